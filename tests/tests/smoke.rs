use weft::prelude::*;
use weft_tests::{options, run_threads};

#[test]
fn all_reduce_three_ranks_over_tcp() {
    let out = run_threads(3, options("cpu-tcp"), |pg| {
        let mut v = vec![pg.rank() as f32 + 1.0; 5];
        pg.all_reduce(&mut v, ReduceOp::Sum, &OpOptions::default()).unwrap().wait().unwrap();
        v
    });
    assert!(out.iter().all(|v| v == &vec![6.0; 5]), "{out:?}");
}
