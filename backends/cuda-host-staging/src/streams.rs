//! The copy streams of posted point-to-point ops (`p2p.rs`): one per
//! device, owned by the [`Staging`](crate::pipeline::Staging) of a group,
//! each ordered after the caller's stream whenever an op is posted.

use std::collections::HashMap;
use std::sync::Mutex;
use weft::{Result, StreamHandle};
use weft_cuda_driver::{Event, Gpu};

/// Per device: a stream for the copies of posted ops, and an event that
/// orders it after the caller's stream.
#[derive(Default)]
pub(crate) struct P2pStreams(Mutex<HashMap<usize, (StreamHandle, Event)>>);

impl P2pStreams {
    /// The copy stream of `device`, made to wait for `caller`'s work so far.
    pub(crate) fn after(&self, g: &dyn Gpu, device: usize, caller: StreamHandle) -> Result<StreamHandle> {
        let mut streams = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let (stream, event) = match streams.get(&device) {
            Some(s) => *s,
            None => {
                let s = (g.new_stream(device)?, g.new_event(device, false)?);
                streams.insert(device, s);
                s
            }
        };
        g.record(event, caller)?;
        g.wait_event(stream, event)?;
        Ok(stream)
    }

    /// Destroy the streams (their work is done: every posted op has
    /// completed before its group goes).
    pub(crate) fn close(&self, g: &dyn Gpu) {
        for (_, (stream, event)) in self.0.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            g.destroy_event(event);
            g.destroy_stream(stream);
        }
    }
}
