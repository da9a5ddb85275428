//! The process group: rank, size, ops, sub-groups, abort, shrinking after a death.
//!
//! How an op runs. Every op is validated where it is issued (`ops.rs`:
//! sizes, dtypes, ranks, tags), then takes one of these routes, chosen
//! from the caller (the group, a scope, or the unscoped ops of a
//! binding), its tensors' route and the host backend's capabilities
//! (decided once per group: `fast.rs`'s `HostPaths`). A collective's
//! route is chosen in `route.rs`; a send's or receive's at the end of its
//! op in `ops.rs` (direct path, else a job):
//!
//! | route | taken by | where |
//! |---|---|---|
//! | direct path | a direct send, receive or sendrecv of host tensors on a transport that posts (not a receive of bools, which a job cleans) | `p2p.rs` (`DirectP2p`): straight to the transport's `exchange` |
//! | fast path | a direct collective of host tensors (not bools) without hints, chosen algorithm or `WEFT_DEBUG=detail`, on a transport whose `Capabilities::fast_ops` says it has one | `fast.rs`: its turn, then `Backend::fast_op`; declined, a job in the same turn |
//! | job in its turn | every other direct op: decided (`decide.rs`: algorithm, segment size), then run when its turn comes, by the backend (`native_op`) or core's algorithm | `ProcessGroup::submit`, `executor.rs` |
//! | posted | a send or receive in a scope or unscoped (and a direct receive from any rank) on a transport that posts: driven by whoever waits, else the group's progress thread | `p2p.rs` |
//! | queued | every other op in a scope or unscoped: run in issue order by the group's worker | `scope.rs`, `executor.rs` |
//!
//! Whatever the route, an op's errors name it and this rank
//! (`GroupCore::guarded`), and a collective keeps its place in the
//! group's order, which `WEFT_DEBUG=detail` checks across ranks.

mod check;
mod debug;
mod decide;
mod executor;
mod fast;
mod job;
mod ops;
mod p2p;
mod progress_thread;
mod route;
mod scope;
mod setup;
mod shared;
mod shrink;
mod work;

pub use ops::{Collectives, P2pOp};
pub(crate) use progress_thread::ProgressThread;
pub use scope::{Scope, Unscoped};
pub use shrink::ShrinkOptions;
pub use work::Work;

use crate::algorithms;
use crate::backend::{Backend, Deadline, Op, OpContext};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::sanitize;
use crate::options::{GroupOptions, OpOptions};
use crate::registry::Route;
use crate::store::{PrefixStore, Store};
use crate::stream::{CompletionSlot, DeviceCompletion};
use crate::tensor::Device;
use executor::Executor;
use job::Job;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// A group of ranks that run collectives together.
///
/// Create one per process with [`ProcessGroup::from_env`] (under `weft run`,
/// torchrun-style variables, Slurm or Open MPI) or [`ProcessGroup::new`]
/// with a store; make sub-groups with [`ProcessGroup::split`]. The ops are
/// in the [`Collectives`] trait. Dropping the group closes its connections
/// cleanly.
pub struct ProcessGroup {
    core: Arc<GroupCore>,
}

