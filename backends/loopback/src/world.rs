//! The mailboxes of a world of threads, and the backend of one rank.
//!
//! Per destination rank: messages that came before their receive (by
//! source and tag, oldest first) and receives posted before their message
//! (in post order). A send fills the first matching posted receive on the
//! sender's thread, or is queued; a receive takes the oldest matching
//! queued message, or is posted. Completions run outside every lock, and
//! never inside another completion on one thread (a completion that posts
//! an op that completes at once would otherwise recurse without bound).

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use weft::backend::progress::{Done, Post, PostParts};
use weft::backend::{Backend, Capabilities, Deadline, GatherSend, OpKind, P2p, ANY_SOURCE};
use weft::{Error, Result};

/// Queued messages of one (source, tag), with their arrival numbers.
type Queue = VecDeque<(u64, Vec<u8>)>;

/// One posted batch: how many of its ops are unfinished, and what to call.
struct Batch {
    left: AtomicUsize,
    deadline: Instant,
    state: Mutex<BatchState>,
}

struct BatchState {
    /// Taken by whoever finishes or fails the batch.
    done: Option<Done>,
    failed: Option<Error>,
    source: Option<Arc<AtomicUsize>>,
}

/// A receive waiting for its message.
struct Waiting {
    batch: Arc<Batch>,
    peer: usize,
    tag: u64,
    buf: *mut u8,
    len: usize,
}

// SAFETY: `buf` is the poster's buffer, valid until its batch's `done`
// has run (`Post`'s contract); it is written only under the destination's
// lock, by whichever thread delivers the message.
unsafe impl Send for Waiting {}

struct Mailbox {
    queued: HashMap<(usize, u64), Queue>,
    posted: Vec<Waiting>,
}

/// Every rank's mailbox.
pub(crate) struct World {
    boxes: Vec<Mutex<Mailbox>>,
    /// Why a rank no longer takes part (it closed its group or aborted):
    /// set before its peers' mailboxes are searched for receives from it,
    /// and read under a mailbox's lock before a receive is posted there,
    /// so no receive from a gone rank stays posted.
    gone: Vec<std::sync::OnceLock<Gone>>,
    /// Bumped (and waiters woken) whenever a batch finishes.
    changes: Mutex<u64>,
    changed: Condvar,
    arrivals: std::sync::atomic::AtomicU64,
}

thread_local! {
    /// Completions left for the outermost caller on this thread to run.
    static DEFERRED: RefCell<VecDeque<(Done, Result<()>)>> = const { RefCell::new(VecDeque::new()) };
    static RUNNING: Cell<bool> = const { Cell::new(false) };
}

/// Run `done(r)` now, unless a completion already runs on this thread:
/// then after it (so that completions never nest).
fn complete(done: Done, r: Result<()>) {
    DEFERRED.with(|q| q.borrow_mut().push_back((done, r)));
    if RUNNING.with(|c| c.replace(true)) {
        return;
    }
    while let Some((done, r)) = DEFERRED.with(|q| q.borrow_mut().pop_front()) {
        done(r);
    }
    RUNNING.with(|c| c.set(false));
}

