//! The TcpStore server: one thread per client, state in a [`MemoryStore`],
//! with limits so that no client, friendly or not, can take it down.
//!
//! - At most [`MAX_CLIENTS`] connections; one more is told so and closed.
//! - A frame's body is read as it arrives (memory grows with the bytes
//!   actually sent, not with the length a client announces), within
//!   [`FRAME_TIME`] of its first byte; frames in flight may hold at most
//!   [`FRAMES_BUDGET`] bytes in all.
//! - A blocking `get` or `wait` ends when its client goes away, not at its
//!   timeout: its thread and socket are freed at once.
//! - A reply the client does not read within [`FRAME_TIME`] drops it.
//! - A write wakes only the waiters of its key (see [`MemoryStore`]).
//! - Out of file descriptors, the accept loop backs off instead of spinning.
//! - With a key ([`crate::auth`]), a client must prove it holds it before
//!   any other request, within [`AUTH_TIME`] of connecting; a stranger is
//!   told only that a key is required.
//!
//! A client that sends garbage, a truncated or oversized frame or breaks a
//! limit gets an error response (when one can still be sent) and is
//! disconnected; every other client keeps being served.

use super::memory::MemoryStore;
use super::session::{Answer, Session};
use super::wire::{write_frame, Encoder, Request, Status, MAX_FRAME};
use crate::auth::Key;
use crate::error::{Error, Result};
use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Most clients served at once.
pub const MAX_CLIENTS: usize = 4096;
/// Longest a frame may take to arrive, from its first byte.
pub const FRAME_TIME: Duration = Duration::from_secs(30);
/// Most bytes of frames being received, over all clients.
pub const FRAMES_BUDGET: usize = 256 << 20;
/// With a key: longest a client may take to prove it holds it, from
/// connecting (a stranger cannot hold a client slot longer).
pub const AUTH_TIME: Duration = Duration::from_secs(10);

/// The server's limits (the constants above, smaller in tests).
#[derive(Clone, Copy, Debug)]
struct Limits {
    max_clients: usize,
    frame_time: Duration,
    frames_budget: usize,
    auth_time: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits { max_clients: MAX_CLIENTS, frame_time: FRAME_TIME, frames_budget: FRAMES_BUDGET, auth_time: AUTH_TIME }
    }
}

/// A running store server. Dropping it stops accepting new clients.
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
}

/// Largest frame body read into the heap (larger ones: [`Body::Large`]):
/// a frame announced but never sent costs at most this.
const SMALL_FRAME: usize = 4 << 10;
/// Stack of a client's thread: it only decodes frames and calls the
/// in-memory store (a small stack also keeps what exited threads leave
/// cached for reuse small).
const CLIENT_STACK: usize = 256 << 10;

/// What the clients' threads share.
struct Shared {
    state: MemoryStore,
    limits: Limits,
    /// The job's key: clients must prove they hold it.
    key: Option<Key>,
    clients: AtomicUsize,
    /// Bytes of frames being received right now.
    in_flight: AtomicUsize,
}

impl TcpStoreServer {
    /// Bind `addr` (port 0 picks a free one) and serve in background
    /// threads, to clients holding the key of the environment (`WEFT_AUTH_KEY`;
    /// none: to anyone).
    pub fn start(addr: SocketAddr) -> Result<Self> {
        Self::start_keyed(addr, Key::from_env()?)
    }

    /// As [`TcpStoreServer::start`], with this key (or none).
    pub fn start_keyed(addr: SocketAddr, key: Option<Key>) -> Result<Self> {
        Self::start_with(addr, Limits::default(), key)
    }

