//! A rank program for the multi-process tests: `weft-test-worker SCENARIO`.
//! Exit status 0 means the scenario behaved as expected on this rank.

use std::time::{Duration, Instant};
use weft::prelude::*;
use weft::ErrorKind;

fn main() {
    weft_builtin::link();
    let scenario = std::env::args().nth(1).unwrap_or_default();
    let code = match run(&scenario) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("scenario {scenario} failed: {e}");
            1
        }
    };
    std::process::exit(code);
}

/// Die by SIGKILL after `delay`, whatever the main thread is doing.
fn sigkill_self_after(delay: Duration) {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
    });
}

/// Under the scenario `zombie`, the last rank forks: the child goes on as
/// the rank (and kills itself mid-op, as in `sigkill_small`), while this
/// process, its parent, does not reap it for `ZOMBIE_GRACE` after it died,
/// so the other ranks must tell a zombie from a live peer. Then it reaps
/// it and exits 0.
fn fork_a_rank_left_unreaped() -> anyhow::Result<()> {
    // SAFETY: called first thing in `main`'s thread, before any other
    // thread exists; the child goes on with a copy of this one.
    match unsafe { nix::unistd::fork() }? {
        nix::unistd::ForkResult::Child => Ok(()),
        nix::unistd::ForkResult::Parent { child } => {
            let stat = format!("/proc/{child}/stat");
            let until = Instant::now() + Duration::from_secs(60);
            while Instant::now() < until {
                let text = std::fs::read_to_string(&stat).unwrap_or_default();
                if text.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with('Z')) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            std::thread::sleep(ZOMBIE_GRACE);
            let _ = nix::sys::wait::waitpid(child, None);
            std::process::exit(0);
        }
    }
}

/// How long a dead rank stays a zombie in the `zombie` scenario.
const ZOMBIE_GRACE: Duration = Duration::from_secs(8);