impl World {
    /// A world of `size` live ranks with empty mailboxes.
    pub(crate) fn new(size: usize) -> World {
        World {
            boxes: (0..size).map(|_| Mutex::new(Mailbox { queued: HashMap::new(), posted: Vec::new() })).collect(),
            gone: (0..size).map(|_| std::sync::OnceLock::new()).collect(),
            changes: Mutex::new(0),
            changed: Condvar::new(),
            arrivals: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn mailbox(&self, rank: usize) -> MutexGuard<'_, Mailbox> {
        self.boxes[rank].lock().unwrap_or_else(|p| p.into_inner())
    }

    fn notify(&self) {
        *self.changes.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.changed.notify_all();
    }

    /// One op of `batch` finished (`Err`: the batch failed); its completion
    /// if that was the last one, or the first failure.
    fn finish_op(batch: &Batch, r: Result<()>) -> Option<(Done, Result<()>)> {
        let mut st = batch.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Err(e) = r {
            st.failed.get_or_insert(e);
            return st.done.take().map(|d| (d, Err(st.failed.clone().expect("just set"))));
        }
        if batch.left.fetch_sub(1, Ordering::AcqRel) == 1 && st.failed.is_none() {
            return st.done.take().map(|d| (d, Ok(())));
        }
        None
    }

    /// Deliver `data` from `src` to `dst` under `tag`: into the first
    /// matching posted receive, else into the queue. The completion of a
    /// receive it finished, if any.
    fn deliver(&self, src: usize, dst: usize, tag: u64, data: &[u8]) -> Result<Option<(Done, Result<()>)>> {
        if self.gone[dst].get().is_some() {
            return Err(self.lost(dst));
        }
        let mut mb = self.mailbox(dst);
        let found = mb.posted.iter().position(|w| w.tag == tag && (w.peer == src || w.peer == ANY_SOURCE));
        let Some(at) = found else {
            if let Some(w) = mb.posted.iter().find(|w| w.peer == src && weft::tag::conflicts(w.tag, tag)) {
                let e = Error::backend(format!(
                    "mismatched ops: peer rank {src} sent {} while rank {dst} waits for {}",
                    OpKind::describe_tag(tag),
                    OpKind::describe_tag(w.tag)
                ));
                let batch = w.batch.clone();
                mb.posted.retain(|x| !Arc::ptr_eq(&x.batch, &batch));
                return Ok(Self::finish_op(&batch, Err(e)));
            }
            let n = self.arrivals.fetch_add(1, Ordering::Relaxed);
            mb.queued.entry((src, tag)).or_default().push_back((n, data.to_vec()));
            return Ok(None);
        };
        let w = mb.posted.remove(at);
        let r = Self::fill(&w, src, dst, data);
        if r.is_err() {
            mb.posted.retain(|x| !Arc::ptr_eq(&x.batch, &w.batch));
        }
        Ok(Self::finish_op(&w.batch, r))
    }

    /// Copy `data` (from `src`) into `w`'s buffer (at `dst`), if the sizes agree.
    fn fill(w: &Waiting, src: usize, dst: usize, data: &[u8]) -> Result<()> {
        if data.len() != w.len {
            return Err(Error::backend(format!(
                "size mismatch: peer rank {src} sent {} bytes, rank {dst} expected {} bytes ({})",
                data.len(),
                w.len,
                OpKind::describe_tag(w.tag)
            )));
        }
        if w.peer == ANY_SOURCE {
            if let Some(cell) = &w.batch.state.lock().unwrap_or_else(|p| p.into_inner()).source {
                cell.store(src, Ordering::Release);
            }
        }
        if w.len > 0 {
            // SAFETY: the receive's buffer, valid until its batch completes
            // (which has not happened: this op is unfinished), written only
            // under this mailbox's lock.
            unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), w.buf, w.len) };
        }
        Ok(())
    }

    /// Take the oldest queued message for a receive of `rank` from `peer`
    /// (or any peer) under `tag`: (source, bytes).
    fn take_queued(mb: &mut Mailbox, peer: usize, tag: u64) -> Option<(usize, Vec<u8>)> {
        let key = if peer == ANY_SOURCE {
            mb.queued.iter().filter(|((_, t), q)| *t == tag && !q.is_empty()).min_by_key(|(_, q)| q[0].0).map(|(k, _)| *k)?
        } else {
            (peer, tag)
        };
        let q = mb.queued.get_mut(&key)?;
        let (_, data) = q.pop_front()?;
        if q.is_empty() {
            mb.queued.remove(&key);
        }
        Some((key.0, data))
    }
}

/// The backend of one rank of a world.
pub(crate) struct LoopbackBackend {
    world: Arc<World>,
    rank: usize,
}

impl LoopbackBackend {
    /// Rank `rank` of `world`.
    pub(crate) fn new(world: Arc<World>, rank: usize) -> Self {
        LoopbackBackend { world, rank }
    }

