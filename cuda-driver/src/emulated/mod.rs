//! A GPU in host memory, for CPU-only CI: the backends' pipelines, ordering
//! and error paths run against it through the same tests as on a GPU.
//!
//! Device memory is host memory in memfd mappings (so other processes can
//! open it as with CUDA IPC); a stream is a worker thread running its tasks
//! in order, asynchronously to the host, with a little random delay before
//! each copy or kernel (`WEFT_CUDA_EMULATION_JITTER_US`, default 20) so that
//! a missing wait shows up as a wrong result. Streams capture as CUDA
//! graphs' do where it matters to weft, and graphs replay what they
//! recorded (`capture.rs`); the device-side hand-off (`Gpu::signal`,
//! `Gpu::wait_flag`) is atomics on the shared words, the wait polling them
//! on its stream's thread.

mod capture;
mod queue;
mod shared;

pub use capture::graph_tasks;

use crate::gpu::{check_reduce_all, DevicePtr, Event, Gpu, Graph};
use queue::{EventCell, Queue, Task, Work};
use shared::Mapping;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use weft::{DType, Error, ReduceOp, Result, StreamHandle};

/// Bytes copied between host and device memory in this process
/// (`copy_htod`, `copy_dtoh`), counted as the copies are queued.
static HOST_BYTES: AtomicU64 = AtomicU64::new(0);

/// Bytes this process has copied between host and device memory so far:
/// tests read it around an op to see that the op's payload stayed on the
/// device (a real GPU has no such count).
pub fn host_bytes() -> u64 {
    HOST_BYTES.load(Ordering::Relaxed)
}

/// The emulated GPU of this process.
pub struct EmulatedGpu {
    devices: usize,
    jitter_us: u64,
    streams: Mutex<HashMap<u64, Arc<Queue>>>,
    events: Mutex<HashMap<u64, Arc<EventCell>>>,
    /// Allocations by base address: this process's and opened peers'.
    memory: Mutex<HashMap<u64, Mapping>>,
    /// IPC handles open here, by the base they were opened at: a handle
    /// opens once at a time (CUDA: `CUDA_ERROR_ALREADY_MAPPED`).
    opened: Mutex<HashMap<u64, Vec<u8>>>,
    pinned: Mutex<HashMap<u64, Vec<u64>>>,
}

/// A raw address moved into a stream task.
#[derive(Copy, Clone)]
struct Addr(u64);
// SAFETY: an address, not a reference; the caller of the unsafe copy and
// kernel calls guarantees the memory stays valid until the task has run.
unsafe impl Send for Addr {}

impl Addr {
    /// # Safety
    /// `len` bytes at the address are valid and not written meanwhile.
    unsafe fn bytes<'a>(self, len: usize) -> &'a [u8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(self.0 as *const u8, len) }
    }
    /// # Safety
    /// `len` bytes at the address are valid and not accessed meanwhile.
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut<'a>(self, len: usize) -> &'a mut [u8] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0 as *mut u8, len) }
    }
}

impl EmulatedGpu {
    /// An emulated GPU with `devices` devices.
    pub fn new(devices: usize) -> EmulatedGpu {
        let jitter_us = std::env::var("WEFT_CUDA_EMULATION_JITTER_US").ok().and_then(|v| v.parse().ok()).unwrap_or(20);
        EmulatedGpu {
            devices,
            jitter_us,
            streams: Mutex::default(),
            events: Mutex::default(),
            memory: Mutex::default(),
            opened: Mutex::default(),
            pinned: Mutex::default(),
        }
    }

    /// A stream or event id, unique in the process (emulated GPUs made by
    /// unit tests side by side share `capture.rs`'s state).
    fn id(&self) -> u64 {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }

    fn stream(&self, s: StreamHandle) -> Result<Arc<Queue>> {
        let mut streams = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if s.0 == 0 {
            // The default stream exists from the start, as in CUDA.
            return Ok(streams.entry(0).or_insert_with(|| Arc::new(Queue::start("weft-emu-stream-0".into()))).clone());
        }
        streams.get(&s.0).cloned().ok_or_else(|| Error::invalid(format!("cuda emulation: unknown stream {}", s.0)))
    }

