//! The shm backend: one byte ring per ordered pair of ranks inside the
//! group's segment. Progress is driven by the calling thread: an exchange
//! moves its sends and drains every incoming ring in one loop (so two ranks
//! sending to each other never block), spins briefly when nothing moves,
//! then sleeps on its futex doorbell, which peers ring after writing to it
//! or reading from it. Dead peers are found by pid while waiting.

use crate::ring::{footprint, Ring};
use crate::segment::Segment;
use linux_futex::{Futex, Shared};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use weft::backend::{Backend, P2p};
use weft::matching::Inbound;
use weft::{Error, Result};

const RUNNING: u32 = 0;
const CLOSED: u32 = 1;
const ABORTED: u32 = 2;
/// Frame header: tag and length.
const HEADER: usize = 16;
/// Spin this long without progress before sleeping.
const SPIN: Duration = Duration::from_micros(30);
/// Sleep at most this long before re-checking peers' liveness.
const NAP: Duration = Duration::from_millis(20);

/// Per-rank control block in the segment.
#[repr(C, align(64))]
pub struct Control {
    pid: AtomicU32,
    state: AtomicU32,
    doorbell: Futex<Shared>,
    sleeping: AtomicU32,
    /// After an abort: 1 + the rank this rank blames (0: itself).
    blame: AtomicU32,
}

/// Shared memory a group may use for its rings, at most. The segment is
/// reserved up front (no SIGBUS later), so this is real memory per group:
/// kept modest for programs with many sub-groups.
const BUDGET: usize = 16 << 20;

/// Data bytes per ring for `w` ranks when `avail` bytes of /dev/shm are
/// free: a power of two in [16 KiB, 8 MiB], rings taking at most
/// min(BUDGET, avail / 4) in all. Larger rings keep big transfers streaming.
pub fn ring_cap(w: usize, avail: usize) -> usize {
    let budget = BUDGET.min(avail / 4);
    let per = budget / (w * w).max(1);
    let cap = if per.is_power_of_two() { per } else { per.next_power_of_two() / 2 };
    cap.clamp(16 << 10, 8 << 20)
}

/// Segment size for `w` ranks with rings of `cap` bytes.
pub fn segment_len(w: usize, cap: usize) -> usize {
    w * std::mem::size_of::<Control>() + w * w * footprint(cap)
}

/// One peer's inbound state: a partly read header, and the matching state.
#[derive(Default)]
struct PeerIn {
    hdr: [u8; HEADER],
    hdr_got: usize,
    inbound: Inbound,
}

pub struct ShmBackend {
    rank: usize,
    size: usize,
    seg: Segment,
    rings: Vec<Ring>,
    incoming: Mutex<Vec<PeerIn>>,
    failed: Mutex<Option<Error>>,
}

impl ShmBackend {
    /// Wrap a mapped segment of `size` ranks with rings of `cap` bytes
    /// (zeroed by its creator).
    pub fn new(rank: usize, size: usize, seg: Segment, cap: usize) -> Self {
        let ctl = size * std::mem::size_of::<Control>();
        assert!(seg.len() >= segment_len(size, cap), "segment sized by segment_len");
        let rings = (0..size * size)
            // SAFETY: ring i lies inside the segment (segment_len), is
            // 64-byte aligned (Control and footprint are multiples of 64),
            // and ring src*W+dst has one producer (src) and one consumer (dst).
            .map(|i| unsafe { Ring::at(seg.base().add(ctl + i * footprint(cap)), cap) })
            .collect();
        let b = ShmBackend {
            rank,
            size,
            seg,
            rings,
            incoming: Mutex::new((0..size).map(|_| PeerIn::default()).collect()),
            failed: Mutex::new(None),
        };
        b.control(rank).pid.store(std::process::id(), Ordering::Release);
        b
    }

    fn control(&self, r: usize) -> &Control {
        // SAFETY: the control blocks open the segment, one per rank, and
        // are only touched through atomics.
        unsafe { &*(self.seg.base() as *const Control).add(r) }
    }

    fn ring(&self, src: usize, dst: usize) -> &Ring {
        &self.rings[src * self.size + dst]
    }

