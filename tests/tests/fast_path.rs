//! Core offers a direct small collective to its transport's fast path
//! (`Backend::fast_op`) only when nothing asks for more than the
//! transport's own choice, and runs it as a job, in the same turn, where
//! the transport declines (or through core's algorithm, where the fast
//! path hands it back). `fast-recorder` is the in-process `loopback` with a
//! fast path that counts what it is offered, hands all_to_all back and
//! declines the rest, and a native path that counts what reaches it and
//! runs nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use weft::backend::{Backend, Deadline, FastOp, FastOutcome, Op, OpContext, P2p};
use weft::registry::StaticBackend;
use weft::{Collectives, DType, Device, OpOptions, ReduceOp, Result, TensorMut};
use weft_tests::wrapped::WrappedLoopback;
use weft_tests::{options, run_threads};

/// Ops offered to the fast path (every rank of the one test counts).
static OFFERS: AtomicUsize = AtomicUsize::new(0);
/// Ops offered to the native path.
static NATIVE: AtomicUsize = AtomicUsize::new(0);

struct FastRecorder(Arc<dyn Backend>);

impl Backend for FastRecorder {
    fn name(&self) -> &str {
        "fast-recorder"
    }
    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
        self.0.exchange(ops, deadline)
    }
    fn abort(&self, reason: &weft::Error) {
        self.0.abort(reason)
    }
    fn capabilities(&self) -> &weft::backend::Capabilities {
        static FAST: weft::backend::Capabilities = weft::backend::Capabilities { fast_ops: true, ..weft::backend::Capabilities::DEFAULT };
        &FAST
    }
    fn fast_op(&self, op: &mut FastOp<'_>, _deadline: &Deadline) -> FastOutcome {
        OFFERS.fetch_add(1, Ordering::SeqCst);
        match op {
            FastOp::AllToAll { .. } => FastOutcome::Generic,
            _ => FastOutcome::Declined,
        }
    }
    fn native_op(&self, _op: &mut Op<'_>, _ctx: &OpContext) -> Option<Result<()>> {
        NATIVE.fetch_add(1, Ordering::SeqCst);
        None
    }
}

static FAST_RECORDER: WrappedLoopback = WrappedLoopback { name: "fast-recorder", wrap: |b| Arc::new(FastRecorder(b)) };
weft::inventory::submit! { StaticBackend(&FAST_RECORDER) }

fn o() -> OpOptions {
    OpOptions::default()
}

/// How many fast-path offers `f` makes, over 2 ranks (results checked by
/// `f`: every declined op ran as a job).
fn offers(opts: weft::GroupOptions, f: impl Fn(&weft::ProcessGroup) + Send + Sync + 'static) -> usize {
    let before = OFFERS.load(Ordering::SeqCst);
    run_threads(2, opts, move |pg| f(&pg));
    OFFERS.load(Ordering::SeqCst) - before
}

fn all_reduce(pg: &weft::ProcessGroup, opts: &OpOptions) {
    let mut v = vec![pg.rank() as f32 + 1.0; 5];
    pg.all_reduce(&mut v, ReduceOp::Sum, opts).unwrap().wait().unwrap();
    assert_eq!(v, vec![3.0; 5]);
}

#[test]
fn small_collectives_are_offered_to_the_fast_path_only_without_a_wish_of_their_own() {
    let group = || options("fast-recorder");
    // Offered, declined, run as a job (through the native path): each of
    // five ops, on each rank; all_to_all, offered and handed back, runs
    // core's algorithm without a second offer to the native path.
    let native = NATIVE.load(Ordering::SeqCst);
    let n = offers(group(), |pg| {
        let r = pg.rank();
        all_reduce(pg, &o());
        let mut b = vec![r as u8; 3];
        pg.broadcast(&mut b[..], 1, &o()).unwrap().wait().unwrap();
        assert_eq!(b, vec![1; 3]);
        pg.barrier(&o()).unwrap().wait().unwrap();
        let mut all = vec![0i32; 4];
        pg.all_gather_single(&mut all[..], &[r as i32, 7][..], &o()).unwrap().wait().unwrap();
        assert_eq!(all, vec![0, 7, 1, 7]);
        let mut out = vec![0i64; 2];
        pg.reduce_scatter_single(&mut out[..], &[1i64, 2, 3, 4][..], ReduceOp::Sum, &o()).unwrap().wait().unwrap();
        assert_eq!(out, if r == 0 { vec![2, 4] } else { vec![6, 8] });
        let mut out = vec![0u8; 2];
        pg.all_to_all_single(&mut out[..], &[r as u8; 2][..], &o()).unwrap().wait().unwrap();
        assert_eq!(out, vec![0, 1]);
    });
    assert_eq!((n, NATIVE.load(Ordering::SeqCst) - native), (12, 10));
    // An op's hint, a group's hint or algorithm: the op is a job from the start.
    assert_eq!(offers(group(), |pg| all_reduce(pg, &o().hint("algorithm", "ring"))), 0);
    assert_eq!(offers(group(), |pg| all_reduce(pg, &o().hint("anything", "at all"))), 0);
    assert_eq!(offers(group().hint("algorithm", "ring"), |pg| all_reduce(pg, &o())), 0);
    assert_eq!(offers(group().hint("anything", "at all"), |pg| pg.barrier(&o()).unwrap().wait().unwrap()), 0);
    // WEFT_ALGORITHM's choice for a family: that family's ops only. (This
    // file's one test is the only reader of the variable in its process.)
    std::env::set_var("WEFT_ALGORITHM", "all_reduce=ring");
    let n = offers(group(), |pg| {
        all_reduce(pg, &o());
        pg.barrier(&o()).unwrap().wait().unwrap();
    });
    std::env::remove_var("WEFT_ALGORITHM");
    assert_eq!(n, 2);
    // Bools are cleaned after a job: never offered.
    let n = offers(group(), |pg| {
        let mut bytes = [pg.rank() as u8; 2];
        // SAFETY: two bytes, 0 or 1, live for the call.
        let t = unsafe { TensorMut::from_raw_parts(bytes.as_mut_ptr(), DType::Bool, Device::Cpu, &[2], None) }.unwrap();
        pg.all_reduce(t, ReduceOp::Bor, &o()).unwrap().wait().unwrap();
        assert_eq!(bytes, [1, 1]);
    });
    assert_eq!(n, 0);
    // Nor is an op in a scope.
    let n = offers(group(), |pg| {
        let mut v = vec![1f32; 2];
        pg.scope(|s| s.all_reduce(&mut v[..], ReduceOp::Sum, &o())?.wait()).unwrap();
        assert_eq!(v, vec![2.0; 2]);
    });
    assert_eq!(n, 0);
}
