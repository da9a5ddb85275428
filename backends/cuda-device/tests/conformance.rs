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

/// An all_reduce and an all_gather told to use an algorithm where core
/// chooses for every backend (hint `algorithm`, without `cuda_algorithm`):
/// cuda-device's own `direct` stays on the device and `staging` goes
/// through the host (the emulated GPU counts the payload bytes), `ring` is
/// all_reduce's device ring, core's others run staged; each is exact, and
/// a name no one offers is refused.
#[test]
fn a_named_algorithm_runs_on_the_device_ring_or_staged() {
    let _gpu = weft_conformance::cuda::exclusive();
    link();
    on_threads("cpu:shm,cuda:cuda-device", &[], 3, |pg, p| {
        use weft::prelude::*;
        // The ops on the stream the buffers' copies use.
        weft::stream::set_current_stream(Some(p.stream()));
        let emulated = std::env::var("WEFT_TEST_REAL_GPU").as_deref() != Ok("1");
        let r = pg.rank() as f32;
        let place = |v: f32, n: usize| {
            weft_conformance::Buf::from_bytes(weft::DType::F32, &vec![v; n].into_iter().flat_map(f32::to_ne_bytes).collect::<Vec<u8>>())
                .place(Some(&p))
        };
        // The payload bytes between host and device (of every rank: they
        // share this process) while `op` runs, between barriers.
        let o = OpOptions::default();
        let counted = |op: &mut dyn FnMut() -> weft::Result<()>| -> weft::Result<u64> {
            pg.barrier(&o)?.wait()?;
            let before = weft_cuda_driver::emulated::host_bytes();
            let r = op();
            pg.barrier(&o)?.wait()?;
            let moved = weft_cuda_driver::emulated::host_bytes() - before;
            pg.barrier(&o)?.wait()?;
            r.map(|()| moved)
        };
        // Each run: (result, want, payload bytes through the host).
        let all_reduce = |algo: &str| -> weft::Result<(Vec<u8>, Vec<u8>, u64)> {
            let mut b = place(r + 1.0, 1000)?;
            let moved = counted(&mut || pg.all_reduce(b.tm(), weft::ReduceOp::Sum, &o.clone().hint("algorithm", algo))?.wait())?;
            Ok((b.read()?, [6.0f32; 1000].map(f32::to_ne_bytes).concat(), moved))
        };
        let all_gather = |algo: &str| -> weft::Result<(Vec<u8>, Vec<u8>, u64)> {
            let input = place(r + 1.0, 500)?;
            let mut outs = (0..3).map(|_| place(0.0, 500)).collect::<weft::Result<Vec<_>>>()?;
            let moved = counted(&mut || {
                pg.all_gather(outs.iter_mut().map(weft_conformance::Buf::tm).collect(), input.t(), &o.clone().hint("algorithm", algo))?
                    .wait()
            })?;
            let got: Vec<u8> = outs.iter().map(weft_conformance::Buf::read).collect::<weft::Result<Vec<_>>>()?.concat();
            let want = (1..=3).flat_map(|k| vec![k as f32; 500]).flat_map(f32::to_ne_bytes).collect();
            Ok((got, want, moved))
        };
        let cases: [(&'static str, &str, Option<bool>); 10] = [
            // (op, algorithm, whether payload stays on the device, if known)
            ("all_reduce", "ring", Some(true)),
            ("all_reduce", "recursive_doubling", Some(false)),
            ("all_reduce", "halving_doubling", Some(false)),
            ("all_reduce", "auto", Some(true)),
            ("all_reduce", "direct", Some(true)),
            ("all_reduce", "staging", Some(false)),
            ("all_gather", "direct", Some(true)),
            ("all_gather", "staging", Some(false)),
            ("all_gather", "at_once", Some(false)),
            ("all_gather", "no_such", None),
        ];
        cases
            .into_iter()
            .map(|(op, algo, resident)| {
                let got = if op == "all_reduce" { all_reduce(algo) } else { all_gather(algo) };
                let (passed, detail) = match (got, resident) {
                    (Err(e), None) => {
                        (e.kind() == &weft::ErrorKind::InvalidArgument && e.to_string().contains("no algorithm"), e.to_string())
                    }
                    (Ok(_), None) => (false, "an unknown name ran".into()),
                    (Err(e), Some(_)) => (false, e.to_string()),
                    (Ok((got, want, _)), _) if got != want => (false, "wrong result".into()),
                    (Ok((_, _, moved)), Some(resident)) if emulated && (moved == 0) != resident => {
                        (false, format!("{moved} payload bytes through the host"))
                    }
                    (Ok(_), _) => (true, String::new()),
                };
                Check {
                    op: "an op with a named algorithm",
                    dtype: weft::DType::F32,
                    redop: None,
                    passed,
                    detail: format!("{op} {algo}: {detail}"),
                }
            })
            .collect()
    });
}

/// Every collective but point-to-point runs device to device: no payload
/// byte between host and device (the emulated GPU counts them) while the
/// ops run, staged through the staging buffers (small) or not, with exact
/// results. cuda-host-staging, run the same way, moves them: the count
/// sees the fallback when there is one.
#[test]
fn collectives_move_no_payload_through_the_host() {
    let _gpu = weft_conformance::cuda::exclusive();
    link();
    if std::env::var("WEFT_TEST_REAL_GPU").as_deref() == Ok("1") {
        return; // (Only the emulation counts.)
    }
    for w in 2..=4 {
        on_threads("cpu:shm,cuda:cuda-device", &[], w, |pg, p| device_resident(pg, p, true));
        on_threads("cpu:shm,cuda:cuda-device", &[("cuda_direct_staged_bytes", "0")], w, |pg, p| device_resident(pg, p, true));
    }
    on_threads("cpu:shm,cuda:cuda-host-staging", &[], 3, |pg, p| device_resident(pg, p, false));
}

/// The ops of [`collectives_move_no_payload_through_the_host`] on `pg`;
/// `resident`: whether none may copy payload through the host.
fn device_resident(pg: &weft::ProcessGroup, p: SharedPlacement, resident: bool) -> Vec<Check> {
    use weft::prelude::*;
    use weft::DType;
    use weft_conformance::Buf;
    weft::stream::set_current_stream(Some(p.stream()));
    let (r, w) = (pg.rank(), pg.size());
    let n = 3001;
    let o = OpOptions::default();
    // Part `k` of rank `seed`'s data: small integers, exact in f32.
    let part = |seed: usize, k: usize| -> Vec<f32> { (0..n).map(|i| ((seed * 7 + k * 3 + i) % 101) as f32).collect() };
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_ne_bytes()).collect() };
    let place = |v: &[f32]| Buf::from_bytes(DType::F32, &bytes(v)).place(Some(&p));
    let sum = |k: usize| -> Vec<f32> { (0..n).map(|i| (0..w).map(|s| part(s, k)[i]).sum()).collect() };
    let max = |k: usize| -> Vec<f32> { (0..n).map(|i| (0..w).map(|s| part(s, k)[i]).fold(f32::MIN, f32::max)).collect() };
    type Case<'a> = (&'static str, Box<dyn Fn() -> weft::Result<(Vec<u8>, Vec<u8>)> + 'a>);
    // Each case: buffers placed, then (between barriers, counted) the op,
    // then its outputs read back against what they should hold.
    let counted = |run: &mut dyn FnMut() -> weft::Result<()>| -> weft::Result<u64> {
        pg.barrier(&o)?.wait()?;
        let before = weft_cuda_driver::emulated::host_bytes();
        run()?;
        pg.barrier(&o)?.wait()?;
        let moved = weft_cuda_driver::emulated::host_bytes() - before;
        pg.barrier(&o)?.wait()?;
        Ok(moved)
    };
    let moved = std::cell::Cell::new(0u64);
    let count = |run: &mut dyn FnMut() -> weft::Result<()>| -> weft::Result<()> {
        moved.set(counted(run)?);
        Ok(())
    };
    let read = |bufs: &[Buf]| -> weft::Result<Vec<u8>> { Ok(bufs.iter().map(Buf::read).collect::<weft::Result<Vec<_>>>()?.concat()) };
    let cases: Vec<Case<'_>> = vec![
        (
            "broadcast",
            Box::new(|| {
                let mut b = place(&if r == w - 1 { part(9, 0) } else { vec![0.0; n] })?;
                count(&mut || pg.broadcast(b.tm(), w - 1, &o)?.wait())?;
                Ok((b.read()?, bytes(&part(9, 0))))
            }),
        ),
        (
            "reduce",
            Box::new(|| {
                let mut b = place(&part(r, 0))?;
                count(&mut || pg.reduce(b.tm(), 0, ReduceOp::Sum, &o)?.wait())?;
                Ok((b.read()?, bytes(&if r == 0 { sum(0) } else { part(r, 0) })))
            }),
        ),
        (
            "all_gather",
            Box::new(|| {
                let input = place(&part(r, 0))?;
                let mut outs = (0..w).map(|_| place(&vec![0.0; n])).collect::<weft::Result<Vec<_>>>()?;
                count(&mut || pg.all_gather(outs.iter_mut().map(Buf::tm).collect(), input.t(), &o)?.wait())?;
                Ok((read(&outs)?, (0..w).flat_map(|s| bytes(&part(s, 0))).collect()))
            }),
        ),
        (
            "reduce_scatter",
            Box::new(|| {
                let ins = (0..w).map(|k| place(&part(r, k))).collect::<weft::Result<Vec<_>>>()?;
                let mut out = place(&vec![0.0; n])?;
                count(&mut || pg.reduce_scatter(out.tm(), ins.iter().map(Buf::t).collect(), ReduceOp::Max, &o)?.wait())?;
                Ok((out.read()?, bytes(&max(r))))
            }),
        ),
        (
            "all_to_all",
            Box::new(|| {
                let ins = (0..w).map(|k| place(&part(r, k))).collect::<weft::Result<Vec<_>>>()?;
                let mut outs = (0..w).map(|_| place(&vec![0.0; n])).collect::<weft::Result<Vec<_>>>()?;
                count(&mut || pg.all_to_all(outs.iter_mut().map(Buf::tm).collect(), ins.iter().map(Buf::t).collect(), &o)?.wait())?;
                Ok((read(&outs)?, (0..w).flat_map(|s| bytes(&part(s, r))).collect()))
            }),
        ),
        (
            "gather",
            Box::new(|| {
                let input = place(&part(r, 1))?;
                let mut outs = if r == 1 { (0..w).map(|_| place(&vec![0.0; n])).collect::<weft::Result<Vec<_>>>()? } else { vec![] };
                count(&mut || pg.gather(outs.iter_mut().map(Buf::tm).collect(), input.t(), 1, &o)?.wait())?;
                let want: Vec<u8> = if r == 1 { (0..w).flat_map(|s| bytes(&part(s, 1))).collect() } else { vec![] };
                Ok((read(&outs)?, want))
            }),
        ),
        (
            "scatter",
            Box::new(|| {
                let ins = if r == 0 { (0..w).map(|k| place(&part(5, k))).collect::<weft::Result<Vec<_>>>()? } else { vec![] };
                let mut out = place(&vec![0.0; n])?;
                count(&mut || pg.scatter(out.tm(), ins.iter().map(Buf::t).collect(), 0, &o)?.wait())?;
                Ok((out.read()?, bytes(&part(5, r))))
            }),
        ),
    ];
    cases
        .into_iter()
        .map(|(op, run)| {
            let (passed, detail) = match run() {
                Ok((got, want)) if got != want => (false, "wrong result".to_string()),
                Ok(_) if resident && moved.get() > 0 => (false, format!("{} payload bytes through the host", moved.get())),
                Ok(_) if !resident && moved.get() == 0 => (false, "staged through the host, yet no byte counted".to_string()),
                Ok(_) => (true, String::new()),
                Err(e) => (false, e.to_string()),
            };
            Check { op, dtype: DType::F32, redop: None, passed, detail }
        })
        .collect()
}

