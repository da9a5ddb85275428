//! Kernels over raw byte buffers: elementwise reductions dispatched by dtype
//! (here), copies into op outputs (`copy.rs`), and the algorithms' scratch
//! buffers (`buffers.rs`).
//!
//! The algorithms move bytes; the reductions give the bytes meaning. Buffers
//! are normally aligned for their dtype (user tensors, [`AlignedBuf`]); an
//! unaligned buffer takes a slower per-element path instead of failing.

use crate::dtype::DType;
use crate::reduce_op::ReduceOp;
use half::{bf16, f16};

mod buffers;
mod copy;
pub mod weighted;

pub use buffers::{AlignedBuf, Scratch};
pub use copy::{copy, copy_to_memory, prefetch, slow_copy_distance, STREAM_COPY_BYTES};

/// Arithmetic each element type provides for the reductions.
trait Arith: Copy {
    fn sum(a: Self, b: Self) -> Self;
    fn prod(a: Self, b: Self) -> Self;
    fn min(a: Self, b: Self) -> Self;
    fn max(a: Self, b: Self) -> Self;
    fn band(a: Self, b: Self) -> Self;
    fn bor(a: Self, b: Self) -> Self;
    fn bxor(a: Self, b: Self) -> Self;
    fn scale(a: Self, f: f64) -> Self;
    /// Division by a rank count, rounded once in the element type.
    fn div(a: Self, n: u32) -> Self;
}

macro_rules! int_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn sum(a: Self, b: Self) -> Self { a.wrapping_add(b) }
            fn prod(a: Self, b: Self) -> Self { a.wrapping_mul(b) }
            fn min(a: Self, b: Self) -> Self { Ord::min(a, b) }
            fn max(a: Self, b: Self) -> Self { Ord::max(a, b) }
            fn band(a: Self, b: Self) -> Self { a & b }
            fn bor(a: Self, b: Self) -> Self { a | b }
            fn bxor(a: Self, b: Self) -> Self { a ^ b }
            fn scale(a: Self, _: f64) -> Self { a }
            fn div(a: Self, _: u32) -> Self { a }
        }
    )*};
}
int_arith!(i8, u8, i32, i64, u32, u64);

macro_rules! float_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn sum(a: Self, b: Self) -> Self { a + b }
            fn prod(a: Self, b: Self) -> Self { a * b }
            // NaN propagates: neither comparison holds, so a + b (NaN) is returned.
            fn min(a: Self, b: Self) -> Self { if a <= b { a } else if b < a { b } else { a + b } }
            fn max(a: Self, b: Self) -> Self { if a >= b { a } else if b > a { b } else { a + b } }
            fn band(a: Self, _: Self) -> Self { a }
            fn bor(a: Self, _: Self) -> Self { a }
            fn bxor(a: Self, _: Self) -> Self { a }
            fn scale(a: Self, f: f64) -> Self { (a as f64 * f) as $t }
            fn div(a: Self, n: u32) -> Self { a / n as $t }
        }
    )*};
}
float_arith!(f32, f64);

macro_rules! half_arith {
    ($($t:ty),*) => {$(
        impl Arith for $t {
            fn sum(a: Self, b: Self) -> Self { <$t>::from_f32(a.to_f32() + b.to_f32()) }
            fn prod(a: Self, b: Self) -> Self { <$t>::from_f32(a.to_f32() * b.to_f32()) }
            fn min(a: Self, b: Self) -> Self { <$t>::from_f32(<f32 as Arith>::min(a.to_f32(), b.to_f32())) }
            fn max(a: Self, b: Self) -> Self { <$t>::from_f32(<f32 as Arith>::max(a.to_f32(), b.to_f32())) }
            fn band(a: Self, _: Self) -> Self { a }
            fn bor(a: Self, _: Self) -> Self { a }
            fn bxor(a: Self, _: Self) -> Self { a }
            fn scale(a: Self, f: f64) -> Self { <$t>::from_f64(a.to_f64() * f) }
            fn div(a: Self, n: u32) -> Self { <$t>::from_f32(a.to_f32() / n as f32) }
        }
    )*};
}
half_arith!(f16, bf16);

