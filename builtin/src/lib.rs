//! Links weft's built-in backends into the final program.
//!
//! Backends register themselves with `inventory`, which only sees crates the
//! binary actually links. Depending on this crate and calling [`link`] once
//! (before creating a group) guarantees every backend enabled by this crate's
//! features is linked and registered.

#![warn(missing_docs)]

/// Links each listed backend crate where its feature is on.
macro_rules! link_each {
    ($($feature:literal => $krate:ident),+ $(,)?) => {
        $(
            #[cfg(feature = $feature)]
            $krate::link();
        )+
    };
}

/// Make sure every enabled built-in backend is linked. Cheap; idempotent.
pub fn link() {
    weft_loopback::link();
    // A built-in backend is one line here (its feature and crate), plus
    // the feature and optional dependency in this crate's Cargo.toml.
    link_each! {
        "cpu-tcp" => weft_cpu_tcp,
        "sparse" => weft_sparse,
        "shm" => weft_shm,
        "cuda-host-staging" => weft_cuda_host_staging,
        "cuda-device" => weft_cuda_device,
        "hierarchical" => weft_hierarchical,
    }
}