/// Ranks that disagree on a pulled collective's sizes or root get
/// `InvalidArgument` on every rank before anything is read, never a copy
/// past a buffer's end or a hang: all_to_all's counts (which core's tags do
/// not carry) by the records' own checks; a broadcast's root by core's
/// tags, or the records'.
#[test]
fn pulled_collectives_that_disagree_are_refused_on_every_rank() {
    let _gpu = weft_conformance::cuda::exclusive();
    link();
    for staged in ["16777216", "0"] {
        on_threads("cpu:shm,cuda:cuda-device", &[("cuda_direct_staged_bytes", staged)], 2, disagreeing);
    }
}

fn disagreeing(pg: &weft::ProcessGroup, p: SharedPlacement) -> Vec<Check> {
    use weft::prelude::*;
    use weft::{DType, ErrorKind};
    use weft_conformance::Buf;
    weft::stream::set_current_stream(Some(p.stream()));
    let r = pg.rank();
    let o = OpOptions::default().timeout(std::time::Duration::from_secs(20));
    let place = |n: usize| Buf::zeros(DType::F32, n).place(Some(&p));
    let refused = |what: &'static str, e: weft::Result<()>, says: &str| {
        let (passed, detail) = match e {
            Err(e) if e.kind() == &ErrorKind::InvalidArgument && e.to_string().contains(says) => (true, String::new()),
            Err(e) => (false, format!("another error: {e}")),
            Ok(()) => (false, "ran".to_string()),
        };
        Check { op: what, dtype: DType::F32, redop: None, passed, detail }
    };
    let run = || -> weft::Result<Vec<Check>> {
        // Rank 1 sends and expects parts of 101 elements, rank 0 of 100.
        let ins = [place(100 + r)?, place(100 + r)?];
        let mut outs = [place(100 + r)?, place(100 + r)?];
        let counts = pg.all_to_all(outs.iter_mut().map(Buf::tm).collect(), ins.iter().map(Buf::t).collect(), &o).and_then(|w| w.wait());
        // Each rank names itself the root.
        let mut b = place(10)?;
        let roots = pg.broadcast(b.tm(), r, &o).and_then(|w| w.wait());
        Ok(vec![
            refused("all_to_all of different counts", counts, "mismatched sizes"),
            refused("broadcast from different roots", roots, "mismatch"),
        ])
    };
    run().unwrap_or_else(|e| vec![Check { op: "disagreeing", dtype: DType::F32, redop: None, passed: false, detail: e.to_string() }])
}

