//! The single-copy side of an exchange (`exchange.rs`): a send's frame
//! carries a descriptor ([`super::Offer`]) instead of its payload, the
//! receiver reads the bytes straight from the sender's buffer
//! (`process_vm_readv`), and a sender with nothing else to do pushes them
//! into the receiver's (`process_vm_writev`), both through the pair's
//! [`super::Cell`] phases. Here: deciding a send's prefix, reading and
//! pushing offers, withdrawing them, and cancelling a pushed transfer
//! the receiver waits for. The copies themselves are in `mod.rs`.

use super as cma;
use super::scheme::Scheme;
use crate::exchange::{plain_header, CANCEL_GRACE};
use crate::posted::{OpState, Peer, CMA_FLAG, HEADER};
use crate::state::ShmBackend;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use weft::backend::progress::{Columns, Table, View};
use weft::backend::P2p;
use weft::{Error, Result};

/// A receiver waiting for a pushed offer pulls it itself if the sender has
/// claimed none of it by then (the sender is not running).
const STEAL: Duration = Duration::from_micros(50);
/// How much longer than its deadline a peer that is not stopped may take
/// to finish writing into this rank's buffer (it is descheduled, not
/// gone): handing the buffer back meanwhile would let it write there
/// after the caller has it again.
const RUNNING_GRACE: Duration = Duration::from_secs(10);

impl ShmBackend {
    /// Withdraw single-copy offer `seq` to `peer`; if the peer is reading
    /// it right now, wait (one system call) until it is done, or `until`.
    pub(crate) fn revoke(&self, peer: usize, seq: u64, until: Instant) {
        let cell = self.cell(self.rank, peer);
        if cell.advance(seq, cma::REVOKED) == Err(Some(cma::READING)) {
            while cell.phase(seq) == Some(cma::READING) && Instant::now() < until && self.peer_problem(peer).is_none() {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// The frame prefix of send `i`: header, plus the descriptor when it
    /// goes single-copy. The offer is decided at its first byte and kept, so
    /// a prefix written in several pieces is the same in each. `planned`:
    /// the scheme its exchange's plan gives it (`cma/scheme.rs`), taken
    /// where this pair can run it; otherwise the rule ([`Self::rule`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn prefix(
        &self,
        to: usize,
        tag: u64,
        data: &[u8],
        peer: &mut Peer,
        offer: &mut Option<cma::Offer>,
        first: bool,
        receiving: bool,
        planned: Option<Scheme>,
    ) -> ([u8; HEADER + cma::DESCRIPTOR], usize) {
        let (mut p, plain) = plain_header(tag, data.len());
        // Until a byte is in the ring (a full ring takes none), the offer is
        // decided afresh.
        if first {
            *offer = None;
            let scheme = match planned {
                Some(s) => self.feasible(s, tag, peer),
                None => self.rule(data.len(), tag, peer, receiving),
            };
            if scheme != Scheme::Ring {
                peer.out_seq += 1;
                let pushes = scheme == Scheme::Push;
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

    /// How the rule sends `len` bytes under `tag` to `peer` (`receiving`:
    /// this rank has a large receive pending too): the policy says whether
    /// single-copy; then, receiving too, the sender pushes it all (see
    /// `cma`), if it can, where the data is likely in its own cache and the
    /// receiver will not reduce it at once (a reduction wants it in the
    /// receiver's cache): data this rank has just written, of any size, and
    /// other data within one core's L2. Pushing other data was slower: one
    /// more hand-over for small ones, nothing cached to gain for large ones
    /// (figures: bench/RESULTS.md, "Measurements behind code comments").
    /// An idle sender pushes what it has just written too (otherwise it
    /// copies chunks alongside the reader).
    pub(crate) fn rule(&self, len: usize, tag: u64, peer: &Peer, receiving: bool) -> Scheme {
        if !self.offers(len, tag, peer, receiving) {
            return Scheme::Ring;
        }
        let fresh = weft::tag::fresh(tag);
        let cached = fresh || (self.l2 / 4..self.l2).contains(&len);
        if (receiving || fresh) && !peer.no_push && cached && !weft::tag::combines(tag) {
            Scheme::Push
        } else {
            Scheme::Pull
        }
    }

    /// `scheme` where this pair can run it: single copy only where the
    /// peer reads this rank's memory, a push only where this rank can
    /// write the peer's and the receiver does not reduce the message.
    pub(crate) fn feasible(&self, scheme: Scheme, tag: u64, peer: &Peer) -> Scheme {
        match scheme {
            Scheme::Ring => Scheme::Ring,
            _ if peer.refused || !self.cma.load(Ordering::Relaxed) => Scheme::Ring,
            Scheme::Push if peer.no_push || weft::tag::combines(tag) => Scheme::Pull,
            s => s,
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
    pub(crate) fn single_copy_moved(&self, table: &Table<OpState>, incoming: &[Peer]) -> bool {
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
    pub(crate) fn read_offer(&self, peer: usize, offer: cma::Offer, st: &mut Peer, ops: &mut [P2p<'_>], until: Instant) -> Result<()> {
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
    pub(crate) fn withdrawn(&self, peer: usize) -> Error {
        let why = self.peer_problem(peer);
        self.fail(why.unwrap_or_else(|| Error::backend(format!("shm: peer rank {peer} withdrew a message before this rank read it"))))
    }

    /// The awaited pushed offer from `peer`: finished (true) once the sender
    /// has pushed it all, or, if the sender has claimed nothing for `STEAL`
    /// (it is not running), once this rank has pulled it instead.
    pub(crate) fn collect_pushed(&self, peer: usize, st: &mut Peer, ops: &mut [P2p<'_>], until: Instant) -> Result<bool> {
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
    pub(crate) fn cancel_awaiting(&self, peer: usize, st: &mut Peer, ops: &mut [P2p<'_>]) -> bool {
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
    pub(crate) fn wait_pushed(&self, peer: usize, seq: u64, theirs: u64, until: Instant) -> Result<()> {
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
    pub(crate) fn pull_offer(&self, peer: usize, offer: cma::Offer, st: &mut Peer, ops: &mut [P2p<'_>], until: Instant) -> Result<()> {
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
    pub(crate) fn push(&self, to: usize, seq: u64, data: &[u8], all: bool, st: &mut Peer) -> bool {
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
    pub(crate) fn transfer_until(table: &Columns<'_, OpState>) -> Instant {
        let grace = Instant::now() + CANCEL_GRACE;
        table.next_deadline().map_or(grace, |d| d.max(grace))
    }
}