/// Bool is reduced on its byte; results are always 0 or 1.
#[derive(Copy, Clone)]
struct BoolByte(u8);
impl Arith for BoolByte {
    fn sum(a: Self, b: Self) -> Self {
        Self::bor(a, b)
    }
    fn prod(a: Self, b: Self) -> Self {
        Self::band(a, b)
    }
    fn min(a: Self, b: Self) -> Self {
        Self::band(a, b)
    }
    fn max(a: Self, b: Self) -> Self {
        Self::bor(a, b)
    }
    fn band(a: Self, b: Self) -> Self {
        BoolByte(((a.0 != 0) & (b.0 != 0)) as u8)
    }
    fn bor(a: Self, b: Self) -> Self {
        BoolByte(((a.0 != 0) | (b.0 != 0)) as u8)
    }
    fn bxor(a: Self, b: Self) -> Self {
        BoolByte(((a.0 != 0) ^ (b.0 != 0)) as u8)
    }
    fn scale(a: Self, _: f64) -> Self {
        a
    }
    fn div(a: Self, _: u32) -> Self {
        a
    }
}

/// Apply `f(acc[i], src[i])` into `acc[i]` for buffers of `T`.
fn zip_apply<T: Arith>(acc: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T) {
    let size = std::mem::size_of::<T>();
    let n = acc.len().min(src.len()) / size;
    let aligned = |p: *const u8| (p as usize).is_multiple_of(std::mem::align_of::<T>());
    if aligned(acc.as_ptr()) && aligned(src.as_ptr()) {
        // SAFETY: both buffers hold at least n*size bytes, are aligned for T,
        // do not overlap (one is &mut), and every T here is plain data for
        // which any bit pattern is valid (BoolByte wraps u8, not bool).
        let (a, s) = unsafe {
            (std::slice::from_raw_parts_mut(acc.as_mut_ptr() as *mut T, n), std::slice::from_raw_parts(src.as_ptr() as *const T, n))
        };
        for (x, y) in a.iter_mut().zip(s) {
            *x = f(*x, *y);
        }
    } else {
        for i in 0..n {
            // SAFETY: i*size + size <= len for both; unaligned access is allowed
            // by read/write_unaligned; any bit pattern is a valid T (see above).
            unsafe {
                let pa = acc.as_mut_ptr().add(i * size) as *mut T;
                let pb = src.as_ptr().add(i * size) as *const T;
                pa.write_unaligned(f(pa.read_unaligned(), pb.read_unaligned()));
            }
        }
    }
}

/// Apply `f(x)` to every element of `buf`.
fn map_apply<T: Arith>(buf: &mut [u8], f: impl Fn(T) -> T) {
    let size = std::mem::size_of::<T>();
    for i in 0..buf.len() / size {
        // SAFETY: element i lies inside buf; unaligned access is allowed by
        // read/write_unaligned; any bit pattern is a valid T (see zip_apply).
        unsafe {
            let p = buf.as_mut_ptr().add(i * size) as *mut T;
            p.write_unaligned(f(p.read_unaligned()));
        }
    }
}

macro_rules! by_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F16 => {
                type $T = f16;
                $body
            }
            DType::BF16 => {
                type $T = bf16;
                $body
            }
            DType::I8 => {
                type $T = i8;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::U64 => {
                type $T = u64;
                $body
            }
            DType::Bool => {
                type $T = BoolByte;
                $body
            }
        }
    };
}

/// `acc[i] = acc[i] (op) src[i]` for every element. `Avg` and `PremulSum`
/// combine as `Sum`; apply [`prescale`] / [`finish`] around the reduction.
/// The op must already be checked against the dtype.
pub fn reduce_into(acc: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) {
    debug_assert_eq!(acc.len(), src.len());
    // f16 converts in blocks (hardware F16C); bf16's conversion is a shift
    // that already vectorizes element by element.
    if dtype == DType::F16 && half_blocks(acc, src, dtype, op) {
        return;
    }
    // Each arm passes the function item itself (not a fn pointer), so the
    // loop is monomorphized per op and dtype, inlined and vectorized.
    by_dtype!(dtype, T => match op.combiner() {
        ReduceOp::Sum => zip_apply::<T>(acc, src, T::sum),
        ReduceOp::Product => zip_apply::<T>(acc, src, T::prod),
        ReduceOp::Min => zip_apply::<T>(acc, src, <T as Arith>::min),
        ReduceOp::Max => zip_apply::<T>(acc, src, <T as Arith>::max),
        ReduceOp::Band => zip_apply::<T>(acc, src, T::band),
        ReduceOp::Bor => zip_apply::<T>(acc, src, T::bor),
        ReduceOp::Bxor => zip_apply::<T>(acc, src, T::bxor),
        ReduceOp::Avg | ReduceOp::PremulSum(_) => unreachable!("combiner() maps these to Sum"),
    })
}

