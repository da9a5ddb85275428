//! Stream capture (CUDA graphs) as the emulation models it: what a real
//! device refuses while a stream captures, so CPU-only tests see a path
//! that would break a capture.
//!
//! - [`begin_capture`] starts capturing on a stream; [`end_capture`] ends
//!   it, with an error if anything invalidated the capture meanwhile.
//! - Work queued on a capturing stream is recorded, not run (replaying a
//!   graph is not modelled).
//! - A stream that waits for an event recorded during a capture joins that
//!   capture, as on a real device.
//! - A copy between a capturing stream and host memory, and a query of an
//!   event recorded during a capture, are errors ("operation not permitted
//!   when stream is capturing") that invalidate the capture.

use std::collections::HashMap;
use std::sync::Mutex;
use weft::{Error, Result, StreamHandle};

/// One capture: its origin stream, and why it was invalidated, if it was.
struct Capture {
    origin: u64,
    invalid: Option<String>,
    /// Tasks recorded into it (queued on one of its streams).
    recorded: usize,
}

#[derive(Default)]
struct State {
    next: u64,
    captures: HashMap<u64, Capture>,
    /// Stream -> the capture it takes part in.
    streams: HashMap<u64, u64>,
    /// Event -> the capture its latest record belongs to.
    events: HashMap<u64, u64>,
}

/// One emulated GPU per process, so the capture state is the process's.
static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut State) -> T) -> T {
    let mut s = STATE.lock().unwrap_or_else(|p| p.into_inner());
    f(s.get_or_insert_with(State::default))
}

/// Start capturing the work queued on `stream` (`cudaStreamBeginCapture`).
pub fn begin_capture(stream: StreamHandle) -> Result<()> {
    with(|s| {
        if stream.0 == 0 {
            return Err(Error::invalid("cuda emulation: the legacy default stream cannot capture"));
        }
        if s.streams.contains_key(&stream.0) {
            return Err(Error::invalid(format!("cuda emulation: stream {} is already capturing", stream.0)));
        }
        s.next += 1;
        let id = s.next;
        s.captures.insert(id, Capture { origin: stream.0, invalid: None, recorded: 0 });
        s.streams.insert(stream.0, id);
        Ok(())
    })
}

/// End the capture that `stream` began (`cudaStreamEndCapture`): the
/// number of tasks it recorded, or why it was invalidated.
pub fn end_capture(stream: StreamHandle) -> Result<usize> {
    with(|s| {
        let id = s.streams.get(&stream.0).copied().filter(|id| s.captures.get(id).is_some_and(|c| c.origin == stream.0));
        let id = id.ok_or_else(|| Error::invalid(format!("cuda emulation: stream {} did not begin a capture", stream.0)))?;
        s.streams.retain(|_, c| *c != id);
        s.events.retain(|_, c| *c != id);
        let c = s.captures.remove(&id).expect("listed");
        match c.invalid {
            Some(why) => Err(Error::backend(format!("cuda emulation: the capture was invalidated: {why}"))),
            None => Ok(c.recorded),
        }
    })
}

/// Whether `stream` takes part in a capture.
pub(super) fn capturing(stream: StreamHandle) -> bool {
    with(|s| s.streams.contains_key(&stream.0))
}

/// Work queued on `stream`: recorded into its capture (true), or to run.
pub(super) fn records(stream: StreamHandle) -> bool {
    with(|s| match s.streams.get(&stream.0).copied() {
        Some(id) => {
            s.captures.get_mut(&id).expect("listed").recorded += 1;
            true
        }
        None => false,
    })
}

/// A copy between `stream` and host memory: refused while it captures
/// (and the capture is invalidated).
pub(super) fn host_copy(stream: StreamHandle, what: &str) -> Result<()> {
    with(|s| match s.streams.get(&stream.0).copied() {
        Some(id) => Err(invalidate(s, id, format!("{what} on capturing stream {}", stream.0))),
        None => Ok(()),
    })
}

