//! One-sided windows for Python (`weft/_window.py` is TorchComm's
//! `TorchCommWindow` over this): puts and gets on tensors the Python side
//! keeps alive, signals, and the addresses of registered memory, which
//! Python views as tensors while this object (and so the memory) lives.

use crate::errors::to_py;
use crate::options::{op_options, Hints};
use crate::tensor::Desc;
use crate::work::PyWork;
use pyo3::prelude::*;
use std::sync::Arc;
use std::time::Instant;
use weft::{AccessType, Window};

/// A window of a group (made by `Group.new_window`).
#[pyclass(frozen, module = "weft._weft", name = "Window")]
pub struct PyWindow {
    /// Taken only by `Drop`.
    win: Option<Arc<Window>>,
}

impl PyWindow {
    /// Wrap a window.
    pub fn new(win: Window) -> PyWindow {
        PyWindow { win: Some(Arc::new(win)) }
    }

    fn win(&self) -> &Window {
        self.win.as_ref().expect("set until dropped")
    }
}

impl Drop for PyWindow {
    /// A window never deregistered is deregistered here (collectively),
    /// without the GIL: Python's other threads (ranks too) go on meanwhile.
    fn drop(&mut self) {
        if let Some(win) = self.win.take() {
            Python::attach(|py| py.detach(move || drop(win)));
        }
    }
}

#[pymethods]
impl PyWindow {
    /// Bytes rank `rank` registered.
    fn len_of(&self, rank: usize) -> usize {
        self.win().len_of(rank)
    }

    /// `(address, bytes)` of this rank's registered memory (a device
    /// address for a CUDA window), valid while this object lives.
    fn local_address(&self) -> (usize, usize) {
        let m = self.win().local();
        (m.as_ptr() as usize, m.len())
    }

    /// `(address, bytes)` of rank `rank`'s registered memory mapped here
    /// (shared memory; device memory through CUDA IPC), valid while this
    /// object lives; raises
    /// `unsupported` where peers' memory is not mapped.
    fn remote_address(&self, rank: usize) -> PyResult<(usize, usize)> {
        let m = self.win().map_remote(rank).map_err(to_py)?;
        Ok((m.as_ptr() as usize, m.len()))
    }

    /// `"unified"` (mapped here) or `"separate"` for `peer`.
    fn access(&self, peer: usize) -> PyResult<&'static str> {
        Ok(match self.win().attr(peer).map_err(to_py)?.access {
            AccessType::Unified => "unified",
            AccessType::Separate => "separate",
        })
    }

    /// Put `t` at byte `offset` of rank `dst`'s memory; `keep` holds `t`
    /// until the returned work has finished.
    #[pyo3(signature = (t, dst, offset, keep, timeout = None, hints = None))]
    fn put(&self, t: Desc, dst: usize, offset: usize, keep: Py<PyAny>, timeout: Option<f64>, hints: Option<Hints>) -> PyResult<PyWork> {
        // SAFETY: `keep` holds the tensor until the work has finished (the
        // PyWork keeps it, and parks it if dropped early).
        let (opts, issued) = (op_options(timeout, hints)?, Instant::now());
        let work = unsafe { t.view() }.and_then(|t| self.win().put(t, dst, offset, &opts)).map_err(to_py)?;
        Ok(PyWork::new(work, issued, keep, None))
    }

    /// Read rank `src`'s memory at byte `offset` into `t`.
    #[pyo3(signature = (t, src, offset, keep, timeout = None, hints = None))]
    fn get(&self, t: Desc, src: usize, offset: usize, keep: Py<PyAny>, timeout: Option<f64>, hints: Option<Hints>) -> PyResult<PyWork> {
        // SAFETY: as in `put`.
        let (opts, issued) = (op_options(timeout, hints)?, Instant::now());
        let work = unsafe { t.view_mut() }.and_then(|t| self.win().get(t, src, offset, &opts)).map_err(to_py)?;
        Ok(PyWork::new(work, issued, keep, None))
    }

    /// Signal `peer` (after this rank's earlier puts to it).
    #[pyo3(signature = (peer, keep, timeout = None, hints = None))]
    fn signal(&self, peer: usize, keep: Py<PyAny>, timeout: Option<f64>, hints: Option<Hints>) -> PyResult<PyWork> {
        let (opts, issued) = (op_options(timeout, hints)?, Instant::now());
        let work = self.win().signal(peer, &opts).map_err(to_py)?;
        Ok(PyWork::new(work, issued, keep, None))
    }

    /// Wait (the GIL released) for `count` signals from `peer`.
    #[pyo3(signature = (peer, count = 1, timeout = None, hints = None))]
    fn wait_signal(&self, py: Python<'_>, peer: usize, count: u64, timeout: Option<f64>, hints: Option<Hints>) -> PyResult<()> {
        let opts = op_options(timeout, hints)?;
        py.detach(|| self.win().wait_signals(peer, count, &opts)).map_err(to_py)
    }

    /// End the window (collective; the GIL released).
    fn deregister(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.win().deregister()).map_err(to_py)
    }
}
