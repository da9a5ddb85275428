//! Point-to-point exchanges over the rings: an exchange's progress loop
//! streams each send into its peer's ring as framed bytes (tag, length,
//! payload) and drains every incoming ring into the matching receives, in
//! one loop, so two ranks sending to each other never block. Large
//! payloads (as the backend's `cma::Policy` says) go single-copy instead:
//! the frame carries a descriptor, and the receiver reads (and an idle
//! sender pushes) the bytes straight between the two processes' buffers
//! (`cma.rs`). What finishes at once skips the table (`direct.rs`).

use crate::cma;
use crate::posted::{Engine, OpState, Peer, CMA_FLAG, HEADER};
use crate::ring::Ring;
use crate::state::{ShmBackend, CMA_SPIN, NAP, PAUSE_SPIN, SPIN, TURNS_PER_CLOCK};
use smallvec::{smallvec, SmallVec};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use weft::backend::matching::{self, Early};
use weft::backend::progress::{Columns, Post, Posting, Table, View};
use weft::backend::{Backend, Deadline, Gather, GatherSend, P2p, ANY_SOURCE};
use weft::{Error, Result};

/// A receiver waiting for a pushed offer pulls it itself if the sender has
/// claimed none of it by then (the sender is not running).
const STEAL: Duration = Duration::from_micros(50);
/// After a failure, how long a peer copying to or from this rank's buffers
/// gets to finish before they go back to the caller anyway (a running one
/// needs well under a millisecond; a stopped one may never finish).
const CANCEL_GRACE: Duration = Duration::from_millis(500);
/// How much longer than its deadline a peer that is not stopped may take
/// to finish writing into this rank's buffer (it is descheduled, not
/// gone): handing the buffer back meanwhile would let it write there
/// after the caller has it again.
const RUNNING_GRACE: Duration = Duration::from_secs(10);

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

/// The frame prefix of an inline send: tag and length.
pub(crate) fn plain_header(tag: u64, len: usize) -> ([u8; HEADER + cma::DESCRIPTOR], usize) {
    let mut p = [0u8; HEADER + cma::DESCRIPTOR];
    p[..8].copy_from_slice(&tag.to_le_bytes());
    p[8..16].copy_from_slice(&(len as u64).to_le_bytes());
    (p, HEADER)
}

