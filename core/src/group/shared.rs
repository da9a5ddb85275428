//! Sub-groups that run over their parent's transports.
//!
//! A split ([`super::ProcessGroup::split`]) of a group whose backends all
//! move host bytes does not connect anew: each of the sub-group's backends
//! is a [`Shared`] view of the parent's, which numbers peers in the
//! sub-group's ranks and puts every tag in a space of the sub-group's own
//! ([`crate::tag::in_space`]), so its messages never meet the parent's or
//! another sub-group's. Setting one up costs the members' agreement on the
//! list (a few store round trips), not a new mesh of sockets or segments.
//!
//! What the view gives up, and why:
//! - the transport's native collectives and fast path (`native_op`,
//!   `fast_op`, its capabilities' `native_algorithms` and `fast_ops`) and
//!   its own windows: they involve
//!   every rank of the parent. The sub-group runs core's algorithms over
//!   the transport's point-to-point `exchange` and `post`, and builds its
//!   windows over posted messages (`crate::window::over_p2p`);
//! - independence from the parent: the transport is one, so an error that
//!   poisons the sub-group aborts the parent's transport too, and the
//!   reverse (what NCCL's `ncclCommSplit` children sharing resources do).
//!
//! A parent has [`crate::tag::SPACES`]` - 1` spaces to hand out, one per
//! split in its order; later splits, splits of a sub-group and splits of
//! a group with a device backend are set up in full
//! ([`super::ProcessGroup::new`]). The transports are shut down once the
//! parent and every sub-group sharing them are dropped ([`Transports`]).

use crate::backend::progress::Post;
use crate::backend::{Backend, Capabilities, Deadline, GatherSend, P2p, ANY_SOURCE};
use crate::error::{Error, Result};
use smallvec::SmallVec;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A group's transports, shut down when the last group using them (the
/// group that made them, or a sub-group sharing them) lets go.
pub(crate) struct Transports(pub(crate) Vec<Arc<dyn Backend>>);

impl Drop for Transports {
    fn drop(&mut self) {
        for b in &self.0 {
            b.shutdown();
        }
    }
}

/// How a sub-group's ranks sit in its parent's.
struct RankMap {
    /// The sub-group's rank i is the parent's `parent[i]`.
    parent: Vec<usize>,
    /// The parent's rank p is the sub-group's `sub[p]` (`usize::MAX`: not a member).
    sub: Vec<usize>,
}

impl RankMap {
    /// A sub-group rank as the parent's (`ANY_SOURCE` stays so).
    fn up(&self, peer: usize) -> usize {
        self.parent.get(peer).copied().unwrap_or(peer)
    }
    /// A parent rank as the sub-group's (a non-member stays as it is).
    fn down(&self, peer: usize) -> usize {
        self.sub.get(peer).copied().filter(|&s| s != usize::MAX).unwrap_or(peer)
    }
    /// A parent's error as the sub-group's: the peer it names renumbered,
    /// the message told which ranks it counts in.
    fn told(&self, e: Error) -> Error {
        e.renumbered(|p| self.down(p))
            .context(format_args!("on the transport shared with the parent group (this group's ranks are its {:?})", self.parent))
    }
}

/// One of a sub-group's backends: a view of the parent's (see the module docs).
pub(crate) struct Shared {
    parent: Arc<dyn Backend>,
    ranks: Arc<RankMap>,
    space: u8,
    /// The parent's, with its preferred rank order (members only, in
    /// sub-group ranks) and without its native algorithms.
    caps: Capabilities,
}

impl Shared {
    /// A view of `parent` for the sub-group of the parent's ranks `ranks`
    /// (in the sub-group's order), sending in tag space `space` (not 0).
    pub(crate) fn new(parent: Arc<dyn Backend>, parent_size: usize, ranks: &[usize], space: u8) -> Self {
        let mut sub = vec![usize::MAX; parent_size];
        for (i, &p) in ranks.iter().enumerate() {
            sub[p] = i;
        }
        let theirs = parent.capabilities();
        let caps = Capabilities {
            rank_order: theirs.rank_order.as_ref().map(|o| o.iter().filter(|&&p| sub[p] != usize::MAX).map(|&p| sub[p]).collect()),
            native_algorithms: &[],
            fast_ops: false,
            posts_device: false,
            ..theirs.clone()
        };
        Shared { parent, ranks: Arc::new(RankMap { parent: ranks.to_vec(), sub }), space, caps }
    }

