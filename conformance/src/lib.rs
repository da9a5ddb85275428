//! The conformance suite for weft backends.
//!
//! [`run`] exercises every op, dtype and reduce op on a group and compares
//! each result with a reference computed without weft ([`reference`](mod@reference)). It
//! returns one [`Check`] per case, so a backend author can see exactly what
//! fails: `weft conformance --backend NAME_OR_PATH -n 4` prints them as a
//! table, and weft's own tests run it on every backend. Its cases come in
//! independent families ([`Family`]: one op form over every dtype and
//! reduce op, or one special case); [`run_family`] runs one alone, and a
//! failure in one never skips the others. [`run_on`] runs the
//! same cases on device memory ([`cuda::placement`]). [`run_p2p`] adds
//! the point-to-point patterns that need sends and receives to progress
//! together (long messages in a ring, batches, sendrecv), [`run_windows`]
//! the one-sided window cases, [`capture::replays`] collectives captured
//! into a CUDA graph and launched again. [`on_threads`] runs any of them on
//! a world of threads: each backend crate's own `cargo test` does.

#![warn(missing_docs)]

mod buf;
pub mod capture;
pub mod cuda;
mod placement;
pub mod reference;
mod suite;
mod threads;
mod windows;

pub use buf::{assert_close, Buf};
pub use placement::{Placement, SharedPlacement};
pub use suite::{run, run_family, run_on, run_p2p, summary, Check, Family};
pub use threads::{assert_passed, checks_on_threads, checks_on_threads_each, on_threads};
pub use windows::{byte as windows_byte, run_windows, run_windows_on};