fn run(scenario: &str) -> anyhow::Result<()> {
    if scenario == "zombie" && std::env::var("RANK")?.parse::<usize>()? + 1 == std::env::var("WORLD_SIZE")?.parse::<usize>()? {
        fork_a_rank_left_unreaped()?;
    }
    // WEFT_TEST_HINTS="k=v,k=v": group hints (e.g. forcing an algorithm).
    let mut options = GroupOptions::from_env()?;
    for kv in std::env::var("WEFT_TEST_HINTS").unwrap_or_default().split(',').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').ok_or_else(|| anyhow::anyhow!("WEFT_TEST_HINTS: {kv:?} is not k=v"))?;
        options = options.hint(k, v);
    }
    let pg = ProcessGroup::from_env(options)?;
    let (r, w) = (pg.rank(), pg.size());
    let o = OpOptions::default();
    match scenario {
        "ops" => {
            let mut v = vec![r as i64 + 1; 1000];
            pg.all_reduce(&mut v, ReduceOp::Sum, &o)?.wait()?;
            anyhow::ensure!(v.iter().all(|x| *x == (w * (w + 1) / 2) as i64), "all_reduce");
            let mut all = vec![0u32; 3 * w];
            pg.all_gather_single(&mut all, &[r as u32; 3][..], &o)?.wait()?;
            anyhow::ensure!(all.chunks(3).enumerate().all(|(i, c)| c == [i as u32; 3]), "all_gather");
            let mut b = vec![r as f64; 17];
            pg.broadcast(&mut b, w - 1, &o)?.wait()?;
            anyhow::ensure!(b.iter().all(|x| *x == (w - 1) as f64), "broadcast");
            pg.barrier(&o)?.wait()?;
            println!("rank {r} of {w}: ok");
        }
        "sigkill" | "sigkill_small" | "sigkill_all_gather" | "zombie" => {
            // The last rank kills itself in the middle of 64 MiB (or 8-byte:
            // shm's fast path) all_reduces, or of all_gathers of 1 MiB parts
            // (shm: single copy, pushed by senders that also receive); every
            // other rank must get PeerLost naming it.
            let victim = w - 1;
            if r == victim {
                sigkill_self_after(Duration::from_millis(400));
            }
            let (op, n) = match scenario {
                "sigkill" => ("all_reduce", 16 << 20),
                "sigkill_small" | "zombie" => ("all_reduce", 2),
                _ => ("all_gather_single", 300_000),
            };
            let mut v = vec![1f32; n];
            let mut all = vec![0f32; if op == "all_gather_single" { n * w } else { 0 }];
            loop {
                let work = match op {
                    "all_reduce" => pg.all_reduce(&mut v, ReduceOp::Sum, &o)?,
                    _ => pg.all_gather_single(&mut all, &v, &o)?,
                };
                match work.wait() {
                    Ok(()) => continue,
                    Err(e) => {
                        println!("rank {r}: {e}");
                        anyhow::ensure!(
                            e.kind() == &ErrorKind::PeerLost { rank: victim },
                            "expected PeerLost {{ rank: {victim} }}, got {e}"
                        );
                        anyhow::ensure!(e.op() == Some(op), "the error names the op");
                        return Ok(());
                    }
                }
            }
        }
        "straggler" | "stuck_at_exit" => {
            // The last rank stops itself (SIGSTOP) once every rank is past a
            // barrier; with "straggler" a child resumes it 6 s later, with
            // "stuck_at_exit" never (a child kills it after 12 s). The others run
            // the last collectives (a broadcast from rank 0, whose sends end
            // in socket buffers and rings, and an all_gather the stopped rank
            // sent its part of first) and leave. A straggler must then read
            // everything and finish with exact data; a stuck rank must not
            // keep the others past the group's timeout (plus a margin).
            let victim = w - 1;
            let mut mine = vec![r as f32 + 1.0; 1 << 12];
            let mut all = vec![0f32; mine.len() * w];
            pg.barrier(&o)?.wait()?;
            if r == victim {
                let me = std::process::id();
                let later = if scenario == "straggler" { format!("sleep 6; kill -CONT {me}") } else { format!("sleep 12; kill -9 {me}") };
                std::process::Command::new("sh").args(["-c", &later]).spawn()?;
                // Its part first, then stopped before it reads the others'.
                let gather = pg.all_gather_single(&mut all, &mine, &o)?;
                std::thread::sleep(Duration::from_millis(300));
                nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP)?;
                gather.wait()?;
            } else {
                pg.all_gather_single(&mut all, &mine, &o)?.wait()?;
            }
            anyhow::ensure!(all.chunks(mine.len()).enumerate().all(|(i, c)| c.iter().all(|x| *x == i as f32 + 1.0)), "all_gather");
            mine.iter_mut().for_each(|x| *x = if r == 0 { 7.0 } else { 0.0 });
            pg.broadcast(&mut mine, 0, &o)?.wait()?;
            anyhow::ensure!(mine.iter().all(|x| *x == 7.0), "broadcast");
            let served = pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense)).unwrap_or_default();
            println!("rank {r}: done on {served} at {:?}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?);
        }
        "adaptive_schemes" => {
            // all_gathers of 1 MiB parts, checked exactly, with each rank's
            // part rewritten before every op: enough of them that shm
            // weighs every scheme of these messages several times
            // (`cma/scheme.rs`).
            let n = 1 << 18;
            let mut all = vec![0u32; n * w];
            for i in 0..1500u32 {
                let mine: Vec<u32> = (0..n as u32).map(|k| k ^ (i << 20) ^ ((r as u32) << 28)).collect();
                pg.all_gather_single(&mut all, &mine, &o)?.wait()?;
                for (src, part) in all.chunks(n).enumerate() {
                    anyhow::ensure!(
                        part.iter().enumerate().all(|(k, x)| *x == k as u32 ^ (i << 20) ^ ((src as u32) << 28)),
                        "all_gather {i}: rank {src}'s part"
                    );
                }
            }
            let served = pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense)).unwrap_or_default();
            println!("rank {r}: done on {served}");
        }
        "late_receiver" => {
            // Rank 0 sends the last rank a message and leaves at once; rank
            // 1 sends it one a second later. The last rank receives rank
            // 1's first, so it waits a second in an op that reads every
            // connection meanwhile, and meets rank 0's leaving there. Then
            // it receives rank 0's message, which came before rank 0 left.
            let last = w - 1;
            let from = |rank: usize| (0..5000).map(|i| (rank * 10_000 + i) as u32).collect::<Vec<_>>();
            pg.barrier(&o)?.wait()?;
            if r == last {
                for peer in [1, 0] {
                    let mut got = vec![0u32; 5000];
                    pg.recv(&mut got, peer, 7, &o)?.wait()?;
                    anyhow::ensure!(got == from(peer), "the message from rank {peer}");
                }
            } else if r < 2 {
                if r == 1 {
                    std::thread::sleep(Duration::from_secs(1));
                }
                pg.send(&from(r)[..], last, 7, &o)?.wait()?;
            }
            let served = pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense)).unwrap_or_default();
            println!("rank {r}: done on {served}");
        }
        "stop_all_gather" => {
            // The last rank stops itself (SIGSTOP; a child kills it 5 s
            // later) in the middle of all_gathers of 1 MiB parts, which
            // senders push straight into receivers' buffers. Each other
            // rank's op fails within its own timeout (WEFT_TIMEOUT_SECONDS)
            // of starting, however the stop caught a copy: no wait of its
            // own outlives the op's deadline.
            let victim = w - 1;
            if r == victim {
                std::process::Command::new("sh").args(["-c", &format!("sleep 5; kill -9 {}", std::process::id())]).spawn()?;
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(400));
                    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP);
                });
            }
            let timeout = weft::timeout_from_env()?;
            let mut v = vec![1f32; 300_000];
            let mut all = vec![0f32; v.len() * w];
            loop {
                let start = Instant::now();
                let Err(e) = pg.all_gather_single(&mut all, &v, &o)?.wait() else {
                    v[0] += 1.0;
                    continue;
                };
                let took = start.elapsed();
                println!("rank {r}: after {took:?}: {e}");
                anyhow::ensure!(r != victim, "the stopped rank failed before it was killed: {e}");
                anyhow::ensure!(took < timeout + Duration::from_millis(1500), "the op took {took:?} with a {timeout:?} timeout");
                anyhow::ensure!(
                    matches!(e.kind(), ErrorKind::Timeout | ErrorKind::PeerLost { .. }),
                    "expected a timeout or a lost peer: {e}"
                );
                return Ok(());
            }
        }
        "sigkill_p2p_batch" => {
            // The last rank kills itself while every other rank waits in a
            // scope on a batch of receives from it (one long, one short)
            // and a send to it: each must get PeerLost naming it.
            let victim = w - 1;
            if r == victim {
                sigkill_self_after(Duration::from_millis(400));
                std::thread::sleep(Duration::from_secs(60));
                anyhow::bail!("still alive");
            }
            let (mut long, mut short) = (vec![0u8; 4 << 20], [0u8; 8]);
            let out = vec![1u8; 4 << 20];
            let e = pg
                .scope(|s| {
                    let batch = s.batch_p2p(vec![P2pOp::recv(&mut long[..], victim, 1), P2pOp::recv(&mut short[..], victim, 2)], &o)?;
                    let send = s.send(&out[..], victim, 3, &o)?;
                    send.wait().and(batch.wait())
                })
                .err()
                .ok_or_else(|| anyhow::anyhow!("the batch finished without its peer"))?;
            println!("rank {r}: {e}");
            anyhow::ensure!(e.kind() == &ErrorKind::PeerLost { rank: victim }, "expected PeerLost {{ rank: {victim} }}, got {e}");
        }
        "window_sigkill" => {
            // The last rank signals rank 0 every 10 ms, then is killed
            // (SIGKILL) while rank 0 waits for its signals (a dead origin)
            // and the others put 4 MiB into it and signal it in a loop (a
            // dead target): each survivor gets PeerLost naming it.
            let victim = w - 1;
            let win = pg.new_window(4 << 20)?;
            let e = if r == victim {
                sigkill_self_after(Duration::from_millis(400));
                loop {
                    win.signal(0, &o)?.wait()?;
                    std::thread::sleep(Duration::from_millis(10));
                }
            } else if r == 0 {
                loop {
                    if let Err(e) = win.wait_signal(victim, &o) {
                        break e;
                    }
                }
            } else {
                let data = vec![r as u8; 4 << 20];
                loop {
                    if let Err(e) = win.put(&data[..], victim, 0, &o).and_then(|w| w.wait()).and_then(|()| win.signal(victim, &o)?.wait()) {
                        break e;
                    }
                }
            };
            println!("rank {r}: {e}");
            anyhow::ensure!(e.kind() == &ErrorKind::PeerLost { rank: victim }, "expected PeerLost {{ rank: {victim} }}, got {e}");
            std::mem::forget(win);
        }
        "default_timeout" => {
            // No per-op timeout: WEFT_TIMEOUT_SECONDS applies.
            if r == 1 {
                let start = Instant::now();
                let mut v = [0u8; 4];
                let e = pg.recv(&mut v[..], 0, 1, &o)?.wait().err().ok_or_else(|| anyhow::anyhow!("recv did not time out"))?;
                anyhow::ensure!(e.kind() == &ErrorKind::Timeout && e.op() == Some("recv"), "{e}");
                anyhow::ensure!(start.elapsed() < Duration::from_secs(10), "took {:?}", start.elapsed());
                println!("rank 1: {e}");
            } else {
                std::thread::sleep(Duration::from_secs(3));
            }
        }
        "all_reduce_hints" => {
            // all_reduce through each path a hint can choose.
            for algo in ["hierarchical", "ring", "recursive_doubling", "halving_doubling"] {
                for n in [1usize, 1000, 300_001] {
                    let mut v: Vec<f64> = (0..n).map(|i| (i % 7) as f64 + r as f64).collect();
                    pg.all_reduce(&mut v, ReduceOp::Avg, &OpOptions::default().hint("algorithm", algo))?.wait()?;
                    let mean = (0..w).map(|k| k as f64).sum::<f64>() / w as f64;
                    anyhow::ensure!(v.iter().enumerate().all(|(i, x)| *x == (i % 7) as f64 + mean), "{algo} n={n}");
                }
            }
            println!("rank {r}: all_reduce hints ok");
        }
        "which_backend" => {
            let name = pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense)).unwrap_or_default();
            let mut v = vec![1u32; 100];
            pg.all_reduce(&mut v, ReduceOp::Sum, &o)?.wait()?;
            anyhow::ensure!(v.iter().all(|x| *x == w as u32), "all_reduce on {name}");
            println!("backend={name}");
        }
        "cuda_conformance" => {
            // CUDA tensors (the emulated GPU under WEFT_CUDA_EMULATION).
            let route = pg.backend_name((weft::DeviceKind::Cuda, weft::Layout::Dense)).unwrap_or_default();
            let cpu = pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense)).unwrap_or_default();
            let place = weft_conformance::cuda::local_placement(r)?;
            let mut checks = weft_conformance::run_on(&pg, 29, Some(place.clone()));
            if route == "cuda-device" {
                // Windows in device memory, mapped across the processes.
                checks.extend(weft_conformance::run_windows_on(&pg, place.clone()));
                // Sends and receives GPU to GPU: every pattern, and no
                // payload byte through the host.
                checks.extend(weft_conformance::run_p2p(&pg, Some(place.clone()), 4 << 20));
                checks.extend(weft_conformance::cuda::p2p_stays_on_the_device(&pg, place));
            }
            let (table, ok) = weft_conformance::summary(&checks);
            anyhow::ensure!(ok, "rank {r} on {route}:\n{table}");
            println!("rank {r}: cuda={route} cpu={cpu}: {} checks passed", checks.len());
        }
        "cuda_capture" => {
            // Collectives captured into a CUDA graph and launched again
            // with new inputs, the ranks' buffers mapped across processes.
            let place = weft_conformance::cuda::local_placement(r)?;
            let checks = weft_conformance::capture::replays(&pg, place);
            let (table, ok) = weft_conformance::summary(&checks);
            anyhow::ensure!(ok, "rank {r}:\n{table}");
            println!("rank {r}: captured collectives replayed right");
        }
        "cuda_p2p_mismatch" => {
            // Two ranks in processes on one GPU disagree on point-to-point
            // ops: a receive of another size, then receives taken in another
            // order than sent. The receiving rank gets InvalidArgument naming
            // the sender, and its later point-to-point ops such an error.
            anyhow::ensure!(w == 2, "two ranks");
            let place = weft_conformance::cuda::local_placement(r)?;
            weft::stream::set_current_stream(Some(place.stream()));
            let o = OpOptions::default().timeout(Duration::from_secs(10));
            let buf = |n: usize| weft_conformance::Buf::from_bytes(weft::DType::U8, &vec![r as u8 + 1; n]).place(Some(&place));
            let (size, order) =
                (std::env::var("WEFT_TEST_CASE").as_deref() == Ok("size"), std::env::var("WEFT_TEST_CASE").as_deref() == Ok("order"));
            if r == 0 {
                let (a, b) = (buf(100)?, buf(100)?);
                pg.send(a.t(), 1, 1, &o)?.wait()?;
                if order {
                    pg.send(b.t(), 1, 2, &o)?.wait()?;
                }
                println!("rank 0: sent");
            } else {
                let (mut a, mut b) = (buf(if size { 200 } else { 100 })?, buf(100)?);
                let got = if order {
                    pg.scope(|s| -> weft::Result<()> {
                        let second = s.recv(b.tm(), 0, 2, &o)?;
                        let first = s.recv(a.tm(), 0, 1, &o)?;
                        first.wait().and(second.wait())
                    })
                } else {
                    pg.recv(a.tm(), 0, 1, &o).and_then(|wk| wk.wait())
                };
                let e = got.err().ok_or_else(|| anyhow::anyhow!("the mismatched receive succeeded"))?;
                anyhow::ensure!(e.kind() == &weft::ErrorKind::InvalidArgument && e.to_string().contains("rank 0"), "{e}");
                let later = pg.send(b.t(), 0, 3, &o).and_then(|wk| wk.wait()).err().ok_or_else(|| anyhow::anyhow!("a later send ran"))?;
                // (The error of whichever failed receive came last.)
                anyhow::ensure!(
                    later.kind() == &weft::ErrorKind::InvalidArgument && later.to_string().contains("rank 0"),
                    "later: {later}"
                );
                println!("rank 1: refused: {e}");
            }
        }
        "cuda_unexported" => {
            // Rank 0's buffer is pinned host memory, which CUDA IPC cannot
            // export: cuda-device's direct all-reduce cannot map it, so every
            // rank runs the ring instead, or, where the direct algorithm is
            // required, fails saying whose buffer it was.
            let g = weft_cuda_driver::gpu().map_err(anyhow::Error::msg)?;
            let stream = g.new_stream(0)?;
            let n = 100_003;
            let data: Vec<f32> = (0..n).map(|i| (i % 13) as f32 + r as f32).collect();
            let bytes = n * 4;
            let addr = if r == 0 { g.alloc_pinned(bytes)? as u64 } else { g.alloc(0, bytes)? };
            let deadline = || Instant::now() + Duration::from_secs(30);
            let all_reduce = |hint: &str| -> anyhow::Result<Vec<f32>> {
                let mut out = vec![0f32; n];
                // SAFETY: `data` and `out` outlive the stream synchronisations
                // below; `addr` holds `bytes` until the process exits.
                unsafe { g.copy_htod(stream, addr, data.as_ptr() as *const u8, bytes)? };
                let t = unsafe { weft_cuda_driver::tensor_mut_from_raw(addr, weft::DType::F32, 0, &[n]) }?;
                let done = pg.all_reduce(t, ReduceOp::Sum, &o.clone().stream(stream).hint("cuda_algorithm", hint))?.synchronize();
                // SAFETY: as above.
                unsafe { g.copy_dtoh(stream, out.as_mut_ptr() as *mut u8, addr, bytes)? };
                weft_cuda_driver::synchronize_stream(&*g, 0, stream, deadline(), "download")?;
                done?;
                Ok(out)
            };
            let out = all_reduce("auto")?;
            let sum = (w * (w - 1) / 2) as f32;
            anyhow::ensure!(out.iter().enumerate().all(|(i, x)| *x == w as f32 * (i % 13) as f32 + sum), "rank {r}: wrong sum");
            let e = all_reduce("direct").err().ok_or_else(|| anyhow::anyhow!("cuda_algorithm=direct ran with an unexported buffer"))?;
            let e = e.downcast::<weft::Error>()?;
            anyhow::ensure!(e.kind() == &ErrorKind::Unsupported && e.to_string().contains("rank(s) [0]"), "rank {r}: {e}");
            println!("rank {r}: fell back to the ring; direct refused: {e}");
        }
        "cuda_staging_disagrees" => {
            // The ranks were given different cuda_direct_staged_bytes: a
            // clear error on every rank, not a timeout.
            let g = weft_cuda_driver::gpu().map_err(anyhow::Error::msg)?;
            let addr = g.alloc(0, 4096)?;
            // SAFETY: 1024 f32 of device memory, alive until the process exits.
            let t = unsafe { weft_cuda_driver::tensor_mut_from_raw(addr, weft::DType::F32, 0, &[1024]) }?;
            let o = o.clone().hint("cuda_algorithm", "direct").timeout(Duration::from_secs(20));
            let e = pg.all_reduce(t, ReduceOp::Sum, &o)?.synchronize().err().ok_or_else(|| anyhow::anyhow!("no error"))?;
            anyhow::ensure!(e.kind() == &ErrorKind::InvalidArgument && e.to_string().contains("cuda_direct_staged_bytes"), "rank {r}: {e}");
            println!("rank {r}: {e}");
        }
        "cuda_sigkill" => {
            // The last rank dies during CUDA all_reduces; the others must
            // get PeerLost naming it, in seconds.
            let victim = w - 1;
            if r == victim {
                sigkill_self_after(Duration::from_millis(300));
            }
            let g = weft_cuda_driver::gpu().map_err(anyhow::Error::msg)?;
            let n = 4 << 20;
            let addr = g.alloc(0, n * 4)?;
            // SAFETY: n f32 of device memory, alive until the process exits.
            let mut t = unsafe { weft_cuda_driver::tensor_mut_from_raw(addr, weft::DType::F32, 0, &[n]) }?;
            loop {
                if let Err(e) = pg.all_reduce(t.reborrow(), ReduceOp::Sum, &o)?.synchronize() {
                    println!("rank {r}: {e}");
                    anyhow::ensure!(e.kind() == &ErrorKind::PeerLost { rank: victim }, "expected PeerLost {{ rank: {victim} }}, got {e}");
                    // Stay a moment, so the other survivor blames the
                    // victim, not this rank's exit.
                    std::thread::sleep(Duration::from_secs(1));
                    break;
                }
            }
        }
        "p2p" => {
            let checks = weft_conformance::run_p2p(&pg, None, 16 << 20);
            let (table, ok) = weft_conformance::summary(&checks);
            anyhow::ensure!(ok, "rank {r}:\n{table}");
            println!("rank {r}: {} p2p checks passed on {:?}", checks.len(), pg);
        }
        "windows" => {
            let checks = weft_conformance::run_windows(&pg, 1 << 20);
            let (table, ok) = weft_conformance::summary(&checks);
            anyhow::ensure!(ok, "rank {r}:\n{table}");
            println!("rank {r}: {} window checks passed on {:?}", checks.len(), pg);
        }
        "shrink" => shrink_scenario(pg)?,
        "conformance" => {
            conform(&pg, false)?;
            println!("rank {r}: checks passed on {pg:?}");
        }
        "debug_mismatch" => {
            let mut v = vec![0f32; 8];
            let e = if r == 0 {
                pg.all_reduce(&mut v, ReduceOp::Sum, &o)?.wait()
            } else {
                pg.all_gather_single(&mut v[..2 * w], &[0f32; 2][..], &o)?.wait()
            };
            let e = e.err().ok_or_else(|| anyhow::anyhow!("mismatch not detected"))?;
            println!("rank {r}: {e}");
            anyhow::ensure!(e.to_string().contains("rank(s) [0] called all_reduce"), "detail message: {e}");
        }
        "flood" => flood_scenario(&pg)?,
        "flood_then_long" => flood_then_long_scenario(&pg)?,
        other => anyhow::bail!("unknown scenario {other:?}"),
    }
    Ok(())
}

