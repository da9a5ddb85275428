//! The dense switch: once the union is dense enough, a dense all-reduce is
//! cheaper than exchanging indices. Absent rows hold the op's identity, and
//! a presence mask (reduced with MAX) keeps the result on the exact union
//! of indices, so MIN and MAX stay correct.

use super::coalesce::{Geometry, Run, Sorted};
use crate::algorithms::{ring, Steps};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kernels::{identity, AlignedBuf};
use crate::reduce_op::ReduceOp;

/// Refuse to densify beyond this many bytes (a forced `dense` on a huge shape).
const MAX_DENSE: u64 = 16 << 30;

/// Densify `input`, all-reduce table and mask, and keep the present rows
/// (their values in `reused`, a finished result's buffer).
pub fn all_reduce(c: &Steps<'_>, input: &Sorted<'_>, l: &Geometry, op: ReduceOp, reused: Vec<u8>) -> Result<Run> {
    let bytes = l.rows.checked_mul(l.row as u64).filter(|b| *b <= MAX_DENSE).ok_or_else(|| {
        Error::unsupported(format!("the dense form of this sparse tensor ({} rows of {} bytes) is too large", l.rows, l.row))
    })?;
    let rows = l.rows as usize;
    let mut dense = AlignedBuf::zeroed(bytes as usize);
    let id = identity(l.dtype, op);
    if id.iter().any(|b| *b != 0) {
        for chunk in dense.as_mut().chunks_exact_mut(id.len()) {
            chunk.copy_from_slice(&id);
        }
    }
    let mut mask = vec![0u8; rows];
    for (k, key) in input.keys.iter().enumerate() {
        let at = *key as usize;
        dense.as_mut()[at * l.row..(at + 1) * l.row].copy_from_slice(input.row(k));
        mask[at] = 1;
    }
    ring::all_reduce(&c.phase(2), dense.as_mut(), l.dtype, op)?;
    ring::all_reduce(&c.phase(3), &mut mask, DType::U8, ReduceOp::Max)?;
    let present = mask.iter().filter(|m| **m != 0).count();
    let mut out = Run::reusing(reused, present, l.row);
    for (i, m) in mask.iter().enumerate() {
        if *m != 0 {
            out.keys.push(i as i64);
            out.values.extend_from_slice(&dense.as_ref()[i * l.row..(i + 1) * l.row]);
        }
    }
    Ok(out)
}
