//! The TcpStore server: one thread per client, state in a [`MemoryStore`].
//!
//! A client that sends garbage, a truncated frame or an oversized frame gets
//! an error response (when one can still be sent) and is disconnected; every
//! other client keeps being served.

use super::memory::MemoryStore;
use super::wire::{read_frame, write_frame, Encoder, Request, Status};
use super::Store;
use crate::error::{Error, ErrorKind, Result};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A running store server. Dropping it stops accepting new clients.
pub struct TcpStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl TcpStoreServer {
    /// Bind `addr` (port 0 picks a free one) and serve in background threads.
    pub fn start(addr: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind(addr).map_err(|e| Error::backend(format!("store server cannot bind {addr}: {e}")))?;
        let addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(MemoryStore::new(Duration::from_secs(3600)));
        let stop2 = stop.clone();
        std::thread::Builder::new().name("weft-store-accept".into()).spawn(move || {
            for conn in listener.incoming() {
                if stop2.load(Ordering::Acquire) {
                    break;
                }
                let Ok(conn) = conn else { continue };
                let state = state.clone();
                let _ = std::thread::Builder::new().name("weft-store-client".into()).spawn(move || serve_client(conn, &state));
            }
        })?;
        crate::log::debug(format_args!("store server listening on {addr}"));
        Ok(TcpStoreServer { addr, stop })
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

fn serve_client(mut conn: TcpStream, state: &MemoryStore) {
    let _ = conn.set_nodelay(true);
    let peer = conn.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    loop {
        let body = match read_frame(&mut conn) {
            Ok(Some(b)) => b,
            Ok(None) => return,
            Err(e) => return reject(&mut conn, &peer, e),
        };
        let req = match Request::decode(&body) {
            Ok(r) => r,
            Err(e) => return reject(&mut conn, &peer, e),
        };
        let reply = match execute(state, req) {
            Ok(body) => body,
            Err(e) if e.kind() == &ErrorKind::Timeout => Encoder::default().u8(Status::Timeout as u8).bytes(e.message().as_bytes()).0,
            Err(e) => Encoder::default().u8(Status::Error as u8).bytes(e.message().as_bytes()).0,
        };
        if write_frame(&mut conn, &reply).is_err() {
            return;
        }
    }
}

fn reject(conn: &mut TcpStream, peer: &str, e: Error) {
    crate::log::debug(format_args!("store server: dropping client {peer}: {e}"));
    let reply = Encoder::default().u8(Status::Error as u8).bytes(format!("protocol error: {}", e.message()).as_bytes()).0;
    let _ = write_frame(conn, &reply);
    let _ = conn.shutdown(std::net::Shutdown::Both);
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

fn execute(s: &MemoryStore, req: Request) -> Result<Vec<u8>> {
    let ok = Encoder::default().u8(Status::Ok as u8);
    Ok(match req {
        Request::Set { key, value } => {
            s.set(&key, &value)?;
            ok
        }
        Request::Get { key, timeout } => ok.bytes(&s.get(&key, timeout)?),
        Request::Add { key, delta } => ok.u64(s.add(&key, delta)? as u64),
        Request::CompareSet { key, expected, desired } => ok.bytes(&s.compare_set(&key, &expected, &desired)?),
        Request::Wait { keys, timeout } => {
            s.wait(&refs(&keys), timeout)?;
            ok
        }
        Request::Check { keys } => ok.u8(s.check(&refs(&keys))? as u8),
        Request::Delete { key } => ok.u8(s.delete(&key)? as u8),
        Request::NumKeys => ok.u64(s.num_keys()?),
    }
    .0)
}
