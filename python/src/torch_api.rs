//! weft's ops for C++ callers: the C functions weft's C++ `c10d::Backend`
//! (`weft/_c10d/backend.cpp`) calls for the common CPU ops, so that torch
//! reaches weft without Python in between.
//!
//! They travel as one table of function pointers ([`Api`]) in the capsule
//! `_weft.TORCH_API`; a group is handed over as the integer
//! `Group._torch_handle()` (a counted reference, given back with
//! [`Api::group_release`]). The C++ side keeps an op's tensors alive and
//! hands the op back with [`Api::release`], whose callback runs once the
//! op can no longer touch them. Errors come back as Python exception
//! objects (new references, the types `weft/_errors.py` registers), which
//! the C++ side raises. Nothing panics across: a panic is an error.
//!
//! The layout is mirrored in `backend.cpp` (`weft_api`); a change to it
//! bumps [`VERSION`].

use crate::errors::to_py;
use crate::group::{via, Issuer, Native};
use crate::tensor::{views, views_mut, Desc};
use crate::work::{Keep, OpHandle};
use pyo3::ffi::PyObject;
use pyo3::prelude::*;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};
use weft::{Collectives, Error, OpOptions, ReduceOp, Result};

/// The table's version: the C++ side refuses any other.
pub const VERSION: u32 = 1;

/// Op kinds ([`OpArgs::kind`]).
mod kind {
    pub const ALL_REDUCE: u32 = 1;
    pub const BROADCAST: u32 = 2;
    pub const REDUCE: u32 = 3;
    pub const ALL_GATHER: u32 = 4;
    pub const ALL_GATHER_SINGLE: u32 = 5;
    pub const REDUCE_SCATTER_SINGLE: u32 = 6;
    pub const ALL_TO_ALL_SINGLE: u32 = 7;
    pub const ALL_TO_ALL: u32 = 8;
    pub const SEND: u32 = 9;
    pub const RECV: u32 = 10;
    pub const RECV_ANY: u32 = 11;
    pub const BARRIER: u32 = 12;
}

/// A contiguous tensor: data pointer, element count, weft's dtype code,
/// device (-1: the CPU, else a CUDA index).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct TensorArg {
    ptr: *mut c_void,
    numel: u64,
    dtype: u8,
    device: i32,
}

/// One op: its kind, its tensors and settings.
#[repr(C)]
pub struct OpArgs {
    kind: u32,
    /// torch's `RedOpType` code (SUM 0, AVG 1, PRODUCT 2, MIN 3, MAX 4,
    /// BAND 5, BOR 6, BXOR 7); PREMUL_SUM is not taken here.
    reduce: u32,
    /// The root, destination or source rank.
    peer: i64,
    tag: u32,
    /// Run it on the calling thread (finished on return) instead of in
    /// the background.
    direct: u8,
    /// Milliseconds; 0 or less: the group's.
    timeout_ms: i64,
    outs: *const TensorArg,
    n_outs: usize,
    ins: *const TensorArg,
    n_ins: usize,
    /// An all_to_all_single's split sizes in elements, `n_splits` each;
    /// with 0, equal parts.
    out_splits: *const u64,
    in_splits: *const u64,
    n_splits: usize,
}

/// A C callback and its argument, called once when dropped (if set).
#[repr(C)]
pub struct Release {
    call: Option<unsafe extern "C" fn(*mut c_void)>,
    ctx: *mut c_void,
}

// SAFETY: the C++ side's callbacks may run on any thread (they only queue
// work for its own thread, or free what it allocated for this op).
unsafe impl Send for Release {}
// SAFETY: nothing reads a Release through a shared reference (only its
// drop, which has it exclusively, calls it).
unsafe impl Sync for Release {}

impl Drop for Release {
    fn drop(&mut self) {
        if let Some(call) = self.call.take() {
            // SAFETY: the C++ side's promise: `call(ctx)` is valid once.
            unsafe { call(self.ctx) }
        }
    }
}

/// Calls its [`Release`] once, when woken.
struct CallOnce(Mutex<Option<Release>>);

impl Wake for CallOnce {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        drop(self.0.lock().unwrap_or_else(|p| p.into_inner()).take());
    }
}

