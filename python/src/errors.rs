//! weft errors as Python exceptions: the classes `weft/_errors.py`
//! registers (torch.distributed's exception types) once the package is
//! imported, else this module's [`WeftError`].

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyType};
use std::collections::HashMap;
use std::sync::OnceLock;
use weft::ErrorKind;

pyo3::create_exception!(
    _weft,
    WeftError,
    pyo3::exceptions::PyRuntimeError,
    "A weft error: args are (message, kind, peer or None, op or None, rank or None)."
);

/// The exception class for each kind's name, as registered by Python.
static TYPES: OnceLock<HashMap<String, Py<PyType>>> = OnceLock::new();

/// Raise weft's errors as these classes from now on: `types` maps a kind
/// (`timeout`, `peer_lost`, `invalid_argument`, `unsupported`, `aborted`,
/// `backend`, `store`) to a class called with `(message, kind, peer, op,
/// rank)`; kinds it lacks raise the `backend` class. Only the first call
/// counts.
#[pyfunction]
pub fn set_error_types(types: &Bound<'_, PyDict>) -> PyResult<()> {
    let map = types.iter().map(|(k, v)| Ok((k.extract::<String>()?, v.cast_into::<PyType>()?.unbind()))).collect::<PyResult<_>>()?;
    let _ = TYPES.set(map);
    Ok(())
}

/// The kind's name, as the Python side matches it.
fn kind_name(kind: &ErrorKind) -> (&'static str, Option<usize>) {
    match kind {
        ErrorKind::Timeout => ("timeout", None),
        ErrorKind::PeerLost { rank } => ("peer_lost", Some(*rank)),
        ErrorKind::InvalidArgument => ("invalid_argument", None),
        ErrorKind::Unsupported => ("unsupported", None),
        ErrorKind::Aborted => ("aborted", None),
        _ => ("backend", None),
    }
}

/// `e` as a Python exception of kind `kind`.
fn raise(e: &weft::Error, kind: &str, peer: Option<usize>) -> PyErr {
    let args = (e.to_string(), kind.to_owned(), peer, e.op().map(str::to_owned), e.rank());
    match TYPES.get().and_then(|t| t.get(kind).or_else(|| t.get("backend"))) {
        // Error paths only: taking the GIL here (also from code that had
        // released it) is fine.
        Some(cls) => Python::attach(|py| PyErr::from_type(cls.bind(py).clone(), args)),
        None => WeftError::new_err(args),
    }
}

/// `e` as a Python exception.
pub fn to_py(e: weft::Error) -> PyErr {
    let (kind, peer) = kind_name(e.kind());
    raise(&e, kind, peer)
}

/// An error while a group is set up: a failure of torch's store (not a
/// timeout) is of kind `store`.
pub fn setup_to_py(e: weft::Error) -> PyErr {
    let (kind, peer) = kind_name(e.kind());
    if kind != "timeout" && e.to_string().contains(crate::store::STORE_ERROR) {
        return raise(&e, "store", None);
    }
    raise(&e, kind, peer)
}
