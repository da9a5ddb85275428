//! One place decides an op's algorithm: a backend with a native path of its
//! own (here `native-recorder`, the in-process `loopback` with a native
//! all_reduce named "native") takes ops only when no algorithm was named
//! or its own was; a name from the op, the group or `WEFT_ALGORITHM` that
//! neither core nor the backend has is refused when the op is issued.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use weft::backend::{Backend, Capabilities, NativeAlgorithm, Op, OpContext, P2p};
use weft::registry::StaticBackend;
use weft::{Collectives, ErrorKind, OpOptions, ReduceOp, Result};
use weft_tests::wrapped::WrappedLoopback;
use weft_tests::{options, run_threads};

/// all_reduces the native path ran (every rank of every test counts).
static NATIVE_RUNS: AtomicUsize = AtomicUsize::new(0);

/// loopback, with a native all_reduce that records that it ran and then
/// runs core's choice (same result, observable path).
struct Recorder(Arc<dyn Backend>);

impl Backend for Recorder {
    fn name(&self) -> &str {
        "native-recorder"
    }
    // By hand: a blocking transport (loopback's exchange, nothing posted)
    // with one native all_reduce.
    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &weft::backend::Deadline) -> Result<()> {
        self.0.exchange(ops, deadline)
    }
    fn abort(&self, reason: &weft::Error) {
        self.0.abort(reason)
    }
    fn capabilities(&self) -> &Capabilities {
        static NATIVE: Capabilities = Capabilities {
            native_algorithms: &[NativeAlgorithm { family: weft::algorithms::select::Family::AllReduce, name: "native" }],
            ..Capabilities::DEFAULT
        };
        &NATIVE
    }
    fn native_op(&self, op: &mut Op<'_>, ctx: &OpContext) -> Option<Result<()>> {
        match op {
            Op::AllReduce { .. } if ctx.algorithm.is_none_or(|a| a == "native") => {
                NATIVE_RUNS.fetch_add(1, Ordering::SeqCst);
                let sub = OpContext { algorithm: None, ..ctx.clone() };
                Some(weft::algorithms::run(&*self.0, op, &sub))
            }
            _ => None,
        }
    }
}

static RECORDER: WrappedLoopback = WrappedLoopback { name: "native-recorder", wrap: |b| Arc::new(Recorder(b)) };
weft::inventory::submit! { StaticBackend(&RECORDER) }

fn o() -> OpOptions {
    OpOptions::default()
}

/// How many native all_reduces `f` makes run, over 2 ranks.
fn native_runs(opts: weft::GroupOptions, f: impl Fn(&weft::ProcessGroup) + Send + Sync + 'static) -> usize {
    // One test at a time counts (the counter is shared).
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|p| p.into_inner());
    let before = NATIVE_RUNS.load(Ordering::SeqCst);
    run_threads(2, opts, move |pg| f(&pg));
    NATIVE_RUNS.load(Ordering::SeqCst) - before
}

#[test]
fn a_native_path_runs_unless_another_algorithm_is_named() {
    let sum = |pg: &weft::ProcessGroup, opts: &OpOptions| {
        let mut v = vec![pg.rank() as f32 + 1.0; 5];
        pg.all_reduce(&mut v, ReduceOp::Sum, opts).unwrap().wait().unwrap();
        assert_eq!(v, vec![3.0; 5]);
    };
    assert_eq!(native_runs(options("native-recorder"), move |pg| sum(pg, &o())), 2);
    assert_eq!(native_runs(options("native-recorder"), move |pg| sum(pg, &o().hint("algorithm", "native"))), 2);
    // Core's ring, named by the op or the group: the native path steps aside.
    assert_eq!(native_runs(options("native-recorder"), move |pg| sum(pg, &o().hint("algorithm", "ring"))), 0);
    assert_eq!(native_runs(options("native-recorder").hint("algorithm", "ring"), move |pg| sum(pg, &o())), 0);
    // The op's own hint beats the group's.
    let group = options("native-recorder").hint("algorithm", "ring");
    assert_eq!(native_runs(group, move |pg| sum(pg, &o().hint("algorithm", "auto"))), 2);
}

#[test]
fn a_name_nothing_serving_the_op_has_is_refused_when_issued() {
    native_runs(options("native-recorder"), |pg| {
        let mut v = vec![1.0f32; 3];
        // The backend's name is no broadcast algorithm.
        let e = pg.broadcast(&mut v, 0, &o().hint("algorithm", "native")).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
        assert!(e.to_string().contains("broadcast has no algorithm \"native\""), "{e}");
        let e = pg.all_reduce(&mut v, ReduceOp::Sum, &o().hint("algorithm", "butterfly")).unwrap_err();
        assert!(e.to_string().contains("choices: auto, ring, recursive_doubling, halving_doubling, native"), "{e}");
        // A segment size that is none, likewise.
        let e = pg.all_reduce(&mut v, ReduceOp::Sum, &o().hint("segment_bytes", "0")).unwrap_err();
        assert!(e.kind() == &ErrorKind::InvalidArgument && e.to_string().contains("segment_bytes=\"0\""), "{e}");
        // Nothing ran: the group goes on.
        pg.all_reduce(&mut v, ReduceOp::Sum, &o()).unwrap().wait().unwrap();
        assert_eq!(v, vec![2.0; 3]);
    });
    // Elsewhere the backend's name means nothing.
    run_threads(2, options("loopback"), |pg| {
        let mut v = vec![1.0f32; 3];
        let e = pg.all_reduce(&mut v, ReduceOp::Sum, &o().hint("algorithm", "native")).unwrap_err();
        assert_eq!(e.kind(), &ErrorKind::InvalidArgument, "{e}");
    });
}

#[test]
fn a_groups_bad_setting_fails_its_creation() {
    let group = |key: &str, value: &str| {
        let store: Arc<dyn weft::store::Store> = Arc::new(weft::store::MemoryStore::new(std::time::Duration::from_secs(5)));
        weft::ProcessGroup::new(store, 0, 1, options("loopback").hint(key, value))
    };
    // A size is a size for every op: refused with the group.
    assert_eq!(group("segment_bytes", "12k").err().map(|e| e.kind().clone()), Some(ErrorKind::InvalidArgument));
    // An algorithm's name is checked per op (the names depend on the
    // backend serving it): refused by the op.
    let pg = group("algorithm", "butterfly").unwrap();
    let mut v = vec![1.0f32; 2];
    assert_eq!(pg.all_reduce(&mut v, ReduceOp::Sum, &o()).err().map(|e| e.kind().clone()), Some(ErrorKind::InvalidArgument));
}
