//! The cases, run in the same order on every rank.

use crate::buf::Buf;
use crate::placement::SharedPlacement;
use crate::reference::{make, reduced_tensor};
use weft::prelude::*;
use weft::{DType, ReduceOp, SparseCoo, SparseCooTensor};

/// One case's outcome on this rank.
#[derive(Clone, Debug)]
pub struct Check {
    /// Op name.
    pub op: &'static str,
    /// Element type.
    pub dtype: DType,
    /// Reduce op, where one applies.
    pub redop: Option<ReduceOp>,
    /// Passed on this rank.
    pub passed: bool,
    /// Why not.
    pub detail: String,
}

impl Check {
    /// The check of a scenario that returns its first problem, if any
    /// (`Ok(None)`: passed; an error fails it with its message).
    pub fn of_scenario(op: &'static str, dtype: DType, outcome: weft::Result<Option<String>>) -> Check {
        let (passed, detail) = match outcome {
            Ok(None) => (true, String::new()),
            Ok(Some(why)) => (false, why),
            Err(e) => (false, e.to_string()),
        };
        Check { op, dtype, redop: None, passed, detail }
    }
}

/// Matches results, allowing f16/bf16 product rounding differences.
fn same(dtype: DType, op: Option<ReduceOp>, got: &[u8], want: &[u8]) -> bool {
    std::panic::catch_unwind(|| crate::assert_close(dtype, op, got, want, "")).is_ok()
}

struct Runner<'g> {
    pg: &'g ProcessGroup,
    /// The group the cases run on after a family failed somewhere (a fresh
    /// one, split from the last: a failure may have poisoned that).
    fresh: Option<ProcessGroup>,
    mk: Mk,
    checks: Vec<Check>,
    broken: Option<String>,
}

/// Makes the cases' buffers where the suite runs.
struct Mk(Option<SharedPlacement>);

impl Mk {
    fn buf(&self, d: DType, bytes: &[u8]) -> weft::Result<Buf> {
        Buf::from_bytes(d, bytes).place(self.0.as_ref())
    }
    fn zeros(&self, d: DType, n: usize) -> weft::Result<Buf> {
        Buf::zeros(d, n).place(self.0.as_ref())
    }
}

/// The contents of several buffers, one after the other.
fn read_all(bufs: &[Buf]) -> weft::Result<Vec<u8>> {
    let mut v = Vec::new();
    for b in bufs {
        v.extend(b.read()?);
    }
    Ok(v)
}

impl<'g> Runner<'g> {
    fn new(pg: &'g ProcessGroup, placement: Option<SharedPlacement>) -> Self {
        Runner { pg, fresh: None, mk: Mk(placement), checks: Vec::new(), broken: None }
    }

    /// The group the next case runs on.
    fn group(&self) -> &ProcessGroup {
        self.fresh.as_ref().unwrap_or(self.pg)
    }

    /// The end of a family of cases (one op, every dtype): the ranks agree
    /// whether any failed in it (through the store: that works on a failed
    /// group), and if one did, all go on in a fresh group. So one failure
    /// costs at most the rest of its family, never the later families.
    fn end_family(&mut self) {
        let mine = u64::from(self.broken.is_none());
        let all_fine = self.group().agree(mine, &weft::ShrinkOptions::default()).map(|v| v == 1);
        if all_fine.as_ref().is_ok_and(|fine| *fine) {
            return;
        }
        let everyone: Vec<usize> = (0..self.group().size()).collect();
        match self.group().split(&everyone) {
            Ok(Some(g)) => {
                self.fresh = Some(g);
                self.broken = None;
            }
            Ok(None) => self.broken = Some("a fresh group left this rank out".into()),
            Err(e) => self.broken = Some(format!("no fresh group after a failure: {e}")),
        }
    }

    /// Record a case: `body` runs the op and returns (got, want) bytes.
    fn case(
        &mut self,
        op: &'static str,
        dtype: DType,
        redop: Option<ReduceOp>,
        body: impl FnOnce(&ProcessGroup, &Mk) -> weft::Result<(Vec<u8>, Vec<u8>)>,
    ) {
        let (passed, detail) = if let Some(b) = &self.broken {
            (false, format!("skipped: this family already failed ({b})"))
        } else {
            match body(self.group(), &self.mk) {
                Ok((got, want)) if same(dtype, redop, &got, &want) => (true, String::new()),
                Ok((got, want)) => {
                    (false, format!("wrong result: got {:?}.. want {:?}..", &got[..got.len().min(16)], &want[..want.len().min(16)]))
                }
                Err(e) => {
                    self.broken = Some(format!("{op}: {e}"));
                    (false, e.to_string())
                }
            }
        };
        self.checks.push(Check { op, dtype, redop, passed, detail });
    }
}

