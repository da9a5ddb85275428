//! CUDA tensors on the emulated GPU (CPU-only CI): the host-staging
//! backend through the whole conformance suite, stream ordering, and the
//! error paths. The same tests run on a real GPU with `scripts/gpu-tests.sh`.

use std::os::unix::process::ExitStatusExt;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::prelude::*;
use weft::{DType, Device, DeviceKind, ErrorKind, Layout, StreamHandle};
use weft_cuda_driver::{synchronize_stream, Gpu};
use weft_tests::procs::{run_world, run_world_on_free_port, torchrun_vars};
use weft_tests::{options, run_threads};

/// The emulated GPU, unless `WEFT_TEST_REAL_GPU=1` asks for the real one.
fn gpu() -> Arc<dyn Gpu> {
    if std::env::var("WEFT_TEST_REAL_GPU").as_deref() != Ok("1") {
        weft_cuda_driver::emulate(1).unwrap();
    }
    weft_cuda_driver::gpu().unwrap()
}

/// Run `suite` on `w` ranks of `spec` (with group `hints`) on the emulated
/// GPU (or the real one, `WEFT_TEST_REAL_GPU=1`); every check must pass on
/// every rank.
fn checked(
    w: usize,
    spec: &str,
    hints: &[(&str, &str)],
    suite: fn(&ProcessGroup, weft_conformance::SharedPlacement) -> Vec<weft_conformance::Check>,
) {
    weft_builtin::link();
    weft_conformance::cuda::on_threads(spec, hints, w, suite);
}

/// The ring exchange and batches on the emulated GPU through a CUDA backend.
fn p2p(w: usize, spec: &str, hints: &[(&str, &str)]) {
    checked(w, spec, hints, |pg, place| weft_conformance::run_p2p(pg, Some(place), 16 << 20));
}

/// One-sided windows in device memory: cuda-device maps every rank's
/// (threads of one process here; processes in `cuda_windows_across_processes`);
/// cuda-host-staging has none and says so.
#[test]
fn cuda_windows_on_the_device() {
    let _gpu = weft_conformance::cuda::exclusive();
    for w in 2..=3 {
        checked(w, "cpu:shm,cuda:cuda-device", &[], weft_conformance::run_windows_on);
        checked(w, "cpu:cpu-tcp,cuda:cuda-device", &[], weft_conformance::run_windows_on);
    }
    let _ = gpu();
    for e in run_threads(2, options("cpu:shm,cuda:cuda-host-staging"), |pg| pg.new_window_on(64, Device::Cuda(0)).unwrap_err()) {
        assert_eq!(e.kind(), &ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains("cuda-host-staging has no windows in cuda:0 memory"), "{e}");
    }
}

#[test]
fn cuda_point_to_point_progresses_together_through_both_backends() {
    let _gpu = weft_conformance::cuda::exclusive();
    for w in 2..=5 {
        p2p(w, "cpu:cpu-tcp,cuda:cuda-host-staging", &[]);
        p2p(w, "cpu:shm,cuda:cuda-device", &[]);
    }
}

/// What the worker processes need to find a GPU: the emulation, unless
/// `WEFT_TEST_REAL_GPU=1`.
fn gpu_env() -> Vec<(&'static str, &'static str)> {
    if std::env::var("WEFT_TEST_REAL_GPU").as_deref() == Ok("1") {
        vec![]
    } else {
        vec![("WEFT_CUDA_EMULATION", "1")]
    }
}

/// The worker program: `WEFT_TEST_WORKER` where the tests run from binaries
/// built elsewhere (`scripts/gpu-pack.sh`), else the one cargo built.
fn worker() -> String {
    std::env::var("WEFT_TEST_WORKER").unwrap_or_else(|_| env!("CARGO_BIN_EXE_weft-test-worker").to_string())
}