/// The conformance suite on `pg` (CUDA tensors too with `cuda`), failing
/// with the table of what went wrong.
fn conform(pg: &ProcessGroup, cuda: bool) -> anyhow::Result<()> {
    let checks = if cuda {
        weft_conformance::run_on(pg, 5, Some(weft_conformance::cuda::local_placement(pg.rank())?))
    } else {
        weft_conformance::run(pg, 5)
    };
    let (table, ok) = weft_conformance::summary(&checks);
    anyhow::ensure!(ok, "rank {}:\n{table}", pg.rank());
    Ok(())
}

/// How a mapping of shm's segment (a memfd) shows in /proc/self/maps.
const SEGMENT: &str = "/memfd:weft-shm-";

/// weft's shm segments this process has mapped.
fn mapped_segments() -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut names: Vec<&str> = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).filter(|p| p.starts_with(SEGMENT)).collect();
    names.sort_unstable();
    names.dedup();
    names.len()
}

/// Collectives of every kind in turn on `group` until one fails: its error.
fn collectives_until_an_error(group: &ProcessGroup) -> weft::Error {
    let o = OpOptions::default();
    let n = group.size();
    let (mut v, mut all, parts) = (vec![1f32; 1 << 14], vec![0f32; n << 14], vec![2f32; n << 14]);
    (0..)
        .find_map(|i| {
            let work = match i % 6 {
                0 => group.all_reduce(&mut v, ReduceOp::Sum, &o),
                1 => group.all_gather_single(&mut all, &v, &o),
                2 => group.broadcast(&mut v, i % n, &o),
                3 => group.reduce_scatter_single(&mut v[..1 << 10], &all[..n << 10], ReduceOp::Max, &o),
                4 => group.all_to_all_single(&mut all, &parts, &o),
                _ => group.barrier(&o),
            };
            work.and_then(|w| w.wait()).err()
        })
        .expect("the loop ends with an error")
}