/// f16/bf16 in blocks: convert a block of each side to f32 with `half`'s
/// slice conversions (hardware F16C where the CPU has it), combine in f32,
/// convert back. Same results as element by element (f16 -> f32 is exact,
/// and the one rounding back is the same). False if a buffer is unaligned.
fn half_blocks(acc: &mut [u8], src: &[u8], dtype: DType, op: ReduceOp) -> bool {
    use half::slice::HalfFloatSliceExt;
    const BLOCK: usize = 1024;
    let aligned = |p: *const u8| (p as usize).is_multiple_of(2);
    if !aligned(acc.as_ptr()) || !aligned(src.as_ptr()) {
        return false;
    }
    let n = acc.len().min(src.len()) / 2;
    let (mut a32, mut s32) = ([0f32; BLOCK], [0f32; BLOCK]);
    macro_rules! run {
        ($t:ty) => {{
            // SAFETY: both buffers are 2-byte aligned (checked), hold n
            // elements, do not overlap (acc is &mut), and any bit pattern is
            // a valid f16/bf16.
            let (a, s) = unsafe {
                (std::slice::from_raw_parts_mut(acc.as_mut_ptr() as *mut $t, n), std::slice::from_raw_parts(src.as_ptr() as *const $t, n))
            };
            for (ab, sb) in a.chunks_mut(BLOCK).zip(s.chunks(BLOCK)) {
                let k = ab.len();
                ab.convert_to_f32_slice(&mut a32[..k]);
                sb.convert_to_f32_slice(&mut s32[..k]);
                zip_apply_f32(&mut a32[..k], &s32[..k], op);
                ab.convert_from_f32_slice(&a32[..k]);
            }
        }};
    }
    match dtype {
        DType::F16 => run!(f16),
        _ => run!(bf16),
    }
    true
}

fn zip_apply_f32(a: &mut [f32], s: &[f32], op: ReduceOp) {
    macro_rules! each {
        ($f:expr) => {
            a.iter_mut().zip(s).for_each(|(x, y)| *x = $f(*x, *y))
        };
    }
    match op.combiner() {
        ReduceOp::Sum => each!(<f32 as Arith>::sum),
        ReduceOp::Product => each!(<f32 as Arith>::prod),
        ReduceOp::Min => each!(<f32 as Arith>::min),
        ReduceOp::Max => each!(<f32 as Arith>::max),
        // Bitwise ops never reach floats (checked by ReduceOp::check).
        _ => {}
    }
}

/// Scale a rank's own contribution before reducing (`PremulSum`); no-op otherwise.
pub fn prescale(buf: &mut [u8], dtype: DType, op: ReduceOp) {
    if let ReduceOp::PremulSum(f) = op {
        by_dtype!(dtype, T => map_apply::<T>(buf, |x| T::scale(x, f)))
    }
}

/// Finish a reduced result: divide by `world` for `Avg`; no-op otherwise.
pub fn finish(buf: &mut [u8], dtype: DType, op: ReduceOp, world: usize) {
    if op == ReduceOp::Avg {
        let n = world as u32;
        by_dtype!(dtype, T => map_apply::<T>(buf, |x| T::div(x, n)))
    }
}

/// One element of `op`'s identity in `dtype` (what an absent entry means):
/// 0 for SUM, the largest value for MIN, the smallest for MAX.
pub fn identity(dtype: DType, op: ReduceOp) -> Vec<u8> {
    macro_rules! bytes {
        ($v:expr) => {
            $v.to_ne_bytes().to_vec()
        };
    }
    let max = matches!(op.combiner(), ReduceOp::Min | ReduceOp::Band | ReduceOp::Product);
    match (op.combiner(), dtype) {
        (ReduceOp::Sum | ReduceOp::Bor | ReduceOp::Bxor, d) => vec![0; d.size()],
        (ReduceOp::Product, DType::F32) => bytes!(1f32),
        (ReduceOp::Product, DType::F64) => bytes!(1f64),
        (ReduceOp::Product, DType::F16) => bytes!(f16::ONE),
        (ReduceOp::Product, DType::BF16) => bytes!(bf16::ONE),
        (_, DType::F32) => bytes!(if max { f32::INFINITY } else { f32::NEG_INFINITY }),
        (_, DType::F64) => bytes!(if max { f64::INFINITY } else { f64::NEG_INFINITY }),
        (_, DType::F16) => bytes!(if max { f16::INFINITY } else { f16::NEG_INFINITY }),
        (_, DType::BF16) => bytes!(if max { bf16::INFINITY } else { bf16::NEG_INFINITY }),
        (ReduceOp::Product, DType::I8 | DType::U8 | DType::Bool) => vec![1],
        (ReduceOp::Product, DType::I32 | DType::U32) => bytes!(1u32),
        (ReduceOp::Product, DType::I64 | DType::U64) => bytes!(1u64),
        (_, DType::I8) => bytes!(if max { i8::MAX } else { i8::MIN }),
        (_, DType::U8) => bytes!(if max { u8::MAX } else { u8::MIN }),
        (_, DType::Bool) => vec![max as u8],
        (_, DType::I32) => bytes!(if max { i32::MAX } else { i32::MIN }),
        (_, DType::U32) => bytes!(if max { u32::MAX } else { u32::MIN }),
        (_, DType::I64) => bytes!(if max { i64::MAX } else { i64::MIN }),
        (_, DType::U64) => bytes!(if max { u64::MAX } else { u64::MIN }),
    }
}

