//! One-sided communication: windows of registered memory that peers put
//! into and get from without the target calling anything (TorchComm's
//! window API, MPI's RMA).
//!
//! [`ProcessGroup::new_window`] registers `bytes` of memory on every rank
//! (sizes may differ), collectively. Then any rank may
//! [`put`](Window::put) bytes into a peer's memory, [`get`](Window::get)
//! them back, and [`signal`](Window::signal) the peer once its puts should
//! be seen: after [`wait_signal`](Window::wait_signal) returns on the
//! target, the data of every put the origin issued before its signal is in
//! the target's memory. Where memory is shared (shm),
//! [`map_remote`](Window::map_remote) views a peer's memory directly.
//!
//! Where the checks and the dispatch live: this file checks every call
//! (ranks, ranges, devices) before any byte moves and picks the
//! implementation; a backend may provide one ([`Backend::window`], shm's
//! shared segments), else `over_p2p` builds windows over the backend's
//! posted point-to-point messages (cpu-tcp, hierarchical), whose frames
//! [`frame`] describes and checks again on the target.

pub mod frame;
mod memory;
pub(crate) mod over_p2p;

pub use memory::WindowMemory;

use crate::backend::progress::Done;
use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::group::{Collectives, ProcessGroup, Work};
use crate::options::OpOptions;
use crate::store::Store;
use crate::tensor::{Device, Tensor, TensorMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The most bytes one rank may register (2^48: far above any memory, far
/// below where a backend's arithmetic on it could overflow).
pub const MAX_BYTES: usize = 1 << 48;

/// How a peer's window memory can be reached (TorchComm's `get_attr`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccessType {
    /// This process maps the peer's memory: [`Window::map_remote`] works.
    Unified,
    /// Only puts and gets reach it.
    Separate,
}

/// What [`Window::attr`] says about a peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowAttr {
    /// Whether the peer's memory is mapped here.
    pub access: AccessType,
}

/// What a backend is told when a window is created on its group.
pub struct WindowSpec {
    /// The window's number in the group (the same on every rank).
    pub id: u64,
    /// This rank.
    pub rank: usize,
    /// Group size.
    pub size: usize,
    /// Every rank's registered bytes.
    pub sizes: Vec<usize>,
    /// Where the registered bytes live (the same kind on every rank).
    pub device: Device,
    /// A store namespace private to this window.
    pub store: Arc<dyn Store>,
    /// When creation must have finished.
    pub deadline: Instant,
    /// Device windows: a host window of the same group (no memory) that
    /// the backend counts signals through.
    pub signals: Option<Arc<dyn WindowTransport>>,
}

/// Contiguous bytes a put reads or a get writes: host memory, or the
/// window's device's memory (a device address).
#[derive(Clone, Copy, Debug)]
pub struct Span {
    /// The first byte.
    pub ptr: *mut u8,
    /// How many.
    pub len: usize,
}

impl Span {
    /// The bytes of a host span.
    ///
    /// # Safety
    /// The span is host memory, valid (and not written elsewhere) for 'a.
    pub unsafe fn host<'a>(self) -> &'a mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        // SAFETY: the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// The call a put, get, signal or wait belongs to.
#[derive(Debug)]
pub struct RmaCall {
    /// When it must be finished (read from the clock only when asked: a
    /// put into shared memory never asks).
    pub deadline: crate::backend::Deadline,
    /// Its timeout (what `deadline` counts).
    pub timeout: std::time::Duration,
    /// Device windows: the caller's stream, the op is ordered on
    /// (`None`: the device's default stream).
    pub stream: Option<crate::stream::StreamHandle>,
}

/// How a put, get or signal that may finish later reports: it returns
/// `Some(result)` if it finished on the calling thread, else it has taken
/// a completion from its `Later` (once) and calls that when it finishes.
/// (Shared memory finishes at once, and then no completion is made.)
pub type Later<'a> = &'a mut dyn FnMut() -> Done;

/// One rank's side of a window, as a backend provides it (or
/// `over_p2p` over point-to-point messages). Ranks and ranges are
/// checked by [`Window`] before any call; spans are on the window's device.
pub trait WindowTransport: Send + Sync {
    /// This rank's registered bytes (valid as long as the transport).
    fn local(&self) -> Span;

