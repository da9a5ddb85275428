//! An emulated stream: tasks run in order on a worker thread, asynchronously
//! to the host; and an emulated event: two counters in a shared mapping.

use super::shared::Mapping;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft::{Error, Result};

/// A unit of device work.
pub type Task = Box<dyn FnOnce() -> std::result::Result<(), String> + Send>;

/// Device work that can run again: a copy or a kernel, as a capture
/// records it and each launch of its graph runs it.
pub type Work = Arc<dyn Fn() -> std::result::Result<(), String> + Send + Sync>;

/// An ordered queue of device work run by its own thread.
pub struct Queue {
    /// Tasks, each with whether it runs even after a failure (records do).
    tx: Mutex<Sender<(bool, Task)>>,
    /// Set when a task failed: later tasks are skipped and events recorded
    /// after it report the failure, as a sticky CUDA error would.
    failed: Arc<Mutex<Option<String>>>,
}

impl Queue {
    /// Start a stream.
    pub fn start(name: String) -> Queue {
        let (tx, rx) = channel::<(bool, Task)>();
        let failed: Arc<Mutex<Option<String>>> = Arc::default();
        let f = failed.clone();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for (always, task) in rx {
                    if !always && f.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
                        continue;
                    }
                    if let Err(why) = task() {
                        *f.lock().unwrap_or_else(|p| p.into_inner()) = Some(why);
                    }
                }
            })
            .expect("spawn an emulated stream thread");
        Queue { tx: Mutex::new(tx), failed }
    }

    /// Append work.
    pub fn push(&self, task: Task) {
        self.send(false, task);
    }

    fn send(&self, always: bool, task: Task) {
        // The worker only ends when the queue is dropped.
        let _ = self.tx.lock().unwrap_or_else(|p| p.into_inner()).send((always, task));
    }

    /// Record `event` here: it completes when the stream reaches this point.
    pub fn record(&self, event: &Arc<EventCell>) {
        let target = event.recorded().fetch_add(1, Ordering::AcqRel) + 1;
        let (e, failed) = (event.clone(), self.failed.clone());
        // A record is never skipped: it reports the failure instead.
        self.send(
            true,
            Box::new(move || {
                if failed.lock().unwrap_or_else(|p| p.into_inner()).is_some() {
                    e.failed().store(1, Ordering::Release);
                }
                e.completed().fetch_max(target, Ordering::AcqRel);
                Ok(())
            }),
        );
    }
}

/// How long a stream waits for another process's event before it gives up
/// (the host side has its own, shorter, op deadline).
const WAIT_LIMIT: Duration = Duration::from_secs(600);

/// An event: `recorded` counts records issued, `completed` the highest one
/// reached; both live in a mapping so other processes can wait on it.
pub struct EventCell {
    map: Mapping,
    owner_alive: Box<dyn Fn() -> bool + Send + Sync>,
}

impl EventCell {
    /// A new event owned by this process.
    pub fn create() -> Result<EventCell> {
        Ok(EventCell { map: Mapping::create(64)?, owner_alive: Box::new(|| true) })
    }

    /// Another process's event.
    pub fn open(handle: &[u8]) -> Result<EventCell> {
        let pid = handle.get(4..8).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes"))).unwrap_or(0);
        let map = Mapping::open(handle)?;
        let alive = move || std::path::Path::new(&format!("/proc/{pid}")).exists();
        Ok(EventCell { map, owner_alive: Box::new(alive) })
    }

    /// The IPC handle.
    pub fn handle(&self) -> Vec<u8> {
        self.map.handle()
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        // SAFETY: the mapping is at least 64 bytes, page-aligned, and lives
        // as long as self; these words are only accessed atomically.
        unsafe { &*(self.map.base() as *const AtomicU64).add(i) }
    }
    fn recorded(&self) -> &AtomicU64 {
        self.word(0)
    }
    fn completed(&self) -> &AtomicU64 {
        self.word(1)
    }
    fn failed(&self) -> &AtomicU64 {
        self.word(2)
    }

    /// Whether the latest record has completed.
    pub fn query(&self) -> Result<bool> {
        let target = self.recorded().load(Ordering::Acquire);
        let done = self.completed().load(Ordering::Acquire) >= target;
        if done && self.failed().load(Ordering::Acquire) != 0 {
            return Err(Error::backend("cuda emulation: device work before this event failed"));
        }
        Ok(done)
    }

    /// A task that waits (on the stream that runs it) for the record that
    /// is latest now.
    pub fn wait_task(self: &Arc<Self>) -> Task {
        let target = self.recorded().load(Ordering::Acquire);
        let me = self.clone();
        Box::new(move || {
            let start = Instant::now();
            let mut pause = Duration::from_micros(1);
            while me.completed().load(Ordering::Acquire) < target {
                if !(me.owner_alive)() {
                    return Err("the process that owns an awaited event is gone".into());
                }
                if start.elapsed() > WAIT_LIMIT {
                    return Err("an awaited event never completed".into());
                }
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_micros(200));
            }
            if me.failed().load(Ordering::Acquire) != 0 {
                return Err("device work before an awaited event failed".into());
            }
            Ok(())
        })
    }
}
