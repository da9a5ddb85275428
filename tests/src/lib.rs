//! Harness for multi-rank tests: ranks as threads of this process over real
//! sockets (fast), with an outer time limit so a hang fails the test.

pub mod procs;
pub mod reference;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;
use weft::store::{MemoryStore, Store};
use weft::{GroupOptions, ProcessGroup};

/// Outer limit for one multi-rank test body.
pub const OUTER_LIMIT: Duration = Duration::from_secs(120);

/// Options for test groups: the given backend spec and a short timeout.
pub fn options(spec: &str) -> GroupOptions {
    weft_builtin::link();
    GroupOptions::from_env().unwrap().backend(spec).timeout(Duration::from_secs(30))
}

/// Run `f(group)` on `w` ranks (threads) sharing an in-process store;
/// results in rank order. Panics if any rank panics or the whole run takes
/// longer than [`OUTER_LIMIT`].
pub fn run_threads<T: Send + 'static>(w: usize, opts: GroupOptions, f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static) -> Vec<T> {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(30)));
    run_threads_on(store, w, opts, f)
}

/// As [`run_threads`] with a given store.
pub fn run_threads_on<T: Send + 'static>(
    store: Arc<dyn Store>,
    w: usize,
    opts: GroupOptions,
    f: impl Fn(ProcessGroup) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for rank in 0..w {
        let (store, opts, f, tx) = (store.clone(), opts.clone(), f.clone(), tx.clone());
        std::thread::Builder::new()
            .name(format!("rank{rank}"))
            .spawn(move || {
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let pg = ProcessGroup::new(store, rank, w, opts).unwrap_or_else(|e| panic!("rank {rank}: group creation failed: {e}"));
                    f(pg)
                }));
                let _ = tx.send((rank, out));
            })
            .expect("spawn rank thread");
    }
    drop(tx);
    let mut results: Vec<Option<T>> = (0..w).map(|_| None).collect();
    let mut failures = Vec::new();
    let deadline = std::time::Instant::now() + OUTER_LIMIT;
    for _ in 0..w {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(v))) => results[rank] = Some(v),
            Ok((rank, Err(p))) => {
                let msg =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                failures.push(format!("rank {rank} panicked: {msg}"));
            }
            Err(_) => {
                failures.push(format!("multi-rank test exceeded its outer limit of {OUTER_LIMIT:?} (hang?)"));
                break;
            }
        }
    }
    // Every rank's failure, in the order they happened: the first is usually the cause.
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    results.into_iter().map(|r| r.expect("every rank reported")).collect()
}

/// Aligned bytes of one dtype, viewable as a tensor.
pub struct Buf {
    words: Vec<u64>,
    len: usize,
    /// Element type.
    pub dtype: weft::DType,
}

impl Buf {
    /// A buffer holding `bytes` (a multiple of the dtype size).
    pub fn from_bytes(dtype: weft::DType, bytes: &[u8]) -> Buf {
        let mut b = Buf { words: vec![0; bytes.len().div_ceil(8)], len: bytes.len(), dtype };
        b.bytes_mut().copy_from_slice(bytes);
        b
    }
    /// `n` zero elements.
    pub fn zeros(dtype: weft::DType, n: usize) -> Buf {
        Buf::from_bytes(dtype, &vec![0; n * dtype.size()])
    }
    /// The bytes.
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: words holds at least len bytes.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }
    /// The bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, unique.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.len / self.dtype.size()
    }
    /// A read-only tensor view.
    pub fn t(&self) -> weft::Tensor<'_> {
        // SAFETY: 8-byte aligned host memory of numel elements, borrowed for the view's life.
        unsafe { weft::Tensor::from_raw_parts(self.words.as_ptr() as *const u8, self.dtype, weft::Device::Cpu, &[self.numel()], None) }
            .unwrap()
    }
    /// A mutable tensor view.
    pub fn tm(&mut self) -> weft::TensorMut<'_> {
        let n = self.numel();
        // SAFETY: as above, uniquely borrowed.
        unsafe { weft::TensorMut::from_raw_parts(self.words.as_mut_ptr() as *mut u8, self.dtype, weft::Device::Cpu, &[n], None) }.unwrap()
    }
}

/// Compare results: exact, except f16/bf16 products (rounding order differs).
pub fn assert_close(dtype: weft::DType, op: Option<weft::ReduceOp>, got: &[u8], want: &[u8], what: &str) {
    use weft::DType;
    if got == want {
        return;
    }
    let tolerant = matches!(dtype, DType::F16 | DType::BF16) && op == Some(weft::ReduceOp::Product);
    if tolerant {
        let f = |b: &[u8]| -> Vec<f32> {
            b.chunks(2)
                .map(|c| {
                    let bits = u16::from_ne_bytes([c[0], c[1]]);
                    if dtype == DType::F16 {
                        half::f16::from_bits(bits).to_f32()
                    } else {
                        half::bf16::from_bits(bits).to_f32()
                    }
                })
                .collect()
        };
        let (g, w) = (f(got), f(want));
        if g.iter().zip(&w).all(|(a, b)| (a - b).abs() <= 0.02 * b.abs().max(1.0)) {
            return;
        }
    }
    let n = got.len().min(64);
    panic!("{what}: {dtype} mismatch\n got  {:?}\n want {:?}", &got[..n], &want[..want.len().min(64)]);
}
