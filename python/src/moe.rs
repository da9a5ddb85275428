//! Mixture-of-experts dispatch and combine for Python (`weft/moe.py`
//! builds the autograd and the torch API over these): each call blocks,
//! with the GIL released, until its exchange has finished on this rank.

use crate::errors::to_py;
use crate::group::PyGroup;
use crate::options::op_options;
use crate::tensor::Desc;
use pyo3::prelude::*;
use std::sync::Mutex;
use weft::moe::{DispatchPlan, ExpertRouting};
use weft::DType;

/// Step one of a dispatch, done (`Group.moe_plan`): how many rows this
/// rank receives. Used once, by `Group.moe_dispatch`.
#[pyclass(frozen, module = "weft._weft", name = "DispatchPlan")]
pub struct PyDispatchPlan(Mutex<Option<DispatchPlan>>);

#[pymethods]
impl PyDispatchPlan {
    /// Rows this rank's experts receive (None once dispatched).
    fn rows(&self) -> Option<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(DispatchPlan::rows)
    }
}

/// How one dispatch routed its tokens: what combine, a second dispatch and
/// the per-pair value exchanges reuse.
#[pyclass(frozen, module = "weft._weft", name = "ExpertRouting")]
pub struct PyExpertRouting(ExpertRouting);

#[pymethods]
impl PyExpertRouting {
    /// Rows received per local expert.
    fn counts(&self) -> Vec<usize> {
        self.0.counts().to_vec()
    }
    /// Rows received in all.
    fn rows(&self) -> usize {
        self.0.rows()
    }
    /// Tokens on this rank.
    fn tokens(&self) -> usize {
        self.0.tokens()
    }
    /// Experts chosen per token.
    fn k(&self) -> usize {
        self.0.k()
    }
    /// Row bytes one dispatch of rows of dtype `code` sends from this
    /// rank to others (one row per token and other rank it goes to).
    fn bytes_sent(&self, code: u8) -> PyResult<usize> {
        let dtype = DType::from_code(code).ok_or_else(|| to_py(weft::Error::invalid(format!("unknown dtype code {code}"))))?;
        Ok(self.0.bytes_sent(dtype))
    }
}

/// A host tensor's description, read-only (`what` names it in errors).
///
/// # Safety
/// As [`Desc::view`]: the caller keeps the tensor alive and untouched.
unsafe fn host<'a>(d: &Desc, what: &str) -> weft::Result<weft::Tensor<'a>> {
    // SAFETY: the caller's promise.
    let t = unsafe { d.view() }?;
    if t.device() != weft::Device::Cpu {
        return Err(weft::Error::invalid(format!("{what} must be in host memory (the Python side stages device tensors)")));
    }
    Ok(t)
}

/// Per-pair values as f64 from a host tensor of float64.
///
/// # Safety
/// As [`host`].
unsafe fn values(d: &Desc) -> weft::Result<Vec<f64>> {
    // SAFETY: the caller's promise.
    let t = unsafe { host(d, "values") }?;
    Ok(t.as_slice::<f64>()?.to_vec())
}

/// Step one of a dispatch (collective): check `topk` (int64, `[tokens,
/// k]`) and `x` (`[tokens, hidden]`, a float dtype) over `num_experts`
/// experts, and send every rank its header and the first part of its rows.
#[pyfunction]
#[pyo3(signature = (group, topk, x, k, num_experts, hidden, timeout = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_plan(
    py: Python<'_>,
    group: &PyGroup,
    topk: Desc,
    x: Desc,
    k: usize,
    num_experts: usize,
    hidden: usize,
    timeout: Option<f64>,
) -> PyResult<PyDispatchPlan> {
    let plan = blocking(py, group, timeout, |pg, o| {
        // SAFETY: the Python caller holds `topk` and `x` until this returns.
        let (topk, x) = unsafe { (host(&topk, "topk_idx")?, host(&x, "x")?) };
        pg.dispatch_plan(topk.as_slice::<i64>()?, k, num_experts, x, hidden, o)
    })?;
    Ok(PyDispatchPlan(Mutex::new(Some(plan))))
}

/// Step two (collective): the rest of the rows, and all of them into
/// `out` (`plan.rows()` rows), grouped by local expert; `x` is the tensor
/// step one took.
#[pyfunction]
#[pyo3(signature = (group, plan, x, out, timeout = None))]
pub(crate) fn moe_dispatch(
    py: Python<'_>,
    group: &PyGroup,
    plan: &PyDispatchPlan,
    x: Desc,
    out: Desc,
    timeout: Option<f64>,
) -> PyResult<PyExpertRouting> {
    let plan = plan.0.lock().unwrap_or_else(|p| p.into_inner()).take();
    let plan = plan.ok_or_else(|| to_py(weft::Error::invalid("this dispatch plan was already used")))?;
    // SAFETY: the Python caller holds `x` and `out` until this returns.
    let routing = blocking(py, group, timeout, |pg, o| pg.dispatch(plan, unsafe { host(&x, "x") }?, unsafe { out.view_mut() }?, o))?;
    Ok(PyExpertRouting(routing))
}

