//! The TcpStore client.

use super::session::{CLIENT_PROOF, SERVER_PROOF};
use super::wire::{read_frame, write_frame, Decoder, Request, Status};
use super::{Store, TcpStoreServer};
use crate::auth::{self, Key};
use crate::error::{Error, Result};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Extra time a client waits for a reply beyond the server-side timeout.
const REPLY_SLACK: Duration = Duration::from_secs(5);

/// A client of a [`TcpStoreServer`], optionally owning the server itself
/// (the rank that hosts it). Safe to share between threads: each call in
/// flight uses its own connection (idle ones are kept for reuse), so a
/// thread blocked in `get` never holds up another thread's `set`.
pub struct TcpStore {
    addr: SocketAddr,
    idle: Mutex<Vec<TcpStream>>,
    timeout: Duration,
    /// The server answered once: a refused connection now means it is
    /// gone (its rank exited), not that it has not started yet.
    reached: std::sync::atomic::AtomicBool,
    /// The job's key, proven on every new connection.
    key: Option<Key>,
    _server: Option<TcpStoreServer>,
}

impl TcpStore {
    /// Connect to the server at `host:port`, retrying until `timeout`
    /// (the server may start after the client), proving the key of the
    /// environment (`WEFT_AUTH_KEY`) if there is one.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Self> {
        Self::connect_keyed(host, port, timeout, Key::from_env()?)
    }

    /// As [`TcpStore::connect`], with this key (or none).
    pub fn connect_keyed(host: &str, port: u16, timeout: Duration, key: Option<Key>) -> Result<Self> {
        let addr = resolve(host, port)?;
        let store = TcpStore { addr, idle: Mutex::new(Vec::new()), timeout, reached: false.into(), key, _server: None };
        let first = store.connect_one()?;
        store.idle.lock().unwrap_or_else(|p| p.into_inner()).push(first);
        Ok(store)
    }

    /// Start a server on `bind` and connect to it; the server lives as long
    /// as the returned store. Both use the key of the environment, if any.
    pub fn host(bind: SocketAddr, timeout: Duration) -> Result<Self> {
        let key = Key::from_env()?;
        let server = TcpStoreServer::start_keyed(bind, key.clone())?;
        let mut addr = server.local_addr();
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let mut store = Self::connect_keyed(&addr.ip().to_string(), addr.port(), timeout, key)?;
        store._server = Some(server);
        Ok(store)
    }

    /// Prove the key on a new connection, and check that the server holds
    /// it too (see [`crate::auth`]).
    fn authenticate(&self, conn: &mut TcpStream, key: &Key) -> Result<()> {
        let fail = |why: String| Error::backend(format!("store at {}: {why}", self.addr));
        conn.set_read_timeout(Some(self.timeout))?;
        let mine = auth::nonce()?;
        write_frame(conn, &Request::Hello { nonce: mine.to_vec() }.encode())?;
        let reply = read_frame(conn)?.ok_or_else(|| fail("closed the connection during authentication".into()))?;
        let mut d = Decoder(&reply);
        if d.u8()? != Status::Ok as u8 {
            return Err(fail(String::from_utf8_lossy(&d.bytes().unwrap_or_default()).into_owned()));
        }
        let (theirs, proof) = (d.bytes()?, d.bytes()?);
        if theirs.len() != auth::NONCE || !key.verify(SERVER_PROOF, &[&mine, &theirs], &proof) {
            return Err(fail("the server does not hold this job's key (WEFT_AUTH_KEY)".into()));
        }
        write_frame(conn, &Request::Proof { proof: key.prove(CLIENT_PROOF, &[&theirs, &mine]).to_vec() }.encode())?;
        let reply = read_frame(conn)?.ok_or_else(|| fail("refused this process's key".into()))?;
        if Decoder(&reply).u8()? != Status::Ok as u8 {
            return Err(fail("refused this process's key".into()));
        }
        Ok(())
    }

    /// The server address.
    pub fn server_addr(&self) -> SocketAddr {
        self.addr
    }

    fn connect_one(&self) -> Result<TcpStream> {
        let deadline = crate::deadline::instant_after(self.timeout);
        let mut delay = Duration::from_millis(10);
        let stream = loop {
            match TcpStream::connect_timeout(&self.addr, Duration::from_secs(2)) {
                Ok(s) => break s,
                // Failing fast matters on error paths (an abort recording
                // whom it blames) after the hosting rank has died.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused && self.reached.load(std::sync::atomic::Ordering::Relaxed) => {
                    return Err(Error::backend(format!("the store at {} is gone (connection refused): its host exited", self.addr)))
                }
                Err(e) if Instant::now() + delay >= deadline => {
                    return Err(Error::timeout(format!("cannot reach the store at {} within {:?}: {e}", self.addr, self.timeout)))
                }
                Err(_) => {
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
            }
        };
        stream.set_nodelay(true)?;
        self.reached.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut stream = stream;
        if let Some(key) = &self.key {
            self.authenticate(&mut stream, key)?;
        }
        Ok(stream)
    }

    /// Send one request and return the OK body; the server waits at most
    /// `wait` for the request itself.
    fn call(&self, req: Request, wait: Duration) -> Result<Vec<u8>> {
        let pooled = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut conn = match pooled {
            Some(c) => c,
            None => self.connect_one()?,
        };
        let result = (|| {
            conn.set_read_timeout(Some(wait + REPLY_SLACK))?;
            conn.set_write_timeout(Some(self.timeout))?;
            write_frame(&mut conn, &req.encode())?;
            read_frame(&mut conn)?.ok_or_else(|| Error::backend(format!("store at {} closed the connection", self.addr)))
        })();
        // A failed stream may be mid-frame: it is dropped, not pooled.
        let body = result.map_err(|e| e.context(format!("store at {}", self.addr)))?;
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(conn);
        let mut d = Decoder(&body);
        match d.u8()? {
            s if s == Status::Ok as u8 => Ok(d.0.to_vec()),
            s if s == Status::Timeout as u8 => Err(Error::timeout(String::from_utf8_lossy(&d.bytes()?).into_owned())),
            _ => Err(Error::backend(format!("store: {}", String::from_utf8_lossy(&d.bytes().unwrap_or_default())))),
        }
    }
}

