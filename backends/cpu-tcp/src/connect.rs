//! Building the full mesh: every rank listens, publishes its address in the
//! store, connects to every lower rank and accepts every higher one.
//!
//! A connection starts with a handshake (magic, protocol version, both ranks
//! and the group's nonce); the acceptor answers with a status byte. A stray
//! connection, a peer of another job or group, or a duplicate is rejected
//! and the acceptor keeps waiting for the right peer. Every wait, on both
//! sides, ends at the setup deadline.
//!
//! With the job's key ([`weft::auth`]), the handshake is its keyed version:
//! the connector adds its nonce, the acceptor answers with its own and its
//! proof over the hello and both nonces, and the connector answers with
//! its proof; a connection whose proof fails is dropped (a recorded
//! handshake is useless against fresh nonces). A side with a key and a side
//! without one refuse each other (a version mismatch).

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};
use weft::auth::{self, Key};
use weft::store::Store;
use weft::{Error, Result};

const MAGIC: u32 = 0x5746_4853; // "WFHS"
/// The handshake without a key, and with one. (1 and 2 before data frames
/// carried lead padding, `wire::lead_for`: such a peer is refused here.)
const VERSION: u16 = 3;
const VERSION_KEYED: u16 = 4;
const HELLO: usize = 22;
/// Labels of the acceptor's proof and the connector's.
const ACCEPTOR_PROOF: &str = "weft cpu-tcp acceptor";
const CONNECTOR_PROOF: &str = "weft cpu-tcp connector";

#[derive(Copy, Clone, Debug, PartialEq)]
enum Status {
    Ok = 0,
    BadNonce = 1,
    BadRank = 2,
    Duplicate = 3,
    BadVersion = 4,
}

fn hello(from: usize, to: usize, nonce: u64, keyed: bool) -> [u8; HELLO] {
    let mut b = [0u8; HELLO];
    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    b[4..6].copy_from_slice(&(if keyed { VERSION_KEYED } else { VERSION }).to_le_bytes());
    b[6..10].copy_from_slice(&(from as u32).to_le_bytes());
    b[10..14].copy_from_slice(&(to as u32).to_le_bytes());
    b[14..22].copy_from_slice(&nonce.to_le_bytes());
    b
}

/// Connect this rank to every other; `peers[r]` is the socket to rank r.
/// With `key`, every connection is authenticated.
pub fn mesh(store: &dyn Store, rank: usize, size: usize, ip: IpAddr, deadline: Instant, key: Option<&Key>) -> Result<Vec<Option<Socket>>> {
    let timeout = deadline.saturating_duration_since(Instant::now());
    let listener = Socket::new(Domain::for_address(SocketAddr::new(ip, 0)), Type::STREAM, Some(Protocol::TCP))?;
    listener.set_reuse_address(true)?;
    // Accepted connections inherit this; one from another host is set
    // back in `tune::connections`.
    crate::tune::before_connecting(&listener, true)?;
    listener.bind(&SocketAddr::new(ip, 0).into()).map_err(|e| Error::backend(format!("cpu-tcp: cannot bind {ip}: {e}")))?;
    listener.listen(size as i32 + 16)?;
    let addr = listener.local_addr()?.as_socket().expect("an IP listener");
    weft::log::debug(format_args!("cpu-tcp rank {rank} listening on {addr}"));
    store.set(&format!("addr/{rank}"), addr.to_string().as_bytes())?;
    let nonce = if rank == 0 {
        let n = auth::random_u64()?;
        store.set("nonce", &n.to_le_bytes())?;
        n
    } else {
        let b = store.get("nonce", timeout)?;
        u64::from_le_bytes(b.as_slice().try_into().map_err(|_| Error::backend("cpu-tcp: malformed nonce in the store"))?)
    };

    let mut peers: Vec<Option<Socket>> = (0..size).map(|_| None).collect();
    std::thread::scope(|s| -> Result<()> {
        let acceptor = s.spawn(|| accept_all(&listener, rank, size, nonce, deadline, key));
        let mut lower = Vec::new();
        for peer in 0..rank {
            lower.push(connect_one(store, rank, peer, ip, nonce, deadline, key)?);
        }
        let higher = acceptor.join().expect("acceptor thread does not panic")?;
        for (p, sock) in lower.into_iter().enumerate() {
            peers[p] = Some(sock);
        }
        for (p, sock) in higher {
            peers[p] = Some(sock);
        }
        Ok(())
    })?;
    crate::tune::connections(&peers)?;
    for sock in peers.iter().flatten() {
        sock.set_nonblocking(false)?;
    }
    Ok(peers)
}