/// The function table in the capsule.
#[repr(C)]
pub struct Api {
    pub version: u32,
    /// Start an op on a group: its handle, or null with `*err` set.
    pub start: unsafe extern "C" fn(*const Native, *const OpArgs, *mut *mut PyObject) -> *mut OpHandle,
    /// Wait at most `timeout_ms` (0 or less: the op's own timeout): 1
    /// finished, 0 still running, -1 failed with `*err` set.
    pub wait: unsafe extern "C" fn(*const OpHandle, i64, *mut *mut PyObject) -> i32,
    /// 1 once the op has finished (successfully or not).
    pub is_completed: unsafe extern "C" fn(*const OpHandle) -> u8,
    /// 1 if the op failed, with `*err` set when `err` is not null.
    pub failed: unsafe extern "C" fn(*const OpHandle, *mut *mut PyObject) -> u8,
    /// A receive from any rank's sender once finished, else -1.
    pub source: unsafe extern "C" fn(*const OpHandle) -> i64,
    /// Milliseconds from issue to the end of the host side; -1 while running.
    pub duration_ms: unsafe extern "C" fn(*const OpHandle) -> f64,
    /// Call `cb` once the op has finished, on the thread that finishes it
    /// (at once, on this thread, if it has).
    pub on_done: unsafe extern "C" fn(*const OpHandle, Release),
    /// Give the handle back; `cb` runs once the op can no longer touch its
    /// tensors (at once, on this thread, if it has finished).
    pub release: unsafe extern "C" fn(*mut OpHandle, Release),
    /// Give a group handle back.
    pub group_release: unsafe extern "C" fn(*const Native),
}

static API: Api = Api { version: VERSION, start, wait, is_completed, failed, source, duration_ms, on_done, release, group_release };

/// The capsule holding the table.
pub fn capsule(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyCapsule>> {
    // SAFETY: the table is static: valid for as long as the capsule.
    unsafe { pyo3::types::PyCapsule::new_with_pointer(py, std::ptr::NonNull::from(&API).cast(), c"weft._weft.TORCH_API") }
}

/// A group as a handle for C++: one more reference to it.
pub fn group_handle(native: &Arc<Native>) -> usize {
    Arc::into_raw(native.clone()) as usize
}

/// `e` as a new reference to a Python exception, stored in `*err`.
fn raise(e: Error, err: *mut *mut PyObject) {
    if err.is_null() {
        return;
    }
    let exc = Python::attach(|py| to_py(e).into_value(py).into_ptr());
    // SAFETY: the caller passes a valid slot.
    unsafe { *err = exc };
}

/// `f`'s result, with a panic made an error.
fn guarded<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| Err(Error::backend("weft: a panic in weft's C API (a bug)")))
}

/// # Safety
/// `p` points to `n` tensor arguments (or `n` is 0).
unsafe fn descs(p: *const TensorArg, n: usize) -> Vec<Desc> {
    if n == 0 {
        return Vec::new();
    }
    // SAFETY: the caller's promise.
    unsafe { std::slice::from_raw_parts(p, n) }
        .iter()
        .map(|t| Desc::new(t.ptr as usize, t.numel as usize, t.dtype, t.device as i64))
        .collect()
}

fn reduce_op(code: u32) -> Result<ReduceOp> {
    Ok(match code {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Avg,
        2 => ReduceOp::Product,
        3 => ReduceOp::Min,
        4 => ReduceOp::Max,
        5 => ReduceOp::Band,
        6 => ReduceOp::Bor,
        7 => ReduceOp::Bxor,
        c => return Err(Error::invalid(format!("reduce op code {c} is not one weft's C API takes"))),
    })
}

fn rank(peer: i64) -> usize {
    // A negative rank is out of range like any other: weft says so.
    usize::try_from(peer).unwrap_or(usize::MAX)
}

fn first(d: &[Desc]) -> Result<Desc> {
    d.first().copied().ok_or_else(|| Error::invalid("an op is missing its tensor"))
}

