//! Windows in device memory: each rank allocates its registered bytes with
//! `cuMemAlloc` and every rank maps every other rank's through CUDA IPC. A
//! put or a get is one device copy on the caller's stream into or out of
//! the peer's mapping. A signal records this rank's interprocess event on
//! the caller's stream and then counts through the host window core made
//! for the purpose ([`WindowSpec::signals`]); a wait takes the count there,
//! then makes the caller's stream wait for the origin's event: work the
//! caller queues after it sees the origin's puts.
//!
//! Ranks that are threads of one process use each other's pointers and
//! events as they are (CUDA IPC cannot open a handle in the process that
//! made it).

use std::sync::Arc;
use std::time::Instant;
use weft::window::{Later, RmaCall, Span, WindowSpec, WindowTransport};
use weft::{Device, Error, Result, StreamHandle};
use weft_cuda_driver::{synchronize_stream, DevicePtr, Event, Gpu};

/// This rank's side of a device window.
pub(crate) struct CudaWindow {
    gpu: Arc<dyn Gpu>,
    device: usize,
    rank: usize,
    len: usize,
    /// Every rank's registered memory, as this process addresses it.
    memory: Vec<DevicePtr>,
    /// Every rank's signal event, as this process addresses it.
    events: Vec<Event>,
    /// What `ipc_open` and `ipc_open_event` opened (closed on drop).
    opened: Vec<DevicePtr>,
    opened_events: Vec<Event>,
    /// The host window signals are counted in.
    signals: Arc<dyn WindowTransport>,
    /// The window's store namespace, the ranks in other processes (rank,
    /// pid) and the timeout: for closing down (`Drop`).
    store: Arc<dyn weft::store::Store>,
    others: Vec<(usize, u32)>,
    timeout: std::time::Duration,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    (0..s.len()).step_by(2).map(|i| s.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect()
}

impl CudaWindow {
    /// Allocate, zero and export this rank's memory and event, then map
    /// every peer's; every rank succeeds or all fail together.
    pub(crate) fn create(gpu: Arc<dyn Gpu>, spec: &WindowSpec) -> Result<CudaWindow> {
        let Device::Cuda(ordinal) = spec.device else { return Err(Error::invalid("cuda-device: a host window")) };
        let signals =
            spec.signals.clone().ok_or_else(|| Error::invalid("cuda-device: a device window needs a host window for its signals"))?;
        let (device, rank, size, len) = (ordinal as usize, spec.rank, spec.size, spec.sizes[spec.rank]);
        let store = &*spec.store;
        let left = || spec.deadline.saturating_duration_since(Instant::now());
        let what = "cuda-device window: CUDA IPC";
        let mut win = CudaWindow {
            gpu: gpu.clone(),
            device,
            rank,
            len,
            memory: vec![0; size],
            events: vec![Event(0); size],
            opened: Vec::new(),
            opened_events: Vec::new(),
            signals,
            store: spec.store.clone(),
            others: Vec::new(),
            timeout: spec.deadline.saturating_duration_since(Instant::now()),
        };
        let exported = (|| {
            let mem = gpu.alloc(device, len.max(1))?;
            win.memory[rank] = mem;
            let zeros = vec![0u8; len.min(16 << 20)];
            let stream = StreamHandle::default();
            for at in (0..len).step_by(zeros.len().max(1)) {
                let n = zeros.len().min(len - at);
                // SAFETY: inside the allocation; `zeros` lives until the
                // stream is synchronized below.
                unsafe { gpu.copy_htod(stream, mem + at as u64, zeros.as_ptr(), n)? };
            }
            synchronize_stream(&*gpu, device, stream, spec.deadline, "cuda-device window: zeroing")?;
            let event = gpu.new_event(device, true)?;
            win.events[rank] = event;
            let (handle, offset) = gpu.ipc_export(mem)?;
            let record = format!(
                "{} {} {} {offset} {} {mem} {}",
                std::process::id(),
                hex(&gpu.device_uuid(device)?),
                hex(&handle),
                hex(&gpu.ipc_export_event(event)?),
                event.0
            );
            store.set(&format!("ipc/{rank}"), record.as_bytes())
        })();
        weft::store::all_or_none(store, "export", rank, size, left(), exported, what)?;
        let opened = win.open_peers(store, left());
        weft::store::all_or_none(store, "open", rank, size, left(), opened, what)?;
        Ok(win)
    }

