//! Independent reference results, computed without weft: each element is
//! combined in f64 (floats) or i128 (integers) from per-rank input values.

use half::{bf16, f16};
use weft::{DType, ReduceOp};

/// Deterministic test value for (rank, index), small enough that sums and
/// products of up to 8 ranks stay exact in every float type.
pub fn value(dtype: DType, rank: usize, i: usize) -> f64 {
    let v = ((rank * 7 + i * 3) % 5) as f64;
    match dtype {
        DType::Bool => (rank + i).is_multiple_of(3) as u8 as f64,
        d if d.is_float() => v - 2.0 + if (rank + i).is_multiple_of(2) { 0.5 } else { 0.0 },
        DType::U8 | DType::U32 | DType::U64 => v + (i % 3) as f64,
        _ => v - 2.0 + (i % 3) as f64,
    }
}

/// `n` f32 values whose combined bits depend on the order ranks' values
/// meet in: -0.0 on even ranks and +0.0 on odd ones (min and max keep the
/// first), alternating with NaNs whose payload is the rank (a sum or min
/// keeps one of them). A reduction must still leave every rank the same bits.
pub fn order_sensitive(rank: usize, n: usize) -> Vec<f32> {
    let zero = if rank.is_multiple_of(2) { -0.0 } else { 0.0 };
    (0..n).map(|i| if i % 2 == 0 { zero } else { f32::from_bits(0x7fc0_0000 | (rank as u32 + 1)) }).collect()
}

/// Bytes of `n` elements of `dtype` from `value(rank, i)`.
pub fn make(dtype: DType, rank: usize, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dtype.size());
    for i in 0..n {
        push(&mut out, dtype, value(dtype, rank, i));
    }
    out
}

/// `v` as one element of `dtype`.
pub fn encode(dtype: DType, v: f64) -> Vec<u8> {
    let mut out = Vec::new();
    push(&mut out, dtype, v);
    out
}

/// One element of `dtype` as f64.
pub fn decode(dtype: DType, b: &[u8]) -> f64 {
    match dtype {
        DType::F32 => f32::from_ne_bytes(b[..4].try_into().unwrap()) as f64,
        DType::F64 => f64::from_ne_bytes(b[..8].try_into().unwrap()),
        DType::F16 => f16::from_ne_bytes(b[..2].try_into().unwrap()).to_f64(),
        DType::BF16 => bf16::from_ne_bytes(b[..2].try_into().unwrap()).to_f64(),
        DType::I8 => b[0] as i8 as f64,
        DType::U8 => b[0] as f64,
        DType::I32 => i32::from_ne_bytes(b[..4].try_into().unwrap()) as f64,
        DType::I64 => i64::from_ne_bytes(b[..8].try_into().unwrap()) as f64,
        DType::U32 => u32::from_ne_bytes(b[..4].try_into().unwrap()) as f64,
        DType::U64 => u64::from_ne_bytes(b[..8].try_into().unwrap()) as f64,
        DType::Bool => (b[0] != 0) as u8 as f64,
    }
}

fn push(out: &mut Vec<u8>, dtype: DType, v: f64) {
    match dtype {
        DType::F32 => out.extend((v as f32).to_ne_bytes()),
        DType::F64 => out.extend(v.to_ne_bytes()),
        DType::F16 => out.extend(f16::from_f64(v).to_ne_bytes()),
        DType::BF16 => out.extend(bf16::from_f64(v).to_ne_bytes()),
        DType::I8 => out.extend((v as i8).to_ne_bytes()),
        DType::U8 => out.extend((v as u8).to_ne_bytes()),
        DType::I32 => out.extend((v as i32).to_ne_bytes()),
        DType::I64 => out.extend((v as i64).to_ne_bytes()),
        DType::U32 => out.extend((v as u32).to_ne_bytes()),
        DType::U64 => out.extend((v as u64).to_ne_bytes()),
        DType::Bool => out.push((v != 0.0) as u8),
    }
}

/// The expected reduction over `ranks` of element `i`, encoded as bytes.
pub fn reduced(dtype: DType, op: ReduceOp, ranks: usize, i: usize) -> Vec<u8> {
    let vals: Vec<f64> = (0..ranks).map(|r| value(dtype, r, i)).collect();
    let ints: Vec<i128> = vals.iter().map(|v| *v as i128).collect();
    let v = if dtype == DType::Bool {
        let b: Vec<bool> = vals.iter().map(|v| *v != 0.0).collect();
        let r = match op {
            ReduceOp::Sum | ReduceOp::Max | ReduceOp::Bor => b.iter().any(|x| *x),
            ReduceOp::Product | ReduceOp::Min | ReduceOp::Band => b.iter().all(|x| *x),
            ReduceOp::Bxor => b.iter().filter(|x| **x).count() % 2 == 1,
            _ => panic!("{op} on bool"),
        };
        r as u8 as f64
    } else if dtype.is_float() {
        match op {
            ReduceOp::Sum => vals.iter().sum(),
            ReduceOp::Product => vals.iter().product(),
            ReduceOp::Min => vals.iter().cloned().fold(f64::INFINITY, f64::min),
            ReduceOp::Max => vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
            // The exact sum, rounded to the dtype, then divided in the dtype.
            ReduceOp::Avg => {
                let sum: f64 = vals.iter().sum();
                return match dtype {
                    DType::F64 => (sum / ranks as f64).to_ne_bytes().to_vec(),
                    DType::F32 => (sum as f32 / ranks as f32).to_ne_bytes().to_vec(),
                    DType::F16 => f16::from_f32(f16::from_f64(sum).to_f32() / ranks as f32).to_ne_bytes().to_vec(),
                    _ => bf16::from_f32(bf16::from_f64(sum).to_f32() / ranks as f32).to_ne_bytes().to_vec(),
                };
            }
            ReduceOp::PremulSum(f) => vals.iter().map(|v| v * f).sum(),
            _ => panic!("{op} on float"),
        }
    } else {
        let bits = dtype.size() as u32 * 8;
        let signed = matches!(dtype, DType::I8 | DType::I32 | DType::I64);
        let r: i128 = match op {
            ReduceOp::Sum => ints.iter().sum(),
            ReduceOp::Product => ints.iter().product(),
            ReduceOp::Min => *ints.iter().min().unwrap(),
            ReduceOp::Max => *ints.iter().max().unwrap(),
            ReduceOp::Band => ints.iter().fold(-1, |a, b| a & b),
            ReduceOp::Bor => ints.iter().fold(0, |a, b| a | b),
            ReduceOp::Bxor => ints.iter().fold(0, |a, b| a ^ b),
            _ => panic!("{op} on integer"),
        };
        // Wrap to the dtype's width.
        let m = 1i128 << bits;
        let mut w = r.rem_euclid(m);
        if signed && w >= m / 2 {
            w -= m;
        }
        w as f64
    };
    let mut out = Vec::new();
    push(&mut out, dtype, v);
    out
}

/// Expected bytes of a whole reduced tensor of `n` elements.
pub fn reduced_tensor(dtype: DType, op: ReduceOp, ranks: usize, n: usize) -> Vec<u8> {
    (0..n).flat_map(|i| reduced(dtype, op, ranks, i)).collect()
}