#[test]
fn cuda_device_direct_and_ring_across_processes_over_ipc() {
    // (world size, group hints): the default (direct, staged) at 2 and 4, direct
    // required, direct mapping the callers' buffers, the ring.
    let runs = [
        (2, ""),
        (4, ""),
        (3, "cuda_algorithm=direct"),
        (3, "cuda_algorithm=direct,cuda_direct_staged_bytes=0"),
        (2, "cuda_algorithm=ring,cuda_slot_bytes=4096,cuda_p2p_chunk_bytes=4096"),
    ];
    for (w, hints) in runs {
        let mut env = gpu_env();
        env.push(("WEFT_TEST_HINTS", hints));
        let ends = run_world(&worker(), w, &["cuda_conformance"], &env, Duration::from_secs(120));
        for (r, e) in ends.iter().enumerate() {
            assert!(e.status.success(), "W={w} {hints} rank {r}:\n{}", e.output);
            assert!(e.output.contains("cuda=cuda-device cpu=shm"), "auto picks cuda-device on one host: {}", e.output);
        }
    }
}

#[test]
fn collectives_captured_into_a_graph_replay_across_processes() {
    // Staged through the staging buffers, and reading the callers' buffers
    // through IPC mappings that the graph keeps.
    for (w, hints) in [(2, ""), (3, "cuda_direct_staged_bytes=0,cuda_p2p_chunk_bytes=256")] {
        let mut env = gpu_env();
        env.push(("WEFT_TEST_HINTS", hints));
        let ends = run_world(&worker(), w, &["cuda_capture"], &env, Duration::from_secs(120));
        for (r, e) in ends.iter().enumerate() {
            assert!(e.status.success(), "W={w} {hints} rank {r}:\n{}", e.output);
            assert!(e.output.contains("captured collectives replayed right"), "{}", e.output);
        }
    }
}

#[test]
fn ranks_on_different_gpus_run_the_ring_unless_direct_is_asked_for() {
    // Two emulated GPUs, one per rank (LOCAL_RANK): events are waited for
    // on the device, and `auto` keeps the ring across GPUs.
    let real = std::env::var("WEFT_TEST_REAL_GPU").as_deref() == Ok("1");
    for hints in ["", "cuda_algorithm=direct"] {
        let mut env = if real { vec![] } else { vec![("WEFT_CUDA_EMULATION", "2")] };
        env.push(("WEFT_TEST_HINTS", hints));
        let vars = |rank: usize, port: &str| torchrun_vars(rank, 2, port, &[("LOCAL_RANK", rank.to_string())]);
        let ends = run_world_on_free_port(&worker(), 2, &["cuda_conformance"], &env, Duration::from_secs(120), vars);
        for (r, e) in ends.iter().enumerate() {
            assert!(e.status.success(), "{hints} rank {r}:\n{}", e.output);
            assert!(e.output.contains("cuda=cuda-device cpu=shm"), "{}", e.output);
        }
    }
}

#[test]
fn ranks_given_different_staging_hints_get_an_error_naming_it() {
    let vars = |rank: usize, port: &str| {
        torchrun_vars(rank, 2, port, &[("WEFT_TEST_HINTS", format!("cuda_direct_staged_bytes={}", rank * 65536))])
    };
    let ends = run_world_on_free_port(&worker(), 2, &["cuda_staging_disagrees"], &gpu_env(), Duration::from_secs(60), vars);
    for (r, e) in ends.iter().enumerate() {
        assert!(e.status.success(), "rank {r}:\n{}", e.output);
    }
}

#[test]
fn cuda_device_falls_back_to_the_ring_where_a_buffer_cannot_be_exported() {
    // Staging would not need the buffers exported: stage nothing.
    let mut env = gpu_env();
    env.push(("WEFT_TEST_HINTS", "cuda_direct_staged_bytes=0"));
    let ends = run_world(&worker(), 3, &["cuda_unexported"], &env, Duration::from_secs(120));
    for (r, e) in ends.iter().enumerate() {
        assert!(e.status.success(), "rank {r}:\n{}", e.output);
    }
}

/// Sends and receives GPU to GPU whose sizes or order disagree fail the
/// receiving rank with `InvalidArgument` naming the sender (their records
/// say so), and its later point-to-point ops the same way: the two ranks'
/// chunk counts no longer agree.
#[test]
fn point_to_point_on_the_device_that_disagrees_is_refused() {
    for case in ["size", "order"] {
        let mut env = gpu_env();
        env.push(("WEFT_TEST_CASE", case));
        let ends = run_world(&worker(), 2, &["cuda_p2p_mismatch"], &env, Duration::from_secs(120));
        for (r, e) in ends.iter().enumerate() {
            assert!(e.status.success(), "{case}: rank {r}:\n{}", e.output);
        }
        let why = if case == "size" { "rank 0 sent 100 bytes with tag 1, and this receive takes 200" } else { "in the order sent" };
        assert!(ends[1].output.contains(why), "{case}: {}", ends[1].output);
    }
}