/// Issue the op `a` describes.
///
/// # Safety
/// As [`Native::start`] for the tensors `outs` and `ins` describe; `a`'s
/// split pointers hold `n_splits` values each.
unsafe fn run(u: &Issuer<'_>, a: &OpArgs, outs: &[Desc], ins: &[Desc], o: &OpOptions) -> Result<weft::Work<'static>> {
    // SAFETY (each view): the caller's promise.
    unsafe {
        match a.kind {
            kind::ALL_REDUCE => {
                let op = reduce_op(a.reduce)?;
                via!(u, |c| c.all_reduce(first(outs)?.view_mut()?, op, o))
            }
            kind::BROADCAST => via!(u, |c| c.broadcast(first(outs)?.view_mut()?, rank(a.peer), o)),
            kind::REDUCE => {
                let op = reduce_op(a.reduce)?;
                via!(u, |c| c.reduce(first(outs)?.view_mut()?, rank(a.peer), op, o))
            }
            kind::ALL_GATHER => via!(u, |c| c.all_gather(views_mut(outs)?, first(ins)?.view()?, o)),
            kind::ALL_GATHER_SINGLE => via!(u, |c| c.all_gather_single(first(outs)?.view_mut()?, first(ins)?.view()?, o)),
            kind::REDUCE_SCATTER_SINGLE => {
                let op = reduce_op(a.reduce)?;
                via!(u, |c| c.reduce_scatter_single(first(outs)?.view_mut()?, first(ins)?.view()?, op, o))
            }
            kind::ALL_TO_ALL_SINGLE => {
                let (out, input) = (first(outs)?.view_mut()?, first(ins)?.view()?);
                if a.n_splits == 0 {
                    via!(u, |c| c.all_to_all_single(out, input, o))
                } else {
                    let split = |p: *const u64| std::slice::from_raw_parts(p, a.n_splits).iter().map(|&s| s as usize).collect::<Vec<_>>();
                    let (os, is) = (split(a.out_splits), split(a.in_splits));
                    via!(u, |c| c.all_to_all_v_single(out, input, &os, &is, o))
                }
            }
            kind::ALL_TO_ALL => via!(u, |c| c.all_to_all(views_mut(outs)?, views(ins)?, o)),
            kind::SEND => via!(u, |c| c.send(first(ins)?.view()?, rank(a.peer), a.tag, o)),
            kind::RECV => via!(u, |c| c.recv(first(outs)?.view_mut()?, rank(a.peer), a.tag, o)),
            kind::RECV_ANY => via!(u, |c| c.recv_any(first(outs)?.view_mut()?, a.tag, o)),
            kind::BARRIER => via!(u, |c| c.barrier(o)),
            k => Err(Error::invalid(format!("op kind {k} is not one weft's C API knows"))),
        }
    }
}

unsafe extern "C" fn start(group: *const Native, args: *const OpArgs, err: *mut *mut PyObject) -> *mut OpHandle {
    let r = guarded(|| {
        // SAFETY: the C++ side passes a live group handle and valid args.
        let (g, a) = unsafe { (&*group, &*args) };
        // SAFETY: `a` describes its tensor arrays.
        let (outs, ins) = unsafe { (descs(a.outs, a.n_outs), descs(a.ins, a.n_ins)) };
        let timeout = (a.timeout_ms > 0).then(|| Duration::from_millis(a.timeout_ms as u64));
        let options = OpOptions { timeout, ..OpOptions::default() };
        let issued = Instant::now();
        // SAFETY: the C++ side holds the tensors until the op has finished
        // (its `release` callback), and does not touch them meanwhile.
        let work = unsafe { g.start(a.direct != 0, &options, |u, o| run(u, a, &outs, &ins, o)) }?;
        Ok(Box::into_raw(Box::new(
            OpHandle::new(work, issued, Keep::Cpp(Release { call: None, ctx: std::ptr::null_mut() }), None).watched(&g.health),
        )))
    });
    r.unwrap_or_else(|e| {
        raise(e, err);
        std::ptr::null_mut()
    })
}

unsafe extern "C" fn wait(w: *const OpHandle, timeout_ms: i64, err: *mut *mut PyObject) -> i32 {
    // SAFETY: the C++ side passes a handle it has not released.
    let w = unsafe { &*w };
    let timeout = (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms as u64));
    match guarded(|| w.wait(timeout)) {
        Ok(true) => 1,
        Ok(false) => 0,
        Err(e) => {
            raise(e, err);
            -1
        }
    }
}

unsafe extern "C" fn is_completed(w: *const OpHandle) -> u8 {
    // SAFETY: as in `wait`.
    u8::from(unsafe { &*w }.work().is_completed())
}

