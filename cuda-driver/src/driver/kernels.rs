//! The CUDA C source of weft's kernels, each compiled with NVRTC the first
//! time a process launches it (one module per kernel: the whole set takes
//! seconds to compile, one kernel a fraction of that):
//! `weft_reduce_<dtype>_<op>` (`dst (op)= src`) and
//! `weft_reduce_all_<dtype>_<op>` (many sources into many destinations) per
//! dtype and op, plus `weft_premul_<dtype>` and `weft_divide_<dtype>` for
//! floats, and the device-side hand-offs `weft_signal` and `weft_wait_flag`.
//!
//! f16 and bf16 are carried as their 16-bit patterns and converted with
//! inline PTX / bit arithmetic, so no CUDA header is needed at run time.

use weft::{DType, ReduceOp};

/// One kernel: its name and the definition that follows the prelude and its
/// dtype's helpers.
pub struct Kernel {
    /// The `extern "C"` name.
    pub name: String,
    dtype: DType,
    body: String,
}

/// The kernel argument of `reduce_all` holding its pointers, by value.
#[repr(C)]
pub struct Pointers(pub [u64; crate::gpu::MAX_REDUCE_ALL]);

const GRID_LOOP: &str = "for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n; \
                         i += (unsigned long long)gridDim.x * blockDim.x)";

impl Kernel {
    /// `dst (op)= src` in `dtype` (`Avg` and `PremulSum` as sums).
    pub fn reduce(dtype: DType, op: ReduceOp) -> Kernel {
        let (name, t) = (format!("weft_reduce_{}_{}", dtype.name(), op_name(op)), types(dtype));
        let (store, compute, d, expr) = (t.store, t.compute, dtype.name(), combine(dtype, op));
        let body = format!(
            "extern \"C\" __global__ void {name}({store}* dst, const {store}* src, unsigned long long n) {{\n\
             {GRID_LOOP} {{ {compute} a = ld_{d}(dst[i]), b = ld_{d}(src[i]); dst[i] = st_{d}({expr}); }} }}\n"
        );
        Kernel { name, dtype, body }
    }

    /// Every destination gets the reduction of every source (`reduce_all`).
    pub fn reduce_all(dtype: DType, op: ReduceOp) -> Kernel {
        let (name, t) = (format!("weft_reduce_all_{}_{}", dtype.name(), op_name(op)), types(dtype));
        let (store, compute, d, expr) = (t.store, t.compute, dtype.name(), combine(dtype, op));
        let body = format!(
            "extern \"C\" __global__ void {name}(Pointers src, Pointers dst, unsigned ns, unsigned nd, unsigned long long n, unsigned avg) {{\n\
             reduce_all<{store}, {compute}>(src, dst, ns, nd, n, avg != 0, []({store} x) {{ return ld_{d}(x); }}, \
             []({compute} x) {{ return st_{d}(x); }}, []({compute} a, {compute} b) {{ return {expr}; }}); }}\n"
        );
        Kernel { name, dtype, body }
    }

    /// `buf[i] *= f` (float dtypes).
    pub fn premul(dtype: DType) -> Kernel {
        let (name, t, d) = (format!("weft_premul_{}", dtype.name()), types(dtype), dtype.name());
        let (store, compute) = (t.store, t.compute);
        let body = format!(
            "extern \"C\" __global__ void {name}({store}* buf, double f, unsigned long long n) {{\n\
             {GRID_LOOP} {{ buf[i] = st_{d}(({compute})((double)ld_{d}(buf[i]) * f)); }} }}\n"
        );
        Kernel { name, dtype, body }
    }

    /// A rank's hand-off, on the device ([`crate::Gpu::signal`]): one
    /// thread; the fence makes the stream's earlier writes visible to other
    /// devices and processes before the flag says so.
    pub fn signal() -> Kernel {
        let body = "extern \"C\" __global__ void weft_signal(unsigned long long* counter, unsigned long long* flag, unsigned advance) {\n\
                    if (blockIdx.x != 0 || threadIdx.x != 0) return;\n\
                    unsigned long long c = *(volatile unsigned long long*)counter;\n\
                    if (advance) { c += 1; *(volatile unsigned long long*)counter = c; }\n\
                    __threadfence_system();\n\
                    *(volatile unsigned long long*)flag = c;\n\
                    __threadfence_system(); }\n";
        Kernel { name: "weft_signal".into(), dtype: DType::U64, body: body.into() }
    }

