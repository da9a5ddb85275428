//! The CUDA driver through `cudarc` (dynamically loaded).
//!
//! Probe order, because cudarc panics where a library is missing: is
//! libcuda present, `cuInit`, device count; NVRTC is probed separately the
//! first time a kernel is needed. Each failure becomes the "unavailable"
//! reason `weft info` shows.
//!
//! Raw handles are used throughout (streams come from callers and other
//! frameworks); every call first binds the primary context of the device
//! the handle belongs to.

mod kernels;

use crate::gpu::{check_reduce_all, DevicePtr, Event, Gpu, Graph, MAX_REDUCE_ALL};
use cudarc::driver::{result, sys, CudaContext, DriverError};
use kernels::Kernel;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};
use weft::{DType, Error, ReduceOp, Result, StreamHandle};

/// The CUDA driver.
pub struct DriverGpu {
    /// Primary contexts, retained on first use (a context costs device
    /// memory: a process touches only the devices it uses).
    contexts: Vec<OnceLock<std::result::Result<Arc<CudaContext>, String>>>,
    /// Device of each stream and event weft created or opened.
    stream_device: Mutex<HashMap<u64, usize>>,
    event_device: Mutex<HashMap<u64, usize>>,
    /// Per device and kernel name: the function, in a module of its own.
    functions: Mutex<HashMap<(usize, String), usize>>,
    /// Each instantiated graph (`CUgraphExec`) and its `CUgraph`, with the
    /// device it was captured on.
    graphs: Mutex<HashMap<u64, (u64, usize)>>,
}

fn err(what: &str, e: DriverError) -> Error {
    let name = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_else(|_| format!("{:?}", e.0));
    Error::backend(format!("cuda: {what}: {name}"))
}

impl DriverGpu {
    /// Open the driver, or say why it cannot be used here.
    pub fn open() -> std::result::Result<DriverGpu, String> {
        // SAFETY: only tries to dlopen libcuda; resolves no symbol.
        if !unsafe { sys::is_culib_present() } {
            return Err("the CUDA driver library (libcuda.so) is not installed".into());
        }
        result::init().map_err(|e| format!("cuInit failed: {e:?}"))?;
        let n = result::device::get_count().map_err(|e| format!("cannot count CUDA devices: {e:?}"))?;
        if n <= 0 {
            return Err("no CUDA device".into());
        }
        let contexts = (0..n as usize).map(|_| OnceLock::new()).collect();
        Ok(DriverGpu {
            contexts,
            stream_device: Mutex::default(),
            event_device: Mutex::default(),
            functions: Mutex::default(),
            graphs: Mutex::default(),
        })
    }

    fn bind(&self, device: usize) -> Result<()> {
        let slot = self.contexts.get(device).ok_or_else(|| Error::invalid(format!("cuda: no device {device}")))?;
        let ctx = slot
            .get_or_init(|| CudaContext::new(device).map_err(|e| format!("cannot open CUDA device {device}: {e:?}")))
            .as_ref()
            .map_err(|why| Error::backend(why.clone()))?;
        ctx.bind_to_thread().map_err(|e| err("binding the context", e))
    }

    /// The device of `stream`: one weft made, else a caller's (torch's, say:
    /// captured ops are queued on it), found from its context; the default
    /// stream's is device 0's.
    fn stream_device(&self, stream: StreamHandle) -> usize {
        let known = self.stream_device.lock().unwrap_or_else(|p| p.into_inner()).get(&stream.0).copied();
        // (A caller's stream is looked up every time: its handle may be
        // reused by a stream of another device once it is destroyed.)
        known.or_else(|| foreign_stream_device(stream)).unwrap_or(0)
    }

    /// Bind the device of `stream`.
    fn bind_stream(&self, stream: StreamHandle) -> Result<sys::CUstream> {
        self.bind(self.stream_device(stream))?;
        Ok(stream.0 as sys::CUstream)
    }

    fn bind_event(&self, event: Event) -> Result<sys::CUevent> {
        let d = self.event_device.lock().unwrap_or_else(|p| p.into_inner()).get(&event.0).copied().unwrap_or(0);
        self.bind(d)?;
        Ok(event.0 as sys::CUevent)
    }

