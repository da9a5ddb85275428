//! Mixture-of-experts token dispatch and combine (expert parallelism) over
//! any backend: each rank holds `num_experts / W` experts (rank r the ids
//! `r * E/W .. (r + 1) * E/W`).
//!
//! - **Dispatch** sends each token's row to the ranks that hold its top-k
//!   experts, once per rank however many of its experts live there, and
//!   lands the rows there grouped by local expert (then by source rank,
//!   then token order), one row per (token, expert). The counts travel
//!   with the data: each message to another rank starts with a header
//!   (validity, what all ranks must agree on, how many tokens and pairs
//!   follow), then the rows, then each token's local experts. It runs in
//!   two steps: [`ProcessGroup::dispatch_plan`] exchanges fixed-size first
//!   parts (the header and what fits of the message: a small dispatch is
//!   all there), so the caller can size the output; [`ProcessGroup::dispatch`]
//!   exchanges the rest of the messages that did not fit (only if some
//!   rank's did not: every header says whether its sender has more), lands
//!   the rows, and returns the [`ExpertRouting`]: the handle a combine and
//!   a second dispatch reuse without exchanging counts again.
//! - **Combine** ([`ProcessGroup::combine`]) weights each expert's row,
//!   sums the rows of one token's experts on their rank, sends one row per
//!   (token, rank) back, and sums those on the token's rank.
//! - Per-pair values (the router's weights, their gradients) travel as
//!   lists in the pairs' canonical order ([`ProcessGroup::pair_values_to_experts`],
//!   [`ProcessGroup::pair_values_to_tokens`]).
//! - The backward passes: a dispatch's is a combine with weights one; a
//!   combine's is [`ProcessGroup::combine_backward`] (the output's
//!   gradient dispatched once per (token, rank), scaled per expert row,
//!   and the router weights' gradients sent back). The Python layer's
//!   autograd (`weft.moe`) is built from these.
//!
//! Invalid routing on any rank (an expert id out of range, a number of
//! experts not divisible by W, shapes that disagree) fails the dispatch on
//! every rank, after the first exchange, naming the ranks; never wrong
//! data. The routing logic (what goes where) is `plan.rs`, without I/O;
//! this file moves bytes through the group's `all_to_all`.

mod plan;
mod spare;

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::{Collectives, ProcessGroup};
use crate::kernels::weighted::{self, WeightedSum};
use crate::options::OpOptions;
use crate::tensor::{Tensor, TensorMut};
use plan::{first_part, in_first_part, meta_bytes, Header, Placement, Plan, HEADER};

/// Step one of a dispatch, done: every rank's first part has arrived,
/// with its header and the start of its rows. Say how many rows this rank
/// receives ([`DispatchPlan::rows`]), then pass it to
/// [`ProcessGroup::dispatch`], on every rank (the other ranks' second
/// parts wait for it).
pub struct DispatchPlan {
    plan: Plan,
    /// What each rank sends this one.
    headers: Vec<Header>,
    shape: Shape,
    /// The messages this rank sends (rows, then metadata), whole: their
    /// first parts are gone, the rest goes in `dispatch`. This rank's own
    /// is its metadata alone (see `token_rows`).
    sends: Vec<Vec<u8>>,
    /// The messages this rank receives, as long as their headers say:
    /// the first parts in place, the rest to come.
    got: Vec<Vec<u8>>,
    /// Some rank's message outgrew its first part: a second exchange runs.
    more: bool,
    /// Where the rows of `x` were (address, bytes): `dispatch` reads this
    /// rank's own tokens from there and takes no other tensor.
    x_at: (usize, usize),
}

impl std::fmt::Debug for DispatchPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatchPlan").field("rows", &self.rows()).field("second_part", &self.more).finish_non_exhaustive()
    }
}

/// What one dispatch's ranks agree on.
#[derive(Clone, Copy, Debug)]
struct Shape {
    tokens: usize,
    k: usize,
    hidden: usize,
    dtype: DType,
    experts: usize,
}

impl Shape {
    fn row_bytes(&self) -> usize {
        self.hidden * self.dtype.size()
    }
}

impl DispatchPlan {
    /// Rows this rank's experts receive: one per (token, local expert).
    pub fn rows(&self) -> usize {
        self.headers.iter().map(|h| h.pairs as usize).sum()
    }
}

