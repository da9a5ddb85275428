//! Small all-to-all rounds through the CPU backend, and the check every
//! device all-reduce makes before it touches memory: that every rank
//! reduces the same count, dtype and op (a rank writing by another's count
//! would write past a tensor's end, or a ring would wait for pieces that
//! never come).

use weft::algorithms::{exchange_all, Steps};
use weft::{DType, Error, ReduceOp, Result};

/// One round: every rank's `mine` (the same length on every rank), by rank.
pub fn round(c: &Steps<'_>, step: u32, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    let w = c.size();
    let mut all = vec![vec![0u8; mine.len()]; w];
    all[c.rank()].copy_from_slice(mine);
    let mut recvs: Vec<Vec<&mut [u8]>> = vec![all.iter_mut().map(Vec::as_mut_slice).collect()];
    exchange_all(&c.phase_step(step), &[vec![mine; w]], &mut recvs)?;
    Ok(all)
}

/// What a rank reduces: its element count, and its dtype and op as
/// positions in `DType::ALL` and `ReduceOp::ALL`.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub struct Signature {
    pub count: u64,
    pub kind: u64,
}

impl Signature {
    /// The signature of reducing `count` elements of `dtype` with `op`.
    pub fn of(count: usize, dtype: DType, op: ReduceOp) -> Signature {
        let d = DType::ALL.iter().position(|x| *x == dtype).unwrap_or(usize::MAX);
        let o = ReduceOp::ALL.iter().position(|x| x.name() == op.name()).unwrap_or(usize::MAX);
        Signature { count: count as u64, kind: (d as u64) | ((o as u64) << 8) }
    }
}

/// `InvalidArgument` (alike on every rank, which all see the same
/// signatures) unless every rank's signature equals `mine`.
pub fn same_everywhere(all: &[Signature], mine: Signature, dtype: DType, op: ReduceOp) -> Result<()> {
    let differ = ranks_where(all, |s| *s != mine);
    if differ.is_empty() {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "cuda-device: mismatched all_reduce: this rank reduces {} {dtype} with {}, rank(s) {differ:?} something else",
        mine.count,
        op.name()
    )))
}

/// The ranks (listed) for which `bad` holds.
pub fn ranks_where<T>(all: &[T], bad: impl Fn(&T) -> bool) -> Vec<usize> {
    all.iter().enumerate().filter(|(_, x)| bad(x)).map(|(r, _)| r).collect()
}

/// One round that checks [`same_everywhere`].
pub fn check(c: &Steps<'_>, step: u32, count: usize, dtype: DType, op: ReduceOp) -> Result<()> {
    let mine = Signature::of(count, dtype, op);
    let bytes = [mine.count.to_le_bytes(), mine.kind.to_le_bytes()].concat();
    let word = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    let all: Vec<Signature> = round(c, step, &bytes)?.iter().map(|b| Signature { count: word(&b[..8]), kind: word(&b[8..]) }).collect();
    same_everywhere(&all, mine, dtype, op)
}
