//! Abuse a store server and watch its memory: `weft-store-abuse [SCALE]`.
//!
//! The server runs in a child process (this program with `serve`); the
//! driver measures its resident memory (VmRSS) at rest, under each abuse
//! and after the abusers have left, and how many rounds a well-behaved
//! client gets through meanwhile. The abuse is what issue 39's outside
//! test did, times SCALE (default 1): random frames on fresh connections,
//! connections sending most of a maximal frame then leaving, blocked gets
//! whose clients leave, and idle connections.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use weft::store::{Store, TcpStore};

fn main() -> anyhow::Result<()> {
    let arg = std::env::args().nth(1).unwrap_or_default();
    if arg == "serve" {
        let server = weft::store::TcpStoreServer::start_keyed(([127, 0, 0, 1], 0).into(), None)?;
        println!("{}", server.local_addr());
        // Serve until the driver closes our stdin.
        let _ = std::io::stdin().read(&mut [0u8; 1]);
        return Ok(());
    }
    if arg == "block" {
        // N clients, each blocked in a get that never ends, until killed.
        let (addr, n): (SocketAddr, usize) =
            (std::env::args().nth(2).unwrap_or_default().parse()?, std::env::args().nth(3).unwrap_or_default().parse()?);
        for _ in 0..n {
            let c = TcpStore::connect(&addr.ip().to_string(), addr.port(), Duration::from_secs(10))?;
            std::thread::Builder::new().stack_size(64 << 10).spawn(move || c.get("never", Duration::from_secs(600)))?;
        }
        println!("blocked");
        std::thread::sleep(Duration::from_secs(600));
        return Ok(());
    }
    let scale: usize = if arg.is_empty() { 1 } else { arg.parse()? };
    let mut child = Command::new(std::env::current_exe()?).arg("serve").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn()?;
    let mut line = String::new();
    let mut out = child.stdout.take().expect("piped");
    let mut b = [0u8; 1];
    while out.read(&mut b)? == 1 && b[0] != b'\n' {
        line.push(b[0] as char);
    }
    let addr: SocketAddr = line.trim().parse()?;
    let pid = child.id();
    let rss = || weft_tests::procs::status_bytes(Some(pid), "VmRSS").unwrap_or(0) >> 10;
    let client = TcpStore::connect(&addr.ip().to_string(), addr.port(), Duration::from_secs(10))?;
    let rounds = |client: &TcpStore| -> anyhow::Result<f64> {
        let start = Instant::now();
        let mut n = 0;
        while start.elapsed() < Duration::from_millis(500) {
            client.set("probe", b"x")?;
            client.get("probe", Duration::from_secs(5))?;
            n += 1;
        }
        Ok(n as f64 / start.elapsed().as_secs_f64())
    };
    let mut pool = vec![0u8; 1 << 20];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut pool)?;
    let report = |what: &str, rounds: f64| println!("{what:<52} RSS {:>7} KiB   client {rounds:>7.0} rounds/s", rss());
    std::thread::sleep(Duration::from_millis(200));
    report("at rest", rounds(&client)?);

    // Random frames, each on its own connection.
    let mut at = 0;
    for i in 0..30_000 * scale {
        let len = 1 + (pool[i % pool.len()] as usize * 257 + i) % 65_536;
        let Ok(mut c) = TcpStream::connect(addr) else { continue };
        let end = (at + len).min(pool.len());
        let _ = c.write_all(&pool[at..end]);
        at = if end == pool.len() { 0 } else { end };
    }
    report(&format!("after {} random frames", 30_000 * scale), rounds(&client)?);

    // Most of a 64 MiB frame from each of 20 connections, which then wait.
    let chunk = vec![7u8; 1 << 20];
    let big: Vec<TcpStream> = (0..20)
        .filter_map(|_| {
            let mut c = TcpStream::connect(addr).ok()?;
            c.set_write_timeout(Some(Duration::from_secs(2))).ok()?;
            c.write_all(&(64u32 << 20).to_le_bytes()).ok()?;
            for _ in 0..63 {
                if c.write_all(&chunk).is_err() {
                    break;
                }
            }
            Some(c)
        })
        .collect();
    report("20 clients holding 63 MiB of a 64 MiB frame", rounds(&client)?);
    drop(big);
    std::thread::sleep(Duration::from_millis(1500));
    report("after they left", rounds(&client)?);

    // Blocked gets whose clients then leave, and idle connections.
    let mut blocked = Command::new(std::env::current_exe()?)
        .args(["block", &addr.to_string(), &(2_000 * scale).to_string()])
        .stdout(Stdio::piped())
        .spawn()?;
    let mut said = [0u8; 7];
    blocked.stdout.take().expect("piped").read_exact(&mut said)?;
    let idle: Vec<TcpStream> = (0..1_000 * scale).filter_map(|_| TcpStream::connect(addr).ok()).collect();
    report(&format!("{} blocked gets, {} idle connections", 2_000 * scale, idle.len()), rounds(&client)?);
    blocked.kill()?;
    blocked.wait()?;
    drop(idle);
    std::thread::sleep(Duration::from_secs(1));
    report("after every abuser left", rounds(&client)?);
    drop(child.stdin.take());
    child.wait()?;
    Ok(())
}
