//! The `weft` command.

mod bench;
mod conformance;
mod info;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::time::Duration;
use weft_cli::launcher::{self, Launch};

#[derive(Parser)]
#[command(name = "weft", version, about = "Collective communication for Rust: launcher, benchmark, backend info")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Start N local ranks of a program (torchrun-like).
    Run {
        /// Ranks on this node.
        #[arg(short = 'n', long = "nproc", default_value_t = 1)]
        nproc: usize,
        /// Number of nodes.
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        /// This node's index.
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        /// Address of node 0 (it hosts the store).
        #[arg(long, default_value = "127.0.0.1")]
        master_addr: String,
        /// Store port (0: any free port; required with --nnodes > 1).
        #[arg(long, default_value_t = 0)]
        master_port: u16,
        /// Backend spec for every rank (sets WEFT_BACKEND).
        #[arg(long)]
        backend: Option<String>,
        /// Kill all ranks after this many seconds (exit status 124).
        #[arg(long)]
        timeout: Option<f64>,
        /// Do not prefix output lines with the rank.
        #[arg(long)]
        no_prefix: bool,
        /// Pin local rank i to CPU i (as mpirun binds small jobs).
        #[arg(long)]
        bind_cores: bool,
        /// Leave the other ranks running when one fails, so the survivors
        /// can shrink their group and carry on (the exit status is still
        /// the first failure's).
        #[arg(long)]
        keep_going: bool,
        /// The program and its arguments.
        #[arg(last = true, required = true)]
        program: Vec<String>,
    },
    /// Measure every op over a size sweep (nccl-tests style). With no
    /// arguments: 4 local ranks, the auto backend, all ops, 8 B to 64 MiB.
    Bench(Box<bench::BenchArgs>),
    /// List backends, whether each is usable here, and the environment weft would use.
    Info,
    /// Check a backend (name or plugin file) against the conformance suite on N local ranks.
    Conformance {
        /// A registered backend name, or the path of a plugin library.
        #[arg(long)]
        backend: String,
        /// Local ranks.
        #[arg(short = 'n', long = "nproc", default_value_t = 4)]
        nproc: usize,
        /// Elements per tensor in each case.
        #[arg(long, default_value_t = 7)]
        count: usize,
        /// Where the tensors live: cpu, or cuda (device LOCAL_RANK modulo
        /// the device count; the emulated GPU under WEFT_CUDA_EMULATION).
        #[arg(long, default_value = "cpu")]
        device: String,
    },
    /// A short `weft bench --ops all_reduce` (sizes from 8 B, x8 a step, up
    /// to --max-bytes; verified) on a local world.
    Demo {
        /// Local ranks (ignored when already started by a launcher).
        #[arg(short = 'n', long = "nproc", default_value_t = 4)]
        nproc: usize,
        /// Backend spec.
        #[arg(long, default_value = "auto")]
        backend: String,
        /// Largest message in bytes.
        #[arg(long, default_value_t = 64 << 20)]
        max_bytes: usize,
        /// Timed iterations per size.
        #[arg(long, default_value_t = 5)]
        iters: usize,
    },
}

/// `weft bench`'s flags on their own, for `weft demo`.
#[derive(Parser)]
struct DemoBench {
    #[command(flatten)]
    args: bench::BenchArgs,
}

fn main() -> Result<()> {
    // Like other command-line tools, end quietly when the reader of our
    // output goes away (`weft info | head`) instead of panicking.
    // SAFETY: restoring the default disposition of SIGPIPE.
    unsafe { nix::sys::signal::signal(nix::sys::signal::Signal::SIGPIPE, nix::sys::signal::SigHandler::SigDfl) }.ok();
    weft_builtin::link();
    let code = match Cli::parse().cmd {
        Cmd::Run { nproc, nnodes, node_rank, master_addr, master_port, backend, timeout, no_prefix, bind_cores, keep_going, program } => {
            launcher::run(&Launch {
                nproc,
                nnodes,
                node_rank,
                master_addr,
                master_port,
                backend,
                timeout: timeout.map(Duration::from_secs_f64),
                prefix: !no_prefix,
                bind_cores,
                keep_going,
                program,
            })?
        }
        Cmd::Info => info::print()?,
        Cmd::Bench(args) => bench::main(*args)?,
        Cmd::Conformance { nproc, backend, count, device } => conformance::main(nproc, &backend, count, &device)?,
        Cmd::Demo { nproc, backend, max_bytes, iters } => {
            // A short `weft bench --ops all_reduce`: one sweep, one code path.
            let (n, e, i) = (nproc.to_string(), max_bytes.to_string(), iters.to_string());
            let flags = ["--world", &n, "--backend", &backend, "--ops", "all_reduce", "-f", "8", "-e", &e, "-n", &i];
            bench::main(DemoBench::parse_from(std::iter::once("weft demo").chain(flags)).args)?
        }
    };
    std::process::exit(code)
}
