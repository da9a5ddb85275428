//! weft errors as Python exceptions. The Python side turns them into
//! torch.distributed's exception types (`weft/_errors.py`).

use pyo3::prelude::*;
use weft::ErrorKind;

pyo3::create_exception!(
    _weft,
    WeftError,
    pyo3::exceptions::PyRuntimeError,
    "A weft error: args are (message, kind, peer or None, op or None, rank or None)."
);

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

/// `e` as a [`WeftError`].
pub fn to_py(e: weft::Error) -> PyErr {
    let (kind, peer) = kind_name(e.kind());
    WeftError::new_err((e.to_string(), kind, peer, e.op(), e.rank()))
}
