//! A group's progress thread for one posting transport: it drives the
//! transport while background ops posted there are unfinished and no
//! thread waiting for one drives it (see `p2p.rs`).

use crate::backend::progress::Post;
use crate::backend::Backend;
use crate::error::Error;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// A group's progress thread for one posting transport: it drives the
/// transport while background ops posted to it are unfinished.
pub(crate) struct ProgressThread {
    backend: Arc<dyn Backend>,
    /// Background ops posted and not yet finished.
    pending: AtomicUsize,
    /// Open windows whose targets keep receives posted (`crate::window`):
    /// the thread drives while any is open, but does not wait for them
    /// to stop.
    listeners: AtomicUsize,
    /// Threads waiting for one of them, which drive the transport
    /// themselves meanwhile (`drive_for`); the progress thread steps aside.
    waiting: AtomicUsize,
    shutdown: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
    idle: Mutex<()>,
    wake: Condvar,
}

impl ProgressThread {
    pub(super) fn start(backend: Arc<dyn Backend>) -> Arc<ProgressThread> {
        let progress = Arc::new(ProgressThread {
            backend,
            pending: AtomicUsize::new(0),
            listeners: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            thread: Mutex::new(None),
            idle: Mutex::new(()),
            wake: Condvar::new(),
        });
        let me = progress.clone();
        let t = std::thread::Builder::new()
            .name("weft-p2p-progress".into())
            .spawn(move || me.run())
            .expect("spawn the point-to-point progress thread");
        *progress.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(t);
        progress
    }

    /// Whether it drives `backend`.
    pub(super) fn drives(&self, backend: &Arc<dyn Backend>) -> bool {
        Arc::ptr_eq(&self.backend, backend)
    }

    /// Whether the progress thread has nothing to do: no background op
    /// pending and no window listening, or a waiting thread drives the
    /// transport.
    fn idle(&self) -> bool {
        (self.pending.load(Ordering::SeqCst) == 0 && self.listeners.load(Ordering::SeqCst) == 0) || self.waiting.load(Ordering::SeqCst) > 0
    }

    /// Whether the thread should end: stopped, and no background op left
    /// (windows still listening are not waited for).
    fn finished(&self) -> bool {
        self.shutdown.load(Ordering::SeqCst) && self.pending.load(Ordering::SeqCst) == 0
    }

    fn run(&self) {
        let mut policy = Policy::of_this_thread();
        loop {
            {
                let g = self.idle.lock().unwrap_or_else(|p| p.into_inner());
                let _g =
                    self.wake.wait_while(g, |_| self.idle() && !self.shutdown.load(Ordering::SeqCst)).unwrap_or_else(|p| p.into_inner());
            }
            if self.finished() {
                return;
            }
            // A window's target answers its peers from this thread: while
            // one listens, waking it takes the core as before (a window
            // opened or closed meanwhile ends the turn, to switch).
            let quiet = || self.listeners.load(Ordering::SeqCst) == 0;
            let batch = policy.as_mut().and_then(|p| p.yield_on_wake_up(quiet()));
            if batch.is_none() {
                // Not ours to change, or refused: left as it is from now on.
                policy = None;
            }
            self.backend.progress(&|| self.idle() || self.finished() || batch.is_some_and(|b| b != quiet()));
        }
    }

    /// Drive the transport on this thread until `until()` holds: what a
    /// thread waiting for a posted op does. The progress thread leaves the
    /// transport to it (within a turn of its loop; while it sleeps in the
    /// kernel, the transport's events wake it) and takes over again after.
    pub(crate) fn drive_for(&self, until: &dyn Fn() -> bool) {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        self.backend.progress(until);
        // Woken only if something is left for it (a post from now on
        // wakes it itself: `kick` sees no waiter).
        if self.waiting.fetch_sub(1, Ordering::SeqCst) == 1 && !self.idle() {
            drop(self.idle.lock().unwrap_or_else(|p| p.into_inner()));
            self.wake.notify_one();
        }
    }

