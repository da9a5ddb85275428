//! `weft run`: start N local ranks of a program, like torchrun.
//!
//! The launcher of node 0 hosts the job's store; every rank gets `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//! `MASTER_PORT` and `WEFT_AGENT_STORE=1`. Output lines are prefixed with
//! the rank. Ctrl-C is forwarded to every rank. When a rank fails, the
//! others are stopped (SIGTERM, then SIGKILL after a grace period) and the
//! launcher exits with the failed rank's status.

use anyhow::{bail, Context, Result};
use nix::sys::signal::{self, SigHandler, Signal};
use nix::unistd::Pid;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use weft::store::TcpStoreServer;

/// How long ranks get to exit after SIGTERM before SIGKILL.
const GRACE: Duration = Duration::from_secs(3);

/// What to launch.
#[derive(Clone, Debug)]
pub struct Launch {
    /// Ranks on this node.
    pub nproc: usize,
    /// Number of nodes.
    pub nnodes: usize,
    /// This node's index.
    pub node_rank: usize,
    /// Store host (node 0's address).
    pub master_addr: String,
    /// Store port; 0 picks a free one (single node only).
    pub master_port: u16,
    /// Backend spec for `WEFT_BACKEND`, if given.
    pub backend: Option<String>,
    /// Kill everything after this long (exit status 124).
    pub timeout: Option<Duration>,
    /// Prefix output lines with the rank (else ranks share our stdio).
    pub prefix: bool,
    /// Pin local rank i to CPU i (mod the CPUs we may use), as mpirun binds
    /// small jobs: stops the scheduler from stacking communicating ranks on
    /// one core, which halves loopback bandwidth at random.
    pub bind_cores: bool,
    /// A failed rank does not stop the others (they may shrink their group
    /// and go on).
    pub keep_going: bool,
    /// Program and arguments.
    pub program: Vec<String>,
}

/// The CPUs this process may run on.
pub fn usable_cpus() -> Vec<usize> {
    match nix::sched::sched_getaffinity(Pid::from_raw(0)) {
        Ok(set) => (0..nix::sched::CpuSet::count()).filter(|c| set.is_set(*c).unwrap_or(false)).collect(),
        Err(_) => vec![],
    }
}

