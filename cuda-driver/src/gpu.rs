//! The GPU interface the CUDA backends are written against.

use weft::{DType, ReduceOp, Result, StreamHandle};

/// A device address (a `CUdeviceptr`, or a host address in the emulation).
pub type DevicePtr = u64;

/// The most sources and destinations one [`Gpu::reduce_all`] takes.
pub const MAX_REDUCE_ALL: usize = 8;

/// `InvalidArgument` unless [`Gpu::reduce_all`] can take these pointers.
pub fn check_reduce_all(srcs: &[DevicePtr], dsts: &[DevicePtr]) -> Result<()> {
    if (1..=MAX_REDUCE_ALL).contains(&srcs.len()) && (1..=MAX_REDUCE_ALL).contains(&dsts.len()) {
        return Ok(());
    }
    Err(weft::Error::invalid(format!(
        "cuda: reduce_all takes 1 to {MAX_REDUCE_ALL} sources and destinations, got {} and {}",
        srcs.len(),
        dsts.len()
    )))
}

/// A captured CUDA graph, instantiated (a `CUgraphExec` and its
/// `CUgraph`, or the emulation's recording): launch it with
/// [`Gpu::launch_graph`], free it with [`Gpu::destroy_graph`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Graph(pub u64);

/// An event handle of one [`Gpu`] implementation.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct Event(pub u64);