/// Nanoseconds since the epoch (comparable between processes of a host).
fn epoch_nanos() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos()
}

/// The `shrink` scenario: ranks die (or stop, or nobody dies and rank 0
/// revokes) at a random moment of a stream of collectives of every kind;
/// the survivors agree on the failed group, shrink, split the new group,
/// run the conformance suite on it and agree again.
/// `WEFT_TEST_VICTIMS`: the original ranks to lose, one per round
/// (default: the last); `WEFT_TEST_HOW`: `kill` (default), `stop`,
/// `revoke` or `exclude` (nobody dies; the victims are left out);
/// `WEFT_TEST_CUDA=1`: the suite runs on (emulated) CUDA tensors too.
fn shrink_scenario(pg: ProcessGroup) -> anyhow::Result<()> {
    use weft::ShrinkOptions;
    let (me, w) = (pg.rank(), pg.size());
    let victims: Vec<usize> = match std::env::var("WEFT_TEST_VICTIMS") {
        Ok(v) => v.split(',').map(str::parse).collect::<Result<_, _>>()?,
        Err(_) => vec![w - 1],
    };
    let how = std::env::var("WEFT_TEST_HOW").unwrap_or_else(|_| "kill".into());
    let cuda = std::env::var("WEFT_TEST_CUDA").as_deref() == Ok("1");
    if how == "exclude" {
        // Nobody dies: every rank shrinks, leaving out the "victims".
        return match pg.shrink(&ShrinkOptions::default().exclude(victims.clone())) {
            Ok(g) => {
                anyhow::ensure!(!victims.contains(&me) && g.size() == w - victims.len(), "shrunk to {} ranks", g.size());
                conform(&g, cuda)?;
                println!("rank {me}: {} survivors ok", g.size());
                Ok(())
            }
            Err(e) if victims.contains(&me) && e.kind() == &ErrorKind::Aborted => {
                println!("rank {me}: excluded: {e}");
                Ok(())
            }
            Err(e) => Err(e.into()),
        };
    }
    println!("rank {me}: backend={}", pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense)).unwrap_or_default());
    let store = weft::launch::LaunchEnv::from_env()?.connect_store(Duration::from_secs(30))?;
    let shm = std::env::var("WEFT_BACKEND").is_ok_and(|b| b.ends_with("shm"));
    let mut group = pg;
    let mut alive: Vec<usize> = (0..w).collect();
    for (round, &victim) in victims.iter().enumerate() {
        let lost = alive.iter().position(|&x| x == victim).expect("a victim of a later round is alive");
        // Somewhere in 100-600 ms of collectives.
        let when = Duration::from_millis(100 + (epoch_nanos() % 500) as u64);
        if me == victim && how != "revoke" {
            store.set(&format!("test/pid/{round}"), std::process::id().to_string().as_bytes())?;
            let (store, how) = (store.clone(), how.clone());
            std::thread::spawn(move || {
                std::thread::sleep(when);
                let _ = store.set(&format!("test/lost_at/{round}"), epoch_nanos().to_string().as_bytes());
                let signal = if how == "stop" { nix::sys::signal::Signal::SIGSTOP } else { nix::sys::signal::Signal::SIGKILL };
                let _ = nix::sys::signal::raise(signal);
            });
        }
        let e = std::thread::scope(|t| {
            if how == "revoke" && group.rank() == 0 {
                // Revoked while every rank is in some collective.
                let g = &group;
                t.spawn(move || {
                    std::thread::sleep(when);
                    g.revoke();
                });
            }
            collectives_until_an_error(&group)
        });
        let failed_at = Instant::now();
        println!("rank {me}: round {round}: {} failed: {e}", e.op().unwrap_or("?"));
        match how.as_str() {
            "revoke" => anyhow::ensure!(e.kind() == &ErrorKind::Aborted, "revoked: expected Aborted, got {e}"),
            "kill" => anyhow::ensure!(e.kind() == &ErrorKind::PeerLost { rank: lost }, "expected PeerLost {{ rank: {lost} }}, got {e}"),
            // Stopped: a rank that timed out blames the peer it waited for
            // (the stopped one, or one waiting for it), and the others hear
            // of that peer, not of the rank that gave up.
            _ if me != victim => {
                let blamed = e.blamed_peer();
                anyhow::ensure!(blamed.is_some_and(|p| p != group.rank()), "expected a peer blamed, got {e}");
                println!("rank {me}: round {round}: blames rank {}", alive[blamed.unwrap_or_default()]);
            }
            _ => {}
        }
        let opts = if how == "stop" { ShrinkOptions::default().wait(Duration::from_secs(1)) } else { ShrinkOptions::default() };
        // The survivors agree on the failed group first.
        let flag = u64::MAX ^ (1 << me);
        let agreed = match group.agree(flag, &opts) {
            Ok(v) => v,
            Err(e) if me == victim => return resumed_and_left_out(e),
            Err(e) => return Err(e.into()),
        };
        let survivors: Vec<usize> = if how == "revoke" { alive.clone() } else { alive.iter().copied().filter(|&x| x != victim).collect() };
        let want = survivors.iter().fold(u64::MAX, |v, r| v & (u64::MAX ^ (1 << r)));
        anyhow::ensure!(agreed == want, "agree on the failed group gave {agreed:#x}, expected {want:#x}");
        let shrunk = match group.shrink(&opts) {
            Ok(g) => g,
            Err(e) if me == victim => return resumed_and_left_out(e),
            Err(e) => return Err(e.into()),
        };
        let took = failed_at.elapsed();
        alive = survivors;
        anyhow::ensure!(shrunk.size() == alive.len(), "shrunk to {} ranks, expected {alive:?}", shrunk.size());
        anyhow::ensure!(Some(shrunk.rank()) == alive.iter().position(|&x| x == me), "new rank {} in {alive:?}", shrunk.rank());
        if how != "revoke" {
            let lost_at: u128 = String::from_utf8(store.get(&format!("test/lost_at/{round}"), Duration::from_secs(10))?)?.parse()?;
            let after = epoch_nanos().saturating_sub(lost_at) / 1_000_000;
            println!("rank {me}: round {round}: usable {after} ms after the loss (shrink {} ms)", took.as_millis());
        }
        if how == "stop" && shrunk.rank() == 0 {
            // Resume the stopped rank now: what it still sends on the old
            // group while the new one runs must not reach the new one.
            let pid: i32 = String::from_utf8(store.get(&format!("test/pid/{round}"), Duration::from_secs(10))?)?.parse()?;
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGCONT)?;
        }
        // The shrunk group splits, passes the suite and agrees like any other.
        let halves = shrunk.split(&(0..shrunk.size()).step_by(2).collect::<Vec<_>>())?;
        if let Some(h) = &halves {
            h.barrier(&OpOptions::default())?.wait()?;
        }
        conform(&shrunk, cuda)?;
        let mine = u64::MAX ^ (1 << shrunk.rank());
        let agreed = shrunk.agree(mine, &ShrinkOptions::default())?;
        let want = (0..shrunk.size()).fold(u64::MAX, |v, r| v & (u64::MAX ^ (1 << r)));
        anyhow::ensure!(agreed == want, "agree gave {agreed:#x}, expected {want:#x}");
        drop(halves);
        group = shrunk;
        // The old group's segment is unmapped with it (the new group's stays).
        if shm {
            anyhow::ensure!(
                mapped_segments() == 1,
                "{} shm segments still mapped: {}",
                mapped_segments(),
                std::fs::read_to_string("/proc/self/maps")
                    .unwrap_or_default()
                    .lines()
                    .filter(|l| l.contains(SEGMENT))
                    .collect::<Vec<_>>()
                    .join("\n")
            );
        }
    }
    println!("rank {me}: {} survivors ok", alive.len());
    Ok(())
}

