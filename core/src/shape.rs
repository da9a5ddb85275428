//! A collective's *shape*: what every rank must agree on about it, packed
//! into the [`crate::tag::SHAPE_BITS`] bits each of its messages carries in
//! its tag, so a peer in a mismatched call is caught when its first message
//! arrives (see [`crate::tag::conflicts`]), not by reducing garbage or
//! waiting for the timeout.
//!
//! ```text
//! bits 14..18 dtype code + 1 (0: none), 10..14 reduce op code + 1 (0: none),
//! 0..10 a hash of the element counts every rank sees alike and the root
//! ```
//!
//! Only what is the same on every rank of a correct call goes in: the
//! per-rank counts of an `all_gather_v` (its output list, alike everywhere)
//! do; an `all_to_all`'s counts, which differ between ranks, do not.
//! (shm's fast path for small ops compares the calls themselves.)

use crate::backend::Op;
use crate::dtype::DType;
use crate::reduce_op::ReduceOp;

/// The shape of `op` (0 for point-to-point ops and barriers).
pub fn of(op: &Op<'_>) -> u32 {
    match op {
        Op::AllReduce { buf, op } => pack(Some(buf.dtype()), Some(*op), &[buf.numel()], None),
        Op::Broadcast { buf, root } => pack(Some(buf.dtype()), None, &[buf.numel()], Some(*root)),
        Op::Reduce { buf, root, op } => pack(Some(buf.dtype()), Some(*op), &[buf.numel()], Some(*root)),
        Op::AllGather { input, outputs } => pack_counts(Some(input.dtype()), None, outputs.iter().map(|o| o.numel())),
        Op::ReduceScatter { inputs, output, op } => pack_counts(Some(output.dtype()), Some(*op), inputs.iter().map(|i| i.numel())),
        Op::AllToAll { outputs, .. } => pack(outputs.first().map(|o| o.dtype()), None, &[], None),
        Op::Gather { input, root, .. } => pack(Some(input.dtype()), None, &[], Some(*root)),
        Op::Scatter { output, root, .. } => pack(Some(output.dtype()), None, &[], Some(*root)),
        // The sparse all-reduce's first step is an agreement on all of it
        // (dtype, shape, op, algorithm), which names every rank's call.
        Op::AllReduceSparse { .. } => 0,
        Op::Send { .. } | Op::Recv { .. } | Op::Batch { .. } | Op::Barrier => 0,
    }
}

/// The dtype a shape names, if any.
pub fn dtype(shape: u32) -> Option<DType> {
    ((shape >> 14) & 0xf).checked_sub(1).and_then(|c| DType::from_code(c as u8))
}

/// The name of the reduce op a shape names, if any.
pub fn reduce_op(shape: u32) -> Option<&'static str> {
    let code = ((shape >> 10) & 0xf).checked_sub(1)?;
    ReduceOp::ALL.iter().find(|o| o.code() as u32 == code).map(|o| o.name())
}

/// What differs between two shapes, readably ("dtype f32 here, f64
/// there"), or None if they agree.
pub fn difference(mine: u32, theirs: u32) -> Option<String> {
    if mine == theirs {
        return None;
    }
    let name = |d: Option<DType>| d.map_or("none".to_string(), |d| d.to_string());
    if dtype(mine) != dtype(theirs) {
        return Some(format!("dtype {} here, {} there", name(dtype(mine)), name(dtype(theirs))));
    }
    if reduce_op(mine) != reduce_op(theirs) {
        return Some(format!("reduce op {} here, {} there", reduce_op(mine).unwrap_or("none"), reduce_op(theirs).unwrap_or("none")));
    }
    Some("element counts or root differ".to_string())
}

/// FNV-1a over `bytes` (also what `WEFT_DEBUG=detail` fingerprints hash).
pub(crate) fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

fn pack(dtype: Option<DType>, op: Option<ReduceOp>, counts: &[usize], root: Option<usize>) -> u32 {
    pack_counts(dtype, op, counts.iter().copied().chain(root.map(|r| usize::MAX - r)))
}

fn pack_counts(dtype: Option<DType>, op: Option<ReduceOp>, counts: impl Iterator<Item = usize>) -> u32 {
    let d = dtype.map_or(0, |d| d as u32 + 1) & 0xf;
    let o = op.map_or(0, |o| o.code() as u32 + 1) & 0xf;
    // FNV-1a over the counts, folded to 10 bits.
    let h = fnv1a(counts.flat_map(|c| (c as u64).to_le_bytes()));
    let h = (h ^ (h >> 10) ^ (h >> 20) ^ (h >> 30) ^ (h >> 40) ^ (h >> 50) ^ (h >> 60)) as u32 & 0x3ff;
    (d << 14) | (o << 10) | h
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::TensorMut;

    fn all_reduce<T: crate::Element + Default>(n: usize, op: ReduceOp) -> u32 {
        let mut v = vec![T::default(); n];
        of(&Op::AllReduce { buf: TensorMut::from(&mut v[..]), op })
    }

    #[test]
    fn what_ranks_must_agree_on_is_in_the_shape() {
        let base = all_reduce::<f32>(16, ReduceOp::Sum);
        assert_eq!(dtype(base), Some(DType::F32));
        assert_eq!(reduce_op(base), Some("sum"));
        // The same bytes as f64, another op, or other counts: another shape.
        let f64s = all_reduce::<f64>(8, ReduceOp::Sum);
        assert_eq!(difference(base, f64s).unwrap(), "dtype f32 here, f64 there");
        let max = all_reduce::<f32>(16, ReduceOp::Max);
        assert_eq!(difference(base, max).unwrap(), "reduce op sum here, max there");
        assert!(difference(base, all_reduce::<f32>(32, ReduceOp::Sum)).unwrap().contains("counts"));
        // 4 MiB against 8 MiB of f32 (counts equal mod 2^16).
        assert_ne!(all_reduce::<f32>(1 << 20, ReduceOp::Sum), all_reduce::<f32>(2 << 20, ReduceOp::Sum));
        assert_eq!(base, all_reduce::<f32>(16, ReduceOp::Sum));
        assert!(base < 1 << crate::tag::SHAPE_BITS);
        assert_eq!(of(&Op::Barrier), 0);
    }
}
