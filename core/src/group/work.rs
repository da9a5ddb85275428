//! Work handles: the result of an op that may still be running.

use crate::error::{Error, Result};
use crate::stream::DeviceCompletion;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Inner {
    result: Option<Result<()>>,
    wakers: Vec<Waker>,
    /// Device ops: the device side, which may still run after the host side.
    device: Option<Arc<dyn DeviceCompletion>>,
    /// Threads blocked on `done`: without any, completing skips the
    /// wake-up (a system call on every op otherwise).
    waiters: usize,
    /// The rank an any-source receive took its message from.
    source: Option<usize>,
    /// When the host side finished (bindings report an op's duration).
    finished: Option<Instant>,
}

/// Completion state shared by a [`Work`] and the thread that runs its op
/// in the background (ops in a [`crate::Scope`]).
#[derive(Default)]
pub(crate) struct WorkState {
    inner: Mutex<Inner>,
    done: Condvar,
    /// The caller's stream was made to wait for the device side.
    ordered: AtomicBool,
    /// For an op posted to a transport that progresses its ops together:
    /// how a thread waiting for it drives that transport itself (as
    /// `MPI_Wait` makes progress) instead of sleeping until the group's
    /// progress thread has finished it and woken the waiter.
    driver: std::sync::OnceLock<Arc<super::progress_thread::ProgressThread>>,
    /// The op's timeout: how long settling waits for its device side.
    timeout: std::sync::OnceLock<Duration>,
}

impl WorkState {
    /// Whether the host side has finished.
    pub(crate) fn is_done(&self) -> bool {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).result.is_some()
    }

    /// The sender of an any-source receive (before `complete`).
    pub(crate) fn set_source(&self, rank: usize) {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).source = Some(rank);
    }

    pub(crate) fn complete(&self, result: Result<()>, device: Option<Arc<dyn DeviceCompletion>>) {
        let (wakers, blocked) = {
            let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            g.result = Some(result);
            g.finished = Some(Instant::now());
            g.device = device;
            (std::mem::take(&mut g.wakers), g.waiters > 0)
        };
        if blocked {
            self.done.notify_all();
        }
        wakers.into_iter().for_each(Waker::wake);
    }

    /// The op's timeout (see `timeout`).
    pub(crate) fn set_timeout(&self, timeout: Duration) {
        let _ = self.timeout.set(timeout);
    }

    /// Have waiters drive `progress`'s transport (see `driver`).
    pub(crate) fn set_driver(&self, progress: Arc<super::progress_thread::ProgressThread>) {
        let _ = self.driver.set(progress);
    }

    /// The result, waiting for it until `deadline` (`None`: for ever);
    /// `None` if the op is still running then.
    fn wait_until(&self, deadline: Option<Instant>) -> Option<Result<()>> {
        if let Some(progress) = self.driver.get() {
            if !self.is_done() {
                progress.drive_for(&|| self.is_done() || deadline.is_some_and(|d| Instant::now() >= d));
            }
        }
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = &g.result {
                return Some(r.clone());
            }
            let now = Instant::now();
            if deadline.is_some_and(|d| now >= d) {
                return None;
            }
            g.waiters += 1;
            g = match deadline {
                None => self.done.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(d) => self.done.wait_timeout(g, d - now).unwrap_or_else(|p| p.into_inner()).0,
            };
            g.waiters -= 1;
        }
    }

    fn device(&self) -> Option<Arc<dyn DeviceCompletion>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).device.clone()
    }

    /// What ending the borrow of the op's tensors needs (see [`settle`]).
    pub(crate) fn settle(&self) {
        let _ = self.wait_until(None);
        settle(self.device().as_deref(), &self.ordered, self.timeout.get().copied());
    }
}

/// How long to wait for an op's device side: its `timeout`, else
/// `WEFT_TIMEOUT_SECONDS` (an op made before its group knew one).
fn device_deadline(timeout: Option<Duration>) -> Instant {
    let t = timeout.or_else(|| crate::options::timeout_from_env().ok()).unwrap_or(crate::options::DEFAULT_TIMEOUT);
    crate::deadline::instant_after(t)
}

/// After the host side of an op: unless the caller's stream was ordered
/// after the device side (the caller waited), block until the device side
/// has finished (at most the op's `timeout`), so the tensors' memory is
/// free to reuse.
fn settle(device: Option<&dyn DeviceCompletion>, ordered: &AtomicBool, timeout: Option<Duration>) {
    if let (Some(d), false) = (device, ordered.load(Ordering::Acquire)) {
        if let Err(e) = d.synchronize(device_deadline(timeout)) {
            crate::log::info(format_args!("a dropped device op did not finish: {e}"));
        }
    }
}

/// What a [`Work`] refers to.
enum Handle {
    /// An op that ran on the caller's thread: finished when the handle was
    /// made, so no shared state (and no lock) is needed.
    Done { result: Result<()>, device: Option<Arc<dyn DeviceCompletion>>, ordered: AtomicBool, timeout: Option<Duration> },
    /// An op running in the background.
    Pending(Arc<WorkState>),
}