/// A reduction the device path cannot run (here: PremulSum factors that
/// differ between the ranks, which only scaling each input first serves)
/// is staged through the host with the right result under `auto`, and is
/// `Unsupported` on every rank under `cuda_algorithm=direct`.
#[test]
fn a_pulled_collective_that_cannot_run_on_the_device_is_staged_or_refused_alike() {
    let _gpu = weft_conformance::cuda::exclusive();
    link();
    for staged in ["16777216", "0"] {
        on_threads("cpu:shm,cuda:cuda-device", &[("cuda_direct_staged_bytes", staged)], 3, |pg, p| premul_factors(pg, p, false));
        let hints = [("cuda_direct_staged_bytes", staged), ("cuda_algorithm", "direct")];
        on_threads("cpu:shm,cuda:cuda-device", &hints, 3, |pg, p| premul_factors(pg, p, true));
    }
}

fn premul_factors(pg: &weft::ProcessGroup, p: SharedPlacement, direct: bool) -> Vec<Check> {
    use weft::prelude::*;
    use weft::{DType, ErrorKind};
    use weft_conformance::Buf;
    weft::stream::set_current_stream(Some(p.stream()));
    let (r, w) = (pg.rank(), pg.size());
    let n = 257;
    let o = OpOptions::default().timeout(std::time::Duration::from_secs(20));
    // Rank k's part for rank j: k + j + i % 5; scaled by its factor 1 / 2^(k+1).
    let part = |k: usize, j: usize| -> Vec<u8> { (0..n).flat_map(|i| ((k + j + i % 5) as f32).to_ne_bytes()).collect() };
    let factor = |k: usize| 1.0 / f64::from(1u32 << (k + 1));
    let run = || -> weft::Result<(Vec<u8>, weft::Result<()>)> {
        let ins = (0..w).map(|j| Buf::from_bytes(DType::F32, &part(r, j)).place(Some(&p))).collect::<weft::Result<Vec<_>>>()?;
        let mut out = Buf::zeros(DType::F32, n).place(Some(&p))?;
        let done = pg.reduce_scatter(out.tm(), ins.iter().map(Buf::t).collect(), ReduceOp::PremulSum(factor(r)), &o).and_then(|x| x.wait());
        Ok((out.read()?, done))
    };
    let want: Vec<u8> =
        (0..n).flat_map(|i| ((0..w).map(|k| (k + r + i % 5) as f64 * factor(k)).sum::<f64>() as f32).to_ne_bytes()).collect();
    let (passed, detail) = match run() {
        Ok((_, Err(e))) if direct && e.kind() == &ErrorKind::Unsupported && e.to_string().contains("another factor") => {
            (true, String::new())
        }
        Ok((got, Ok(()))) if !direct && got == want => (true, String::new()),
        Ok((_, Ok(()))) if direct => (false, "ran on the device".to_string()),
        Ok((_, Ok(()))) => (false, "wrong result".to_string()),
        Ok((_, Err(e))) | Err(e) => (false, e.to_string()),
    };
    vec![Check { op: "reduce_scatter with per-rank PremulSum factors", dtype: DType::F32, redop: None, passed, detail }]
}

