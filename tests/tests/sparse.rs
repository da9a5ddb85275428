//! Sparse COO all-reduce against a reference computed by densifying,
//! reducing and re-sparsifying in the test, for every algorithm, dtype and
//! the awkward cases (empty ranks, identical or disjoint indices,
//! duplicates, several dense dims), at world sizes 1-5.

use weft::prelude::*;
use weft::{DType, ErrorKind, SparseCoo, SparseCooTensor};
use weft_conformance::reference::{decode, encode, order_sensitive, value};
use weft_tests::{options, run_threads, Buf};

/// One rank's input: indices `[sparse_dims][nnz]` and values (f64, per element).
struct Input {
    idx: Vec<Vec<i64>>,
    vals: Vec<f64>,
}

#[derive(Clone, Copy, Debug)]
enum Pattern {
    Random,
    Identical,
    Disjoint,
    EmptyOnOdd,
    /// Hundreds of entries, a third of them repeated (the radix sort's path).
    Many,
}

fn input(shape: &[usize], sparse: usize, dtype: DType, rank: usize, pattern: Pattern) -> Input {
    let row: usize = shape[sparse..].iter().product();
    let nnz = match pattern {
        Pattern::EmptyOnOdd if rank % 2 == 1 => 0,
        Pattern::Many => 600,
        _ => 6,
    };
    let mut idx = vec![Vec::new(); sparse];
    let mut vals = Vec::new();
    for k in 0..nnz {
        for (d, dim) in idx.iter_mut().enumerate() {
            let i = match pattern {
                Pattern::Identical => (k * 3 + d) % shape[d],
                Pattern::Disjoint if d == 0 => (rank * 7 + k) % shape[0],
                // Entries k and k+400 collide; ranks overlap in part.
                Pattern::Many => ((((k % 400) * 7919 + (rank % 2) * 31 + d * 17) * 2_654_435_761) >> 7) % shape[d],
                // Duplicates within a rank: entries k and k+3 collide.
                _ => ((rank * 5 + (k % 3) * 7 + d) * 13) % shape[d],
            };
            dim.push(i as i64);
        }
        for j in 0..row {
            vals.push(value(dtype, rank * 100 + k, j));
        }
    }
    Input { idx, vals }
}

/// The expected result: sorted union of indices, values reduced in f64.
fn reference(shape: &[usize], sparse: usize, dtype: DType, op: ReduceOp, inputs: &[Input]) -> (Vec<i64>, Vec<u8>) {
    let row: usize = shape[sparse..].iter().product();
    let mut map: std::collections::BTreeMap<Vec<i64>, Vec<f64>> = Default::default();
    for inp in inputs {
        let nnz = inp.idx.first().map_or(0, Vec::len);
        for k in 0..nnz {
            let key: Vec<i64> = (0..sparse).map(|d| inp.idx[d][k]).collect();
            let row_vals = &inp.vals[k * row..(k + 1) * row];
            match map.get_mut(&key) {
                None => {
                    map.insert(key, row_vals.to_vec());
                }
                Some(acc) => {
                    for (a, v) in acc.iter_mut().zip(row_vals) {
                        *a = match (op, dtype) {
                            (ReduceOp::Sum, DType::Bool) | (ReduceOp::Max, _) => a.max(*v),
                            (ReduceOp::Min, _) => a.min(*v),
                            _ => *a + v,
                        };
                    }
                }
            }
        }
    }
    let n = map.len();
    let mut indices = vec![0i64; sparse * n];
    let mut values = Vec::new();
    for (k, (key, vals)) in map.into_iter().enumerate() {
        for d in 0..sparse {
            indices[d * n + k] = key[d];
        }
        values.extend(vals.iter().flat_map(|v| encode(dtype, *v)));
    }
    (indices, values)
}

fn run_case(pg: &ProcessGroup, shape: &[usize], sparse: usize, dtype: DType, op: ReduceOp, pattern: Pattern, algo: &str) {
    run_case_on(pg, shape, sparse, dtype, op, pattern, algo, None, &mut SparseCoo::default())
}