/// `local`: this rank's address (a peer there is on this host).
fn connect_one(
    store: &dyn Store,
    rank: usize,
    peer: usize,
    local: IpAddr,
    nonce: u64,
    deadline: Instant,
    key: Option<&Key>,
) -> Result<Socket> {
    let raw = store.get(&format!("addr/{peer}"), deadline.saturating_duration_since(Instant::now()))?;
    let addr: SocketAddr = String::from_utf8_lossy(&raw)
        .parse()
        .map_err(|_| Error::backend(format!("cpu-tcp: peer rank {peer} published a malformed address {raw:?}")))?;
    let mut delay = Duration::from_millis(5);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(Error::timeout(format!("cpu-tcp: rank {rank} could not connect to peer rank {peer} at {addr}")));
        }
        let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
        crate::tune::before_connecting(&sock, addr.ip().is_loopback() || addr.ip() == local)?;
        match sock.connect_timeout(&SockAddr::from(addr), left.min(Duration::from_secs(5))) {
            Ok(()) => {}
            Err(_) => {
                std::thread::sleep(delay.min(left));
                delay = (delay * 2).min(Duration::from_millis(200));
                continue;
            }
        }
        sock.set_read_timeout(Some(left.max(Duration::from_millis(1))))?;
        sock.set_write_timeout(Some(left.max(Duration::from_millis(1))))?;
        let h = hello(rank, peer, nonce, key.is_some());
        let mine = key.map(|_| auth::nonce()).transpose()?;
        (&sock).write_all(&h)?;
        if let Some(n) = &mine {
            (&sock).write_all(n)?;
        }
        let mut ack = [0u8; 5];
        (&sock)
            .read_exact(&mut ack)
            .map_err(|e| Error::backend(format!("cpu-tcp: no handshake reply from peer rank {peer} at {addr}: {e}")))?;
        let status = ack[4];
        if u32::from_le_bytes(ack[..4].try_into().expect("4 bytes")) != MAGIC || status != Status::Ok as u8 {
            let hint = if status == Status::BadVersion as u8 {
                "not the same job, or one of the two has WEFT_AUTH_KEY and the other not?"
            } else {
                "not the same job or group?"
            };
            return Err(Error::backend(format!("cpu-tcp: peer rank {peer} at {addr} rejected the handshake (status {status}: {hint})")));
        }
        if let (Some(key), Some(mine)) = (key, mine) {
            let mut theirs = [0u8; auth::NONCE + auth::PROOF];
            (&sock)
                .read_exact(&mut theirs)
                .map_err(|e| Error::backend(format!("cpu-tcp: peer rank {peer} at {addr} sent no proof: {e}")))?;
            let (their_nonce, proof) = theirs.split_at(auth::NONCE);
            if !key.verify(ACCEPTOR_PROOF, &[&h, &mine, their_nonce], proof) {
                return Err(Error::backend(format!(
                    "cpu-tcp: the listener at {addr} (peer rank {peer}'s address) does not hold this job's key"
                )));
            }
            (&sock).write_all(&key.prove(CONNECTOR_PROOF, &[&h, their_nonce, &mine]))?;
        }
        return Ok(sock);
    }
}

/// Longest one incoming connection may take to complete its handshake (a
/// silent or slow stranger holds nothing else up: each has its own thread).
const HANDSHAKE_TIME: Duration = Duration::from_secs(5);
/// Most incoming handshakes in progress at once (more wait in the backlog).
const HANDSHAKES: usize = 64;

/// What the handshake of one incoming connection found.
enum Incoming {
    Peer(usize, Socket),
    Refused,
}

