//! Bad input, mismatched ranks and timeouts give clear errors, never hangs.

use std::time::{Duration, Instant};
use weft::prelude::*;
use weft::{DType, Device, ErrorKind, Tensor};
use weft_tests::{options, run_threads};

fn o() -> OpOptions {
    OpOptions::default()
}

fn invalid(r: weft::Result<Work<'_>>, needle: &str) {
    let e = r.err().unwrap_or_else(|| panic!("expected a local validation error mentioning {needle:?}"));
    assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains(needle), "{e:?} should mention {needle:?}");
}

#[test]
fn bad_local_input_is_rejected_before_any_byte_moves() {
    run_threads(3, options("cpu-tcp"), |pg| {
        let mut f = vec![0f32; 6];
        let mut i = vec![0i32; 6];
        let small = vec![0f32; 2];
        invalid(pg.broadcast(&mut f, 3, &o()), "root 3 is out of range");
        invalid(pg.all_reduce(&mut f, ReduceOp::Band, &o()), "bitwise");
        invalid(pg.all_reduce(&mut i, ReduceOp::Avg, &o()), "floating-point");
        invalid(pg.all_gather_single(&mut f[..5], &small, &o()), "has 5 elements, expected 6");
        invalid(pg.all_gather(vec![(&mut f).into()], &small, &o()), "one per rank");
        invalid(pg.reduce_scatter_single(&mut f[..4], &small, ReduceOp::Sum, &o()), "expected 12");
        let g = f.clone();
        invalid(pg.all_to_all_single(&mut f[..4], &g[..4], &o()), "not divisible");
        invalid(pg.all_to_all_v_single(&mut f, &small, &[1, 1, 4], &[1, 1], &o()), "input_splits");
        invalid(pg.all_to_all_v_single(&mut f, &small, &[1, 1, 4], &[1, 1, 1], &o()), "sum of input_splits");
        invalid(pg.send(&small, pg.rank(), 0, &o()), "this rank");
        invalid(pg.send(&small, 9, 0, &o()), "out of range");
        invalid(pg.recv(&mut f, (pg.rank() + 1) % 3, u32::MAX, &o()), "largest user tag");
        let other = [0f64; 2];
        let (i1, i2) = i.split_at_mut(3);
        invalid(pg.all_gather(vec![(&mut f[..2]).into(), (&mut i1[..2]).into(), (&mut i2[..2]).into()], &other[..], &o()), "dtype");
        if pg.rank() == 0 {
            invalid(pg.gather(vec![], &small, 0, &o()), "one per rank");
        }
        // The list is read at the root only: other ranks may pass any list,
        // which stays untouched.
        let mine = [pg.rank() as f32 + 1.0; 2];
        let (mut at_root, mut ignored) = ([[0f32; 2]; 3], [7f32; 2]);
        let outs: Vec<TensorMut<'_>> =
            if pg.rank() == 0 { at_root.iter_mut().map(|b| (&mut b[..]).into()).collect() } else { vec![(&mut ignored[..]).into()] };
        pg.gather(outs, &mine[..], 0, &o()).unwrap().wait().unwrap();
        assert_eq!(at_root, if pg.rank() == 0 { [[1.0; 2], [2.0; 2], [3.0; 2]] } else { [[0.0; 2]; 3] });
        assert_eq!(ignored, [7.0; 2]);
        let raw = [0f32; 8];
        // SAFETY: dims (4,2) strides (1,4) reach offsets up to 3 + 4 = 7, inside the 8 elements.
        let strided =
            unsafe { Tensor::from_raw_parts(raw.as_ptr() as *const u8, DType::F32, Device::Cpu, &[4, 2], Some(&[1, 4])) }.unwrap();
        invalid(pg.send(strided, (pg.rank() + 1) % 3, 0, &o()), "not contiguous");
        // The group is still fine after local errors.
        pg.all_reduce(&mut f, ReduceOp::Sum, &o()).unwrap().wait().unwrap();
    });
}

