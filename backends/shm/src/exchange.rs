//! Point-to-point exchanges over the rings: an exchange's progress loop
//! streams each send into its peer's ring as framed bytes (tag, length,
//! payload) and drains every incoming ring into the matching receives, in
//! one loop, so two ranks sending to each other never block. Large
//! payloads may go single-copy instead (each exchange's plan says which
//! scheme, `cma/scheme.rs`, else the backend's `cma::Policy`): the frame
//! carries a descriptor, and the receiver reads (or the sender pushes) the
//! bytes straight between the two processes' buffers (`cma/`: the copies
//! in `mod.rs`, the offers in `offers.rs`). What finishes at once skips
//! the table (`direct.rs`).

use crate::cma;
use crate::cma::scheme::{Key, Plan, Scheme};
use crate::posted::{Engine, OpState, Peer, CMA_FLAG, HEADER};
use crate::ring::Ring;
use crate::state::{ShmBackend, CMA_SPIN, NAP, PAUSE_SPIN, SPIN, TURNS_PER_CLOCK};
use smallvec::{smallvec, SmallVec};
use std::time::{Duration, Instant};
use weft::backend::matching::{self, Early};
use weft::backend::progress::{Columns, Post, Posting, Table, View};
use weft::backend::{Backend, Deadline, Gather, GatherSend, P2p, ANY_SOURCE};
use weft::{Error, Result};

/// Messages at least this long are read out of the ring with stores that
/// go past the receiving core's caches (`Ring::read_to_memory`): their
/// destination cannot stay in cache, and streaming skips reading each of
/// its lines first. Shorter ones keep cached stores: messages of 4 and
/// 8 MiB, whose buffers stay in the L3 from one op to the next, were slower
/// streamed (figures: bench/RESULTS.md, twelfth session).
const TO_MEMORY_BYTES: usize = 16 << 20;

/// After a failure, how long a peer copying to or from this rank's buffers
/// gets to finish before they go back to the caller anyway (a running one
/// needs well under a millisecond; a stopped one may never finish).
pub(crate) const CANCEL_GRACE: Duration = Duration::from_millis(500);

/// The tag of a padding frame ([`Ring::rewind`](crate::ring::Ring::rewind)):
/// a transport's own frame in `weft::tag`'s layout (bit 61 alone of the
/// top three), which no user, collective or window tag is.
const PADDING: u64 = 1 << 61;
/// Frames from this size on start at their ring's start when it is empty
/// (`rewind`): large enough that a padding frame costs nothing next to
/// the copy.
const REWIND_MIN: usize = 16 << 10;

/// What a send of an exchange sends: bytes in one buffer (which may go
/// single-copy), or gathered bytes (always inline: written into the ring
/// as they are gathered).
#[derive(Clone, Copy)]
enum Out<'a> {
    Bytes(&'a [u8]),
    Gathered(&'a dyn Gather),
}

impl Out<'_> {
    fn len(&self) -> usize {
        match self {
            Out::Bytes(data) => data.len(),
            Out::Gathered(g) => g.len(),
        }
    }
}

/// How many of `ops` are sends.
pub(crate) fn sends(ops: &[P2p<'_>]) -> usize {
    ops.iter().filter(|op| matches!(op, P2p::Send { .. })).count()
}

/// Send `i` of the table: peer, tag and what it sends; `None` for a
/// receive.
fn send_of<'a>(ops: &'a [P2p<'_>], gathered: &[Option<&'a dyn Gather>], i: usize) -> Option<(usize, u64, Out<'a>)> {
    match (&ops[i], gathered[i]) {
        (P2p::Send { peer, tag, .. }, Some(g)) => Some((*peer, *tag, Out::Gathered(g))),
        (P2p::Send { peer, tag, data }, None) => Some((*peer, *tag, Out::Bytes(data))),
        (P2p::Recv { .. }, _) => None,
    }
}