    /// Wait on the device for another rank's flag ([`crate::Gpu::wait_flag`]):
    /// one thread spins on the (mapped) word; past `limit` nanoseconds of
    /// the global timer it traps, failing the stream instead of holding it
    /// forever.
    pub fn wait_flag() -> Kernel {
        let body = "extern \"C\" __global__ void weft_wait_flag(const unsigned long long* counter, const unsigned long long* flag, unsigned long long limit) {\n\
                    if (blockIdx.x != 0 || threadIdx.x != 0) return;\n\
                    const unsigned long long want = *(volatile const unsigned long long*)counter;\n\
                    unsigned long long start, now;\n\
                    asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(start));\n\
                    while (*(volatile const unsigned long long*)flag < want) {\n\
                    asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(now));\n\
                    if (now - start > limit) __trap(); }\n\
                    __threadfence_system(); }\n";
        Kernel { name: "weft_wait_flag".into(), dtype: DType::U64, body: body.into() }
    }

    /// `buf[i] /= d` (float dtypes).
    pub fn divide(dtype: DType) -> Kernel {
        let (name, t, d) = (format!("weft_divide_{}", dtype.name()), types(dtype), dtype.name());
        let (store, compute) = (t.store, t.compute);
        let body = format!(
            "extern \"C\" __global__ void {name}({store}* buf, unsigned int d, unsigned long long n) {{\n\
             {GRID_LOOP} {{ buf[i] = st_{d}(ld_{d}(buf[i]) / ({compute})d); }} }}\n"
        );
        Kernel { name, dtype, body }
    }
}

fn op_name(op: ReduceOp) -> &'static str {
    match op.combiner() {
        ReduceOp::Sum => "sum",
        ReduceOp::Product => "prod",
        ReduceOp::Min => "min",
        ReduceOp::Max => "max",
        ReduceOp::Band => "band",
        ReduceOp::Bor => "bor",
        ReduceOp::Bxor => "bxor",
        ReduceOp::Avg | ReduceOp::PremulSum(_) => unreachable!("combiner() maps these to sum"),
    }
}

/// `op` on two compute-type values `a` and `b` of `dtype` (bool: as logic).
fn combine(dtype: DType, op: ReduceOp) -> &'static str {
    match (op.combiner(), dtype == DType::Bool) {
        (ReduceOp::Sum | ReduceOp::Max | ReduceOp::Bor, true) => "a | b",
        (ReduceOp::Product | ReduceOp::Min | ReduceOp::Band, true) => "a & b",
        (ReduceOp::Sum, false) => "a + b",
        (ReduceOp::Product, false) => "a * b",
        (ReduceOp::Min, false) => "wmin(a, b)",
        (ReduceOp::Max, false) => "wmax(a, b)",
        (ReduceOp::Band, false) => "a & b",
        (ReduceOp::Bor, false) => "a | b",
        (_, _) => "a ^ b",
    }
}

/// How a dtype is stored and computed in: types, and the load and store
/// conversions of `x`.
struct Types {
    store: &'static str,
    compute: &'static str,
    load: &'static str,
    save: &'static str,
}

fn types(dtype: DType) -> Types {
    let t = |store, compute, load, save| Types { store, compute, load, save };
    match dtype {
        DType::F32 => t("float", "float", "x", "x"),
        DType::F64 => t("double", "double", "x", "x"),
        DType::F16 => t("unsigned short", "float", "h2f(x)", "f2h(x)"),
        DType::BF16 => t("unsigned short", "float", "b2f(x)", "f2b(x)"),
        DType::I8 => t("signed char", "int", "x", "(signed char)(x)"),
        DType::U8 => t("unsigned char", "unsigned int", "x", "(unsigned char)(x)"),
        DType::I32 => t("int", "int", "x", "x"),
        DType::I64 => t("long long", "long long", "x", "x"),
        DType::U32 => t("unsigned int", "unsigned int", "x", "x"),
        DType::U64 => t("unsigned long long", "unsigned long long", "x", "x"),
        DType::Bool => t("unsigned char", "unsigned int", "(x != 0)", "(unsigned char)(x != 0)"),
    }
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

// reduce_all: every destination gets the reduction of every source, in
// source order, computed in C and stored as S once. 16 bytes per thread and
// pointer where all pointers are 16-byte aligned (the loads of all sources
// in flight at once), then one element per thread for the rest. Loops over
// pointers are unrolled to 8 so the pointers stay in registers.
struct Pointers { unsigned long long p[8]; };
template <typename S, typename C, typename LD, typename ST, typename OP>
__device__ __forceinline__ void reduce_all(const Pointers& src, const Pointers& dst, unsigned ns, unsigned nd,
                                           unsigned long long n, bool avg, LD ld, ST st, OP op) {
    constexpr unsigned V = 16 / sizeof(S);
    union Lanes { uint4 u; S e[V]; };
    unsigned long long bits = 0;
#pragma unroll
    for (unsigned k = 0; k < 8; k++) {
        if (k < ns) bits |= src.p[k];
        if (k < nd) bits |= dst.p[k];
    }
    const unsigned long long nv = (bits & 15) ? 0 : n / V;
    const unsigned long long first = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long v = first; v < nv; v += stride) {
        Lanes in[8];
#pragma unroll
        for (unsigned k = 0; k < 8; k++) if (k < ns) in[k].u = ((const uint4*)src.p[k])[v];
        C acc[V];
#pragma unroll
        for (unsigned j = 0; j < V; j++) acc[j] = ld(in[0].e[j]);
#pragma unroll
        for (unsigned k = 1; k < 8; k++) {
            if (k < ns) {
#pragma unroll
                for (unsigned j = 0; j < V; j++) acc[j] = op(acc[j], ld(in[k].e[j]));
            }
        }
        Lanes out;
#pragma unroll
        for (unsigned j = 0; j < V; j++) out.e[j] = st(avg ? acc[j] / (C)ns : acc[j]);
#pragma unroll
        for (unsigned k = 0; k < 8; k++) if (k < nd) ((uint4*)dst.p[k])[v] = out.u;
    }
    for (unsigned long long i = nv * V + first; i < n; i += stride) {
        C a = ld(((const S*)src.p[0])[i]);
#pragma unroll
        for (unsigned k = 1; k < 8; k++) if (k < ns) a = op(a, ld(((const S*)src.p[k])[i]));
        const S r = st(avg ? a / (C)ns : a);
#pragma unroll
        for (unsigned k = 0; k < 8; k++) if (k < nd) ((S*)dst.p[k])[i] = r;
    }
}
"#;