/// What running an op needs; shared with the worker thread.
pub(crate) struct GroupCore {
    rank: usize,
    size: usize,
    options: GroupOptions,
    store: Arc<dyn Store>,
    /// One backend per filled route (instances shared between routes); a
    /// few entries, searched on every op: a list, not a hash map.
    routes: Vec<(Route, Arc<dyn Backend>)>,
    /// Why each empty route has no backend.
    missing: HashMap<Route, String>,
    exec: Arc<Executor>,
    /// Progress threads of the transports background p2p ops are posted to.
    progress_threads: std::sync::Mutex<Vec<Arc<ProgressThread>>>,
    debug_detail: bool,
    /// The transports this group runs on, shut down once it and every
    /// sub-group sharing them let go (`shared.rs`); taken when it is dropped.
    transports: std::sync::Mutex<Option<Arc<shared::Transports>>>,
    /// Whether its backends are views of its parent's (`shared.rs`).
    shares: bool,
    /// Told why, once, before the group's transports are aborted
    /// ([`ProcessGroup::on_abort`]).
    on_abort: OnceLock<AbortHook>,
    aborted: AtomicBool,
    /// The `ProcessGroup` was dropped (what outlives it, a window, fails).
    dropped: AtomicBool,
    /// The first failure after bytes may have moved (checked on every op).
    poisoned: OnceLock<Error>,
    splits: AtomicU64,
    /// Windows created so far (numbered alike on every rank).
    windows: AtomicU64,
    /// Shrinks and agreements run so far (numbered alike on survivors).
    surveys: AtomicU64,
    /// Whether this rank marked the group revoked in the store (`shrink.rs`).
    revoked: AtomicBool,
    /// Hashes every op's hint map: seeded once, so an op without hints
    /// makes its empty map without reading the per-thread seed.
    hasher: std::collections::hash_map::RandomState,
    /// The group's algorithm setting (hint `algorithm`, `WEFT_ALGORITHM`).
    algorithms: crate::algorithms::select::Setting,
    /// Where direct ops on host tensors may skip the job.
    host: fast::HostPaths,
}

impl ProcessGroup {
    /// Join a group of `size` ranks as `rank`, meeting the others through
    /// `store`. Collective: every rank calls it; returns once every backend
    /// chosen by `options.backend` is connected.
    pub fn new(store: Arc<dyn Store>, rank: usize, size: usize, options: GroupOptions) -> Result<Self> {
        setup::create(store, rank, size, options).map(|core| ProcessGroup { core: Arc::new(core) })
    }

    /// Join the job's default group, configured by the environment (see
    /// [`crate::launch::LaunchEnv`]).
    pub fn from_env(options: GroupOptions) -> Result<Self> {
        let env = crate::launch::LaunchEnv::from_env()?;
        let store = env.connect_store(options.timeout)?;
        Self::new(store, env.rank, env.world_size, options)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.core.rank
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.core.size
    }
    /// The name of the backend that handles `route`, if any.
    pub fn backend_name(&self, route: Route) -> Option<String> {
        self.core.backend(route).map(|b| b.name().to_string())
    }

    /// Whether this group runs over its parent's transports (a sub-group
    /// made by a split that shares them: see [`ProcessGroup::split`]).
    pub fn shares_parent_transports(&self) -> bool {
        self.core.shares
    }

    /// A sub-group of the given ranks of this group (in that order: the
    /// i-th listed rank becomes rank i). Every rank of this group must call
    /// it, in the same order relative to other splits, with the same list;
    /// ranks not listed get `None`. An empty list, a rank out of range or a
    /// duplicate is `InvalidArgument`.
    ///
    /// Where this group's backends all move host bytes, the sub-group runs
    /// over its transports (no new connections or segments: a split costs
    /// its members a few store round trips), with core's algorithms and
    /// without the transport's fast path, and shares its fate: an error
    /// that poisons one aborts the transports of both. The first 255
    /// splits of a group share; later ones, splits of a sub-group that
    /// shares, splits of a group with a device backend and splits of a
    /// group with the hint `split=new` set up their own transports, as
    /// [`ProcessGroup::new`] does.
    pub fn split(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        self.check_split_list(ranks)?;
        let n = self.core.splits.fetch_add(1, Ordering::Relaxed);
        match ranks.iter().position(|&r| r == self.core.rank) {
            Some(sub_rank) => self.form_split(n, ranks, sub_rank).map(Some),
            None => Ok(None),
        }
    }

