//! Turn a Rust [`BackendFactory`] into a weft plugin (`cdylib`) with one
//! macro, [`export_backend!`]. Every entry point catches panics and maps
//! errors to statuses, so nothing unwinds across the C boundary.

#![warn(missing_docs)]
#![allow(clippy::missing_safety_doc)]

mod host_store;

pub use weft;

use host_store::HostStore;
use std::ffi::{c_char, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft::backend::{Backend, BackendContext, P2p};
use weft::plugin::abi::{self, InitV1, P2pV1, Status};
use weft::registry::BackendFactory;
use weft::Error;

/// Device bit for CPU (for the macro's `devices = ...`).
pub const CPU: u32 = abi::DEVICE_CPU;
/// Device bit for CUDA.
pub const CUDA: u32 = abi::DEVICE_CUDA;
/// Layout bit for dense tensors.
pub const DENSE: u32 = abi::LAYOUT_DENSE;
/// Layout bit for sparse COO tensors.
pub const SPARSE_COO: u32 = abi::LAYOUT_SPARSE_COO;

/// What the macro's generated type provides: the factory.
pub trait Provider: 'static {
    /// The plugin's factory.
    fn factory() -> &'static dyn BackendFactory;
}

/// Export `weft_backend_v1` for the factory in the static `$factory`.
#[macro_export]
macro_rules! export_backend {
    ($factory:path, name = $name:literal, devices = $devices:expr, layouts = $layouts:expr, priority = $priority:expr $(,)?) => {
        #[doc(hidden)]
        pub struct __WeftPluginProvider;
        impl $crate::Provider for __WeftPluginProvider {
            fn factory() -> &'static dyn $crate::weft::registry::BackendFactory {
                &$factory
            }
        }
        /// The plugin's ABI v1 table.
        #[unsafe(no_mangle)]
        #[allow(non_upper_case_globals)]
        pub static weft_backend_v1: $crate::weft::plugin::abi::BackendV1 = $crate::table::<__WeftPluginProvider>(
            concat!($name, "\0").as_ptr() as *const ::std::ffi::c_char,
            $devices,
            $layouts,
            $priority,
        );
    };
}

/// The ABI table for provider `P` (used by [`export_backend!`]).
pub const fn table<P: Provider>(name: *const c_char, devices: u32, layouts: u32, priority: i32) -> abi::BackendV1 {
    abi::BackendV1 {
        struct_size: std::mem::size_of::<abi::BackendV1>() as u32,
        abi_version: abi::ABI_VERSION,
        name,
        devices,
        layouts,
        priority,
        probe: Some(probe::<P>),
        init: Some(init::<P>),
        destroy: Some(destroy),
        start: Some(start),
        wait: Some(wait),
        cancel: Some(cancel),
        abort: Some(abort),
        last_error: Some(last_error),
        all_reduce: None,
        broadcast: None,
        barrier: None,
        // Requests are posted to the backend, which progresses them
        // together (where it posts; otherwise each finishes inside start).
        flags: abi::PLUGIN_CONCURRENT,
    }
}

/// Per-group state behind the opaque ctx.
struct Ctx {
    backend: Arc<dyn Backend>,
    error: Mutex<(CString, i32)>,
}

/// A finished batch (the SDK completes batches inside `start`).
/// A started request is an `Arc<Slot>` behind the raw pointer: its outcome
/// once the backend has finished it (set at once where it does not post).
type Request = weft::backend::progress::Slot;

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

fn write_c(buf: *mut c_char, cap: usize, msg: &str) {
    if buf.is_null() || cap == 0 {
        return;
    }
    let n = msg.len().min(cap - 1);
    // SAFETY: the host gives `cap` writable bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr() as *const c_char, buf, n);
        *buf.add(n) = 0;
    }
}

impl Ctx {
    /// Record `e` as the last error and return its status.
    fn set_error(&self, e: &Error) -> Status {
        let peer = match e.kind() {
            weft::ErrorKind::PeerLost { rank } => *rank as i32,
            _ => -1,
        };
        let msg = CString::new(e.to_string().replace('\0', " ")).unwrap_or_default();
        *self.error.lock().unwrap_or_else(|p| p.into_inner()) = (msg, peer);
        weft::plugin::status_of(e)
    }
}

/// Run `f` on the ctx, turning errors and panics into a status.
unsafe fn on_ctx(ctx: *mut c_void, f: impl FnOnce(&Ctx) -> weft::Result<Status>) -> Status {
    if ctx.is_null() {
        return abi::ERR_INVALID;
    }
    // SAFETY: ctx came from `init` and is live until `destroy`.
    let c = unsafe { &*(ctx as *const Ctx) };
    match catch_unwind(AssertUnwindSafe(|| f(c))) {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => c.set_error(&e),
        Err(p) => c.set_error(&Error::backend(format!("plugin panicked: {}", panic_message(p)))),
    }
}

unsafe extern "C" fn probe<P: Provider>(why: *mut c_char, cap: usize) -> Status {
    match catch_unwind(|| P::factory().probe()) {
        Ok(Ok(())) => abi::OK,
        Ok(Err(reason)) => {
            write_c(why, cap, &reason);
            abi::ERR_UNSUPPORTED
        }
        Err(p) => {
            write_c(why, cap, &format!("probe panicked: {}", panic_message(p)));
            abi::ERR_BACKEND
        }
    }
}