    /// Post one batch; its completion runs when all its ops are done.
    fn post_batch(
        &self,
        ops: &mut [P2p<'_>],
        gathered: &[GatherSend<'_>],
        deadline: Instant,
        done: Done,
        source: Option<Arc<AtomicUsize>>,
    ) {
        let w = &self.world;
        let total = ops.len() + gathered.len();
        let batch = Arc::new(Batch {
            left: AtomicUsize::new(total.max(1)),
            deadline,
            state: Mutex::new(BatchState { done: Some(done), failed: None, source }),
        });
        if w.gone[self.rank].get().is_some() {
            if let Some((done, r)) = World::finish_op(&batch, Err(w.own_end(self.rank))) {
                complete(done, r);
            }
            return;
        }
        let mut finished = Vec::new();
        if total == 0 {
            finished.extend(World::finish_op(&batch, Ok(())));
        }
        let packed: Vec<Vec<u8>> = gathered
            .iter()
            .map(|g| {
                let mut b = vec![0u8; g.src.len()];
                g.src.fill(0, &mut b);
                b
            })
            .collect();
        // Receives first (in order), so a batch that sends to itself finds them.
        for op in ops.iter_mut() {
            let P2p::Recv { peer, tag, buf } = op else { continue };
            if batch.state.lock().unwrap_or_else(|p| p.into_inner()).failed.is_some() {
                break;
            }
            let mut mb = w.mailbox(self.rank);
            let waiting = Waiting { batch: batch.clone(), peer: *peer, tag: *tag, buf: buf.as_mut_ptr(), len: buf.len() };
            match World::take_queued(&mut mb, *peer, *tag) {
                Some((src, data)) => {
                    let r = World::fill(&waiting, src, self.rank, &data);
                    drop(mb);
                    finished.extend(World::finish_op(&batch, r));
                }
                None if *peer != ANY_SOURCE && w.gone[*peer].get().is_some() => {
                    drop(mb);
                    finished.extend(World::finish_op(&batch, Err(w.lost(*peer))));
                }
                None => mb.posted.push(waiting),
            }
        }
        let sends: Vec<(usize, u64, &[u8])> = ops
            .iter()
            .filter_map(|op| match op {
                P2p::Send { peer, tag, data } => Some((*peer, *tag, &data[..])),
                P2p::Recv { .. } => None,
            })
            .chain(gathered.iter().zip(&packed).map(|(g, b)| (g.peer, g.tag, &b[..])))
            .collect();
        for (peer, tag, data) in sends {
            if batch.state.lock().unwrap_or_else(|p| p.into_inner()).failed.is_some() {
                break;
            }
            let r = w.deliver(self.rank, peer, tag, data);
            match r {
                Ok(filled) => finished.extend(filled),
                Err(e) => {
                    finished.extend(World::finish_op(&batch, Err(e)));
                    continue;
                }
            }
            finished.extend(World::finish_op(&batch, Ok(())));
        }
        if !finished.is_empty() {
            for (done, r) in finished {
                complete(done, r);
            }
            w.notify();
        }
        // A failed batch lets go of its receives still posted.
        if batch.state.lock().unwrap_or_else(|p| p.into_inner()).failed.is_some() {
            w.mailbox(self.rank).posted.retain(|x| !Arc::ptr_eq(&x.batch, &batch));
        }
    }

    /// Fail this rank's posted receives whose batch's deadline has passed,
    /// naming the peer each waits for.
    fn expire(&self, now: Instant) {
        let mut mb = self.world.mailbox(self.rank);
        let Some(w) = mb.posted.iter().find(|w| w.batch.deadline <= now) else { return };
        let batch = w.batch.clone();
        let e = Error::timeout(format!(
            "no message from peer rank {} for {} ({} bytes expected) before the deadline",
            w.peer,
            OpKind::describe_tag(w.tag),
            w.len
        ))
        .stalled_on((w.peer != ANY_SOURCE).then_some(w.peer));
        mb.posted.retain(|x| !Arc::ptr_eq(&x.batch, &batch));
        drop(mb);
        if let Some((done, r)) = World::finish_op(&batch, Err(e)) {
            complete(done, r);
        }
        self.world.notify();
    }

    /// This rank is gone (`why`): its own posted receives fail, its peers'
    /// receives from it with `PeerLost`.
    fn leave(&self, why: Gone) {
        let w = &self.world;
        if w.gone[self.rank].set(why).is_err() {
            return;
        }
        let e = w.own_end(self.rank);
        let mut failed = Vec::new();
        for r in 0..w.boxes.len() {
            let mut mb = w.mailbox(r);
            let gone: Vec<Arc<Batch>> =
                mb.posted.iter().filter(|x| x.peer == self.rank || r == self.rank).map(|x| x.batch.clone()).collect();
            mb.posted.retain(|x| !gone.iter().any(|b| Arc::ptr_eq(b, &x.batch)));
            drop(mb);
            for b in gone {
                failed.extend(World::finish_op(&b, Err(if r == self.rank { e.clone() } else { w.lost(self.rank) })));
            }
        }
        for (done, r) in failed {
            complete(done, r);
        }
        w.notify();
    }
}

impl World {
    /// The error of an op that needs `peer`, which is gone: the root
    /// cause where it aborted after a failure (a lost peer it names is the
    /// one to blame).
    fn lost(&self, peer: usize) -> Error {
        match self.gone[peer].get() {
            Some(Gone::Aborted(e)) => match e.kind() {
                weft::ErrorKind::PeerLost { rank } if *rank != peer => e.clone(),
                _ => Error::peer_lost(peer, format!("peer rank {peer} aborted its group: {e}")),
            },
            _ => Error::peer_left(peer),
        }
    }

    /// The error of an op of `rank` itself after it left.
    fn own_end(&self, rank: usize) -> Error {
        match self.gone[rank].get() {
            Some(Gone::Aborted(e)) => e.clone(),
            _ => Error::aborted(format!("rank {rank} closed its group")),
        }
    }
}

/// Why a rank left.
#[derive(Clone)]
enum Gone {
    /// It closed its group.
    Closed,
    /// It aborted, for this reason (its own or a failure it saw).
    Aborted(Error),
}

/// How often a waiting thread looks at deadlines.
const TICK: Duration = Duration::from_millis(5);

impl Backend for LoopbackBackend {
    fn name(&self) -> &str {
        "loopback"
    }

    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
        self.exchange_gathered(ops, &[], deadline)
    }

    fn exchange_gathered(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: &Deadline) -> Result<()> {
        let slot: Arc<Mutex<Option<Result<()>>>> = Arc::default();
        let mine = slot.clone();
        self.post_batch(ops, gathered, deadline.get(), Box::new(move |r| *mine.lock().unwrap_or_else(|p| p.into_inner()) = Some(r)), None);
        self.progress(&|| slot.lock().unwrap_or_else(|p| p.into_inner()).is_some());
        let r = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
        r.expect("finished or expired")
    }

    fn capabilities(&self) -> &Capabilities {
        static POSTING: Capabilities = Capabilities::POSTING;
        &POSTING
    }

    fn post(&self, post: Post) {
        // SAFETY: the receive buffers are kept as raw pointers (`Waiting`),
        // written only until their op finishes, and `done` runs after the
        // batch's last op has (`World::finish_op`).
        let PostParts { mut ops, gathered, deadline, done, source } = unsafe { post.into_parts() };
        self.post_batch(&mut ops, &gathered, deadline, done, source);
    }

    /// Sends and receives complete on the threads that post them; a waiting
    /// thread only sleeps until something finishes, failing receives of
    /// this rank whose deadline passed.
    fn progress(&self, until: &dyn Fn() -> bool) {
        let w = &self.world;
        loop {
            let seen = *w.changes.lock().unwrap_or_else(|p| p.into_inner());
            if until() {
                return;
            }
            self.expire(Instant::now());
            let g = w.changes.lock().unwrap_or_else(|p| p.into_inner());
            if *g == seen && !until() {
                let _ = w.changed.wait_timeout(g, TICK);
            }
        }
    }

    fn abort(&self, reason: &Error) {
        self.leave(Gone::Aborted(reason.clone()));
    }

    fn shutdown(&self) {
        self.leave(Gone::Closed);
    }
}
