//! Every op against independent references, every dtype and reduce op where
//! it applies, world sizes 1, 2, 3, 4, 5 and 8, ranks as threads over cpu-tcp.

use weft::prelude::*;
use weft::{DType, ReduceOp};
use weft_tests::reference::{make, reduced_tensor};
use weft_tests::{assert_close, options, run_threads, Buf};

const WORLDS: [usize; 6] = [1, 2, 3, 4, 5, 8];
const COUNTS: [usize; 3] = [0, 1, 13];

fn o() -> OpOptions {
    OpOptions::default()
}

fn valid_ops(d: DType) -> Vec<ReduceOp> {
    let mut v: Vec<ReduceOp> = ReduceOp::ALL.into_iter().filter(|op| op.supports(d)).collect();
    if d.is_float() {
        v.retain(|op| !matches!(op, ReduceOp::PremulSum(_)));
        v.push(ReduceOp::PremulSum(0.5));
    }
    v
}

#[test]
fn reductions_every_dtype_op_and_world_size() {
    for w in WORLDS {
        run_threads(w, options("cpu-tcp"), move |pg| {
            let r = pg.rank();
            for d in DType::ALL {
                for op in valid_ops(d) {
                    for n in COUNTS {
                        let mut b = Buf::from_bytes(d, &make(d, r, n));
                        pg.all_reduce(b.tm(), op, &o()).unwrap().wait().unwrap();
                        assert_close(d, Some(op), b.bytes(), &reduced_tensor(d, op, w, n), &format!("all_reduce w={w} n={n} {op}"));
                    }
                    // reduce at the last root; reduce_scatter (single) with W parts of 3
                    let root = w - 1;
                    let mut b = Buf::from_bytes(d, &make(d, r, 7));
                    pg.reduce(b.tm(), root, op, &o()).unwrap().wait().unwrap();
                    let want = if r == root { reduced_tensor(d, op, w, 7) } else { make(d, r, 7) };
                    assert_close(d, Some(op), b.bytes(), &want, &format!("reduce w={w} {op}"));
                    let input = Buf::from_bytes(d, &make(d, r, 3 * w));
                    let mut out = Buf::zeros(d, 3);
                    pg.reduce_scatter_single(out.tm(), input.t(), op, &o()).unwrap().wait().unwrap();
                    let full = reduced_tensor(d, op, w, 3 * w);
                    let sz = d.size();
                    assert_close(d, Some(op), out.bytes(), &full[3 * r * sz..3 * (r + 1) * sz], &format!("reduce_scatter w={w} {op}"));
                }
            }
        });
    }
}

#[test]
fn rooted_ops_every_root() {
    for w in WORLDS {
        run_threads(w, options("cpu-tcp"), move |pg| {
            let r = pg.rank();
            for root in 0..w {
                for d in [DType::F64, DType::BF16, DType::I8, DType::Bool] {
                    let mut b = Buf::from_bytes(d, &make(d, r, 9));
                    pg.broadcast(b.tm(), root, &o()).unwrap().wait().unwrap();
                    assert_eq!(b.bytes(), make(d, root, 9), "broadcast w={w} root={root} {d}");

                    // gather: root gets everyone's 5 elements
                    let input = Buf::from_bytes(d, &make(d, r, 5));
                    let mut outs: Vec<Buf> = if r == root { (0..w).map(|_| Buf::zeros(d, 5)).collect() } else { vec![] };
                    pg.gather(outs.iter_mut().map(|b| b.tm()).collect(), input.t(), root, &o()).unwrap().wait().unwrap();
                    for (i, b) in outs.iter().enumerate() {
                        assert_eq!(b.bytes(), make(d, i, 5), "gather w={w} root={root}");
                    }
                    // scatter: root's i-th input (data of "rank" 10+i) goes to rank i
                    let ins: Vec<Buf> = if r == root { (0..w).map(|i| Buf::from_bytes(d, &make(d, 10 + i, 4))).collect() } else { vec![] };
                    let mut out = Buf::zeros(d, 4);
                    pg.scatter(out.tm(), ins.iter().map(|b| b.t()).collect(), root, &o()).unwrap().wait().unwrap();
                    assert_eq!(out.bytes(), make(d, 10 + r, 4), "scatter w={w} root={root}");
                }
                let mut b = Buf::from_bytes(DType::I32, &make(DType::I32, r, 6));
                pg.reduce(b.tm(), root, ReduceOp::Sum, &o()).unwrap().wait().unwrap();
                if r == root {
                    assert_eq!(b.bytes(), reduced_tensor(DType::I32, ReduceOp::Sum, w, 6));
                }
            }
            pg.barrier(&o()).unwrap().wait().unwrap();
        });
    }
}

