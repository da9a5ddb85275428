//! The conformance suite on `cuda-host-staging`: device tensors staged
//! through host memory over cpu-tcp and shm, pipelined in 64-byte chunks,
//! whole, and by default. Ranks are threads of this test; the GPU is the
//! emulated one (`WEFT_TEST_REAL_GPU=1`: the real one, as
//! `scripts/gpu-tests.sh` runs it).

use weft_conformance::cuda::on_threads;

fn link() {
    weft_shm::link();
    weft_cpu_tcp::link();
    weft_cuda_host_staging::link();
}

#[test]
fn passes_conformance_pipelined_over_cpu_tcp() {
    let _gpu = weft_conformance::cuda::exclusive();
    link();
    for w in 1..=4 {
        // 64-byte chunks: every op is cut into many chunks through 3 slots.
        on_threads("cpu:cpu-tcp,cuda:cuda-host-staging", &[("staging_chunk_bytes", "64")], w, |pg, p| {
            weft_conformance::run_on(pg, 37, Some(p))
        });
    }
}

#[test]
fn passes_conformance_over_shm_whole_and_default() {
    let _gpu = weft_conformance::cuda::exclusive();
    link();
    for w in [2, 3] {
        on_threads("cpu:shm,cuda:cuda-host-staging", &[("staging", "whole")], w, |pg, p| weft_conformance::run_on(pg, 37, Some(p)));
        on_threads("cpu:shm,cuda:cuda-host-staging", &[], w, |pg, p| weft_conformance::run_on(pg, 37, Some(p)));
    }
}