/// `event` recorded on `stream`: true if that record is captured (the
/// event then stands for a point in the capture), false to queue it.
pub(super) fn record(event: u64, stream: StreamHandle) -> bool {
    with(|s| match s.streams.get(&stream.0).copied() {
        Some(id) => {
            s.events.insert(event, id);
            true
        }
        None => {
            s.events.remove(&event);
            false
        }
    })
}

/// `stream` waits for `event`: if its record is captured, `stream` joins
/// that capture (true: nothing to queue).
pub(super) fn wait(stream: StreamHandle, event: u64) -> bool {
    with(|s| match s.events.get(&event).copied() {
        Some(id) => {
            s.streams.insert(stream.0, id);
            true
        }
        // (A capturing stream's wait for an event from outside is recorded.)
        None => s.streams.contains_key(&stream.0),
    })
}

/// A query of `event`: refused if its record is captured.
pub(super) fn query(event: u64) -> Result<()> {
    with(|s| match s.events.get(&event).copied() {
        Some(id) => Err(invalidate(s, id, format!("a query of event {event}, recorded during the capture"))),
        None => Ok(()),
    })
}

fn invalidate(s: &mut State, id: u64, what: String) -> Error {
    let c = s.captures.get_mut(&id).expect("listed");
    c.invalid.get_or_insert_with(|| what.clone());
    Error::backend(format!("cuda emulation: operation not permitted when stream is capturing ({what})"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emulated::EmulatedGpu;
    use crate::gpu::Gpu;

    #[test]
    fn a_capture_records_device_work_and_refuses_the_host() {
        let g = EmulatedGpu::new(1);
        let (s, other) = (g.new_stream(0).unwrap(), g.new_stream(0).unwrap());
        let buf = g.alloc(0, 64).unwrap();
        let mut host = vec![0u8; 64];
        assert!(!g.is_capturing(s).unwrap());
        begin_capture(s).unwrap();
        assert!(g.is_capturing(s).unwrap() && !g.is_capturing(other).unwrap());
        assert!(begin_capture(s).is_err(), "twice");
        // Device work is recorded, not run.
        // SAFETY: `buf` holds 64 bytes.
        unsafe { g.premul(s, buf, 16, weft::DType::F32, 2.0).unwrap() };
        // An event recorded in the capture stands for a point in it: a
        // stream that waits for it joins the capture.
        let e = g.new_event(0, false).unwrap();
        g.record(e, s).unwrap();
        g.wait_event(other, e).unwrap();
        assert!(g.is_capturing(other).unwrap());
        assert_eq!(end_capture(s).unwrap(), 1);
        assert!(!g.is_capturing(s).unwrap() && !g.is_capturing(other).unwrap());
        assert!(end_capture(s).is_err(), "not capturing any more");

        // A host copy, or a query of a captured event, is refused and
        // invalidates the capture.
        begin_capture(s).unwrap();
        // SAFETY: both ranges hold 64 bytes.
        let copy = unsafe { g.copy_dtoh(s, host.as_mut_ptr(), buf, 64) };
        assert!(copy.unwrap_err().to_string().contains("not permitted when stream is capturing"));
        assert!(end_capture(s).unwrap_err().to_string().contains("copy to host memory"));
        begin_capture(s).unwrap();
        g.record(e, s).unwrap();
        assert!(g.query(e).is_err());
        assert!(end_capture(s).unwrap_err().to_string().contains("query"));
        assert!(begin_capture(StreamHandle(0)).is_err(), "the legacy default stream");
        // Outside a capture the stream runs its work again.
        let f = g.new_event(0, false).unwrap();
        // SAFETY: as above.
        unsafe { g.copy_dtoh(s, host.as_mut_ptr(), buf, 64).unwrap() };
        g.record(f, s).unwrap();
        while !g.query(f).unwrap() {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
    }
}
