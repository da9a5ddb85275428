//! A loaded plugin as a weft backend: the factory the registry holds and
//! the `Backend` each group gets.

use super::abi::{self, BackendV1, InitV1, P2pV1};
use super::host::{self, HostState};
use crate::backend::progress::{Done, Post, PostParts};
use crate::backend::BackendFactory;
use crate::backend::{Backend, BackendContext, Capabilities, Deadline, Op, OpContext, P2p};
use crate::error::{Error, Result};
use crate::tensor::{Device, DeviceKind, Layout};
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a waiting exchange wakes to check its deadline.
const POLL: Duration = Duration::from_millis(100);

/// A plugin's function table (copied, so fields it lacks read as null),
/// and the library it lives in, which is never unloaded.
pub struct PluginFactory {
    pub(super) table: BackendV1,
    pub(super) name: String,
    pub(super) path: String,
    pub(super) devices: Vec<DeviceKind>,
    pub(super) layouts: Vec<Layout>,
    pub(super) _lib: Arc<libloading::Library>,
}

// SAFETY: the table is an immutable copy of function pointers and a name
// pointer into a library that is never unloaded; the header requires
// `probe` and `init` to be callable from any thread.
unsafe impl Send for PluginFactory {}
// SAFETY: as above.
unsafe impl Sync for PluginFactory {}

impl PluginFactory {
    fn describe(&self) -> String {
        format!("plugin {} ({})", self.name, self.path)
    }
}

