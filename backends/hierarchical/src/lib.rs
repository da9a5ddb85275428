//! `hierarchical`: for groups that span hosts with several ranks on some of
//! them. all_reduce goes shm within each host and cpu-tcp between hosts,
//! each local rank carrying a slice (or one leader per host when hosts
//! differ in size; see `all_reduce.rs`), as NCCL and Open MPI's HAN do;
//! every other op runs over a flat cpu-tcp mesh.
//!
//! `auto` ranks it between shm (one host) and cpu-tcp. It declines
//! (`Unsupported`) when every rank is on one host or every host has one
//! rank, where it would add nothing. The hints `hier_local` and
//! `hier_global` name the backends (default shm and cpu-tcp).

#![warn(missing_docs)]

mod all_reduce;
mod topology;

use std::sync::Arc;
use std::time::Duration;
use topology::Topology;
use weft::algorithms::select::Family;
use weft::backend::progress::Post;
use weft::backend::{Backend, BackendContext, Capabilities, Deadline, GatherSend, NativeAlgorithm, Op, OpContext, P2p};
use weft::registry::{BackendFactory, StaticBackend};
use weft::store::PrefixStore;
use weft::{DeviceKind, Error, ErrorKind, Layout, Result};

/// The registration of `hierarchical`.
pub struct Hierarchical;

impl BackendFactory for Hierarchical {
    fn name(&self) -> &str {
        "hierarchical"
    }
    fn devices(&self) -> &[DeviceKind] {
        &[DeviceKind::Cpu]
    }
    fn layouts(&self) -> &[Layout] {
        &[Layout::Dense]
    }
    fn priority(&self) -> i32 {
        15
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        let topo = Topology::discover(&ctx)?;
        if topo.hosts.len() == 1 {
            return Err(Error::unsupported("hierarchical: every rank is on one host (shm serves that)"));
        }
        if topo.hosts.iter().all(|h| h.len() == 1) {
            return Err(Error::unsupported("hierarchical: one rank per host, nothing to share within a host"));
        }
        let hint = |k: &str, d: &str| ctx.hints.get(k).cloned().unwrap_or_else(|| d.to_string());
        let (local_name, global_name) = (hint("hier_local", "shm"), hint("hier_global", "cpu-tcp"));
        let all: Vec<usize> = (0..ctx.size).collect();
        let flat = stage(&ctx, "flat", || SubGroup::create(&ctx, &global_name, "flat", &all))?;
        let local = stage(&ctx, "local", || SubGroup::create(&ctx, &local_name, &format!("local{}", topo.mine), topo.local()))?;
        // Hosts of equal size: every local rank owns a slice and talks to its
        // counterparts on the other hosts. Otherwise one leader per host.
        let inter = match topo.cross() {
            Some(cross) => Inter::Cross(stage(&ctx, "cross", || {
                let i = topo.local().iter().position(|r| *r == ctx.rank).expect("in its host");
                SubGroup::create(&ctx, &global_name, &format!("cross{i}"), &cross[i])
            })?),
            None => {
                let leaders = topo.leaders();
                Inter::Leaders(stage(&ctx, "leaders", || {
                    if leaders.contains(&ctx.rank) {
                        SubGroup::create(&ctx, &global_name, "leaders", &leaders).map(Some)
                    } else {
                        Ok(None)
                    }
                })?)
            }
        };
        // Its own all_reduce, not the flat transport's fast path (its ops
        // span hosts).
        let caps = Capabilities { native_algorithms: NATIVE, fast_ops: false, ..flat.backend.capabilities().clone() };
        Ok(Arc::new(HierBackend { flat: Arc::new(flat), local, inter, store: ctx.store.clone(), caps }))
    }
}

/// One step of creation, agreed by every rank (see [`weft::store::all_or_none`]).
fn stage<T>(ctx: &BackendContext, what: &str, make: impl FnOnce() -> Result<T>) -> Result<T> {
    let step = format!("hierarchical: setting up the {what} backend");
    weft::store::all_or_none(&*ctx.store, &format!("stage/{what}"), ctx.rank, ctx.size, ctx.timeout, make(), &step)
}

/// A backend over some of the group's ranks, and their group ranks.
pub(crate) struct SubGroup {
    backend: Arc<dyn Backend>,
    /// Group rank of each sub-rank.
    ranks: Vec<usize>,
    rank: usize,
    /// The hierarchical backend's store namespace (for the root cause).
    store: Arc<dyn weft::store::Store>,
}

/// Where an aborting rank records the group rank it blames: sub-transports
/// can only name ranks of their own sub-group.
const ROOT_CAUSE: &str = "root_cause";
/// This backend's two-level all_reduce, as the hint `algorithm` names it
/// (the default; naming another runs core's algorithm over the flat group).
const ALGORITHM: &str = "hierarchical";

impl SubGroup {
    fn create(ctx: &BackendContext, backend: &str, scope: &str, ranks: &[usize]) -> Result<SubGroup> {
        let factory = weft::registry::find(backend).ok_or_else(|| Error::unsupported(format!("hierarchical: no backend {backend:?}")))?;
        let rank = ranks.iter().position(|r| *r == ctx.rank).expect("a member creates its sub-group");
        let sub = BackendContext {
            rank,
            size: ranks.len(),
            store: Arc::new(PrefixStore::new(scope.to_string(), ctx.store.clone())),
            timeout: ctx.timeout,
            hints: ctx.hints.clone(),
            cpu_backend: None,
            group_ranks: ranks.iter().map(|r| ctx.group_ranks[*r]).collect(),
        };
        Ok(SubGroup { backend: factory.create(sub)?, ranks: ranks.to_vec(), rank, store: ctx.store.clone() })
    }

