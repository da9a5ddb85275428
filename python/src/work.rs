//! Work handles for Python: an op running in weft's threads, the Python
//! objects that keep its tensors alive, and completion notices.
//!
//! Nothing here needs the GIL for an op to progress or finish. Python
//! learns of a finished op by waiting (the GIL released), by asking, or
//! through [`next_completed`], which a Python thread blocks in to complete
//! torch futures.

use crate::errors::to_py;
use crate::health::Health;
use pyo3::prelude::*;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Wake, Waker};
use std::time::{Duration, Instant};
use weft::SparseCoo;

/// What keeps an op's tensors alive until it has finished: the Python
/// objects holding them, or a C++ caller's release callback
/// ([`crate::torch_api`]), called once the op can no longer touch them.
#[allow(dead_code)] // held for what their drop does, never read
pub(crate) enum Keep {
    Py(Py<PyAny>),
    Cpp(crate::torch_api::Release),
}

/// What an op holds while it runs: its handle, what keeps its tensors
/// alive, and an output weft allocates (a sparse result).
struct Flight {
    work: weft::Work<'static>,
    /// Dropped after `work` (field order), once the op cannot touch it.
    sparse: Option<Box<SparseCoo>>,
    _keep: Keep,
}

/// An issued op as any binding holds it: its flight, the group's error
/// record, and its times. Dropped before it finished, it parks the flight
/// until the op has finished instead of blocking.
pub(crate) struct OpHandle {
    flight: Option<Flight>,
    /// The group's error record, which this op's failure updates once a
    /// caller learns of it.
    health: Option<Health>,
    /// When the op was issued, and when it ended if it ran on the caller's
    /// thread (else weft's Work knows): for `duration`.
    issued: Instant,
    ran: Option<Instant>,
}

impl OpHandle {
    /// The handle of `work`, issued at `issued` (before it ran: for its
    /// duration), which uses the tensors `keep` holds (and writes
    /// `sparse`, if any) until it has finished.
    pub(crate) fn new(work: weft::Work<'static>, issued: Instant, keep: Keep, sparse: Option<Box<SparseCoo>>) -> OpHandle {
        // An op that ran on this thread ended just now.
        let ran = work.ran_on_caller().then(Instant::now);
        OpHandle { flight: Some(Flight { work, sparse, _keep: keep }), health: None, issued, ran }
    }

    /// The same, recording a failure in `health` (the group's).
    pub(crate) fn watched(mut self, health: &Health) -> OpHandle {
        self.health = Some(health.clone());
        self
    }

    /// `e`, recorded in the group's health first.
    pub(crate) fn fail(&self, e: weft::Error) -> weft::Error {
        if let Some(h) = &self.health {
            h.record(e.kind());
        }
        e
    }

    /// Keep what `keep` holds until the op has finished (instead of what
    /// was given at issue).
    pub(crate) fn keep_until_done(&mut self, keep: Keep) {
        if let Some(f) = &mut self.flight {
            f._keep = keep;
        }
    }

    pub(crate) fn work(&self) -> &weft::Work<'static> {
        &self.flight.as_ref().expect("set until dropped").work
    }

    /// Block until the op finishes: true; with a `timeout`, false if it is
    /// still running then. The op's error (recorded) if it failed.
    pub(crate) fn wait(&self, timeout: Option<Duration>) -> weft::Result<bool> {
        let w = self.work();
        match timeout {
            None => w.wait().map(|()| true),
            Some(t) => w.wait_timeout(t),
        }
        .map_err(|e| self.fail(e))
    }

    /// Milliseconds from the op's issue to the end of its host side; None
    /// while it runs.
    pub(crate) fn duration(&self) -> Option<f64> {
        let end = self.ran.or_else(|| self.work().finished_at())?;
        Some(end.saturating_duration_since(self.issued).as_secs_f64() * 1e3)
    }

    /// The op's error once it has failed (recorded), else None.
    pub(crate) fn error(&self) -> Option<weft::Error> {
        self.work().error().map(|e| self.fail(e))
    }
}

impl Drop for OpHandle {
    fn drop(&mut self) {
        let Some(flight) = self.flight.take() else { return };
        if flight.work.is_completed() {
            return;
        }
        // Still running: the tensors must outlive the op, but the caller
        // must not wait for it (an isend whose handle was dropped). Park
        // the flight until the op finishes; what keeps the tensors goes
        // then (Python references are released by PyO3 the next time a
        // thread holds the GIL).
        let parked = Arc::new(Parked(Mutex::new(None)));
        let waker = Waker::from(parked.clone());
        // Parked before the waker is registered, so a wake finds it.
        let mut slot = parked.0.lock().unwrap_or_else(|p| p.into_inner());
        let registered = flight.work.wake_when_done(&waker);
        *slot = Some(flight);
        drop(slot);
        if !registered {
            parked.wake_by_ref();
        }
    }
}