/// A result left over from an earlier op, longer than any result here: an
/// op that writes into it must overwrite every byte it keeps.
fn stale() -> SparseCoo {
    SparseCoo { shape: vec![3], sparse_dims: 1, dtype: Some(DType::U8), indices: vec![1, 2, 0], values: vec![0xA5; 1 << 14] }
}

/// As `run_case`, with the input on `place`'s device and the result in
/// `out` (which may hold an earlier result).
#[allow(clippy::too_many_arguments)]
fn run_case_on(
    pg: &ProcessGroup,
    shape: &[usize],
    sparse: usize,
    dtype: DType,
    op: ReduceOp,
    pattern: Pattern,
    algo: &str,
    place: Option<&weft_conformance::SharedPlacement>,
    out: &mut SparseCoo,
) {
    let (r, w) = (pg.rank(), pg.size());
    let inputs: Vec<Input> = (0..w).map(|k| input(shape, sparse, dtype, k, pattern)).collect();
    let mine = &inputs[r];
    let nnz = mine.idx.first().map_or(0, Vec::len);
    let flat: Vec<u8> = mine.idx.concat().iter().flat_map(|i| i.to_ne_bytes()).collect();
    let idx = Buf::from_bytes(DType::I64, &flat).place(place).unwrap();
    let vals = Buf::from_bytes(dtype, &mine.vals.iter().flat_map(|v| encode(dtype, *v)).collect::<Vec<u8>>()).place(place).unwrap();
    let mut vdims = vec![nnz];
    vdims.extend_from_slice(&shape[sparse..]);
    let t = SparseCooTensor::new(idx.t().reshape(&[sparse, nnz]).unwrap(), vals.t().reshape(&vdims).unwrap(), shape.to_vec()).unwrap();
    pg.all_reduce_sparse(out, t, op, &OpOptions::default().hint("sparse_algorithm", algo)).unwrap().wait().unwrap();
    let (want_idx, want_vals) = reference(shape, sparse, dtype, op, &inputs);
    let what = format!("{algo} w={w} shape={shape:?}/{sparse} {dtype} {op} {pattern:?}");
    assert_eq!(out.shape, shape, "{what}");
    assert_eq!(out.indices, want_idx, "{what}");
    let got: Vec<f64> = out.values.chunks(dtype.size()).map(|b| decode(dtype, b)).collect();
    let want: Vec<f64> = want_vals.chunks(dtype.size()).map(|b| decode(dtype, b)).collect();
    assert_eq!(got, want, "{what}");
}

const ALGOS: [&str; 5] = ["auto", "allgather", "recursive_doubling", "split", "dense"];