    /// Ranks in the sub-group.
    pub(crate) fn size(&self) -> usize {
        self.ranks.len()
    }
    /// This rank in the sub-group.
    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    /// Run `op` on the sub-group with the generic algorithms, as collective
    /// number `seq` of its transport; errors name group ranks.
    pub(crate) fn run(&self, op: &mut Op<'_>, ctx: &OpContext, seq: u64) -> Result<()> {
        let mut sub = OpContext { rank: self.rank, size: self.ranks.len(), seq, ..ctx.clone() };
        // `algorithm=hierarchical` chose this backend's path; the steps
        // inside pick their own algorithms.
        if sub.algorithm == Some(ALGORITHM) {
            sub.algorithm = None;
        }
        weft::algorithms::run(&*self.backend, op, &sub).map_err(|e| self.translate(e))
    }

    /// A sub-rank in an error becomes the group rank; a lost peer that an
    /// aborting rank traced to another rank is reported as that rank.
    fn translate(&self, e: Error) -> Error {
        match e.kind() {
            ErrorKind::PeerLost { rank } => {
                let recorded = self
                    .store
                    .check(&[ROOT_CAUSE])
                    .unwrap_or(false)
                    .then(|| self.store.get(ROOT_CAUSE, Duration::from_secs(1)).ok())
                    .flatten();
                let root = recorded.and_then(|v| String::from_utf8_lossy(&v).parse::<usize>().ok());
                let r = root.unwrap_or_else(|| self.ranks.get(*rank).copied().unwrap_or(*rank));
                Error::peer_lost(r, format!("peer rank {r} lost ({})", e.message()))
            }
            _ => e,
        }
    }

    /// `reason` in this sub-group's rank space: a lost peer outside it
    /// cannot be named there (the root cause is in the store instead).
    fn local_reason(&self, reason: &Error) -> Error {
        match reason.kind() {
            ErrorKind::PeerLost { rank } => match self.ranks.iter().position(|r| r == rank) {
                Some(sub) => Error::peer_lost(sub, reason.message().to_string()),
                None => Error::aborted(reason.message().to_string()),
            },
            _ => reason.clone(),
        }
    }
}

/// How a host's data meets the other hosts'.
pub(crate) enum Inter {
    /// Hosts of equal size: this rank's counterparts (same local index) on
    /// every host.
    Cross(SubGroup),
    /// One leader per host (`None` on the other ranks).
    Leaders(Option<SubGroup>),
}

struct HierBackend {
    /// Every rank: point-to-point ops and the generic algorithms run here
    /// (shared with posted batches' completions, which translate errors).
    flat: Arc<SubGroup>,
    local: SubGroup,
    inter: Inter,
    store: Arc<dyn weft::store::Store>,
    /// The flat transport's, with the two-level all_reduce as a native
    /// algorithm.
    caps: Capabilities,
}

/// The algorithm hierarchical runs natively.
const NATIVE: &[NativeAlgorithm] = &[NativeAlgorithm { family: Family::AllReduce, name: ALGORITHM }];

impl HierBackend {
    fn subs(&self) -> impl Iterator<Item = &SubGroup> {
        let inter = match &self.inter {
            Inter::Cross(g) => Some(g),
            Inter::Leaders(g) => g.as_ref(),
        };
        [&*self.flat, &self.local].into_iter().chain(inter)
    }
}

impl Backend for HierBackend {
    fn name(&self) -> &str {
        "hierarchical"
    }
    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
        self.flat.backend.exchange(ops, deadline).map_err(|e| self.flat.translate(e))
    }
    fn exchange_gathered(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: &Deadline) -> Result<()> {
        self.flat.backend.exchange_gathered(ops, gathered, deadline).map_err(|e| self.flat.translate(e))
    }
    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }
    fn post(&self, post: Post) {
        let flat = self.flat.clone();
        self.flat.backend.post(post.then(move |r| r.map_err(|e| flat.translate(e))))
    }
    fn progress(&self, until: &dyn Fn() -> bool) {
        self.flat.backend.progress(until)
    }
    fn native_op(&self, op: &mut Op<'_>, ctx: &OpContext) -> Option<Result<()>> {
        match op {
            Op::AllReduce { buf, op } if ctx.algorithm.is_none_or(|a| a == ALGORITHM) => {
                Some(all_reduce::run(&self.local, &self.inter, buf, *op, ctx))
            }
            _ => None,
        }
    }
    fn abort(&self, reason: &Error) {
        if let ErrorKind::PeerLost { rank } = reason.kind() {
            // Before any sub-transport tells its peers: they look it up.
            let _ = self.store.compare_set(ROOT_CAUSE, b"", rank.to_string().as_bytes());
        }
        self.subs().for_each(|s| s.backend.abort(&s.local_reason(reason)));
    }
    fn shutdown(&self) {
        self.subs().for_each(|s| s.backend.shutdown());
    }
}

static HIERARCHICAL: Hierarchical = Hierarchical;
weft::inventory::submit! { StaticBackend(&HIERARCHICAL) }

/// Reference this crate so the linker keeps its registration.
pub fn link() {}
