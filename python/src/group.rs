//! A weft process group for Python: every op issued in the background on
//! tensors the Python side keeps alive, each returning a [`PyWork`].
//!
//! The Python side (`weft/_ops.py`) checks torch's arguments, makes
//! tensors contiguous and describes them ([`Desc`]); weft validates the
//! rest, as for Rust callers.

use crate::errors::{setup_to_py, to_py};
use crate::health::Health;
use crate::options::{seconds, Call};
use crate::store::PyStore;
use crate::tensor::{views, views_mut, Desc};
use crate::work::PyWork;
use pyo3::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use weft::store::{PrefixStore, Store};
use weft::{Collectives, GroupOptions, OpOptions, P2pOp, ProcessGroup, ReduceOp, SparseCoo, SparseCooTensor, Unscoped};

/// A process group and its error record: what Python's [`PyGroup`] and
/// C++ callers ([`crate::torch_api`]) share.
pub(crate) struct Native {
    pub(crate) pg: ProcessGroup,
    /// The worst communication error its ops have met (`get_error`).
    pub(crate) health: Health,
}

impl Native {
    /// Start an op: run it on this thread (`direct`: what a synchronous
    /// torch call needs, with no hand-over to another thread), finished
    /// when this returns and its error returned (and recorded) here; else
    /// issue it in the background.
    ///
    /// # Safety
    /// Every tensor `op` views stays valid, and untouched but by the op,
    /// until the returned work has finished (`ProcessGroup::unscoped`).
    pub(crate) unsafe fn start(
        &self,
        direct: bool,
        options: &OpOptions,
        op: impl FnOnce(&Issuer<'_>, &OpOptions) -> weft::Result<weft::Work<'static>>,
    ) -> weft::Result<weft::Work<'static>> {
        if !direct {
            // SAFETY: the caller's promise.
            return op(&Issuer::Background(unsafe { self.pg.unscoped() }), options);
        }
        let work = op(&Issuer::Direct(&self.pg), options)?;
        // It has finished: its error is the call's, as for a blocking
        // torch call.
        match work.error() {
            Some(e) => {
                self.health.record(e.kind());
                Err(e)
            }
            None => Ok(work),
        }
    }
}

/// One process group.
#[pyclass(frozen, module = "weft._weft", name = "Group")]
pub struct PyGroup(Arc<Native>);

impl From<ProcessGroup> for PyGroup {
    fn from(pg: ProcessGroup) -> Self {
        let health = Health::default();
        let told = health.clone();
        // Only noted here (core calls it on whichever thread found the
        // error); the Python side's callback runs later (`Health`). A new
        // group has no hook yet, so this cannot fail.
        let _ = pg.on_abort(move |_| told.aborted());
        PyGroup(Arc::new(Native { pg, health }))
    }
}

/// `store` under the prefix of the group called `name`, claimed by its
/// rank 0: a second group of that name on the store is an error.
fn named(store: Arc<dyn Store>, name: &str, rank: usize) -> weft::Result<Arc<dyn Store>> {
    let store: Arc<dyn Store> = Arc::new(PrefixStore::new(format!("weft.comm.{name}"), store));
    if rank == 0 && store.add("created", 1)? != 1 {
        return Err(weft::Error::invalid(format!("a communicator named {name:?} was already created on this store")));
    }
    Ok(store)
}

fn reduce_op(op: &str) -> PyResult<ReduceOp> {
    op.parse().map_err(to_py)
}