#[test]
fn cuda_tensors_without_a_cuda_backend_get_an_error_naming_why() {
    if weft_cuda_driver::gpu().is_ok() {
        return; // a GPU (or the emulation) is here: tests/tests/cuda.rs covers it
    }
    run_threads(2, options("auto"), |pg| {
        let mut host = vec![0f32; 4];
        // SAFETY: the pointer is never dereferenced: no backend handles CUDA here.
        let t = unsafe { weft::TensorMut::from_raw_parts(host.as_mut_ptr() as *mut u8, DType::F32, Device::Cuda(0), &[4], None) }.unwrap();
        let e = pg.all_reduce(t, ReduceOp::Sum, &o()).unwrap().wait().unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::Unsupported);
        assert!(e.to_string().contains("cuda-host-staging: unavailable: the CUDA driver library"), "{e}");
        // Not poisoned: the op never started.
        pg.all_reduce(&mut host, ReduceOp::Sum, &o()).unwrap().wait().unwrap();
    });
}

#[test]
fn cross_rank_size_mismatch_errors_on_every_rank_without_hanging() {
    // (shm: the send goes straight into the ring, and the receive, which
    // finds a frame of another size there, leaves it to the exchange.)
    for spec in ["cpu-tcp", "shm"] {
        size_mismatch_errors_on_every_rank(spec);
    }
}

fn size_mismatch_errors_on_every_rank(spec: &'static str) {
    let start = Instant::now();
    let out = run_threads(2, options(spec), |pg| {
        // Rank 0 sends 4 KiB where rank 1 expects 8 bytes.
        if pg.rank() == 0 {
            let big = vec![1u8; 4096];
            let _ = pg.send(&big, 1, 3, &o()).unwrap().wait();
            let mut v = vec![0f32; 1024];
            let result = pg.all_reduce(&mut v, ReduceOp::Sum, &o()).unwrap().wait();
            result.unwrap_err()
        } else {
            let mut small = [0u8; 8];
            let e = pg.recv(&mut small[..], 0, 3, &o()).unwrap().wait().unwrap_err();
            assert!(e.to_string().contains("4096") && e.to_string().contains("8 bytes"), "{e}");
            e
        }
    });
    assert!(start.elapsed() < Duration::from_secs(20), "{spec}: errors must come well before the timeout");
    assert_eq!(out[0].kind(), &ErrorKind::PeerLost { rank: 1 }, "{spec}: {}", out[0]);
}

#[test]
fn mismatched_collectives_fail_fast_and_detail_mode_names_the_ranks() {
    // Without WEFT_DEBUG: the transport sees messages of another collective
    // at the same sequence number and fails.
    let out = run_threads(2, options("cpu-tcp"), |pg| {
        let mut v = vec![0f32; 8];
        let w = if pg.rank() == 0 { pg.all_reduce(&mut v, ReduceOp::Sum, &o()) } else { pg.broadcast(&mut v, 0, &o()) };
        let result = w.unwrap().wait();
        result.unwrap_err()
    });
    assert!(out.iter().any(|e| e.to_string().contains("mismatch")), "{out:?}");

    // With detail checks (WEFT_DEBUG=detail or the group hint), every rank
    // learns exactly which rank called what.
    let out = run_threads(3, options("cpu-tcp").hint("debug", "detail"), |pg| {
        let mut v = vec![0f32; 8];
        pg.all_reduce(&mut v, ReduceOp::Sum, &o()).unwrap().wait().unwrap(); // agreeing ops pass
        let w = if pg.rank() == 1 {
            pg.all_gather_single(&mut v[..6], &[1f32, 2.0][..], &o())
        } else {
            pg.all_reduce(&mut v, ReduceOp::Sum, &o())
        };
        let result = w.unwrap().wait();
        result.unwrap_err()
    });
    for e in out {
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        let m = e.to_string();
        assert!(
            m.contains("rank(s) [0, 2] called all_reduce(f32 x 8 op sum)") && m.contains("rank(s) [1] called all_gather_single"),
            "{m}"
        );
    }
}

