//! weft's fuzz targets, by name. Each takes any bytes and must not panic,
//! hang or allocate without bound. `fuzz/afl/` runs them under AFL++;
//! `tests/replay.rs` runs the stored corpus (`corpus/<target>/`) in every
//! `cargo test`.

/// A fuzz target: its name and entry point.
pub struct Target {
    /// The name (`corpus/<name>/` holds its inputs).
    pub name: &'static str,
    /// The entry point.
    pub run: fn(&[u8]),
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target { name: "store_session", run: weft::fuzzing::store_session },
    Target { name: "plugin_table", run: weft::fuzzing::plugin_table },
    Target { name: "cpu_tcp_frames", run: weft_cpu_tcp::fuzzing::frames },
    Target { name: "cpu_tcp_handshake", run: weft_cpu_tcp::fuzzing::handshake },
    Target { name: "shm_slots", run: weft_shm::fuzzing::slots },
    Target { name: "window_frames", run: weft::fuzzing::window_frames },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}