unsafe extern "C" fn init<P: Provider>(args: *const InitV1, out: *mut *mut c_void, err: *mut c_char, cap: usize) -> Status {
    let r = catch_unwind(AssertUnwindSafe(|| -> weft::Result<*mut c_void> {
        // SAFETY: the host passes a valid InitV1 whose strings live for the call
        // and whose host table lives until destroy (header contract).
        let a = unsafe { &*args };
        let mut hints = std::collections::HashMap::new();
        for i in 0..a.num_hints {
            // SAFETY: num_hints valid key/value string pointers.
            let (k, v) = unsafe { (std::ffi::CStr::from_ptr(*a.hint_keys.add(i)), std::ffi::CStr::from_ptr(*a.hint_values.add(i))) };
            hints.insert(k.to_string_lossy().into_owned(), v.to_string_lossy().into_owned());
        }
        let timeout = Duration::from_millis(a.timeout_ms.max(0) as u64);
        let ctx = BackendContext {
            rank: a.rank as usize,
            size: a.size as usize,
            store: Arc::new(HostStore::new(a.host, timeout)),
            timeout,
            hints,
            cpu_backend: None,
            group_ranks: (0..a.size as usize).collect(),
        };
        let backend = P::factory().create(ctx)?;
        Ok(Box::into_raw(Box::new(Ctx { backend, error: Mutex::new((CString::default(), -1)) })) as *mut c_void)
    }));
    match r {
        Ok(Ok(ctx)) => {
            // SAFETY: out is writable (header contract).
            unsafe { *out = ctx };
            abi::OK
        }
        Ok(Err(e)) => {
            write_c(err, cap, &e.to_string());
            weft::plugin::status_of(&e)
        }
        Err(p) => {
            write_c(err, cap, &format!("init panicked: {}", panic_message(p)));
            abi::ERR_BACKEND
        }
    }
}

unsafe extern "C" fn destroy(ctx: *mut c_void) {
    if ctx.is_null() {
        return;
    }
    let _ = catch_unwind(|| {
        // SAFETY: ctx came from init; destroy is called once.
        let c = unsafe { Box::from_raw(ctx as *mut Ctx) };
        c.backend.shutdown();
    });
}

unsafe extern "C" fn start(ctx: *mut c_void, ops: *const P2pV1, n: usize, timeout_ms: i64, req: *mut *mut c_void) -> Status {
    // SAFETY: see on_ctx; `ops` holds n entries whose buffers stay valid
    // until the request completes or is cancelled (the header's contract).
    unsafe {
        on_ctx(ctx, |c| {
            let raw = if n == 0 { &[][..] } else { std::slice::from_raw_parts(ops, n) };
            let mut batch: Vec<P2p<'_>> = raw
                .iter()
                .map(|o| {
                    let peer = o.peer as usize;
                    if o.kind == abi::P2P_SEND {
                        let data = if o.len == 0 { &[][..] } else { std::slice::from_raw_parts(o.buf as *const u8, o.len) };
                        P2p::Send { peer, tag: o.tag, data }
                    } else {
                        let buf = if o.len == 0 { &mut [][..] } else { std::slice::from_raw_parts_mut(o.buf as *mut u8, o.len) };
                        P2p::Recv { peer, tag: o.tag, buf }
                    }
                })
                .collect();
            let deadline = Instant::now() + Duration::from_millis(timeout_ms.max(0) as u64);
            let request = Arc::new(Request::default());
            if c.backend.capabilities().posts {
                // The host keeps the buffers until the request finishes.
                c.backend.post(weft::backend::progress::Post::new(&mut batch, &[], deadline, request.completer()));
            } else {
                let done = request.completer();
                done(c.backend.exchange(&mut batch, &weft::backend::Deadline::at(deadline)));
            }
            *req = Arc::into_raw(request) as *mut c_void;
            Ok(abi::OK)
        })
    }
}

unsafe extern "C" fn wait(ctx: *mut c_void, req: *mut c_void, timeout_ms: i64) -> Status {
    // SAFETY: req came from start; it is released here, once, when finished.
    unsafe {
        on_ctx(ctx, |c| {
            let request = &*(req as *const Request);
            let until = Instant::now() + Duration::from_millis(timeout_ms.max(0) as u64);
            // At least one turn of progress, even with a zero timeout.
            let turned = std::cell::Cell::new(false);
            c.backend.progress(&|| request.is_set() || (turned.replace(true) && Instant::now() >= until));
            if !request.is_set() {
                return Ok(abi::PENDING);
            }
            let request = Arc::from_raw(req as *const Request);
            request.take().map(|()| abi::OK)
        })
    }
}

unsafe extern "C" fn cancel(ctx: *mut c_void, req: *mut c_void) {
    if req.is_null() || ctx.is_null() {
        return;
    }
    // SAFETY: as in wait. Cancelling a posted request fails the backend
    // (nothing lets one batch go alone), which lets go of its buffers.
    unsafe {
        on_ctx(ctx, |c| {
            let request = Arc::from_raw(req as *const Request);
            if !request.is_set() {
                c.backend.abort(&Error::aborted("a request was cancelled"));
                c.backend.progress(&|| request.is_set());
            }
            Ok(abi::OK)
        });
    }
}

unsafe extern "C" fn abort(ctx: *mut c_void) {
    // SAFETY: see on_ctx; abort may come from any thread and Backend::abort is Sync.
    unsafe {
        on_ctx(ctx, |c| {
            c.backend.abort(&Error::aborted("aborted by the host"));
            Ok(abi::OK)
        });
    }
}

unsafe extern "C" fn last_error(ctx: *mut c_void, peer: *mut i32) -> *const c_char {
    if ctx.is_null() {
        return std::ptr::null();
    }
    // SAFETY: ctx is live; the returned pointer stays valid until the next
    // error is recorded on this ctx (header contract).
    let c = unsafe { &*(ctx as *const Ctx) };
    let g = c.error.lock().unwrap_or_else(|p| p.into_inner());
    if !peer.is_null() {
        // SAFETY: writable per the header.
        unsafe { *peer = g.1 };
    }
    g.0.as_ptr()
}