/// How one dispatch's tokens were routed, on this rank: the handle a
/// combine, a second dispatch with the same routing and the per-pair
/// value exchanges reuse.
#[derive(Debug)]
pub struct ExpertRouting {
    plan: Plan,
    placed: Placement,
    shape: Shape,
    rank: usize,
}

impl ExpertRouting {
    /// Rows received per local expert (in local expert order).
    pub fn counts(&self) -> &[usize] {
        &self.placed.counts
    }
    /// Rows received in all.
    pub fn rows(&self) -> usize {
        self.placed.total()
    }
    /// Tokens on this rank (the dispatch's input rows).
    pub fn tokens(&self) -> usize {
        self.shape.tokens
    }
    /// Experts chosen per token.
    pub fn k(&self) -> usize {
        self.shape.k
    }
    /// Elements per row.
    pub fn hidden(&self) -> usize {
        self.shape.hidden
    }
    /// Row bytes this rank sends in one dispatch of `dtype` rows, and
    /// receives in a combine of them: one row per (token, other rank that
    /// holds any of its experts).
    pub fn bytes_sent(&self, dtype: DType) -> usize {
        let tokens: usize = self.plan.tokens.iter().enumerate().filter(|(r, _)| *r != self.rank).map(|(_, t)| t.len()).sum();
        tokens * self.shape.hidden * dtype.size()
    }
}

impl ProcessGroup {
    /// Step one of a dispatch: check the routing and the rows, and send
    /// every rank the first part of its message: a header (validity, what
    /// all ranks must agree on, how many tokens and pairs follow), then as
    /// much of the rows and their metadata as fits (16 KiB in all up to 16 ranks, less beyond).
    /// `topk_idx` holds `k` expert ids per token (`-1`: none), `x` the
    /// tokens' rows (`[tokens, hidden]`, a float dtype). Collective: every
    /// rank calls it, with the same `k`, `num_experts`, `hidden` and dtype;
    /// a rank with no tokens passes empty lists. Invalid arguments on any
    /// rank fail it on every rank, naming the ranks. A dispatch whose
    /// messages all fit their first parts is complete here but for the
    /// landing; only longer ones exchange a second part, in `dispatch`.
    pub fn dispatch_plan(
        &self,
        topk_idx: &[i64],
        k: usize,
        num_experts: usize,
        x: Tensor<'_>,
        hidden: usize,
        opts: &OpOptions,
    ) -> Result<DispatchPlan> {
        const NAME: &str = "dispatch";
        let (rank, world, dtype) = (self.rank(), self.size(), x.dtype());
        let fail = |e: Error| e.with_op(NAME).with_rank(rank);
        let tokens = topk_idx.len().checked_div(k).unwrap_or(0);
        let shape = Shape { tokens, k, hidden, dtype, experts: num_experts };
        let row = shape.row_bytes();
        let planned = weighted::require_float(dtype)
            .and_then(|_| if hidden == 0 { Err(Error::invalid("hidden (elements per row) must be at least 1")) } else { Ok(()) })
            .and_then(|_| Plan::new(topk_idx, k, num_experts, world))
            .and_then(|plan| Ok((plan, rows_of(&x, shape, tokens, "x")?)));
        // The whole messages: rows, then the tokens' local experts.
        let sends = match &planned {
            Ok((plan, x)) => {
                let meta = |r: usize| meta_bytes(plan.tokens[r].len(), plan.pairs[r].len());
                let mut sends = self.or_abort(token_rows(&plan.tokens, Some(x), row, rank, meta)).map_err(fail)?;
                for (r, b) in sends.iter_mut().enumerate() {
                    let at = b.len() - meta(r);
                    plan.meta(r, k, &mut b[at..]);
                }
                sends
            }
            Err(_) => vec![Vec::new(); world],
        };
        let more = sends.iter().enumerate().any(|(r, b)| r != rank && b.len() > in_first_part(b.len(), world));
        let mine: Vec<Header> = (0..world)
            .map(|r| Header {
                ok: planned.is_ok(),
                experts: num_experts as u64,
                row_bytes: row as u64,
                dtype: dtype as u64,
                tokens: planned.as_ref().map_or(0, |(p, _)| p.tokens[r].len() as u64),
                pairs: planned.as_ref().map_or(0, |(p, _)| p.pairs[r].len() as u64),
                k: k as u64,
                more,
            })
            .collect();
        // First parts, a fixed size each way (this rank's own: its header).
        let part = |r: usize| if r == rank { HEADER } else { first_part(world) };
        let firsts = (0..world)
            .map(|r| {
                let mut b = spare::take(part(r))?;
                mine[r].encode(&mut b[..HEADER]);
                let n = if r == rank { 0 } else { in_first_part(sends[r].len(), world) };
                b[HEADER..HEADER + n].copy_from_slice(&sends[r][..n]);
                b[HEADER + n..].fill(0);
                Ok(b)
            })
            .collect::<Result<Vec<_>>>();
        let firsts = self.or_abort(firsts).map_err(fail)?;
        let got_firsts = self.or_abort((0..world).map(|r| spare::take(part(r))).collect::<Result<Vec<_>>>()).map_err(fail)?;
        let got_firsts = self.all_to_all_bytes(firsts, got_firsts, opts)?;
        let headers: Vec<Header> = got_firsts.iter().map(|b| Header::decode(&b[..HEADER])).collect();
        let checked = self.check_headers(&headers, &mine, row);
        let (plan, x) = planned.map_err(fail)?;
        checked.map_err(fail)?;
        // The messages as long as their headers say (checked: no sender
        // could announce more), their first parts in place.
        let mut sends = sends;
        let own_meta = std::mem::take(&mut sends[rank]);
        let got = headers
            .iter()
            .zip(&got_firsts)
            .enumerate()
            .map(|(s, (h, first))| {
                if s == rank {
                    return Ok(Vec::new());
                }
                let len = h.message_bytes(row).expect("checked");
                let mut b = spare::take(len)?;
                let n = in_first_part(len, world);
                b[..n].copy_from_slice(&first[HEADER..HEADER + n]);
                Ok(b)
            })
            .collect::<Result<Vec<_>>>();
        spare::give(got_firsts);
        let mut got = self.or_abort(got).map_err(fail)?;
        got[rank] = own_meta;
        let more = headers.iter().any(|h| h.more);
        Ok(DispatchPlan { plan, headers, shape, sends, got, more, x_at: (x.as_ptr() as usize, x.len()) })
    }

