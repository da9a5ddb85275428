//! What is settled about an op when it is issued, before anything runs:
//! the algorithm it was told to use (see [`crate::algorithms::select`]),
//! checked against core's algorithms and those of the backend that serves
//! it, and the segment size of its pipelined steps (the op's hint, the
//! group's, or one that fits what the backend buffers). A name that is not
//! among them, or a size that is not one, is `InvalidArgument` from the
//! call that issued the op, on every rank alike, before any byte moves.

use super::job::Job;
use super::GroupCore;
use crate::algorithms::select;
use crate::error::Result;
use crate::options::OpOptions;

impl GroupCore {
    /// Settle `job`'s algorithm and segment size from `opts` and the
    /// group's setting.
    pub(crate) fn decide(&self, job: &mut Job<'_>, opts: &OpOptions) -> Result<()> {
        let fail = |e: crate::Error| e.with_op(job.name).with_rank(self.rank);
        // (`is_empty` first: no hashing on the common path.)
        let hint = |key: &str| if opts.hints.is_empty() { None } else { opts.hints.get(key).map(String::as_str) };
        let backend = self.backend(job.route);
        // Every op with pipelined steps (reduce_scatter too, which has no
        // choice of algorithm).
        job.segment_bytes = match hint("segment_bytes") {
            Some(v) => Some(select::parse_segment_bytes(v).map_err(fail)?),
            None => self.algorithms.segment_bytes.or_else(|| select::segment_for(backend.and_then(|b| b.capabilities().buffered_bytes))),
        };
        if let Some(family) = select::Family::of(job.kind) {
            let natives = backend.map_or(&[][..], |b| b.capabilities().native_algorithms);
            job.algorithm = select::forced(family, hint("algorithm"), &self.algorithms, natives).map_err(fail)?;
        }
        Ok(())
    }
}