    /// The compiled kernel `name` on the device of `stream`.
    fn function(&self, stream: StreamHandle, kernel: &Kernel) -> Result<sys::CUfunction> {
        let d = self.stream_device(stream);
        let key = (d, kernel.name.clone());
        // Held while loading, so two threads do not load the same kernel twice.
        let mut functions = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = functions.get(&key) {
            return Ok(*f as sys::CUfunction);
        }
        self.bind(d)?;
        let ptx = CString::new(ptx(kernel)?).map_err(|_| Error::backend("cuda: PTX contains a NUL byte"))?;
        // SAFETY: a NUL-terminated PTX image; the context is bound. Modules
        // stay loaded for the life of the process.
        let module = unsafe { result::module::load_data(ptx.as_ptr() as *const c_void) }.map_err(|e| err("loading a kernel", e))?;
        let cname = CString::new(kernel.name.as_str()).expect("kernel names have no NUL");
        // SAFETY: a module loaded in the bound context.
        let f = unsafe { result::module::get_function(module, cname) }.map_err(|e| err(&format!("kernel {}", kernel.name), e))?;
        functions.insert(key, f as usize);
        Ok(f)
    }

    /// Launch a grid-stride kernel over `n` elements.
    ///
    /// # Safety
    /// `params` match the kernel's signature and stay valid until launch returns.
    unsafe fn launch(&self, stream: StreamHandle, kernel: Kernel, n: usize, params: &mut [*mut c_void]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let f = self.function(stream, &kernel)?;
        let s = self.bind_stream(stream)?;
        let blocks = n.div_ceil(256).min(4096) as u32;
        // SAFETY: the caller's contract; the context of `s` is bound.
        unsafe { result::launch_kernel(f, (blocks, 1, 1), (256, 1, 1), 0, s, params) }.map_err(|e| err(&kernel.name, e))
    }
}

/// This thread in relaxed stream-capture mode while the guard lives: calls
/// that a capture in global mode (torch's default) refuses on every thread
/// (an event query, exporting, opening or closing IPC memory) neither fail nor
/// invalidate a capture another thread, or a captured op on this one, is
/// making, as torch's and NCCL's own such calls are guarded. None of them
/// queues work on a capturing stream.
struct Relaxed(Option<sys::CUstreamCaptureMode>);

impl Relaxed {
    fn here() -> Relaxed {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: swaps this thread's capture mode with `mode` (the old one).
        let swapped = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result().is_ok();
        Relaxed(swapped.then_some(mode))
    }
}

impl Drop for Relaxed {
    fn drop(&mut self) {
        if let Some(mut mode) = self.0 {
            // SAFETY: restores the mode `here` found (only if it swapped).
            let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) };
        }
    }
}

/// The device of a stream weft did not make, from its context; `None` for
/// the default stream or where the driver cannot say.
fn foreign_stream_device(stream: StreamHandle) -> Option<usize> {
    if stream.0 == 0 {
        return None;
    }
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: a stream the caller passed as live; the out-pointer is ours.
    unsafe { sys::cuStreamGetCtx(stream.0 as sys::CUstream, &mut ctx) }.result().ok()?;
    let mut device: sys::CUdevice = 0;
    // SAFETY: the context pushed here is popped before returning, leaving
    // this thread's context stack as it was; the out-pointers are ours.
    let got = unsafe {
        sys::cuCtxPushCurrent_v2(ctx).result().ok()?;
        let got = sys::cuCtxGetDevice(&mut device).result();
        let mut popped: sys::CUcontext = std::ptr::null_mut();
        let _ = sys::cuCtxPopCurrent_v2(&mut popped).result();
        got
    };
    got.ok()?;
    usize::try_from(device).ok()
}

