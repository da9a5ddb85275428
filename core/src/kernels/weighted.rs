//! Weighted sums, scaled copies and dot products of rows of floats,
//! computed wider than they are stored (f32 for f32, f16 and bf16; f64 for
//! f64): what a mixture of experts' combine and its backward pass compute
//! (`crate::moe`). Half-precision rows convert in blocks: float16 with
//! `half`'s slice conversions (F16C where the CPU has it), bfloat16 with
//! the bit shifts and rounding below, which vectorize.

use crate::dtype::DType;
use crate::error::{Error, Result};
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Elements converted at a time.
const BLOCK: usize = 512;

/// Evaluates `$body` compiled for AVX2, FMA and F16C where the CPU has
/// them (checked once), else for the baseline: the wheel is built for any
/// x86-64, and these loops (half-precision conversions above all) run 4
/// to 8 times the elements per instruction with them.
macro_rules! wide {
    ($body:expr) => {{
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn wide<R>(f: impl FnOnce() -> R) -> R {
                f()
            }
            if has_wide() {
                // SAFETY: the CPU has AVX2, FMA and F16C (`has_wide`).
                return unsafe {
                    wide(
                        #[inline(always)]
                        || $body,
                    )
                };
            }
        }
        $body
    }};
}

/// Whether the CPU has AVX2, FMA and F16C (asked once).
#[cfg(target_arch = "x86_64")]
fn has_wide() -> bool {
    static WIDE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *WIDE.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"))
}

/// A buffer of sums for rows of `dtype`.
pub enum WeightedSum {
    /// For f32, f16 and bf16 rows.
    F32(Vec<f32>, DType),
    /// For f64 rows.
    F64(Vec<f64>),
}

impl WeightedSum {
    /// `n` zeros for rows of `dtype`; `InvalidArgument` for a dtype that
    /// is not a float.
    pub fn zeros(dtype: DType, n: usize) -> Result<WeightedSum> {
        require_float(dtype)?;
        Ok(if dtype == DType::F64 { WeightedSum::F64(vec![0.0; n]) } else { WeightedSum::F32(vec![0.0; n], dtype) })
    }

    /// Set every sum back to zero.
    pub fn clear(&mut self) {
        match self {
            WeightedSum::F32(acc, _) => acc.fill(0.0),
            WeightedSum::F64(acc) => acc.fill(0.0),
        }
    }

    /// Add `w * row` to the sums from element `at` on (`row`: bytes of
    /// this buffer's dtype, little-endian).
    pub fn add(&mut self, at: usize, row: &[u8], w: f64) {
        wide!(self.add_body(at, row, w))
    }

    #[inline(always)]
    fn add_body(&mut self, at: usize, row: &[u8], w: f64) {
        match self {
            WeightedSum::F64(acc) => f64_each(row, |i, x| acc[at + i] += w * x),
            WeightedSum::F32(acc, dtype) => {
                let w = w as f32;
                f32_blocks(
                    row,
                    *dtype,
                    #[inline(always)]
                    |i, xs| acc[at + i..at + i + xs.len()].iter_mut().zip(xs).for_each(|(a, x)| *a += w * x),
                );
            }
        }
    }

    /// Write the sums from element `at` on into `out` (as many as it
    /// holds), rounded to the dtype.
    pub fn write(&self, at: usize, out: &mut [u8]) {
        wide!(self.write_body(at, out))
    }

    #[inline(always)]
    fn write_body(&self, at: usize, out: &mut [u8]) {
        match self {
            WeightedSum::F64(acc) => {
                for (a, c) in acc[at..].iter().zip(out.chunks_exact_mut(8)) {
                    c.copy_from_slice(&a.to_le_bytes());
                }
            }
            WeightedSum::F32(acc, dtype) => {
                let n = (out.len() / dtype.size()).min(acc.len() - at);
                store_f32(&mut out[..n * dtype.size()], *dtype, &acc[at..at + n]);
            }
        }
    }
}

/// `out = w * row`, and the dot product of `row` and `other`, in one pass
/// (all rows of `dtype`, a float): a combine's backward pass, for one
/// expert's row. The dot product sums in f32 (f64 for f64) per block and
/// in f64 across blocks.
pub fn scale_and_dot(out: &mut [u8], row: &[u8], other: &[u8], dtype: DType, w: f64) -> f64 {
    wide!(scale_and_dot_body(out, row, other, dtype, w))
}

#[inline(always)]
fn scale_and_dot_body(out: &mut [u8], row: &[u8], other: &[u8], dtype: DType, w: f64) -> f64 {
    let mut total = 0.0;
    if dtype == DType::F64 {
        f64_each(row, |i, x| {
            out[8 * i..8 * i + 8].copy_from_slice(&(w * x).to_le_bytes());
            total += x * f64::from_le_bytes(bytes8(&other[8 * i..8 * i + 8]));
        });
        return total;
    }
    let (w, size) = (w as f32, dtype.size());
    let mut scaled = [0f32; BLOCK];
    f32_blocks(
        row,
        dtype,
        #[inline(always)]
        |i, xs| {
            let (at, end) = (i * size, (i + xs.len()) * size);
            // (An aligned f32 row comes as one block, longer than `scaled`.)
            for (j, part) in xs.chunks(BLOCK).enumerate() {
                for (s, x) in scaled.iter_mut().zip(part) {
                    *s = w * x;
                }
                let from = at + j * BLOCK * size;
                store_f32(&mut out[from..from + part.len() * size], dtype, &scaled[..part.len()]);
            }
            f32_blocks(
                &other[at..end],
                dtype,
                #[inline(always)]
                |_, ys| total += f64::from(dot(xs, ys)),
            );
        },
    );
    total
}