/// An op issued on a stream that is capturing a CUDA graph, which would
/// run through the host (cuda-host-staging, point-to-point included; on
/// cuda-device the ring and staged ops), is refused on every rank, naming the op
/// and the capture, before it touches a stream: the capture stays valid
/// (the emulation invalidates one that a host copy or a host wait touches,
/// as a device does), records nothing, and the group runs the same ops
/// once the capture has ended.
#[test]
fn ops_on_a_capturing_stream_are_refused_and_the_capture_stays_valid() {
    let _gpu = weft_conformance::cuda::exclusive();
    link();
    for spec in ["cpu:shm,cuda:cuda-device", "cpu:shm,cuda:cuda-host-staging"] {
        on_threads(spec, &[], 2, capture_refused);
    }
}

fn capture_refused(pg: &weft::ProcessGroup, p: SharedPlacement) -> Vec<Check> {
    use weft::prelude::*;
    use weft::{DType, ErrorKind};
    use weft_conformance::Buf;
    weft::stream::set_current_stream(Some(p.stream()));
    let (r, peer) = (pg.rank(), 1 - pg.rank());
    let n = 1000;
    let o = OpOptions::default().timeout(std::time::Duration::from_secs(10));
    let ones = |v: f32| -> Vec<u8> { (0..n).flat_map(|_| v.to_ne_bytes()).collect() };
    let refused = |what: &str, got: weft::Result<()>| -> Option<String> {
        match got {
            Err(e)
                if e.kind() == &ErrorKind::Unsupported
                    && e.to_string().contains(what)
                    && e.to_string().contains("capturing a CUDA graph") =>
            {
                None
            }
            Err(e) => Some(format!("{what}: {e}")),
            Ok(()) => Some(format!("{what} ran while the stream was capturing")),
        }
    };
    let run = || -> weft::Result<Option<String>> {
        let mut b = Buf::from_bytes(DType::F32, &ones(r as f32 + 1.0)).place(Some(&p))?;
        let mut c = Buf::zeros(DType::F32, n).place(Some(&p))?;
        let mut g = [Buf::zeros(DType::F32, n).place(Some(&p))?, Buf::zeros(DType::F32, n).place(Some(&p))?];
        let gpu = weft_cuda_driver::gpu().map_err(weft::Error::unsupported)?;
        gpu.begin_capture(p.stream())?;
        // (cuda-device captures these but for the ring and staging.)
        let (ring, staged) = (o.clone().hint("cuda_algorithm", "ring"), o.clone().hint("cuda_algorithm", "staging"));
        let mut problems = vec![refused("all_reduce", pg.all_reduce(b.tm(), ReduceOp::Sum, &ring).and_then(|x| x.wait()))];
        let [g0, g1] = &mut g;
        problems.push(refused("all_gather", pg.all_gather(vec![g0.tm(), g1.tm()], b.t(), &staged).and_then(|x| x.wait())));
        // (cuda-device captures point-to-point, which takes no hint.)
        if pg.backend_name((weft::DeviceKind::Cuda, weft::Layout::Dense)).as_deref() == Some("cuda-host-staging") {
            let p2p = if r == 0 { pg.send(b.t(), peer, 3, &o) } else { pg.recv(c.tm(), peer, 3, &o) };
            problems.push(refused(if r == 0 { "send" } else { "recv" }, p2p.and_then(|x| x.wait())));
        }
        match gpu.end_capture(p.stream()).map(|graph| weft_cuda_driver::emulated::graph_tasks(graph.0)) {
            // (None: a real GPU's graph, whose nodes are not counted here.)
            Ok(Some(0) | None) => {}
            Ok(Some(k)) => problems.push(Some(format!("{k} tasks were recorded into the capture"))),
            Err(e) => problems.push(Some(format!("the capture was broken: {e}"))),
        }
        // The same ops once the capture has ended.
        pg.all_reduce(b.tm(), ReduceOp::Sum, &o)?.wait()?;
        if r == 0 {
            pg.send(b.t(), peer, 3, &o)?.wait()?;
        } else {
            pg.recv(c.tm(), peer, 3, &o)?.wait()?;
        }
        if b.read()? != ones(3.0) || (r == 1 && c.read()? != ones(3.0)) {
            problems.push(Some("wrong results after the capture".into()));
        }
        Ok(problems.into_iter().flatten().next())
    };
    vec![Check::of_scenario("ops on a capturing stream", DType::F32, run())]
}

