//! Point-to-point ops that complete on their own.
//!
//! On a transport that posts
//! ([`Capabilities::posts`](crate::backend::Capabilities::posts): cpu-tcp, shm
//! and what wraps them), a send, a receive or a batch of them takes no turn in
//! the group's order, so it never waits for an unrelated op, and no op waits
//! for it. A direct op runs at once as an exchange, which drives the transport
//! (everything posted there too) until the op is done; a direct send, receive
//! or sendrecv of host tensors (but bools, cleaned after a job) takes a
//! [`DirectP2p`] there, without building an op and a job. A background op (in a
//! scope, or unscoped) is posted to the transport when it is issued, on the
//! issuing thread, which then takes one non-blocking turn of the transport
//! (what fits its buffers goes at once). It completes whenever its peers allow,
//! driven by whoever is in the transport: a thread waiting for it (as
//! `MPI_Wait` makes progress), or else the group's progress thread for that
//! transport (a [`ProgressThread`]), which steps aside while a thread waits.
//!
//! Device tensors go the same way where the backend posts them
//! ([`Capabilities::posts_device`](crate::backend::Capabilities::posts_device):
//! the CUDA backends), as do a plugin's that declares it progresses
//! concurrently. Elsewhere point-to-point ops run as collectives do: one at a
//! time, in issue order (a batch as one exchange).

use super::job::Job;
use super::progress_thread::ProgressThread;
use super::work::{Work, WorkState};
use super::GroupCore;
use crate::backend::progress::Post;
use crate::backend::{Backend, Deadline, Op, P2p, ANY_SOURCE};
use crate::dtype::DType;
use crate::error::{Error, ErrorKind, Result};
use crate::options::OpOptions;
use crate::registry::Route;
use crate::tensor::DeviceKind;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Received bool buffers, to clean once their bytes are in.
fn bool_outputs(op: &mut Op<'_>) -> Vec<(usize, usize)> {
    op.outputs_mut()
        .filter(|o| o.dtype() == DType::Bool)
        .filter_map(|o| o.host_bytes_mut().ok())
        .map(|b| (b.as_mut_ptr() as usize, b.len()))
        .collect()
}

/// Where a direct send or receive of host tensors runs at once, without a
/// job: the group's transport for them, which posts (see the module doc).
/// What [`GroupCore::direct_p2p`] hands out.
pub struct DirectP2p<'g> {
    core: &'g GroupCore,
    backend: &'g Arc<dyn Backend>,
}

impl DirectP2p<'_> {
    /// Exchange `ops` now as op `name`, within `opts`' timeout (else the
    /// group's): what `submit` does with a direct send, receive or
    /// sendrecv on a transport that posts, without building the op and the
    /// job on the way (a send, a receive and a sendrecv of 8 B are each
    /// a few hundred nanoseconds, and most of those were the layers).
    pub fn run<'t>(self, name: &'static str, ops: &mut [P2p<'_>], opts: &OpOptions) -> Work<'t> {
        let timeout = opts.timeout.unwrap_or(self.core.options.timeout);
        let deadline = Deadline::after(timeout);
        let result = self.core.guarded(name, || self.backend.exchange(ops, &deadline));
        Work::done(result, None).within(timeout)
    }
}