/// The dot product of `xs` and `ys` in f32, summed in [`LANES`] partial
/// sums: one running sum is a chain of dependent adds the compiler may not
/// reorder, several are vector registers it fills in parallel.
#[inline(always)]
fn dot(xs: &[f32], ys: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (xc, yc) = (xs.chunks_exact(LANES), ys.chunks_exact(LANES));
    let tail: f32 = xc.remainder().iter().zip(yc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in xc.zip(yc) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Partial sums of a dot product: four AVX registers of f32.
const LANES: usize = 32;

/// `InvalidArgument` unless `dtype` is a float (what every function here
/// takes).
pub fn require_float(dtype: DType) -> Result<()> {
    if dtype.is_float() {
        return Ok(());
    }
    Err(Error::invalid(format!("rows must be floats (float32, float64, float16, bfloat16), not {dtype}")))
}

/// Call `f(i, x)` for each element of a row of f64.
#[inline(always)]
fn f64_each(row: &[u8], mut f: impl FnMut(usize, f64)) {
    match typed::<f64>(row) {
        Some(r) => r.iter().enumerate().for_each(|(i, x)| f(i, *x)),
        None => row.chunks_exact(8).enumerate().for_each(|(i, c)| f(i, f64::from_le_bytes(bytes8(c)))),
    }
}

/// Call `f(start, values)` on successive blocks of a row of f32, f16 or
/// bf16, as f32 (an aligned row of f32 as one block, without a copy).
#[inline(always)]
fn f32_blocks(row: &[u8], dtype: DType, mut f: impl FnMut(usize, &[f32])) {
    if dtype == DType::F32 {
        if let Some(r) = typed::<f32>(row) {
            return f(0, r);
        }
    }
    let size = dtype.size();
    let n = row.len() / size;
    let mut buf = [0f32; BLOCK];
    let mut at = 0;
    while at < n {
        let k = BLOCK.min(n - at);
        let bytes = &row[at * size..(at + k) * size];
        let out = &mut buf[..k];
        match dtype {
            DType::BF16 if typed::<u16>(bytes).is_some() => {
                out.iter_mut().zip(typed::<u16>(bytes).expect("aligned")).for_each(|(o, b)| *o = bf16_to_f32(*b))
            }
            DType::F16 if typed::<f16>(bytes).is_some() => typed::<f16>(bytes).expect("aligned").convert_to_f32_slice(out),
            _ => out.iter_mut().zip(bytes.chunks_exact(size)).for_each(|(o, c)| *o = scalar(dtype, c)),
        }
        f(at, out);
        at += k;
    }
}

/// One element of f32, f16 or bf16 as f32.
#[inline(always)]
fn scalar(dtype: DType, c: &[u8]) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
        DType::BF16 => bf16_to_f32(u16::from_le_bytes([c[0], c[1]])),
        _ => f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32(),
    }
}

/// Store `xs` into `out` as `dtype` (f32, f16 or bf16), rounding.
#[inline(always)]
fn store_f32(out: &mut [u8], dtype: DType, xs: &[f32]) {
    match dtype {
        DType::F32 => out.chunks_exact_mut(4).zip(xs).for_each(|(c, x)| c.copy_from_slice(&x.to_le_bytes())),
        DType::BF16 if typed_mut::<u16>(out).is_some() => {
            typed_mut::<u16>(out).expect("aligned").iter_mut().zip(xs).for_each(|(o, x)| *o = f32_to_bf16(*x))
        }
        DType::F16 if typed_mut::<f16>(out).is_some() => typed_mut::<f16>(out).expect("aligned").convert_from_f32_slice(xs),
        d => out.chunks_exact_mut(2).zip(xs).for_each(|(c, x)| {
            let bits = if d == DType::BF16 { f32_to_bf16(*x) } else { f16::from_f32(*x).to_bits() };
            c.copy_from_slice(&bits.to_le_bytes());
        }),
    }
}

/// A bfloat16's value: its bits are a float32's upper half. (This and
/// [`f32_to_bf16`] compile to vector shifts and blends; `half`'s slice
/// conversions, a branch per element, left `scale_and_dot` at half the
/// speed: bench/RESULTS.md, seventh session.)
#[inline(always)]
fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// `x` rounded to the nearest bfloat16, ties to even (a NaN stays a quiet
/// NaN), as `half::bf16::from_f32`.
#[inline(always)]
fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16;
    let nan = (b >> 16) | 0x40;
    (if b & 0x7FFF_FFFF > 0x7F80_0000 { nan } else { rounded }) as u16
}