    /// What `dispatch_plan` makes of the headers every rank sent this one
    /// (`mine`: what it sent them), rows of `row` bytes: every rank's
    /// routing valid, the ranks agreeing, and counts that a sender could
    /// announce.
    fn check_headers(&self, headers: &[Header], mine: &[Header], row: usize) -> Result<()> {
        let invalid: Vec<usize> = (0..headers.len()).filter(|r| !headers[*r].ok).collect();
        if !invalid.is_empty() {
            return Err(Error::invalid(format!("rank(s) {invalid:?} passed invalid routing or rows (see their errors)")));
        }
        let differ = |what: &str, get: fn(&Header) -> u64, show: &dyn Fn(u64) -> String| -> Result<()> {
            let odd: Vec<String> = headers
                .iter()
                .enumerate()
                .filter(|(_, h)| get(h) != get(&mine[0]))
                .map(|(r, h)| format!("rank {r}: {}", show(get(h))))
                .collect();
            if odd.is_empty() {
                return Ok(());
            }
            Err(Error::invalid(format!("ranks disagree on {what}: this rank has {}, {}", show(get(&mine[0])), odd.join(", "))))
        };
        differ("num_experts", |h| h.experts, &|v| v.to_string())?;
        differ("the dtype", |h| h.dtype, &|v| DType::ALL.get(v as usize).map_or(v.to_string(), |d| d.to_string()))?;
        differ("the row size in bytes (hidden x dtype size)", |h| h.row_bytes, &|v| v.to_string())?;
        let more = headers.iter().any(|h| h.more);
        for (s, h) in headers.iter().enumerate() {
            // Counts no sender could announce are refused before anything
            // is allocated for them, as is a second part nobody announced.
            // The peers that got honest headers go on into the dispatch:
            // the group is aborted, so that they fail at once instead of
            // at their timeout.
            // (This rank's own part never travels: its rows stay in `x`.)
            let why = match h.message_bytes(row) {
                Err(why) => why,
                Ok(len) if s != self.rank() && !more && len > in_first_part(len, headers.len()) => {
                    format!("{len} bytes without a second part")
                }
                Ok(_) => continue,
            };
            self.abort();
            return Err(Error::backend(format!("rank {s} announced a dispatch that cannot be: {why}")));
        }
        Ok(())
    }