/// A stopped rank, resumed after the others shrank without it: its next
/// survey tells it it was left out.
fn resumed_and_left_out(e: weft::Error) -> anyhow::Result<()> {
    anyhow::ensure!(e.kind() == &ErrorKind::Aborted && e.to_string().contains("left out"), "the resumed rank: {e}");
    println!("left out after resuming: {e}");
    Ok(())
}

/// Messages rank 1 sends rank 0 in the `flood` scenario, and their size.
const FLOOD: (usize, usize) = (4000, 64 << 10);

/// Peak resident memory of this process so far (VmHWM), in bytes.
fn peak_rss() -> anyhow::Result<usize> {
    weft_tests::procs::status_bytes(None, "VmHWM").ok_or_else(|| anyhow::anyhow!("no VmHWM in /proc/self/status"))
}

/// Rank 1 sends rank 0 `FLOOD` messages at once while rank 0 waits 3 s
/// for a message from rank 2: rank 0 keeps at most its budget for early
/// messages (WEFT_EARLY_BYTES) of them, and rank 1's sends wait; then
/// rank 0 receives them all, in order. Prints rank 0's peak growth.
fn flood_scenario(pg: &ProcessGroup) -> anyhow::Result<()> {
    let o = OpOptions::default();
    let (count, size) = FLOOD;
    match pg.rank() {
        0 => {
            let before = peak_rss()?;
            let mut b = [0u8; 8];
            pg.recv(&mut b[..], 2, 8, &o)?.wait()?;
            let grew = peak_rss()?.saturating_sub(before);
            println!("rank 0: peak RSS grew by {} KiB while flooded", grew >> 10);
            let budget: usize = std::env::var("WEFT_EARLY_BYTES")?.parse()?;
            anyhow::ensure!(grew < budget + (16 << 20), "peak RSS grew by {grew} bytes, over the {budget}-byte budget");
            receive_numbered(pg, count, size)?;
        }
        1 => {
            let data = numbered(count, size);
            let works = data.chunks(size).map(|m| pg.send(m, 0, 7, &o)).collect::<weft::Result<Vec<_>>>()?;
            for w in works {
                w.wait()?;
            }
        }
        _ => {
            std::thread::sleep(Duration::from_secs(3));
            pg.send(&[1u8; 8][..], 0, 8, &o)?.wait()?;
        }
    }
    pg.barrier(&o)?.wait()?;
    Ok(())
}