    /// This rank's sub-group in a split where every rank names its own
    /// (NCCL's colours, TorchComm's `split`): every rank of this group
    /// calls it, in the same order relative to other splits, passing the
    /// ranks of the sub-group it joins (the same list, in the same order,
    /// as the other members: the i-th listed rank becomes rank i), or an
    /// empty list to join none (`None`). A list without this rank, a rank
    /// out of range or a duplicate is `InvalidArgument`.
    pub fn join_split(&self, ranks: &[usize]) -> Result<Option<ProcessGroup>> {
        // The split is numbered first: ranks that join none, or pass a bad
        // list, stay in step with the others for later splits.
        let n = self.core.splits.fetch_add(1, Ordering::Relaxed);
        if ranks.is_empty() {
            return Ok(None);
        }
        self.check_split_list(ranks)?;
        let Some(sub_rank) = ranks.iter().position(|&r| r == self.core.rank) else {
            let e = Error::invalid(format!("this rank ({}) is not in the list {ranks:?}", self.core.rank));
            return Err(e.with_op("split").with_rank(self.core.rank));
        };
        self.form_split(n, ranks, sub_rank).map(Some)
    }

    /// A split's rank list is non-empty, in range and without duplicates.
    fn check_split_list(&self, ranks: &[usize]) -> Result<()> {
        let c = &self.core;
        let fail = |m: String| Err(Error::invalid(m).with_op("split").with_rank(c.rank));
        if ranks.is_empty() {
            return fail("the rank list is empty".into());
        }
        for (i, &r) in ranks.iter().enumerate() {
            if r >= c.size {
                return fail(format!("rank {r} is out of range for a group of size {}", c.size));
            }
            if ranks[..i].contains(&r) {
                return fail(format!("rank {r} is listed twice"));
            }
        }
        Ok(())
    }