/// Force every byte of a received bool buffer to 0 or 1, so that bytes from a
/// misbehaving peer can never become an invalid `bool` in user memory.
pub fn sanitize(buf: &mut [u8], dtype: DType) {
    if dtype == DType::Bool {
        for b in buf {
            *b = (*b != 0) as u8;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T>(v: &[T]) -> &[u8] {
        // SAFETY: test helper over plain numeric slices.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
    }
    fn bytes_mut<T>(v: &mut [T]) -> &mut [u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
    }

    #[test]
    fn integer_ops_wrap_and_bitwise() {
        let mut a = [250u8, 3, 0b1100];
        let b = [10u8, 5, 0b1010];
        reduce_into(bytes_mut(&mut a), bytes(&b), DType::U8, ReduceOp::Sum);
        assert_eq!(a, [4, 8, 22]);
        let mut a = [0b1100i32, -7];
        reduce_into(bytes_mut(&mut a), bytes(&[0b1010i32, 2]), DType::I32, ReduceOp::Bxor);
        assert_eq!(a, [0b0110, -7 ^ 2]);
    }

    #[test]
    fn float_min_max_propagate_nan_and_avg_divides() {
        let mut a = [1.0f32, f32::NAN, 3.0];
        reduce_into(bytes_mut(&mut a), bytes(&[2.0f32, 0.0, f32::NAN]), DType::F32, ReduceOp::Min);
        assert_eq!(a[0], 1.0);
        assert!(a[1].is_nan() && a[2].is_nan());
        let mut s = [3.0f64, 9.0];
        finish(bytes_mut(&mut s), DType::F64, ReduceOp::Avg, 3);
        assert_eq!(s, [1.0, 3.0]);
        let mut h = [bf16::from_f32(1.5)];
        prescale(bytes_mut(&mut h), DType::BF16, ReduceOp::PremulSum(2.0));
        assert_eq!(h[0].to_f32(), 3.0);
    }

    #[test]
    fn bool_bytes_are_normalized() {
        let mut a = [0u8, 2, 1, 0];
        reduce_into(&mut a, &[0u8, 0, 7, 1], DType::Bool, ReduceOp::Max);
        assert_eq!(a, [0, 1, 1, 1]);
        let mut b = [5u8, 0];
        sanitize(&mut b, DType::Bool);
        assert_eq!(b, [1, 0]);
    }

    #[test]
    fn half_blocks_match_element_by_element() {
        for dtype in [DType::F16, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Product, ReduceOp::Min, ReduceOp::Max] {
                let vals = |k: usize| -> Vec<f32> { (0..3000).map(|i| ((i * 7 + k) % 97) as f32 * 0.37 - 11.0).collect() };
                let to = |v: &[f32]| -> Vec<u16> {
                    v.iter().map(|x| if dtype == DType::F16 { f16::from_f32(*x).to_bits() } else { bf16::from_f32(*x).to_bits() }).collect()
                };
                let (mut a, b) = (to(&vals(1)), to(&vals(5)));
                let mut slow = a.clone();
                reduce_into(bytes_mut(&mut a), bytes(&b), dtype, op);
                by_dtype!(dtype, T => zip_apply::<T>(bytes_mut(&mut slow), bytes(&b), match op {
                    ReduceOp::Sum => T::sum,
                    ReduceOp::Product => T::prod,
                    ReduceOp::Min => <T as Arith>::min,
                    _ => <T as Arith>::max,
                }));
                assert_eq!(a, slow, "{dtype} {op}");
            }
        }
    }

    #[test]
    fn unaligned_buffers_take_the_slow_path() {
        let mut raw = [0u8; 9];
        raw[1..5].copy_from_slice(&1.5f32.to_ne_bytes());
        raw[5..9].copy_from_slice(&2.0f32.to_ne_bytes());
        let src = [0.5f32, 1.0];
        reduce_into(&mut raw[1..9], bytes(&src), DType::F32, ReduceOp::Sum);
        assert_eq!(f32::from_ne_bytes(raw[1..5].try_into().unwrap()), 2.0);
        assert_eq!(f32::from_ne_bytes(raw[5..9].try_into().unwrap()), 3.0);
    }
}