    /// Write `src` at `offset` of rank `dst`'s memory (another rank);
    /// finished once `src` may be reused (device windows: once the copy is
    /// queued on the call's stream, which orders any later use). See
    /// [`Later`] for how it reports.
    ///
    /// # Safety
    /// `src` stays valid until it has finished (and, on a device, until
    /// its stream has run the copy).
    unsafe fn put(&self, src: Span, dst: usize, offset: usize, call: &RmaCall, later: Later<'_>) -> Option<Result<()>>;

    /// Read `dst.len` bytes at `offset` of rank `src`'s memory (another
    /// rank) into `dst`; finished once they are there (device windows:
    /// once the copy is queued on the call's stream).
    ///
    /// # Safety
    /// `dst` stays valid and untouched until it has finished (and, on a
    /// device, until its stream has run the copy).
    unsafe fn get(&self, dst: Span, src: usize, offset: usize, call: &RmaCall, later: Later<'_>) -> Option<Result<()>>;

    /// Count one signal at `peer` (this rank too), seen there after every
    /// earlier put from this rank to `peer`; finished once sent.
    fn signal(&self, peer: usize, call: &RmaCall, later: Later<'_>) -> Option<Result<()>>;

    /// Wait until `count` signals from `peer` (this rank too) have arrived
    /// that no earlier wait took, and take them (device windows: then order
    /// the call's stream after the puts they cover).
    fn wait_signal(&self, peer: usize, count: u64, call: &RmaCall) -> Result<()>;

    /// Rank `rank`'s memory, where this process maps it.
    fn remote(&self, rank: usize) -> Option<*mut u8>;

    /// Device windows: the device side of the put or get this thread just
    /// queued on `call`'s stream, for its [`Work`] (which then waits for it
    /// when dropped or synchronized). `None` for host windows.
    fn queued(&self, call: &RmaCall) -> Result<Option<Arc<dyn crate::stream::DeviceCompletion>>> {
        let _ = call;
        Ok(None)
    }

    /// Collective teardown: returns once no peer will touch this rank's
    /// memory any more, and this rank's puts and gets are over.
    fn close(&self, deadline: Instant) -> Result<()>;
}

/// Registered memory on every rank of a group, reachable one-sidedly.
///
/// Offsets and lengths are in bytes. The memory a window registers is its
/// own (zeroed at creation; shared memory on `shm`): read and write this
/// rank's part through [`Window::local`]. Puts from peers land in it at
/// any time: read what a peer put after its signal arrived
/// ([`Window::wait_signal`]), as in MPI's RMA.
///
/// [`Window::deregister`] is collective; dropping a window that was not
/// deregistered does the same and only logs what failed.
pub struct Window {
    imp: Arc<dyn WindowTransport>,
    /// Device windows: the host window their signals go through.
    signals: Option<Box<Window>>,
    rank: usize,
    device: Device,
    sizes: Vec<usize>,
    timeout: std::time::Duration,
    closed: AtomicBool,
    /// The group's poisoned/aborted state.
    usable: Box<dyn Fn() -> Result<()> + Send + Sync>,
}

impl ProcessGroup {
    /// Create a window with `bytes` of memory on this rank (zeroed; each
    /// rank may register a different size). Collective: every rank calls
    /// it, in the same order relative to other windows and collectives.
    ///
    /// On shm the memory is shared (puts are one copy, peers' memory
    /// can be mapped); elsewhere puts travel as messages that a progress
    /// thread on the target writes into place.
    pub fn new_window(&self, bytes: usize) -> Result<Window> {
        self.new_window_on(bytes, Device::Cpu)
    }

    /// A window whose memory starts as a copy of `init` (on `init`'s
    /// device; its size is this rank's registered size): TorchComm's
    /// `tensor_register`. The copy from a device tensor runs on this
    /// thread's current stream ([`crate::stream::set_current_stream`]), so
    /// it follows the work that wrote `init` there. Collective; no rank
    /// returns before every rank's memory holds its `init`, so no put can
    /// land before that copy.
    pub fn new_window_from<'t>(&self, init: impl Into<Tensor<'t>>) -> Result<Window> {
        let init = init.into();
        let win = self.new_window_on(init.nbytes(), init.device())?;
        // A put to this rank: a copy (on the device, on the current stream,
        // waited for here).
        win.put(init, self.rank(), 0, &OpOptions::default())?.synchronize()?;
        self.barrier(&OpOptions::default())?.wait()?;
        Ok(win)
    }

    /// As [`ProcessGroup::new_window`], with the memory on `device` (every
    /// rank passes the same kind): `cuda-device` maps peers' device memory
    /// (CUDA IPC, ranks on one host), and puts and gets are device copies
    /// ordered on the caller's stream.
    pub fn new_window_on(&self, bytes: usize, device: Device) -> Result<Window> {
        let name = "new_window";
        let (rank, size) = (self.rank(), self.size());
        // A device window counts its signals through a host window of its
        // own, made first (on every rank alike).
        let signals = match device {
            Device::Cpu => None,
            Device::Cuda(_) => Some(Box::new(self.new_window(0)?)),
        };
        let mut all = vec![0u64; size];
        self.all_gather_single(&mut all[..], &[bytes as u64][..], &OpOptions::default())?.wait()?;
        let sizes: Vec<usize> = all.iter().map(|&b| b as usize).collect();
        // Room for a backend's own header above any size (no overflow).
        if let Some(r) = sizes.iter().position(|&b| b > MAX_BYTES) {
            let e = Error::invalid(format!("rank {r} registered {} bytes; a window holds at most {MAX_BYTES}", sizes[r]));
            return Err(e.with_op(name).with_rank(rank));
        }
        let parts = self.window_parts(device.kind())?;
        let spec = WindowSpec {
            id: parts.id,
            rank,
            size,
            sizes: sizes.clone(),
            device,
            store: parts.store,
            deadline: crate::deadline::instant_after(parts.timeout),
            signals: signals.as_ref().map(|w| w.imp.clone()),
        };
        let backend: &Arc<dyn Backend> = &parts.backend;
        // The backend's own windows; where it has none, or cannot make one
        // (on every rank alike), windows over its messages.
        let imp: Arc<dyn WindowTransport> = match backend.window(&spec) {
            Some(Ok(native)) => native,
            Some(Err(e)) if !matches!(e.kind(), crate::ErrorKind::Unsupported) => return Err(e.with_op(name).with_rank(rank)),
            native => {
                if let Some(Err(e)) = native {
                    crate::log::info(format_args!("window #{} on rank {rank}: over messages, since {e}", spec.id));
                }
                if device != Device::Cpu {
                    let e = Error::unsupported(format!(
                        "backend {} has no windows in {device} memory (cuda-device has them; cuda-host-staging and plugins do not)",
                        backend.name()
                    ));
                    return Err(e.with_op(name).with_rank(rank));
                }
                if !backend.capabilities().posts {
                    let e = Error::unsupported(format!(
                        "backend {} cannot move bytes without the target calling in: windows need a backend that posts \
                         point-to-point ops (cpu-tcp, shm, hierarchical)",
                        backend.name()
                    ));
                    return Err(e.with_op(name).with_rank(rank));
                }
                let made = over_p2p::P2pWindow::new(spec, backend.clone(), (parts.progress)());
                Arc::new(made.map_err(|e| e.with_op(name).with_rank(rank))?)
            }
        };
        Ok(Window { imp, signals, rank, device, sizes, timeout: parts.timeout, closed: AtomicBool::new(false), usable: parts.usable })
    }
}

/// What a window needs from its group (`group::window_parts`).
pub(crate) struct WindowParts {
    pub(crate) id: u64,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) backend: Arc<dyn Backend>,
    /// The group's progress thread for `backend` (started on first use).
    pub(crate) progress: Box<dyn FnOnce() -> Arc<crate::group::ProgressThread>>,
    pub(crate) timeout: std::time::Duration,
    pub(crate) usable: Box<dyn Fn() -> Result<()> + Send + Sync>,
}

impl Window {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.sizes.len()
    }
    /// Bytes rank `rank` registered.
    pub fn len_of(&self, rank: usize) -> usize {
        self.sizes.get(rank).copied().unwrap_or(0)
    }