    /// Set up split `n`'s sub-group `ranks` as its rank `sub_rank`, on the
    /// store under a prefix of its own (sub-groups of one split are
    /// disjoint, so their lowest ranks differ). Each member publishes its
    /// list and reads every other listed member's: members that disagree
    /// (on who, in which order, or on sharing transports) all fail, naming
    /// the first that differs. The sub-group runs over this group's
    /// transports where it can (`shared.rs`), else sets up its own.
    fn form_split(&self, n: u64, ranks: &[usize], sub_rank: usize) -> Result<ProcessGroup> {
        let c = &self.core;
        let lowest = ranks.iter().min().copied().unwrap_or_default();
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(format!("split{n}.{lowest}"), c.store.clone()));
        let space = c.share_space(n);
        let list = format!("{ranks:?}{}", if space.is_some() { " over the parent's transports" } else { "" });
        store.set(&format!("members/{}", c.rank), list.as_bytes())?;
        for &r in ranks.iter().filter(|&&r| r != c.rank) {
            let theirs = store.get(&format!("members/{r}"), c.options.timeout).map_err(|e| e.with_op("split"))?;
            if theirs != list.as_bytes() {
                let e = Error::invalid(format!(
                    "rank lists differ: this rank passed {list}, rank {r} passed {}",
                    String::from_utf8_lossy(&theirs)
                ));
                return Err(e.with_op("split").with_rank(c.rank));
            }
        }
        match space {
            Some(space) => setup::shared(c, store, sub_rank, ranks, space).map(|core| ProcessGroup { core: Arc::new(core) }),
            None => Self::new(store, sub_rank, ranks.len(), c.options.clone()),
        }
    }

    /// What a new window on a `device` takes from this group: its number,
    /// a store namespace, the device's backend and its progress thread.
    pub(crate) fn window_parts(&self, device: crate::tensor::DeviceKind) -> Result<crate::window::WindowParts> {
        let c = &self.core;
        c.usable()?;
        let id = c.windows.fetch_add(1, Ordering::Relaxed);
        let backend = c.route((device, crate::tensor::Layout::Dense))?.clone();
        let (core, backend_of) = (c.clone(), backend.clone());
        let usable = c.clone();
        Ok(crate::window::WindowParts {
            id,
            store: Arc::new(PrefixStore::new(format!("window{id}"), c.store.clone())),
            backend,
            progress: Box::new(move || core.progress_thread(&backend_of)),
            timeout: c.options.timeout,
            usable: Box::new(move || usable.usable()),
        })
    }

    /// Send `bytes` to `dst` under any `tag` (a forged window frame, a
    /// collective's step out of turn): for tests of what a rank does with
    /// what a misbehaving peer sends.
    #[cfg(feature = "fuzzing")]
    #[doc(hidden)]
    pub fn forge_send(&self, bytes: &[u8], dst: usize, tag: u64) -> Result<()> {
        let backend = self.core.route((crate::tensor::DeviceKind::Cpu, crate::tensor::Layout::Dense))?;
        let mut ops = [crate::backend::P2p::Send { peer: dst, tag, data: bytes }];
        backend.exchange(&mut ops, &crate::deadline::Deadline::after(self.core.options.timeout))
    }

    /// End every in-flight op of this rank promptly with `Aborted`, and make
    /// every later op fail the same way. Peers see this rank as lost.
    pub fn abort(&self) {
        self.core.aborted.store(true, Ordering::Release);
        let e = Error::aborted(format!("rank {} aborted the group", self.core.rank));
        self.core.tell_abort(&e);
        for b in self.core.backends() {
            b.abort(&e);
        }
    }

    /// Call `hook` with the reason, once, just before this group aborts its
    /// transports: on [`ProcessGroup::abort`], and when an op's error (a
    /// timeout, a lost peer, a revoke) makes the group unusable, before
    /// the peers are told. It runs on the thread that found the error (an
    /// op's caller, or a thread of weft's), so it must be short and must
    /// not wait for this group's ops. One hook per group: a second call
    /// is `InvalidArgument`.
    pub fn on_abort(&self, hook: impl Fn(&Error) + Send + Sync + 'static) -> Result<()> {
        self.core
            .on_abort
            .set(AbortHook { hook: Box::new(hook), told: AtomicBool::new(false) })
            .map_err(|_| Error::invalid("this group has an abort hook already").with_op("on_abort").with_rank(self.core.rank))
    }
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut routes: Vec<String> =
            self.core.routes.iter().map(|(r, b)| format!("{}-{}: {}", r.0.name(), r.1.name(), b.name())).collect();
        routes.sort();
        write!(f, "ProcessGroup(rank {} of {}, {})", self.core.rank, self.core.size, routes.join(", "))
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        self.core.dropped.store(true, Ordering::Release);
        self.core.exec.shutdown();
        for progress in self.core.progress_threads.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            progress.stop();
        }
        drop(self.core.transports.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

impl Collectives<'_> for ProcessGroup {}

impl<'t> route::Issuer<'t> for ProcessGroup {
    #[inline]
    fn submit(&self, mut job: Job<'t>, opts: &OpOptions) -> Result<Work<'t>> {
        self.core.decide(&mut job, opts)?;
        let opts = job.options(opts);
        let timeout = opts.timeout.unwrap_or(self.core.options.timeout);
        if let Some(backend) = self.core.posting_backend(&job) {
            if job.op.receives_from_any() {
                return Ok(Work::new(self.core.post_and_wait(backend, &mut job, &opts)).within(timeout));
            }
            // A point-to-point op on a transport that progresses everything
            // together takes no turn: it runs now, driving the transport (and
            // whatever else is posted there) until it is done.
            let (result, device) = self.core.run_job(&mut job, &opts, 0);
            return Ok(Work::done(result, device).within(timeout));
        }
        let ticket = self.core.exec.issue();
        let (result, device) = self.core.exec.run_inline(ticket, job.is_collective(), |seq| self.core.run_job(&mut job, &opts, seq));
        Ok(Work::done(result, device).within(timeout))
    }
    fn direct_p2p(&self, route: Route) -> Option<p2p::DirectP2p<'_>> {
        self.core.direct_p2p(route)
    }
    fn fast_path(
        &self,
        name: &'static str,
        route: Route,
        kind: crate::backend::OpKind,
        dtype: DType,
        opts: &OpOptions,
    ) -> Option<fast::FastPath<'_>> {
        self.core.fast_path(name, route, kind, dtype, opts)
    }
    fn group(&self) -> &ProcessGroup {
        self
    }
}

