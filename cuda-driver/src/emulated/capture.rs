//! Stream capture (CUDA graphs) as the emulation models it: what a real
//! device refuses while a stream captures, so CPU-only tests see a path
//! that would break a capture, and replay, so they see what a captured op
//! does on every launch.
//!
//! - [`begin_capture`] starts capturing on a stream; [`end_capture`] ends
//!   it, with the graph, or an error if anything invalidated the capture
//!   meanwhile.
//! - Work queued on a capturing stream is recorded, not run; launching the
//!   graph queues the recorded work again on the launching stream, in the
//!   order it was recorded (an order every dependency inside the capture
//!   respects). Event records and waits inside the capture only join
//!   streams to it; a capturing stream's wait for an event recorded outside
//!   it is not replayed.
//! - A stream that waits for an event recorded during a capture joins that
//!   capture, as on a real device.
//! - A copy between a capturing stream and host memory, and a query of an
//!   event recorded during a capture, are errors ("operation not permitted
//!   when stream is capturing") that invalidate the capture.

use super::queue::Work;
use std::collections::HashMap;
use std::sync::Mutex;
use weft::{Error, Result, StreamHandle};

/// One capture: its origin stream, and why it was invalidated, if it was.
struct Capture {
    origin: u64,
    invalid: Option<String>,
    /// Work recorded into it (queued on one of its streams), in order.
    recorded: Vec<Work>,
}

#[derive(Default)]
struct State {
    next: u64,
    captures: HashMap<u64, Capture>,
    /// Stream -> the capture it takes part in.
    streams: HashMap<u64, u64>,
    /// Event -> the capture its latest record belongs to.
    events: HashMap<u64, u64>,
    /// Graphs that captures ended in, by id.
    graphs: HashMap<u64, Vec<Work>>,
}

/// One emulated GPU per process, so the capture state is the process's.
static STATE: Mutex<Option<State>> = Mutex::new(None);

fn with<T>(f: impl FnOnce(&mut State) -> T) -> T {
    let mut s = STATE.lock().unwrap_or_else(|p| p.into_inner());
    f(s.get_or_insert_with(State::default))
}

/// Start capturing the work queued on `stream` (`cudaStreamBeginCapture`).
pub(super) fn begin_capture(stream: StreamHandle) -> Result<()> {
    with(|s| {
        if stream.0 == 0 {
            return Err(Error::invalid("cuda emulation: the legacy default stream cannot capture"));
        }
        if s.streams.contains_key(&stream.0) {
            return Err(Error::invalid(format!("cuda emulation: stream {} is already capturing", stream.0)));
        }
        s.next += 1;
        let id = s.next;
        s.captures.insert(id, Capture { origin: stream.0, invalid: None, recorded: Vec::new() });
        s.streams.insert(stream.0, id);
        Ok(())
    })
}

/// End the capture that `stream` began (`cudaStreamEndCapture`): the
/// graph's id, or why the capture was invalidated.
pub(super) fn end_capture(stream: StreamHandle) -> Result<u64> {
    with(|s| {
        let id = s.streams.get(&stream.0).copied().filter(|id| s.captures.get(id).is_some_and(|c| c.origin == stream.0));
        let id = id.ok_or_else(|| Error::invalid(format!("cuda emulation: stream {} did not begin a capture", stream.0)))?;
        s.streams.retain(|_, c| *c != id);
        s.events.retain(|_, c| *c != id);
        let c = s.captures.remove(&id).expect("listed");
        match c.invalid {
            Some(why) => Err(Error::backend(format!("cuda emulation: the capture was invalidated: {why}"))),
            None => {
                s.graphs.insert(id, c.recorded);
                Ok(id)
            }
        }
    })
}

/// The work a graph recorded, to queue again.
pub(super) fn graph(id: u64) -> Result<Vec<Work>> {
    with(|s| s.graphs.get(&id).cloned()).ok_or_else(|| Error::invalid(format!("cuda emulation: graph {id} is not one end_capture made")))
}

/// Forget a graph.
pub(super) fn destroy_graph(id: u64) {
    with(|s| s.graphs.remove(&id));
}

/// How many tasks graph `id` recorded (copies, kernels, hand-offs), if it
/// exists: what a test reads to see that a refused op left nothing in a
/// capture.
pub fn graph_tasks(id: u64) -> Option<usize> {
    with(|s| s.graphs.get(&id).map(Vec::len))
}

/// Whether `stream` takes part in a capture.
pub(super) fn capturing(stream: StreamHandle) -> bool {
    with(|s| s.streams.contains_key(&stream.0))
}

