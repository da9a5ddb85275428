//! The native half of the `weft` Python package (`weft._weft`): weft's
//! process groups over a torch.distributed store, ops on tensors described
//! by pointer, and work handles. `weft/` (Python) makes it a
//! torch.distributed backend.

mod errors;
mod group;
mod health;
mod moe;
mod options;
mod store;
mod tensor;
mod torch_api;
mod window;
mod work;

use pyo3::prelude::*;

/// Order CUDA ops issued from this thread after `stream` (torch's
/// `torch.cuda.current_stream().cuda_stream`), or the device's default
/// stream with None.
#[pyfunction]
#[pyo3(signature = (stream = None))]
fn set_current_stream(stream: Option<u64>) {
    weft::stream::set_current_stream(stream.map(weft::StreamHandle));
}

/// The job's place for this process from the launcher's environment
/// (torchrun, Slurm, Open MPI, PMI): `rank`, `world_size`, `master_addr`,
/// `master_port`, and `agent_store` (a launcher hosts the store).
#[pyfunction]
fn launch_env(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let env = weft::launch::LaunchEnv::from_env().map_err(errors::to_py)?;
    let d = pyo3::types::PyDict::new(py);
    d.set_item("rank", env.rank)?;
    d.set_item("world_size", env.world_size)?;
    d.set_item("master_addr", env.master_addr)?;
    d.set_item("master_port", env.master_port)?;
    d.set_item("agent_store", env.agent_store)?;
    Ok(d)
}

/// This process's rank and the world size from the launcher's variables
/// alone (for a caller that brings its own store).
#[pyfunction]
fn launch_ranks() -> PyResult<(usize, usize)> {
    weft::launch::LaunchEnv::rank_and_size().map_err(errors::to_py)
}

/// `WEFT_TIMEOUT_SECONDS`'s value in seconds, parsed as weft's Rust API
/// parses it (`weft::parse_timeout`); a bad one is a `ValueError`.
#[pyfunction]
fn parse_timeout(text: &str) -> PyResult<f64> {
    weft::parse_timeout(text).map(|d| d.as_secs_f64()).map_err(errors::to_py)
}

/// The extension module.
#[pymodule]
fn _weft(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<group::PyGroup>()?;
    m.add_class::<work::PyWork>()?;
    m.add_class::<window::PyWindow>()?;
    m.add_function(wrap_pyfunction!(work::next_completed, m)?)?;
    m.add_function(wrap_pyfunction!(set_current_stream, m)?)?;
    m.add_function(wrap_pyfunction!(errors::set_error_types, m)?)?;
    m.add_function(wrap_pyfunction!(launch_env, m)?)?;
    m.add_function(wrap_pyfunction!(launch_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(parse_timeout, m)?)?;
    m.add_class::<moe::PyDispatchPlan>()?;
    m.add_class::<moe::PyExpertRouting>()?;
    for f in [
        wrap_pyfunction!(moe::moe_plan, m)?,
        wrap_pyfunction!(moe::moe_dispatch, m)?,
        wrap_pyfunction!(moe::moe_dispatch_again, m)?,
        wrap_pyfunction!(moe::moe_combine, m)?,
        wrap_pyfunction!(moe::moe_combine_backward, m)?,
        wrap_pyfunction!(moe::moe_to_experts, m)?,
    ] {
        m.add_function(f)?;
    }
    m.add("WeftError", m.py().get_type::<errors::WeftError>())?;
    m.add("TORCH_API", torch_api::capsule(m.py())?)?;
    m.add("TORCH_API_VERSION", torch_api::VERSION)?;
    m.add("TIMEOUT_DEFAULT", weft::DEFAULT_TIMEOUT.as_secs_f64())?;
    Ok(())
}