/// Start `nproc` local ranks running this same executable with `args`
/// (how `weft bench`, `demo` and `conformance` run stand-alone); ranks share
/// our terminal, and are bound to cores, round-robin when they outnumber
/// them. (Unbound, the scheduler starts them unevenly and moves them: at
/// W=4 on 2 cores an 8 B op's span varied up to 2x between runs, and
/// bound it was as fast or faster at 8 B, 1 MiB and 64 MiB.)
pub fn relaunch_local(nproc: usize, args: Vec<String>, timeout: Option<Duration>) -> Result<i32> {
    let mut program = vec![std::env::current_exe()?.to_string_lossy().into_owned()];
    program.extend(args);
    run(&Launch {
        nproc,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 0,
        backend: None,
        timeout,
        prefix: false,
        bind_cores: true,
        keep_going: false,
        program,
    })
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: i32) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Run the ranks; the exit status the launcher should exit with.
pub fn run(l: &Launch) -> Result<i32> {
    if l.nproc == 0 || l.nnodes == 0 || l.node_rank >= l.nnodes {
        bail!("need -n >= 1 and --node-rank < --nnodes");
    }
    if l.program.is_empty() {
        bail!("no program given: weft run -n N -- PROGRAM [ARGS...]");
    }
    if l.nnodes > 1 && l.master_port == 0 {
        bail!("--master-port is required with --nnodes > 1");
    }
    // The job's key: the environment's, else (one node) a fresh one, which
    // the ranks inherit. Across nodes every launcher must be given the same.
    let given = weft::auth::Key::from_env()?;
    let generated = match &given {
        Some(_) => None,
        None if l.nnodes == 1 => Some(weft::auth::Key::generate()?),
        None => {
            eprintln!("weft run: {} is not set: this multi-node job is unauthenticated", weft::auth::ENV_KEY);
            None
        }
    };
    let key = given.or_else(|| generated.clone());
    let _server;
    let port = if l.node_rank == 0 {
        let bind = weft::launch::store_bind_addr(&l.master_addr, l.master_port);
        let server = TcpStoreServer::start_keyed(bind, key).context("starting the store")?;
        let p = server.local_addr().port();
        _server = server;
        p
    } else {
        l.master_port
    };
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe { signal::signal(Signal::SIGINT, SigHandler::Handler(on_sigint)) }.context("installing the SIGINT handler")?;

    let world = l.nproc * l.nnodes;
    let mut children: Vec<(usize, Child)> = Vec::new();
    let mut pumps = Vec::new();
    for local in 0..l.nproc {
        let rank = l.node_rank * l.nproc + local;
        let mut cmd = Command::new(&l.program[0]);
        cmd.args(&l.program[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", l.nproc.to_string())
            .env("MASTER_ADDR", &l.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env(weft::launch::ENV_AGENT_STORE, "1")
            .stdin(Stdio::null())
            // Prefixed output is pumped line by line; otherwise ranks write
            // straight to our stdout/stderr (a terminal keeps its features).
            .stdout(if l.prefix { Stdio::piped() } else { Stdio::inherit() })
            .stderr(if l.prefix { Stdio::piped() } else { Stdio::inherit() })
            // Own process group: Ctrl-C reaches ranks once, through us.
            .process_group(0);
        if let Some(b) = &l.backend {
            cmd.env(weft::ENV_BACKEND, b);
        }
        if let Some(text) = generated.as_ref().and_then(weft::auth::Key::as_text) {
            cmd.env(weft::auth::ENV_KEY, text);
        }
        if l.bind_cores {
            let cpus = usable_cpus();
            if !cpus.is_empty() {
                let cpu = cpus[local % cpus.len()];
                // SAFETY: between fork and exec, only an async-signal-safe
                // syscall (sched_setaffinity) runs in the child.
                unsafe {
                    cmd.pre_exec(move || {
                        let mut set = nix::sched::CpuSet::new();
                        set.set(cpu).map_err(std::io::Error::from)?;
                        nix::sched::sched_setaffinity(Pid::from_raw(0), &set).map_err(std::io::Error::from)
                    });
                }
            }
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut children, Signal::SIGKILL);
                return Err(e).with_context(|| format!("starting rank {rank}: {}", l.program[0]));
            }
        };
        if let (Some(out), Some(err)) = (child.stdout.take(), child.stderr.take()) {
            let prefix = format!("[{rank}] ");
            pumps.push(pump(out, prefix.clone(), false));
            pumps.push(pump(err, prefix, true));
        }
        children.push((rank, child));
    }

    let start = Instant::now();
    let mut failed: Option<(usize, ExitStatus)> = None;
    let mut stopping: Option<Instant> = None;
    let mut reason = String::new();
    let mut live = children.len();
    while live > 0 {
        std::thread::sleep(Duration::from_millis(20));
        live = 0;
        for (rank, child) in children.iter_mut() {
            match child.try_wait()? {
                Some(status) if !status.success() && failed.is_none() && stopping.is_none() => {
                    failed = Some((*rank, status));
                    if l.keep_going {
                        eprintln!("weft run: rank {rank} failed ({}); --keep-going: the others go on", describe(status));
                    }
                }
                Some(_) => {}
                None => live += 1,
            }
        }
        if live == 0 {
            break;
        }
        if stopping.is_none() {
            if let (Some((rank, status)), false) = (failed, l.keep_going) {
                reason = format!("rank {rank} failed ({}); stopping the others", describe(status));
            } else if INTERRUPTED.load(Ordering::SeqCst) {
                reason = "interrupted; forwarding SIGINT".into();
                stop_all(&mut children, Signal::SIGINT);
                stopping = Some(Instant::now());
                eprintln!("weft run: {reason}");
                continue;
            } else if l.timeout.is_some_and(|t| start.elapsed() > t) {
                reason = format!("timed out after {:?}; killing all ranks", l.timeout.expect("checked"));
            }
            if !reason.is_empty() {
                eprintln!("weft run: {reason}");
                stop_all(&mut children, Signal::SIGTERM);
                stopping = Some(Instant::now());
            }
        } else if stopping.is_some_and(|s| s.elapsed() > GRACE) {
            stop_all(&mut children, Signal::SIGKILL);
        }
    }
    // Ranks are gone; descendants they left in their process groups (which
    // would keep the output pipes open) go with them.
    for (_, child) in &children {
        let _ = signal::killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
    }
    for p in pumps {
        let _ = p.join();
    }
    // SAFETY: restoring the default disposition.
    unsafe { signal::signal(Signal::SIGINT, SigHandler::SigDfl) }.ok();
    Ok(match failed {
        Some((_, status)) => exit_code(status),
        None if INTERRUPTED.load(Ordering::SeqCst) => 130,
        None if reason.starts_with("timed out") => 124,
        None => 0,
    })
}

fn stop_all(children: &mut [(usize, Child)], sig: Signal) {
    for (_, child) in children.iter_mut() {
        if let Ok(None) = child.try_wait() {
            // The child leads its own process group: signal all of it.
            let _ = signal::killpg(Pid::from_raw(child.id() as i32), sig);
        }
    }
}

fn pump(src: impl std::io::Read + Send + 'static, prefix: String, to_err: bool) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for line in BufReader::new(src).split(b'\n').map_while(Result::ok) {
            let mut text = prefix.clone().into_bytes();
            text.extend_from_slice(&line);
            text.push(b'\n');
            let _ = if to_err { std::io::stderr().lock().write_all(&text) } else { std::io::stdout().lock().write_all(&text) };
        }
    })
}

fn describe(s: ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => "unknown status".into(),
    }
}

/// The shell convention: the exit code, or 128 + the signal number.
pub fn exit_code(s: ExitStatus) -> i32 {
    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
}