fn ops_for(d: DType) -> Vec<ReduceOp> {
    ReduceOp::ALL
        .into_iter()
        .map(|op| if let ReduceOp::PremulSum(_) = op { ReduceOp::PremulSum(0.5) } else { op })
        .filter(|op| op.supports(d))
        .collect()
}

/// Run every case on `pg` (collective: every rank calls it) with `n`
/// elements per basic tensor; this rank's results.
pub fn run(pg: &ProcessGroup, n: usize) -> Vec<Check> {
    run_on(pg, n, None)
}

/// As [`run`], with every tensor on `placement`'s device (the host if
/// `None`) and the ops issued on its stream.
pub fn run_on(pg: &ProcessGroup, n: usize, placement: Option<SharedPlacement>) -> Vec<Check> {
    on_stream_of(placement.as_ref(), || cases(pg, n, placement.clone()))
}

/// Run `f` with the ops issued on `placement`'s stream (the default one
/// for none).
pub(crate) fn on_stream_of(placement: Option<&SharedPlacement>, f: impl FnOnce() -> Vec<Check>) -> Vec<Check> {
    let previous = weft::stream::current_stream();
    weft::stream::set_current_stream(placement.map(|p| p.stream()));
    let checks = f();
    weft::stream::set_current_stream(previous);
    checks
}

/// A family of cases: one op (or one form of an op) over every dtype and
/// reduce op it takes, or one special case. [`run`] runs them all, in
/// [`Family::ALL`]'s order; [`run_family`] runs one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// all_reduce, every dtype and reduce op.
    AllReduce,
    /// reduce to the last rank, every dtype and reduce op.
    Reduce,
    /// reduce_scatter_single, every dtype and reduce op.
    ReduceScatterSingle,
    /// reduce_scatter of a list.
    ReduceScatterList,
    /// reduce_scatter_v (uneven parts).
    ReduceScatterV,
    /// broadcast from the last rank.
    Broadcast,
    /// all_gather_single.
    AllGatherSingle,
    /// all_gather into a list.
    AllGatherList,
    /// all_gather_v (uneven parts).
    AllGatherV,
    /// all_to_all_single.
    AllToAllSingle,
    /// all_to_all of lists.
    AllToAllList,
    /// all_to_all_v_single (uneven splits).
    AllToAllV,
    /// gather to rank 0.
    Gather,
    /// scatter from rank 0.
    Scatter,
    /// A ring of sends and receives in a scope.
    SendRecv,
    /// all_reduce of values whose reduced bits depend on the order they
    /// combine in: every rank must still end with the same bits.
    AllReduceBitsAlike,
    /// Sparse all_reduce, where the group has a backend for sparse host
    /// tensors (else no case).
    AllReduceSparse,
    /// barrier.
    Barrier,
}

impl Family {
    /// Every family, in the order [`run`] runs them.
    pub const ALL: [Family; 18] = [
        Family::AllReduce,
        Family::Reduce,
        Family::ReduceScatterSingle,
        Family::ReduceScatterList,
        Family::ReduceScatterV,
        Family::Broadcast,
        Family::AllGatherSingle,
        Family::AllGatherList,
        Family::AllGatherV,
        Family::AllToAllSingle,
        Family::AllToAllList,
        Family::AllToAllV,
        Family::Gather,
        Family::Scatter,
        Family::SendRecv,
        Family::AllReduceBitsAlike,
        Family::AllReduceSparse,
        Family::Barrier,
    ];
}

/// Run one family of cases on `pg` (collective), with `n` elements per
/// basic tensor and tensors on `placement`'s device (the host if `None`);
/// this rank's results. Families are independent: each can run alone, in
/// any order.
pub fn run_family(pg: &ProcessGroup, family: Family, n: usize, placement: Option<SharedPlacement>) -> Vec<Check> {
    on_stream_of(placement.as_ref(), || {
        let mut t = Runner::new(pg, placement.clone());
        family_cases(&mut t, family, n);
        t.checks
    })
}

