//! Scopes: ops that run in the background while the caller works.
//!
//! A [`Work`] borrows the op's tensors, but a handle can be leaked
//! (`mem::forget`), which would end the borrow while the op still writes.
//! So, as `std::thread::scope` does for threads, background ops live in a
//! scope that waits for all of them before it returns: leaking a handle
//! cannot let the op outlive the buffers. Bindings whose runtime keeps the
//! tensors alive issue the same background ops without a scope
//! ([`Unscoped`], an unsafe promise).

use super::job::Job;
use super::ops::Collectives;
use super::route::Issuer;
use super::work::{Work, WorkState};
use super::GroupCore;
use super::ProcessGroup;
use crate::error::Result;
use crate::options::OpOptions;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// A scope of background ops on one group; see [`ProcessGroup::scope`].
pub struct Scope<'scope, 'env: 'scope> {
    group: &'env ProcessGroup,
    pending: Mutex<Vec<Arc<WorkState>>>,
    // Invariant in both lifetimes, as std::thread::Scope.
    _scope: PhantomData<&'scope mut &'scope ()>,
    _env: PhantomData<&'env mut &'env ()>,
}

impl ProcessGroup {
    /// Run `f` with a scope in which ops run in the background; return once
    /// `f` has returned and every op issued in the scope has finished.
    ///
    /// Collectives run on the group's worker thread one at a time, in issue
    /// order (the same order on every rank). Sends and receives are posted
    /// to the transport when issued and complete in whatever order the
    /// peers allow: any set that MPI's nonblocking `Isend`/`Irecv` would
    /// complete does (a ring exchange of long messages, both ranks sending
    /// first, receives posted in any order). They never wait for an
    /// unrelated op, collective or not, nor does a collective wait for them;
    /// messages of one tag between two ranks match in issue order. (On a
    /// plugin that cannot post, they run in issue order with the
    /// collectives; use [`Collectives::batch_p2p`] there.)
    ///
    /// ```no_run
    /// # use weft::{ProcessGroup, ReduceOp, OpOptions, Collectives};
    /// # fn f(pg: &ProcessGroup, grads: &mut [f32], other: &mut [f32]) -> weft::Result<()> {
    /// pg.scope(|s| {
    ///     let w = s.all_reduce(&mut *grads, ReduceOp::Avg, &OpOptions::default())?;
    ///     other.iter_mut().for_each(|x| *x *= 2.0); // overlaps the all_reduce
    ///     w.wait()
    /// })
    /// # }
    /// ```
    pub fn scope<'env, F, T>(&'env self, f: F) -> T
    where
        F: for<'scope> FnOnce(&'scope Scope<'scope, 'env>) -> T,
    {
        let scope = Scope { group: self, pending: Mutex::new(Vec::new()), _scope: PhantomData, _env: PhantomData };
        let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&scope)));
        for st in scope.pending.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            st.settle();
        }
        match out {
            Ok(v) => v,
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
}

impl<'scope> Collectives<'scope> for Scope<'scope, '_> {}
impl Collectives<'static> for Unscoped<'_> {}

impl<'scope, 'env> Issuer<'scope> for Scope<'scope, 'env> {
    fn submit(&self, mut job: Job<'scope>, opts: &OpOptions) -> Result<Work<'scope>> {
        self.group.core.decide(&mut job, opts)?;
        // SAFETY: only the lifetime changes. The job borrows tensors for
        // 'scope; `ProcessGroup::scope` waits for the state (completed after
        // the job has run and been dropped) before 'scope can end, whatever
        // happens to the returned Work.
        let job: Job<'static> = unsafe { std::mem::transmute::<Job<'scope>, Job<'static>>(job) };
        // SAFETY: as above: the scope waits for the state.
        let state = unsafe {
            self.group.core.submit_background(job, opts, |st| self.pending.lock().unwrap_or_else(|p| p.into_inner()).push(st.clone()))
        };
        Ok(Work::new(state))
    }
    fn group(&self) -> &ProcessGroup {
        self.group
    }
}

/// Background ops without a scope, for callers whose tensors are kept
/// alive by other means; see [`ProcessGroup::unscoped`].
pub struct Unscoped<'g> {
    group: &'g ProcessGroup,
}

impl ProcessGroup {
    /// Issue ops in the background without a scope: each returns at once
    /// with a [`Work`] not tied to any borrow. What language bindings need,
    /// where the caller's runtime keeps the tensors alive (Python holds them
    /// until the op has finished) and a scope cannot span the program.
    ///
    /// Ops run as in a [`ProcessGroup::scope`]: collectives in issue order
    /// on the group's worker thread, sends and receives posted to the
    /// transport at once.
    ///
    /// # Safety
    /// Every tensor an op issued through the handle views must stay valid,
    /// and untouched except by the op, until that op has finished
    /// ([`Work::is_completed`], or `wait` returned); dropping the `Work`
    /// waits for it, but leaking it does not end the obligation.
    pub unsafe fn unscoped(&self) -> Unscoped<'_> {
        Unscoped { group: self }
    }
}

impl Issuer<'static> for Unscoped<'_> {
    fn submit(&self, mut job: Job<'static>, opts: &OpOptions) -> Result<Work<'static>> {
        self.group.core.decide(&mut job, opts)?;
        // SAFETY: the promise made to `ProcessGroup::unscoped`.
        Ok(Work::new(unsafe { self.group.core.submit_background(job, opts, |_| ()) }))
    }
    fn group(&self) -> &ProcessGroup {
        self.group
    }
}

impl GroupCore {
    /// Run `job` in the background: posted to its transport if it is a
    /// send or receive there, else queued for the group's worker in issue
    /// order. `track` sees the op's state before the op can start.
    ///
    /// # Safety
    /// The memory `job`'s tensors view stays valid until the returned state
    /// has completed.
    pub(crate) unsafe fn submit_background(
        self: &Arc<Self>,
        mut job: Job<'static>,
        opts: &OpOptions,
        track: impl FnOnce(&Arc<WorkState>),
    ) -> Arc<WorkState> {
        let opts = job.options(opts).into_owned();
        let state = Arc::<WorkState>::default();
        state.set_timeout(opts.timeout.unwrap_or(self.options.timeout));
        track(&state);
        if let Some(backend) = self.posting_backend(&job) {
            // SAFETY: the caller's promise.
            unsafe { self.post_p2p(backend, &mut job, &opts, state.clone(), true) };
            return state;
        }
        // Everything else takes its turn in the group's order.
        let ticket = self.exec.issue();
        let collective = job.is_collective();
        let st = state.clone();
        let core = self.clone();
        self.exec.enqueue(
            ticket,
            collective,
            Box::new(move |seq| {
                let mut job = job;
                let (result, device) = core.run_job(&mut job, &opts, seq);
                // The job (and its view of the tensors) ends before the
                // Work completes.
                drop(job);
                st.complete(result, device);
            }),
        );
        state
    }
}