/// Start an inline frame (`header` and `payload` bytes) at `ring`'s start
/// if the ring is empty and the payload large (`Ring::rewind`), where its
/// exchange sends more than one message (`several`, asked only then): an
/// all_to_all's frames then land where their rings' last ones did, instead
/// of walking every ring through (W=4 on 2 cores, 1 MiB: twelve rings of
/// 1 MiB went to memory, a profile 78 % `memmove`; 390-470 -> 190-200 µs,
/// and W=8 1640 -> 1445 µs). Not for one message: a pipeline's segments
/// would then overwrite lines its receiver has just read, where walking on
/// finds lines no core holds (W=4 4 MiB all_reduce and broadcast, every
/// frame rewound: 15 % slower).
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
enum Lane {
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
        let first = eng.table.len();
        eng.table.add(post, |_, _| OpState::default());
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
    /// it has finished.
    pub(crate) fn exchange_now(
        &self,
        eng: &mut Engine,
        posting: &Posting,
        ops: &mut [P2p<'_>],
        gathered: &[GatherSend<'_>],
        deadline: &Deadline,
    ) -> Result<()> {
        if let Err(e) = self.check_failed().and_then(|()| posting.take(|post| self.absorb(eng, post, posting)).map(|_| ())) {
            self.fail_everything(eng, posting, e.clone());
            return Err(e);
        }
        if let Some(e) = self.refuse(ops.iter(), gathered) {
            return Err(e);
        }
        // With nothing else posted, what can finish at once skips the table
        // (`direct`). A receive from any rank binds its op to the sender:
        // it keeps the batch whole.
        let any_source = || ops.iter().any(|op| matches!(op, P2p::Recv { peer: ANY_SOURCE, .. }));
        if gathered.is_empty() && eng.table.is_idle() && ops.len() <= 64 && !any_source() {
            return self.exchange_direct(eng, posting, ops, deadline);
        }
        self.exchange_in_table(eng, posting, ops, gathered, deadline)
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
    ) -> Result<()> {
        let first = eng.table.len();
        // SAFETY: this returns only once the batch's outcome is in, and its
        // ops have then left the table (`settle`, `expire` and
        // `fail_everything` remove finished ops); `deadline` is the
        // caller's, borrowed as long.
        unsafe { eng.table.add_local(ops, gathered, deadline, |_, _| OpState::default()) };
        match self.start(eng, first) {
            Err(e) => self.fail_everything(eng, posting, e),
            Ok(()) => self.drive(eng, posting, true, &|| false),
        }
        eng.table.take_local().unwrap_or_else(|| Err(Error::backend("shm: an exchange ended without an outcome")))
    }

    /// Let go of every buffer before failing everything with `e`: a peer
    /// may be pushing into a receive buffer (stop it), or reading a send
    /// buffer (withdraw the offer); either way the pair's stream is then out
    /// of step for good, and the transport fails.
    pub(crate) fn fail_everything(&self, eng: &mut Engine, posting: &Posting, e: Error) {
        let Engine { peers, table } = eng;
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
        let mut lanes: SmallVec<[Lane; 16]> = smallvec![Lane::Free; w];
        loop {
            let mut moved = false;
            let mut step = || -> Result<()> {
                self.check_failed()?;
                moved |= posting.take(|post| self.absorb(eng, post, posting))?;
                moved |= self.pass(eng, &mut lanes)?;
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
                self.fail_everything(eng, posting, e);
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
            // A peer copying our offered buffer finishes in about a
            // millisecond per 16 MiB: keep spinning for it rather than pay a
            // wake-up (~50 us) at the end of every large send.
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
                    || (0..w).any(|p| lanes[p] == Lane::Full && self.ring(me, p).has_room())
                    || self.single_copy_moved(&eng.table, &eng.peers)
            });
            // The next idle turn reads the clock.
            unclocked = TURNS_PER_CLOCK - 1;
        }
    }

    /// One turn over every posted op: the first unfinished send to each
    /// peer streams into its ring, then every incoming ring is drained into
    /// the matching receives. True if anything moved.
    fn pass(&self, eng: &mut Engine, lanes: &mut [Lane]) -> Result<bool> {
        let me = self.rank;
        let mut moved = false;
        let Engine { peers: incoming, table } = eng;
        // SAFETY: sends are read, not replaced; no op is put in.
        let Columns { ops, done, gathered, state, .. } = unsafe { table.columns() };
        lanes.fill(Lane::Free);
        // Help copy single-copy sends only with nothing left to receive:
        // while receiving, this core is busy pulling already.
        let nothing_to_receive = ops.iter().zip(done.iter()).all(|(op, d)| *d || matches!(op, P2p::Send { .. }));
        for i in 0..ops.len() {
            let Some((peer, tag, out)) = send_of(ops, gathered, i) else { continue };
            if done[i] || lanes[peer] != Lane::Free {
                continue;
            }
            lanes[peer] = Lane::Busy;
            let ring = self.ring(me, peer);
            let st = &mut state[i];
            // An offer made while a large receive is pending says so
            // (all_gather, all_to_all, ring steps), and may be pushed
            // whole by this rank (`prefix` decides).
            let first = st.sent == 0;
            let receiving = first
                && ops.iter().zip(done.iter()).any(|(op, d)| !*d && matches!(op, P2p::Recv { buf, .. } if buf.len() >= cma::MIN_BYTES));
            let (prefix, plen) = match out {
                Out::Bytes(data) => self.prefix(peer, tag, data, &mut incoming[peer], &mut st.offer, first, receiving),
                Out::Gathered(g) => plain_header(tag, g.len()),
            };
            if first && st.offer.is_none() {
                rewind(ring, plen, out.len(), || sends(ops) > 1);
            }
            let before = st.sent;
            if st.sent < plen {
                let n = ring.write(&prefix[st.sent..plen]);
                if n < plen - st.sent {
                    lanes[peer] = Lane::Full;
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
                        lanes[peer] = Lane::Free;
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
                    lanes[peer] = Lane::Full;
                }
                st.sent += n;
            }
            if st.sent != before {
                moved = true;
                self.notify(peer);
            }
            if inline && st.sent == plen + out.len() {
                done[i] = true;
                lanes[peer] = Lane::Free;
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

    /// Withdraw single-copy offer `seq` to `peer`; if the peer is reading
    /// it right now, wait (one system call) until it is done, or `until`.
    fn revoke(&self, peer: usize, seq: u64, until: Instant) {
        let cell = self.cell(self.rank, peer);
        if cell.advance(seq, cma::REVOKED) == Err(Some(cma::READING)) {
            while cell.phase(seq) == Some(cma::READING) && Instant::now() < until && self.peer_problem(peer).is_none() {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// The frame prefix of send `i`: header, plus the descriptor when it
    /// goes single-copy. The offer is decided at its first byte and kept, so
    /// a prefix written in several pieces is the same in each.
    #[allow(clippy::too_many_arguments)]
    fn prefix(
        &self,
        to: usize,
        tag: u64,
        data: &[u8],
        peer: &mut Peer,
        offer: &mut Option<cma::Offer>,
        first: bool,
        receiving: bool,
    ) -> ([u8; HEADER + cma::DESCRIPTOR], usize) {
        let (mut p, plain) = plain_header(tag, data.len());
        // Until a byte is in the ring (a full ring takes none), the offer is
        // decided afresh.
        if first {
            *offer = None;
            if self.offers(data.len(), tag, peer, receiving) {
                peer.out_seq += 1;
                // Receiving too: push it all (see `cma`), if this rank can,
                // where the data is likely in its own cache and the receiver
                // will not reduce it at once (a reduction wants it in the
                // receiver's cache): data this rank has just written, of
                // any size (measured, W=2, all_reduce: 1 MiB 167 -> 69 us,
                // 256 KiB 42 -> 20, 16 MiB 2.2-2.4 -> 1.9-2.1 ms), and
                // other data within one core's L2 (all_gather 1 MiB 50.1 ->
                // 41.3 us, 2 MiB 149 -> 131 us). Pushing other data of
                // 64-256 KiB made it 3-10 % slower (one more hand-over),
                // of 16 and 64 MiB 4-29 % slower (nothing cached to gain).
                let fresh = weft::tag::fresh(tag);
                let cached = fresh || (self.l2 / 4..self.l2).contains(&data.len());
                // An idle sender pushes what it has just written too
                // (otherwise it copies chunks alongside the reader).
                let pushes = (receiving || fresh) && !peer.no_push && cached && !weft::tag::combines(tag);
                *offer = Some(cma::Offer { addr: data.as_ptr() as u64, seq: peer.out_seq, busy: receiving, pushes });
                // Posted before the descriptor can be seen.
                self.cell(self.rank, to).post(peer.out_seq);
            }
        }
        match offer {
            Some(o) => {
                p[8..16].copy_from_slice(&(data.len() as u64 | CMA_FLAG).to_le_bytes());
                p[16..].copy_from_slice(&o.encode());
                (p, HEADER + cma::DESCRIPTOR)
            }
            None => (p, plain),
        }
    }

    /// Whether a send of `len` bytes under `tag` to `peer` goes single-copy
    /// (`receiving`: this rank has a large receive pending too).
    pub(crate) fn offers(&self, len: usize, tag: u64, peer: &Peer, receiving: bool) -> bool {
        self.single_copy.offers(len, tag, receiving) && !peer.refused && self.cma.load(Ordering::Relaxed)
    }

    /// Whether a single-copy transfer of this exchange needs this rank: a
    /// peer opened an offer this rank pushes, finished reading (or
    /// refused) one, or pushed one this rank waits for.
    fn single_copy_moved(&self, table: &Table<OpState>, incoming: &[Peer]) -> bool {
        let me = self.rank;
        let View { ops, done, state, .. } = table.view();
        let mut open = (0..ops.len()).filter(|i| !done[*i]).filter_map(|i| state[i].offer.map(|o| (ops[i].peer(), o)));
        open.any(|(peer, o)| {
            let cell = self.cell(me, peer);
            match cell.phase(o.seq) {
                Some(cma::READING) => o.pushes && cell.claimed(o.seq) == 0,
                phase => phase != Some(cma::POSTED),
            }
        }) || incoming.iter().enumerate().any(|(p, st)| st.awaiting.is_some_and(|(o, _)| self.cell(p, me).pushed_count(o.seq) > 0))
    }

    /// Take single-copy offer `offer` from `peer` into the current frame's
    /// destination, or refuse it (the payload then follows inline). A pushed
    /// offer into a posted receive is only opened: the frame then waits for
    /// the sender (`collect_pushed`).
    fn read_offer(&self, peer: usize, offer: cma::Offer, st: &mut Peer, ops: &mut [P2p<'_>], until: Instant) -> Result<()> {
        let seq = offer.seq;
        let cell = self.cell(peer, self.rank);
        let dst = st.inbound.payload(ops).as_mut_ptr() as u64;
        let slow = weft::kernels::slow_copy_distance(dst as usize, offer.addr as usize);
        let cma = self.cma.load(Ordering::Relaxed);
        if !cma || slow {
            if cell.refuse(seq, cma).is_err() {
                return Err(self.withdrawn(peer));
            }
            self.wake(peer);
            return Ok(());
        }
        cell.open_chunks(seq, dst);
        if cell.advance(seq, cma::READING).is_err() {
            return Err(self.withdrawn(peer));
        }
        // Into a stashed copy (no receive posted yet), pull at once: the
        // frame must not stay open past this exchange.
        if offer.pushes && st.inbound.fills_receive() {
            st.awaiting = Some((offer, Instant::now()));
            self.wake(peer);
            return Ok(());
        }
        self.pull_offer(peer, offer, st, ops, until)
    }

    /// A withdrawn offer means the sender failed and aborted: its cause.
    fn withdrawn(&self, peer: usize) -> Error {
        let why = self.peer_problem(peer);
        self.fail(why.unwrap_or_else(|| Error::backend(format!("shm: peer rank {peer} withdrew a message before this rank read it"))))
    }

    /// The awaited pushed offer from `peer`: finished (true) once the sender
    /// has pushed it all, or, if the sender has claimed nothing for `STEAL`
    /// (it is not running), once this rank has pulled it instead.
    fn collect_pushed(&self, peer: usize, st: &mut Peer, ops: &mut [P2p<'_>], until: Instant) -> Result<bool> {
        let Some((offer, since)) = st.awaiting else { return Ok(true) };
        let cell = self.cell(peer, self.rank);
        let count = cma::Chunks::of(st.inbound.payload(ops).len()).count();
        if cell.pushed_count(offer.seq) < count && (cell.claimed(offer.seq) > 0 || since.elapsed() < STEAL) {
            return Ok(false);
        }
        st.awaiting = None;
        self.pull_offer(peer, offer, st, ops, until)?;
        Ok(true)
    }

    /// After a failure: stop the sender of an awaited offer (no more claims,
    /// wait for what it claimed) and refuse the rest, so the destination
    /// can go back to the caller. True if there was one.
    fn cancel_awaiting(&self, peer: usize, st: &mut Peer, ops: &mut [P2p<'_>]) -> bool {
        let Some((offer, _)) = st.awaiting.take() else { return false };
        let count = cma::Chunks::of(st.inbound.payload(ops).len()).count();
        let theirs = self.cell(peer, self.rank).close(offer.seq, count);
        let _ = self.wait_pushed(peer, offer.seq, theirs, Instant::now() + CANCEL_GRACE);
        self.cell(peer, self.rank).advance_from_reading(offer.seq, cma::REFUSED);
        self.wake(peer);
        true
    }

    /// Wait until the sender of `seq` has pushed (or given up on) `theirs`
    /// chunks, or `until` if the sender is stopped (one that runs gets
    /// `RUNNING_GRACE` more); only a dead or stopped sender takes long.
    fn wait_pushed(&self, peer: usize, seq: u64, theirs: u64, until: Instant) -> Result<()> {
        let cell = self.cell(peer, self.rank);
        let start = Instant::now();
        while cell.pushed_count(seq) < theirs {
            let now = Instant::now();
            if now.duration_since(start) > Duration::from_millis(1) {
                if let Some(e) = self.peer_problem(peer) {
                    return Err(self.fail(e));
                }
                if now >= until && (now >= until + RUNNING_GRACE || crate::liveness::stopped(self.pid(peer))) {
                    // It may still write there later: this stream is done for.
                    return Err(self.fail(
                        Error::timeout(format!("shm: peer rank {peer} did not finish copying into this rank before the deadline"))
                            .stalled_on(Some(peer)),
                    ));
                }
                // Not running (stopped, or descheduled): no need to spin.
                std::thread::sleep(Duration::from_micros(20));
            } else {
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Copy the opened offer into the frame's destination: the chunks
    /// nobody has claimed yet are pulled here, those the sender claimed are
    /// waited for; then DONE.
    fn pull_offer(&self, peer: usize, offer: cma::Offer, st: &mut Peer, ops: &mut [P2p<'_>], until: Instant) -> Result<()> {
        let (addr, seq) = (offer.addr, offer.seq);
        let cell = self.cell(peer, self.rank);
        let dst = st.inbound.payload(ops);
        let chunks = cma::Chunks::of(dst.len());
        let pid = self.pid(peer);
        let n = dst.len();
        let mut pull = |run: std::ops::Range<u64>| {
            let range = chunks.range(run);
            cma::read(pid, addr + range.start as u64, &mut dst[range])
        };
        let mut r = Ok(());
        let mut mine = 0;
        // A busy sender will not help chunk by chunk: take everything left
        // in one call. Otherwise, after the first chunk, a sender that has
        // claimed none is busy after all: take the rest in one call.
        while let Some(run) = cell.claim(seq, chunks.count(), (mine > 0 || offer.busy).then_some(mine)) {
            mine += run.end - run.start;
            r = pull(run);
            if r.is_err() {
                break;
            }
        }
        // The sender may be writing the chunks it claimed into `dst`: no
        // more claims, and wait until those are in before going on.
        let theirs = cell.close(seq, chunks.count()) - mine;
        self.wait_pushed(peer, seq, theirs, until)?;
        if let (Ok(()), Some(run)) = (&r, cell.failed_run(seq)) {
            r = pull(run);
        }
        match r {
            Ok(()) => {
                st.inbound.advance(n);
                cell.done(seq);
            }
            Err(cma::CopyError::Forbidden(e)) => {
                // Not allowed here (a container, a ptrace policy): refuse this
                // and every later offer; the sender streams inline instead.
                weft::log::debug(format_args!("shm: reading rank {peer}'s memory is not allowed ({e}); using the ring"));
                self.cma.store(false, Ordering::Relaxed);
                cell.advance_from_reading(seq, cma::REFUSED);
            }
            Err(cma::CopyError::Failed(e)) => {
                cell.advance_from_reading(seq, cma::REFUSED);
                self.wake(peer);
                // ESRCH: the sender died mid-read (its memory is gone, even
                // while it is still a zombie that kill(pid, 0) finds).
                let why = match (e, self.peer_problem(peer)) {
                    (_, Some(problem)) => problem,
                    (nix::errno::Errno::ESRCH, None) => Error::peer_lost(peer, format!("peer rank {peer} (pid {pid}) died")),
                    (e, None) => Error::backend(format!("shm: reading rank {peer}'s message failed: {e}")),
                };
                return Err(self.fail(why));
            }
        }
        self.wake(peer);
        Ok(())
    }

    /// Sender of offer `seq` to `to`, while the receiver reads it: copy
    /// into the receiver's destination every chunk left (`all`: this rank
    /// pushes the offer) or the next one; true if it claimed any.
    fn push(&self, to: usize, seq: u64, data: &[u8], all: bool, st: &mut Peer) -> bool {
        if st.no_push {
            return false;
        }
        let cell = self.cell(self.rank, to);
        let chunks = cma::Chunks::of(data.len());
        let claimed = if all { cell.claim_rest(seq, chunks.count()) } else { cell.claim(seq, chunks.count(), None) };
        let Some(run) = claimed else { return false };
        let range = chunks.range(run.clone());
        // The receiver published `dst` before READING (which we saw) and
        // keeps it until it has counted these chunks as pushed.
        let ok = match cma::write(self.pid(to), cell.dst() + range.start as u64, &data[range]) {
            Ok(()) => true,
            // Whatever went wrong, the receiver copies these chunks itself;
            // this rank stops offering help to that peer.
            Err(cma::CopyError::Failed(e) | cma::CopyError::Forbidden(e)) => {
                weft::log::debug(format_args!("shm: writing into rank {to}'s memory failed ({e}); it copies alone"));
                st.no_push = true;
                false
            }
        };
        cell.pushed(seq, run, ok);
        true
    }

    /// How long a single-copy transfer may keep a pass waiting: the
    /// earliest deadline, but a grace at least (a batch past its deadline
    /// that has not expired yet must not fail a transfer of another that
    /// has only just begun). Asked only by a transfer: most turns move
    /// none, and need neither the clock nor a deadline fixed.
    fn transfer_until(table: &Columns<'_, OpState>) -> Instant {
        let grace = Instant::now() + CANCEL_GRACE;
        table.next_deadline().map_or(grace, |d| d.max(grace))
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
                if incoming[peer].inbound.holds_back(peer, tag, Some((len & !CMA_FLAG) as usize), table.ops, table.done, rank_stashed) {
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
            let dst = st.inbound.payload(table.ops);
            if !dst.is_empty() {
                let n = ring.read(dst);
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