    /// Step two of a dispatch: the rest of every message that outgrew its
    /// first part, then the rows land in `out` (`[plan.rows(), hidden]`,
    /// grouped by local expert). `x` is the tensor `dispatch_plan` took
    /// (this rank's own tokens are read from it). Collective, after every
    /// rank's [`ProcessGroup::dispatch_plan`]. A wrong `x` or `out` here
    /// fails this rank only: what it sends was taken at the plan.
    pub fn dispatch(&self, plan: DispatchPlan, x: Tensor<'_>, mut out: TensorMut<'_>, opts: &OpOptions) -> Result<ExpertRouting> {
        const NAME: &str = "dispatch";
        let DispatchPlan { plan, headers, shape, sends, mut got, more, x_at } = plan;
        let (rank, row) = (self.rank(), shape.row_bytes());
        let fail = |e: Error| e.with_op(NAME).with_rank(rank);
        if more {
            let first = |b: &[u8]| in_first_part(b.len(), self.size());
            let inputs = sends.iter().map(|b| &b[first(b)..]);
            let outputs = got.iter_mut().enumerate().map(|(s, b)| {
                let at = if s == rank { b.len() } else { first(b) };
                &mut b[at..]
            });
            self.exchange_slices(inputs, outputs, opts)?;
        }
        spare::give(sends);
        let x = rows_of(&x, shape, shape.tokens, "x").and_then(|b| {
            if (b.as_ptr() as usize, b.len()) != x_at {
                return Err(Error::invalid("x is not the tensor dispatch_plan took"));
            }
            Ok(b)
        });
        let landed = x.and_then(|x| {
            // This rank's own part is its metadata alone (see `token_rows`).
            let metas: Vec<&[u8]> = got
                .iter()
                .zip(&headers)
                .enumerate()
                .map(|(s, (b, h))| if s == rank { &b[..] } else { &b[h.tokens as usize * row..] })
                .collect();
            let placed = Placement::new(&metas, &headers, shape.experts / self.size())?;
            let out = rows_of_mut(&mut out, shape, placed.total(), "out")?;
            let from = Sources { got: &got, rank, x, own: &plan.tokens[rank], row };
            each_pair(&placed, &from, |r, token_row| out[r * row..(r + 1) * row].copy_from_slice(token_row));
            Ok(placed)
        });
        spare::give(got);
        Ok(ExpertRouting { plan, placed: landed.map_err(fail)?, shape, rank })
    }

    /// A second dispatch with `routing`: the rows of `x` (`[tokens,
    /// hidden]`, any float dtype, the same on every rank) into `out`
    /// (`[routing.rows(), hidden]`), without headers or counts.
    pub fn dispatch_again(&self, routing: &ExpertRouting, x: Tensor<'_>, mut out: TensorMut<'_>, opts: &OpOptions) -> Result<()> {
        const NAME: &str = "dispatch";
        let shape = Shape { dtype: x.dtype(), ..routing.shape };
        let row = shape.row_bytes();
        let fail = |e: Error| e.with_op(NAME).with_rank(self.rank());
        let checked =
            rows_of(&x, shape, shape.tokens, "x").and_then(|x| Ok((x, rows_of_mut(&mut out, shape, routing.placed.total(), "out")?)));
        let (x, out) = match checked {
            Ok((x, out)) => (Some(x), Some(out)),
            Err(e) => {
                let _ = self.spread(NAME, routing, None, row, opts);
                return Err(fail(e));
            }
        };
        let got = self.spread(NAME, routing, x, row, opts)?;
        let (x, out) = (x.expect("checked"), out.expect("checked"));
        let from = Sources { got: &got, rank: self.rank(), x, own: &routing.plan.tokens[self.rank()], row };
        each_pair(&routing.placed, &from, |r, token_row| out[r * row..(r + 1) * row].copy_from_slice(token_row));
        spare::give(got);
        Ok(())
    }