#[test]
fn auto_falls_back_to_host_staging_when_ranks_are_on_different_hosts() {
    let vars = |rank: usize, port: &str| torchrun_vars(rank, 2, port, &[("WEFT_HOST_ID", format!("host{rank}"))]);
    let ends = run_world_on_free_port(&worker(), 2, &["cuda_conformance"], &gpu_env(), Duration::from_secs(120), vars);
    for (r, e) in ends.iter().enumerate() {
        assert!(e.status.success(), "rank {r}:\n{}", e.output);
        assert!(e.output.contains("cuda=cuda-host-staging cpu=cpu-tcp"), "{}", e.output);
    }
}

#[test]
fn a_rank_killed_during_cuda_all_reduce_is_reported_by_the_others() {
    let ends = run_world(&worker(), 3, &["cuda_sigkill"], &gpu_env(), Duration::from_secs(60));
    assert_eq!(ends[2].status.signal(), Some(9), "{}", ends[2].output);
    for (r, e) in ends.iter().take(2).enumerate() {
        assert!(e.status.success(), "rank {r}:\n{}", e.output);
        let died = ends[2].at;
        assert!(e.at.saturating_duration_since(died) < Duration::from_secs(15), "rank {r} took {:?}", e.at - died);
    }
}

/// Device memory on the emulated GPU, filled from `data` on `stream`
/// (the copy may still be in flight when this returns).
///
/// # Safety
/// `data` stays alive until `stream` has run the copy (a `download` or
/// `free` synchronises it): a temporary freed at once would be read after
/// its memory went to other allocations.
unsafe fn upload(g: &dyn Gpu, stream: StreamHandle, data: &[f32]) -> u64 {
    let addr = g.alloc(0, data.len() * 4).unwrap();
    // SAFETY: the caller keeps `data` alive until the stream has copied it.
    unsafe { g.copy_htod(stream, addr, data.as_ptr() as *const u8, data.len() * 4).unwrap() };
    addr
}

fn download(g: &dyn Gpu, stream: StreamHandle, addr: u64, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; n];
    // SAFETY: `out` lives until the event below completes.
    unsafe { g.copy_dtoh(stream, out.as_mut_ptr() as *mut u8, addr, n * 4).unwrap() };
    synchronize_stream(g, 0, stream, Instant::now() + Duration::from_secs(30), "download").unwrap();
    out
}

#[test]
fn ops_are_ordered_after_the_callers_stream_and_wait_orders_it_back() {
    let _gpu = weft_conformance::cuda::exclusive();
    let g = gpu();
    for spec in ["cpu:shm,cuda:cuda-host-staging", "cpu:shm,cuda:cuda-device"] {
        let results = run_threads(2, options(spec), move |pg| {
            let g = weft_cuda_driver::gpu().unwrap();
            let stream = g.new_stream(0).unwrap();
            // A large upload still in flight on the caller's stream when the op
            // is issued; the op must see its data, not zeros.
            let n = 4 << 20;
            let data = vec![pg.rank() as f32 + 1.0; n];
            // SAFETY: `data` lives to the end of the closure, after the
            // stream is synchronised.
            let addr = unsafe { upload(&*g, stream, &data) };
            // SAFETY: n f32 of device memory, freed below after the stream's work.
            let t = unsafe { weft_cuda_driver::tensor_mut_from_raw(addr, DType::F32, 0, &[n]) }.unwrap();
            let work = pg.all_reduce(t, ReduceOp::Sum, &OpOptions::default().stream(stream)).unwrap();
            work.wait().unwrap();
            // Ordered after the op by `wait`, without the host blocking for it.
            let out = download(&*g, stream, addr, n);
            work.synchronize().unwrap();
            assert!(work.is_completed());
            drop(work);
            // SAFETY: every use of addr is done (synchronised above).
            unsafe { g.free(addr) };
            out.iter().all(|&x| x == 3.0)
        });
        assert!(results.iter().all(|ok| *ok), "{spec}: a rank saw data from before its stream's upload or before the op");
    }
    drop(g);
}