    fn event(&self, e: Event) -> Result<Arc<EventCell>> {
        self.events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&e.0)
            .cloned()
            .ok_or_else(|| Error::invalid(format!("cuda emulation: unknown event {}", e.0)))
    }

    fn device(&self, device: usize) -> Result<()> {
        if device >= self.devices {
            return Err(Error::invalid(format!("cuda emulation: device {device} does not exist ({} devices)", self.devices)));
        }
        Ok(())
    }

    /// Block until every stream has run what was queued so far.
    fn synchronize_all(&self) {
        let streams: Vec<Arc<Queue>> = self.streams.lock().unwrap_or_else(|p| p.into_inner()).values().cloned().collect();
        for q in streams {
            if let Ok(e) = EventCell::create().map(Arc::new) {
                q.record(&e);
                while !e.query().unwrap_or(true) {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
        }
    }

    /// Queue `work` on `s` after a random short delay (recorded instead,
    /// while `s` captures).
    fn enqueue(&self, s: StreamHandle, work: impl Fn() + Send + Sync + 'static) -> Result<()> {
        self.enqueue_work(
            s,
            Arc::new(move || {
                work();
                Ok(())
            }),
        )
    }

    /// As [`EmulatedGpu::enqueue`], for work that can fail the stream.
    fn enqueue_work(&self, s: StreamHandle, work: Work) -> Result<()> {
        let q = self.stream(s)?;
        if !capture::records(s, &work) {
            self.push(&q, work);
        }
        Ok(())
    }

    fn push(&self, q: &Queue, work: Work) {
        let jitter = if self.jitter_us == 0 { 0 } else { pseudo_random() % (self.jitter_us + 1) };
        let task: Task = Box::new(move || {
            if jitter > 0 {
                std::thread::sleep(Duration::from_micros(jitter));
            }
            work()
        });
        q.push(task);
    }
}

/// The 8-byte word at `at`, shared with other threads and processes.
///
/// # Safety
/// 8 valid, 8-aligned bytes there, accessed only atomically meanwhile.
unsafe fn word<'a>(at: Addr) -> &'a AtomicU64 {
    // SAFETY: the caller's contract.
    unsafe { &*(at.0 as *const AtomicU64) }
}

/// A xorshift generator per thread, each thread seeded apart (by process
/// and by a counter): ranks that are threads of one process issue the same
/// sequence of copies, and equal delays would hide the races between them.
fn pseudo_random() -> u64 {
    use std::cell::Cell;
    static THREADS: AtomicU64 = AtomicU64::new(1);
    thread_local!(static STATE: Cell<u64> = Cell::new(
        0x9e37_79b9_7f4a_7c15 ^ u64::from(std::process::id()) ^ THREADS.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x2545_f491_4f6c_dd1d)
    ));
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        x
    })
}

