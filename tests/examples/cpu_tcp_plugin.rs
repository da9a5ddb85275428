//! Builds the user-facing example `examples/plugins/rust-cpu-tcp` as a test
//! artifact (cargo test builds examples, not other crates' cdylibs).
include!("../../examples/plugins/rust-cpu-tcp/src/export.rs");
