//! Work handles: the result of an op that may still be running.

use crate::error::{Error, Result};
use crate::stream::DeviceCompletion;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Inner {
    result: Option<Result<()>>,
    wakers: Vec<Waker>,
    /// Device ops: the device side, which may still run after the host side.
    device: Option<Arc<dyn DeviceCompletion>>,
    /// The caller's stream was made to wait for the device side.
    ordered: bool,
    /// Threads blocked on `done`: without any, completing skips the
    /// wake-up (a system call on every op otherwise).
    waiters: usize,
}

/// Completion state shared by a [`Work`] and whoever runs the op.
#[derive(Default)]
pub(crate) struct WorkState {
    inner: Mutex<Inner>,
    done: Condvar,
}

impl WorkState {
    pub(crate) fn complete(&self, result: Result<()>, device: Option<Arc<dyn DeviceCompletion>>) {
        let (wakers, blocked) = {
            let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            g.result = Some(result);
            g.device = device;
            (std::mem::take(&mut g.wakers), g.waiters > 0)
        };
        if blocked {
            self.done.notify_all();
        }
        wakers.into_iter().for_each(Waker::wake);
    }

    fn wait_until(&self, deadline: Option<Instant>) -> Option<Result<()>> {
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

    pub(crate) fn wait(&self) -> Result<()> {
        self.wait_until(None).expect("no deadline")
    }

    fn device(&self) -> Option<Arc<dyn DeviceCompletion>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).device.clone()
    }

    /// After a successful host side: make the caller's stream wait for the
    /// device side (once is enough; again is harmless).
    fn order(&self, r: Result<()>) -> Result<()> {
        r?;
        if let Some(d) = self.device() {
            d.order_caller_stream()?;
            self.inner.lock().unwrap_or_else(|p| p.into_inner()).ordered = true;
        }
        Ok(())
    }

    /// What ending the borrow of the op's tensors needs: the host side done,
    /// and the device side either ordered before the caller's later stream
    /// work (the caller waited) or finished (the host blocks for it).
    pub(crate) fn settle(&self) {
        let _ = self.wait();
        let (device, ordered) = {
            let g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            (g.device.clone(), g.ordered)
        };
        if let (Some(d), false) = (device, ordered) {
            let deadline = Instant::now() + crate::options::timeout_from_env().unwrap_or(crate::options::DEFAULT_TIMEOUT);
            if let Err(e) = d.synchronize(deadline) {
                crate::log::info(format_args!("a dropped device op did not finish: {e}"));
            }
        }
    }
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
    state: Arc<WorkState>,
    _borrow: PhantomData<&'t mut ()>,
}

impl<'t> Work<'t> {
    pub(crate) fn new(state: Arc<WorkState>) -> Self {
        Work { state, _borrow: PhantomData }
    }

    /// Block until the op finishes; its result. May be called repeatedly.
    /// For device tensors, the host side finishes and the caller's stream
    /// is made to wait for the device side.
    pub fn wait(&self) -> Result<()> {
        self.state.order(self.state.wait())
    }

    /// As [`Work::wait`], then block the host until the device side has
    /// finished too (at most `WEFT_TIMEOUT_SECONDS`). Same as `wait` for
    /// host tensors.
    pub fn synchronize(&self) -> Result<()> {
        self.wait()?;
        match self.state.device() {
            Some(d) => d.synchronize(Instant::now() + crate::options::timeout_from_env()?),
            None => Ok(()),
        }
    }

    /// Block at most `timeout`: `Ok(true)` if the op finished successfully,
    /// `Ok(false)` if it is still running (it keeps running), `Err` if it failed.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        match self.state.wait_until(Some(Instant::now() + timeout)) {
            None => Ok(false),
            Some(r) => self.state.order(r).map(|()| true),
        }
    }

    /// Whether the op has finished (successfully or not), device side
    /// included.
    pub fn is_completed(&self) -> bool {
        if self.state.inner.lock().unwrap_or_else(|p| p.into_inner()).result.is_none() {
            return false;
        }
        self.state.device().is_none_or(|d| d.is_complete().unwrap_or(true))
    }

    /// The error, if the op finished with one.
    pub fn error(&self) -> Option<Error> {
        match &self.state.inner.lock().unwrap_or_else(|p| p.into_inner()).result {
            Some(Err(e)) => Some(e.clone()),
            _ => None,
        }
    }
}

impl Future for Work<'_> {
    type Output = Result<()>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let mut g = self.state.inner.lock().unwrap_or_else(|p| p.into_inner());
        match &g.result {
            Some(r) => {
                let r = r.clone();
                drop(g);
                Poll::Ready(self.state.order(r))
            }
            None => {
                if !g.wakers.iter().any(|w| w.will_wake(cx.waker())) {
                    g.wakers.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}

impl Drop for Work<'_> {
    fn drop(&mut self) {
        // The borrow of the tensors ends here: the op must not outlive it.
        self.state.settle();
    }
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Work(completed={})", self.is_completed())
    }
}
