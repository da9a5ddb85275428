//! Ranks as real processes: start a store, spawn N copies of a program with
//! the launcher's environment, collect their exit statuses and output, and
//! kill everything at an outer time limit so a hang fails the test.

use std::io::Read;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft::store::TcpStoreServer;

/// How one rank ended.
#[derive(Debug)]
pub struct RankEnd {
    /// Exit status.
    pub status: ExitStatus,
    /// When it was seen to exit.
    pub at: Instant,
    /// Its stdout and stderr.
    pub output: String,
}

/// Run `program args` as `n` ranks with extra `env`, the store hosted here
/// (as `weft run` does); panic after `limit`.
pub fn run_world(program: &str, n: usize, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Vec<RankEnd> {
    let server = TcpStoreServer::start(([127, 0, 0, 1], 0).into()).expect("store server");
    let port = server.local_addr().port().to_string();
    run_world_with(program, n, args, env, limit, |rank| torchrun_vars(rank, n, &port, &[("WEFT_AGENT_STORE", "1".into())]))
}

/// As [`run_world`], with rank r on the "host" `hosts[r]` (`WEFT_HOST_ID`)
/// and `auto` choosing backends unless `env` says otherwise.
pub fn run_on_hosts(program: &str, hosts: &[&str], args: &[&str], env: &[(&str, &str)], limit: Duration) -> Vec<RankEnd> {
    let server = TcpStoreServer::start(([127, 0, 0, 1], 0).into()).expect("store server");
    let port = server.local_addr().port().to_string();
    let n = hosts.len();
    let vars = |r: usize| {
        let extra = [("WEFT_AGENT_STORE", "1".into()), ("WEFT_BACKEND", "auto".into()), ("WEFT_HOST_ID", hosts[r].to_string())];
        torchrun_vars(r, n, &port, &extra)
    };
    run_world_with(program, n, args, env, limit, vars)
}

/// torchrun's variables for `rank` of `n` with the store at
/// 127.0.0.1:`port`, then `extra`.
pub fn torchrun_vars(rank: usize, n: usize, port: &str, extra: &[(&str, String)]) -> Vec<(String, String)> {
    let mut v = vec![
        ("RANK".to_string(), rank.to_string()),
        ("WORLD_SIZE".into(), n.to_string()),
        ("MASTER_ADDR".into(), "127.0.0.1".into()),
        ("MASTER_PORT".into(), port.to_string()),
    ];
    v.extend(extra.iter().map(|(k, val)| (k.to_string(), val.clone())));
    v
}

/// A free TCP port on loopback (for a store rank 0 hosts).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// As [`run_world_with`], where rank 0 hosts the store on a free port
/// picked here (`vars(rank, port)`). A port found free can be taken by
/// another test before rank 0 binds it, so a world whose store lost that
/// race is run again on another port (three tries).
pub fn run_world_on_free_port(
    program: &str,
    n: usize,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
    vars: impl Fn(usize, &str) -> Vec<(String, String)>,
) -> Vec<RankEnd> {
    let mut tries = 0;
    loop {
        let port = free_port().to_string();
        let ends = run_world_with(program, n, args, env, limit, |r| vars(r, &port));
        let lost_race = ends.iter().any(|e| e.output.contains("store server cannot bind") && e.output.contains("in use"));
        tries += 1;
        if !lost_race || tries == 3 {
            return ends;
        }
    }
}

/// As [`run_world`], with each rank's launcher variables from `vars(rank)`.
pub fn run_world_with(
    program: &str,
    n: usize,
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
    vars: impl Fn(usize) -> Vec<(String, String)>,
) -> Vec<RankEnd> {
    let mut children: Vec<(Child, Arc<Mutex<String>>)> = (0..n)
        .map(|rank| {
            let mut cmd = Command::new(program);
            cmd.args(args).env("WEFT_TIMEOUT_SECONDS", "60").stdout(Stdio::piped()).stderr(Stdio::piped());
            for (k, v) in vars(rank) {
                cmd.env(k, v);
            }
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut child = cmd.spawn().expect("spawn rank");
            let out = Arc::new(Mutex::new(String::new()));
            for mut src in [Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>, Box::new(child.stderr.take().unwrap())] {
                let out = out.clone();
                std::thread::spawn(move || {
                    let mut s = String::new();
                    let _ = src.read_to_string(&mut s);
                    out.lock().unwrap().push_str(&s);
                });
            }
            (child, out)
        })
        .collect();
    let deadline = Instant::now() + limit;
    let mut ends: Vec<Option<(ExitStatus, Instant)>> = (0..n).map(|_| None).collect();
    while ends.iter().any(Option::is_none) {
        if Instant::now() > deadline {
            for (c, _) in children.iter_mut() {
                let _ = c.kill();
            }
            let outs: Vec<String> = children.iter().map(|(_, o)| o.lock().unwrap().clone()).collect();
            panic!("ranks still running after the outer limit of {limit:?} (hang?); output so far: {outs:#?}");
        }
        for (i, (c, _)) in children.iter_mut().enumerate() {
            if ends[i].is_none() {
                if let Some(s) = c.try_wait().expect("try_wait") {
                    ends[i] = Some((s, Instant::now()));
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(50)); // let the output pumps finish
    ends.into_iter()
        .zip(children)
        .map(|(e, (_, out))| {
            let (status, at) = e.expect("all ended");
            let output = out.lock().unwrap().clone();
            RankEnd { status, at, output }
        })
        .collect()
}

/// Names in /dev/shm that weft made (`weft-...`, as versions before
/// anonymous segments named theirs): today's segments have no name there,
/// so any is one a job left behind.
pub fn shm_segments() -> Vec<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.starts_with("weft")).collect())
        .unwrap_or_default()
}

/// A size field (`VmRSS`, `VmHWM`...) of `/proc/<pid>/status` (`None`:
/// this process), in bytes.
pub fn status_bytes(pid: Option<u32>, field: &str) -> Option<usize> {
    let who = pid.map_or("self".to_string(), |p| p.to_string());
    let status = std::fs::read_to_string(format!("/proc/{who}/status")).ok()?;
    let kb = status.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?;
    Some(kb.trim().trim_end_matches("kB").trim().parse::<usize>().ok()? << 10)
}

/// Run `scenario` of `worker` on `n` processes of `backend`, where the last
/// rank is killed (SIGKILL): it died by the signal, and every other rank
/// succeeded (it checked its own error) within 10 s of the death.
pub fn last_rank_killed_is_named_within_10s(worker: &str, scenario: &str, backend: &str, n: usize) {
    use std::os::unix::process::ExitStatusExt;
    let ends = run_world(worker, n, &[scenario], &[("WEFT_BACKEND", backend)], Duration::from_secs(90));
    let victim = &ends[n - 1];
    assert_eq!(victim.status.signal(), Some(9), "{backend}: the victim was killed: {}", victim.output);
    for (r, e) in ends[..n - 1].iter().enumerate() {
        assert!(e.status.success(), "{backend} rank {r}: {:?}\n{}", e.status, e.output);
        let after = e.at.saturating_duration_since(victim.at);
        assert!(after < Duration::from_secs(10), "{backend} rank {r} reported {after:?} after the kill");
    }
}