    /// The backward pass of a [`ProcessGroup::combine`] (collective):
    /// from `dy` (`[tokens, hidden]`, the gradient of its output) and what
    /// it took (`expert_out`, `weights` per row), `grad_expert_out`
    /// (`[rows, hidden]`) becomes `weights[row] * dy[token]`, and the
    /// result is the gradient of the per-pair weights, `[tokens, k]` (zero
    /// for slots routed nowhere). One row per (token, rank) travels to the
    /// experts, as in a dispatch, and one value per pair back.
    pub fn combine_backward(
        &self,
        routing: &ExpertRouting,
        dy: Tensor<'_>,
        expert_out: Tensor<'_>,
        weights: &[f64],
        mut grad_expert_out: TensorMut<'_>,
        opts: &OpOptions,
    ) -> Result<Vec<f64>> {
        const NAME: &str = "combine_backward";
        let shape = Shape { dtype: dy.dtype(), ..routing.shape };
        let (row, rows) = (shape.row_bytes(), routing.placed.total());
        let fail = |e: Error| e.with_op(NAME).with_rank(self.rank());
        let checked = backward_rows(&dy, &expert_out, &mut grad_expert_out, weights, shape, rows);
        let (dy, eo, grad) = match checked {
            Ok(parts) => parts,
            Err(e) => {
                let _ = self.spread(NAME, routing, None, row, opts);
                return Err(fail(e));
            }
        };
        let got = self.spread(NAME, routing, Some(dy), row, opts)?;
        let mut grad_w = vec![0.0; rows];
        let from = Sources { got: &got, rank: self.rank(), x: dy, own: &routing.plan.tokens[self.rank()], row };
        each_pair(&routing.placed, &from, |r, dy_row| {
            let (at, end) = (r * row, (r + 1) * row);
            grad_w[r] = weighted::scale_and_dot(&mut grad[at..end], dy_row, &eo[at..end], shape.dtype, weights[r]);
        });
        spare::give(got);
        self.pair_values_to_tokens(routing, &grad_w, opts)
    }

    /// Send each token's row of `x` (rows of `row` bytes; `None`: this
    /// rank's arguments were invalid, and it sends zeros) to every other
    /// rank holding its experts, once per rank: what each rank sent, by
    /// source (this rank's own part stays in `x`: see [`Sources`]).
    fn spread(&self, name: &'static str, routing: &ExpertRouting, x: Option<&[u8]>, row: usize, opts: &OpOptions) -> Result<Vec<Vec<u8>>> {
        let rank = self.rank();
        let sends = self.or_abort(token_rows(&routing.plan.tokens, x, row, rank, |_| 0)).map_err(|e| e.with_op(name).with_rank(rank))?;
        let sizes: Vec<usize> = routing.placed.tokens.iter().enumerate().map(|(s, t)| if s == rank { 0 } else { t * row }).collect();
        self.exchange_bytes(name, sends, &sizes, x.is_some(), opts)
    }