    /// Where the registered memory lives.
    pub fn device(&self) -> Device {
        self.device
    }

    /// This rank's registered memory.
    pub fn local(&self) -> WindowMemory<'_> {
        let Span { ptr, len } = self.imp.local();
        // SAFETY: the transport keeps these bytes mapped as long as itself,
        // which the view's borrow of `self` outlives.
        unsafe { WindowMemory::new(ptr, len, self.device) }
    }

    /// How `peer`'s memory is reached from here.
    pub fn attr(&self, peer: usize) -> Result<WindowAttr> {
        self.peer("get_attr", peer)?;
        let access = if peer == self.rank || self.imp.remote(peer).is_some() { AccessType::Unified } else { AccessType::Separate };
        Ok(WindowAttr { access })
    }

    /// A direct view of `rank`'s registered memory, where this process
    /// maps it (shm; this rank's own everywhere): `Unsupported` elsewhere.
    pub fn map_remote(&self, rank: usize) -> Result<WindowMemory<'_>> {
        self.peer("map_remote", rank)?;
        if rank == self.rank {
            return Ok(self.local());
        }
        match self.imp.remote(rank) {
            // SAFETY: as in `local`: mapped as long as the transport.
            Some(ptr) => Ok(unsafe { WindowMemory::new(ptr, self.sizes[rank], self.device) }),
            None => Err(Error::unsupported(format!(
                "map_remote: rank {rank}'s window memory is not mapped in this process (the backend reaches it by messages; \
                 use put and get)"
            ))
            .with_op("map_remote")
            .with_rank(self.rank)),
        }
    }

    /// Write `src` at byte `offset` of rank `dst`'s memory, one-sidedly
    /// (`dst` does not call anything). The [`Work`] finishes once `src`
    /// may be reused; `dst` sees the bytes after a later
    /// [`Window::signal`] to it arrived. Puts from one origin to one target
    /// land in issue order. A range outside `dst`'s registered bytes is
    /// `InvalidArgument` before any byte moves.
    pub fn put<'t>(&self, src: impl Into<Tensor<'t>>, dst: usize, offset: usize, opts: &OpOptions) -> Result<Work<'t>> {
        let src = src.into();
        let span = Span { ptr: src.as_ptr() as *mut u8, len: src.nbytes() };
        self.one_sided(
            "put",
            dst,
            src.device(),
            src.is_contiguous(),
            span,
            offset,
            opts,
            |mine, bytes| mine.write(offset, bytes),
            |call, later| {
                // SAFETY: the Work borrows `src` for 't and waits for the put
                // when dropped, so `src` outlives it.
                unsafe { self.imp.put(span, dst, offset, call, later) }
            },
        )
    }

    /// Read `dst`'s length in bytes at byte `offset` of rank `src`'s memory
    /// into `dst`, one-sidedly. The [`Work`] finishes once they are in.
    pub fn get<'t>(&self, dst: impl Into<TensorMut<'t>>, src: usize, offset: usize, opts: &OpOptions) -> Result<Work<'t>> {
        let dst = dst.into();
        let span = Span { ptr: dst.as_ptr() as *mut u8, len: dst.nbytes() };
        self.one_sided(
            "get",
            src,
            dst.device(),
            dst.is_contiguous(),
            span,
            offset,
            opts,
            |mine, bytes| mine.read(offset, bytes),
            |call, later| {
                // SAFETY: as in `put`.
                unsafe { self.imp.get(span, src, offset, call, later) }
            },
        )
    }

    /// A put or get (`name`) of `span` (a tensor on `device`) at `offset` of
    /// `peer`'s memory: checked, then nothing (no bytes), `here` (this
    /// rank's own host memory, with the span's bytes) or `there` (the
    /// transport).
    #[allow(clippy::too_many_arguments)]
    fn one_sided<'t>(
        &self,
        name: &'static str,
        peer: usize,
        device: Device,
        contiguous: bool,
        span: Span,
        offset: usize,
        opts: &OpOptions,
        here: impl FnOnce(WindowMemory<'_>, &mut [u8]) -> Result<()>,
        there: impl FnOnce(&RmaCall, Later<'_>) -> Option<Result<()>>,
    ) -> Result<Work<'t>> {
        let call = self.start(name, peer, device, contiguous, offset, span.len, opts)?;
        if span.len == 0 {
            return Ok(Work::done(Ok(()), None));
        }
        if peer == self.rank && self.device == Device::Cpu {
            // SAFETY: the caller's contiguous host tensor (checked),
            // borrowed (mutably, for a get) for 't.
            return here(self.local(), unsafe { span.host() }).map(|()| Work::done(Ok(()), None));
        }
        Ok(self.track(name, &call, |later| there(&call, later)))
    }

    /// Tell `peer` that this rank's earlier puts to it are complete: once
    /// `peer`'s [`Window::wait_signal`] for this rank returns, their bytes
    /// are in its memory.
    pub fn signal(&self, peer: usize, opts: &OpOptions) -> Result<Work<'static>> {
        self.peer("signal", peer)?;
        self.check_open("signal")?;
        let call = self.call(opts);
        Ok(self.track("signal", &call, |later| self.imp.signal(peer, &call, later)))
    }

    /// Wait for a signal from `peer` (one that no earlier wait took).
    pub fn wait_signal(&self, peer: usize, opts: &OpOptions) -> Result<()> {
        self.wait_signals(peer, 1, opts)
    }

    /// Wait for `count` signals from `peer`; `Timeout` naming `peer` if
    /// they have not all arrived by the op's deadline, `PeerLost` if it died.
    pub fn wait_signals(&self, peer: usize, count: u64, opts: &OpOptions) -> Result<()> {
        let name = "wait_signal";
        self.peer(name, peer)?;
        self.check_open(name)?;
        self.imp.wait_signal(peer, count, &self.call(opts)).map_err(|e| e.with_op(name).with_rank(self.rank))
    }

    /// Collectively end the window: returns once every rank has stopped
    /// using it (each rank's earlier puts have landed); later calls are
    /// `InvalidArgument`. The memory stays readable through
    /// [`Window::local`] until the window is dropped. Again: nothing.
    pub fn deregister(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        // A group that was closed or failed: no peer will take part.
        (self.usable)().map_err(|e| e.with_op("tensor_deregister").with_rank(self.rank))?;
        let closed = self.imp.close(crate::deadline::instant_after(self.timeout));
        // A device window's signals window closes after it: collectively,
        // so no rank frees its memory before every rank's copies drained.
        let signals = self.signals.as_ref().map_or(Ok(()), |w| w.deregister());
        closed.and(signals).map_err(|e| e.with_op("tensor_deregister").with_rank(self.rank))
    }

    fn call(&self, opts: &OpOptions) -> RmaCall {
        let stream = if self.device == Device::Cpu { None } else { opts.stream.or_else(crate::stream::current_stream) };
        let timeout = opts.timeout.unwrap_or(self.timeout);
        RmaCall { deadline: crate::backend::Deadline::after(timeout), timeout, stream }
    }

    fn peer(&self, name: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size() {
            let e = Error::invalid(format!("rank {peer} is out of range for a group of size {}", self.size()));
            return Err(e.with_op(name).with_rank(self.rank));
        }
        Ok(())
    }

    fn check_open(&self, name: &'static str) -> Result<()> {
        let r = if self.closed.load(Ordering::Acquire) { Err(Error::invalid("the window was deregistered")) } else { (self.usable)() };
        r.map_err(|e| e.with_op(name).with_rank(self.rank))
    }

    /// The checks of a put or get of `len` bytes at `offset` of `peer`'s
    /// memory, before any byte moves; the call it makes.
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        name: &'static str,
        peer: usize,
        device: Device,
        contiguous: bool,
        offset: usize,
        len: usize,
        opts: &OpOptions,
    ) -> Result<RmaCall> {
        self.peer(name, peer)?;
        self.check_open(name)?;
        let fail = |m: String| Err(Error::invalid(m).with_op(name).with_rank(self.rank));
        if device != self.device {
            return fail(format!("the window's memory is on {}, the tensor on {device}", self.device));
        }
        if !contiguous {
            return fail("the tensor is not contiguous".into());
        }
        let theirs = self.sizes[peer];
        if offset.checked_add(len).is_none_or(|end| end > theirs) {
            return fail(format!("{len} bytes at offset {offset} lie outside rank {peer}'s {theirs} registered bytes"));
        }
        Ok(self.call(opts))
    }

    /// A [`Work`] for an op of `call` that finishes now or later (see
    /// [`Later`]), with its device side where it has one.
    fn track<'t>(&self, name: &'static str, call: &RmaCall, run: impl FnOnce(Later<'_>) -> Option<Result<()>>) -> Work<'t> {
        let rank = self.rank;
        let tag = move |e: Error| e.with_op(name).with_rank(rank);
        let mut pending = None;
        let now = run(&mut || {
            let (work, done) = Work::later(tag);
            pending = Some(work);
            done
        });
        match (now, pending) {
            (Some(Ok(())), _) => match self.imp.queued(call) {
                Ok(device) => Work::done(Ok(()), device).within(call.timeout),
                Err(e) => Work::done(Err(tag(e)), None),
            },
            (Some(r), _) => Work::done(r.map_err(tag), None),
            (None, Some(work)) => work,
            (None, None) => Work::done(Err(tag(Error::backend("window: the transport neither finished nor deferred the op"))), None),
        }
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        if let Err(e) = self.deregister() {
            crate::log::info(format_args!("dropping a window on rank {}: {e}", self.rank));
        }
    }
}

impl std::fmt::Debug for Window {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Window(rank {} of {}, {:?} bytes on {})", self.rank, self.size(), self.sizes, self.device)
    }
}