#[test]
fn dropping_an_unwaited_work_blocks_until_the_device_side_is_done() {
    let _gpu = weft_conformance::cuda::exclusive();
    let _ = gpu();
    run_threads(2, options("cpu:cpu-tcp,cuda:cuda-host-staging"), |pg| {
        let g = weft_cuda_driver::gpu().unwrap();
        let stream = g.new_stream(0).unwrap();
        let n = 1 << 20;
        let data = vec![1f32; n];
        // SAFETY: `data` lives to the end of the closure, after the stream
        // is synchronised.
        let addr = unsafe { upload(&*g, stream, &data) };
        weft::stream::set_current_stream(Some(stream));
        {
            // SAFETY: n f32 of device memory.
            let t = unsafe { weft_cuda_driver::tensor_mut_from_raw(addr, DType::F32, 0, &[n]) }.unwrap();
            let _work = pg.all_reduce(t, ReduceOp::Avg, &OpOptions::default()).unwrap();
        }
        weft::stream::set_current_stream(None);
        // No wait: the drop above finished the device side, so a copy on
        // another stream sees the result.
        let other = g.new_stream(0).unwrap();
        let out = download(&*g, other, addr, n);
        // SAFETY: done with addr.
        unsafe { g.free(addr) };
        assert!(out.iter().all(|&x| x == 1.0), "{}", out[0]);
    });
}