fn resolve(host: &str, port: u16) -> Result<SocketAddr> {
    (host, port)
        .to_socket_addrs()
        .map_err(|e| Error::invalid(format!("cannot resolve store host {host:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::invalid(format!("store host {host:?} resolves to no address")))
}

impl Store for TcpStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call(Request::Set { key: key.into(), value: value.into() }, self.timeout).map(drop)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let b = self.call(Request::Get { key: key.into(), timeout }, timeout)?;
        Decoder(&b).bytes()
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let b = self.call(Request::Add { key: key.into(), delta }, self.timeout)?;
        Ok(Decoder(&b).u64()? as i64)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let b = self.call(Request::CompareSet { key: key.into(), expected: expected.into(), desired: desired.into() }, self.timeout)?;
        Decoder(&b).bytes()
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.call(Request::Wait { keys: keys.iter().map(|k| k.to_string()).collect(), timeout }, timeout).map(drop)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        let b = self.call(Request::Check { keys: keys.iter().map(|k| k.to_string()).collect() }, self.timeout)?;
        Ok(Decoder(&b).u8()? != 0)
    }
    fn delete(&self, key: &str) -> Result<bool> {
        let b = self.call(Request::Delete { key: key.into() }, self.timeout)?;
        Ok(Decoder(&b).u8()? != 0)
    }
    fn num_keys(&self) -> Result<u64> {
        let b = self.call(Request::NumKeys, self.timeout)?;
        Decoder(&b).u64()
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::Arc;

    fn hosted() -> Arc<TcpStore> {
        Arc::new(TcpStore::host("127.0.0.1:0".parse().unwrap(), Duration::from_secs(5)).unwrap())
    }

    #[test]
    fn conforms() {
        super::super::conformance::check_store(hosted());
    }

    fn key(b: u8) -> Option<Key> {
        Some(Key::new(vec![b; 32]).unwrap())
    }

    #[test]
    fn with_a_key_only_holders_of_it_get_in_and_a_recorded_handshake_is_useless() {
        let server = TcpStoreServer::start_keyed("127.0.0.1:0".parse().unwrap(), key(1)).unwrap();
        let port = server.local_addr().port();
        let t = Duration::from_secs(5);
        let ours = Arc::new(TcpStore::connect_keyed("127.0.0.1", port, t, key(1)).unwrap());
        super::super::conformance::check_store(ours.clone());
        ours.set("secret", b"nonce").unwrap();
        // No key: refused before any request is served.
        let e = TcpStore::connect_keyed("127.0.0.1", port, t, None).unwrap().get("secret", t).unwrap_err();
        assert!(e.to_string().contains("requires a key"), "{e}");
        // Another key: refused.
        let e = TcpStore::connect_keyed("127.0.0.1", port, t, key(2)).err().expect("a wrong key is refused");
        assert!(e.to_string().contains("does not hold this job's key"), "{e}");
        // A key against a server without one: refused too, saying so.
        let open = TcpStoreServer::start_keyed("127.0.0.1:0".parse().unwrap(), None).unwrap();
        let e = TcpStore::connect_keyed("127.0.0.1", open.local_addr().port(), t, key(1)).err().expect("refused");
        assert!(e.to_string().contains("no key"), "{e}");
        // A handshake recorded from a real client and replayed: the server's
        // new nonce makes the recorded proof worthless.
        let mut c = TcpStream::connect(server.local_addr()).unwrap();
        c.set_read_timeout(Some(t)).unwrap();
        let k = key(1).unwrap();
        let mine = [7u8; 16];
        write_frame(&mut c, &Request::Hello { nonce: mine.to_vec() }.encode()).unwrap();
        let reply = read_frame(&mut c).unwrap().unwrap();
        let mut d = Decoder(&reply);
        d.u8().unwrap();
        let first_nonce = d.bytes().unwrap();
        let recorded = k.prove(CLIENT_PROOF, &[&first_nonce, &mine]);
        let mut replay = TcpStream::connect(server.local_addr()).unwrap();
        replay.set_read_timeout(Some(t)).unwrap();
        write_frame(&mut replay, &Request::Hello { nonce: mine.to_vec() }.encode()).unwrap();
        read_frame(&mut replay).unwrap().unwrap();
        write_frame(&mut replay, &Request::Proof { proof: recorded.to_vec() }.encode()).unwrap();
        let reply = read_frame(&mut replay).unwrap().unwrap();
        assert!(String::from_utf8_lossy(&reply).contains("authentication failed"));
        assert_eq!(ours.get("secret", t).unwrap(), b"nonce");
    }

    #[test]
    fn server_survives_garbage_truncated_and_oversized_frames() {
        let store = hosted();
        store.set("k", b"v").unwrap();
        let addr = store.server_addr();
        let attacks: [&[u8]; 4] = [
            b"\x05\x00\x00\x00\xff\xff\xff\xff\xff", // unknown opcode
            b"\xff\xff\xff\xff",                     // oversized length
            b"\x10\x00\x00\x00\x01\x02",             // truncated, then close
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",    // wrong protocol entirely
        ];
        for bytes in attacks {
            let mut c = TcpStream::connect(addr).unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            c.write_all(bytes).unwrap();
            if bytes.len() == 6 {
                drop(c);
                continue;
            }
            let mut reply = Vec::new();
            let _ = c.read_to_end(&mut reply); // server answers (or not) and closes
        }
        // A well-behaved client on its existing connection and a new one still work.
        assert_eq!(store.get("k", Duration::from_secs(1)).unwrap(), b"v");
        let other = TcpStore::connect("127.0.0.1", addr.port(), Duration::from_secs(5)).unwrap();
        assert_eq!(other.add("n", 3).unwrap(), 3);
    }

    #[test]
    fn connect_to_nothing_times_out() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let e = TcpStore::connect("127.0.0.1", port, Duration::from_millis(300)).err().unwrap();
        assert!(e.is_timeout(), "{e}");
    }
}