fn cases(pg: &ProcessGroup, n: usize, placement: Option<SharedPlacement>) -> Vec<Check> {
    let mut t = Runner::new(pg, placement);
    for family in Family::ALL {
        family_cases(&mut t, family, n);
        // One failure costs at most the rest of its family.
        t.end_family();
    }
    t.checks
}

/// `family`'s cases, on the group `t` runs on.
fn family_cases(t: &mut Runner<'_>, family: Family, n: usize) {
    let (r, w) = (t.group().rank(), t.group().size());
    let o = OpOptions::default();
    let sum_for = |d: DType| if d == DType::Bool { ReduceOp::Bor } else { ReduceOp::Sum };
    let each: &dyn Fn(&mut Runner<'_>, DType) = match family {
        Family::AllReduce => &|t, d| {
            for op in ops_for(d) {
                t.case("all_reduce", d, Some(op), |pg, m| {
                    let mut b = m.buf(d, &make(d, r, n))?;
                    pg.all_reduce(b.tm(), op, &o)?.wait()?;
                    Ok((b.read()?, reduced_tensor(d, op, w, n)))
                });
            }
        },
        Family::Reduce => &|t, d| {
            for op in ops_for(d) {
                t.case("reduce", d, Some(op), |pg, m| {
                    let root = w - 1;
                    let mut b = m.buf(d, &make(d, r, n))?;
                    pg.reduce(b.tm(), root, op, &o)?.wait()?;
                    Ok((b.read()?, if r == root { reduced_tensor(d, op, w, n) } else { make(d, r, n) }))
                });
            }
        },
        Family::ReduceScatterSingle => &|t, d| {
            let sz = d.size();
            for op in ops_for(d) {
                t.case("reduce_scatter_single", d, Some(op), |pg, m| {
                    let input = m.buf(d, &make(d, r, n * w))?;
                    let mut out = m.zeros(d, n)?;
                    pg.reduce_scatter_single(out.tm(), input.t(), op, &o)?.wait()?;
                    Ok((out.read()?, reduced_tensor(d, op, w, n * w)[r * n * sz..(r + 1) * n * sz].to_vec()))
                });
            }
        },
        Family::ReduceScatterList => &|t, d| {
            let (sz, op) = (d.size(), sum_for(d));
            t.case("reduce_scatter (list)", d, Some(op), |pg, m| {
                let all = make(d, r, n * w);
                let ins: Vec<Buf> = (0..w).map(|i| m.buf(d, &all[i * n * sz..(i + 1) * n * sz])).collect::<weft::Result<_>>()?;
                let mut out = m.zeros(d, n)?;
                pg.reduce_scatter(out.tm(), ins.iter().map(Buf::t).collect(), op, &o)?.wait()?;
                Ok((out.read()?, reduced_tensor(d, op, w, n * w)[r * n * sz..(r + 1) * n * sz].to_vec()))
            });
        },
        Family::ReduceScatterV => &|t, d| {
            let op = sum_for(d);
            t.case("reduce_scatter_v", d, Some(op), |pg, m| {
                let ins: Vec<Buf> = (0..w).map(|i| m.buf(d, &make(d, r, i % 3))).collect::<weft::Result<_>>()?;
                let mut out = m.zeros(d, r % 3)?;
                pg.reduce_scatter_v(out.tm(), ins.iter().map(Buf::t).collect(), op, &o)?.wait()?;
                Ok((out.read()?, reduced_tensor(d, op, w, r % 3)))
            });
        },
        Family::Broadcast => &|t, d| {
            t.case("broadcast", d, None, |pg, m| {
                let mut b = m.buf(d, &make(d, r, n))?;
                pg.broadcast(b.tm(), w - 1, &o)?.wait()?;
                Ok((b.read()?, make(d, w - 1, n)))
            });
        },
        Family::AllGatherSingle => &|t, d| {
            t.case("all_gather_single", d, None, |pg, m| {
                let input = m.buf(d, &make(d, r, n))?;
                let mut out = m.zeros(d, n * w)?;
                pg.all_gather_single(out.tm(), input.t(), &o)?.wait()?;
                Ok((out.read()?, (0..w).flat_map(|i| make(d, i, n)).collect()))
            });
        },
        Family::AllGatherList => &|t, d| {
            t.case("all_gather (list)", d, None, |pg, m| {
                let input = m.buf(d, &make(d, r, n))?;
                let mut outs: Vec<Buf> = (0..w).map(|_| m.zeros(d, n)).collect::<weft::Result<_>>()?;
                pg.all_gather(outs.iter_mut().map(Buf::tm).collect(), input.t(), &o)?.wait()?;
                Ok((read_all(&outs)?, (0..w).flat_map(|i| make(d, i, n)).collect()))
            });
        },
        Family::AllGatherV => &|t, d| {
            t.case("all_gather_v", d, None, |pg, m| {
                let input = m.buf(d, &make(d, r, r % 3))?;
                let mut outs: Vec<Buf> = (0..w).map(|i| m.zeros(d, i % 3)).collect::<weft::Result<_>>()?;
                pg.all_gather_v(outs.iter_mut().map(Buf::tm).collect(), input.t(), &o)?.wait()?;
                Ok((read_all(&outs)?, (0..w).flat_map(|i| make(d, i, i % 3)).collect()))
            });
        },
        Family::AllToAllSingle => &|t, d| {
            t.case("all_to_all_single", d, None, |pg, m| {
                let input = m.buf(d, &(0..w).flat_map(|dst| make(d, 100 * r + dst, n)).collect::<Vec<u8>>())?;
                let mut out = m.zeros(d, n * w)?;
                pg.all_to_all_single(out.tm(), input.t(), &o)?.wait()?;
                Ok((out.read()?, (0..w).flat_map(|src| make(d, 100 * src + r, n)).collect()))
            });
        },
        Family::AllToAllList => &|t, d| {
            t.case("all_to_all (list)", d, None, |pg, m| {
                let ins: Vec<Buf> = (0..w).map(|dst| m.buf(d, &make(d, 100 * r + dst, n))).collect::<weft::Result<_>>()?;
                let mut outs: Vec<Buf> = (0..w).map(|_| m.zeros(d, n)).collect::<weft::Result<_>>()?;
                pg.all_to_all(outs.iter_mut().map(Buf::tm).collect(), ins.iter().map(Buf::t).collect(), &o)?.wait()?;
                Ok((read_all(&outs)?, (0..w).flat_map(|src| make(d, 100 * src + r, n)).collect()))
            });
        },
        Family::AllToAllV => &|t, d| {
            t.case("all_to_all_v_single", d, None, |pg, m| {
                let ins: Vec<usize> = (0..w).map(|dst| (r + dst) % 3).collect();
                let outs: Vec<usize> = (0..w).map(|src| (src + r) % 3).collect();
                let input = m.buf(d, &(0..w).flat_map(|dst| make(d, 100 * r + dst, ins[dst])).collect::<Vec<u8>>())?;
                let mut out = m.zeros(d, outs.iter().sum())?;
                pg.all_to_all_v_single(out.tm(), input.t(), &outs, &ins, &o)?.wait()?;
                Ok((out.read()?, (0..w).flat_map(|src| make(d, 100 * src + r, outs[src])).collect()))
            });
        },
        Family::Gather => &|t, d| {
            t.case("gather", d, None, |pg, m| {
                let input = m.buf(d, &make(d, r, n))?;
                let mut outs: Vec<Buf> = if r == 0 { (0..w).map(|_| m.zeros(d, n)).collect::<weft::Result<_>>()? } else { vec![] };
                pg.gather(outs.iter_mut().map(Buf::tm).collect(), input.t(), 0, &o)?.wait()?;
                let want: Vec<u8> = if r == 0 { (0..w).flat_map(|i| make(d, i, n)).collect() } else { vec![] };
                Ok((read_all(&outs)?, want))
            });
        },
        Family::Scatter => &|t, d| {
            t.case("scatter", d, None, |pg, m| {
                let ins: Vec<Buf> =
                    if r == 0 { (0..w).map(|i| m.buf(d, &make(d, 10 + i, n))).collect::<weft::Result<_>>()? } else { vec![] };
                let mut out = m.zeros(d, n)?;
                pg.scatter(out.tm(), ins.iter().map(Buf::t).collect(), 0, &o)?.wait()?;
                Ok((out.read()?, make(d, 10 + r, n)))
            });
        },
        Family::SendRecv => &|t, d| {
            t.case("send_recv", d, None, |pg, m| {
                // A ring: send to the right, receive from the left, tags by dtype.
                if w == 1 {
                    return Ok((vec![], vec![]));
                }
                let tag = d as u32;
                let input = m.buf(d, &make(d, r, n))?;
                let mut out = m.zeros(d, n)?;
                pg.scope(|s| -> weft::Result<()> {
                    let a = s.send(input.t(), (r + 1) % w, tag, &o)?;
                    let b = s.recv(out.tm(), (r + w - 1) % w, tag, &o)?;
                    a.wait()?;
                    b.wait()
                })?;
                Ok((out.read()?, make(d, (r + w - 1) % w, n)))
            });
        },
        Family::AllReduceBitsAlike => {
            // Each rank gathers everyone's result to compare the bits.
            for op in [ReduceOp::Sum, ReduceOp::Min, ReduceOp::Max] {
                t.case("all_reduce (bits alike on every rank)", DType::F32, Some(op), |pg, m| {
                    let v = crate::reference::order_sensitive(r, n);
                    let mut b = m.buf(DType::F32, &v.into_iter().flat_map(f32::to_ne_bytes).collect::<Vec<u8>>())?;
                    pg.all_reduce(b.tm(), op, &o)?.wait()?;
                    let mut all = m.zeros(DType::F32, n * w)?;
                    pg.all_gather_single(all.tm(), b.t(), &o)?.wait()?;
                    Ok((all.read()?, b.read()?.repeat(w)))
                });
            }
            return;
        }
        Family::AllReduceSparse => {
            let sparse = t.mk.0.is_none() && t.group().backend_name((weft::DeviceKind::Cpu, weft::Layout::SparseCoo)).is_some();
            if sparse {
                sparse_case(t, &o);
            }
            return;
        }
        Family::Barrier => {
            t.case("barrier", DType::U8, None, |pg, _| {
                pg.barrier(&o)?.wait()?;
                Ok((vec![], vec![]))
            });
            return;
        }
    };
    for d in DType::ALL {
        each(t, d);
    }
}

