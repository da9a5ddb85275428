//! The native half of the `weft` Python package (`weft._weft`): weft's
//! process groups over a torch.distributed store, ops on tensors described
//! by pointer, and work handles. `weft/` (Python) makes it a
//! torch.distributed backend.

mod errors;
mod group;
mod store;
mod tensor;
mod work;

use pyo3::prelude::*;

/// The extension module.
#[pymodule]
fn _weft(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<group::PyGroup>()?;
    m.add_class::<work::PyWork>()?;
    m.add_function(wrap_pyfunction!(work::next_completed, m)?)?;
    m.add("WeftError", m.py().get_type::<errors::WeftError>())?;
    m.add("TIMEOUT_DEFAULT", weft::DEFAULT_TIMEOUT.as_secs_f64())?;
    Ok(())
}
