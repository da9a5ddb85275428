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
    let _gpu = weft_conformance::cuda::exclusive();
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
    let _gpu = weft_conformance::cuda::exclusive();
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

/// An all_reduce told to use an algorithm (hint `algorithm`, without
/// `cuda_algorithm`): `ring` is the device ring, core's others run staged
/// through the host; each sums right.
#[test]
fn a_named_algorithm_runs_on_the_device_ring_or_staged() {
    let _gpu = weft_conformance::cuda::exclusive();
    link();
    on_threads("cpu:shm,cuda:cuda-device", &[], 3, |pg, p| {
        use weft::prelude::*;
        // The ops on the stream the buffers' copies use.
        weft::stream::set_current_stream(Some(p.stream()));
        ["ring", "recursive_doubling", "halving_doubling", "auto"]
            .into_iter()
            .map(|algo| {
                let r = pg.rank() as f32;
                let run = || -> weft::Result<Vec<u8>> {
                    let mut b = weft_conformance::Buf::from_bytes(weft::DType::F32, &[r + 1.0; 1000].map(f32::to_ne_bytes).concat())
                        .place(Some(&p))?;
                    pg.all_reduce(b.tm(), weft::ReduceOp::Sum, &weft::OpOptions::default().hint("algorithm", algo))?.wait()?;
                    b.read()
                };
                let want = [6.0f32; 1000].map(f32::to_ne_bytes).concat();
                let (passed, detail) = match run() {
                    Ok(got) => (got == want, String::new()),
                    Err(e) => (false, e.to_string()),
                };
                Check {
                    op: "all_reduce with a named algorithm",
                    dtype: weft::DType::F32,
                    redop: Some(weft::ReduceOp::Sum),
                    passed,
                    detail: format!("{algo}: {detail}"),
                }
            })
            .collect()
    });
}