    fn wake(&self, r: usize) {
        let c = self.control(r);
        c.doorbell.value.fetch_add(1, Ordering::SeqCst);
        if c.sleeping.load(Ordering::SeqCst) != 0 {
            c.doorbell.wake(1);
        }
    }

    fn fail(&self, e: Error) -> Error {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e).clone()
    }

    /// Why `peer` can no longer take part, if it cannot.
    fn peer_problem(&self, peer: usize) -> Option<Error> {
        let c = self.control(peer);
        match c.state.load(Ordering::Acquire) {
            ABORTED => {
                // Report the root cause the aborting rank recorded, so every
                // rank blames the same peer.
                let blame = c.blame.load(Ordering::Acquire) as usize;
                return Some(match blame {
                    b if b > 0 && b - 1 != self.rank => {
                        Error::peer_lost(b - 1, format!("peer rank {} lost (reported by rank {peer})", b - 1))
                    }
                    _ => Error::peer_lost(peer, format!("peer rank {peer} aborted its group")),
                });
            }
            CLOSED => return Some(Error::peer_lost(peer, format!("peer rank {peer} left the group (its process group was closed)"))),
            _ => {}
        }
        let pid = c.pid.load(Ordering::Acquire);
        if pid != 0 && nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None) == Err(nix::errno::Errno::ESRCH) {
            return Some(Error::peer_lost(peer, format!("peer rank {peer} (pid {pid}) died")));
        }
        None
    }

    fn check_failed(&self) -> Result<()> {
        match &*self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

impl Backend for ShmBackend {
    fn name(&self) -> &str {
        "shm"
    }

    fn exchange(&self, ops: &mut [P2p<'_>], deadline: Instant) -> Result<()> {
        self.check_failed()?;
        for op in ops.iter() {
            if op.peer() >= self.size || op.peer() == self.rank {
                return Err(Error::invalid(format!("shm: bad peer rank {}", op.peer())));
            }
        }
        let mut incoming = self.incoming.lock().unwrap_or_else(|p| p.into_inner());
        let n = ops.len();
        let mut done = vec![false; n];
        let mut sent = vec![0usize; n];
        // Receives first served by messages that arrived earlier.
        for (i, op) in ops.iter_mut().enumerate() {
            if let P2p::Recv { peer, tag, buf } = op {
                done[i] = incoming[*peer].inbound.serve_early(self.rank, *peer, *tag, buf).map_err(|e| self.fail(e))?;
            }
        }
        let result = self.progress(ops, &mut incoming, &mut done, &mut sent, deadline);
        if result.is_err() {
            for p in incoming.iter_mut() {
                p.inbound.detach(ops);
            }
        }
        result
    }

    fn abort(&self, reason: &Error) {
        self.fail(reason.clone());
        let me = self.control(self.rank);
        if let weft::ErrorKind::PeerLost { rank } = reason.kind() {
            me.blame.store(*rank as u32 + 1, Ordering::Release);
        }
        me.state.store(ABORTED, Ordering::Release);
        for r in 0..self.size {
            self.wake(r);
        }
    }

    fn shutdown(&self) {
        let c = self.control(self.rank);
        let _ = c.state.compare_exchange(RUNNING, CLOSED, Ordering::AcqRel, Ordering::Acquire);
        for r in 0..self.size {
            self.wake(r);
        }
    }
}

impl ShmBackend {
    fn progress(
        &self,
        ops: &mut [P2p<'_>],
        incoming: &mut [PeerIn],
        done: &mut [bool],
        sent: &mut [usize],
        deadline: Instant,
    ) -> Result<()> {
        let (me, w) = (self.rank, self.size);
        let mut idle_since = Instant::now();
        let mut last_check = Instant::now();
        let mut busy = vec![false; w];
        loop {
            let mut moved = false;
            // Sends: the first unfinished send to each peer streams into its ring.
            busy.fill(false);
            for i in 0..ops.len() {
                let P2p::Send { peer, tag, data } = &ops[i] else { continue };
                if done[i] || busy[*peer] {
                    continue;
                }
                busy[*peer] = true;
                let ring = self.ring(me, *peer);
                let mut header = [0u8; HEADER];
                header[..8].copy_from_slice(&tag.to_le_bytes());
                header[8..].copy_from_slice(&(data.len() as u64).to_le_bytes());
                let before = sent[i];
                if sent[i] < HEADER {
                    sent[i] += ring.write(&header[sent[i]..]);
                }
                if sent[i] >= HEADER {
                    sent[i] += ring.write(&data[sent[i] - HEADER..]);
                }
                if sent[i] != before {
                    moved = true;
                    self.wake(*peer);
                }
                if sent[i] == HEADER + data.len() {
                    done[i] = true;
                    busy[*peer] = false;
                }
            }
            // Receives: drain every incoming ring, matching or stashing frames.
            for peer in (0..w).filter(|p| *p != me) {
                if self.drain(peer, ops, incoming, done)? {
                    moved = true;
                    self.wake(peer);
                }
            }
            if done.iter().all(|d| *d) {
                return Ok(());
            }
            let now = Instant::now();
            if moved {
                idle_since = now;
                continue;
            }
            // Nothing moved: check why, then spin or sleep.
            self.check_failed()?;
            if now.duration_since(last_check) >= NAP || now >= deadline {
                last_check = now;
                for i in (0..ops.len()).filter(|i| !done[*i]) {
                    let peer = ops[i].peer();
                    let drained = matches!(ops[i], P2p::Send { .. }) || self.ring(peer, me).available() == 0;
                    if let (true, Some(e)) = (drained, self.peer_problem(peer)) {
                        return Err(self.fail(e));
                    }
                }
            }
            if now >= deadline {
                let pending: Vec<String> = (0..ops.len())
                    .filter(|i| !done[*i])
                    .map(|i| {
                        format!(
                            "{} peer rank {}",
                            if matches!(ops[i], P2p::Send { .. }) { "send to" } else { "receive from" },
                            ops[i].peer()
                        )
                    })
                    .collect();
                let e = Error::timeout(format!("shm: {} not finished before the deadline", pending.join(", ")));
                if sent.iter().zip(ops.iter()).any(|(s, op)| matches!(op, P2p::Send { data, .. } if *s > 0 && *s < HEADER + data.len())) {
                    // Half a frame sits in a ring: the stream cannot be trusted again.
                    return Err(self.fail(e));
                }
                return Err(e);
            }
            if now.duration_since(idle_since) < SPIN {
                std::thread::yield_now();
                continue;
            }
            let ctl = self.control(me);
            let seen = ctl.doorbell.value.load(Ordering::SeqCst);
            ctl.sleeping.store(1, Ordering::SeqCst);
            let ready = (0..w).any(|p| p != me && self.ring(p, me).available() > 0);
            if !ready {
                let _ = ctl.doorbell.wait_for(seen, NAP.min(deadline.saturating_duration_since(now)));
            }
            ctl.sleeping.store(0, Ordering::SeqCst);
        }
    }

    /// Read what `peer` has written to us; true if any byte moved.
    fn drain(&self, peer: usize, ops: &mut [P2p<'_>], incoming: &mut [PeerIn], done: &mut [bool]) -> Result<bool> {
        let ring = self.ring(peer, self.rank);
        let st = &mut incoming[peer];
        let mut moved = false;
        loop {
            if !st.inbound.in_frame() {
                let n = ring.read(&mut st.hdr[st.hdr_got..]);
                if n == 0 {
                    return Ok(moved);
                }
                moved = true;
                st.hdr_got += n;
                if st.hdr_got < HEADER {
                    return Ok(moved);
                }
                st.hdr_got = 0;
                let tag = u64::from_le_bytes(st.hdr[..8].try_into().expect("8 bytes"));
                let len = u64::from_le_bytes(st.hdr[8..].try_into().expect("8 bytes")) as usize;
                st.inbound.begin(self.rank, peer, tag, len, ops, done).map_err(|e| self.fail(e))?;
            }
            let dst = st.inbound.payload(ops);
            if !dst.is_empty() {
                let n = ring.read(dst);
                if n == 0 {
                    return Ok(moved);
                }
                st.inbound.advance(n);
                moved = true;
            }
            st.inbound.finish(self.rank, peer, ops, done).map_err(|e| self.fail(e))?;
        }
    }
}