#[inline(always)]
fn bytes8(c: &[u8]) -> [u8; 8] {
    [c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]
}

/// Float types: every bit pattern is a value.
trait Plain: Copy {}
impl Plain for f32 {}
impl Plain for f64 {}
impl Plain for f16 {}
impl Plain for u16 {}

/// `bytes` as a slice of `T`, where it is aligned for `T` (it is when it
/// starts a row of a buffer of `T`s, as everywhere here).
#[inline(always)]
fn typed<T: Plain>(bytes: &[u8]) -> Option<&[T]> {
    // SAFETY: every bit pattern is a valid `T` (`Plain`: floats), and
    // align_to only yields the aligned middle, whose bytes it covers.
    let (head, body, tail) = unsafe { bytes.align_to::<T>() };
    (head.is_empty() && tail.is_empty()).then_some(body)
}

/// As [`typed`], writable.
#[inline(always)]
fn typed_mut<T: Plain>(bytes: &mut [u8]) -> Option<&mut [T]> {
    // SAFETY: as in `typed`; any `T` written leaves valid bytes.
    let (head, body, tail) = unsafe { bytes.align_to_mut::<T>() };
    (head.is_empty() && tail.is_empty()).then_some(body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::bf16;

    fn enc(dtype: DType, v: &[f32]) -> Vec<u8> {
        v.iter()
            .flat_map(|x| match dtype {
                DType::F32 => x.to_le_bytes().to_vec(),
                DType::F64 => f64::from(*x).to_le_bytes().to_vec(),
                DType::F16 => f16::from_f32(*x).to_bits().to_le_bytes().to_vec(),
                _ => bf16::from_f32(*x).to_bits().to_le_bytes().to_vec(),
            })
            .collect()
    }

    const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

    #[test]
    fn bfloat16_conversions_agree_with_half() {
        for bits in 0..=u16::MAX {
            let (ours, theirs) = (bf16_to_f32(bits), bf16::from_bits(bits).to_f32());
            assert!(ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan()), "{bits:#x}");
        }
        // Every bf16 value, the ties and neighbours around it, and specials.
        let mut xs = vec![f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, f32::MAX, f32::MIN, f32::MIN_POSITIVE, 0.0, -0.0];
        for bits in (0..=u32::MAX).step_by(0x3FFF) {
            xs.push(f32::from_bits(bits));
        }
        for hi in 0..=u16::MAX {
            let b = u32::from(hi) << 16;
            xs.extend([b, b | 0x7FFF, b | 0x8000, b | 0x8001, b | 0xFFFF].map(f32::from_bits));
        }
        for x in xs {
            let (ours, theirs) = (f32_to_bf16(x), bf16::from_f32(x).to_bits());
            assert!(
                ours == theirs || (x.is_nan() && bf16_to_f32(ours).is_nan()),
                "{x:e} ({:#x}): {ours:#x} against {theirs:#x}",
                x.to_bits()
            );
        }
    }

    #[test]
    fn sums_in_each_float_dtype_aligned_or_not() {
        // Longer than a block, so that blocks join up.
        let row: Vec<f32> = (0..BLOCK + 7).map(|i| (i % 9) as f32 - 4.0).collect();
        for dtype in FLOATS {
            let r = enc(dtype, &row);
            // The same row one byte off its alignment.
            let mut shifted = vec![0u8; r.len() + 1];
            shifted[1..].copy_from_slice(&r);
            for bytes in [&r[..], &shifted[1..]] {
                let mut s = WeightedSum::zeros(dtype, row.len() + 1).unwrap();
                s.add(1, bytes, 2.0);
                s.add(1, bytes, 0.5);
                let mut out = vec![0u8; (row.len() + 1) * dtype.size()];
                s.write(0, &mut out);
                let want: Vec<f32> = std::iter::once(0.0).chain(row.iter().map(|x| 2.5 * x)).collect();
                assert_eq!(out, enc(dtype, &want), "{dtype}");
                s.clear();
                s.write(0, &mut out);
                assert_eq!(out, enc(dtype, &vec![0.0; row.len() + 1]), "{dtype}");
            }
        }
        assert!(WeightedSum::zeros(DType::I32, 1).is_err());
    }

    #[test]
    fn scaled_copies_and_dot_products() {
        let a: Vec<f32> = (0..BLOCK + 3).map(|i| (i % 5) as f32 - 2.0).collect();
        let b: Vec<f32> = (0..BLOCK + 3).map(|i| (i % 3) as f32).collect();
        let want_dot: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(x * y)).sum();
        for dtype in FLOATS {
            let (ab, bb) = (enc(dtype, &a), enc(dtype, &b));
            let mut out = vec![0u8; ab.len()];
            assert_eq!(scale_and_dot(&mut out, &ab, &bb, dtype, 1.5), want_dot, "{dtype}");
            assert_eq!(out, enc(dtype, &a.iter().map(|x| 1.5 * x).collect::<Vec<_>>()), "{dtype}");
        }
    }
}