    /// Combine: `out` (`[tokens, hidden]`) becomes, per token, the sum
    /// over its experts of `weights[row] * expert_out[row]` (`weights` in
    /// `expert_out`'s row order, as [`ProcessGroup::pair_values_to_experts`]
    /// gives them). One token's rows on one rank are summed there first,
    /// so one row per (token, rank) travels back. `expert_out` and `out`
    /// share a float dtype; sums are taken in f32 (f64 for f64).
    pub fn combine(
        &self,
        routing: &ExpertRouting,
        expert_out: Tensor<'_>,
        weights: &[f64],
        mut out: TensorMut<'_>,
        opts: &OpOptions,
    ) -> Result<()> {
        const NAME: &str = "combine";
        let shape = Shape { dtype: expert_out.dtype(), ..routing.shape };
        let fail = |e: Error| e.with_op(NAME).with_rank(self.rank());
        let (plan, placed, row, h) = (&routing.plan, &routing.placed, shape.row_bytes(), shape.hidden);
        let checked = (|| {
            if weights.len() != placed.total() {
                return Err(Error::invalid(format!("weights has {} entries, expected one per row ({})", weights.len(), placed.total())));
            }
            if out.dtype() != shape.dtype || out.numel() != shape.tokens * h {
                let want = format!("{} x {} elements of {}", shape.tokens, h, shape.dtype);
                return Err(Error::invalid(format!("out has {} elements of {}, expected {want}", out.numel(), out.dtype())));
            }
            weighted::require_float(shape.dtype)?;
            rows_of(&expert_out, shape, placed.total(), "expert_out")
        })();
        // Expert side: per source rank, one weighted sum per token (its
        // pairs are adjacent in canonical order), summed in one row.
        let mut sum = WeightedSum::zeros(shape.dtype, h).map_err(fail);
        let sends = placed
            .rows
            .iter()
            .zip(&placed.token_of)
            .zip(&placed.tokens)
            .map(|((pair_rows, token_of), tokens)| {
                // Every token received has a pair: each slot is written.
                let (Ok(rows), Ok(sum)) = (&checked, &mut sum) else { return spare::zeros(tokens * row) };
                let mut b = spare::take(tokens * row)?;
                let mut p = 0;
                while p < pair_rows.len() {
                    let i = token_of[p] as usize;
                    sum.clear();
                    while p < pair_rows.len() && token_of[p] as usize == i {
                        let r = pair_rows[p] as usize;
                        sum.add(0, &rows[r * row..(r + 1) * row], weights[r]);
                        p += 1;
                    }
                    sum.write(0, &mut b[i * row..(i + 1) * row]);
                }
                Ok(b)
            })
            .collect::<Result<Vec<_>>>();
        let sends = self.or_abort(sends).map_err(fail)?;
        let sizes: Vec<usize> = plan.tokens.iter().map(|t| t.len() * row).collect();
        let got = self.exchange_bytes(NAME, sends, &sizes, checked.is_ok(), opts);
        checked.map_err(fail)?;
        let (got, mut sum) = (got?, sum?);
        // Token side: each token's rows from the ranks it went to, summed
        // (the ranks' lists are ascending: one cursor each).
        let out = out.host_bytes_mut().map_err(fail)?;
        let mut next = vec![0usize; got.len()];
        for (t, o) in out.chunks_exact_mut(row.max(1)).enumerate().take(shape.tokens) {
            sum.clear();
            for ((toks, b), at) in plan.tokens.iter().zip(&got).zip(next.iter_mut()) {
                if toks.get(*at) == Some(&(t as u32)) {
                    sum.add(0, &b[*at * row..(*at + 1) * row], 1.0);
                    *at += 1;
                }
            }
            sum.write(0, o);
        }
        spare::give(got);
        Ok(())
    }

    /// Per-pair values from the tokens' side to the experts': `values`
    /// holds `tokens * k` values (`[tokens, k]`, as `topk_idx`); the
    /// result one per received row, in the dispatch's row order (slots
    /// routed nowhere are dropped).
    pub fn pair_values_to_experts(&self, routing: &ExpertRouting, values: &[f64], opts: &OpOptions) -> Result<Vec<f64>> {
        let (plan, placed, s) = (&routing.plan, &routing.placed, routing.shape);
        let from: Vec<&[u32]> = plan.pairs.iter().map(|p| &p[..]).collect();
        let to: Vec<&[u32]> = placed.rows.iter().map(|r| &r[..]).collect();
        self.move_pair_values("pair_values_to_experts", values, s.tokens * s.k, "tokens x k", &from, &to, placed.total(), opts)
    }

    /// Per-pair values from the experts' side back to the tokens':
    /// `values` holds one per received row (the dispatch's row order); the
    /// result `tokens * k` values (`[tokens, k]`), zero for slots routed
    /// nowhere.
    pub fn pair_values_to_tokens(&self, routing: &ExpertRouting, values: &[f64], opts: &OpOptions) -> Result<Vec<f64>> {
        let (plan, placed, s) = (&routing.plan, &routing.placed, routing.shape);
        let from: Vec<&[u32]> = placed.rows.iter().map(|r| &r[..]).collect();
        let to: Vec<&[u32]> = plan.pairs.iter().map(|p| &p[..]).collect();
        self.move_pair_values("pair_values_to_tokens", values, placed.total(), "one per row", &from, &to, s.tokens * s.k, opts)
    }