/// Sparse all-reduce (SUM of f32 rows; host memory, where the group has a
/// sparse backend): rank r contributes rows r and 4W (three values each,
/// all r + 1); the result has rows 0..W (from one rank each) and 4W (the
/// sum over ranks), coalesced and sorted.
fn sparse_case(t: &mut Runner<'_>, o: &OpOptions) {
    let (r, w) = (t.group().rank(), t.group().size());
    t.case("all_reduce_sparse", DType::F32, Some(ReduceOp::Sum), |pg, _| {
        let last = 4 * w as i64;
        let indices: Vec<i64> = vec![r as i64, last];
        let values: Vec<f32> = vec![r as f32 + 1.0; 6];
        let idx = Tensor::from(&indices[..]).reshape(&[1, 2])?;
        let vals = Tensor::from(&values[..]).reshape(&[2, 3])?;
        let input = SparseCooTensor::new(idx, vals, vec![4 * w + 1, 3])?;
        let mut out = SparseCoo::default();
        pg.all_reduce_sparse(&mut out, input, ReduceOp::Sum, o)?.wait()?;
        let want_idx: Vec<i64> = (0..w as i64).chain([last]).collect();
        if out.indices != want_idx {
            return Err(weft::Error::backend(format!("indices {:?}, expected {want_idx:?}", out.indices)));
        }
        let mut want: Vec<f32> = (0..w).flat_map(|k| [k as f32 + 1.0; 3]).collect();
        want.extend([(w * (w + 1) / 2) as f32; 3]);
        Ok((out.values.clone(), want.iter().flat_map(|v| v.to_ne_bytes()).collect()))
    });
}