/// A second dispatch with `routing` (collective): `x`'s rows into `out`.
#[pyfunction]
#[pyo3(signature = (group, routing, x, out, timeout = None))]
pub(crate) fn moe_dispatch_again(
    py: Python<'_>,
    group: &PyGroup,
    routing: &PyExpertRouting,
    x: Desc,
    out: Desc,
    timeout: Option<f64>,
) -> PyResult<()> {
    // SAFETY: the Python caller holds `x` and `out` until this returns.
    blocking(py, group, timeout, |pg, o| pg.dispatch_again(&routing.0, unsafe { host(&x, "x") }?, unsafe { out.view_mut() }?, o))
}

/// Combine (collective): `out` (`[tokens, hidden]`) becomes each
/// token's sum over its experts of `weights[row] * expert_out[row]`
/// (`weights`: float64, one per row).
#[pyfunction]
#[pyo3(signature = (group, routing, expert_out, weights, out, timeout = None))]
pub(crate) fn moe_combine(
    py: Python<'_>,
    group: &PyGroup,
    routing: &PyExpertRouting,
    expert_out: Desc,
    weights: Desc,
    out: Desc,
    timeout: Option<f64>,
) -> PyResult<()> {
    blocking(py, group, timeout, |pg, o| {
        // SAFETY: the Python caller holds the tensors until this returns.
        let (expert_out, weights, out) = unsafe { (host(&expert_out, "expert_out")?, values(&weights)?, out.view_mut()?) };
        pg.combine(&routing.0, expert_out, &weights, out, o)
    })
}

/// The backward pass of a combine (collective): `grad_out` (`[rows,
/// hidden]`) becomes `weights[row] * dy[token]`, and `grad_weights`
/// (float64, `[tokens, k]`) the gradient of the router's weights.
#[pyfunction]
#[pyo3(signature = (group, routing, dy, expert_out, weights, grad_out, grad_weights, timeout = None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_combine_backward(
    py: Python<'_>,
    group: &PyGroup,
    routing: &PyExpertRouting,
    dy: Desc,
    expert_out: Desc,
    weights: Desc,
    grad_out: Desc,
    grad_weights: Desc,
    timeout: Option<f64>,
) -> PyResult<()> {
    blocking(py, group, timeout, |pg, o| {
        // SAFETY: the Python caller holds the tensors until this returns.
        let (dy, eo, w, grad, mut gw) = unsafe {
            (host(&dy, "dy")?, host(&expert_out, "expert_out")?, values(&weights)?, grad_out.view_mut()?, grad_weights.view_mut()?)
        };
        let got = pg.combine_backward(&routing.0, dy, eo, &w, grad, o)?;
        copy_values(&got, gw.as_slice_mut::<f64>()?)
    })
}

/// Per-pair values (float64 `values`, `[tokens, k]`) to the experts'
/// side: `out` (float64) gets one per received row.
#[pyfunction]
#[pyo3(signature = (group, routing, values, out, timeout = None))]
pub(crate) fn moe_to_experts(
    py: Python<'_>,
    group: &PyGroup,
    routing: &PyExpertRouting,
    values: Desc,
    out: Desc,
    timeout: Option<f64>,
) -> PyResult<()> {
    blocking(py, group, timeout, |pg, o| {
        // SAFETY: the Python caller holds `values` and `out` until this returns.
        let (values, mut out) = unsafe { (self::values(&values)?, out.view_mut()?) };
        copy_values(&pg.pair_values_to_experts(&routing.0, &values, o)?, out.as_slice_mut::<f64>()?)
    })
}

/// Run `f` on `group`'s weft group with the GIL released, with an op's
/// options for `timeout` (seconds; None: the group's).
fn blocking<R: Send>(
    py: Python<'_>,
    group: &PyGroup,
    timeout: Option<f64>,
    f: impl FnOnce(&weft::ProcessGroup, &weft::OpOptions) -> weft::Result<R> + Send,
) -> PyResult<R> {
    let o = op_options(timeout, None)?;
    let pg = &group.native().pg;
    py.detach(|| f(pg, &o)).map_err(to_py)
}

/// `got` into `out`, which must hold as many values.
fn copy_values(got: &[f64], out: &mut [f64]) -> weft::Result<()> {
    if out.len() != got.len() {
        return Err(weft::Error::invalid(format!("out has {} elements, expected {}", out.len(), got.len())));
    }
    out.copy_from_slice(got);
    Ok(())
}