/// A group's abort hook ([`ProcessGroup::on_abort`]) and whether it ran.
struct AbortHook {
    hook: Box<dyn Fn(&Error) + Send + Sync>,
    told: AtomicBool,
}

impl GroupCore {
    /// The tag space split `n`'s sub-groups get on this group's transports,
    /// if they can share them (`shared.rs`): not a sub-group's, nor one
    /// with a device backend; not past the last space; not where the
    /// group's hint `split` is `new`.
    fn share_space(&self, n: u64) -> Option<u8> {
        let host_only = self.routes.iter().all(|(r, _)| r.0 == crate::tensor::DeviceKind::Cpu);
        let wanted = self.options.hints.get("split").is_none_or(|v| v != "new");
        u8::try_from(n + 1).ok().filter(|_| !self.shares && host_only && wanted)
    }

    fn backends(&self) -> Vec<Arc<dyn Backend>> {
        let mut v: Vec<Arc<dyn Backend>> = Vec::new();
        for (_, b) in &self.routes {
            if !v.iter().any(|x| Arc::ptr_eq(x, b)) {
                v.push(b.clone());
            }
        }
        v
    }

    #[inline]
    fn usable(&self) -> Result<()> {
        if self.dropped.load(Ordering::Acquire) || self.aborted.load(Ordering::Acquire) || self.poisoned.get().is_some() {
            return Err(self.unusable());
        }
        Ok(())
    }

    /// Why the group is not usable (closed, aborted or poisoned).
    #[cold]
    fn unusable(&self) -> Error {
        if self.dropped.load(Ordering::Acquire) {
            return Error::aborted(format!("the process group was closed on rank {}", self.rank));
        }
        if self.aborted.load(Ordering::Acquire) {
            return Error::aborted(format!("the group was aborted on rank {}", self.rank));
        }
        match self.poisoned.get() {
            Some(e) => Error::new(e.kind().clone(), format!("the group is unusable after an earlier error: {e}")),
            None => Error::aborted(format!("the group was aborted on rank {}", self.rank)),
        }
    }

    fn backend(&self, route: Route) -> Option<&Arc<dyn Backend>> {
        self.routes.iter().find(|(r, _)| *r == route).map(|(_, b)| b)
    }

    fn route(&self, route: Route) -> Result<&Arc<dyn Backend>> {
        self.backend(route).ok_or_else(|| {
            Error::unsupported(format!(
                "no backend handles {} {} tensors in this group: {}",
                route.0.name(),
                route.1.name(),
                self.missing.get(&route).map(String::as_str).unwrap_or("none was requested")
            ))
        })
    }

    /// Run one op; errors are tagged with the op and rank, and any error
    /// after bytes may have moved poisons the group: the backend aborts,
    /// telling peers the cause, so every rank fails instead of hanging.
    ///
    /// Returns the result of the host side, and for device ops the device
    /// side's completion.
    ///
    /// The job is borrowed, not moved: it is a few hundred bytes, and each
    /// move through these layers was a memcpy call on every op.
    fn run_job(&self, job: &mut Job<'_>, opts: &OpOptions, seq: u64) -> (Result<()>, Option<Arc<dyn DeviceCompletion>>) {
        let slot = if job.route.0 == crate::tensor::DeviceKind::Cpu { CompletionSlot::default() } else { CompletionSlot::for_device() };
        let result = self.guarded(job.name, || self.run_job_inner(job, opts, seq, &slot));
        (result, slot.take())
    }