impl Gpu for EmulatedGpu {
    fn name(&self) -> &'static str {
        "emulated"
    }
    fn device_count(&self) -> usize {
        self.devices
    }
    fn device_uuid(&self, device: usize) -> Result<[u8; 16]> {
        // Every process of this host emulates the same devices.
        self.device(device)?;
        let mut u = [0u8; 16];
        u[..8].copy_from_slice(b"weft-emu");
        u[8..].copy_from_slice(&(device as u64).to_le_bytes());
        Ok(u)
    }
    fn new_stream(&self, device: usize) -> Result<StreamHandle> {
        self.device(device)?;
        let id = self.id();
        let q = Arc::new(Queue::start(format!("weft-emu-stream-{id}")));
        self.streams.lock().unwrap_or_else(|p| p.into_inner()).insert(id, q);
        Ok(StreamHandle(id))
    }
    fn destroy_stream(&self, stream: StreamHandle) {
        if stream.0 != 0 {
            // The worker ends once the queued tasks have run.
            self.streams.lock().unwrap_or_else(|p| p.into_inner()).remove(&stream.0);
        }
    }
    fn alloc(&self, device: usize, bytes: usize) -> Result<DevicePtr> {
        self.device(device)?;
        let m = Mapping::create(bytes)?;
        let base = m.base() as u64;
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).insert(base, m);
        Ok(base)
    }
    unsafe fn free(&self, ptr: DevicePtr) {
        // As cuMemFree: wait for all device work, then release.
        self.synchronize_all();
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).remove(&ptr);
    }
    fn alloc_pinned(&self, bytes: usize) -> Result<*mut u8> {
        let words = vec![0u64; bytes.div_ceil(8).max(1)];
        let ptr = words.as_ptr() as u64;
        self.pinned.lock().unwrap_or_else(|p| p.into_inner()).insert(ptr, words);
        Ok(ptr as *mut u8)
    }
    unsafe fn free_pinned(&self, ptr: *mut u8) {
        self.pinned.lock().unwrap_or_else(|p| p.into_inner()).remove(&(ptr as u64));
    }
    unsafe fn copy_htod(&self, stream: StreamHandle, dst: DevicePtr, src: *const u8, bytes: usize) -> Result<()> {
        capture::host_copy(stream, "a copy from host memory")?;
        HOST_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
        // SAFETY: the caller keeps both ranges valid until the task runs.
        unsafe { self.copy_dtod(stream, dst, src as u64, bytes) }
    }
    unsafe fn copy_dtoh(&self, stream: StreamHandle, dst: *mut u8, src: DevicePtr, bytes: usize) -> Result<()> {
        capture::host_copy(stream, "a copy to host memory")?;
        HOST_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { self.copy_dtod(stream, dst as u64, src, bytes) }
    }
    unsafe fn copy_dtod(&self, stream: StreamHandle, dst: DevicePtr, src: DevicePtr, bytes: usize) -> Result<()> {
        let (d, s) = (Addr(dst), Addr(src));
        self.enqueue(stream, move || {
            // SAFETY: the caller keeps both ranges valid until the task runs,
            // and stream order keeps others off them meanwhile.
            unsafe { std::ptr::copy(s.0 as *const u8, d.0 as *mut u8, bytes) }
        })
    }
    unsafe fn reduce(&self, stream: StreamHandle, dst: DevicePtr, src: DevicePtr, count: usize, dtype: DType, op: ReduceOp) -> Result<()> {
        let (d, s, len) = (Addr(dst), Addr(src), count * dtype.size());
        self.enqueue(stream, move || {
            // SAFETY: as in copy_dtod; the ranges do not overlap (caller).
            let (acc, src) = unsafe { (d.bytes_mut(len), s.bytes(len)) };
            weft::kernels::reduce_into(acc, src, dtype, op);
        })
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
        let (srcs, dsts): (Vec<Addr>, Vec<Addr>) = (srcs.iter().map(|p| Addr(*p)).collect(), dsts.iter().map(|p| Addr(*p)).collect());
        let len = count * dtype.size();
        self.enqueue(stream, move || {
            // SAFETY: as in copy_dtod; the result is built aside, so a
            // destination may be a source.
            let mut acc = unsafe { srcs[0].bytes(len) }.to_vec();
            for s in &srcs[1..] {
                // SAFETY: as above.
                weft::kernels::reduce_into(&mut acc, unsafe { s.bytes(len) }, dtype, op);
            }
            weft::kernels::finish(&mut acc, dtype, op, srcs.len());
            for d in &dsts {
                // SAFETY: as above; distinct destinations do not overlap.
                unsafe { d.bytes_mut(len) }.copy_from_slice(&acc);
            }
        })
    }
    unsafe fn premul(&self, stream: StreamHandle, buf: DevicePtr, count: usize, dtype: DType, factor: f64) -> Result<()> {
        let (b, len) = (Addr(buf), count * dtype.size());
        // SAFETY: as in copy_dtod.
        self.enqueue(stream, move || weft::kernels::prescale(unsafe { b.bytes_mut(len) }, dtype, ReduceOp::PremulSum(factor)))
    }
    unsafe fn divide(&self, stream: StreamHandle, buf: DevicePtr, count: usize, dtype: DType, divisor: u32) -> Result<()> {
        let (b, len) = (Addr(buf), count * dtype.size());
        // SAFETY: as in copy_dtod.
        self.enqueue(stream, move || weft::kernels::finish(unsafe { b.bytes_mut(len) }, dtype, ReduceOp::Avg, divisor as usize))
    }
    fn new_event(&self, device: usize, _interprocess: bool) -> Result<Event> {
        self.device(device)?;
        let id = self.id();
        self.events.lock().unwrap_or_else(|p| p.into_inner()).insert(id, Arc::new(EventCell::create()?));
        Ok(Event(id))
    }
    fn destroy_event(&self, event: Event) {
        self.events.lock().unwrap_or_else(|p| p.into_inner()).remove(&event.0);
    }
    fn record(&self, event: Event, stream: StreamHandle) -> Result<()> {
        let (q, e) = (self.stream(stream)?, self.event(event)?);
        if !capture::record(event.0, stream) {
            q.record(&e);
        }
        Ok(())
    }
    fn wait_event(&self, stream: StreamHandle, event: Event) -> Result<()> {
        let (q, e) = (self.stream(stream)?, self.event(event)?);
        if !capture::wait(stream, event.0) {
            q.push(e.wait_task());
        }
        Ok(())
    }
    fn query(&self, event: Event) -> Result<bool> {
        let e = self.event(event)?;
        capture::query(event.0)?;
        e.query()
    }
    fn is_capturing(&self, stream: StreamHandle) -> Result<bool> {
        self.stream(stream)?;
        Ok(capture::capturing(stream))
    }
    fn begin_capture(&self, stream: StreamHandle) -> Result<()> {
        self.stream(stream)?;
        capture::begin_capture(stream)
    }
    fn end_capture(&self, stream: StreamHandle) -> Result<Graph> {
        capture::end_capture(stream).map(Graph)
    }
    fn launch_graph(&self, graph: Graph, stream: StreamHandle) -> Result<()> {
        let (q, works) = (self.stream(stream)?, capture::graph(graph.0)?);
        for w in works {
            if !capture::records(stream, &w) {
                self.push(&q, w);
            }
        }
        Ok(())
    }
    fn destroy_graph(&self, graph: Graph) {
        capture::destroy_graph(graph.0);
    }
    unsafe fn signal(&self, stream: StreamHandle, counter: DevicePtr, advance: bool, flag: DevicePtr) -> Result<()> {
        let (c, f) = (Addr(counter), Addr(flag));
        self.enqueue(stream, move || {
            // SAFETY: the caller keeps both words valid until the task runs.
            let (c, f) = unsafe { (word(c), word(f)) };
            if advance {
                c.fetch_add(1, Ordering::AcqRel);
            }
            // What this stream wrote before is visible once the flag is.
            f.store(c.load(Ordering::Acquire), Ordering::Release);
        })
    }
    unsafe fn wait_flag(&self, stream: StreamHandle, counter: DevicePtr, flag: DevicePtr, timeout: Duration) -> Result<()> {
        let (c, f) = (Addr(counter), Addr(flag));
        self.enqueue_work(
            stream,
            Arc::new(move || {
                // SAFETY: as in `signal`; another rank's mapping stays open
                // while its flag may be awaited.
                let (c, f) = unsafe { (word(c), word(f)) };
                let (want, start) = (c.load(Ordering::Acquire), std::time::Instant::now());
                let mut pause = Duration::from_micros(1);
                while f.load(Ordering::Acquire) < want {
                    if start.elapsed() > timeout {
                        return Err(format!("another rank's hand-off did not come within {timeout:?} (its op never ran)"));
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_micros(200));
                }
                Ok(())
            }),
        )
    }
    fn ipc_export(&self, ptr: DevicePtr) -> Result<(Vec<u8>, u64)> {
        let mem = self.memory.lock().unwrap_or_else(|p| p.into_inner());
        let (base, m) = mem
            .iter()
            .find(|(base, m)| (**base..**base + m.len() as u64).contains(&ptr))
            .ok_or_else(|| Error::invalid(format!("cuda emulation: {ptr:#x} is not in an exportable allocation")))?;
        Ok((m.handle(), ptr - base))
    }
    fn ipc_open(&self, device: usize, handle: &[u8]) -> Result<DevicePtr> {
        self.device(device)?;
        let mut opened = self.opened.lock().unwrap_or_else(|p| p.into_inner());
        if opened.values().any(|h| h == handle) {
            return Err(Error::backend("cuda emulation: this IPC handle is already open in this process (CUDA_ERROR_ALREADY_MAPPED)"));
        }
        let m = Mapping::open(handle)?;
        let base = m.base() as u64;
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).insert(base, m);
        opened.insert(base, handle.to_vec());
        Ok(base)
    }
    unsafe fn ipc_close(&self, ptr: DevicePtr) {
        self.opened.lock().unwrap_or_else(|p| p.into_inner()).remove(&ptr);
        self.memory.lock().unwrap_or_else(|p| p.into_inner()).remove(&ptr);
    }
    fn ipc_export_event(&self, event: Event) -> Result<Vec<u8>> {
        Ok(self.event(event)?.handle())
    }
    fn ipc_open_event(&self, handle: &[u8]) -> Result<Event> {
        let id = self.id();
        self.events.lock().unwrap_or_else(|p| p.into_inner()).insert(id, Arc::new(EventCell::open(handle)?));
        Ok(Event(id))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_order_and_events() {
        let g = EmulatedGpu::new(1);
        let (a, b) = (g.new_stream(0).unwrap(), g.new_stream(0).unwrap());
        let buf = g.alloc(0, 4096).unwrap();
        let host = vec![7u8; 4096];
        let mut out = vec![0u8; 4096];
        let e = g.new_event(0, false).unwrap();
        // SAFETY: host, out and buf outlive the synchronisation below.
        unsafe {
            g.copy_htod(a, buf, host.as_ptr(), 4096).unwrap();
            g.record(e, a).unwrap();
            g.wait_event(b, e).unwrap();
            g.copy_dtoh(b, out.as_mut_ptr(), buf, 4096).unwrap();
        }
        let done = g.new_event(0, false).unwrap();
        g.record(done, b).unwrap();
        while !g.query(done).unwrap() {
            std::thread::yield_now();
        }
        assert_eq!(out, host);
    }

    #[test]
    fn reduce_all_writes_the_reduction_of_every_source_to_every_destination() {
        let g = EmulatedGpu::new(1);
        let s = g.new_stream(0).unwrap();
        let bufs: Vec<Vec<f32>> = (0..3).map(|k| (0..5).map(|i| (i * 10 + k) as f32).collect()).collect();
        let ptrs: Vec<u64> = bufs.iter().map(|b| b.as_ptr() as u64).collect();
        // SAFETY: three buffers of 5 f32, read back after the stream drains;
        // each destination is also a source (in place).
        unsafe { g.reduce_all(s, &ptrs, &ptrs, 5, DType::F32, ReduceOp::Avg).unwrap() };
        crate::synchronize_stream(&g, 0, s, std::time::Instant::now() + Duration::from_secs(10), "test").unwrap();
        for b in &bufs {
            assert_eq!(b, &[1.0, 11.0, 21.0, 31.0, 41.0]);
        }
        let addr = g.alloc(0, 256).unwrap();
        let (handle, offset) = g.ipc_export(addr + 40).unwrap();
        assert_eq!(offset, 40);
        assert_ne!(handle, g.ipc_export(g.alloc(0, 256).unwrap()).unwrap().0, "a handle names one allocation");
        assert!(g.ipc_export(bufs[0].as_ptr() as u64).is_err(), "host memory is not exportable");
    }

    #[test]
    fn ipc_memory_and_events_open_in_another_mapping() {
        let g = EmulatedGpu::new(1);
        let buf = g.alloc(0, 64).unwrap();
        let other = g.ipc_open(0, &g.ipc_export(buf).unwrap().0).unwrap();
        assert_ne!(buf, other);
        let again = g.ipc_open(0, &g.ipc_export(buf).unwrap().0);
        assert!(again.unwrap_err().to_string().contains("already open"), "a handle opens once at a time");
        // SAFETY: 64 valid bytes each; both map the same pages.
        unsafe {
            *(buf as *mut u8) = 42;
            assert_eq!(*(other as *const u8), 42);
            g.ipc_close(other);
        }
        let reopened = g.ipc_open(0, &g.ipc_export(buf).unwrap().0).unwrap();
        // SAFETY: as above.
        unsafe {
            g.ipc_close(reopened);
            g.free(buf);
        }
        let e = g.new_event(0, true).unwrap();
        let f = g.ipc_open_event(&g.ipc_export_event(e).unwrap()).unwrap();
        let s = g.new_stream(0).unwrap();
        g.record(e, s).unwrap();
        while !g.query(f).unwrap() {
            std::thread::yield_now();
        }
    }
}
