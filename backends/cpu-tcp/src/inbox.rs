//! Matching received messages with posted receives, for all peers of one
//! transport. Pure bookkeeping: no sockets here.
//!
//! A receive is posted with a raw pointer to the caller's buffer; the reader
//! thread of the peer either copies a stashed (unexpected) message into it,
//! or claims it and reads the payload straight from the socket into it. The
//! poster never returns while a reader is writing into its buffer (state
//! `Reading`), which is what makes handing out the pointer sound.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Instant;
use weft::backend::OpKind;
use weft::{Error, Result};

/// A pointer to a posted receive buffer.
#[derive(Copy, Clone)]
pub struct RawBuf {
    pub ptr: *mut u8,
    pub len: usize,
}
// SAFETY: the pointer is only dereferenced by the one reader that claimed
// the receive, while its poster waits (see the module doc).
unsafe impl Send for RawBuf {}

enum State {
    Posted,
    Reading,
    Done(Result<()>),
}

struct Posted {
    peer: usize,
    tag: u64,
    buf: RawBuf,
    deadline: Instant,
    state: State,
}

#[derive(Default)]
struct PeerBox {
    closed: Option<Error>,
    posted: HashMap<u64, VecDeque<u64>>,
    stash: HashMap<u64, VecDeque<Vec<u8>>>,
}

struct Inner {
    failed: Option<Error>,
    peers: Vec<PeerBox>,
    recvs: HashMap<u64, Posted>,
    next_id: u64,
}

/// What the reader should do with a frame's payload.
pub enum Claim {
    /// Read it into this receive's buffer, then call `complete`.
    Into(u64, RawBuf, Instant),
    /// Read it into a new buffer and `stash` it.
    Stash,
    /// Read it and throw it away (a receive was failed instead).
    Discard,
}

pub struct Inbox {
    me: usize,
    inner: Mutex<Inner>,
    changed: Condvar,
    /// Bumped on every completion, so a spinning waiter can poll it without the lock.
    generation: AtomicU64,
}

/// How long a waiter spins in total before sleeping, and per check of its receives.
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);
const SPIN_SLICE: std::time::Duration = std::time::Duration::from_micros(5);

