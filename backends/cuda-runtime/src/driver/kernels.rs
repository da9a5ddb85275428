//! The CUDA C source of the reduction kernels, compiled once per process
//! with NVRTC: one `weft_reduce_<dtype>_<op>` per dtype and op, plus
//! `weft_premul_<dtype>` and `weft_divide_<dtype>` for floats.
//!
//! f16 and bf16 are carried as their 16-bit patterns and converted with
//! inline PTX / bit arithmetic, so no CUDA header is needed at run time.

use weft::{DType, ReduceOp};

/// The kernel name for `dst (op)= src` in `dtype`.
pub fn reduce_name(dtype: DType, op: ReduceOp) -> String {
    let op = match op.combiner() {
        ReduceOp::Sum => "sum",
        ReduceOp::Product => "prod",
        ReduceOp::Min => "min",
        ReduceOp::Max => "max",
        ReduceOp::Band => "band",
        ReduceOp::Bor => "bor",
        ReduceOp::Bxor => "bxor",
        ReduceOp::Avg | ReduceOp::PremulSum(_) => unreachable!("combiner() maps these to sum"),
    };
    format!("weft_reduce_{}_{op}", dtype.name())
}

/// (dtype, storage type, compute type, load, store) for each dtype.
fn types() -> Vec<(DType, &'static str, &'static str, &'static str, &'static str)> {
    vec![
        (DType::F32, "float", "float", "x", "x"),
        (DType::F64, "double", "double", "x", "x"),
        (DType::F16, "unsigned short", "float", "h2f(x)", "f2h(x)"),
        (DType::BF16, "unsigned short", "float", "b2f(x)", "f2b(x)"),
        (DType::I8, "signed char", "int", "x", "(signed char)(x)"),
        (DType::U8, "unsigned char", "unsigned int", "x", "(unsigned char)(x)"),
        (DType::I32, "int", "int", "x", "x"),
        (DType::I64, "long long", "long long", "x", "x"),
        (DType::U32, "unsigned int", "unsigned int", "x", "x"),
        (DType::U64, "unsigned long long", "unsigned long long", "x", "x"),
        (DType::Bool, "unsigned char", "unsigned int", "(x != 0)", "(unsigned char)(x != 0)"),
    ]
}

const PRELUDE: &str = r#"
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float b2f(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ unsigned short f2b(float f) {
    unsigned int x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (unsigned short)(x >> 16);
}
template <typename T> __device__ __forceinline__ T wmin(T a, T b) { return (a != a || a < b) ? a : b; }
template <typename T> __device__ __forceinline__ T wmax(T a, T b) { return (a != a || a > b) ? a : b; }
"#;

/// The whole module's source.
pub fn source() -> String {
    let mut s = String::from(PRELUDE);
    for (dtype, store, compute, load, save) in types() {
        let float = dtype.is_float();
        let ops: Vec<(&str, &str)> = if dtype == DType::Bool {
            vec![
                ("sum", "a | b"),
                ("prod", "a & b"),
                ("min", "a & b"),
                ("max", "a | b"),
                ("band", "a & b"),
                ("bor", "a | b"),
                ("bxor", "a ^ b"),
            ]
        } else if float {
            vec![("sum", "a + b"), ("prod", "a * b"), ("min", "wmin(a, b)"), ("max", "wmax(a, b)")]
        } else {
            vec![
                ("sum", "a + b"),
                ("prod", "a * b"),
                ("min", "wmin(a, b)"),
                ("max", "wmax(a, b)"),
                ("band", "a & b"),
                ("bor", "a | b"),
                ("bxor", "a ^ b"),
            ]
        };
        let name = dtype.name();
        let grid_loop = "for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; \
                         i += (unsigned long long)gridDim.x * blockDim.x)";
        s += &format!(
            "__device__ __forceinline__ {compute} ld_{name}({store} x) {{ return ({compute})({load}); }}\n\
             __device__ __forceinline__ {store} st_{name}({compute} x) {{ return {save}; }}\n"
        );
        for (op, expr) in ops {
            s += &format!(
                "extern \"C\" __global__ void weft_reduce_{name}_{op}({store}* dst, const {store}* src, unsigned long long n) {{\n\
                 {grid_loop} {{ {compute} a = ld_{name}(dst[i]), b = ld_{name}(src[i]); dst[i] = st_{name}({expr}); }} }}\n"
            );
        }
        if float {
            s += &format!(
                "extern \"C\" __global__ void weft_premul_{name}({store}* buf, double f, unsigned long long n) {{\n\
                 {grid_loop} {{ buf[i] = st_{name}(({compute})((double)ld_{name}(buf[i]) * f)); }} }}\n\
                 extern \"C\" __global__ void weft_divide_{name}({store}* buf, unsigned int d, unsigned long long n) {{\n\
                 {grid_loop} {{ buf[i] = st_{name}(ld_{name}(buf[i]) / ({compute})d); }} }}\n"
            );
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reduce_kernel_is_in_the_source() {
        let src = source();
        for d in DType::ALL {
            for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(d)) {
                assert!(src.contains(&format!("void {}(", reduce_name(d, op))), "{d} {op}");
            }
        }
    }
}

#[cfg(test)]
mod nvrtc_tests {
    /// Compiles the kernels to PTX where NVRTC is installed (no GPU needed);
    /// `WEFT_REQUIRE_NVRTC=1` makes its absence a failure (scripts/gpu-tests.sh, CI).
    #[test]
    fn kernels_compile_with_nvrtc() {
        // SAFETY: only tries to dlopen libnvrtc.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            assert!(std::env::var("WEFT_REQUIRE_NVRTC").as_deref() != Ok("1"), "NVRTC is required but not installed");
            return;
        }
        let ptx = cudarc::nvrtc::compile_ptx(super::source()).unwrap_or_else(|e| panic!("{e:?}")).to_src();
        for d in weft::DType::ALL {
            for op in weft::ReduceOp::ALL.into_iter().filter(|op| op.supports(d)) {
                assert!(ptx.contains(&super::reduce_name(d, op)), "{d} {op}");
            }
        }
    }
}
