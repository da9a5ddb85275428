//! Work handles: the result of an op that may still be running.

use crate::error::{Error, Result};
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
}

/// Completion state shared by a [`Work`] and whoever runs the op.
#[derive(Default)]
pub(crate) struct WorkState {
    inner: Mutex<Inner>,
    done: Condvar,
}

impl WorkState {
    pub(crate) fn complete(&self, result: Result<()>) {
        let wakers = {
            let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
            g.result = Some(result);
            std::mem::take(&mut g.wakers)
        };
        self.done.notify_all();
        wakers.into_iter().for_each(Waker::wake);
    }

    fn wait_until(&self, deadline: Option<Instant>) -> Option<Result<()>> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = &g.result {
                return Some(r.clone());
            }
            match deadline {
                None => g = self.done.wait(g).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    g = self.done.wait_timeout(g, d - now).unwrap_or_else(|p| p.into_inner()).0;
                }
            }
        }
    }

    pub(crate) fn wait(&self) -> Result<()> {
        self.wait_until(None).expect("no deadline")
    }
}

/// A handle to an op that was issued.
///
/// It borrows the op's tensors for `'t`, so safe code cannot touch them
/// until the handle is gone; dropping an unfinished handle waits for the op.
/// Ops issued directly on a [`crate::ProcessGroup`] have finished by the time
/// the handle is returned; ops issued in a [`crate::Scope`] run in the
/// background. A `Work` is also a `Future` of the op's result.
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
    pub fn wait(&self) -> Result<()> {
        self.state.wait()
    }

    /// Block at most `timeout`: `Ok(true)` if the op finished successfully,
    /// `Ok(false)` if it is still running (it keeps running), `Err` if it failed.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<bool> {
        match self.state.wait_until(Some(Instant::now() + timeout)) {
            None => Ok(false),
            Some(r) => r.map(|()| true),
        }
    }

    /// Whether the op has finished (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.state.inner.lock().unwrap_or_else(|p| p.into_inner()).result.is_some()
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
            Some(r) => Poll::Ready(r.clone()),
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
        let _ = self.state.wait();
    }
}

impl std::fmt::Debug for Work<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Work(completed={})", self.is_completed())
    }
}
