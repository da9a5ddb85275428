//! The device side of an op as its `Work` sees it.

use crate::gpu::{Event, Gpu};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::stream::DeviceCompletion;
use weft::{Error, Result, StreamHandle};

/// Block the host until `event` completes, polling (so no driver call
/// blocks without a deadline); `Timeout` at `deadline`. It spins for the
/// first 50 µs, then sleeps with a pause growing to 100 µs, so a long wait
/// costs little CPU.
pub fn synchronize_event(gpu: &dyn Gpu, event: Event, deadline: Instant, what: &str) -> Result<()> {
    synchronize_event_checked(gpu, event, deadline, what, Duration::from_micros(50), &|| Ok(()))
}

/// [`synchronize_event`], spinning for `spin` before it sleeps, and calling
/// `check` about every 100 µs: its error (a peer found dead, say: an event
/// of a process that died never completes) ends the wait.
pub fn synchronize_event_checked(
    gpu: &dyn Gpu,
    event: Event,
    deadline: Instant,
    what: &str,
    spin: Duration,
    check: &dyn Fn() -> Result<()>,
) -> Result<()> {
    let start = Instant::now();
    let mut checked = start;
    let mut pause = Duration::from_micros(2);
    while !gpu.query(event)? {
        let now = Instant::now();
        if now >= deadline {
            return Err(Error::timeout(format!("device work of {what} did not finish in time")));
        }
        if now - checked >= Duration::from_micros(100) {
            check()?;
            checked = now;
        }
        if now - start < spin {
            std::thread::yield_now();
        } else {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(100));
        }
    }
    Ok(())
}

/// Make `waiter` wait for the work queued on `stream` so far (no host block).
pub fn order_after(gpu: &dyn Gpu, device: usize, waiter: StreamHandle, stream: StreamHandle) -> Result<()> {
    let e = gpu.new_event(device, false)?;
    // The wait captures the record; the event can go right after.
    let r = gpu.record(e, stream).and_then(|()| gpu.wait_event(waiter, e));
    gpu.destroy_event(e);
    r
}

/// Block the host until the work queued on `stream` so far has run, or
/// fail with `Timeout` at `deadline`.
pub fn synchronize_stream(gpu: &dyn Gpu, device: usize, stream: StreamHandle, deadline: Instant, what: &str) -> Result<()> {
    let e = gpu.new_event(device, false)?;
    let r = gpu.record(e, stream).and_then(|()| synchronize_event(gpu, e, deadline, what));
    gpu.destroy_event(e);
    r
}

/// An event recorded after an op's last device work, and the caller's
/// stream to order after it. Owns the event.
pub struct StreamCompletion {
    gpu: Arc<dyn Gpu>,
    event: Event,
    caller: StreamHandle,
}

impl StreamCompletion {
    /// Record a new event on `stream` (where the op's last work is queued)
    /// for a caller on `caller`.
    pub fn record(gpu: Arc<dyn Gpu>, device: usize, stream: StreamHandle, caller: StreamHandle) -> Result<StreamCompletion> {
        let event = gpu.new_event(device, false)?;
        let c = StreamCompletion { gpu, event, caller };
        c.gpu.record(event, stream)?;
        Ok(c)
    }
}

impl DeviceCompletion for StreamCompletion {
    fn order_caller_stream(&self) -> Result<()> {
        self.gpu.wait_event(self.caller, self.event)
    }
    fn is_complete(&self) -> Result<bool> {
        self.gpu.query(self.event)
    }
    fn synchronize(&self, deadline: Instant) -> Result<()> {
        synchronize_event(&*self.gpu, self.event, deadline, "an op")
    }
}

impl Drop for StreamCompletion {
    fn drop(&mut self) {
        self.gpu.destroy_event(self.event);
    }
}