/// A CUDA graph that captured all_reduce, all_gather, reduce_scatter,
/// all_to_all and broadcast on every rank, launched 10 times with new
/// inputs written between launches: every launch gives the exact results
/// of its inputs (the hand-offs between ranks run on the device, with no
/// host step, so a replay that skipped one reads stale or half-written
/// buffers). Staged through the staging buffers and not, at 2 and 4 ranks.
#[test]
fn a_captured_graph_replays_its_collectives_with_fresh_inputs() {
    let _gpu = weft_conformance::cuda::exclusive();
    link();
    // (Unstaged runs also cut the sendrecv into 256-byte chunks, five per message.)
    let unstaged = [("cuda_direct_staged_bytes", "0"), ("cuda_p2p_chunk_bytes", "256")];
    for (w, hints) in [(2, &[][..]), (2, &unstaged[..]), (4, &[][..]), (3, &unstaged[..])] {
        on_threads("cpu:shm,cuda:cuda-device", hints, w, weft_conformance::capture::replays);
    }
}

/// Ranks that disagree whether an op is captured (one captures, the other
/// runs it eagerly) all get `InvalidArgument` naming the capture, instead
/// of the eager rank reading what the graph has not run; nothing is
/// recorded, and the group runs the op right afterwards.
#[test]
fn ranks_that_disagree_about_a_capture_are_refused_alike() {
    let _gpu = weft_conformance::cuda::exclusive();
    link();
    let unstaged = [("cuda_direct_staged_bytes", "0")];
    for hints in [&[][..], &unstaged[..]] {
        on_threads("cpu:shm,cuda:cuda-device", hints, 2, capture_disagreement);
    }
}