    fn start_with(addr: SocketAddr, limits: Limits, key: Option<Key>) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::backend(format!("store server cannot bind {addr}: {e}")))?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            state: MemoryStore::new(Duration::from_secs(3600)),
            limits,
            key,
            clients: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
        });
        let (stop2, shared2) = (stop.clone(), shared.clone());
        std::thread::Builder::new().name("weft-store-accept".into()).spawn(move || accept_loop(listener, &stop2, &shared2))?;
        crate::log::debug(format_args!("store server listening on {addr}"));
        Ok(TcpStoreServer { addr, stop, shared })
    }

    /// Clients connected now.
    pub fn clients(&self) -> usize {
        self.shared.clients.load(Ordering::Acquire)
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TcpStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn accept_loop(listener: TcpListener, stop: &AtomicBool, shared: &Arc<Shared>) {
    for conn in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let mut conn = match conn {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors (or another transient failure): the
                // connection waits in the backlog; retrying at once spins.
                crate::log::debug(format_args!("store server: accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
        };
        let max = shared.limits.max_clients;
        if shared.clients.fetch_add(1, Ordering::AcqRel) >= max {
            shared.clients.fetch_sub(1, Ordering::AcqRel);
            let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
            reject(&mut conn, &peer, Error::backend(format!("the store serves at most {max} clients at once")));
            continue;
        }
        let shared2 = shared.clone();
        let spawned = std::thread::Builder::new().name("weft-store-client".into()).stack_size(CLIENT_STACK).spawn(move || {
            serve_client(conn, &shared2);
            shared2.clients.fetch_sub(1, Ordering::AcqRel);
        });
        if spawned.is_err() {
            shared.clients.fetch_sub(1, Ordering::AcqRel);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn serve_client(mut conn: TcpStream, shared: &Shared) {
    let _ = conn.set_nodelay(true);
    let _ = conn.set_write_timeout(Some(shared.limits.frame_time));
    let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    let mut session = Session::new(shared.key.as_ref(), &shared.state);
    let auth_by = Instant::now() + shared.limits.auth_time;
    loop {
        let body = match read_frame_bounded(&mut conn, shared, (!session.trusted()).then_some(auth_by)) {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(e) => return reject(&mut conn, &peer, e),
        };
        let req = match Request::decode(&body) {
            Ok(r) => r,
            Err(e) => return reject(&mut conn, &peer, e),
        };
        drop(body);
        match session.answer(req, &|| client_gone(&conn)) {
            Answer::Reply(reply) => {
                if write_frame(&mut conn, &reply).is_err() {
                    return;
                }
            }
            Answer::Refuse(e) => return reject(&mut conn, &peer, e),
            Answer::Gone => return,
        }
    }
}

/// Bytes of a frame being received, counted against [`FRAMES_BUDGET`].
struct InFlight<'a> {
    shared: &'a Shared,
    bytes: usize,
}

impl InFlight<'_> {
    fn grow(&mut self, n: usize) -> Result<()> {
        let before = self.shared.in_flight.fetch_add(n, Ordering::AcqRel);
        self.bytes += n;
        let budget = self.shared.limits.frames_budget;
        if before + n > budget {
            return Err(Error::backend(format!("the store is receiving more than {budget} bytes of frames at once")));
        }
        Ok(())
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// One frame (see `wire.rs`), its body read as it arrives, within
/// [`FRAME_TIME`] of its first byte (and, given `by`, all of it by then);
/// `Ok(None)` on a clean end of stream before a frame starts.
fn read_frame_bounded(conn: &mut TcpStream, shared: &Shared, by: Option<Instant>) -> Result<Option<Body>> {
    let time = shared.limits.frame_time;
    let timed_out = |what: &str| match by {
        Some(by) if by <= Instant::now() => Error::backend(format!("not authenticated within {:?}", shared.limits.auth_time)),
        _ => Error::backend(format!("store frame {what} did not arrive within {time:?}")),
    };
    let mut len = [0u8; 4];
    let first = match by {
        None => {
            let _ = conn.set_read_timeout(None);
            conn.read(&mut len[..1])
        }
        Some(by) => read_some(conn, &mut len[..1], by),
    };
    match first {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) if by.is_some() && matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock) => {
            return Err(timed_out("start"))
        }
        Err(e) => return Err(e.into()),
    }
    let until = by.map_or(Instant::now() + time, |by| by.min(Instant::now() + time));
    read_by(conn, &mut len[1..], until).map_err(|_| timed_out("length"))?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(Error::backend(format!("store frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")));
    }
    // Read in place; a page takes memory only once bytes reach it.
    let mut body = Body::of(n)?;
    let mut counted = InFlight { shared, bytes: 0 };
    let mut have = 0;
    while have < n {
        let got = read_some(conn, &mut body[have..n], until).map_err(|_| timed_out("body"))?;
        counted.grow(got)?;
        have += got;
    }
    Ok(Some(body))
}

/// A frame's body: on the heap when small, else in its own anonymous
/// mapping (see the `memmap2` entry in Cargo.toml).
enum Body {
    Small(Vec<u8>),
    Large(memmap2::MmapMut),
}

impl Body {
    /// Zeroed room for `n` bytes.
    fn of(n: usize) -> Result<Body> {
        Ok(if n <= SMALL_FRAME { Body::Small(vec![0; n]) } else { Body::Large(memmap2::MmapMut::map_anon(n)?) })
    }
}

impl std::ops::Deref for Body {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Body::Small(v) => v,
            Body::Large(m) => m,
        }
    }
}

impl std::ops::DerefMut for Body {
    fn deref_mut(&mut self) -> &mut [u8] {
        match self {
            Body::Small(v) => v,
            Body::Large(m) => m,
        }
    }
}

/// Fill `buf` before `until`.
fn read_by(conn: &mut TcpStream, buf: &mut [u8], until: Instant) -> std::io::Result<()> {
    let mut at = 0;
    while at < buf.len() {
        at += read_some(conn, &mut buf[at..], until)?;
    }
    Ok(())
}

/// Read at least one byte into `buf` before `until` (an error at the end
/// of the stream or past `until`).
fn read_some(conn: &mut TcpStream, buf: &mut [u8], until: Instant) -> std::io::Result<usize> {
    let left = until.saturating_duration_since(Instant::now());
    if left.is_zero() {
        return Err(std::io::ErrorKind::TimedOut.into());
    }
    conn.set_read_timeout(Some(left))?;
    match conn.read(buf)? {
        0 => Err(std::io::ErrorKind::UnexpectedEof.into()),
        n => Ok(n),
    }
}

