//! `weft bench`: nccl-tests-style measurements of every op over a size
//! sweep, on a local world (stand-alone) or under any launcher.
//!
//! Timing: after warm-ups, each iteration starts after a barrier and is
//! timed on every rank; an iteration's time is the slowest rank's
//! (`--timing window`, as nccl-tests and the OSU benchmarks time), or the
//! span from the first rank's start to the last rank's end on the host's
//! clock (`--timing span`, for ranks that outnumber the cores: there a
//! rank may start its clock only once its peers have finished, and the
//! slowest rank's window can be shorter than the op).
//! Iteration counts adapt to `--time-per-size` so large sizes stay quick;
//! ranks agree on them through an all_reduce, so they never diverge.
//! With `--check` (default) one more run per size is verified element by
//! element against the conformance references.

mod moe;
mod ops;
mod plot;
mod report;
mod rng;
mod sparse;

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use ops::Case;
use report::Row;
use std::io::IsTerminal;
use std::time::Instant;
use weft::prelude::*;
use weft::{DType, ReduceOp};
use weft_cli::launcher;

/// Flags (named as in nccl-tests where they overlap).
#[derive(Args, Clone, Debug)]
pub struct BenchArgs {
    /// Ops, comma-separated, or "all": all_reduce, all_gather, reduce_scatter,
    /// all_to_all, all_to_all_v, broadcast, reduce, gather, scatter, p2p, sendrecv,
    /// put (one-sided: put, signal, wait_signal), barrier; and sparse_all_reduce (its own table; not part of "all").
    #[arg(long = "ops", default_value = "all")]
    ops: String,
    /// Smallest size in bytes per rank (suffixes K, M, G).
    #[arg(short = 'b', long = "minbytes", default_value = "8")]
    minbytes: String,
    /// Largest size in bytes per rank.
    #[arg(short = 'e', long = "maxbytes", default_value = "64M")]
    maxbytes: String,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
    factor: usize,
    /// Data type.
    #[arg(short = 'd', long = "datatype", default_value = "f32")]
    dtype: String,
    /// Reduce op (sum, product, min, max, avg, band, bor, bxor, premul_sum(x)).
    #[arg(short = 'o', long = "op", default_value = "sum")]
    redop: String,
    /// Root of rooted ops.
    #[arg(short = 'r', long = "root", default_value_t = 0)]
    root: usize,
    /// Timed iterations per size (at most; see --time-per-size).
    #[arg(short = 'n', long = "iters", default_value_t = 20)]
    iters: usize,
    /// Warm-up iterations per size (at most).
    #[arg(short = 'w', long = "warmup-iters", default_value_t = 5)]
    warmup: usize,
    /// Time budget per size in seconds: fewer iterations for slow sizes.
    #[arg(long = "time-per-size", default_value_t = 1.0)]
    budget: f64,
    /// How an iteration is timed: "window" (the slowest rank's time from
    /// its start to its end) or "span" (the first rank's start to the last
    /// rank's end; every rank on one host).
    #[arg(long, default_value = "window", value_parser = ["window", "span"])]
    timing: String,
    /// Skip verifying results.
    #[arg(long = "no-check")]
    no_check: bool,
    /// Rewrite each rank's input on its own core before every iteration
    /// (untimed), as programs compute what they send right before they
    /// send it; by default inputs are reused, as nccl-tests and the OSU
    /// benchmarks do (host tensors only).
    #[arg(long = "fresh-inputs")]
    fresh_inputs: bool,
    /// Backend spec.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Where the tensors live: cpu, or cuda (device LOCAL_RANK modulo the
    /// device count; the emulated GPU under WEFT_CUDA_EMULATION). The op
    /// device_copy times a copy of N bytes on every rank at once (host:
    /// the copy weft uses for op outputs, streaming from 4 MiB; cuda:
    /// device-to-device): the memory-bandwidth reference.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Group hints KEY=VALUE (repeatable), e.g. staging=whole.
    #[arg(long = "hint")]
    hints: Vec<String>,
    /// Local ranks when run stand-alone (ignored under a launcher).
    #[arg(long = "world", default_value_t = 4)]
    world: usize,
    /// Measure on a group shrunk after a rank died: one rank more starts,
    /// the last leaves at once without a goodbye (as a crash would), and
    /// the others shrink their group and measure on it. Compare with a
    /// run without the flag (a fresh group of the same size).
    #[arg(long)]
    shrunk: bool,
    /// Write results as CSV to this file ("-" for stdout instead of the table).
    #[arg(long)]
    csv: Option<String>,
    /// Write results as JSON to this file ("-" for stdout instead of the table).
    #[arg(long)]
    json: Option<String>,
    /// Draw busbw against size to this SVG file.
    #[arg(long)]
    plot: Option<String>,
    /// Earlier runs (JSON files from --json) to draw on the same plot.
    #[arg(long = "plot-add")]
    plot_add: Vec<String>,
    /// sparse_all_reduce: rows of the embedding table.
    #[arg(long = "sparse-rows", default_value_t = 100_000)]
    sparse_rows: usize,
    /// sparse_all_reduce: columns (f32 values per row).
    #[arg(long = "sparse-dim", default_value_t = 64)]
    sparse_dim: usize,
    /// sparse_all_reduce: fractions of rows each rank touches.
    #[arg(long = "densities", default_value = "0.001,0.01,0.05,0.1,0.25,0.5", value_delimiter = ',')]
    densities: Vec<f64>,
    /// sparse_all_reduce: Zipf exponent of row popularity.
    #[arg(long = "zipf", default_value_t = 1.1)]
    zipf: f64,
    /// moe: tokens per rank.
    #[arg(long = "moe-tokens", default_value_t = 4096)]
    moe_tokens: usize,
    /// moe: elements per token (of -d/--datatype).
    #[arg(long = "moe-hidden", default_value_t = 2048)]
    moe_hidden: usize,
    /// moe: experts in all (a multiple of the world size).
    #[arg(long = "moe-experts", default_value_t = 64)]
    moe_experts: usize,
    /// moe: experts per token.
    #[arg(long = "moe-topk", default_value_t = 8)]
    moe_topk: usize,
}

fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1usize << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    Ok(num.parse::<usize>().with_context(|| format!("bad size {s:?}"))? * mul)
}

pub fn main(args: BenchArgs) -> Result<i32> {
    // A bad flag fails here, once, before any rank starts.
    let checked = plan(&args)?;
    if std::env::var("RANK").is_err() && std::env::var("SLURM_PROCID").is_err() && std::env::var("OMPI_COMM_WORLD_RANK").is_err() {
        // Stand-alone: start a local world running this same command.
        return launcher::relaunch_local(args.world + usize::from(args.shrunk), std::env::args().skip(1).collect(), None);
    }
    run_rank(&args, checked)
}

/// What the flags ask for, checked.
struct Plan {
    dtype: DType,
    redop: ReduceOp,
    /// Message sizes in bytes per rank.
    sizes: Vec<usize>,
    /// The dense ops, in the order given.
    ops: Vec<&'static str>,
    /// Whether `sparse_all_reduce` was asked for (its own table).
    sparse: bool,
    /// Whether `moe` was asked for (its own table).
    moe: bool,
}

fn plan(a: &BenchArgs) -> Result<Plan> {
    let dtype: DType = a.dtype.parse()?;
    let redop: ReduceOp = a.redop.parse().map_err(|e: weft::Error| {
        // nccl-tests' -o/--op is the reduce op; a collective named there
        // belongs in --ops.
        let collective = a.redop == "sparse_all_reduce" || ops::ALL.contains(&a.redop.as_str());
        let hint = if collective { format!(" (-o/--op is the reduce op; for the op {0} use --ops {0})", a.redop) } else { String::new() };
        anyhow::anyhow!("{e}{hint}")
    })?;
    redop.check(dtype)?;
    let (min, max) = (parse_size(&a.minbytes)?, parse_size(&a.maxbytes)?);
    if a.factor < 2 || min == 0 || min > max {
        bail!("need 0 < minbytes <= maxbytes and stepfactor >= 2");
    }
    let sparse = a.ops.split(',').any(|o| o.trim() == "sparse_all_reduce");
    let moe = a.ops.split(',').any(|o| o.trim() == "moe");
    if moe && !dtype.is_float() {
        bail!("--ops moe moves float rows: use -d f32, f64, f16 or bf16");
    }
    let ops: Vec<&'static str> = if a.ops == "all" {
        ops::ALL.to_vec()
    } else {
        a.ops
            .split(',')
            .filter(|o| !matches!(o.trim(), "sparse_all_reduce" | "moe"))
            .map(|o| {
                ops::ALL
                    .iter()
                    .chain(&["device_copy"])
                    .find(|k| **k == o.trim())
                    .copied()
                    .with_context(|| format!("unknown op {o:?} (known: {}, sparse_all_reduce, moe, device_copy)", ops::ALL.join(", ")))
            })
            .collect::<Result<_>>()?
    };
    let sizes: Vec<usize> = std::iter::successors(Some(min), |s| s.checked_mul(a.factor)).take_while(|s| *s <= max).collect();
    Ok(Plan { dtype, redop, sizes, ops, sparse, moe })
}