impl GroupCore {
    /// The direct path for a send or receive of host tensors on `route`:
    /// the route's transport, if it posts (elsewhere the op is a job).
    pub(crate) fn direct_p2p(&self, route: Route) -> Option<DirectP2p<'_>> {
        if route.0 != DeviceKind::Cpu {
            return None;
        }
        Some(DirectP2p { core: self, backend: self.host.posting()? })
    }

    /// Post a directly issued `job` and drive its transport until it has
    /// finished (what a receive from any rank takes, to learn its sender).
    pub(crate) fn post_and_wait(self: &Arc<Self>, backend: &Arc<dyn Backend>, job: &mut Job<'_>, opts: &OpOptions) -> Arc<WorkState> {
        let state = Arc::<WorkState>::default();
        // SAFETY: this returns once `state` has completed, so the tensors
        // outlive the op.
        unsafe { self.post_p2p(backend, job, opts, state.clone(), false) };
        backend.progress(&|| state.is_done());
        state
    }

    /// The transport a point-to-point job is posted to, if it posts.
    pub(crate) fn posting_backend(&self, job: &Job<'_>) -> Option<&Arc<dyn Backend>> {
        if job.is_collective() {
            return None;
        }
        let host = job.route.0 == DeviceKind::Cpu;
        self.backend(job.route).filter(|b| if host { b.capabilities().posts } else { b.capabilities().posts_device })
    }

    /// This group's progress thread for `backend`, started on first use.
    pub(crate) fn progress_thread(&self, backend: &Arc<dyn Backend>) -> Arc<ProgressThread> {
        let mut progress_threads = self.progress_threads.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(l) = progress_threads.iter().find(|l| l.drives(backend)) {
            return l.clone();
        }
        let l = ProgressThread::start(backend.clone());
        progress_threads.push(l.clone());
        l
    }

    /// Post `job` to `backend`; `state` completes when it has finished.
    /// `background`: the group's progress thread drives it when nobody
    /// else is in the transport.
    ///
    /// # Safety
    /// The memory `job`'s tensors view stays valid until `state` completes.
    pub(crate) unsafe fn post_p2p(
        self: &Arc<Self>,
        backend: &Arc<dyn Backend>,
        job: &mut Job<'_>,
        opts: &OpOptions,
        state: Arc<WorkState>,
        background: bool,
    ) {
        let name = job.name;
        if let Err(e) = self.usable() {
            return state.complete(Err(e.with_op(name).with_rank(self.rank)), None);
        }
        let host = job.route.0 == DeviceKind::Cpu;
        let bools = if host { bool_outputs(&mut job.op) } else { Vec::new() };
        let deadline = crate::deadline::instant_after(opts.timeout.unwrap_or(self.options.timeout));
        let any = job.op.receives_from_any();
        if any && !backend.capabilities().receives_from_any {
            let e = Error::unsupported(format!("backend {} cannot receive from any rank", backend.name()));
            return state.complete(Err(e.with_op(name).with_rank(self.rank)), None);
        }
        let source = any.then(|| Arc::new(AtomicUsize::new(ANY_SOURCE)));
        let progress = background.then(|| self.progress_thread(backend));
        if let Some(l) = &progress {
            l.begin();
            state.set_driver(l.clone());
        }
        let (kick, mine) = (progress.clone(), state.clone());
        let core = self.clone();
        let from = source.clone();
        // Where a device backend leaves what of the op still runs on the device.
        let completion = if host { crate::stream::CompletionSlot::default() } else { crate::stream::CompletionSlot::for_device() };
        let device = completion.clone();
        let done: crate::backend::progress::Done = Box::new(move |r: Result<()>| {
            let r = r.map_err(|e| {
                let e = core.explain(e).with_op(name).with_rank(core.rank);
                if !matches!(e.kind(), ErrorKind::Unsupported | ErrorKind::InvalidArgument) {
                    core.poison(e.clone());
                }
                e
            });
            if r.is_ok() {
                for &(at, len) in &bools {
                    // SAFETY: a receive buffer of this op, valid until
                    // `state` completes (the caller's promise); the
                    // transport no longer touches it.
                    crate::kernels::sanitize(unsafe { std::slice::from_raw_parts_mut(at as *mut u8, len) }, DType::Bool);
                }
            }
            if let (Ok(()), Some(from)) = (&r, &from) {
                state.set_source(from.load(Ordering::Acquire));
            }
            // Also after a failure: what the backend queued may still use the
            // tensors, and the work handle waits for it before freeing them.
            state.complete(r, device.take());
            if let Some(l) = progress {
                l.end();
            }
        });
        if !host {
            // SAFETY: the tensors are valid until `state` completes (the
            // caller's promise), which `done` does last.
            unsafe { backend.post_device(&mut job.op, opts.stream, deadline, completion, done) };
            if let Some(l) = kick {
                l.kick();
            }
            return;
        }
        let mut ops = match job.op.host_p2p() {
            Ok(ops) => ops,
            Err(e) => return done(Err(e)),
        };
        // SAFETY: as above.
        let post = unsafe { Post::new(&mut ops, &[], deadline, done) };
        backend.post(match source {
            Some(cell) => post.with_source(cell),
            None => post,
        });
        if let Some(l) = kick {
            // Progress on the posting thread first, as MPI_Isend makes it:
            // one turn of the transport that never blocks sends what fits
            // its buffers and takes what has already arrived. Only what is
            // left wakes the progress thread (a hand-over costs more than
            // the small op itself; figures: bench/RESULTS.md, "Measurements
            // behind code comments").
            let once = std::cell::Cell::new(false);
            backend.progress(&|| once.replace(true));
            if !mine.is_done() {
                l.kick();
            }
        }
    }
}