fn capture_disagreement(pg: &weft::ProcessGroup, p: SharedPlacement) -> Vec<Check> {
    use weft::prelude::*;
    use weft::{DType, ErrorKind};
    use weft_conformance::Buf;
    weft::stream::set_current_stream(Some(p.stream()));
    let (r, n) = (pg.rank(), 64);
    let o = OpOptions::default().timeout(std::time::Duration::from_secs(10));
    let ones = |v: f32| -> Vec<u8> { (0..n).flat_map(|_| v.to_ne_bytes()).collect() };
    let run = || -> weft::Result<Option<String>> {
        let gpu = weft_cuda_driver::gpu().map_err(weft::Error::unsupported)?;
        let mut b = Buf::from_bytes(DType::F32, &ones(r as f32 + 1.0)).place(Some(&p))?;
        let mut g = [Buf::zeros(DType::F32, n).place(Some(&p))?, Buf::zeros(DType::F32, n).place(Some(&p))?];
        let mut problems = Vec::new();
        for op in ["all_reduce", "all_gather"] {
            if r == 0 {
                gpu.begin_capture(p.stream())?;
            }
            let [g0, g1] = &mut g;
            let got = match op {
                "all_reduce" => pg.all_reduce(b.tm(), ReduceOp::Sum, &o).and_then(|x| x.wait()),
                _ => pg.all_gather(vec![g0.tm(), g1.tm()], b.t(), &o).and_then(|x| x.wait()),
            };
            match got {
                Err(e) if e.kind() == &ErrorKind::InvalidArgument && e.to_string().contains("mismatched capture") => {}
                Err(e) => problems.push(format!("{op}: {e}")),
                Ok(()) => problems.push(format!("{op} ran on rank {r}")),
            }
            if r == 0 {
                match gpu.end_capture(p.stream()).map(|graph| weft_cuda_driver::emulated::graph_tasks(graph.0)) {
                    Ok(Some(0) | None) => {}
                    Ok(Some(k)) => problems.push(format!("{op}: {k} tasks were recorded")),
                    Err(e) => problems.push(format!("{op}: the capture was broken: {e}")),
                }
            }
        }
        pg.all_reduce(b.tm(), ReduceOp::Sum, &o)?.wait()?;
        if b.read()? != ones(3.0) {
            problems.push("wrong result after the refused captures".into());
        }
        Ok(problems.into_iter().next())
    };
    vec![Check::of_scenario("an op captured on one rank only", DType::F32, run())]
}