fn reject(conn: &mut TcpStream, peer: &str, e: Error) {
    crate::log::debug(format_args!("store server: dropping client {peer}: {e}"));
    let reply = Encoder::default().u8(Status::Error as u8).bytes(format!("protocol error: {}", e.message()).as_bytes()).0;
    let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
    let _ = write_frame(conn, &reply);
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

/// Whether the client has gone (its end closed, or the connection broke).
fn client_gone(conn: &TcpStream) -> bool {
    let _ = conn.set_nonblocking(true);
    let mut b = [0u8; 1];
    let gone = match conn.peek(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() != std::io::ErrorKind::WouldBlock,
    };
    let _ = conn.set_nonblocking(false);
    gone
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::wire::{read_frame, write_frame, Decoder};
    use std::io::Write;

    fn server(limits: Limits) -> TcpStoreServer {
        TcpStoreServer::start_with("127.0.0.1:0".parse().unwrap(), limits, None).unwrap()
    }

    /// Poll `cond` for up to 5 s.
    fn soon(cond: impl Fn() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        cond()
    }

    #[test]
    fn a_blocked_get_ends_with_its_client_and_frees_its_thread() {
        let s = server(Limits::default());
        let get = Request::Get { key: "never".into(), timeout: Duration::from_secs(600) }.encode();
        let conns: Vec<TcpStream> = (0..50)
            .map(|_| {
                let mut c = TcpStream::connect(s.local_addr()).unwrap();
                write_frame(&mut c, &get).unwrap();
                c
            })
            .collect();
        assert!(soon(|| s.clients() == 50), "{} clients", s.clients());
        drop(conns);
        assert!(soon(|| s.clients() == 0), "{} clients still served after they left", s.clients());
    }

    #[test]
    fn limits_on_clients_frame_bytes_and_frame_time() {
        let s = server(Limits { max_clients: 3, frame_time: Duration::from_millis(300), frames_budget: 1 << 20, ..Limits::default() });
        let addr = s.local_addr();
        // One client too many is told so.
        let held: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(addr).unwrap()).collect();
        assert!(soon(|| s.clients() == 3));
        let mut extra = TcpStream::connect(addr).unwrap();
        let reply = read_frame(&mut extra).unwrap().unwrap();
        assert!(String::from_utf8_lossy(&reply).contains("at most 3 clients"));
        drop(held);
        assert!(soon(|| s.clients() == 0));
        // A frame announcing 60 MiB costs only what is sent, and is dropped
        // when the rest does not come in time.
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(&(60u32 << 20).to_le_bytes()).unwrap();
        slow.write_all(&[1u8; 1000]).unwrap();
        assert!(soon(|| s.shared.in_flight.load(Ordering::Acquire) == 1000));
        let reply = read_frame(&mut slow).unwrap().unwrap();
        assert!(String::from_utf8_lossy(&reply).contains("did not arrive within"), "{}", String::from_utf8_lossy(&reply));
        assert!(soon(|| s.shared.in_flight.load(Ordering::Acquire) == 0));
        // Frames in flight together may not pass the budget.
        let mut big = TcpStream::connect(addr).unwrap();
        big.write_all(&(2u32 << 20).to_le_bytes()).unwrap();
        big.write_all(&vec![0u8; 2 << 20]).unwrap_or(());
        let reply = read_frame(&mut big).unwrap().unwrap();
        assert!(String::from_utf8_lossy(&reply).contains("more than 1048576 bytes"));
        // Well-behaved clients are served throughout.
        let mut ok = TcpStream::connect(addr).unwrap();
        write_frame(&mut ok, &Request::Set { key: "k".into(), value: b"v".to_vec() }.encode()).unwrap();
        let reply = read_frame(&mut ok).unwrap().unwrap();
        assert_eq!(Decoder(&reply).u8().unwrap(), Status::Ok as u8);
    }

    #[test]
    fn with_a_key_a_silent_or_slow_stranger_loses_its_slot_in_time() {
        let limits = Limits { auth_time: Duration::from_millis(300), ..Limits::default() };
        let key = Key::new(b"a job key of sixteen bytes or more".to_vec()).unwrap();
        let s = TcpStoreServer::start_with("127.0.0.1:0".parse().unwrap(), limits, Some(key)).unwrap();
        // One sends nothing, one starts a frame and stops.
        let mut silent = TcpStream::connect(s.local_addr()).unwrap();
        let mut slow = TcpStream::connect(s.local_addr()).unwrap();
        slow.write_all(&100u32.to_le_bytes()).unwrap();
        for c in [&mut silent, &mut slow] {
            let reply = read_frame(c).unwrap().unwrap();
            assert!(String::from_utf8_lossy(&reply).contains("within 300ms"), "{}", String::from_utf8_lossy(&reply));
        }
        assert!(soon(|| s.clients() == 0));
    }
}