/// Work queued on `stream`: recorded into its capture (true), or to run.
pub(super) fn records(stream: StreamHandle, work: &Work) -> bool {
    with(|s| match s.streams.get(&stream.0).copied() {
        Some(id) => {
            s.captures.get_mut(&id).expect("listed").recorded.push(work.clone());
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
        g.begin_capture(s).unwrap();
        assert!(g.is_capturing(s).unwrap() && !g.is_capturing(other).unwrap());
        assert!(g.begin_capture(s).is_err(), "twice");
        // Device work is recorded, not run.
        // SAFETY: `buf` holds 64 bytes.
        unsafe { g.premul(s, buf, 16, weft::DType::F32, 2.0).unwrap() };
        // An event recorded in the capture stands for a point in it: a
        // stream that waits for it joins the capture.
        let e = g.new_event(0, false).unwrap();
        g.record(e, s).unwrap();
        g.wait_event(other, e).unwrap();
        assert!(g.is_capturing(other).unwrap());
        let graph = g.end_capture(s).unwrap();
        assert_eq!(graph_tasks(graph.0), Some(1));
        assert!(!g.is_capturing(s).unwrap() && !g.is_capturing(other).unwrap());
        assert!(g.end_capture(s).is_err(), "not capturing any more");

        // A host copy, or a query of a captured event, is refused and
        // invalidates the capture.
        g.begin_capture(s).unwrap();
        // SAFETY: both ranges hold 64 bytes.
        let copy = unsafe { g.copy_dtoh(s, host.as_mut_ptr(), buf, 64) };
        assert!(copy.unwrap_err().to_string().contains("not permitted when stream is capturing"));
        assert!(g.end_capture(s).unwrap_err().to_string().contains("copy to host memory"));
        g.begin_capture(s).unwrap();
        g.record(e, s).unwrap();
        assert!(g.query(e).is_err());
        assert!(g.end_capture(s).unwrap_err().to_string().contains("query"));
        assert!(g.begin_capture(StreamHandle(0)).is_err(), "the legacy default stream");
        // Outside a capture the stream runs its work again.
        let f = g.new_event(0, false).unwrap();
        // SAFETY: as above.
        unsafe { g.copy_dtoh(s, host.as_mut_ptr(), buf, 64).unwrap() };
        g.record(f, s).unwrap();
        while !g.query(f).unwrap() {
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        g.destroy_graph(graph);
        assert_eq!(graph_tasks(graph.0), None);
    }

    #[test]
    fn each_launch_runs_what_the_capture_recorded_with_the_memory_as_it_is_then() {
        let g = EmulatedGpu::new(1);
        let s = g.new_stream(0).unwrap();
        let buf = g.alloc(0, 16).unwrap();
        let write = |v: f32| {
            // SAFETY: `buf` holds 4 f32 and no stream uses it now.
            unsafe { std::slice::from_raw_parts_mut(buf as *mut f32, 4) }.fill(v)
        };
        // SAFETY: as above.
        let read = || unsafe { std::slice::from_raw_parts(buf as *const f32, 4) }.to_vec();
        write(1.0);
        g.begin_capture(s).unwrap();
        // SAFETY: `buf` holds 4 f32 for as long as the graph is launched.
        unsafe { g.premul(s, buf, 4, weft::DType::F32, 3.0).unwrap() };
        let graph = g.end_capture(s).unwrap();
        assert_eq!(read(), vec![1.0; 4], "capturing ran nothing");
        let deadline = || std::time::Instant::now() + std::time::Duration::from_secs(10);
        for (input, want) in [(1.0, 3.0), (2.0, 6.0), (5.0, 15.0)] {
            write(input);
            g.launch_graph(graph, s).unwrap();
            crate::synchronize_stream(&g, 0, s, deadline(), "a launch").unwrap();
            assert_eq!(read(), vec![want; 4]);
        }
        g.destroy_graph(graph);
        assert!(g.launch_graph(graph, s).is_err(), "a destroyed graph");
    }

    #[test]
    fn a_flag_wait_holds_its_stream_until_the_signal_and_fails_it_past_its_limit() {
        let g = EmulatedGpu::new(1);
        let (a, b) = (g.new_stream(0).unwrap(), g.new_stream(0).unwrap());
        // Words: a's counter, a's flag, b's counter, b's flag, a payload.
        let words = g.alloc(0, 5 * 8).unwrap();
        let w = |i: u64| words + 8 * i;
        let deadline = || std::time::Instant::now() + std::time::Duration::from_secs(10);
        let limit = std::time::Duration::from_secs(10);
        // SAFETY: every word lies in `words`, alive until the end.
        unsafe {
            // b waits for a's flag, then copies the payload a wrote.
            g.signal(b, w(2), true, w(3)).unwrap();
            g.wait_flag(b, w(2), w(1), limit).unwrap();
            g.copy_dtod(b, w(3), w(4), 8).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
            assert_eq!(*(w(3) as *const u64), 1, "b waits");
            *(w(4) as *mut u64) = 77;
            g.signal(a, w(0), true, w(1)).unwrap();
            crate::synchronize_stream(&g, 0, b, deadline(), "b").unwrap();
            assert_eq!(*(w(3) as *const u64), 77);
            // A flag that never comes fails the stream instead of holding it.
            *(w(2) as *mut u64) = 1000;
            g.wait_flag(b, w(2), w(4), std::time::Duration::from_millis(1)).unwrap();
            let stuck = crate::synchronize_stream(&g, 0, b, deadline(), "b");
            assert!(stuck.is_err(), "{stuck:?}");
        }
    }
}
