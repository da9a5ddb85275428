//! The store torch.distributed hands a backend, as a weft [`Store`]: the
//! group meets through it, with no port or variable of its own.
//!
//! Each call takes the GIL for as long as the Python call runs (c10d's
//! stores release it while they wait), from whichever thread weft makes it.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use std::time::Duration;
use weft::store::Store;
use weft::{Error, Result};

/// How every error from torch's store begins (setup errors with it are of
/// kind `store`).
pub const STORE_ERROR: &str = "torch store";

/// A `torch.distributed.Store` (or anything with its methods).
pub struct PyStore {
    store: Py<PyAny>,
    timeout: Duration,
}

impl PyStore {
    /// Wrap `store`, whose calls that do not wait are bounded by `timeout`.
    pub fn new(store: Py<PyAny>, timeout: Duration) -> PyStore {
        PyStore { store, timeout }
    }

    /// Call `method` with the GIL; a Python exception becomes a weft error
    /// (a timeout when the store says it timed out).
    fn call<T>(&self, what: &str, f: impl FnOnce(Python<'_>, &Bound<'_, PyAny>) -> PyResult<T>) -> Result<T> {
        Python::attach(|py| {
            f(py, self.store.bind(py)).map_err(|e| {
                let text = e.to_string();
                let lower = text.to_lowercase();
                if lower.contains("timeout") || lower.contains("timed out") {
                    Error::timeout(format!("{STORE_ERROR} {what}: {text}"))
                } else {
                    Error::backend(format!("{STORE_ERROR} {what}: {text}"))
                }
            })
        })
    }
}

/// A `datetime.timedelta` of `d`.
fn timedelta<'py>(py: Python<'py>, d: Duration) -> PyResult<Bound<'py, PyAny>> {
    py.import("datetime")?.getattr("timedelta")?.call1((0, 0, d.as_micros().min(i64::MAX as u128) as i64))
}

impl Store for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call("set", |py, s| s.call_method1("set", (key, PyBytes::new(py, value))).map(drop))
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait(&[key], timeout)?;
        self.call("get", |_, s| s.call_method1("get", (key,))?.extract::<Vec<u8>>())
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.call("add", |_, s| s.call_method1("add", (key, delta))?.extract())
    }

    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        // c10d answers `expected` for a missing key; weft's contract is the
        // value stored afterwards (empty: still missing).
        if !expected.is_empty() && !self.check(&[key])? {
            return Ok(Vec::new());
        }
        self.call("compare_set", |py, s| {
            s.call_method1("compare_set", (key, PyBytes::new(py, expected), PyBytes::new(py, desired)))?.extract::<Vec<u8>>()
        })
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.call("wait", |py, s| s.call_method1("wait", (PyList::new(py, keys)?, timedelta(py, timeout)?)).map(drop))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.call("check", |py, s| s.call_method1("check", (PyList::new(py, keys)?,))?.extract())
    }

    fn delete(&self, key: &str) -> Result<bool> {
        self.call("delete_key", |_, s| s.call_method1("delete_key", (key,))?.extract())
    }

    fn num_keys(&self) -> Result<u64> {
        self.call("num_keys", |_, s| s.call_method0("num_keys")?.extract())
    }

    fn timeout(&self) -> Duration {
        self.timeout
    }
}