    /// Run op `name` (`run`): not on a group that was closed, aborted or
    /// poisoned. A panic inside (a bug) becomes the op's error; an error
    /// after bytes may have moved poisons the group (invalid and
    /// unsupported calls are caught before any moves, alike on every rank);
    /// every error is explained (a peer lost to a revoked group) and names
    /// the op and this rank.
    pub(crate) fn guarded(&self, name: &'static str, run: impl FnOnce() -> Result<()>) -> Result<()> {
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.usable()?;
            run().map_err(|e| self.explain(e)).inspect_err(|e| {
                if !matches!(e.kind(), crate::ErrorKind::Unsupported | crate::ErrorKind::InvalidArgument) {
                    self.poison(e.clone().with_op(name).with_rank(self.rank));
                }
            })
        }));
        match result {
            Ok(r) => r.map_err(|e| e.with_op(name).with_rank(self.rank)),
            Err(p) => {
                let what =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                let e = Error::backend(format!("internal error (panic) in {name}: {what}")).with_op(name).with_rank(self.rank);
                self.poison(e.clone());
                Err(e)
            }
        }
    }

    fn run_job_inner(&self, job: &mut Job<'_>, opts: &OpOptions, seq: u64, completion: &CompletionSlot) -> Result<()> {
        let Job { name, kind, route, fingerprint, op, algorithm, segment_bytes, native } = job;
        let (algorithm, segment_bytes) = (*algorithm, *segment_bytes);
        let (name, kind, route) = (*name, *kind, *route);
        let backend = self.route(route)?;
        if op.receives_from_any() {
            // Posted where the transport can (`p2p.rs`); not here.
            return Err(crate::Error::unsupported(format!("backend {} cannot receive from any rank", backend.name())));
        }
        // The op's hints over the group's. Usually both are empty: then
        // the map is made from the group's hasher, without reading the
        // per-thread seed a fresh one takes.
        let mut hints = if opts.hints.is_empty() { HashMap::with_hasher(self.hasher.clone()) } else { opts.hints.clone() };
        for (k, v) in &self.options.hints {
            hints.entry(k.clone()).or_insert_with(|| v.clone());
        }
        let ctx = OpContext {
            rank: self.rank,
            size: self.size,
            name,
            kind,
            seq,
            shape: crate::shape::of(op),
            deadline: Deadline::after(opts.timeout.unwrap_or(self.options.timeout)),
            hints,
            algorithm,
            segment_bytes,
            stream: opts.stream,
            completion: completion.clone(),
        };
        self.execute(backend.as_ref(), &ctx, fingerprint.as_ref(), op, *native)
    }

    fn execute(
        &self,
        backend: &dyn Backend,
        ctx: &OpContext,
        fp: Option<&debug::Fingerprint>,
        op: &mut Op<'_>,
        native: bool,
    ) -> Result<()> {
        if let (true, Some(fp)) = (self.debug_detail, fp) {
            debug::check(backend, ctx, fp)?;
        }
        match if native { backend.native_op(op, ctx) } else { None } {
            Some(r) => r?,
            None => algorithms::run(backend, op, ctx).map_err(|e| match e.kind() {
                crate::ErrorKind::Unsupported => e.context(format!("backend {} has no native {}", backend.name(), ctx.name)),
                _ => e,
            })?,
        }
        // Bytes from peers must never become invalid bools in user memory.
        for out in op.outputs_mut() {
            if out.dtype() == DType::Bool && out.device() == Device::Cpu {
                sanitize(out.host_bytes_mut()?, DType::Bool);
            }
        }
        Ok(())
    }

    /// Run the abort hook, if any and not yet run.
    fn tell_abort(&self, e: &Error) {
        if let Some(h) = self.on_abort.get() {
            if !h.told.swap(true, Ordering::AcqRel) {
                (h.hook)(e);
            }
        }
    }

    fn poison(&self, e: Error) {
        if self.poisoned.set(e.clone()).is_ok() {
            crate::log::info(format_args!("group poisoned on rank {}: {e}", self.rank));
            self.tell_abort(&e);
            for b in self.backends() {
                b.abort(&e);
            }
        }
    }
}