    /// A peer and tag of the sub-group's as the parent's transport sees them.
    fn up(&self, peer: usize, tag: u64) -> (usize, u64) {
        (self.ranks.up(peer), crate::tag::in_space(tag, self.space))
    }

    /// Renumber and re-tag `ops` for the parent's transport; returns what
    /// to put back after.
    fn enter(&self, ops: &mut [P2p<'_>]) -> SmallVec<[(usize, u64); 8]> {
        ops.iter_mut()
            .map(|op| {
                let (peer, tag) = op.address_mut();
                let was = (*peer, *tag);
                (*peer, *tag) = self.up(*peer, *tag);
                was
            })
            .collect()
    }

    /// A gathered send, renumbered and re-tagged.
    fn gathered<'g>(&self, g: &GatherSend<'g>) -> GatherSend<'g> {
        let (peer, tag) = self.up(g.peer, g.tag);
        GatherSend { peer, tag, src: g.src }
    }
}

fn restore(ops: &mut [P2p<'_>], was: &[(usize, u64)]) {
    for (op, &(p, t)) in ops.iter_mut().zip(was) {
        let (peer, tag) = op.address_mut();
        (*peer, *tag) = (p, t);
    }
}

impl Backend for Shared {
    fn name(&self) -> &str {
        self.parent.name()
    }

    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
        let was = self.enter(ops);
        let r = self.parent.exchange(ops, deadline);
        restore(ops, &was);
        r.map_err(|e| self.ranks.told(e))
    }

    fn exchange_gathered(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: &Deadline) -> Result<()> {
        let was = self.enter(ops);
        let gathered: SmallVec<[GatherSend<'_>; 4]> = gathered.iter().map(|g| self.gathered(g)).collect();
        let r = self.parent.exchange_gathered(ops, &gathered, deadline);
        restore(ops, &was);
        r.map_err(|e| self.ranks.told(e))
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn post(&self, mut post: Post) {
        post.renumber(|peer, tag| (*peer, *tag) = self.up(*peer, *tag));
        let ranks = self.ranks.clone();
        let theirs = post.take_source();
        // The sender of an any-source receive, learnt in the parent's ranks.
        let learnt = theirs.as_ref().map(|_| Arc::new(AtomicUsize::new(ANY_SOURCE)));
        if let Some(cell) = &learnt {
            post = post.with_source(cell.clone());
        }
        self.parent.post(post.then(move |r| {
            if let (Some(cell), Some(learnt)) = (theirs, learnt) {
                let p = learnt.load(Ordering::Acquire);
                cell.store(if p == ANY_SOURCE { p } else { ranks.down(p) }, Ordering::Release);
            }
            r.map_err(|e| ranks.told(e))
        }))
    }

    fn progress(&self, until: &dyn Fn() -> bool) {
        self.parent.progress(until)
    }

    /// The transport is the parent's: what fails this group fails it.
    fn abort(&self, reason: &Error) {
        self.parent.abort(reason)
    }

    // `shutdown`: the parent's transports close with their last user (`Transports`).
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_map_both_ways_and_errors_are_renumbered() {
        let m = RankMap { parent: vec![3, 1], sub: vec![usize::MAX, 1, usize::MAX, 0] };
        assert_eq!((m.up(0), m.up(1), m.up(ANY_SOURCE)), (3, 1, ANY_SOURCE));
        assert_eq!((m.down(3), m.down(1), m.down(2)), (0, 1, 2));
        let e = m.told(Error::peer_lost(3, "peer rank 3 closed its socket"));
        assert_eq!(e.kind(), &crate::ErrorKind::PeerLost { rank: 0 });
        assert!(e.to_string().contains("its [3, 1]"), "{e}");
        assert_eq!(m.told(Error::timeout("t").stalled_on(Some(1))).stalled_peer(), Some(1));
    }
}