/// The GPU calls weft's CUDA backends make; every call is asynchronous on a
/// stream unless it says otherwise. Implementations: the CUDA driver and a
/// host-memory emulation ([`crate::gpu()`] picks one per process).
///
/// The copy and kernel calls are `unsafe`: the caller guarantees the
/// addresses are valid for the given lengths until the stream reaches them.
pub trait Gpu: Send + Sync {
    /// `"cuda-driver"` or `"emulated"`.
    fn name(&self) -> &'static str;
    /// Number of devices.
    fn device_count(&self) -> usize;
    /// The physical device's UUID: the same in every process that sees the
    /// device, whatever its ordinal there (`CUDA_VISIBLE_DEVICES`).
    fn device_uuid(&self, device: usize) -> Result<[u8; 16]>;
    /// A new non-blocking stream on `device`.
    fn new_stream(&self, device: usize) -> Result<StreamHandle>;
    /// Destroy a stream from `new_stream` (work already queued still runs).
    fn destroy_stream(&self, stream: StreamHandle);
    /// Device memory of `bytes` that CUDA IPC can export (`cuMemAlloc`,
    /// never pool memory).
    fn alloc(&self, device: usize, bytes: usize) -> Result<DevicePtr>;
    /// Free memory from [`Gpu::alloc`] (synchronizes with its users).
    ///
    /// # Safety
    /// `ptr` came from `alloc` and is not used afterwards.
    unsafe fn free(&self, ptr: DevicePtr);
    /// Page-locked host memory the CPU reads fast (not write-combined).
    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8>;
    /// Free memory from [`Gpu::alloc_pinned`].
    ///
    /// # Safety
    /// `ptr` came from `alloc_pinned` and no stream still uses it.
    unsafe fn free_pinned(&self, ptr: *mut u8);
    /// Copy host to device on `stream`.
    ///
    /// # Safety
    /// Both ranges are valid until the stream has run the copy.
    unsafe fn copy_htod(&self, stream: StreamHandle, dst: DevicePtr, src: *const u8, bytes: usize) -> Result<()>;
    /// Copy device to host on `stream`.
    ///
    /// # Safety
    /// As [`Gpu::copy_htod`].
    unsafe fn copy_dtoh(&self, stream: StreamHandle, dst: *mut u8, src: DevicePtr, bytes: usize) -> Result<()>;
    /// Copy device to device on `stream`.
    ///
    /// # Safety
    /// As [`Gpu::copy_htod`].
    unsafe fn copy_dtod(&self, stream: StreamHandle, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()>;
    /// `dst[i] = dst[i] (op) src[i]` for `count` elements (`Avg` and
    /// `PremulSum` combine as sums).
    ///
    /// # Safety
    /// As [`Gpu::copy_htod`]; the ranges do not overlap.
    unsafe fn reduce(&self, stream: StreamHandle, dst: DevicePtr, src: DevicePtr, count: usize, dtype: DType, op: ReduceOp) -> Result<()>;
    /// The full reduction of `srcs` written to every one of `dsts`:
    /// `dst[i] = srcs[0][i] (op) srcs[1][i] (op) ...`, in the order given,
    /// for `count` elements (`Avg` divides the sum by `srcs.len()`;
    /// `PremulSum` sums inputs already scaled). A destination may be one of
    /// the sources (each element is read before it is written). At most
    /// [`MAX_REDUCE_ALL`] of each.
    ///
    /// # Safety
    /// As [`Gpu::copy_htod`], for every range; distinct destinations do not overlap.
    unsafe fn reduce_all(
        &self,
        stream: StreamHandle,
        srcs: &[DevicePtr],
        dsts: &[DevicePtr],
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()>;
    /// `buf[i] *= factor` (the `PremulSum` scaling of a rank's contribution).
    ///
    /// # Safety
    /// As [`Gpu::copy_htod`].
    unsafe fn premul(&self, stream: StreamHandle, buf: DevicePtr, count: usize, dtype: DType, factor: f64) -> Result<()>;
    /// `buf[i] /= divisor` (finishing `Avg`).
    ///
    /// # Safety
    /// As [`Gpu::copy_htod`].
    unsafe fn divide(&self, stream: StreamHandle, buf: DevicePtr, count: usize, dtype: DType, divisor: u32) -> Result<()>;
    /// A new event (timing disabled); `interprocess` makes it exportable.
    fn new_event(&self, device: usize, interprocess: bool) -> Result<Event>;
    /// Destroy an event (from `new_event` or `ipc_open_event`).
    fn destroy_event(&self, event: Event);
    /// Record `event` on `stream`.
    fn record(&self, event: Event, stream: StreamHandle) -> Result<()>;
    /// Make `stream` wait for the latest record of `event` (no host block).
    fn wait_event(&self, stream: StreamHandle, event: Event) -> Result<()>;
    /// Whether the latest record of `event` has completed; `Err` when the
    /// device work before it failed.
    fn query(&self, event: Event) -> Result<bool>;
    /// An IPC handle of the allocation that contains `ptr`, and `ptr`'s
    /// offset in it. `Err` for memory CUDA IPC cannot export (pool
    /// allocations, host memory). A handle names one allocation: memory
    /// freed and allocated again gets a new one.
    fn ipc_export(&self, ptr: DevicePtr) -> Result<(Vec<u8>, u64)>;
    /// Map another process's allocation; close with [`Gpu::ipc_close`].
    fn ipc_open(&self, device: usize, handle: &[u8]) -> Result<DevicePtr>;
    /// Unmap what `ipc_open` mapped (never `free` it).
    ///
    /// # Safety
    /// `ptr` came from `ipc_open` and no stream still uses it.
    unsafe fn ipc_close(&self, ptr: DevicePtr);
    /// An IPC handle of an interprocess event.
    fn ipc_export_event(&self, event: Event) -> Result<Vec<u8>>;
    /// Open another process's event, for `wait_event`.
    fn ipc_open_event(&self, handle: &[u8]) -> Result<Event>;
    /// Whether `stream` is capturing work into a CUDA graph
    /// (`cuStreamIsCapturing`): while it is, its work runs only when the
    /// graph is launched, and nothing may copy between it and host memory
    /// or wait on the host for what it records.
    fn is_capturing(&self, stream: StreamHandle) -> Result<bool>;
    /// Start capturing the work queued on `stream` into a graph
    /// (`cuStreamBeginCapture`, relaxed mode: other threads may call the
    /// driver meanwhile). What frameworks do for their own graphs (torch's
    /// `torch.cuda.graph`); weft's tests do it here.
    fn begin_capture(&self, stream: StreamHandle) -> Result<()>;
    /// End the capture `stream` began: the graph, instantiated; an error if
    /// anything invalidated the capture.
    fn end_capture(&self, stream: StreamHandle) -> Result<Graph>;
    /// Queue one run of `graph` on `stream` (`cuGraphLaunch`).
    fn launch_graph(&self, graph: Graph, stream: StreamHandle) -> Result<()>;
    /// Free a graph from [`Gpu::end_capture`] (launches already queued
    /// still run).
    fn destroy_graph(&self, graph: Graph);
    /// A hand-off to other ranks that runs on the device alone, so a graph
    /// can capture it: after the work queued before it on `stream`, add one
    /// to the word at `counter` if `advance`, make everything written so far
    /// visible to other devices and processes, then store the counter's
    /// value in the word at `flag` (which other ranks read through a
    /// mapping).
    ///
    /// # Safety
    /// Both words are valid device memory (8 bytes, 8-aligned) until the
    /// stream has run this; nothing else writes them meanwhile.
    unsafe fn signal(&self, stream: StreamHandle, counter: DevicePtr, advance: bool, flag: DevicePtr) -> Result<()>;
    /// Hold `stream` (on the device) until the word at `flag` (another
    /// rank's [`Gpu::signal`]) is at least the word at `counter`, read when
    /// the wait starts. Past `timeout` the stream fails (a sticky error its
    /// next synchronisation reports) instead of waiting forever.
    ///
    /// # Safety
    /// As [`Gpu::signal`]; `flag` may be another process's memory, mapped.
    unsafe fn wait_flag(&self, stream: StreamHandle, counter: DevicePtr, flag: DevicePtr, timeout: std::time::Duration) -> Result<()>;
}
