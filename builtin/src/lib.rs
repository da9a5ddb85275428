//! Links weft's built-in backends into the final program.
//!
//! Backends register themselves with `inventory`, which only sees crates the
//! binary actually links. Depending on this crate and calling [`link`] once
//! (before creating a group) guarantees every backend enabled by this crate's
//! features is linked and registered.

#![warn(missing_docs)]

/// Make sure every enabled built-in backend is linked. Cheap; idempotent.
pub fn link() {
    weft_loopback::link();
    #[cfg(feature = "cpu-tcp")]
    weft_cpu_tcp::link();
    #[cfg(feature = "sparse")]
    weft_sparse::link();
    #[cfg(feature = "shm")]
    weft_shm::link();
    #[cfg(feature = "cuda-host-staging")]
    weft_cuda_host_staging::link();
    #[cfg(feature = "cuda-device")]
    weft_cuda_device::link();
    #[cfg(feature = "hierarchical")]
    weft_hierarchical::link();
}

/// Names of the built-in backends this build links.
pub fn names() -> Vec<&'static str> {
    let mut v = vec!["loopback"];
    if cfg!(feature = "cpu-tcp") {
        v.push("cpu-tcp");
    }
    if cfg!(feature = "shm") {
        v.push("shm");
    }
    if cfg!(feature = "sparse") {
        v.push("sparse");
    }
    if cfg!(feature = "cuda-host-staging") {
        v.push("cuda-host-staging");
    }
    if cfg!(feature = "cuda-device") {
        v.push("cuda-device");
    }
    if cfg!(feature = "hierarchical") {
        v.push("hierarchical");
    }
    v
}
