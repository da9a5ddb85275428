//! The device side of an op as its `Work` sees it.

use crate::gpu::{Event, Gpu};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::stream::DeviceCompletion;
use weft::{Error, Result, StreamHandle};

/// Block the host until `event` completes, polling with a growing pause
/// (so no driver call blocks without a deadline); `Timeout` at `deadline`.
pub fn synchronize_event(gpu: &dyn Gpu, event: Event, deadline: Instant, what: &str) -> Result<()> {
    let mut pause = Duration::from_micros(2);
    while !gpu.query(event)? {
        if Instant::now() >= deadline {
            return Err(Error::timeout(format!("device work of {what} did not finish in time")));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_micros(500));
    }
    Ok(())
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