fn run_rank(a: &BenchArgs, plan: Plan) -> Result<i32> {
    let Plan { dtype, redop, sizes, ops, sparse: want_sparse, moe: want_moe } = plan;

    let mut opts = GroupOptions::from_env()?.backend(a.backend.as_str());
    for h in &a.hints {
        let (k, v) = h.split_once('=').with_context(|| format!("hint {h:?} is not KEY=VALUE"))?;
        opts = opts.hint(k, v);
    }
    let pg = ProcessGroup::from_env(opts)?;
    let pg = if a.shrunk { shrunk_after_a_loss(pg)? } else { pg };
    let (r, w) = (pg.rank(), pg.size());
    if a.root >= w {
        bail!("root {} is out of range for {w} ranks", a.root);
    }
    let (kind, place) = match a.device.as_str() {
        "cpu" => (weft::DeviceKind::Cpu, None),
        "cuda" => (weft::DeviceKind::Cuda, Some(weft_conformance::cuda::local_placement(r)?)),
        d => bail!("--device {d:?}: use cpu or cuda"),
    };
    if a.fresh_inputs && place.is_some() {
        bail!("--fresh-inputs rewrites host inputs on the rank's core: use it with --device cpu");
    }
    // Device ops are ordered after the placement's stream (as a user's
    // current stream); `synchronize` in each timed call waits for them.
    weft::stream::set_current_stream(place.as_ref().map(|p| p.stream()));
    let backend = pg.backend_name((kind, weft::Layout::Dense)).unwrap_or_default();
    let o = OpOptions::default();
    let table_to_stdout = a.csv.as_deref() != Some("-") && a.json.as_deref() != Some("-");
    let total = ops.iter().map(|op| if *op == "barrier" { 1 } else { sizes.len() }).sum::<usize>() as u64;
    let bar = if r == 0 && std::io::stderr().is_terminal() { ProgressBar::new(total) } else { ProgressBar::hidden() };
    bar.set_style(ProgressStyle::with_template("{bar:40} {pos}/{len} {msg} [{elapsed}]").expect("valid template"));
    let say = |line: String| {
        if r == 0 && table_to_stdout {
            // A hidden bar (no terminal) prints nothing itself.
            if bar.is_hidden() {
                println!("{line}");
            } else {
                bar.println(line);
            }
        }
    };
    if a.timing == "span" {
        check_one_clock(&pg, &o)?;
    }
    if !ops.is_empty() {
        say(format!(
            "# weft bench: backend {backend}, {w} ranks, dtype {dtype}, redop {redop}, root {}, check {}, timing {}, inputs {}",
            a.root,
            !a.no_check,
            a.timing,
            if a.fresh_inputs { "fresh" } else { "reused" }
        ));
        say(report::table_header());
    }
    let mut rows = Vec::new();
    let mut own_table_wrong = 0;
    if want_sparse {
        let workload = sparse::Workload {
            rows: a.sparse_rows,
            dim: a.sparse_dim,
            densities: a.densities.clone(),
            zipf: a.zipf,
            iters: a.iters.max(1),
        };
        own_table_wrong = sparse::run(&pg, &workload)?;
    }
    if want_moe {
        let workload = moe::Workload {
            tokens: a.moe_tokens,
            hidden: a.moe_hidden,
            experts: a.moe_experts,
            k: a.moe_topk,
            dtype,
            iters: a.iters.max(1),
            warmup: a.warmup,
        };
        own_table_wrong += moe::run(&pg, &workload)?;
    }
    for op in &ops {
        let op_sizes = if *op == "barrier" { vec![0] } else { sizes.clone() };
        for &bytes in &op_sizes {
            bar.set_message(format!("{op} {bytes} B"));
            let mut case = Case::new(op, dtype, redop, a.root, bytes, &pg, place.clone())?;
            let row = measure(&pg, &mut case, op, a, &o)?;
            let row = Row {
                backend: backend.clone(),
                dtype: dtype.to_string(),
                redop: if Case::uses_redop(op) { redop.to_string() } else { "-".into() },
                root: if Case::uses_root(op) { a.root.to_string() } else { "-".into() },
                ..row
            };
            say(report::table_row(&row));
            rows.push(row);
            bar.inc(1);
        }
    }
    bar.finish_and_clear();
    let wrong: u64 = rows.iter().map(|r| r.wrong).sum::<u64>() + own_table_wrong;
    if r == 0 {
        let times = if a.timing == "span" { "from the first rank's start to the last rank's end" } else { "the slowest rank's" };
        say(format!("# total wrong: {wrong}; times are {times}, per iteration; busbw as nccl-tests"));
        for (dest, text) in [(&a.csv, report::csv(&rows)), (&a.json, report::json(&rows))] {
            match dest.as_deref() {
                Some("-") => print!("{text}"),
                Some(path) => std::fs::write(path, text).with_context(|| format!("writing {path}"))?,
                None => {}
            }
        }
        if let Some(path) = &a.plot {
            let mut runs = vec![(format!("{backend} W={w}"), rows.clone())];
            for f in &a.plot_add {
                let earlier = report::from_json(&std::fs::read_to_string(f).with_context(|| format!("reading {f}"))?)?;
                let label = earlier.first().map(|r| format!("{} W={}", r.backend, r.world)).unwrap_or_else(|| f.clone());
                runs.push((label, earlier));
            }
            plot::svg(path, &runs)?;
        }
    }
    Ok(if wrong > 0 { 1 } else { 0 })
}