/// The source of one module holding `kernels`.
pub fn source(kernels: &[Kernel]) -> String {
    let mut s = String::from(PRELUDE);
    let mut helpers: Vec<DType> = kernels.iter().map(|k| k.dtype).collect();
    helpers.sort_by_key(|d| d.name());
    helpers.dedup();
    for dtype in helpers {
        let (t, d) = (types(dtype), dtype.name());
        let (store, compute, load, save) = (t.store, t.compute, t.load, t.save);
        s += &format!(
            "__device__ __forceinline__ {compute} ld_{d}({store} x) {{ return ({compute})({load}); }}\n\
             __device__ __forceinline__ {store} st_{d}({compute} x) {{ return {save}; }}\n"
        );
    }
    for k in kernels {
        s += &k.body;
    }
    s
}

/// Every kernel weft can launch.
#[cfg(test)]
pub fn all() -> Vec<Kernel> {
    let mut all = Vec::new();
    for d in DType::ALL {
        // One op per combiner (Avg and PremulSum share Sum's kernels).
        for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(d) && op.combiner() == *op) {
            all.push(Kernel::reduce(d, op));
            all.push(Kernel::reduce_all(d, op));
        }
        if d.is_float() {
            all.push(Kernel::premul(d));
            all.push(Kernel::divide(d));
        }
    }
    all.push(Kernel::signal());
    all.push(Kernel::wait_flag());
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_is_defined_once_in_its_source() {
        for k in all() {
            let src = source(std::slice::from_ref(&k));
            assert_eq!(src.matches(&format!("void {}(", k.name)).count(), 1, "{}", k.name);
        }
        let names: Vec<String> = all().into_iter().map(|k| k.name).collect();
        for d in DType::ALL {
            for op in ReduceOp::ALL.into_iter().filter(|op| op.supports(d)) {
                assert!(names.contains(&Kernel::reduce(d, op).name), "{d} {op}");
                assert!(names.contains(&Kernel::reduce_all(d, op).name), "{d} {op}");
            }
        }
    }
}

#[cfg(test)]
mod nvrtc_tests {
    /// Compiles every kernel to PTX, in one module, where NVRTC is installed
    /// (no GPU needed); `WEFT_REQUIRE_NVRTC=1` makes its absence a failure
    /// (scripts/gpu-tests.sh, CI).
    #[test]
    fn kernels_compile_with_nvrtc() {
        // SAFETY: only tries to dlopen libnvrtc.
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            assert!(std::env::var("WEFT_REQUIRE_NVRTC").as_deref() != Ok("1"), "NVRTC is required but not installed");
            return;
        }
        let all = super::all();
        let ptx = cudarc::nvrtc::compile_ptx(super::source(&all)).unwrap_or_else(|e| panic!("{e:?}")).to_src();
        for k in &all {
            assert!(ptx.contains(&format!(".entry {}(", k.name)), "{}", k.name);
        }
    }
}
