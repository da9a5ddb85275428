//! Point-to-point exchanges that finish at once, without the table: with
//! nothing else posted, a send whose whole frame fits in its ring is
//! written there (header and payload published together), and a lone
//! receive of at most 64 KiB whose message is next in its ring is read
//! straight into its buffer. Most small sends and receives go this way, at
//! about half the cost through the table (figures: bench/RESULTS.md,
//! "Measurements behind code comments"); the table (`exchange.rs`) runs
//! whatever cannot: what does not fit, what goes
//! single-copy, a receive that finds another message first or waits
//! longer than a few looks.

use crate::cma::scheme::{Plan, Scheme};
use crate::exchange::{plain_header, planned, rewind, sends, skip_padding};
use crate::posted::{Engine, HEADER};
use crate::ring::{Whole, PUBLISH};
use crate::state::{ShmBackend, PURE_SPINS, SPIN, TURNS_PER_CLOCK};
use smallvec::SmallVec;
use std::time::Instant;
use weft::backend::progress::Posting;
use weft::backend::{Deadline, P2p};
use weft::Result;

impl ShmBackend {
    /// Run a batch with nothing else posted (no receive from any rank, at
    /// most 64 ops): its sends that fit go at once, then a lone receive
    /// left may be read at once; the table runs what is left.
    pub(crate) fn exchange_direct(
        &self,
        eng: &mut Engine,
        posting: &Posting,
        ops: &mut [P2p<'_>],
        deadline: &Deadline,
        plan: Option<Plan>,
    ) -> Result<()> {
        let (sent, count) = self.sends_at_once(eng, ops, plan);
        let unsent = |i: usize| sent & (1 << i) == 0;
        let left = ops.len() - count;
        if left == 0 {
            return Ok(());
        }
        if left == 1 {
            let i = (0..ops.len()).find(|&i| unsent(i)).expect("one is left");
            if let P2p::Recv { peer, tag, buf } = &mut ops[i] {
                if self.recv_at_once(eng, posting, *peer, *tag, buf) {
                    return Ok(());
                }
            }
            return self.exchange_in_table(eng, posting, &mut ops[i..=i], &[], deadline, plan);
        }
        if sent == 0 {
            return self.exchange_in_table(eng, posting, ops, &[], deadline, plan);
        }
        let mut rest: SmallVec<[P2p<'_>; 4]> =
            ops.iter_mut().enumerate().filter(|(i, _)| unsent(*i)).map(|(_, op)| op.reborrow()).collect();
        self.exchange_in_table(eng, posting, &mut rest, &[], deadline, plan)
    }

    /// With nothing else posted, the batch's sends whose whole frames fit
    /// in their rings now, in order until one does not, written at once
    /// (nothing of this rank's can be queued before them): which went, a
    /// bit per op (at most 64), and how many (counted here: without a
    /// `popcnt` in the baseline instruction set, counting the bits after
    /// was a score of instructions per op). One that goes single-copy (as
    /// `plan` or the rule says), or does not fit, stops them, and the table
    /// runs the rest.
    fn sends_at_once(&self, eng: &Engine, ops: &[P2p<'_>], plan: Option<Plan>) -> (u64, usize) {
        let (mut sent, mut count) = (0, 0);
        for (i, op) in ops.iter().enumerate() {
            let P2p::Send { peer, tag, data } = *op else { continue };
            let single_copy = match planned(plan, op) {
                Some(s) => self.feasible(s, tag, &eng.peers[peer]) != Scheme::Ring,
                None => self.offers(data.len(), tag, &eng.peers[peer], false),
            };
            if single_copy {
                break;
            }
            let (header, len) = plain_header(tag, data.len());
            let ring = self.ring(self.rank, peer);
            rewind(ring, len, data.len(), || sends(ops) > 1);
            if !ring.write_whole(&header[..len], data) {
                break;
            }
            self.notify(peer);
            sent |= 1 << i;
            count += 1;
        }
        (sent, count)
    }

    /// A lone receive of at most one publication ([`PUBLISH`]) from `peer`
    /// with nothing else posted, when the peer's next frame is the one it
    /// waits for (this tag, this size, inline) and nothing of the peer's
    /// was kept back: read whole, without the table, as soon as it is in
    /// the ring. Watched for `PURE_SPINS`
    /// looks; oversubscribed, yielding between looks for as long as a wait
    /// spins (`SPIN`), the sender may need this core, and a look at one
    /// ring costs a waiting rank less of its turn than a pass over them
    /// all. False otherwise: the exchange then runs it (it waits, stashing
    /// what other peers send meanwhile, or finds the mismatch).
    fn recv_at_once(&self, eng: &Engine, posting: &Posting, peer: usize, tag: u64, buf: &mut [u8]) -> bool {
        let st = &eng.peers[peer];
        // A frame longer than one publication comes in pieces: the table
        // reads each as it is published, where waiting for the whole would
        // copy nothing until the sender has copied everything (W = 2, 256
        // KiB: 5.8 against 4.6 us; bench/RESULTS.md, "ninth session").
        if buf.len() > PUBLISH {
            return false;
        }
        if !eng.table.is_idle() || st.hdr_got != 0 || st.cma_in.is_some() || st.awaiting.is_some() || !st.inbound.is_idle() {
            return false;
        }
        let ring = self.ring(peer, self.rank);
        let (frame, _) = plain_header(tag, buf.len());
        let expected: &[u8; HEADER] = frame[..HEADER].try_into().expect("a plain header");
        let mut since = None;
        for turn in 0u32.. {
            match ring.read_whole(expected, buf) {
                Whole::Read => {
                    self.notify(peer);
                    return true;
                }
                Whole::Other if skip_padding(ring) => continue,
                Whole::Other => return false,
                Whole::NotYet => {}
            }
            if posting.has_new() {
                return false;
            }
            if !self.oversubscribed {
                if turn as usize + 1 >= PURE_SPINS {
                    return false;
                }
                std::hint::spin_loop();
                continue;
            }
            // (Not before the first yield: see `Waiter::wait_until`.)
            if (turn + 1).is_multiple_of(TURNS_PER_CLOCK) {
                let now = Instant::now();
                if now.duration_since(*since.get_or_insert(now)) >= SPIN {
                    return false;
                }
            }
            std::thread::yield_now();
        }
        false
    }
}