    /// Map every other rank's memory and event.
    fn open_peers(&mut self, store: &dyn weft::store::Store, timeout: std::time::Duration) -> Result<()> {
        let me = std::process::id();
        for r in (0..self.memory.len()).filter(|&r| r != self.rank) {
            let text = String::from_utf8_lossy(&store.get(&format!("ipc/{r}"), timeout)?).into_owned();
            let bad = || Error::backend(format!("cuda-device window: malformed IPC record of rank {r}: {text:?}"));
            let f: Vec<&str> = text.split(' ').collect();
            let [pid, _uuid, handle, offset, event, mem, event_id] = f[..] else { return Err(bad()) };
            let num = |s: &str| s.parse::<u64>().map_err(|_| bad());
            if num(pid)? == me as u64 {
                self.memory[r] = num(mem)?;
                self.events[r] = Event(num(event_id)?);
                continue;
            }
            self.others.push((r, num(pid)? as u32));
            let base = self.gpu.ipc_open(self.device, &unhex(handle).ok_or_else(bad)?)?;
            self.opened.push(base);
            self.memory[r] = base + num(offset)?;
            let e = self.gpu.ipc_open_event(&unhex(event).ok_or_else(bad)?)?;
            self.opened_events.push(e);
            self.events[r] = e;
        }
        Ok(())
    }

    fn stream(call: &RmaCall) -> StreamHandle {
        call.stream.unwrap_or_default()
    }
}

impl WindowTransport for CudaWindow {
    fn local(&self) -> Span {
        Span { ptr: self.memory[self.rank] as *mut u8, len: self.len }
    }

    unsafe fn put(&self, src: Span, dst: usize, offset: usize, call: &RmaCall, _: Later<'_>) -> Option<Result<()>> {
        let to = self.memory[dst] + offset as u64;
        // SAFETY: inside `dst`'s registered bytes (checked by the window),
        // mapped here; `src` is valid until the stream ran the copy (the
        // caller's promise).
        Some(unsafe { self.gpu.copy_dtod(Self::stream(call), to, src.ptr as DevicePtr, src.len) })
    }

    unsafe fn get(&self, dst: Span, src: usize, offset: usize, call: &RmaCall, _: Later<'_>) -> Option<Result<()>> {
        let from = self.memory[src] + offset as u64;
        // SAFETY: as in `put`.
        Some(unsafe { self.gpu.copy_dtod(Self::stream(call), dst.ptr as DevicePtr, from, dst.len) })
    }

    fn signal(&self, peer: usize, call: &RmaCall, later: Later<'_>) -> Option<Result<()>> {
        // The event first: once the count is seen, its record is issued.
        if let Err(e) = self.gpu.record(self.events[self.rank], Self::stream(call)) {
            return Some(Err(e));
        }
        self.signals.signal(peer, call, later)
    }

    fn wait_signal(&self, peer: usize, count: u64, call: &RmaCall) -> Result<()> {
        self.signals.wait_signal(peer, count, call)?;
        self.gpu.wait_event(Self::stream(call), self.events[peer])
    }

    fn remote(&self, rank: usize) -> Option<*mut u8> {
        Some(self.memory[rank] as *mut u8)
    }

    /// An event after the copy on the caller's stream: the Work's device
    /// side (dropping it waits for the copy, as for every device op).
    fn queued(&self, call: &RmaCall) -> Result<Option<Arc<dyn weft::stream::DeviceCompletion>>> {
        let stream = Self::stream(call);
        let done = weft_cuda_driver::StreamCompletion::record(self.gpu.clone(), self.device, stream, stream)?;
        Ok(Some(Arc::new(done)))
    }

    /// Drains this thread's current stream (puts and gets on other streams
    /// are the caller's to synchronize first); core then closes the host
    /// window, which every rank passes only once all have drained.
    fn close(&self, deadline: Instant) -> Result<()> {
        let stream = weft::stream::current_stream().unwrap_or_default();
        synchronize_stream(&*self.gpu, self.device, stream, deadline, "cuda-device window: deregistering")
    }
}

impl Drop for CudaWindow {
    fn drop(&mut self) {
        for e in self.opened_events.drain(..) {
            self.gpu.destroy_event(e);
        }
        for mapped in self.opened.drain(..) {
            // SAFETY: opened by ipc_open; the window was closed (every
            // rank's copies drained) or is abandoned on an error path.
            unsafe { self.gpu.ipc_close(mapped) };
        }
        crate::setup::await_peers_closed(&*self.store, self.rank, &self.others, self.timeout);
        if self.events[self.rank] != Event(0) {
            self.gpu.destroy_event(self.events[self.rank]);
        }
        if self.memory[self.rank] != 0 {
            // SAFETY: allocated in `create`; `free` waits for device work.
            unsafe { self.gpu.free(self.memory[self.rank]) };
        }
    }
}