fn accept_all(
    listener: &Socket,
    rank: usize,
    size: usize,
    nonce: u64,
    deadline: Instant,
    key: Option<&Key>,
) -> Result<Vec<(usize, Socket)>> {
    let accepted = std::sync::Arc::new(std::sync::Mutex::new(Vec::<usize>::new()));
    let (tx, rx) = std::sync::mpsc::channel::<Incoming>();
    let mut got: Vec<(usize, Socket)> = Vec::new();
    listener.set_nonblocking(true)?;
    let mut running = 0usize;
    while got.len() < size - rank - 1 {
        while let Ok(done) = rx.try_recv() {
            running -= 1;
            if let Incoming::Peer(p, sock) = done {
                got.push((p, sock));
            }
        }
        if got.len() == size - rank - 1 {
            break;
        }
        if Instant::now() >= deadline {
            let missing: Vec<usize> = (rank + 1..size).filter(|r| got.iter().all(|(p, _)| p != r)).collect();
            return Err(Error::timeout(format!("cpu-tcp: rank {rank} timed out waiting for peer rank(s) {missing:?} to connect")));
        }
        if running >= HANDSHAKES {
            std::thread::sleep(Duration::from_millis(2));
            continue;
        }
        let (sock, from) = match listener.accept() {
            Ok(c) => c,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        running += 1;
        // Its own thread, not waited for: setup goes on as soon as every
        // peer is in, while a silent stranger's handshake runs out alone.
        let (tx, accepted, key) = (tx.clone(), accepted.clone(), key.cloned());
        std::thread::Builder::new().name("weft-tcp-handshake".into()).spawn(move || {
            let until = deadline.min(Instant::now() + HANDSHAKE_TIME);
            let out = match handshake(&sock, rank, size, nonce, until, key.as_ref(), &accepted) {
                Ok(peer) => Incoming::Peer(peer, sock),
                Err(why) => {
                    weft::log::debug(format_args!("cpu-tcp rank {rank}: dropped a connection from {from:?}: {why}"));
                    Incoming::Refused
                }
            };
            let _ = tx.send(out);
        })?;
    }
    Ok(got)
}

/// The acceptor's side of one connection's handshake, by `until`: the
/// peer rank it is from, or why it was refused.
pub(crate) fn handshake(
    sock: &Socket,
    rank: usize,
    size: usize,
    nonce: u64,
    until: Instant,
    key: Option<&Key>,
    accepted: &std::sync::Mutex<Vec<usize>>,
) -> std::result::Result<usize, String> {
    let io = |e: std::io::Error| e.to_string();
    sock.set_nonblocking(false).map_err(io)?;
    sock.set_read_timeout(Some(until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)))).map_err(io)?;
    sock.set_write_timeout(Some(HANDSHAKE_TIME)).map_err(io)?;
    let version = if key.is_some() { VERSION_KEYED } else { VERSION };
    let mut h = [0u8; HELLO];
    (&mut &*sock).read_exact(&mut h).map_err(|e| format!("no handshake ({e})"))?;
    let word = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    let peer = word(6) as usize;
    let mut their_nonce = [0u8; auth::NONCE];
    if key.is_some() && u16::from_le_bytes([h[4], h[5]]) == VERSION_KEYED {
        (&mut &*sock).read_exact(&mut their_nonce).map_err(|e| format!("no nonce ({e})"))?;
    }
    let status = if word(0) != MAGIC || u16::from_le_bytes([h[4], h[5]]) != version {
        Status::BadVersion
    } else if u64::from_le_bytes(h[14..22].try_into().expect("8 bytes")) != nonce {
        Status::BadNonce
    } else if word(10) as usize != rank || peer <= rank || peer >= size {
        Status::BadRank
    } else {
        Status::Ok
    };
    // The status reply; a duplicate is told so only once the first of its
    // rank has proven itself (`claim`: this peer's place, if still free).
    let reply = |status: Status| [&MAGIC.to_le_bytes()[..], &[status as u8]].concat();
    let claim = || {
        let mut seen = accepted.lock().unwrap_or_else(|p| p.into_inner());
        let free = !seen.contains(&peer);
        if free {
            seen.push(peer);
        }
        free
    };
    if status != Status::Ok {
        let _ = (&mut &*sock).write_all(&reply(status));
        return Err(format!("{status:?}"));
    }
    match key {
        None => {
            if !claim() {
                let _ = (&mut &*sock).write_all(&reply(Status::Duplicate));
                return Err("Duplicate".into());
            }
            (&mut &*sock).write_all(&reply(Status::Ok)).map_err(io)?;
        }
        Some(key) => {
            // Our nonce and proof, then the connector's proof; only then is
            // the peer's place taken.
            let mine = auth::nonce().map_err(|e| e.to_string())?;
            let mut ok = reply(Status::Ok);
            ok.extend_from_slice(&mine);
            ok.extend_from_slice(&key.prove(ACCEPTOR_PROOF, &[&h, &their_nonce, &mine]));
            let mut proof = [0u8; auth::PROOF];
            (&mut &*sock).write_all(&ok).map_err(io)?;
            (&mut &*sock).read_exact(&mut proof).map_err(|e| format!("no proof ({e})"))?;
            if !key.verify(CONNECTOR_PROOF, &[&h, &mine, &their_nonce], &proof) {
                return Err("its proof of the key failed".into());
            }
            if !claim() {
                return Err("Duplicate".into());
            }
        }
    }
    Ok(peer)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use weft::store::MemoryStore;

    #[test]
    fn strays_and_foreign_handshakes_are_rejected_and_setup_still_succeeds() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(10)));
        let deadline = Instant::now() + Duration::from_secs(10);
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        std::thread::scope(|s| {
            let r0 = s.spawn(|| mesh(&*store, 0, 2, ip, deadline, None));
            let addr: SocketAddr = String::from_utf8(store.get("addr/0", Duration::from_secs(5)).unwrap()).unwrap().parse().unwrap();
            // Garbage, then a well-formed hello from "another job" (wrong nonce).
            let mut g = std::net::TcpStream::connect(addr).unwrap();
            g.write_all(b"GET / HTTP/1.0\r\n\r\n....").unwrap();
            let mut foreign = std::net::TcpStream::connect(addr).unwrap();
            foreign.write_all(&hello(1, 0, 12345, false)).unwrap();
            let mut ack = [0u8; 5];
            foreign.read_exact(&mut ack).unwrap();
            assert_eq!(ack[4], Status::BadNonce as u8);
            let r1 = mesh(&*store, 1, 2, ip, deadline, None).unwrap();
            let r0 = r0.join().unwrap().unwrap();
            assert!(r0[1].is_some() && r1[0].is_some());
            // The buffers asked for (the kernel doubles them, up to rmem_max).
            let cap = std::fs::read_to_string("/proc/sys/net/core/rmem_max").ok().and_then(|v| v.trim().parse().ok()).unwrap_or(0);
            let got = r1[0].as_ref().unwrap().recv_buffer_size().unwrap();
            assert!(got >= crate::tune::DEFAULT_BUFFER.min(cap), "receive buffer {got} bytes");
        });
    }

    #[test]
    fn silent_connections_do_not_hold_up_the_real_peer() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(10)));
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        std::thread::scope(|s| {
            let start = Instant::now();
            let r0 = s.spawn(|| mesh(&*store, 0, 2, ip, deadline, None));
            let addr: SocketAddr = String::from_utf8(store.get("addr/0", Duration::from_secs(5)).unwrap()).unwrap().parse().unwrap();
            // Eight strangers connect and say nothing.
            let silent: Vec<std::net::TcpStream> = (0..8).map(|_| std::net::TcpStream::connect(addr).unwrap()).collect();
            let r1 = mesh(&*store, 1, 2, ip, deadline, None).unwrap();
            let r0 = r0.join().unwrap().unwrap();
            assert!(r0[1].is_some() && r1[0].is_some());
            // Not one 5 s handshake wait after another (a hang guard, not a timing).
            assert!(start.elapsed() < Duration::from_secs(5), "setup took {:?}", start.elapsed());
            drop(silent);
        });
    }

    #[test]
    fn a_missing_peer_is_a_timeout_naming_it() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(10)));
        let e = mesh(&*store, 0, 3, "127.0.0.1".parse().unwrap(), Instant::now() + Duration::from_millis(300), None).err().unwrap();
        assert!(e.is_timeout() && e.to_string().contains("[1, 2]"), "{e}");
    }

    #[test]
    fn with_a_key_a_stranger_who_knows_the_nonce_is_dropped_and_the_peer_gets_in() {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(10)));
        let deadline = Instant::now() + Duration::from_secs(10);
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let key = Key::new(vec![5u8; 32]).unwrap();
        std::thread::scope(|s| {
            let r0 = s.spawn(|| mesh(&*store, 0, 2, ip, deadline, Some(&key)));
            let addr: SocketAddr = String::from_utf8(store.get("addr/0", Duration::from_secs(5)).unwrap()).unwrap().parse().unwrap();
            let nonce = u64::from_le_bytes(store.get("nonce", Duration::from_secs(5)).unwrap().try_into().unwrap());
            // A stranger with the group's nonce (say, sniffed) but not the
            // key: the listener's proof comes, but the stranger's fails.
            let mut stranger = std::net::TcpStream::connect(addr).unwrap();
            stranger.write_all(&hello(1, 0, nonce, true)).unwrap();
            stranger.write_all(&[9u8; auth::NONCE]).unwrap();
            let mut reply = [0u8; 5 + auth::NONCE + auth::PROOF];
            stranger.read_exact(&mut reply).unwrap();
            assert_eq!(reply[4], Status::Ok as u8);
            stranger.write_all(&[0u8; auth::PROOF]).unwrap();
            // A stranger without a key speaking the unkeyed version is refused outright.
            let mut plain = std::net::TcpStream::connect(addr).unwrap();
            plain.write_all(&hello(1, 0, nonce, false)).unwrap();
            let mut ack = [0u8; 5];
            plain.read_exact(&mut ack).unwrap();
            assert_eq!(ack[4], Status::BadVersion as u8);
            // The real rank 1 gets in.
            let r1 = mesh(&*store, 1, 2, ip, deadline, Some(&key)).unwrap();
            let r0 = r0.join().unwrap().unwrap();
            assert!(r0[1].is_some() && r1[0].is_some());
        });
        // A rank with another key is refused by the listener's proof.
        let store2: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(10)));
        let other = Key::new(vec![6u8; 32]).unwrap();
        let short = Instant::now() + Duration::from_secs(2);
        std::thread::scope(|s| {
            let a = s.spawn(|| mesh(&*store2, 0, 2, ip, short, Some(&key)));
            let e = mesh(&*store2, 1, 2, ip, short, Some(&other)).expect_err("another key is refused");
            assert!(e.to_string().contains("does not hold this job's key"), "{e}");
            assert!(a.join().unwrap().is_err(), "rank 0 never got its peer");
        });
    }
}