/// A background op; see `weft/_work.py` for the torch-facing object.
#[pyclass(frozen, module = "weft._weft", name = "Work")]
pub struct PyWork(OpHandle);

impl PyWork {
    /// The handle of `work` (see [`OpHandle::new`]), its tensors held by
    /// the Python object `keep`.
    pub fn new(work: weft::Work<'static>, issued: Instant, keep: Py<PyAny>, sparse: Option<Box<SparseCoo>>) -> PyWork {
        PyWork(OpHandle::new(work, issued, Keep::Py(keep), sparse))
    }

    /// The same, recording a failure in `health` (the group's).
    pub fn watched(self, health: &Health) -> PyWork {
        PyWork(self.0.watched(health))
    }

    fn work(&self) -> &weft::Work<'static> {
        self.0.work()
    }
}

#[pymethods]
impl PyWork {
    /// Block until the op finishes (the GIL released): True; with a
    /// `timeout` in seconds, False if it is still running then. Raises the
    /// op's error.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        if self.work().is_completed() {
            // Nothing to block on (a direct op; a CUDA op's wait only
            // orders torch's stream): no hand-over of the GIL.
            return self.0.wait(None).map_err(to_py);
        }
        let timeout = timeout.map(|t| crate::options::seconds(t.max(0.0))).transpose()?;
        py.detach(|| self.0.wait(timeout)).map_err(to_py)
    }

    /// As `wait`, then block the host until the device side of a CUDA op
    /// has finished too (the same as `wait` for CPU tensors).
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        let w = self.work();
        py.detach(|| w.synchronize()).map_err(to_py)
    }

    /// Whether the op has finished, successfully or not.
    fn is_completed(&self) -> bool {
        self.work().is_completed()
    }

    /// Milliseconds from the op's issue to the end of its host side; None
    /// while it runs.
    fn duration(&self) -> Option<f64> {
        self.0.duration()
    }

    /// The op's error once it has failed, else None.
    fn exception(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.0.error().map(|e| to_py(e).into_value(py).into_any())
    }

    /// For a receive from any rank: the sender, once it has finished.
    fn source(&self) -> Option<usize> {
        self.work().source()
    }

    /// Once finished: `id` comes out of [`next_completed`] (at once if the
    /// op has already finished).
    fn notify(&self, id: u64) {
        let notice = Arc::new(Notice { id, tx: Mutex::new(Some(completions().0.clone())) });
        if !self.work().wake_when_done(&Waker::from(notice.clone())) {
            notice.wake_by_ref();
        }
    }

    /// A sparse all-reduce's result, once finished successfully: the
    /// indices (i64, `[sparse_dims, nnz]`, as bytes), the values (bytes)
    /// and nnz.
    fn sparse_result<'py>(&self, py: Python<'py>) -> PyResult<(Bound<'py, pyo3::types::PyBytes>, Bound<'py, pyo3::types::PyBytes>, usize)> {
        let f = self.0.flight.as_ref().expect("set until dropped");
        f.work.error().map_or(Ok(()), |e| Err(to_py(e)))?;
        if !f.work.is_completed() {
            return Err(pyo3::exceptions::PyRuntimeError::new_err("the sparse all-reduce has not finished"));
        }
        let out = f.sparse.as_ref().ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("not a sparse all-reduce"))?;
        let indices: Vec<u8> = out.indices.iter().flat_map(|i| i.to_le_bytes()).collect();
        Ok((pyo3::types::PyBytes::new(py, &indices), pyo3::types::PyBytes::new(py, &out.values), out.nnz()))
    }
}

/// An unfinished op whose handle its caller dropped.
struct Parked(Mutex<Option<Flight>>);

impl Wake for Parked {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        let flight = self.0.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(flight);
    }
}

/// Sends an op's id to [`next_completed`] once.
struct Notice {
    id: u64,
    tx: Mutex<Option<Sender<u64>>>,
}

impl Wake for Notice {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(tx) = self.tx.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = tx.send(self.id);
        }
    }
}

type Channel = (Sender<u64>, Mutex<Receiver<u64>>);

fn completions() -> &'static Channel {
    static C: OnceLock<Channel> = OnceLock::new();
    C.get_or_init(|| {
        let (tx, rx) = channel();
        (tx, Mutex::new(rx))
    })
}

/// The id of the next op that finished among those asked about with
/// `Work.notify`, waiting at most `timeout` seconds (the GIL released);
/// None if none finished meanwhile.
#[pyfunction]
pub fn next_completed(py: Python<'_>, timeout: f64) -> Option<u64> {
    py.detach(|| {
        let rx = completions().1.lock().unwrap_or_else(|p| p.into_inner());
        rx.recv_timeout(Duration::from_secs_f64(timeout.max(0.0))).ok()
    })
}
