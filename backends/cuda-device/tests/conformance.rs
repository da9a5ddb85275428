//! The conformance suite on `cuda-device` with in-process peers: the ring
//! (in 64-byte IPC slots), the direct all_reduce (staged and not), waits
//! on the device and on the host, and `auto` for CUDA tensors. Ranks are
//! threads of this test; the GPU is the emulated one
//! (`WEFT_TEST_REAL_GPU=1`: the real one, as `scripts/gpu-tests.sh` runs it).

use weft_conformance::cuda::on_threads;
use weft_conformance::{run_on, Check, SharedPlacement};

fn link() {
    weft_shm::link();
    weft_cpu_tcp::link();
    weft_cuda_host_staging::link();
    weft_cuda_device::link();
}

fn suite(pg: &weft::ProcessGroup, p: SharedPlacement) -> Vec<Check> {
    run_on(pg, 37, Some(p))
}

#[test]
fn the_ring_passes_conformance() {
    link();
    for w in 1..=4 {
        // 64-byte slots: every block is many pieces cycling through the slots.
        on_threads("cpu:shm,cuda:cuda-device", &[("cuda_slot_bytes", "64"), ("cuda_algorithm", "ring")], w, suite);
    }
    // Neighbours' events waited for on the host (the default only for
    // other processes on the same GPU).
    on_threads("cpu:shm,cuda:cuda-device", &[("cuda_slot_bytes", "64"), ("cuda_wait", "host"), ("cuda_algorithm", "ring")], 3, suite);
}

#[test]
fn the_direct_all_reduce_passes_conformance() {
    link();
    // W=1 has nothing to map: the ring's no-op serves, also where direct is asked for.
    on_threads("cpu:shm,cuda:cuda-device", &[("cuda_algorithm", "direct")], 1, suite);
    for w in 2..=5 {
        // Staged through the staging buffers (small ops), and not.
        on_threads("cpu:shm,cuda:cuda-device", &[("cuda_algorithm", "direct")], w, suite);
        on_threads("cpu:shm,cuda:cuda-device", &[("cuda_algorithm", "direct"), ("cuda_direct_staged_bytes", "0")], w, suite);
    }
    on_threads("cpu:shm,cuda:cuda-device", &[("cuda_wait", "host"), ("cuda_algorithm", "direct")], 3, suite);
    on_threads("cpu:cpu-tcp,cuda:auto", &[], 3, suite);
}