    /// Send rank r `values[from[r][i]]` for each i, and put what rank s
    /// sends at `to[s][i]` of a result of `len` values (zero elsewhere).
    #[allow(clippy::too_many_arguments)]
    fn move_pair_values(
        &self,
        name: &'static str,
        values: &[f64],
        want: usize,
        what: &str,
        from: &[&[u32]],
        to: &[&[u32]],
        len: usize,
        opts: &OpOptions,
    ) -> Result<Vec<f64>> {
        let ok = values.len() == want;
        let sends = from
            .iter()
            .map(|idx| if ok { idx.iter().flat_map(|i| values[*i as usize].to_le_bytes()).collect() } else { vec![0u8; 8 * idx.len()] })
            .collect();
        let sizes: Vec<usize> = to.iter().map(|t| 8 * t.len()).collect();
        let got = self.exchange_bytes(name, sends, &sizes, ok, opts);
        if !ok {
            let e = Error::invalid(format!("values has {} entries, expected {what} = {want}", values.len()));
            return Err(e.with_op(name).with_rank(self.rank()));
        }
        let mut out = vec![0.0; len];
        for (idx, b) in to.iter().zip(&got?) {
            for (i, c) in idx.iter().zip(b.chunks_exact(8)) {
                out[*i as usize] = f64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
        }
        Ok(out)
    }

    /// `r`, the group aborted first where it failed: this rank's peers are
    /// in the collective it now leaves (a buffer could not be had), and
    /// would otherwise wait out their timeout, then meet its next
    /// collective out of step.
    fn or_abort<T>(&self, r: Result<T>) -> Result<T> {
        if r.is_err() {
            self.abort();
        }
        r
    }

    /// Send `sends[r]` to each rank r and receive `sizes[s]` bytes from
    /// each rank s (one `all_to_all`); this rank's own part is handed over
    /// without a copy. The sends go back to the spare buffers; what comes
    /// back is taken from them, for the caller to give back. Each message
    /// ends in a status word: `ok` false (this rank's part was invalid,
    /// and it sent zeros) fails the op on every rank that receives from
    /// it, naming this rank, instead of leaving them wrong data or a
    /// timeout.
    fn exchange_bytes(
        &self,
        name: &'static str,
        mut sends: Vec<Vec<u8>>,
        sizes: &[usize],
        ok: bool,
        opts: &OpOptions,
    ) -> Result<Vec<Vec<u8>>> {
        let rank = self.rank();
        let own = std::mem::take(&mut sends[rank]);
        for (_, b) in sends.iter_mut().enumerate().filter(|(r, _)| *r != rank) {
            b.extend_from_slice(&u64::from(!ok).to_le_bytes());
        }
        let got = sizes.iter().enumerate().map(|(s, n)| if s == rank { Ok(Vec::new()) } else { spare::take(n + STATUS) }).collect();
        let got: Vec<Vec<u8>> = self.or_abort(got).map_err(|e| e.with_op(name).with_rank(rank))?;
        let mut got = self.all_to_all_bytes(sends, got, opts)?;
        let mut failed = Vec::new();
        for (s, b) in got.iter_mut().enumerate().filter(|(s, _)| *s != rank) {
            let at = b.len() - STATUS;
            if b[at..] != [0u8; STATUS] {
                failed.push(s);
            }
            b.truncate(at);
        }
        got[rank] = own;
        if !failed.is_empty() {
            spare::give(got);
            return Err(Error::invalid(format!("rank(s) {failed:?} passed invalid arguments (see their errors)"))
                .with_op(name)
                .with_rank(rank));
        }
        Ok(got)
    }

    /// `sends[r]` to each rank r, into `got[s]` from each rank s (sized
    /// as the peers send: one `all_to_all`); the sends go back to the
    /// spare buffers.
    fn all_to_all_bytes(&self, sends: Vec<Vec<u8>>, mut got: Vec<Vec<u8>>, opts: &OpOptions) -> Result<Vec<Vec<u8>>> {
        self.exchange_slices(sends.iter().map(|b| &b[..]), got.iter_mut().map(|b| &mut b[..]), opts)?;
        spare::give(sends);
        Ok(got)
    }

    /// One `all_to_all` of bytes: the i-th of `sends` to rank i, the i-th
    /// of `got` from rank i (sized as rank i sends).
    fn exchange_slices<'a>(
        &self,
        sends: impl Iterator<Item = &'a [u8]>,
        got: impl Iterator<Item = &'a mut [u8]>,
        opts: &OpOptions,
    ) -> Result<()> {
        let inputs: Vec<Tensor<'_>> = sends.map(Tensor::from).collect();
        let outputs: Vec<TensorMut<'_>> = got.map(TensorMut::from).collect();
        self.all_to_all(outputs, inputs, opts)?.wait()
    }
}