/// Rank 1 sends rank 0 more small messages than rank 0's budget for early
/// messages, then waits for a long message from rank 0, which rank 0 sends
/// before it receives the small ones. A correct program: on cpu-tcp the
/// go-ahead for the long message travels behind the small ones, so rank 0
/// must read past its budget while its send waits for it.
fn flood_then_long_scenario(pg: &ProcessGroup) -> anyhow::Result<()> {
    let o = OpOptions::default();
    let (count, size, long) = (200, 64 << 10, 2 << 20);
    match pg.rank() {
        0 => {
            pg.send(&vec![5u8; long][..], 1, 8, &o)?.wait()?;
            receive_numbered(pg, count, size)?;
        }
        1 => {
            let data = numbered(count, size);
            let works = data.chunks(size).map(|m| pg.send(m, 0, 7, &o)).collect::<weft::Result<Vec<_>>>()?;
            let mut got = vec![0u8; long];
            pg.recv(&mut got[..], 0, 8, &o)?.wait()?;
            anyhow::ensure!(got.iter().all(|x| *x == 5), "the long message arrived damaged");
            for w in works {
                w.wait()?;
            }
        }
        _ => {}
    }
    pg.barrier(&o)?.wait()?;
    Ok(())
}

/// `count` messages of `size` bytes, message i all bytes i (mod 256), one
/// after the other.
fn numbered(count: usize, size: usize) -> Vec<u8> {
    (0..count).flat_map(|i| std::iter::repeat_n(i as u8, size)).collect()
}

/// Receive [`numbered`] messages from rank 1 under tag 7, checking each.
fn receive_numbered(pg: &ProcessGroup, count: usize, size: usize) -> anyhow::Result<()> {
    let mut m = vec![0u8; size];
    for i in 0..count {
        pg.recv(&mut m[..], 1, 7, &OpOptions::default())?.wait()?;
        anyhow::ensure!(m.iter().all(|x| *x == i as u8), "message {i} arrived out of order or damaged");
    }
    Ok(())
}
