//! The atomics the ring and single-copy protocols use: std's, or loom's
//! when built with `--cfg loom` so the protocols can be model-checked
//! in-process (`RUSTFLAGS="--cfg loom" cargo test -p weft-shm --lib loom`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{fence, AtomicU64, Ordering};