#[test]
fn gathers_scatters_and_all_to_all_with_even_and_uneven_parts() {
    for w in WORLDS {
        run_threads(w, options("cpu-tcp"), move |pg| {
            let r = pg.rank();
            for d in DType::ALL {
                let sz = d.size();
                // all_gather list and single
                let input = Buf::from_bytes(d, &make(d, r, 3));
                let mut outs: Vec<Buf> = (0..w).map(|_| Buf::zeros(d, 3)).collect();
                pg.all_gather(outs.iter_mut().map(|b| b.tm()).collect(), input.t(), &o()).unwrap().wait().unwrap();
                let mut single = Buf::zeros(d, 3 * w);
                pg.all_gather_single(single.tm(), input.t(), &o()).unwrap().wait().unwrap();
                for (i, out) in outs.iter().enumerate() {
                    assert_eq!(out.bytes(), make(d, i, 3), "all_gather w={w} {d}");
                    assert_eq!(&single.bytes()[3 * i * sz..3 * (i + 1) * sz], make(d, i, 3), "all_gather_single w={w}");
                }
                // all_gather_v: rank i contributes (i % 3) elements (zero-length parts included)
                let input = Buf::from_bytes(d, &make(d, r, r % 3));
                let mut outs: Vec<Buf> = (0..w).map(|i| Buf::zeros(d, i % 3)).collect();
                pg.all_gather_v(outs.iter_mut().map(|b| b.tm()).collect(), input.t(), &o()).unwrap().wait().unwrap();
                for (i, b) in outs.iter().enumerate() {
                    assert_eq!(b.bytes(), make(d, i, i % 3), "all_gather_v w={w} {d}");
                }
                // reduce_scatter list and _v (part i has (i+1) % 3 elements)
                let op = if d == DType::Bool { ReduceOp::Bor } else { ReduceOp::Max };
                let ins: Vec<Buf> = (0..w).map(|_| Buf::from_bytes(d, &make(d, r, 4))).collect();
                let mut out = Buf::zeros(d, 4);
                pg.reduce_scatter(out.tm(), ins.iter().map(|b| b.t()).collect(), op, &o()).unwrap().wait().unwrap();
                assert_eq!(out.bytes(), reduced_tensor(d, op, w, 4), "reduce_scatter w={w} {d}");
                let ins: Vec<Buf> = (0..w).map(|i| Buf::from_bytes(d, &make(d, r, (i + 1) % 3))).collect();
                let mut out = Buf::zeros(d, (r + 1) % 3);
                pg.reduce_scatter_v(out.tm(), ins.iter().map(|b| b.t()).collect(), op, &o()).unwrap().wait().unwrap();
                assert_eq!(out.bytes(), reduced_tensor(d, op, w, (r + 1) % 3), "reduce_scatter_v w={w} {d}");
                // all_to_all list: rank r sends make(100*r + dst, 2) to dst
                let ins: Vec<Buf> = (0..w).map(|dst| Buf::from_bytes(d, &make(d, 100 * r + dst, 2))).collect();
                let mut outs: Vec<Buf> = (0..w).map(|_| Buf::zeros(d, 2)).collect();
                pg.all_to_all(outs.iter_mut().map(|b| b.tm()).collect(), ins.iter().map(|b| b.t()).collect(), &o())
                    .unwrap()
                    .wait()
                    .unwrap();
                for (src, b) in outs.iter().enumerate() {
                    assert_eq!(b.bytes(), make(d, 100 * src + r, 2), "all_to_all w={w} {d}");
                }
                // all_to_all_single: part i of rank r's input is make(100*r+i, 2)
                let input = Buf::from_bytes(d, &(0..w).flat_map(|dst| make(d, 100 * r + dst, 2)).collect::<Vec<u8>>());
                let mut out = Buf::zeros(d, 2 * w);
                pg.all_to_all_single(out.tm(), input.t(), &o()).unwrap().wait().unwrap();
                let want: Vec<u8> = (0..w).flat_map(|src| make(d, 100 * src + r, 2)).collect();
                assert_eq!(out.bytes(), want, "all_to_all_single w={w} {d}");
                // all_to_all_v_single: rank s sends (s + dst) % 3 elements to dst
                let in_splits: Vec<usize> = (0..w).map(|dst| (r + dst) % 3).collect();
                let out_splits: Vec<usize> = (0..w).map(|src| (src + r) % 3).collect();
                let input = Buf::from_bytes(d, &(0..w).flat_map(|dst| make(d, 100 * r + dst, in_splits[dst])).collect::<Vec<u8>>());
                let mut out = Buf::zeros(d, out_splits.iter().sum());
                pg.all_to_all_v_single(out.tm(), input.t(), &out_splits, &in_splits, &o()).unwrap().wait().unwrap();
                let want: Vec<u8> = (0..w).flat_map(|src| make(d, 100 * src + r, out_splits[src])).collect();
                assert_eq!(out.bytes(), want, "all_to_all_v_single w={w} {d}");
            }
        });
    }
}