#[test]
fn sparse_all_reduce_matches_the_dense_reference() {
    for w in 1..=5 {
        run_threads(w, options("cpu:auto"), |pg| {
            for algo in ALGOS {
                for pattern in [Pattern::Random, Pattern::Identical, Pattern::Disjoint, Pattern::EmptyOnOdd] {
                    run_case(&pg, &[23], 1, DType::F32, ReduceOp::Sum, pattern, algo);
                    run_case(&pg, &[6, 5, 3], 2, DType::I64, ReduceOp::Sum, pattern, algo);
                }
                // Hundreds of entries with repeats, keys over 2^21 positions.
                run_case(&pg, &[3000, 700, 2], 2, DType::F32, ReduceOp::Sum, Pattern::Many, algo);
                run_case(&pg, &[3000, 700, 2], 2, DType::I64, ReduceOp::Max, Pattern::Many, algo);
                // Several sparse and dense dims; more of each than PyTorch's
                // Gloo path takes (4 + 4).
                run_case(&pg, &[4, 3, 5, 2, 2], 3, DType::F64, ReduceOp::Sum, Pattern::Random, algo);
                run_case(&pg, &[3, 2, 3, 2, 2, 3, 2, 1, 2, 1, 2], 6, DType::F32, ReduceOp::Sum, Pattern::Random, algo);
                for op in [ReduceOp::Min, ReduceOp::Max] {
                    run_case(&pg, &[9, 2], 1, DType::I32, op, Pattern::Random, algo);
                    run_case(&pg, &[9, 2], 1, DType::BF16, op, Pattern::Disjoint, algo);
                }
            }
            for dtype in DType::ALL {
                run_case(&pg, &[11, 2], 1, dtype, ReduceOp::Sum, Pattern::Random, "auto");
            }
            // The most dims a tensor may have: 16 sparse, 16 dense.
            let widest: Vec<usize> = [vec![2; 16], vec![1; 16]].concat();
            run_case(&pg, &widest, 16, DType::I32, ReduceOp::Sum, Pattern::Identical, "auto");
            // Results written over earlier ones (algorithms reuse the
            // caller's result buffer): longer, then shorter, other dtypes.
            let mut out = stale();
            for algo in ALGOS {
                for (shape, sparse, dtype) in
                    [(&[9, 4][..], 1, DType::F32), (&[4, 3, 5, 2, 2][..], 3, DType::F64), (&[11, 2][..], 1, DType::U8)]
                {
                    run_case_on(&pg, shape, sparse, dtype, ReduceOp::Sum, Pattern::Random, algo, None, &mut out);
                }
                run_case_on(&pg, &[9, 2], 1, DType::I32, ReduceOp::Max, Pattern::EmptyOnOdd, algo, None, &mut out);
                out = stale();
            }
        });
    }
}

#[test]
fn split_streams_slices_larger_than_a_shm_ring() {
    // Three ranks: 1 MiB rings. Rows of 3001 f32 (12 KB, not a divisor of
    // the ring) and about 130 rows per owner: each slice is gathered into
    // the ring over several rounds, pieces ending inside rows. Over
    // sockets, the same slices are packed before they are sent.
    for spec in ["cpu:shm", "cpu:cpu-tcp"] {
        run_threads(3, options(spec), |pg| {
            run_case(&pg, &[3000, 700, 3001], 2, DType::F32, ReduceOp::Sum, Pattern::Many, "split");
            run_case(&pg, &[3000, 700, 3001], 2, DType::F32, ReduceOp::Max, Pattern::Many, "split");
        });
    }
}

#[test]
fn every_rank_gets_the_same_bits() {
    // Where contributions meet, the result's bits can depend on the order
    // they combine in (`order_sensitive`): every rank must still get the
    // same bits.
    for w in 2..=5 {
        for algo in ALGOS {
            for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max] {
                let results = run_threads(w, options("cpu:auto"), move |pg| {
                    let r = pg.rank();
                    let idx = vec![0i64, 1, 2];
                    let vals = order_sensitive(r, 3);
                    let t = SparseCooTensor::new(
                        weft::Tensor::from_slice(&idx).reshape(&[1, 3]).unwrap(),
                        weft::Tensor::from_slice(&vals),
                        vec![3],
                    )
                    .unwrap();
                    let mut out = SparseCoo::default();
                    let opts = OpOptions::default().hint("sparse_algorithm", algo);
                    pg.all_reduce_sparse(&mut out, t, op, &opts).unwrap().wait().unwrap();
                    out.values
                });
                assert!(results.iter().all(|v| *v == results[0]), "{algo} w={w} {op}: ranks differ: {results:?}");
            }
        }
    }
}

#[test]
fn cuda_sparse_tensors_are_reduced_through_host_staging() {
    weft_cuda_driver::emulate(1).unwrap();
    for w in [1, 2, 3] {
        run_threads(w, options("cpu:cpu-tcp,cuda:cuda-host-staging"), |pg| {
            assert_eq!(pg.backend_name((weft::DeviceKind::Cuda, weft::Layout::SparseCoo)).as_deref(), Some("cuda-host-staging"));
            let place = weft_conformance::cuda::placement(0).unwrap();
            weft::stream::set_current_stream(Some(place.stream()));
            for pattern in [Pattern::Random, Pattern::EmptyOnOdd] {
                let mut out = stale();
                run_case_on(&pg, &[4, 3, 5, 2], 2, DType::F32, ReduceOp::Sum, pattern, "auto", Some(&place), &mut out);
                run_case_on(&pg, &[9, 2], 1, DType::I64, ReduceOp::Max, pattern, "allgather", Some(&place), &mut out);
            }
        });
    }
}

