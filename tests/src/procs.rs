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

/// Run `program args` as `n` ranks with extra `env`; panic after `limit`.
pub fn run_world(program: &str, n: usize, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Vec<RankEnd> {
    let server = TcpStoreServer::start(([127, 0, 0, 1], 0).into()).expect("store server");
    let port = server.local_addr().port().to_string();
    let mut children: Vec<(Child, Arc<Mutex<String>>)> = (0..n)
        .map(|rank| {
            let mut cmd = Command::new(program);
            cmd.args(args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("WEFT_AGENT_STORE", "1")
                .env("WEFT_TIMEOUT_SECONDS", "60")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
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