#[test]
fn cuda_errors_are_typed_and_nothing_hangs() {
    let _gpu = weft_conformance::cuda::exclusive();
    let g = gpu();
    // No CUDA backend in the group: a clear Unsupported error.
    let results = run_threads(2, options("cpu:cpu-tcp"), |pg| {
        let g = weft_cuda_driver::gpu().unwrap();
        let addr = g.alloc(0, 64).unwrap();
        // SAFETY: 16 f32 of device memory.
        let t = unsafe { weft_cuda_driver::tensor_mut_from_raw(addr, DType::F32, 0, &[16]) }.unwrap();
        let e = pg.all_reduce(t, ReduceOp::Sum, &OpOptions::default()).unwrap().wait().unwrap_err();
        // SAFETY: unused now.
        unsafe { g.free(addr) };
        (e.kind().clone(), e.to_string())
    });
    for (kind, msg) in results {
        assert_eq!(kind, ErrorKind::Unsupported, "{msg}");
        assert!(msg.contains("no backend handles cuda dense tensors"), "{msg}");
    }
    // Mixed devices in one op: rejected before anything moves.
    run_threads(1, options("cpu:cpu-tcp,cuda:cuda-host-staging"), |pg| {
        assert_eq!(pg.backend_name((DeviceKind::Cuda, Layout::Dense)).as_deref(), Some("cuda-host-staging"));
        let g = weft_cuda_driver::gpu().unwrap();
        let addr = g.alloc(0, 64).unwrap();
        // SAFETY: 16 f32 of device memory.
        let input = unsafe { weft_cuda_driver::tensor_from_raw(addr, DType::F32, 0, &[16]) }.unwrap();
        let mut host = [0f32; 16];
        let e = pg.all_gather_single(&mut host[..], input, &OpOptions::default()).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("cuda:0"), "{e}");
        // SAFETY: unused now.
        unsafe { g.free(addr) };
    });
    // A peer that never joins the op: Timeout, not a hang.
    run_threads(2, options("cpu:cpu-tcp,cuda:cuda-host-staging"), |pg| {
        if pg.rank() == 1 {
            std::thread::sleep(Duration::from_secs(2));
            return;
        }
        let g = weft_cuda_driver::gpu().unwrap();
        let addr = g.alloc(0, 64).unwrap();
        // SAFETY: 16 f32 of device memory.
        let t = unsafe { weft_cuda_driver::tensor_mut_from_raw(addr, DType::F32, 0, &[16]) }.unwrap();
        let start = Instant::now();
        let e = pg.all_reduce(t, ReduceOp::Sum, &OpOptions::default().timeout(Duration::from_millis(500))).unwrap().wait().unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::Timeout, "{e}");
        assert!(start.elapsed() < Duration::from_secs(10));
        // SAFETY: the failed op drained its streams before returning.
        unsafe { g.free(addr) };
    });
    // Ranks all-reducing different sizes on cuda-device: an error on every
    // rank, and no rank's memory written past its tensor.
    for (algorithm, staged) in [("direct", "65536"), ("direct", "0"), ("ring", "0")] {
        let opts = options("cpu:shm,cuda:cuda-device")
            .hint("cuda_algorithm", algorithm)
            .hint("cuda_slot_bytes", "256")
            .hint("cuda_direct_staged_bytes", staged);
        let results = run_threads(2, opts, |pg| {
            let g = weft_cuda_driver::gpu().unwrap();
            let stream = g.new_stream(0).unwrap();
            let n = if pg.rank() == 0 { 1000 } else { 1100 };
            // A guard of 64 floats after rank 0's tensor. (`data` outlives
            // the upload: a temporary freed here, its memory reused before
            // the stream's late copy ran, once left a guard of garbage.)
            let data = vec![1f32; n + 64];
            // SAFETY: `data` lives until after `download` synchronises the stream.
            let addr = unsafe { upload(&*g, stream, &data) };
            // SAFETY: n f32 of device memory.
            let t = unsafe { weft_cuda_driver::tensor_mut_from_raw(addr, DType::F32, 0, &[n]) }.unwrap();
            let o = OpOptions::default().stream(stream).timeout(Duration::from_secs(5));
            let e = pg.all_reduce(t, ReduceOp::Sum, &o).and_then(|w| w.synchronize()).unwrap_err();
            let guard = download(&*g, stream, addr + 4 * n as u64, 64);
            // SAFETY: the failed op drained its streams.
            unsafe { g.free(addr) };
            (e.kind().clone(), e.to_string(), guard.iter().all(|x| *x == 1.0))
        });
        for (r, (kind, msg, guard)) in results.into_iter().enumerate() {
            assert!(guard, "{algorithm}: rank {r}'s memory past its tensor was written");
            assert_eq!(kind, ErrorKind::InvalidArgument, "{algorithm}: rank {r}: {msg}");
            // Caught by cuda-device's own exchange of sizes, or before that
            // by the shape every message's tag carries.
            assert!(msg.contains("mismatched all_reduce") || msg.contains("collective mismatch"), "{algorithm}: rank {r}: {msg}");
        }
    }
    // A bad cuda-device hint fails group creation on every rank, saying why.
    let store: Arc<dyn weft::store::Store> = Arc::new(weft::store::MemoryStore::new(Duration::from_secs(5)));
    let e = ProcessGroup::new(store, 0, 1, options("cpu:shm,cuda:cuda-device").hint("cuda_wait", "sometimes")).unwrap_err();
    assert!(e.to_string().contains("hint cuda_wait=\"sometimes\""), "{e}");
    let store: Arc<dyn weft::store::Store> = Arc::new(weft::store::MemoryStore::new(Duration::from_secs(5)));
    let e = ProcessGroup::new(store, 0, 1, options("cpu:shm,cuda:cuda-device").hint("cuda_direct_staged_bytes", "lots")).unwrap_err();
    assert!(e.to_string().contains("hint cuda_direct_staged_bytes=\"lots\""), "{e}");
    // A bad algorithm hint fails the op, saying the choices.
    run_threads(1, options("cpu:shm,cuda:cuda-device"), |pg| {
        let g = weft_cuda_driver::gpu().unwrap();
        let addr = g.alloc(0, 64).unwrap();
        // SAFETY: 16 f32 of device memory.
        let t = unsafe { weft_cuda_driver::tensor_mut_from_raw(addr, DType::F32, 0, &[16]) }.unwrap();
        let o = OpOptions::default().hint("cuda_algorithm", "fastest");
        let e = pg.all_reduce(t, ReduceOp::Sum, &o).and_then(|w| w.wait()).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("\"direct\", \"ring\""), "{e}");
        // SAFETY: unused now.
        unsafe { g.free(addr) };
    });
    let _ = (g, Device::Cpu);
}