impl Inbox {
    pub fn new(me: usize, size: usize) -> Self {
        Inbox {
            me,
            inner: Mutex::new(Inner {
                failed: None,
                peers: (0..size).map(|_| PeerBox::default()).collect(),
                recvs: HashMap::new(),
                next_id: 0,
            }),
            changed: Condvar::new(),
            generation: AtomicU64::new(0),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The error that makes ops with `peer` fail, if any.
    pub fn check(&self, peer: usize) -> Result<()> {
        let g = self.lock();
        match (&g.failed, &g.peers[peer].closed) {
            (Some(e), _) | (None, Some(e)) => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// Whether `peer` itself has left or its stream broke (ignoring a
    /// group-wide failure).
    pub fn peer_gone(&self, peer: usize) -> bool {
        self.lock().peers[peer].closed.is_some()
    }

    /// Post a receive of exactly `buf.len` bytes; returns its id.
    pub fn post(&self, peer: usize, tag: u64, buf: RawBuf, deadline: Instant) -> u64 {
        let mut g = self.lock();
        let id = g.next_id;
        g.next_id += 1;
        // A stashed message of another collective at the same sequence
        // number means the ranks disagree on the op: fail now, not at the
        // deadline (the arrival-time check only sees receives posted before).
        if let Some(other) = g.peers[peer].stash.iter().find(|(t, q)| !q.is_empty() && weft::tag::conflicts(**t, tag)).map(|(t, _)| *t) {
            let e = Error::backend(format!(
                "collective mismatch: peer rank {peer} sent a message for {} while this rank waits in {}",
                OpKind::describe_tag(other),
                OpKind::describe_tag(tag)
            ));
            g.recvs.insert(id, Posted { peer, tag, buf, deadline, state: State::Done(Err(e)) });
            return id;
        }
        // A message that arrived before the peer said goodbye is still
        // delivered; a group-wide failure wins over everything.
        let stashed = g.peers[peer].stash.get_mut(&tag).and_then(VecDeque::pop_front);
        let state = match (g.failed.clone(), stashed, g.peers[peer].closed.clone()) {
            (Some(e), _, _) => State::Done(Err(e)),
            (None, Some(msg), _) => State::Done(copy_into(buf, &msg, self.me, peer, tag)),
            (None, None, Some(e)) => State::Done(Err(e)),
            (None, None, None) => {
                g.peers[peer].posted.entry(tag).or_default().push_back(id);
                State::Posted
            }
        };
        g.recvs.insert(id, Posted { peer, tag, buf, deadline, state });
        id
    }

    /// A `len`-byte frame with `tag` arrived from `peer`: who gets it?
    pub fn claim(&self, peer: usize, tag: u64, len: usize) -> Claim {
        let mut g = self.lock();
        let Some(id) = g.peers[peer].posted.get_mut(&tag).and_then(VecDeque::pop_front) else {
            // A receive waiting in another collective at the same sequence
            // number means the ranks disagree on the op: fail it now.
            let conflicting: Vec<u64> = g
                .recvs
                .iter()
                .filter(|(_, r)| r.peer == peer && matches!(r.state, State::Posted) && weft::tag::conflicts(r.tag, tag))
                .map(|(id, _)| *id)
                .collect();
            for id in conflicting {
                let mine = g.recvs[&id].tag;
                let e = Error::backend(format!(
                    "collective mismatch: peer rank {peer} sent a message for {} while this rank waits in {}",
                    OpKind::describe_tag(tag),
                    OpKind::describe_tag(mine)
                ));
                self.finish(&mut g, id, Err(e));
            }
            return Claim::Stash;
        };
        let r = g.recvs.get_mut(&id).expect("posted ids are live");
        if r.buf.len != len {
            let e = Error::backend(format!(
                "size mismatch: peer rank {peer} sent {len} bytes, rank {} expected {} bytes ({})",
                self.me,
                r.buf.len,
                OpKind::describe_tag(tag)
            ));
            self.finish(&mut g, id, Err(e));
            return Claim::Discard;
        }
        r.state = State::Reading;
        Claim::Into(id, r.buf, r.deadline)
    }

    /// A claimed receive finished (or failed) reading.
    pub fn complete(&self, id: u64, result: Result<()>) {
        let mut g = self.lock();
        self.finish(&mut g, id, result);
    }

    /// An unexpected message was read in full; deliver or keep it.
    pub fn stash(&self, peer: usize, tag: u64, msg: Vec<u8>) {
        let mut g = self.lock();
        match g.peers[peer].posted.get_mut(&tag).and_then(VecDeque::pop_front) {
            Some(id) => {
                let buf = g.recvs[&id].buf;
                self.finish(&mut g, id, copy_into(buf, &msg, self.me, peer, tag));
            }
            None => g.peers[peer].stash.entry(tag).or_default().push_back(msg),
        }
    }

    /// Ops with `peer` fail with `e` from now on (it left, or its stream broke).
    pub fn fail_peer(&self, peer: usize, e: Error) {
        let mut g = self.lock();
        g.peers[peer].closed.get_or_insert(e.clone());
        let ids: Vec<u64> = g.recvs.iter().filter(|(_, r)| r.peer == peer && matches!(r.state, State::Posted)).map(|(id, _)| *id).collect();
        for id in ids {
            self.finish(&mut g, id, Err(e.clone()));
        }
    }

    /// Every op fails with `e` from now on (the first such error is kept).
    pub fn fail_all(&self, e: Error) {
        let mut g = self.lock();
        g.failed.get_or_insert(e);
        let e = g.failed.clone().expect("just set");
        let ids: Vec<u64> = g.recvs.iter().filter(|(_, r)| matches!(r.state, State::Posted)).map(|(id, _)| *id).collect();
        for id in ids {
            self.finish(&mut g, id, Err(e.clone()));
        }
    }

    /// Whether anything completed since `seen` (checked without the lock).
    fn any_change(&self, seen: u64) -> bool {
        self.generation.load(Ordering::Acquire) != seen
    }

    fn finish(&self, g: &mut Inner, id: u64, result: Result<()>) {
        if let Some(r) = g.recvs.get_mut(&id) {
            if matches!(r.state, State::Posted) {
                if let Some(q) = g.peers[r.peer].posted.get_mut(&r.tag) {
                    q.retain(|x| *x != id);
                }
            }
            r.state = State::Done(result);
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_all();
    }

    /// Wait for every receive in `ids` (removing them); the first error wins.
    /// At `deadline`, receives not yet being read are cancelled with a
    /// timeout; one being read is waited for (its reader ends by the same
    /// deadline).
    pub fn wait(&self, ids: &[u64], deadline: Instant) -> Result<()> {
        let mut spun = std::time::Duration::ZERO;
        let mut g = self.lock();
        loop {
            let seen = self.generation.load(Ordering::Acquire);
            let now = Instant::now();
            if now >= deadline {
                let late: Vec<u64> = ids.iter().copied().filter(|id| matches!(g.recvs[id].state, State::Posted)).collect();
                for id in late {
                    let r = &g.recvs[&id];
                    let e = Error::timeout(format!(
                        "no message from peer rank {} for {} ({} bytes expected) before the deadline",
                        r.peer,
                        OpKind::describe_tag(r.tag),
                        r.buf.len
                    ));
                    self.finish(&mut g, id, Err(e));
                }
            }
            if ids.iter().all(|id| matches!(g.recvs[id].state, State::Done(_))) {
                let mut first = Ok(());
                for id in ids {
                    if let Some(Posted { state: State::Done(Err(e)), .. }) = g.recvs.remove(id) {
                        if first.is_ok() {
                            first = Err(e);
                        }
                    }
                }
                return first;
            }
            // Spin briefly before sleeping: a small message usually lands
            // within microseconds, and waking a sleeping thread costs tens
            // of them. Yielding lets the reader thread run on a busy core.
            if spun < SPIN {
                drop(g);
                let t = std::time::Instant::now();
                while t.elapsed() < SPIN_SLICE && !self.any_change(seen) {
                    std::thread::yield_now();
                }
                spun += t.elapsed();
                g = self.lock();
                continue;
            }
            let wait = deadline.saturating_duration_since(now).max(std::time::Duration::from_millis(1));
            g = self.changed.wait_timeout(g, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Cancel receives after a failed send: like `wait` with a deadline now.
    pub fn cancel(&self, ids: &[u64]) {
        let _ = self.wait(ids, Instant::now());
    }
}

fn copy_into(buf: RawBuf, msg: &[u8], me: usize, peer: usize, tag: u64) -> Result<()> {
    if msg.len() != buf.len {
        return Err(Error::backend(format!(
            "size mismatch: peer rank {peer} sent {} bytes, rank {me} expected {} bytes ({})",
            msg.len(),
            buf.len,
            OpKind::describe_tag(tag)
        )));
    }
    // SAFETY: the receive is posted (its poster waits and the buffer holds
    // buf.len bytes); `msg` is a separate allocation.
    unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), buf.ptr, buf.len) };
    Ok(())
}