/// Message sizes of [`run_p2p`]'s ring exchange and their case names:
/// around cpu-tcp's 1 MiB rendezvous threshold, and well past it.
const RING: [(usize, &str); 5] = [
    (0, "p2p ring in a scope, 0 B"),
    (1, "p2p ring in a scope, 1 B"),
    ((1 << 20) - 1, "p2p ring in a scope, 1 MiB - 1"),
    ((1 << 20) + 1, "p2p ring in a scope, 1 MiB + 1"),
    (16 << 20, "p2p ring in a scope, 16 MiB"),
];

/// Point-to-point patterns that complete only if sends and receives
/// progress together: a ring exchange in a scope (every rank sends to its
/// right, then receives from its left) at sizes up to `max_bytes`, the same
/// with receives first as one batch, and `sendrecv`. Needs two ranks or
/// more. Tensors on `placement` as in [`run_on`].
pub fn run_p2p(pg: &ProcessGroup, placement: Option<SharedPlacement>, max_bytes: usize) -> Vec<Check> {
    on_stream_of(placement.as_ref(), || p2p_cases(pg, placement.clone(), max_bytes))
}

fn p2p_cases(pg: &ProcessGroup, placement: Option<SharedPlacement>, max_bytes: usize) -> Vec<Check> {
    let (r, w) = (pg.rank(), pg.size());
    let (right, left) = ((r + 1) % w, (r + w - 1) % w);
    let o = OpOptions::default();
    let d = DType::U8;
    let mut t = Runner::new(pg, placement);
    for (k, &(n, name)) in RING.iter().enumerate().filter(|(_, (n, _))| *n <= max_bytes) {
        let tag = 100 + k as u32;
        t.case(name, d, None, |pg, m| {
            let input = m.buf(d, &make(d, r, n))?;
            let mut out = m.zeros(d, n)?;
            pg.scope(|s| -> weft::Result<()> {
                let a = s.send(input.t(), right, tag, &o)?;
                let b = s.recv(out.tm(), left, tag, &o)?;
                a.wait()?;
                b.wait()
            })?;
            Ok((out.read()?, make(d, left, n)))
        });
    }
    let n = max_bytes.min((1 << 20) + 1);
    t.case("p2p batch, receives first, both directions", d, None, |pg, m| {
        let (to_right, to_left) = (m.buf(d, &make(d, r, n))?, m.buf(d, &make(d, 50 + r, n))?);
        let (mut from_left, mut from_right) = (m.zeros(d, n)?, m.zeros(d, n)?);
        let ops = vec![
            P2pOp::recv(from_left.tm(), left, 200),
            P2pOp::recv(from_right.tm(), right, 201),
            P2pOp::send(to_right.t(), right, 200),
            P2pOp::send(to_left.t(), left, 201),
        ];
        pg.batch_p2p(ops, &o)?.wait()?;
        let mut got = from_left.read()?;
        got.extend(from_right.read()?);
        let mut want = make(d, left, n);
        want.extend(make(d, 50 + right, n));
        Ok((got, want))
    });
    t.case("sendrecv", d, None, |pg, m| {
        let input = m.buf(d, &make(d, r, n))?;
        let mut out = m.zeros(d, n)?;
        pg.sendrecv(input.t(), right, out.tm(), left, 202, &o)?.wait()?;
        Ok((out.read()?, make(d, left, n)))
    });
    // Every rank sends a size of its own: what a rank sends and receives differ.
    let size_of = |rank: usize| n / (1 + rank) + rank;
    t.case("sendrecv, another size each way", d, None, |pg, m| {
        let input = m.buf(d, &make(d, r, size_of(r)))?;
        let mut out = m.zeros(d, size_of(left))?;
        pg.sendrecv(input.t(), right, out.tm(), left, 203, &o)?.wait()?;
        Ok((out.read()?, make(d, left, size_of(left))))
    });
    t.checks
}

/// A table of the checks (failures first) and whether all passed.
pub fn summary(checks: &[Check]) -> (String, bool) {
    let mut rows: Vec<&Check> = checks.iter().collect();
    rows.sort_by_key(|c| c.passed);
    let mut out = format!("{:<24} {:<6} {:<16} result\n", "op", "dtype", "redop");
    for c in &rows {
        let redop = c.redop.map(|o| o.to_string()).unwrap_or_else(|| "-".into());
        let res = if c.passed { "pass".to_string() } else { format!("FAIL {}", c.detail) };
        out += &format!("{:<24} {:<6} {:<16} {res}\n", c.op, c.dtype.name(), redop);
    }
    let failed = checks.iter().filter(|c| !c.passed).count();
    out += &format!("{} passed, {} failed\n", checks.len() - failed, failed);
    (out, failed == 0)
}
