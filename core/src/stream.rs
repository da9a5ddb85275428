//! Device streams as core sees them: an opaque handle, the thread's current
//! stream, and the device-side completion an op hands back to its [`Work`].
//!
//! Semantics follow c10d: a device op is ordered after the work already on
//! the caller's stream (the one in [`crate::OpOptions::stream`], else this
//! thread's [`current_stream`], else the device's default stream), runs on
//! the backend's own streams, and [`Work::wait`] makes the caller's stream
//! wait for it without blocking the host; [`Work::synchronize`] blocks the
//! host. Core never calls a device API itself: backends implement
//! [`DeviceCompletion`].
//!
//! [`Work`]: crate::Work
//! [`Work::wait`]: crate::Work::wait
//! [`Work::synchronize`]: crate::Work::synchronize

use crate::error::Result;
use std::cell::Cell;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// An opaque device stream: a `CUstream` cast to an integer for CUDA (0 is
/// the legacy default stream), or a stream id of a device emulation.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct StreamHandle(pub u64);

thread_local! {
    static CURRENT: Cell<Option<StreamHandle>> = const { Cell::new(None) };
}

/// Make `stream` this thread's current stream: device ops issued from this
/// thread without an explicit stream are ordered after it. `None` restores
/// the device's default stream.
pub fn set_current_stream(stream: Option<StreamHandle>) {
    CURRENT.with(|c| c.set(stream));
}

/// This thread's current stream, if one was set.
pub fn current_stream() -> Option<StreamHandle> {
    CURRENT.with(Cell::get)
}

/// The device-side end of an op, created by a device backend: an event
/// recorded after the op's last device work, and the caller's stream.
pub trait DeviceCompletion: Send + Sync {
    /// Make the caller's stream wait for the op (no host blocking).
    fn order_caller_stream(&self) -> Result<()>;
    /// Whether the device work has finished.
    fn is_complete(&self) -> Result<bool>;
    /// Block the host until the device work has finished, or fail with
    /// `Timeout` at `deadline`.
    fn synchronize(&self, deadline: Instant) -> Result<()>;
}

/// Where a backend leaves an op's [`DeviceCompletion`]; part of
/// [`crate::backend::OpContext`]. Ops on host tensors get an empty slot
/// (`default()`: nothing allocated, as no backend sets one for them).
#[derive(Clone, Default)]
pub struct CompletionSlot(Option<Arc<Shared>>);

/// A device op's slot, shared by every copy of its context.
type Shared = Mutex<Option<Arc<dyn DeviceCompletion>>>;

impl CompletionSlot {
    /// A slot for an op on device tensors.
    pub fn for_device() -> Self {
        CompletionSlot(Some(Arc::default()))
    }
    /// Hand the op's completion to its work handle.
    ///
    /// # Panics
    /// On the empty slot of a host op: a backend bug (the op then fails
    /// with an internal error instead of returning before its device work).
    pub fn set(&self, completion: Arc<dyn DeviceCompletion>) {
        let slot = self.0.as_ref().expect("a device completion set on a host op's empty CompletionSlot");
        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(completion);
    }
    /// Take what a backend set.
    pub(crate) fn take(&self) -> Option<Arc<dyn DeviceCompletion>> {
        self.0.as_ref()?.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

impl std::fmt::Debug for CompletionSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            None => write!(f, "CompletionSlot(host)"),
            Some(s) => write!(f, "CompletionSlot(set={})", s.lock().map(|g| g.is_some()).unwrap_or(false)),
        }
    }
}
