//! `weft run` and `weft demo` as a user runs them.

use std::process::Command;
use std::time::{Duration, Instant};

const WEFT: &str = env!("CARGO_BIN_EXE_weft");

#[test]
fn ranks_get_the_environment_and_prefixed_output() {
    let out = Command::new(WEFT)
        .args([
            "run",
            "-n",
            "3",
            "--timeout",
            "60",
            "--",
            "sh",
            "-c",
            "echo \"r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK/$LOCAL_WORLD_SIZE a=$WEFT_AGENT_STORE\"",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for r in 0..3 {
        assert!(text.contains(&format!("[{r}] r={r} w=3 l={r}/3 a=1")), "{text}");
    }
}

#[test]
fn a_failing_rank_stops_the_others_and_sets_the_exit_status() {
    let start = Instant::now();
    let out = Command::new(WEFT)
        .args(["run", "-n", "3", "--timeout", "60", "--", "sh", "-c", "if [ $RANK = 1 ]; then exit 7; fi; sleep 30"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7));
    assert!(start.elapsed() < Duration::from_secs(15), "others were stopped promptly");
    assert!(String::from_utf8_lossy(&out.stderr).contains("rank 1 failed (exit status 7)"));
}

#[test]
fn the_outer_timeout_kills_a_hung_job() {
    let out = Command::new(WEFT).args(["run", "-n", "2", "--timeout", "0.5", "--", "sleep", "30"]).output().unwrap();
    assert_eq!(out.status.code(), Some(124));
}

#[test]
fn ctrl_c_is_forwarded_to_every_rank() {
    let child = Command::new(WEFT)
        .args(["run", "-n", "2", "--timeout", "60", "--", "sh", "-c", "trap 'echo got-int; exit 3' INT; sleep 20 & wait"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), nix::sys::signal::Signal::SIGINT).unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.matches("got-int").count(), 2, "{text}");
    assert_ne!(out.status.code(), Some(0));
}

#[test]
fn demo_runs_a_verified_all_reduce_on_a_local_world() {
    let out = Command::new(WEFT).args(["demo", "-n", "3", "--max-bytes", "65536", "--iters", "2"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}\n{}", String::from_utf8_lossy(&out.stderr));
    // It is `weft bench --ops all_reduce`: its rows, checked.
    assert!(text.contains("all_reduce") && text.contains("# total wrong: 0") && text.contains("32768"), "{text}");
}

#[test]
fn info_lists_backends_and_availability() {
    let out = Command::new(WEFT).arg("info").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("cpu-tcp") && text.contains("available"), "{text}");
}

#[test]
fn two_nodes_on_one_host_form_one_world() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let node = |rank: &str| {
        Command::new(WEFT)
            .args(["run", "-n", "2", "--nnodes", "2", "--node-rank", rank, "--master-port", &port, "--timeout", "60", "--"])
            .args(["sh", "-c", "echo \"r=$RANK w=$WORLD_SIZE l=$LOCAL_RANK\""])
            .output()
            .unwrap()
    };
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| node("0"));
        let b = s.spawn(|| node("1"));
        (a.join().unwrap(), b.join().unwrap())
    });
    assert!(a.status.success() && b.status.success());
    let b_out = String::from_utf8_lossy(&b.stdout);
    assert!(b_out.contains("[2] r=2 w=4 l=0") && b_out.contains("[3] r=3 w=4 l=1"), "{b_out}");
}