/// A batch's plan (see `ShmBackend::plan`).
struct Batch {
    plan: Option<Plan>,
    rule: Option<Scheme>,
    weighed: bool,
    /// It sends messages of its key and receives none: a weighed time then
    /// runs until the receivers have taken every byte (`drained`).
    one_way: bool,
}

/// The scheme `plan` gives `op`: sends of its key (others take the rule).
pub(crate) fn planned(plan: Option<Plan>, op: &P2p<'_>) -> Option<Scheme> {
    let plan = plan?;
    match op {
        P2p::Send { tag, data, .. } if Key::of(*tag, data.len()) == Some(plan.key) => Some(plan.scheme),
        _ => None,
    }
}

/// The frame prefix of an inline send: tag and length.
pub(crate) fn plain_header(tag: u64, len: usize) -> ([u8; HEADER + cma::DESCRIPTOR], usize) {
    let mut p = [0u8; HEADER + cma::DESCRIPTOR];
    p[..8].copy_from_slice(&tag.to_le_bytes());
    p[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    (p, HEADER)
}

/// Start an inline frame (`header` and `payload` bytes) at `ring`'s start if
/// the ring is empty and the payload large (`Ring::rewind`), where its exchange
/// sends more than one message (`several`, asked only then): an all_to_all's
/// frames then land where their rings' last ones did, instead of walking every
/// ring through, which sends them to memory (figures: bench/RESULTS.md,
/// "Measurements behind code comments"). Not for one message: a pipeline's
/// segments would then overwrite lines its receiver has just read, where
/// walking on finds lines no core holds (W=4 4 MiB all_reduce and broadcast,
/// every frame rewound: 15 % slower).
pub(crate) fn rewind(ring: &Ring, header: usize, payload: usize, several: impl FnOnce() -> bool) {
    if payload >= REWIND_MIN && several() {
        let pad = |n| plain_header(PADDING, n).0[..HEADER].try_into().expect("a header");
        ring.rewind::<HEADER>(header + payload, pad);
    }
}

/// If the next frame in `ring` is (well-formed) padding, skip it; whether
/// it was. A lone receive's quick path looks for its own frame after it.
pub(crate) fn skip_padding(ring: &Ring) -> bool {
    let mut header = [0u8; HEADER];
    if ring.peek(&mut header) < HEADER || header[..8] != PADDING.to_le_bytes() {
        return false;
    }
    let len = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    ring.skip_to_start((len as usize).saturating_add(HEADER))
}

/// What a turn of the table did with its sends to one peer.
#[derive(Clone, Copy, PartialEq, Eq)]
enum PeerSend {
    /// No send to it yet, or the last one finished: the next may go.
    Free,
    /// A send to it is under way (sends to one peer go in order).
    Busy,
    /// And found its ring full: room made there is worth waking for.
    Full,
}

#[cold]
fn bad_peer(p: usize) -> Error {
    Error::invalid(format!("shm: bad peer rank {p}"))
}

impl ShmBackend {
    /// Why a batch cannot run: a bad peer rank (a receive may name any).
    #[inline]
    fn refuse<'o>(&self, ops: impl Iterator<Item = &'o P2p<'o>>, gathered: &[GatherSend<'_>]) -> Option<Error> {
        let bad = |p: usize| p >= self.size || p == self.rank;
        for op in ops {
            match *op {
                P2p::Recv { peer: ANY_SOURCE, .. } => {}
                ref op if bad(op.peer()) => return Some(bad_peer(op.peer())),
                _ => {}
            }
        }
        gathered.iter().map(|g| g.peer).find(|&p| bad(p)).map(bad_peer)
    }

    /// Take a posted batch into the table; a batch naming a bad peer fails
    /// alone.
    fn absorb(&self, eng: &mut Engine, post: Post, posting: &Posting) -> Result<()> {
        if let Some(e) = self.refuse(post.ops().iter(), post.gathered()) {
            post.fail(e);
            posting.notify();
            return Ok(());
        }
        // Planned (and counted) as a batch the calling thread runs is: a
        // rank's count of a key must not depend on which thread ran it.
        let plan = self.plan(eng, post.ops()).plan;
        let first = eng.table.len();
        eng.table.add(post, |op, _| OpState { scheme: planned(plan, op), ..OpState::default() });
        self.start(eng, first)
    }

    /// The ops from `first` on are new: receives are first served by
    /// messages that arrived earlier.
    fn start(&self, eng: &mut Engine, first: usize) -> Result<()> {
        // SAFETY: receives are filled and bound here; no op is put in.
        let Columns { ops, done, .. } = unsafe { eng.table.columns() };
        for (i, op) in ops.iter_mut().enumerate().skip(first) {
            let P2p::Recv { peer, tag, buf } = op else { continue };
            if *peer != ANY_SOURCE {
                done[i] = eng.peers[*peer].inbound.serve_early(self.rank, *peer, *tag, buf).map_err(|e| self.fail(e))? == Early::Served;
                continue;
            }
            // From any rank: the first peer with a message of this tag;
            // else the first that comes (`drain`).
            for q in (0..self.size).filter(|&q| q != self.rank) {
                if eng.peers[q].inbound.serve_early(self.rank, q, *tag, buf).map_err(|e| self.fail(e))? == Early::Served {
                    done[i] = true;
                    *peer = q;
                    break;
                }
            }
        }
        Ok(())
    }

    /// Run `ops` and the `gathered` sends as the driving thread's own
    /// batch, after the batches posted before it, driving everything until
    /// it has finished. Its large sends take the scheme its plan gives
    /// them (`cma/scheme.rs`), and the decider times it.
    pub(crate) fn exchange_now(
        &self,
        eng: &mut Engine,
        posting: &Posting,
        ops: &mut [P2p<'_>],
        gathered: &[GatherSend<'_>],
        deadline: &Deadline,
    ) -> Result<()> {
        if let Err(e) = self.check_failed().and_then(|()| posting.take(|post| self.absorb(eng, post, posting)).map(|_| ())) {
            self.fail_all(eng, posting, e.clone());
            return Err(e);
        }
        if let Some(e) = self.refuse(ops.iter(), gathered) {
            return Err(e);
        }
        let Batch { plan, rule, weighed, one_way } = self.plan(eng, ops);
        let timed = (weighed && eng.chooser.decides()).then(Instant::now);
        // With nothing else posted, what can finish at once skips the table
        // (`direct`). A receive from any rank binds its op to the sender: it
        // keeps the batch whole.
        let any_source = ops.iter().any(|op| matches!(op, P2p::Recv { peer: ANY_SOURCE, .. }));
        let r = if gathered.is_empty() && eng.table.is_idle() && ops.len() <= 64 && !any_source {
            self.exchange_direct(eng, posting, ops, deadline, plan)
        } else {
            self.exchange_in_table(eng, posting, ops, gathered, deadline, plan)
        };
        if let (Ok(()), Some(start), Some(plan)) = (&r, timed, plan) {
            let ended = if one_way && plan.weighed_soon() { self.drained(ops, plan.key, start) } else { Some(start.elapsed()) };
            match ended {
                None => eng.chooser.missed(plan),
                Some(t) => {
                    if let Some(c) = eng.chooser.record(&self.schemes(), plan, t.as_nanos() as u64, rule) {
                        weft::log::debug(format_args!("shm: {c}"));
                    }
                }
            }
        }
        r
    }

    /// How long from `start` until the peers `ops` sent messages of `key`
    /// to had read everything this rank wrote into their rings: a send alone through the ring ends once its
    /// bytes are in the ring, before its receiver has copied them, so its
    /// own time would flatter the ring (single-copy sends end once the
    /// receiver has the bytes). Waits at most as long again as the
    /// exchange took (at least 50 µs); `None` (the time is not weighed)
    /// where a receiver has not come by then.
    fn drained(&self, ops: &[P2p<'_>], key: Key, start: Instant) -> Option<std::time::Duration> {
        let peers = ops.iter().filter_map(|op| match op {
            P2p::Send { peer, tag, data } if Key::of(*tag, data.len()) == Some(key) => Some(*peer),
            _ => None,
        });
        let waits = Instant::now();
        let until = start + start.elapsed().max(std::time::Duration::from_micros(50)) * 2;
        loop {
            if peers.clone().all(|p| self.ring(self.rank, p).drained()) {
                return Some(start.elapsed());
            }
            let now = Instant::now();
            if now >= until {
                return None;
            }
            // Spinning keeps a short wait exact; past 20 µs the receiver
            // may need this core (more ranks than cores).
            if now - waits < std::time::Duration::from_micros(20) {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// The plan of a batch, where adapting and it has a message large
    /// enough to choose (the key of its largest message, this rank's
    /// exchange of that key, its scheme); how the rule would send it; and
    /// whether its time may be weighed (it sends messages of the key:
    /// see `cma/scheme.rs`), and whether it only sends them (its receivers
    /// are then waited for before it is weighed).
    fn plan(&self, eng: &mut Engine, ops: &[P2p<'_>]) -> Batch {
        let none = Batch { plan: None, rule: None, weighed: false, one_way: false };
        if !self.adapt {
            return none;
        }
        let largest = ops
            .iter()
            .map(|op| match op {
                P2p::Send { tag, data, .. } => (*tag, data.len()),
                P2p::Recv { tag, buf, .. } => (*tag, buf.len()),
            })
            .max_by_key(|(_, len)| *len);
        let Some(key) = largest.and_then(|(tag, len)| Key::of(tag, len)) else { return none };
        let receiving = ops.iter().any(|op| matches!(op, P2p::Recv { buf, .. } if buf.len() >= cma::MIN_BYTES));
        let rule = ops.iter().find_map(|op| match op {
            P2p::Send { peer, tag, data } if Key::of(*tag, data.len()) == Some(key) => {
                Some(self.rule(data.len(), *tag, &eng.peers[*peer], receiving))
            }
            _ => None,
        });
        let receives_key = ops.iter().any(|op| matches!(op, P2p::Recv { tag, buf, .. } if Key::of(*tag, buf.len()) == Some(key)));
        let plan = eng.chooser.plan(&self.schemes(), key, rule);
        Batch { plan, rule, weighed: plan.is_some() && rule.is_some(), one_way: !receives_key }
    }

    /// [`Self::exchange_now`] through the table: the batch is added, and
    /// everything driven until it has finished.
    pub(crate) fn exchange_in_table(
        &self,
        eng: &mut Engine,
        posting: &Posting,
        ops: &mut [P2p<'_>],
        gathered: &[GatherSend<'_>],
        deadline: &Deadline,
        plan: Option<Plan>,
    ) -> Result<()> {
        let first = eng.table.len();
        // SAFETY: this returns only once the batch's outcome is in, and its
        // ops have then left the table (`settle`, `expire` and
        // `fail_all` remove finished ops); `deadline` is the
        // caller's, borrowed as long.
        unsafe { eng.table.add_local(ops, gathered, deadline, |op, _| OpState { scheme: planned(plan, op), ..OpState::default() }) };
        match self.start(eng, first) {
            Err(e) => self.fail_all(eng, posting, e),
            Ok(()) => self.drive(eng, posting, true, &|| false),
        }
        eng.table.take_local().unwrap_or_else(|| Err(Error::backend("shm: an exchange ended without an outcome")))
    }

    /// Let go of every buffer before failing everything with `e`: a peer
    /// may be pushing into a receive buffer (stop it), or reading a send
    /// buffer (withdraw the offer); either way the pair's stream is then out
    /// of step for good, and the transport fails.
    pub(crate) fn fail_all(&self, eng: &mut Engine, posting: &Posting, e: Error) {
        let Engine { peers, table, .. } = eng;
        let mut cancelled = false;
        {
            // SAFETY: a receive being filled is cancelled; no op is put in.
            let Columns { ops, .. } = unsafe { table.columns() };
            for (peer, st) in peers.iter_mut().enumerate() {
                cancelled |= self.cancel_awaiting(peer, st, ops);
            }
        }
        let View { ops, done, state, .. } = table.view();
        for p in peers.iter_mut() {
            p.inbound.detach(ops);
        }
        // (Gathered sends make no offers.)
        let open: Vec<(usize, u64)> =
            (0..ops.len()).filter(|i| !done[*i]).filter_map(|i| state[i].offer.map(|o| (ops[i].peer(), o.seq))).collect();
        if !open.is_empty() {
            // Abort first, so a peer that finds the offer withdrawn also
            // finds why (and whom to blame) in our control block.
            self.abort(&e);
            for &(peer, seq) in &open {
                self.revoke(peer, seq, Instant::now() + CANCEL_GRACE);
            }
        }
        let e = if cancelled || !open.is_empty() { self.fail(e) } else { e };
        table.fail_all(&e);
        posting.fail_new(&e);
        posting.notify();
    }

    /// Fail batches whose deadline has passed. One with a message half in
    /// a ring or in single-copy flight fails the transport (the stream is
    /// out of step); others just let go of their buffers.
    fn expire(&self, eng: &mut Engine, posting: &Posting, now: Instant) -> std::result::Result<(), Error> {
        while let Some(id) = eng.table.expired(now) {
            let pending = eng.table.pending_of(id);
            let View { ops, gathered, state, .. } = eng.table.view();
            let what: Vec<String> = pending
                .iter()
                .map(|&i| match (&ops[i], send_of(ops, gathered, i).is_some()) {
                    (op, true) => format!("send to peer rank {}", op.peer()),
                    (P2p::Recv { peer: ANY_SOURCE, .. }, false) => "receive from any rank".to_string(),
                    (op, false) => format!(
                        "receive from peer rank {}{}",
                        op.peer(),
                        if eng.peers[op.peer()].holds() { matching::HELD_BACK } else { "" }
                    ),
                })
                .collect();
            let e = Error::timeout(format!("shm: {} not finished before the deadline", what.join(", ")))
                .stalled_on(weft::backend::first_named_peer(ops, &pending));
            let half_sent = |i: usize| matches!(send_of(ops, gathered, i), Some((_, _, out)) if state[i].sent > 0 && state[i].sent < HEADER + out.len());
            let in_flight = pending.iter().any(|&i| state[i].offer.is_some() || half_sent(i))
                || eng.peers.iter().any(|st| st.awaiting.is_some() && st.inbound.filling().is_some_and(|r| pending.contains(&r)));
            if in_flight {
                return Err(self.fail(e));
            }
            for p in eng.peers.iter_mut() {
                p.inbound.detach_where(eng.table.ops(), |i| pending.contains(&i));
            }
            eng.table.withdraw(id, e);
            posting.notify();
            Self::settle(eng, posting);
        }
        Ok(())
    }

    /// Finished batches report (and threads waiting for them wake);
    /// finished ops leave the table.
    fn settle(eng: &mut Engine, posting: &Posting) {
        if eng.table.is_idle() {
            return;
        }
        if eng.table.settle() {
            posting.notify();
        }
        if let Some(map) = eng.table.compact() {
            for p in eng.peers.iter_mut() {
                p.inbound.remap(&map);
            }
        }
    }

    /// Drive every posted op (taking new batches as they are posted) until
    /// `until()` holds, or with `local`, until the driving thread's own
    /// batch has finished.
    pub(crate) fn drive(&self, eng: &mut Engine, posting: &Posting, local: bool, until: &dyn Fn() -> bool) {
        let (me, w) = (self.rank, self.size);
        // The clock is read only once turns move nothing (an op that
        // finishes in its first turns never reads it), every
        // TURNS_PER_CLOCK idle turns. `idle_since`: the first reading
        // since the last turn that moved something.
        let mut now = None;
        let mut idle_since = None;
        let mut last_check = None;
        // The doorbell as read before the last turn, if that turn is to
        // be the one before a nap.
        let mut armed = None;
        let mut turns: u32 = 0;
        let mut unclocked: u32 = 0;
        let mut sending: SmallVec<[PeerSend; 16]> = smallvec![PeerSend::Free; w];
        loop {
            let mut moved = false;
            let mut step = || -> Result<()> {
                self.check_failed()?;
                moved |= posting.take(|post| self.absorb(eng, post, posting))?;
                moved |= self.pass(eng, &mut sending)?;
                // (Also after nothing moved: a receive served early
                // finishes its batch at once.)
                Self::settle(eng, posting);
                turns = turns.wrapping_add(1);
                if moved && !turns.is_multiple_of(256) {
                    return Ok(());
                }
                if !moved {
                    unclocked += 1;
                    if unclocked < TURNS_PER_CLOCK {
                        return Ok(());
                    }
                }
                unclocked = 0;
                // Nothing moved (or, while other ops keep moving, every 256
                // turns): the clock, deadlines, and now and then whether a
                // peer whose op waits has died.
                let t = Instant::now();
                now = Some(t);
                if !moved {
                    idle_since.get_or_insert(t);
                }
                self.expire(eng, posting, t)?;
                if t.duration_since(*last_check.get_or_insert(t)) >= NAP {
                    last_check = Some(t);
                    // A collective this rank runs through the rings that a
                    // peer took through the fast path never completes.
                    if let Some(e) = self.fast.rings_mismatch() {
                        return Err(self.fail(e));
                    }
                    let View { ops, done, .. } = eng.table.view();
                    for op in ops.iter().zip(done).filter(|(_, d)| !**d).map(|(op, _)| op) {
                        let peer = op.peer();
                        if peer == ANY_SOURCE {
                            continue;
                        }
                        // (A frame held back stays until its receive comes.)
                        let drained = matches!(op, P2p::Send { .. }) || self.ring(peer, me).available() == 0 || eng.peers[peer].holds();
                        if let (true, Some(e)) = (drained, self.peer_problem(peer)) {
                            return Err(self.fail(e));
                        }
                    }
                }
                Ok(())
            };
            if let Err(e) = step() {
                self.fail_all(eng, posting, e);
                return;
            }
            if (local && eng.table.local_done()) || until() {
                return;
            }
            if moved {
                // Idle from the next turn that moves nothing (its clock
                // reading stands for this one: a turn takes well under
                // PAUSE_SPIN).
                idle_since = None;
                unclocked = 0;
                armed = None;
                continue;
            }
            // A peer copying our offered buffer finishes soon: keep
            // spinning for it rather than pay a wake-up at the end of every
            // large send (figures: bench/RESULTS.md, "Measurements behind
            // code comments").
            let View { ops, done, state, .. } = eng.table.view();
            let reading = (0..ops.len()).any(|i| !done[i] && state[i].offer.is_some()) || eng.peers.iter().any(|st| st.awaiting.is_some());
            let idle = match (now, idle_since) {
                (Some(now), Some(since)) => now.duration_since(since),
                _ => Duration::ZERO,
            };
            let work = !eng.table.all_done();
            if work && idle < PAUSE_SPIN && !self.oversubscribed {
                // The peer is most likely running on another core and about
                // to answer: a system call here would only add latency.
                std::hint::spin_loop();
                continue;
            }
            if work && idle < if reading { CMA_SPIN } else { SPIN } {
                std::thread::yield_now();
                continue;
            }
            // Read the doorbell, then take one more turn before sleeping: a
            // peer's ring from here on (for a step `ready` below does not
            // look for) ends the nap at once, and one before it, that turn
            // sees.
            let Some(seen) = armed.take() else {
                armed = Some(self.doorbell());
                continue;
            };
            // (Idle for SPIN: the clock has been read.)
            let now = now.unwrap_or_else(Instant::now);
            let deadline = eng.table.next_deadline().unwrap_or(now + NAP);
            self.nap(seen, now, deadline, &|| {
                posting.has_new()
                    || (0..w).any(|p| p != me && self.ring(p, me).available() > 0 && !eng.peers[p].holds())
                    || (0..w).any(|p| sending[p] == PeerSend::Full && self.ring(me, p).has_room())
                    || self.single_copy_moved(&eng.table, &eng.peers)
            });
            // The next idle turn reads the clock.
            unclocked = TURNS_PER_CLOCK - 1;
        }
    }

    /// One turn over every posted op: the first unfinished send to each
    /// peer streams into its ring, then every incoming ring is drained into
    /// the matching receives. True if anything moved.
    fn pass(&self, eng: &mut Engine, sending: &mut [PeerSend]) -> Result<bool> {
        let me = self.rank;
        let mut moved = false;
        let Engine { peers: incoming, table, .. } = eng;
        // SAFETY: sends are read, not replaced; no op is put in.
        let Columns { ops, done, gathered, state, .. } = unsafe { table.columns() };
        sending.fill(PeerSend::Free);
        // Help copy single-copy sends only with nothing left to receive:
        // while receiving, this core is busy pulling already.
        let nothing_to_receive = ops.iter().zip(done.iter()).all(|(op, d)| *d || matches!(op, P2p::Send { .. }));
        for i in 0..ops.len() {
            let Some((peer, tag, out)) = send_of(ops, gathered, i) else { continue };
            if done[i] || sending[peer] != PeerSend::Free {
                continue;
            }
            sending[peer] = PeerSend::Busy;
            let ring = self.ring(me, peer);
            let st = &mut state[i];
            // An offer made while a large receive is pending says so
            // (all_gather, all_to_all, ring steps), and may be pushed
            // whole by this rank (`prefix` decides).
            let first = st.sent == 0;
            let receiving = first
                && ops.iter().zip(done.iter()).any(|(op, d)| !*d && matches!(op, P2p::Recv { buf, .. } if buf.len() >= cma::MIN_BYTES));
            let (prefix, plen) = match out {
                Out::Bytes(data) => self.prefix(peer, tag, data, &mut incoming[peer], &mut st.offer, first, receiving, st.scheme),
                Out::Gathered(g) => plain_header(tag, g.len()),
            };
            if first && st.offer.is_none() {
                rewind(ring, plen, out.len(), || sends(ops) > 1);
            }
            let before = st.sent;
            if st.sent < plen {
                let n = ring.write(&prefix[st.sent..plen]);
                if n < plen - st.sent {
                    sending[peer] = PeerSend::Full;
                }
                st.sent += n;
            }
            let mut inline = st.offer.is_none();
            if let (Some(cma::Offer { seq, pushes, .. }), true) = (st.offer, st.sent >= plen) {
                // Offered: done when the peer has read it, inline if it
                // cannot (asked again while the inline payload streams:
                // a payload larger than the ring's free space takes
                // several rounds).
                match self.cell(me, peer).phase(seq) {
                    Some(cma::DONE) => {
                        done[i] = true;
                        sending[peer] = PeerSend::Free;
                        moved = true;
                        continue;
                    }
                    Some(cma::REFUSED) => {
                        incoming[peer].refused |= !self.cell(me, peer).declined();
                        inline = true;
                    }
                    Some(cma::READING)
                        if (pushes || nothing_to_receive)
                            && matches!(out, Out::Bytes(data) if self.push(peer, seq, data, pushes, &mut incoming[peer])) =>
                    {
                        moved = true;
                        self.wake(peer);
                    }
                    _ => {}
                }
            }
            if inline && st.sent >= plen {
                let from = st.sent - plen;
                let n = match out {
                    Out::Bytes(data) => ring.write(&data[from..]),
                    Out::Gathered(g) => ring.write_with(g.len() - from, |at, piece| g.fill(from + at, piece)),
                };
                if n < out.len() - from {
                    sending[peer] = PeerSend::Full;
                }
                st.sent += n;
            }
            if st.sent != before {
                moved = true;
                self.notify(peer);
            }
            if inline && st.sent == plen + out.len() {
                done[i] = true;
                sending[peer] = PeerSend::Free;
            }
        }
        // Receives: drain every incoming ring, matching or stashing frames.
        for peer in (0..self.size).filter(|p| *p != me) {
            if self.drain(peer, table, incoming)? {
                moved = true;
                self.notify(peer);
            }
        }
        Ok(moved)
    }

    /// Read what `peer` has written to us into `table`'s receives; true if
    /// any byte moved.
    fn drain(&self, peer: usize, table: &mut Table<OpState>, incoming: &mut [Peer]) -> Result<bool> {
        let ring = self.ring(peer, self.rank);
        let mut moved = false;
        // SAFETY: receives are filled and bound; no op is put in.
        let table = unsafe { table.columns() };
        loop {
            let mut st = &mut incoming[peer];
            if st.awaiting.is_some() {
                let until = Self::transfer_until(&table);
                if !self.collect_pushed(peer, st, table.ops, until)? {
                    return Ok(moved);
                }
                moved = true;
            }
            if !st.inbound.in_frame() {
                if !st.holds() {
                    let need = st.header_len();
                    let n = ring.read(&mut st.hdr[st.hdr_got..need]);
                    if n == 0 {
                        return Ok(moved);
                    }
                    moved = true;
                    st.hdr_got += n;
                    // (A header's length may announce a descriptor.)
                    if !st.holds() {
                        continue;
                    }
                }
                let tag = u64::from_le_bytes(st.hdr[..8].try_into().expect("8 bytes"));
                let len = u64::from_le_bytes(st.hdr[8..16].try_into().expect("8 bytes"));
                if tag == PADDING {
                    st.hdr_got = 0;
                    if !ring.skip_to_start(len as usize) {
                        let e = Error::backend(format!("shm: rank {peer} sent {len} bytes of padding that do not end at its ring's end"));
                        return Err(self.fail(e));
                    }
                    continue;
                }
                let rank_stashed = || incoming.iter().map(|p| p.inbound.stashed_bytes()).sum();
                // With every op of the table finished, nothing waits on this
                // frame and no op of this rank can wait on the peer: it stays
                // in the ring for the receive that comes next, which reads it
                // from there, rather than copied aside and copied again (a
                // stream of large sends to background receives paid the
                // extra copy, into fresh pages, on every message). Any op
                // posted later decides again.
                let nothing_waits = table.done.iter().all(|d| *d);
                if nothing_waits
                    || incoming[peer].inbound.holds_back(peer, tag, Some((len & !CMA_FLAG) as usize), table.ops, table.done, rank_stashed)
                {
                    // Left in the ring (header read) until there is room:
                    // the sender waits for ring space.
                    return Ok(moved);
                }
                st = &mut incoming[peer];
                st.hdr_got = 0;
                if len & CMA_FLAG != 0 {
                    st.cma_in = Some(cma::Offer::decode(&st.hdr[HEADER..]));
                }
                if let Some(i) =
                    st.inbound.begin(self.rank, peer, tag, (len & !CMA_FLAG) as usize, table.ops, table.done).map_err(|e| self.fail(e))?
                {
                    matching::bind(table.ops, i, peer);
                }
            }
            if let Some(offer) = st.cma_in.take() {
                let until = Self::transfer_until(&table);
                self.read_offer(peer, offer, st, table.ops, until)?;
                moved = true;
                if st.awaiting.is_some() {
                    continue;
                }
            }
            // A message too large to stay in cache goes to memory.
            let to_memory = st.inbound.frame_len().is_some_and(|len| len >= TO_MEMORY_BYTES);
            let dst = st.inbound.payload(table.ops);
            if !dst.is_empty() {
                let n = if to_memory { ring.read_to_memory(dst) } else { ring.read(dst) };
                if n == 0 {
                    return Ok(moved);
                }
                st.inbound.advance(n);
                moved = true;
            }
            st.inbound.finish(self.rank, peer, table.ops, table.done).map_err(|e| self.fail(e))?;
        }
    }
}
