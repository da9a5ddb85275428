//! Host services handed to plugins: the group's store and logging, as
//! `extern "C"` functions over a `HostState`. None of them unwinds.

use super::abi::{self, HostV1, Status};
use crate::error::{Error, ErrorKind};
use crate::store::Store;
use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

/// What `host_ctx` points to; owned by the plugin backend for its lifetime.
pub struct HostState {
    pub store: Arc<dyn Store>,
    pub plugin: String,
}

/// The status a weft error maps to.
pub fn status_of(e: &Error) -> Status {
    match e.kind() {
        ErrorKind::Timeout => abi::ERR_TIMEOUT,
        ErrorKind::PeerLost { .. } => abi::ERR_PEER_LOST,
        ErrorKind::InvalidArgument => abi::ERR_INVALID,
        ErrorKind::Unsupported => abi::ERR_UNSUPPORTED,
        ErrorKind::Aborted => abi::ERR_ABORTED,
        _ => abi::ERR_BACKEND,
    }
}

/// Run `f` on the state behind `ctx`, mapping errors and panics to statuses.
unsafe fn with_state(ctx: *mut c_void, f: impl FnOnce(&HostState) -> crate::Result<()>) -> Status {
    if ctx.is_null() {
        return abi::ERR_INVALID;
    }
    // SAFETY: ctx is the host_ctx weft passed to init, pointing to a
    // HostState that outlives the plugin context (see PluginBackend).
    let state = unsafe { &*(ctx as *const HostState) };
    match catch_unwind(AssertUnwindSafe(|| f(state))) {
        Ok(Ok(())) => abi::OK,
        Ok(Err(e)) => status_of(&e),
        Err(_) => abi::ERR_BACKEND,
    }
}

unsafe fn key<'a>(k: *const c_char) -> crate::Result<&'a str> {
    if k.is_null() {
        return Err(Error::invalid("null store key"));
    }
    // SAFETY: the plugin passes a NUL-terminated string valid for the call.
    unsafe { CStr::from_ptr(k) }.to_str().map_err(|_| Error::invalid("store key is not UTF-8"))
}

fn ms(t: i64) -> Duration {
    Duration::from_millis(t.max(0) as u64)
}

unsafe extern "C" fn store_set(ctx: *mut c_void, k: *const c_char, v: *const c_void, len: usize) -> Status {
    // SAFETY: see with_state; `v` holds `len` bytes for the call.
    unsafe {
        with_state(ctx, |s| {
            let value = if len == 0 { &[][..] } else { std::slice::from_raw_parts(v as *const u8, len) };
            s.store.set(key(k)?, value)
        })
    }
}

unsafe extern "C" fn store_get(ctx: *mut c_void, k: *const c_char, timeout: i64, buf: *mut c_void, cap: usize, len: *mut usize) -> Status {
    // SAFETY: see with_state; buf holds cap bytes and len is writable.
    unsafe {
        with_state(ctx, |s| {
            let v = s.store.get(key(k)?, ms(timeout))?;
            let n = v.len().min(cap);
            if n > 0 {
                std::ptr::copy_nonoverlapping(v.as_ptr(), buf as *mut u8, n);
            }
            if !len.is_null() {
                *len = v.len();
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn store_add(ctx: *mut c_void, k: *const c_char, delta: i64, out: *mut i64) -> Status {
    // SAFETY: see with_state; out is writable or null.
    unsafe {
        with_state(ctx, |s| {
            let v = s.store.add(key(k)?, delta)?;
            if !out.is_null() {
                *out = v;
            }
            Ok(())
        })
    }
}

unsafe extern "C" fn store_wait(ctx: *mut c_void, keys: *const *const c_char, n: usize, timeout: i64) -> Status {
    // SAFETY: see with_state; keys holds n strings.
    unsafe {
        with_state(ctx, |s| {
            let ks = (0..n).map(|i| key(*keys.add(i))).collect::<crate::Result<Vec<&str>>>()?;
            s.store.wait(&ks, ms(timeout))
        })
    }
}

unsafe extern "C" fn log(ctx: *mut c_void, level: i32, msg: *const c_char) {
    // SAFETY: see with_state and key.
    unsafe {
        with_state(ctx, |s| {
            let m = key(msg).unwrap_or("(unreadable message)");
            match level {
                0 | 1 => eprintln!("[weft plugin {}] {m}", s.plugin),
                2 => crate::log::info(format_args!("plugin {}: {m}", s.plugin)),
                _ => crate::log::debug(format_args!("plugin {}: {m}", s.plugin)),
            }
            Ok(())
        });
    }
}

/// The service table for `state`.
pub fn table(state: &HostState) -> HostV1 {
    HostV1 {
        struct_size: std::mem::size_of::<HostV1>() as u32,
        abi_version: abi::ABI_VERSION,
        host_ctx: state as *const HostState as *mut c_void,
        store_set,
        store_get,
        store_add,
        store_wait,
        log,
    }
}