/// `--shrunk`: the last rank leaves without a goodbye (exit status 0, so
/// the launcher lets the others go on); the others see it gone at a
/// barrier and shrink their group.
fn shrunk_after_a_loss(pg: ProcessGroup) -> Result<ProcessGroup> {
    if pg.rank() + 1 == pg.size() {
        // No destructors: the connections just drop, as in a crash.
        std::process::exit(0);
    }
    let o = OpOptions::default();
    if pg.barrier(&o)?.wait().is_ok() {
        bail!("--shrunk: the last rank left, yet the barrier succeeded");
    }
    Ok(pg.shrink(&weft::ShrinkOptions::default())?)
}

/// Seconds on this host's monotonic clock, which every process started
/// since the kernel booted shares.
fn host_clock() -> Result<f64> {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)?;
    Ok(t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9)
}

/// `--timing span` compares clock readings across ranks: refuse ranks that
/// do not share one (another host, or another boot).
fn check_one_clock(pg: &ProcessGroup, o: &OpOptions) -> Result<()> {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut h = DefaultHasher::new();
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").context("--timing span: reading the boot id")?.trim().hash(&mut h);
    let id = h.finish();
    let (mut lo, mut hi) = ([id], [id]);
    pg.all_reduce(&mut lo[..], ReduceOp::Min, o)?.wait()?;
    pg.all_reduce(&mut hi[..], ReduceOp::Max, o)?.wait()?;
    if lo != hi {
        bail!("--timing span needs every rank on one host (one clock); use --timing window");
    }
    Ok(())
}

/// Time one (op, size) on every rank; the row as rank 0 reports it.
fn measure(pg: &ProcessGroup, case: &mut Case, op: &'static str, a: &BenchArgs, o: &OpOptions) -> Result<Row> {
    let (r, w) = (pg.rank(), pg.size());
    // One untimed run, then agree on the slowest rank's time to size the loops.
    let t = Instant::now();
    case.run(pg, o)?;
    let mut first = [t.elapsed().as_secs_f64()];
    pg.all_reduce(&mut first[..], ReduceOp::Max, o)?.wait()?;
    let per = first[0].max(1e-7);
    let iters = ((a.budget / per) as usize).clamp(1, a.iters.max(1));
    let warm = ((a.budget * 0.25 / per) as usize).min(a.warmup);
    for i in 0..warm {
        if a.fresh_inputs {
            case.refresh(i);
        }
        case.run(pg, o)?;
    }
    let mut starts = vec![0f64; iters];
    let mut times = vec![0f64; iters];
    let span = a.timing == "span";
    for (i, (start, slot)) in starts.iter_mut().zip(times.iter_mut()).enumerate() {
        if a.fresh_inputs {
            case.refresh(i);
        }
        // Every iteration starts together, so eager senders cannot run
        // ahead and the time covers one whole op.
        pg.barrier(o)?.wait()?;
        if span {
            *start = host_clock()?;
            case.run(pg, o)?;
            *slot = host_clock()?;
        } else {
            let t = Instant::now();
            case.run(pg, o)?;
            *slot = t.elapsed().as_secs_f64();
        }
    }
    pg.all_reduce(&mut times, ReduceOp::Max, o)?.wait()?;
    if span {
        pg.all_reduce(&mut starts, ReduceOp::Min, o)?.wait()?;
        for (end, start) in times.iter_mut().zip(&starts) {
            *end -= start;
        }
    }
    let mut wrong = [0u64];
    if !a.no_check {
        case.reset(r)?;
        case.run(pg, o)?;
        wrong[0] = case.wrong(r, w)? as u64;
        pg.all_reduce(&mut wrong[..], ReduceOp::Sum, o)?.wait()?;
    }
    times.sort_by(f64::total_cmp);
    let pick = |q: f64| times[((times.len() - 1) as f64 * q).round() as usize] * 1e6;
    let median = pick(0.5);
    let size = case.count * case.dtype_size();
    let algbw = if median > 0.0 { size as f64 / (median * 1e-6) / 1e9 } else { 0.0 };
    Ok(Row {
        backend: String::new(),
        world: w,
        op: op.to_string(),
        bytes: size,
        count: case.count,
        dtype: String::new(),
        redop: String::new(),
        root: String::new(),
        iters,
        median_us: median,
        min_us: pick(0.0),
        max_us: pick(1.0),
        p99_us: pick(0.99),
        algbw,
        busbw: algbw * ops::bus_factor(op, w),
        wrong: wrong[0],
    })
}