#[test]
fn large_tensors_on_a_representative_subset() {
    const N: usize = 4 << 20; // 4 Mi elements
    for w in [2, 3, 4] {
        run_threads(w, options("cpu-tcp"), move |pg| {
            let r = pg.rank();
            let mut v: Vec<f32> = (0..N).map(|i| (i % 1000) as f32 + r as f32).collect();
            pg.all_reduce(&mut v, ReduceOp::Sum, &o()).unwrap().wait().unwrap();
            let base: f32 = (0..w).map(|k| k as f32).sum();
            for (i, x) in v.iter().enumerate().step_by(4099) {
                assert_eq!(*x, (i % 1000) as f32 * w as f32 + base, "all_reduce 4Mi w={w} at {i}");
            }
            let input: Vec<i32> = (0..N / w).map(|i| (i * w + r) as i32).collect();
            let mut out = vec![0i32; N / w * w];
            pg.all_gather_single(&mut out, &input, &o()).unwrap().wait().unwrap();
            for (k, x) in out.iter().enumerate().step_by(1021) {
                let (src, i) = (k / (N / w), k % (N / w));
                assert_eq!(*x, (i * w + src) as i32);
            }
            // Part p of rank r's input goes to rank p; element i of a part
            // tells who sent it and where it sat.
            let part = N / w;
            let input: Vec<i32> = (0..part * w).map(|k| ((k % part) * w * w + (k / part) * w + r) as i32).collect();
            let mut out = vec![0i32; part * w];
            pg.all_to_all_single(&mut out, &input, &o()).unwrap().wait().unwrap();
            for (k, x) in out.iter().enumerate() {
                let (src, i) = (k / part, k % part);
                assert_eq!(*x, (i * w * w + r * w + src) as i32, "all_to_all 4Mi w={w} at {k}");
            }
            let mut b: Vec<u8> = if r == 0 { (0..N).map(|i| (i % 251) as u8).collect() } else { vec![0; N] };
            pg.broadcast(&mut b, 0, &o()).unwrap().wait().unwrap();
            assert!(b.iter().enumerate().all(|(i, x)| *x == (i % 251) as u8));
        });
    }
}