/// Bytes of the status word that ends each message.
const STATUS: usize = 8;

/// Per destination rank r, a buffer with the rows `tokens[r]` of `x`
/// (rows of `row` bytes; zeros where `x` is `None`, an invalid rank's
/// part) one after another, then `tail(r)` bytes of room (for the caller
/// to fill). Rank `own`'s buffer has the room alone: its rows are read
/// from `x` where they land, never copied aside ([`Sources`]).
fn token_rows(tokens: &[Vec<u32>], x: Option<&[u8]>, row: usize, own: usize, tail: impl Fn(usize) -> usize) -> Result<Vec<Vec<u8>>> {
    tokens
        .iter()
        .enumerate()
        .map(|(r, toks)| {
            let toks = if r == own { &[][..] } else { &toks[..] };
            let n = toks.len() * row + tail(r);
            let Some(x) = x else { return spare::zeros(n) };
            let mut b = spare::take(n)?;
            for (o, t) in b.chunks_exact_mut(row.max(1)).zip(toks) {
                let t = *t as usize;
                o.copy_from_slice(&x[t * row..(t + 1) * row]);
            }
            Ok(b)
        })
        .collect()
}

/// `t`'s bytes as `n` rows of `shape`, else an error naming `what`.
fn rows_of<'a>(t: &'a Tensor<'_>, shape: Shape, n: usize, what: &str) -> Result<&'a [u8]> {
    check_rows(t.dtype(), t.numel(), shape, n, what)?;
    t.host_bytes()
}

/// As [`rows_of`], writable.
fn rows_of_mut<'a>(t: &'a mut TensorMut<'_>, shape: Shape, n: usize, what: &str) -> Result<&'a mut [u8]> {
    check_rows(t.dtype(), t.numel(), shape, n, what)?;
    t.host_bytes_mut()
}

fn check_rows(dtype: DType, numel: usize, shape: Shape, n: usize, what: &str) -> Result<()> {
    if dtype != shape.dtype {
        return Err(Error::invalid(format!("{what} is {dtype}, expected {}", shape.dtype)));
    }
    if numel != n * shape.hidden {
        return Err(Error::invalid(format!("{what} has {numel} elements, expected {n} rows of {} ({})", shape.hidden, n * shape.hidden)));
    }
    Ok(())
}

/// `combine_backward`'s arguments, checked: the rows of `dy`, `expert_out`
/// and `grad`.
fn backward_rows<'a>(
    dy: &'a Tensor<'_>,
    expert_out: &'a Tensor<'_>,
    grad: &'a mut TensorMut<'_>,
    weights: &[f64],
    shape: Shape,
    rows: usize,
) -> Result<(&'a [u8], &'a [u8], &'a mut [u8])> {
    if weights.len() != rows {
        return Err(Error::invalid(format!("weights has {} entries, expected one per row ({rows})", weights.len())));
    }
    weighted::require_float(shape.dtype)?;
    let (dy, eo) = (rows_of(dy, shape, shape.tokens, "dy")?, rows_of(expert_out, shape, rows, "expert_out")?);
    Ok((dy, eo, rows_of_mut(grad, shape, rows, "grad_expert_out")?))
}

/// Where the token rows a rank's experts take are: what each other rank
/// sent (`got[s]`, its rows first, `row` bytes each), and this rank's own
/// tokens' rows in its input `x` itself (`own`: their indices there).
struct Sources<'a> {
    got: &'a [Vec<u8>],
    rank: usize,
    x: &'a [u8],
    own: &'a [u32],
    row: usize,
}

impl Sources<'_> {
    /// Row `i` of what source rank `s` sent.
    fn row(&self, s: usize, i: usize) -> &[u8] {
        let (b, i) = if s == self.rank { (self.x, self.own[i] as usize) } else { (&self.got[s][..], i) };
        &b[i * self.row..(i + 1) * self.row]
    }
}

/// Call `f(row index, token row)` for each received pair.
fn each_pair(placed: &Placement, from: &Sources<'_>, mut f: impl FnMut(usize, &[u8])) {
    for (s, (rows, token_of)) in placed.rows.iter().zip(&placed.token_of).enumerate() {
        for (r, i) in rows.iter().zip(token_of) {
            f(*r as usize, from.row(s, *i as usize));
        }
    }
}