    /// A window starts listening on this transport: drive it from now on.
    pub(crate) fn listen(&self) {
        self.listeners.fetch_add(1, Ordering::SeqCst);
        self.kick();
    }

    /// A window stopped listening.
    pub(crate) fn unlisten(&self) {
        self.listeners.fetch_sub(1, Ordering::SeqCst);
    }

    /// Post a background batch and leave it to whoever drives the
    /// transport (this thread does not take a turn: with a window open the
    /// progress thread is always in the transport, and a turn would wait
    /// for it).
    pub(crate) fn post(self: &Arc<Self>, post: Post) {
        if self.shutdown.load(Ordering::SeqCst) {
            // The group was closed: nothing drives this transport any more.
            return post.fail(Error::aborted("the process group was closed"));
        }
        self.begin();
        let me = self.clone();
        self.backend.post(post.finally(move || me.end()));
        self.kick();
    }

    /// One more background op is posted (see `kick`).
    pub(super) fn begin(&self) {
        self.pending.fetch_add(1, Ordering::SeqCst);
    }

    /// A background op is left for the progress thread: wake it (unless a
    /// waiting thread drives the transport, or nothing is pending).
    pub(super) fn kick(&self) {
        if !self.idle() {
            drop(self.idle.lock().unwrap_or_else(|p| p.into_inner()));
            self.wake.notify_one();
        }
    }

    /// A background op finished.
    pub(super) fn end(&self) {
        self.pending.fetch_sub(1, Ordering::SeqCst);
    }

    /// Stop the thread (after every background op has finished).
    pub(crate) fn stop(&self) {
        self.shutdown.store(true, Ordering::SeqCst);
        drop(self.idle.lock().unwrap_or_else(|p| p.into_inner()));
        self.wake.notify_one();
        if let Some(t) = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// The progress thread's scheduling policy: `SCHED_BATCH` while no window
/// listens, so that waking it no longer preempts the thread that woke it
/// (it still gets its fair share of a core), `SCHED_OTHER` while one does.
/// A posted op wakes it at once; under `SCHED_OTHER` it took the core from
/// the posting thread, which came back to wait for the op, found the
/// transport in the progress thread's hands and slept until it stepped
/// aside: about 4.7 context switches per message of 1 MiB on a core each
/// rank. A window's target, whose puts this thread writes into place, kept
/// `SCHED_OTHER`: as `SCHED_BATCH`, puts of 1 MiB into a target whose core
/// computed waited 2-4 ms now and then (figures: bench/RESULTS.md, "ninth
/// session").
struct Policy {
    batch: bool,
}

impl Policy {
    /// The calling thread's, if weft may change it: a thread the program
    /// made real-time (`chrt`) or idle keeps what it inherited.
    fn of_this_thread() -> Option<Policy> {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: no arguments but pid 0, this thread.
            let now = unsafe { libc::sched_getscheduler(0) } & !libc::SCHED_RESET_ON_FORK;
            (now == libc::SCHED_OTHER).then_some(Policy { batch: false })
        }
        #[cfg(not(target_os = "linux"))]
        None
    }

    /// `SCHED_BATCH` (`batch`) or `SCHED_OTHER` for the calling thread:
    /// whether it is `SCHED_BATCH` now, or `None` if the change was refused.
    fn yield_on_wake_up(&mut self, batch: bool) -> Option<bool> {
        if batch == self.batch {
            return Some(batch);
        }
        #[cfg(target_os = "linux")]
        {
            let param = libc::sched_param { sched_priority: 0 };
            let policy = if batch { libc::SCHED_BATCH } else { libc::SCHED_OTHER };
            // SAFETY: `param` is a valid `sched_param` for the call; pid 0
            // is this thread, and a failure (refused by a security policy)
            // leaves its policy as it was.
            if unsafe { libc::sched_setscheduler(0, policy, &param) } != 0 {
                crate::log::debug(format_args!("the progress thread's policy stays: {}", std::io::Error::last_os_error()));
                return None;
            }
        }
        self.batch = batch;
        Some(batch)
    }
}
