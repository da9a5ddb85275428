//! What is settled about an op when it is issued, before anything runs:
//! the algorithm it was told to use (see [`crate::algorithms::select`]),
//! checked against core's algorithms and those of the backend that serves
//! it. A name that is not among them is `InvalidArgument` from the call
//! that issued the op, on every rank alike, before any byte moves.

use super::ops::Job;
use super::GroupCore;
use crate::algorithms::select;
use crate::error::Result;
use crate::options::OpOptions;

impl GroupCore {
    /// Settle `job`'s algorithm from `opts` and the group's setting.
    pub(crate) fn decide(&self, job: &mut Job<'_>, opts: &OpOptions) -> Result<()> {
        let Some(family) = select::family(job.kind) else { return Ok(()) };
        // (`is_empty` first: no hashing on the common path.)
        let hint = if opts.hints.is_empty() { None } else { opts.hints.get("algorithm").map(String::as_str) };
        let natives = self.backend(job.route).map_or(&[][..], |b| b.native_algorithms(family));
        job.algorithm = select::forced(family, hint, &self.algorithms, natives).map_err(|e| e.with_op(job.name).with_rank(self.rank))?;
        Ok(())
    }
}