/// A handle to an op that was issued.
///
/// It borrows the op's tensors for `'t`, so safe code cannot touch them
/// until the handle is gone; dropping an unfinished handle waits for the op.
/// Ops issued directly on a [`crate::ProcessGroup`] have finished by the time
/// the handle is returned; ops issued in a [`crate::Scope`] run in the
/// background. A `Work` is also a `Future` of the op's result.
///
/// For device (CUDA) tensors, `wait` and the `Future` make the caller's
/// stream wait for the op without blocking the host (as in c10d);
/// [`Work::synchronize`] blocks the host until the device side is done.
/// Dropping a handle that was never waited on blocks until the device side
/// is done, so the tensors' memory is free to reuse afterwards.
#[must_use = "an op's error is only reported through its Work"]
pub struct Work<'t> {
    handle: Handle,
    _borrow: PhantomData<&'t mut ()>,
}

impl<'t> Work<'t> {
    /// The handle of a background op.
    pub(crate) fn new(state: Arc<WorkState>) -> Self {
        Work { handle: Handle::Pending(state), _borrow: PhantomData }
    }

    /// The handle of an op that finishes later, and the completion that
    /// finishes it (errors passed through `name`).
    pub(crate) fn later(name: impl FnOnce(Error) -> Error + Send + 'static) -> (Self, crate::backend::progress::Done) {
        let state = Arc::<WorkState>::default();
        let mine = state.clone();
        (Work::new(state), Box::new(move |r: Result<()>| mine.complete(r.map_err(name), None)))
    }

    /// The handle of an op that has already run.
    pub(crate) fn done(result: Result<()>, device: Option<Arc<dyn DeviceCompletion>>) -> Self {
        Work { handle: Handle::Done { result, device, ordered: AtomicBool::new(false), timeout: None }, _borrow: PhantomData }
    }

    /// The same handle, whose device side `synchronize` and dropping wait
    /// for at most `timeout` (the op's).
    pub(crate) fn within(mut self, timeout: Duration) -> Self {
        match &mut self.handle {
            Handle::Done { timeout: t, .. } => *t = Some(timeout),
            Handle::Pending(s) => s.set_timeout(timeout),
        }
        self
    }

    fn timeout(&self) -> Option<Duration> {
        match &self.handle {
            Handle::Done { timeout, .. } => *timeout,
            Handle::Pending(s) => s.timeout.get().copied(),
        }
    }

    /// The result of an op that ran on the caller's thread with no device
    /// side (every direct op on host tensors): nothing is left to wait for
    /// or to order (the common case, kept to a few instructions).
    #[inline]
    fn host_done(&self) -> Option<&Result<()>> {
        match &self.handle {
            Handle::Done { result, device: None, .. } => Some(result),
            _ => None,
        }
    }

    /// The host side's result, waiting for it until `deadline` (`None`:
    /// for ever); `None` if the op is still running then.
    fn host_result(&self, deadline: Option<Instant>) -> Option<Result<()>> {
        match &self.handle {
            Handle::Done { result, .. } => Some(result.clone()),
            Handle::Pending(s) => s.wait_until(deadline),
        }
    }

    fn device(&self) -> Option<Arc<dyn DeviceCompletion>> {
        match &self.handle {
            Handle::Done { device, .. } => device.clone(),
            Handle::Pending(s) => s.device(),
        }
    }

    /// After a successful host side: make the caller's stream wait for the
    /// device side (once is enough; again is harmless).
    fn order(&self, r: Result<()>) -> Result<()> {
        r?;
        if let Some(d) = self.device() {
            d.order_caller_stream()?;
            let ordered = match &self.handle {
                Handle::Done { ordered, .. } => ordered,
                Handle::Pending(s) => &s.ordered,
            };
            ordered.store(true, Ordering::Release);
        }
        Ok(())
    }

    /// Block until the op finishes; its result. May be called repeatedly.
    /// For device tensors, the host side finishes and the caller's stream
    /// is made to wait for the device side.
    #[inline]
    pub fn wait(&self) -> Result<()> {
        if let Some(r) = self.host_done() {
            return r.clone();
        }
        self.order(self.host_result(None).expect("no deadline"))
    }

    /// As [`Work::wait`], then block the host until the device side has
    /// finished too (at most the op's timeout, else the group's). Same as
    /// `wait` for host tensors.
    #[inline]
    pub fn synchronize(&self) -> Result<()> {
        if let Some(r) = self.host_done() {
            return r.clone();
        }
        self.wait()?;
        match self.device() {
            Some(d) => d.synchronize(device_deadline(self.timeout())),
            None => Ok(()),
        }
    }