#[test]
fn sparse_errors_are_clear() {
    let errors = run_threads(3, options("cpu-tcp"), |pg| {
        // The sparse layer also works under an explicit dense backend.
        let idx = vec![0i64, 1];
        let vals = vec![1f32, 2.0];
        let n = if pg.rank() == 2 { 9 } else { 8 };
        let t = SparseCooTensor::new(weft::Tensor::from_slice(&idx).reshape(&[1, 2]).unwrap(), weft::Tensor::from_slice(&vals), vec![n])
            .unwrap();
        let mut out = SparseCoo::default();
        let r = pg.all_reduce_sparse(&mut out, t.clone(), ReduceOp::Product, &OpOptions::default());
        assert_eq!(r.unwrap_err().kind(), &ErrorKind::InvalidArgument);
        // More dims than the header carries: refused on every rank before
        // anything is sent.
        let deep = SparseCooTensor::new(
            weft::Tensor::from_slice(&idx).reshape(&[1, 2]).unwrap(),
            weft::Tensor::from_slice(&vals).reshape(&[vec![2], vec![1; 32]].concat()).unwrap(),
            [vec![8], vec![1; 32]].concat(),
        )
        .unwrap();
        let e = pg.all_reduce_sparse(&mut out, deep, ReduceOp::Sum, &OpOptions::default()).and_then(|w| w.wait()).unwrap_err();
        assert!(e.kind() == &ErrorKind::InvalidArgument && e.to_string().contains("at most 32 dims"), "{e}");
        // Ranks that disagree on the op or the algorithm all fail, naming
        // both calls; the group goes on working.
        let same = SparseCooTensor::new(weft::Tensor::from_slice(&idx).reshape(&[1, 2]).unwrap(), weft::Tensor::from_slice(&vals), vec![8])
            .unwrap();
        let call = |op: ReduceOp, algo: &str| {
            let opts = OpOptions::default().hint("sparse_algorithm", algo);
            let mut out = SparseCoo::default();
            pg.all_reduce_sparse(&mut out, same.clone(), op, &opts).and_then(|w| w.wait()).map(|_| out)
        };
        let mismatch = |op, algo, want: &[&str]| {
            let e = call(op, algo).unwrap_err();
            assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
            assert!(want.iter().all(|w| e.to_string().contains(w)), "{e}");
        };
        let rank = pg.rank();
        mismatch(
            if rank == 2 { ReduceOp::Max } else { ReduceOp::Sum },
            "allgather",
            &["rank 0 called it with op sum and sparse_algorithm=allgather", "rank 2 with op max and sparse_algorithm=allgather"],
        );
        mismatch(
            ReduceOp::Sum,
            if rank == 1 { "split" } else { "dense" },
            &["sparse_algorithm=dense", "rank 1 with op sum and sparse_algorithm=split"],
        );
        mismatch(ReduceOp::Sum, if rank == 1 { "bogus" } else { "auto" }, &["rank 1 with op sum and sparse_algorithm=(unknown)"]);
        mismatch(ReduceOp::Sum, "bogus", &["no algorithm \"bogus\""]);
        assert_eq!(call(ReduceOp::Max, "split").unwrap().values, [1f32, 2.0].iter().flat_map(|v| v.to_ne_bytes()).collect::<Vec<u8>>());
        let result = pg.all_reduce_sparse(&mut out, t, ReduceOp::Sum, &OpOptions::default()).unwrap().wait();
        result.unwrap_err()
    });
    for e in errors {
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("rank 0 has shape [8]") && e.to_string().contains("rank 2 has shape [9]"), "{e}");
    }
}
