//! An op's call settings as Python hands them over: one parser for the
//! timeout and hints of every op, window ops included.

use pyo3::prelude::*;
use std::collections::HashMap;
use std::time::Duration;
use weft::OpOptions;

/// An op's hints (keys weft does not know are ignored, as everywhere).
pub(crate) type Hints = HashMap<String, String>;

/// The options of one op: a timeout in seconds (None, zero or negative:
/// the group's) and hints. A timeout that is not a number of seconds is a
/// `ValueError`.
pub(crate) fn op_options(timeout: Option<f64>, hints: Option<Hints>) -> PyResult<OpOptions> {
    let timeout = timeout.filter(|t| t.is_nan() || *t > 0.0).map(seconds).transpose()?;
    Ok(OpOptions { timeout, hints: hints.unwrap_or_default(), stream: None })
}

/// `t` seconds as a duration; NaN, a negative or an unrepresentable
/// (infinite) value is a `ValueError` instead of a panic.
pub(crate) fn seconds(t: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(t)
        .map_err(|_| pyo3::exceptions::PyValueError::new_err(format!("weft: timeout {t} is not a number of seconds")))
}

/// What every op takes besides its tensors, as the Python side's `Call`
/// (`weft/_ops.py`, a named tuple `(keep, timeout, hints, direct)`): the
/// objects keeping the tensors alive, the timeout in seconds (None: the
/// group's), hints (or None), and whether the op runs directly (a
/// synchronous torch call) or in the background.
pub(crate) struct Call {
    pub(crate) keep: Py<PyAny>,
    pub(crate) options: OpOptions,
    pub(crate) direct: bool,
}

impl<'a, 'py> FromPyObject<'a, 'py> for Call {
    type Error = PyErr;
    fn extract(ob: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        let (keep, timeout, hints, direct): (Py<PyAny>, Option<f64>, Option<Hints>, bool) = ob.extract()?;
        Ok(Call { keep, options: op_options(timeout, hints)?, direct })
    }
}