    /// Block at most `timeout`: `Ok(true)` if the op finished successfully,
    /// `Ok(false)` if it is still running (it keeps running), `Err` if it failed.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        match self.host_result(Some(crate::deadline::instant_after(timeout))) {
            None => Ok(false),
            Some(r) => self.order(r).map(|()| true),
        }
    }

    /// Whether the op has finished (successfully or not), device side
    /// included.
    pub fn is_completed(&self) -> bool {
        if let Handle::Pending(s) = &self.handle {
            if s.inner.lock().unwrap_or_else(|p| p.into_inner()).result.is_none() {
                return false;
            }
        }
        self.device().is_none_or(|d| d.is_complete().unwrap_or(true))
    }

    /// For a receive from any rank ([`crate::Collectives::recv_any`]): the
    /// rank its message came from, once it has finished successfully.
    pub fn source(&self) -> Option<usize> {
        match &self.handle {
            Handle::Done { .. } => None,
            Handle::Pending(s) => s.inner.lock().unwrap_or_else(|p| p.into_inner()).source,
        }
    }

    /// Whether the op ran on the caller's thread: its host side had
    /// finished when this handle was made (no lock, no device query).
    pub fn ran_on_caller(&self) -> bool {
        matches!(self.handle, Handle::Done { .. })
    }

    /// When the host side of an op that ran in the background finished;
    /// `None` while it runs, and for an op that [ran on the
    /// caller's](Work::ran_on_caller) thread.
    pub fn finished_at(&self) -> Option<Instant> {
        match &self.handle {
            Handle::Done { .. } => None,
            Handle::Pending(s) => s.inner.lock().unwrap_or_else(|p| p.into_inner()).finished,
        }
    }

    /// Have `waker` woken, on the thread that finishes the op, once its
    /// host side has finished: for bindings that learn of completion
    /// without blocking a thread. `false` if it already has (then nothing
    /// is registered and the waker is not woken).
    pub fn wake_when_done(&self, waker: &Waker) -> bool {
        match &self.handle {
            Handle::Done { .. } => false,
            Handle::Pending(s) => {
                let mut g = s.inner.lock().unwrap_or_else(|p| p.into_inner());
                if g.result.is_some() {
                    return false;
                }
                g.wakers.push(waker.clone());
                true
            }
        }
    }

    /// The error, if the op finished with one.
    pub fn error(&self) -> Option<Error> {
        match &self.handle {
            Handle::Done { result, .. } => result.clone().err(),
            Handle::Pending(s) => s.inner.lock().unwrap_or_else(|p| p.into_inner()).result.clone()?.err(),
        }
    }
}

impl Future for Work<'_> {
    type Output = Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let r = match &self.handle {
            Handle::Done { result, .. } => result.clone(),
            Handle::Pending(s) => {
                let mut g = s.inner.lock().unwrap_or_else(|p| p.into_inner());
                match &g.result {
                    Some(r) => r.clone(),
                    None => {
                        if !g.wakers.iter().any(|w| w.will_wake(cx.waker())) {
                            g.wakers.push(cx.waker().clone());
                        }
                        return Poll::Pending;
                    }
                }
            }
        };
        Poll::Ready(self.order(r))
    }
}

impl Drop for Work<'_> {
    #[inline]
    fn drop(&mut self) {
        // The borrow of the tensors ends here: the op must not outlive it.
        match &self.handle {
            Handle::Done { device: None, .. } => {}
            Handle::Done { device, ordered, timeout, .. } => settle(device.as_deref(), ordered, *timeout),
            Handle::Pending(s) => s.settle(),
        }
    }
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Work(completed={})", self.is_completed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device side that records the deadline it was waited with.
    #[derive(Default)]
    struct Recorded(Mutex<Option<Instant>>);

    impl DeviceCompletion for Recorded {
        fn order_caller_stream(&self) -> Result<()> {
            Ok(())
        }
        fn is_complete(&self) -> Result<bool> {
            Ok(true)
        }
        fn synchronize(&self, deadline: Instant) -> Result<()> {
            *self.0.lock().unwrap() = Some(deadline);
            Ok(())
        }
    }

    #[test]
    fn synchronize_and_drop_wait_for_the_device_side_by_the_ops_timeout() {
        let device = Arc::new(Recorded::default());
        let start = Instant::now();
        let work = Work::done(Ok(()), Some(device.clone())).within(Duration::from_secs(7));
        work.synchronize().unwrap();
        let waited = device.0.lock().unwrap().take().expect("waited for") - start;
        assert!(waited >= Duration::from_secs(7) && waited < Duration::from_secs(8), "{waited:?}");
        // Dropped without waiting (the caller's stream never ordered after
        // it): settling waits by the same timeout.
        let work = Work::done(Ok(()), Some(device.clone())).within(Duration::from_secs(3));
        drop(work);
        let waited = device.0.lock().unwrap().take().expect("settled") - start;
        assert!(waited >= Duration::from_secs(3) && waited < Duration::from_secs(4), "{waited:?}");
    }

    #[test]
    fn a_background_op_knows_when_it_finished() {
        let direct = Work::done(Ok(()), None);
        assert!(direct.ran_on_caller());
        assert_eq!(direct.finished_at(), None, "a direct op finished before its handle");
        let (work, done) = Work::later(|e| e);
        assert!(!work.ran_on_caller());
        assert_eq!(work.finished_at(), None, "still running");
        let before = Instant::now();
        done(Ok(()));
        let at = work.finished_at().expect("finished");
        assert!(at >= before && at <= Instant::now());
    }
}