#[test]
fn conformance_prints_a_pass_fail_table() {
    let out = Command::new(WEFT).args(["conformance", "--backend", "cpu-tcp", "-n", "2", "--count", "3"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("all_reduce") && text.contains("premul_sum(0.5)") && text.contains(" 0 failed"), "{text}");
    let out = Command::new(WEFT).args(["conformance", "--backend", "/nonexistent/libweft-backend-x.so", "-n", "1"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("does not exist"));
}

#[test]
fn bench_checks_every_op_over_a_short_sweep_and_writes_csv_json_and_a_plot() {
    let dir = std::env::temp_dir().join(format!("weft-bench-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, csv, svg) = (dir.join("a.json"), dir.join("a.csv"), dir.join("p.svg"));
    let out = Command::new(WEFT)
        .args([
            "bench",
            "--world",
            "3",
            "-b",
            "8",
            "-e",
            "64K",
            "-f",
            "16",
            "-n",
            "2",
            "-w",
            "1",
            "--json",
            json.to_str().unwrap(),
            "--csv",
            csv.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for op in ["all_reduce", "all_gather", "reduce_scatter", "all_to_all_v", "broadcast", "reduce", "gather", "scatter", "p2p", "barrier"] {
        assert!(text.contains(op), "{op} missing:\n{text}");
    }
    assert!(text.contains("# total wrong: 0"), "{text}");
    assert!(std::fs::read_to_string(&csv).unwrap().starts_with("backend,world,op,bytes"));
    // A second run draws itself and the first on one picture; the host
    // memory-bandwidth reference (device_copy on the CPU) is checked too.
    let out = Command::new(WEFT)
        .args([
            "bench",
            "--world",
            "2",
            "--ops",
            "all_reduce,p2p,device_copy",
            "-e",
            "4K",
            "-f",
            "8",
            "-n",
            "2",
            "--plot",
            svg.to_str().unwrap(),
            "--plot-add",
            json.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("device_copy") && text.contains("# total wrong: 0"), "{text}");
    let picture = std::fs::read_to_string(&svg).unwrap();
    assert!(picture.contains("<svg") && picture.contains("W=2 all_reduce") && picture.contains("W=3 all_gather"), "plot lacks series");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--ops moe`: every phase of expert parallelism timed, the output
/// checked, and a float dtype required.
#[test]
fn bench_times_expert_parallelism_phase_by_phase() {
    let args = ["bench", "--world", "3", "--ops", "moe", "-d", "bf16", "--moe-tokens", "64", "--moe-hidden", "32", "--moe-experts", "12"];
    let out = Command::new(WEFT).args(args).args(["--moe-topk", "4", "-n", "2", "-w", "1"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for phase in ["plan", "dispatch", "combine", "combine_backward", "dispatch_backward", "total"] {
        assert!(text.contains(phase), "{phase} missing:\n{text}");
    }
    assert!(text.contains("wrong elements: 0") && text.contains("# total wrong: 0"), "{text}");
    let out = Command::new(WEFT).args(["bench", "--world", "2", "--ops", "moe", "-d", "i32"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("float rows"));
}

/// `--timing span`: every iteration from the first rank's start to the
/// last rank's end, on the clock the host's processes share; a p2p chain
/// through three ranks spans at least one hop, which takes time.
#[test]
fn bench_times_spans_across_ranks() {
    let out = Command::new(WEFT)
        .args(["bench", "--world", "3", "--ops", "p2p,barrier", "-e", "8", "-n", "50", "--timing", "span", "--csv", "-"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let medians: Vec<f64> = text.lines().skip(1).map(|l| l.split(',').nth(9).unwrap().parse().unwrap()).collect();
    assert_eq!(medians.len(), 2, "{text}");
    assert!(medians.iter().all(|m| *m > 0.0 && *m < 1e6), "{text}");
    let out = Command::new(WEFT).args(["bench", "--world", "2", "--ops", "barrier", "--timing", "spam"]).output().unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("spam"));
}

/// With fresh inputs every rank rewrites its input before each iteration;
/// every op's check still runs on the inputs as made (the rewrite undone).
#[test]
fn bench_with_fresh_inputs_checks_every_op() {
    let out = Command::new(WEFT)
        .args(["bench", "--world", "3", "--backend", "shm", "-b", "4K", "-e", "64K", "-f", "16", "-n", "3", "-w", "1", "--fresh-inputs"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("inputs fresh") && text.contains("all_gather") && text.contains("# total wrong: 0"), "{text}");
}

/// cpu-tcp sends messages over 1 MiB by rendezvous: every op, checked, on
/// both sides of that limit, with a root that is not rank 0.
#[test]
fn bench_checks_cpu_tcp_across_the_rendezvous_limit() {
    let out = Command::new(WEFT)
        .args(["bench", "--world", "3", "--backend", "cpu-tcp", "-b", "1M", "-e", "4M", "-f", "4", "-n", "2", "-w", "1", "-r", "2"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("4194304") && text.contains("all_to_all_v") && text.contains("# total wrong: 0"), "{text}");
}

#[test]
fn bench_sparse_all_reduce_runs_every_algorithm_and_checks_them() {
    let out = Command::new(WEFT)
        .args([
            "bench",
            "--world",
            "3",
            "--ops",
            "sparse_all_reduce",
            "-n",
            "1",
            "--sparse-rows",
            "2000",
            "--sparse-dim",
            "4",
            "--densities",
            "0.01,0.3",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("recursive_doubling") && text.contains("30.00%") && text.contains("# total wrong: 0"), "{text}");
}

/// A bad flag is one clear error before any rank starts (not one per
/// rank); a collective given to the reduce op's flag says where it goes.
#[test]
fn bench_rejects_bad_flags_before_starting_ranks() {
    for (args, says) in [
        (&["--op", "sparse_all_reduce"][..], "for the op sparse_all_reduce use --ops sparse_all_reduce"),
        (&["--ops", "all_reduse"][..], "unknown op \"all_reduse\""),
        (&["-o", "band", "-d", "f32"][..], "band"),
        (&["-b", "4K", "-e", "1K"][..], "minbytes <= maxbytes"),
    ] {
        let out = Command::new(WEFT).args(["bench", "--world", "2"]).args(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.matches(says).count(), 1, "{args:?}: wanted {says:?} once in:\n{err}");
        assert!(!err.contains("rank"), "{args:?}: a rank was started:\n{err}");
    }
}