unsafe extern "C" fn failed(w: *const OpHandle, err: *mut *mut PyObject) -> u8 {
    // SAFETY: as in `wait`.
    match unsafe { &*w }.error() {
        Some(e) => {
            raise(e, err);
            1
        }
        None => 0,
    }
}

unsafe extern "C" fn source(w: *const OpHandle) -> i64 {
    // SAFETY: as in `wait`.
    unsafe { &*w }.work().source().map_or(-1, |s| s as i64)
}

unsafe extern "C" fn duration_ms(w: *const OpHandle) -> f64 {
    // SAFETY: as in `wait`.
    unsafe { &*w }.duration().unwrap_or(-1.0)
}

unsafe extern "C" fn on_done(w: *const OpHandle, cb: Release) {
    let once = Arc::new(CallOnce(Mutex::new(Some(cb))));
    // SAFETY: as in `wait`.
    if !unsafe { &*w }.work().wake_when_done(&Waker::from(once.clone())) {
        once.wake_by_ref();
    }
}

unsafe extern "C" fn release(w: *mut OpHandle, cb: Release) {
    // SAFETY: the C++ side gives back a handle `start` made, once.
    let mut w = unsafe { Box::from_raw(w) };
    w.keep_until_done(Keep::Cpp(cb));
    // Dropped: the callback runs now if the op has finished, else once it
    // has (the handle parks itself).
    drop(w);
}

unsafe extern "C" fn group_release(g: *const Native) {
    // SAFETY: a handle `group_handle` made, given back once.
    drop(unsafe { Arc::from_raw(g) });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::health::Health;
    use std::ptr::{null, null_mut};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use weft::{GroupOptions, ProcessGroup};

    static RELEASED: AtomicUsize = AtomicUsize::new(0);

    unsafe extern "C" fn count(_: *mut c_void) {
        RELEASED.fetch_add(1, Ordering::SeqCst);
    }

    fn args(kind: u32, outs: &TensorArg) -> OpArgs {
        OpArgs {
            kind,
            reduce: 0,
            peer: 0,
            tag: 0,
            direct: 0,
            timeout_ms: 0,
            outs,
            n_outs: 1,
            ins: null(),
            n_ins: 0,
            out_splits: null(),
            in_splits: null(),
            n_splits: 0,
        }
    }

    #[test]
    fn an_op_runs_through_the_table_and_its_release_runs_once() {
        weft_builtin::link();
        let store = Arc::new(weft::store::MemoryStore::new(Duration::from_secs(5)));
        let pg = ProcessGroup::new(store, 0, 1, GroupOptions::default().backend("loopback")).unwrap();
        let native = Arc::new(Native { pg, health: Health::default() });
        let group = group_handle(&native) as *const Native;
        let mut x = [1.5f32, -2.0];
        let t = TensorArg { ptr: x.as_mut_ptr().cast(), numel: 2, dtype: 0, device: -1 };
        let mut err = null_mut();
        for direct in [0, 1] {
            let a = OpArgs { direct, ..args(kind::ALL_REDUCE, &t) };
            // SAFETY: a live group handle, and `x` outlives the op.
            unsafe {
                let w = (API.start)(group, &a, &mut err);
                assert!(!w.is_null() && err.is_null());
                assert_eq!((API.wait)(w, 0, &mut err), 1);
                assert_eq!(((API.is_completed)(w), (API.failed)(w, null_mut()), (API.source)(w)), (1, 0, -1));
                assert!((API.duration_ms)(w) >= 0.0);
                let before = RELEASED.load(Ordering::SeqCst);
                (API.release)(w, Release { call: Some(count), ctx: null_mut() });
                assert_eq!(RELEASED.load(Ordering::SeqCst), before + 1);
            }
        }
        assert_eq!(x, [1.5, -2.0]); // a sum over one rank
                                    // SAFETY: the handle `group_handle` made, given back once.
        unsafe { (API.group_release)(group) };
        assert_eq!(Arc::strong_count(&native), 1);
    }

    #[test]
    fn reduce_codes_are_torchs_and_premul_sum_is_refused() {
        assert_eq!(reduce_op(0).unwrap(), ReduceOp::Sum);
        assert_eq!(reduce_op(1).unwrap(), ReduceOp::Avg);
        assert_eq!(reduce_op(7).unwrap(), ReduceOp::Bxor);
        assert!(reduce_op(8).is_err());
    }
}