/// A peer that never joins: the op fails with `Timeout` once its own
/// timeout has passed (not before: the shm fast path reads the clock only
/// when it starts to wait), naming the op and the peer.
#[test]
fn timeouts_are_reported_with_the_op_name() {
    let timeout = Duration::from_millis(300);
    for backend in ["cpu-tcp", "shm"] {
        for op in ["recv", "all_reduce"] {
            run_threads(2, options(backend), move |pg| {
                if pg.rank() == 0 {
                    // Stay in the group (leaving would be reported as PeerLost).
                    std::thread::sleep(Duration::from_secs(1));
                    return;
                }
                let o = OpOptions::default().timeout(timeout);
                let mut v = [0u8; 4];
                let start = Instant::now();
                let work = match op {
                    "recv" => pg.recv(&mut v[..], 0, 1, &o),
                    _ => pg.all_reduce(&mut v[..], ReduceOp::Sum, &o),
                };
                let e = work.unwrap().wait().unwrap_err();
                let took = start.elapsed();
                assert_eq!(e.kind(), &ErrorKind::Timeout, "{backend} {op}: {e}");
                assert_eq!(e.op(), Some(op));
                assert!(e.to_string().contains("rank 0"), "{backend} {op}: {e}");
                assert!(took >= timeout && took < Duration::from_secs(5), "{backend} {op}: timed out after {took:?}");
            });
        }
    }
}

/// One rank's call and the other's, on `spec` with 2 ranks: each rank's
/// error, and how long it took to come.
fn mismatched(spec: &str, call: fn(&ProcessGroup, bool) -> weft::Result<()>) -> Vec<(weft::Error, Duration)> {
    run_threads(2, options(spec), move |pg| {
        let start = Instant::now();
        let e = call(&pg, pg.rank() == 0).expect_err("a mismatched call fails");
        (e, start.elapsed())
    })
}

#[test]
fn same_bytes_other_dtype_sizes_or_reduce_op_are_named_on_both_ranks_without_debug_mode() {
    // 64 KiB: past shm's fast path (which checks calls itself), through the
    // rings and the sockets, where only the messages' tags can tell; and
    // on shm, 4000 against 8000 bytes: one rank in the fast path, the
    // other in the rings (their call numbers tell, see shm's `fastbox`).
    type Call = fn(&ProcessGroup, bool) -> weft::Result<()>;
    let cases: [(&str, Call, &str); 4] = [
        (
            "f32 against f64 of the same bytes",
            |pg, first| {
                if first {
                    pg.all_reduce(&mut vec![1f32; 16 << 10][..], ReduceOp::Sum, &o())?.wait()
                } else {
                    pg.all_reduce(&mut vec![1f64; 8 << 10][..], ReduceOp::Sum, &o())?.wait()
                }
            },
            "dtype",
        ),
        (
            "sum against max",
            |pg, first| {
                let op = if first { ReduceOp::Sum } else { ReduceOp::Max };
                pg.all_reduce(&mut vec![1f32; 16 << 10][..], op, &o())?.wait()
            },
            "reduce op",
        ),
        (
            "4 MiB against 8 MiB",
            |pg, first| pg.all_reduce(&mut vec![1f32; if first { 1 << 20 } else { 2 << 20 }][..], ReduceOp::Sum, &o())?.wait(),
            "",
        ),
        (
            "1000 against 2000 floats",
            |pg, first| pg.all_reduce(&mut vec![1f32; if first { 1000 } else { 2000 }][..], ReduceOp::Sum, &o())?.wait(),
            "",
        ),
    ];
    for spec in ["cpu-tcp", "shm", "loopback"] {
        for (what, call, names) in cases {
            for (r, (e, took)) in mismatched(spec, call).into_iter().enumerate() {
                // Caught as the first messages arrive (or, on shm, within a
                // nap of the rings), not at the 30 s timeout.
                assert!(took < Duration::from_secs(10), "{spec}, {what}: rank {r} took {took:?}: {e}");
                assert!(e.to_string().contains("mismatch"), "{spec}, {what}: rank {r}: {e}");
                if e.kind() == &ErrorKind::InvalidArgument {
                    assert!(e.to_string().contains(names), "{spec}, {what}: rank {r}: {e}");
                }
            }
        }
    }
}