/// A NUL-terminated message from a C buffer.
pub(crate) fn message(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf.iter().take_while(|c| **c != 0).map(|c| *c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn ms(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

pub(crate) fn error_of(status: abi::Status, msg: String, peer: i32) -> Error {
    match status {
        abi::ERR_TIMEOUT => Error::timeout(msg),
        abi::ERR_PEER_LOST if peer >= 0 => Error::peer_lost(peer as usize, msg),
        abi::ERR_INVALID => Error::invalid(msg),
        abi::ERR_UNSUPPORTED => Error::unsupported(msg),
        abi::ERR_ABORTED => Error::aborted(msg),
        abi::PENDING => Error::backend(format!("{msg} (returned PENDING where a result was required)")),
        _ => Error::backend(msg),
    }
}

impl BackendFactory for PluginFactory {
    fn name(&self) -> &str {
        &self.name
    }
    fn devices(&self) -> &[DeviceKind] {
        &self.devices
    }
    fn layouts(&self) -> &[Layout] {
        &self.layouts
    }
    fn priority(&self) -> i32 {
        self.table.priority
    }
    fn origin(&self) -> String {
        format!("{} (ABI v{})", self.path, self.table.abi_version)
    }
    fn probe(&self) -> std::result::Result<(), String> {
        let probe = self.table.probe.expect("validated at load");
        let mut why = [0 as c_char; 512];
        // SAFETY: `why` is writable for its length; the plugin writes a NUL-terminated string.
        match unsafe { probe(why.as_mut_ptr(), why.len()) } {
            abi::OK => Ok(()),
            s => Err(format!("{} (status {s})", message(&why))),
        }
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        let host = Box::new(HostState { store: ctx.store.clone(), plugin: self.name.clone() });
        let table = Box::new(host::table(&host));
        let hints: Vec<(CString, CString)> =
            ctx.hints.iter().filter_map(|(k, v)| Some((CString::new(k.as_str()).ok()?, CString::new(v.as_str()).ok()?))).collect();
        let keys: Vec<*const c_char> = hints.iter().map(|(k, _)| k.as_ptr()).collect();
        let values: Vec<*const c_char> = hints.iter().map(|(_, v)| v.as_ptr()).collect();
        let args = InitV1 {
            struct_size: std::mem::size_of::<InitV1>() as u32,
            abi_version: abi::ABI_VERSION,
            rank: ctx.rank as u32,
            size: ctx.size as u32,
            timeout_ms: ms(ctx.timeout),
            num_hints: hints.len(),
            hint_keys: keys.as_ptr(),
            hint_values: values.as_ptr(),
            host: &*table,
        };
        let init = self.table.init.expect("validated at load");
        let mut pctx: *mut c_void = std::ptr::null_mut();
        let mut err = [0 as c_char; 1024];
        // SAFETY: args and everything it points to live across the call;
        // host and table are boxed and kept by the backend for its life.
        let status = unsafe { init(&args, &mut pctx, err.as_mut_ptr(), err.len()) };
        if status != abi::OK {
            return Err(error_of(status, format!("{}: init failed: {}", self.describe(), message(&err)), -1));
        }
        if pctx.is_null() {
            return Err(Error::backend(format!("{}: init returned no context", self.describe())));
        }
        Ok(Arc::new(PluginBackend {
            table: self.table.clone_table(),
            ctx: pctx,
            name: self.name.clone(),
            path: self.path.clone(),
            _host: host,
            _host_table: table,
            requests: std::sync::Mutex::new(Vec::new()),
            caps: Capabilities { posts: self.table.flags & abi::PLUGIN_CONCURRENT != 0, ..Capabilities::DEFAULT },
        }))
    }
}

impl BackendV1 {
    fn clone_table(&self) -> BackendV1 {
        // SAFETY: BackendV1 is plain data (integers, pointers, fn pointers).
        unsafe { std::ptr::read(self) }
    }
}

/// One group's instance of a plugin.
pub struct PluginBackend {
    table: BackendV1,
    ctx: *mut c_void,
    name: String,
    path: String,
    _host: Box<HostState>,
    _host_table: Box<abi::HostV1>,
    /// A concurrent plugin's outstanding requests (see `caps.posts`); its
    /// lock also keeps calls on ctx one at a time.
    requests: std::sync::Mutex<Vec<Request>>,
    /// It posts where the plugin is concurrent.
    caps: Capabilities,
}

/// A request started for a posted batch.
struct Request {
    req: *mut c_void,
    deadline: Instant,
    done: Done,
}

// SAFETY: the header's threading rules hold: weft calls one op at a time per
// ctx (the group's executor; for a concurrent plugin, under `requests`'
// lock) and `abort` may come from any thread.
unsafe impl Send for PluginBackend {}
// SAFETY: as above.
unsafe impl Sync for PluginBackend {}

impl PluginBackend {
    fn fail(&self, status: abi::Status, what: &str) -> Error {
        let mut peer = -1i32;
        let msg = match self.table.last_error {
            // SAFETY: ctx is live; the returned string (if any) is valid until the next call on ctx.
            Some(f) => unsafe {
                let p = f(self.ctx, &mut peer);
                if p.is_null() {
                    String::new()
                } else {
                    CStr::from_ptr(p).to_string_lossy().into_owned()
                }
            },
            None => String::new(),
        };
        error_of(status, format!("plugin {} ({}): {what}: {msg}", self.name, self.path), peer)
    }

    fn check(&self, status: abi::Status, what: &str) -> Result<()> {
        if status == abi::OK {
            Ok(())
        } else {
            Err(self.fail(status, what))
        }
    }
}

impl Backend for PluginBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
        let deadline = deadline.get();
        if self.caps.posts {
            // Progress on this request moves the others too.
            return crate::backend::progress::post_and_wait(ops, &[], deadline, |p| self.post(p), |until| self.progress(until));
        }
        let batch = to_abi(ops);
        let (start, wait, cancel) =
            (self.table.start.expect("validated"), self.table.wait.expect("validated"), self.table.cancel.expect("validated"));
        let mut req: *mut c_void = std::ptr::null_mut();
        let left = deadline.saturating_duration_since(Instant::now());
        // SAFETY: the buffers behind `batch` are borrowed by `ops` and stay
        // valid until this function returns, which is after the request has
        // completed or been cancelled.
        let status = unsafe { start(self.ctx, batch.as_ptr(), batch.len(), ms(left), &mut req) };
        self.check(status, "start")?;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            // SAFETY: req is a live request of ctx.
            let status = unsafe { wait(self.ctx, req, ms(left.min(POLL))) };
            if status != abi::PENDING {
                return self.check(status, "wait");
            }
            if left.is_zero() {
                // SAFETY: as above; after cancel the plugin no longer touches the buffers.
                unsafe { cancel(self.ctx, req) };
                return Err(Error::timeout(format!("plugin {}: transfers did not finish before the deadline", self.name)));
            }
        }
    }

    fn native_op(&self, op: &mut Op<'_>, ctx: &OpContext) -> Option<Result<()>> {
        // One call on ctx at a time (requests may be in flight): a native
        // collective of a concurrent plugin holds the calls lock while it
        // runs, so posting waits for it.
        let _calls = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        let timeout = ms(ctx.remaining());
        match op {
            Op::AllReduce { buf, op } if buf.device() == Device::Cpu => {
                let f = self.table.all_reduce?;
                let factor = if let crate::ReduceOp::PremulSum(x) = op { *x } else { 1.0 };
                let (n, dtype, code) = (buf.numel(), buf.dtype() as i32, op.code() as i32);
                let bytes = match buf.host_bytes_mut() {
                    Ok(b) => b,
                    Err(e) => return Some(Err(e)),
                };
                // SAFETY: bytes holds n elements of dtype for the call.
                let s = unsafe { f(self.ctx, bytes.as_mut_ptr() as *mut c_void, n, dtype, code, factor, timeout) };
                Some(self.check(s, "all_reduce"))
            }
            Op::Broadcast { buf, root } if buf.device() == Device::Cpu => {
                let f = self.table.broadcast?;
                let root = *root as u32;
                let bytes = match buf.host_bytes_mut() {
                    Ok(b) => b,
                    Err(e) => return Some(Err(e)),
                };
                // SAFETY: bytes is valid for the call.
                let s = unsafe { f(self.ctx, bytes.as_mut_ptr() as *mut c_void, bytes.len(), root, timeout) };
                Some(self.check(s, "broadcast"))
            }
            Op::Barrier => {
                let f = self.table.barrier?;
                // SAFETY: ctx is live.
                Some(self.check(unsafe { f(self.ctx, timeout) }, "barrier"))
            }
            _ => None,
        }
    }

    fn capabilities(&self) -> &Capabilities {
        &self.caps
    }

    fn post(&self, post: Post) {
        // SAFETY: the buffers go to the plugin as raw pointers (`to_abi`),
        // which it stops touching once the request has finished or been
        // cancelled; `done` is called only after that (`progress`, `abort`).
        let PostParts { mut ops, deadline, done, .. } = unsafe { post.into_parts() };
        let batch = to_abi(&mut ops);
        let start = self.table.start.expect("validated");
        let mut req: *mut c_void = std::ptr::null_mut();
        let mut requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the buffers behind `batch` stay valid until `done` runs
        // (`Post`'s contract), which is after the request has finished or
        // been cancelled.
        let status =
            unsafe { start(self.ctx, batch.as_ptr(), batch.len(), ms(deadline.saturating_duration_since(Instant::now())), &mut req) };
        if status != abi::OK {
            let e = self.fail(status, "start");
            drop(requests);
            return done(Err(e));
        }
        requests.push(Request { req, deadline, done });
    }

    fn progress(&self, until: &dyn Fn() -> bool) {
        let (wait, cancel) = (self.table.wait.expect("validated"), self.table.cancel.expect("validated"));
        let mut idle_since = Instant::now();
        while !until() {
            let mut finished: Vec<(Done, Result<()>)> = Vec::new();
            {
                let mut requests = self.requests.lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                let mut i = 0;
                while i < requests.len() {
                    // Polled (timeout 0): the calls lock is never held while
                    // the plugin waits, so posters get in at once.
                    let r = &requests[i];
                    // SAFETY: a live request of ctx, under the calls lock.
                    let status = unsafe { wait(self.ctx, r.req, 0) };
                    if status != abi::PENDING {
                        let r = requests.remove(i);
                        finished.push((r.done, self.check(status, "wait")));
                    } else if now >= r.deadline {
                        let r = requests.remove(i);
                        // SAFETY: as above; afterwards its buffers are not touched.
                        unsafe { cancel(self.ctx, r.req) };
                        let e = Error::timeout(format!("plugin {}: transfers did not finish before the deadline", self.name));
                        finished.push((r.done, Err(e)));
                    } else {
                        i += 1;
                    }
                }
            }
            if finished.is_empty() {
                // Yield for a while (the peer is likely about to answer),
                // then sleep briefly between polls.
                if idle_since.elapsed() < Duration::from_micros(200) {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(50));
                }
                continue;
            }
            idle_since = Instant::now();
            for (done, r) in finished {
                done(r);
            }
        }
    }

    fn abort(&self, _reason: &Error) {
        if let Some(f) = self.table.abort {
            // SAFETY: abort may be called from any thread (header contract).
            unsafe { f(self.ctx) };
        }
    }
}

/// The batch as the ABI passes it (pointers into the ops' buffers).
fn to_abi(ops: &mut [P2p<'_>]) -> Vec<P2pV1> {
    ops.iter_mut()
        .map(|op| match op {
            P2p::Send { peer, tag, data } => {
                P2pV1 { kind: abi::P2P_SEND, peer: *peer as u32, tag: *tag, buf: data.as_ptr() as *mut c_void, len: data.len() }
            }
            P2p::Recv { peer, tag, buf } => {
                P2pV1 { kind: abi::P2P_RECV, peer: *peer as u32, tag: *tag, buf: buf.as_mut_ptr() as *mut c_void, len: buf.len() }
            }
        })
        .collect()
}

impl Drop for PluginBackend {
    fn drop(&mut self) {
        if let Some(f) = self.table.destroy {
            // SAFETY: ctx came from init and is destroyed exactly once; no op
            // is running (the group drops its backends last).
            unsafe { f(self.ctx) };
        }
    }
}