/// Who runs an op: the calling thread, now (`Direct`: what a synchronous
/// torch call needs, with no hand-over to another thread), or the group's
/// threads in the background.
pub(crate) enum Issuer<'g> {
    Direct(&'g ProcessGroup),
    Background(Unscoped<'g>),
}

/// Run `$call` (an op method call on `$c`) with whichever issuer `$i` is.
macro_rules! via {
    ($i:expr, |$c:ident| $call:expr) => {
        match $i {
            Issuer::Direct($c) => $call,
            Issuer::Background($c) => $call,
        }
    };
}
pub(crate) use via;

impl PyGroup {
    /// The group and its error record.
    pub(crate) fn native(&self) -> &Native {
        &self.0
    }

    /// Issue an op; `keep` holds its tensors until it has finished. A
    /// direct op runs on this thread with the GIL released and has
    /// finished when this returns (its error raised here); else it runs in
    /// the background.
    fn issue(
        &self,
        py: Python<'_>,
        call: Call,
        op: impl FnOnce(&Issuer<'_>, &OpOptions) -> weft::Result<weft::Work<'static>> + Send,
    ) -> PyResult<PyWork> {
        let Call { keep, options, direct } = call;
        let issued = std::time::Instant::now();
        // SAFETY: every tensor the op views is held by `keep`, which the
        // PyWork keeps (and parks when dropped early) until the op has
        // finished; the Python side does not touch them meanwhile.
        let work =
            if direct { py.detach(|| unsafe { self.0.start(true, &options, op) }) } else { unsafe { self.0.start(false, &options, op) } }
                .map_err(to_py)?;
        Ok(PyWork::new(work, issued, keep, None).watched(&self.0.health))
    }
}

#[pymethods]
impl PyGroup {
    /// Join a group of `size` ranks as `rank`, meeting through `store` (a
    /// torch.distributed Store; None: the store of the launcher's
    /// environment, see `weft::launch`). `backend` is weft's spec (`auto`,
    /// `shm`, `cpu-tcp`, `cpu:NAME,cuda:NAME`, a plugin); `timeout`
    /// (seconds) is every op's default and setup's limit. A `name` keeps
    /// the group's keys apart from other groups on the store, and two
    /// groups of one name on one store are an error.
    #[new]
    #[pyo3(signature = (store, rank, size, backend, timeout, hints = None, name = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        store: Option<Py<PyAny>>,
        rank: usize,
        size: usize,
        backend: String,
        timeout: f64,
        hints: Option<HashMap<String, String>>,
        name: Option<String>,
    ) -> PyResult<Self> {
        weft_builtin::link();
        let timeout = seconds(timeout.max(0.001))?;
        let mut options = GroupOptions::default().backend(backend).timeout(timeout);
        options.hints = hints.unwrap_or_default();
        let pg = py
            .detach(|| {
                let store: Arc<dyn Store> = match store {
                    Some(s) => Arc::new(PyStore::new(s, timeout)),
                    None => weft::launch::LaunchEnv::from_env()?.connect_store(timeout)?,
                };
                let store = match &name {
                    Some(name) => named(store, name, rank)?,
                    None => store,
                };
                ProcessGroup::new(store, rank, size, options)
            })
            .map_err(setup_to_py)?;
        Ok(PyGroup::from(pg))
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> usize {
        self.0.pg.rank()
    }

    /// Number of ranks.
    #[getter]
    fn size(&self) -> usize {
        self.0.pg.size()
    }

    /// The weft backend serving `device` (`"cpu"` or `"cuda"`) tensors of
    /// `layout` (`"dense"` or `"sparse"`), if any.
    #[pyo3(signature = (device = "cpu", layout = "dense"))]
    fn backend_name(&self, device: &str, layout: &str) -> Option<String> {
        let kind = if device == "cuda" { weft::DeviceKind::Cuda } else { weft::DeviceKind::Cpu };
        let layout = if layout == "sparse" { weft::Layout::SparseCoo } else { weft::Layout::Dense };
        self.0.pg.backend_name((kind, layout))
    }

    /// This rank's sub-group of a split where every rank names its own
    /// (`ranks`: its members, in their new rank order), or None for an
    /// empty list. Every rank calls it; see `ProcessGroup::join_split`.
    fn split(&self, py: Python<'_>, ranks: Vec<i64>) -> PyResult<Option<PyGroup>> {
        // A negative rank is out of range like any other (weft says so
        // after numbering the split, so every rank stays in step).
        let ranks: Vec<usize> = ranks.iter().map(|&r| usize::try_from(r).unwrap_or(usize::MAX)).collect();
        let sub = py.detach(|| self.0.pg.join_split(&ranks)).map_err(setup_to_py)?;
        Ok(sub.map(PyGroup::from))
    }

    /// A window whose memory starts as a copy of `init` (a host or CUDA
    /// tensor the caller keeps alive for the call; collective: see
    /// `ProcessGroup::new_window_from`).
    fn new_window(&self, py: Python<'_>, init: Desc) -> PyResult<crate::window::PyWindow> {
        // SAFETY: the caller holds the tensor for the duration of the call.
        let init = unsafe { init.view() }.map_err(to_py)?;
        py.detach(|| self.0.pg.new_window_from(init)).map(crate::window::PyWindow::new).map_err(to_py)
    }

    /// This group for weft's C++ torch backend: a handle (one more
    /// reference, given back through the C API) for the functions in
    /// `_weft.TORCH_API` (see `torch_api.rs`).
    fn _torch_handle(&self) -> usize {
        crate::torch_api::group_handle(&self.0)
    }

    /// End every in-flight op with an error and fail later ones.
    fn abort(&self) {
        self.0.pg.abort();
    }

    /// The worst communication error this group's ops have met, as torch's
    /// `ErrorType` value: 0 none, 1 timeout, 2 a transport failure or an
    /// abort, 3 a peer lost. A bad argument does not count.
    fn error_code(&self) -> u8 {
        self.0.health.code()
    }

    /// Call `callback()` once, on a Python thread, after this group has
    /// aborted (`abort`, a revoke, or an op's error that made it
    /// unusable): when Python first learns of an error after that.
    fn set_abort_callback(&self, callback: Py<PyAny>) {
        self.0.health.set_abort_callback(callback);
    }

    /// Fail this rank's pending and later ops, and make peers' ops with it
    /// fail (see `ProcessGroup::revoke`): what comes before a shrink that
    /// must not wait for ops in flight.
    fn revoke(&self) {
        self.0.pg.revoke();
    }

    /// A new group of the survivors (see `ProcessGroup::shrink`), leaving
    /// out `exclude` and every rank found dead, waiting at most `wait`
    /// seconds for ranks not heard from; with the ranks of this group it
    /// holds (in their new order). Every survivor calls it.
    #[pyo3(signature = (exclude, wait = None))]
    fn shrink(&self, py: Python<'_>, exclude: Vec<usize>, wait: Option<f64>) -> PyResult<(PyGroup, Vec<usize>)> {
        let mut opts = weft::ShrinkOptions::default().exclude(exclude);
        if let Some(w) = wait.filter(|w| *w > 0.0) {
            opts = opts.wait(seconds(w)?);
        }
        let rank = self.0.pg.rank() as u64;
        let (pg, members) = py
            .detach(|| {
                let pg = self.0.pg.shrink(&opts)?;
                // Who is in it: each member's rank in this group.
                let mut members = vec![0u64; pg.size()];
                pg.all_gather_single(&mut members[..], &[rank][..], &OpOptions::default())?.wait()?;
                Ok::<_, weft::Error>((pg, members))
            })
            .map_err(to_py)?;
        Ok((PyGroup::from(pg), members.into_iter().map(|r| r as usize).collect()))
    }

    /// Send `t` to `dst` under `tag`.
    fn send(&self, py: Python<'_>, t: Desc, dst: usize, tag: u32, call: Call) -> PyResult<PyWork> {
        // SAFETY (every op below): `issue` keeps the tensors alive.
        self.issue(py, call, |u, o| via!(u, |c| c.send(unsafe { t.view() }?, dst, tag, o)))
    }

    /// Receive into `t` from `src` under `tag`.
    fn recv(&self, py: Python<'_>, t: Desc, src: usize, tag: u32, call: Call) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| via!(u, |c| c.recv(unsafe { t.view_mut() }?, src, tag, o)))
    }

    /// Receive into `t` from any rank under `tag` (`Work.source()` names it).
    fn recv_any(&self, py: Python<'_>, t: Desc, tag: u32, call: Call) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| via!(u, |c| c.recv_any(unsafe { t.view_mut() }?, tag, o)))
    }

    /// Sends and receives as one unit: `(is_send, t, peer, tag)` each.
    fn batch_p2p(&self, py: Python<'_>, ops: Vec<(bool, Desc, usize, u32)>, call: Call) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| {
            let ops = ops
                .iter()
                .map(|&(send, t, peer, tag)| {
                    Ok(if send { P2pOp::send(unsafe { t.view() }?, peer, tag) } else { P2pOp::recv(unsafe { t.view_mut() }?, peer, tag) })
                })
                .collect::<weft::Result<Vec<_>>>()?;
            via!(u, |c| c.batch_p2p(ops, o))
        })
    }

    /// Copy `root`'s `t` into every rank's.
    fn broadcast(&self, py: Python<'_>, t: Desc, root: usize, call: Call) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| via!(u, |c| c.broadcast(unsafe { t.view_mut() }?, root, o)))
    }

    /// Reduce every rank's `t` with `op` (weft's name, e.g. `sum`,
    /// `premul_sum(0.5)`) into every rank's.
    fn all_reduce(&self, py: Python<'_>, t: Desc, op: &str, call: Call) -> PyResult<PyWork> {
        let op = reduce_op(op)?;
        self.issue(py, call, |u, o| via!(u, |c| c.all_reduce(unsafe { t.view_mut() }?, op, o)))
    }

    /// Reduce every rank's `t` into `root`'s.
    fn reduce(&self, py: Python<'_>, t: Desc, root: usize, op: &str, call: Call) -> PyResult<PyWork> {
        let op = reduce_op(op)?;
        self.issue(py, call, |u, o| via!(u, |c| c.reduce(unsafe { t.view_mut() }?, root, op, o)))
    }

    /// `outs[i]` receives rank i's `input`; with `uneven`, sizes may differ
    /// per rank.
    fn all_gather(&self, py: Python<'_>, outs: Vec<Desc>, input: Desc, uneven: bool, call: Call) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| {
            let (outs, input) = unsafe { (views_mut(&outs)?, input.view()?) };
            via!(u, |c| if uneven { c.all_gather_v(outs, input, o) } else { c.all_gather(outs, input, o) })
        })
    }

    /// Rank i's `input` lands in the i-th of W equal parts of `out`.
    fn all_gather_single(&self, py: Python<'_>, out: Desc, input: Desc, call: Call) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| via!(u, |c| c.all_gather_single(unsafe { out.view_mut() }?, unsafe { input.view() }?, o)))
    }

    /// `out` becomes the reduction over ranks of their `inputs[rank]`; with
    /// `uneven`, sizes may differ per destination.
    fn reduce_scatter(&self, py: Python<'_>, out: Desc, inputs: Vec<Desc>, op: &str, uneven: bool, call: Call) -> PyResult<PyWork> {
        let op = reduce_op(op)?;
        self.issue(py, call, |u, o| {
            let (out, inputs) = unsafe { (out.view_mut()?, views(&inputs)?) };
            via!(u, |c| if uneven { c.reduce_scatter_v(out, inputs, op, o) } else { c.reduce_scatter(out, inputs, op, o) })
        })
    }

    /// The i-th of W equal parts of every rank's `input`, reduced into rank
    /// i's `out`.
    fn reduce_scatter_single(&self, py: Python<'_>, out: Desc, input: Desc, op: &str, call: Call) -> PyResult<PyWork> {
        let op = reduce_op(op)?;
        self.issue(py, call, |u, o| via!(u, |c| c.reduce_scatter_single(unsafe { out.view_mut() }?, unsafe { input.view() }?, op, o)))
    }

    /// `outs[i]` receives rank i's `inputs[rank]`.
    fn all_to_all(&self, py: Python<'_>, outs: Vec<Desc>, inputs: Vec<Desc>, call: Call) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| via!(u, |c| c.all_to_all(unsafe { views_mut(&outs) }?, unsafe { views(&inputs) }?, o)))
    }

    /// Part i of `input` goes to rank i, part i of `out` comes from rank i:
    /// W equal parts, or the given split sizes (in elements).
    fn all_to_all_single(
        &self,
        py: Python<'_>,
        out: Desc,
        input: Desc,
        out_splits: Option<Vec<usize>>,
        in_splits: Option<Vec<usize>>,
        call: Call,
    ) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| {
            let (out, input) = unsafe { (out.view_mut()?, input.view()?) };
            via!(u, |c| match (&out_splits, &in_splits) {
                (Some(os), Some(is)) => c.all_to_all_v_single(out, input, os, is, o),
                _ => c.all_to_all_single(out, input, o),
            })
        })
    }

    /// At `root`, `outs[i]` receives rank i's `input` (`outs` empty elsewhere).
    fn gather(&self, py: Python<'_>, outs: Vec<Desc>, input: Desc, root: usize, call: Call) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| via!(u, |c| c.gather(unsafe { views_mut(&outs) }?, unsafe { input.view() }?, root, o)))
    }

    /// Every rank's `out` receives `root`'s `inputs[rank]` (`inputs` empty elsewhere).
    fn scatter(&self, py: Python<'_>, out: Desc, inputs: Vec<Desc>, root: usize, call: Call) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| via!(u, |c| c.scatter(unsafe { out.view_mut() }?, unsafe { views(&inputs) }?, root, o)))
    }

    /// Every rank has entered it (after this rank's earlier collectives).
    fn barrier(&self, py: Python<'_>, call: Call) -> PyResult<PyWork> {
        self.issue(py, call, |u, o| via!(u, |c| c.barrier(o)))
    }

    /// Reduce every rank's sparse COO tensor (`indices` i64 `[sparse_dims,
    /// nnz]`, `values` `[nnz, dense...]`, full `shape`) with `op` (sum, min,
    /// max); `Work.sparse_result()` gives the coalesced result. Always in
    /// the background (`call`'s `direct` does not apply): weft allocates the
    /// result, which the work holds.
    fn all_reduce_sparse(
        &self,
        indices: Desc,
        sparse_dims: usize,
        values: Desc,
        shape: Vec<usize>,
        op: &str,
        call: Call,
    ) -> PyResult<PyWork> {
        let op = reduce_op(op)?;
        // SAFETY: as `issue`: `keep` holds both tensors.
        let (i, v) = unsafe { (indices.view(), values.view()) };
        let (i, v) = (i.map_err(to_py)?, v.map_err(to_py)?);
        let nnz = i.numel() / sparse_dims.max(1);
        let input = SparseCooTensor::new(i.reshape(&[sparse_dims, nnz]).map_err(to_py)?, v, shape).map_err(to_py)?;
        let mut out = Box::new(SparseCoo::default());
        // SAFETY: the box goes into the PyWork with the op's handle and is
        // dropped after it, so it outlives every write of the op; nothing
        // reads it before the op has finished (`sparse_result` checks).
        let slot: &'static mut SparseCoo = unsafe { &mut *(out.as_mut() as *mut SparseCoo) };
        // SAFETY: as `issue`.
        let u = unsafe { self.0.pg.unscoped() };
        let issued = std::time::Instant::now();
        let work = u.all_reduce_sparse(slot, input, op, &call.options).map_err(to_py)?;
        Ok(PyWork::new(work, issued, call.keep, Some(out)).watched(&self.0.health))
    }
}