/// A kernel's PTX, compiled the first time this process needs it (for
/// whichever device: PTX is device-independent).
fn ptx(kernel: &Kernel) -> Result<String> {
    static PTX: Mutex<Option<HashMap<String, std::result::Result<String, String>>>> = Mutex::new(None);
    let mut cache = PTX.lock().unwrap_or_else(|p| p.into_inner());
    cache
        .get_or_insert_with(HashMap::new)
        .entry(kernel.name.clone())
        .or_insert_with(|| {
            // SAFETY: only tries to dlopen libnvrtc.
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err("NVRTC (libnvrtc.so) is not installed; it compiles weft's reduction kernels".into());
            }
            let source = kernels::source(std::slice::from_ref(kernel));
            cudarc::nvrtc::compile_ptx(source).map(|p| p.to_src()).map_err(|e| format!("compiling {}: {e:?}", kernel.name))
        })
        .clone()
        .map_err(Error::unsupported)
}

const IPC_LEN: usize = 64;

impl Gpu for DriverGpu {
    fn name(&self) -> &'static str {
        "cuda-driver"
    }
    fn device_count(&self) -> usize {
        self.contexts.len()
    }
    fn device_uuid(&self, device: usize) -> Result<[u8; 16]> {
        self.bind(device)?;
        let ctx = self.contexts[device].get().and_then(|c| c.as_ref().ok()).expect("bound above");
        let u = ctx.uuid().map_err(|e| err("reading the device UUID", e))?;
        Ok(u.bytes.map(|b| b as u8))
    }
    fn new_stream(&self, device: usize) -> Result<StreamHandle> {
        self.bind(device)?;
        let s = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(|e| err("creating a stream", e))?;
        let h = StreamHandle(s as u64);
        self.stream_device.lock().unwrap_or_else(|p| p.into_inner()).insert(h.0, device);
        Ok(h)
    }
    fn destroy_stream(&self, stream: StreamHandle) {
        if stream.0 != 0 && self.bind_stream(stream).is_ok() {
            // SAFETY: a stream this process created; queued work still completes.
            let _ = unsafe { result::stream::destroy(stream.0 as sys::CUstream) };
            self.stream_device.lock().unwrap_or_else(|p| p.into_inner()).remove(&stream.0);
        }
    }
    fn alloc(&self, device: usize, bytes: usize) -> Result<DevicePtr> {
        self.bind(device)?;
        // SAFETY: plain cuMemAlloc (IPC-exportable, unlike pool memory).
        unsafe { result::malloc_sync(bytes.max(1)) }.map_err(|e| err(&format!("allocating {bytes} bytes"), e))
    }
    unsafe fn free(&self, ptr: DevicePtr) {
        // SAFETY: the caller's contract; cuMemFree synchronizes.
        let _ = unsafe { result::free_sync(ptr) };
    }
    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8> {
        self.bind(0)?;
        // Flags: portable, and not write-combined (the CPU reads it).
        // SAFETY: plain cuMemHostAlloc.
        unsafe { result::malloc_host(bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) }
            .map(|p| p as *mut u8)
            .map_err(|e| err(&format!("pinning {bytes} host bytes"), e))
    }
    unsafe fn free_pinned(&self, ptr: *mut u8) {
        // SAFETY: the caller's contract.
        let _ = unsafe { result::free_host(ptr as *mut c_void) };
    }
    unsafe fn copy_htod(&self, stream: StreamHandle, dst: DevicePtr, src: *const u8, bytes: usize) -> Result<()> {
        let s = self.bind_stream(stream)?;
        // SAFETY: the caller keeps both ranges valid until the stream runs the copy.
        unsafe { result::memcpy_htod_async(dst, std::slice::from_raw_parts(src, bytes), s) }.map_err(|e| err("host-to-device copy", e))
    }
    unsafe fn copy_dtoh(&self, stream: StreamHandle, dst: *mut u8, src: DevicePtr, bytes: usize) -> Result<()> {
        let s = self.bind_stream(stream)?;
        // SAFETY: as above.
        unsafe { result::memcpy_dtoh_async(std::slice::from_raw_parts_mut(dst, bytes), src, s) }.map_err(|e| err("device-to-host copy", e))
    }
    unsafe fn copy_dtod(&self, stream: StreamHandle, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        let s = self.bind_stream(stream)?;
        // SAFETY: as above.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, s) }.map_err(|e| err("device-to-device copy", e))
    }
    unsafe fn reduce(&self, stream: StreamHandle, dst: DevicePtr, src: DevicePtr, count: usize, dtype: DType, op: ReduceOp) -> Result<()> {
        let (mut d, mut s, mut n) = (dst, src, count as u64);
        let mut params = [&mut d as *mut u64 as *mut c_void, &mut s as *mut u64 as *mut c_void, &mut n as *mut u64 as *mut c_void];
        // SAFETY: (T*, const T*, u64) as the kernel declares; the caller
        // keeps the memory valid.
        unsafe { self.launch(stream, Kernel::reduce(dtype, op), count, &mut params) }
    }
    unsafe fn reduce_all(
        &self,
        stream: StreamHandle,
        srcs: &[DevicePtr],
        dsts: &[DevicePtr],
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        check_reduce_all(srcs, dsts)?;
        let pointers = |p: &[DevicePtr]| {
            let mut a = [0u64; MAX_REDUCE_ALL];
            a[..p.len()].copy_from_slice(p);
            kernels::Pointers(a)
        };
        let (mut s, mut d) = (pointers(srcs), pointers(dsts));
        let (mut ns, mut nd, mut n) = (srcs.len() as u32, dsts.len() as u32, count as u64);
        let mut avg = u32::from(op == ReduceOp::Avg);
        let mut params = [
            &mut s as *mut kernels::Pointers as *mut c_void,
            &mut d as *mut kernels::Pointers as *mut c_void,
            &mut ns as *mut u32 as *mut c_void,
            &mut nd as *mut u32 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
            &mut avg as *mut u32 as *mut c_void,
        ];
        // One thread per 16 bytes (the kernel's aligned path).
        let threads = (count * dtype.size()).div_ceil(16).max(count.min(1));
        // SAFETY: (Pointers, Pointers, unsigned, unsigned, u64, unsigned) as
        // the kernel declares; the caller keeps the memory valid.
        unsafe { self.launch(stream, Kernel::reduce_all(dtype, op), threads, &mut params) }
    }
    unsafe fn premul(&self, stream: StreamHandle, buf: DevicePtr, count: usize, dtype: DType, factor: f64) -> Result<()> {
        let (mut b, mut f, mut n) = (buf, factor, count as u64);
        let mut params = [&mut b as *mut u64 as *mut c_void, &mut f as *mut f64 as *mut c_void, &mut n as *mut u64 as *mut c_void];
        // SAFETY: (T*, double, u64) as the kernel declares.
        unsafe { self.launch(stream, Kernel::premul(dtype), count, &mut params) }
    }
    unsafe fn divide(&self, stream: StreamHandle, buf: DevicePtr, count: usize, dtype: DType, divisor: u32) -> Result<()> {
        let (mut b, mut d, mut n) = (buf, divisor, count as u64);
        let mut params = [&mut b as *mut u64 as *mut c_void, &mut d as *mut u32 as *mut c_void, &mut n as *mut u64 as *mut c_void];
        // SAFETY: (T*, unsigned, u64) as the kernel declares.
        unsafe { self.launch(stream, Kernel::divide(dtype), count, &mut params) }
    }
    fn new_event(&self, device: usize, interprocess: bool) -> Result<Event> {
        self.bind(device)?;
        let mut flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        if interprocess {
            flags |= sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
        }
        // The raw call: an OR of two `CUevent_flags` is no variant of that
        // Rust enum, so cudarc's typed `event::create` cannot take it.
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one event handle; the flags are valid CUevent_flags bits.
        unsafe { sys::cuEventCreate(&mut e, flags) }.result().map_err(|e| err("creating an event", e))?;
        self.event_device.lock().unwrap_or_else(|p| p.into_inner()).insert(e as u64, device);
        Ok(Event(e as u64))
    }
    fn destroy_event(&self, event: Event) {
        if let Ok(e) = self.bind_event(event) {
            // SAFETY: an event this process created or opened, not used afterwards.
            let _ = unsafe { result::event::destroy(e) };
        }
        self.event_device.lock().unwrap_or_else(|p| p.into_inner()).remove(&event.0);
    }
    fn record(&self, event: Event, stream: StreamHandle) -> Result<()> {
        let e = self.bind_event(event)?;
        // SAFETY: live handles of the bound context.
        unsafe { result::event::record(e, stream.0 as sys::CUstream) }.map_err(|e| err("recording an event", e))
    }
    fn wait_event(&self, stream: StreamHandle, event: Event) -> Result<()> {
        let s = if stream.0 == 0 {
            // The default stream is its context's: the event's device's (a
            // caller on another device's default stream gets that one).
            self.bind_event(event)?;
            std::ptr::null_mut()
        } else {
            self.bind_stream(stream)?
        };
        // SAFETY: live handles.
        unsafe { result::stream::wait_event(s, event.0 as sys::CUevent, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .map_err(|e| err("waiting on an event", e))
    }
    fn query(&self, event: Event) -> Result<bool> {
        let e = self.bind_event(event)?;
        let _relaxed = Relaxed::here();
        // SAFETY: a live event.
        match unsafe { result::event::query(e) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::cudaError_enum::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(err("device work failed", e)),
        }
    }
    fn ipc_export(&self, ptr: DevicePtr) -> Result<(Vec<u8>, u64)> {
        let (mut base, mut size) = (0, 0);
        // SAFETY: writes two integers; fails for addresses CUDA did not allocate.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(|e| err("finding the allocation (cuMemGetAddressRange)", e))?;
        let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
        let _relaxed = Relaxed::here();
        // SAFETY: writes the handle of the allocation at `base`.
        unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), base) }.result().map_err(|e| err("exporting memory (cuIpcGetMemHandle)", e))?;
        // SAFETY: initialised by the call above; a plain byte array.
        let h = unsafe { h.assume_init() };
        Ok((h.reserved.iter().map(|&c| c as u8).collect(), ptr - base))
    }
    fn ipc_open(&self, device: usize, handle: &[u8]) -> Result<DevicePtr> {
        self.bind(device)?;
        let mut h = sys::CUipcMemHandle { reserved: [0; IPC_LEN] };
        if handle.len() != IPC_LEN {
            return Err(Error::invalid("cuda: an IPC memory handle has 64 bytes"));
        }
        h.reserved.iter_mut().zip(handle).for_each(|(d, s)| *d = *s as _);
        let mut ptr: sys::CUdeviceptr = 0;
        let _relaxed = Relaxed::here();
        // SAFETY: a handle exported by another process of this host.
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, h, sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32) }
            .result()
            .map_err(|e| err("opening peer memory (cuIpcOpenMemHandle)", e))?;
        Ok(ptr)
    }
    unsafe fn ipc_close(&self, ptr: DevicePtr) {
        let _relaxed = Relaxed::here();
        // SAFETY: the caller's contract; opened memory is closed, never freed.
        let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
    }
    fn ipc_export_event(&self, event: Event) -> Result<Vec<u8>> {
        let e = self.bind_event(event)?;
        let mut h = std::mem::MaybeUninit::<sys::CUipcEventHandle>::uninit();
        // SAFETY: an interprocess event of the bound context.
        unsafe { sys::cuIpcGetEventHandle(h.as_mut_ptr(), e) }.result().map_err(|e| err("exporting an event", e))?;
        // SAFETY: initialised above.
        let h = unsafe { h.assume_init() };
        Ok(h.reserved.iter().map(|&c| c as u8).collect())
    }
    fn ipc_open_event(&self, handle: &[u8]) -> Result<Event> {
        self.bind(0)?;
        let mut h = sys::CUipcEventHandle { reserved: [0; IPC_LEN] };
        if handle.len() != IPC_LEN {
            return Err(Error::invalid("cuda: an IPC event handle has 64 bytes"));
        }
        h.reserved.iter_mut().zip(handle).for_each(|(d, s)| *d = *s as _);
        let mut e = std::ptr::null_mut();
        // SAFETY: a handle exported by another process of this host.
        unsafe { sys::cuIpcOpenEventHandle(&mut e, h) }.result().map_err(|e| err("opening a peer event", e))?;
        self.event_device.lock().unwrap_or_else(|p| p.into_inner()).insert(e as u64, 0);
        Ok(Event(e as u64))
    }
    fn is_capturing(&self, stream: StreamHandle) -> Result<bool> {
        let s = self.bind_stream(stream)?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: a stream of this process (the caller's or weft's); the
        // status is written before the call returns.
        unsafe { sys::cuStreamIsCapturing(s, &mut status) }.result().map_err(|e| err("asking whether a stream captures", e))?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }
    fn begin_capture(&self, stream: StreamHandle) -> Result<()> {
        let s = self.bind_stream(stream)?;
        // SAFETY: a stream of this process.
        unsafe { sys::cuStreamBeginCapture_v2(s, sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED) }
            .result()
            .map_err(|e| err("beginning a capture", e))
    }
    fn end_capture(&self, stream: StreamHandle) -> Result<Graph> {
        let s = self.bind_stream(stream)?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: a stream of this process that began a capture; writes one graph handle.
        unsafe { sys::cuStreamEndCapture(s, &mut graph) }.result().map_err(|e| err("ending a capture", e))?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: the graph just captured; writes one handle.
        if let Err(e) = unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) }.result() {
            // SAFETY: the graph is ours and instantiated nowhere.
            let _ = unsafe { sys::cuGraphDestroy(graph) };
            return Err(err("instantiating a captured graph", e));
        }
        let device = self.stream_device(stream);
        self.graphs.lock().unwrap_or_else(|p| p.into_inner()).insert(exec as u64, (graph as u64, device));
        Ok(Graph(exec as u64))
    }
    fn launch_graph(&self, graph: Graph, stream: StreamHandle) -> Result<()> {
        if !self.graphs.lock().unwrap_or_else(|p| p.into_inner()).contains_key(&graph.0) {
            return Err(Error::invalid(format!("cuda: graph {:#x} is not one end_capture made", graph.0)));
        }
        let s = self.bind_stream(stream)?;
        // SAFETY: an instantiated graph of this process, on a stream of it.
        unsafe { sys::cuGraphLaunch(graph.0 as sys::CUgraphExec, s) }.result().map_err(|e| err("launching a graph", e))
    }
    fn destroy_graph(&self, graph: Graph) {
        let Some((g, device)) = self.graphs.lock().unwrap_or_else(|p| p.into_inner()).remove(&graph.0) else { return };
        if self.bind(device).is_ok() {
            // SAFETY: made by end_capture, not used afterwards (launches
            // already queued complete first, as the driver documents).
            unsafe {
                let _ = sys::cuGraphExecDestroy(graph.0 as sys::CUgraphExec);
                let _ = sys::cuGraphDestroy(g as sys::CUgraph);
            }
        }
    }
    unsafe fn signal(&self, stream: StreamHandle, counter: DevicePtr, advance: bool, flag: DevicePtr) -> Result<()> {
        let (mut c, mut f, mut a) = (counter, flag, u32::from(advance));
        let mut params = [&mut c as *mut u64 as *mut c_void, &mut f as *mut u64 as *mut c_void, &mut a as *mut u32 as *mut c_void];
        // SAFETY: (u64*, u64*, unsigned) as the kernel declares; the caller's contract.
        unsafe { self.launch(stream, Kernel::signal(), 1, &mut params) }
    }
    unsafe fn wait_flag(&self, stream: StreamHandle, counter: DevicePtr, flag: DevicePtr, timeout: std::time::Duration) -> Result<()> {
        let (mut c, mut f, mut t) = (counter, flag, u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX));
        let mut params = [&mut c as *mut u64 as *mut c_void, &mut f as *mut u64 as *mut c_void, &mut t as *mut u64 as *mut c_void];
        // SAFETY: (u64*, u64*, u64) as the kernel declares; the caller's contract.
        unsafe { self.launch(stream, Kernel::wait_flag(), 1, &mut params) }
    }
}
