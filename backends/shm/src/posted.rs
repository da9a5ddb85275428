//! What this rank's point-to-point exchanges keep between turns (the data
//! `exchange.rs` drives): each peer's incoming stream and single-copy
//! state, and the table of posted ops.

use crate::cma;
use std::time::Instant;
use weft::backend::matching::{EarlyBudget, Inbound};
use weft::backend::progress::Table;

/// Frame header: tag and length.
pub(crate) const HEADER: usize = 16;
/// Set in a header's length: a single-copy descriptor follows (see `cma`).
pub(crate) const CMA_FLAG: u64 = 1 << 63;

/// One peer's state, kept across exchanges: what is arriving from it, and
/// the single-copy state of what this rank sends it.
#[derive(Default)]
pub(crate) struct Peer {
    /// The header (and descriptor) of the frame being read, and how many
    /// of its bytes have come.
    pub(crate) hdr: [u8; HEADER + cma::DESCRIPTOR],
    pub(crate) hdr_got: usize,
    /// Which receive what arrives fills, and what came early.
    pub(crate) inbound: Inbound,
    /// A single-copy frame whose payload is still to be read.
    pub(crate) cma_in: Option<cma::Offer>,
    /// Sequence of the last single-copy send to this peer.
    pub(crate) out_seq: u64,
    /// The peer cannot read this rank's memory: send inline.
    pub(crate) refused: bool,
    /// This rank cannot write the peer's memory: leave every chunk to it.
    pub(crate) no_push: bool,
    /// A pushed offer whose payload this rank waits for (destination
    /// published, frame open), and since when.
    pub(crate) awaiting: Option<(cma::Offer, Instant)>,
}

impl Peer {
    /// The header bytes of the frame being read: a single-copy frame's
    /// descriptor follows its header.
    pub(crate) fn header_len(&self) -> usize {
        let len = u64::from_le_bytes(self.hdr[8..16].try_into().expect("8 bytes"));
        if self.hdr_got >= HEADER && len & CMA_FLAG != 0 {
            HEADER + cma::DESCRIPTOR
        } else {
            HEADER
        }
    }

    /// A whole frame header is read but its frame waits in the ring:
    /// stashing it would pass the budget for early messages.
    pub(crate) fn holds(&self) -> bool {
        self.hdr_got >= HEADER && self.hdr_got == self.header_len()
    }
}

/// The engine's state for one posted op (sends only use it).
#[derive(Clone, Copy, Default)]
pub(crate) struct OpState {
    /// Bytes of the frame written into the ring.
    pub(crate) sent: usize,
    /// The single-copy offer, if the send went that way.
    pub(crate) offer: Option<cma::Offer>,
    /// The scheme its exchange's plan gives it (`None`: the rule).
    pub(crate) scheme: Option<cma::scheme::Scheme>,
}

/// Every peer's inbound state and every posted op, driven by one thread at
/// a time (see `weft::backend::progress`).
pub(crate) struct Engine {
    /// `peers[r]`: what comes from rank r.
    pub(crate) peers: Vec<Peer>,
    /// The posted ops.
    pub(crate) table: Table<OpState>,
    /// This rank's side of choosing large messages' schemes.
    pub(crate) chooser: cma::scheme::Chooser,
}

impl Engine {
    /// Every peer's state on `rank` of `size`, early messages kept within
    /// `budget`.
    pub(crate) fn new(rank: usize, size: usize, budget: EarlyBudget) -> Engine {
        let peer = || Peer { inbound: Inbound::default().with_budget(budget), ..Peer::default() };
        Engine { peers: (0..size).map(|_| peer()).collect(), table: Table::default(), chooser: cma::scheme::Chooser::new(rank, size) }
    }
}
