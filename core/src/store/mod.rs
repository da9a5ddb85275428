//! Rendezvous key-value stores: how ranks find each other.
//!
//! [`Store`] is the interface; [`TcpStore`] (a server on the master plus
//! clients), [`FileStore`] (a file on a shared file system), [`PrefixStore`]
//! (a namespace inside another store) and [`MemoryStore`] (threads of one
//! process) implement it. Every blocking call has a timeout.

mod file;
mod memory;
mod prefix;
pub(crate) mod session;
mod tcp_client;
mod tcp_server;
pub(crate) mod wire;

pub use file::FileStore;
pub use memory::MemoryStore;
pub use prefix::PrefixStore;
pub use tcp_client::TcpStore;
pub use tcp_server::TcpStoreServer;

use crate::error::{Error, Result};
use std::time::Duration;

/// A collective step that must work on every rank or on none: each rank
/// publishes whether its part (`made`) worked under `key/RANK`, then reads
/// everyone's. Returns `made` when all succeeded; otherwise, on every rank,
/// `Unsupported` naming the first rank that failed and why, so that
/// backend creation can fail together and `auto` fall back together.
pub fn all_or_none<T>(store: &dyn Store, key: &str, rank: usize, size: usize, timeout: Duration, made: Result<T>, what: &str) -> Result<T> {
    let status = match &made {
        Ok(_) => "ok".to_string(),
        Err(e) => e.to_string(),
    };
    store.set(&format!("{key}/{rank}"), status.as_bytes())?;
    for r in 0..size {
        let s = store.get(&format!("{key}/{r}"), timeout)?;
        if s != b"ok" {
            return Err(Error::unsupported(format!("{what}: rank {r} failed: {}", String::from_utf8_lossy(&s))));
        }
    }
    made
}

/// A collective over the store: publish `mine` under `key/RANK`, then read
/// every rank's (in rank order, this rank's included), each within `timeout`.
pub fn all_gather(store: &dyn Store, key: &str, rank: usize, size: usize, timeout: Duration, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    store.set(&format!("{key}/{rank}"), mine)?;
    (0..size).map(|r| store.get(&format!("{key}/{r}"), timeout)).collect()
}

/// A key-value store shared by the ranks of a job.
///
/// Values are bytes; `add` keeps its counter as a decimal string, so `get`
/// on a counter returns e.g. `b"3"`. Calls that wait take an explicit
/// timeout and fail with `ErrorKind::Timeout`; the others are bounded by
/// [`Store::timeout`].
pub trait Store: Send + Sync {
    /// Set `key` to `value`, waking waiters.
    fn set(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Wait up to `timeout` for `key` to exist and return its value.
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>>;
    /// Add `delta` to the integer counter at `key` (0 if missing), returning the new value.
    fn add(&self, key: &str, delta: i64) -> Result<i64>;
    /// Set `key` to `desired` if its value equals `expected` (a missing key
    /// equals empty `expected`); return the value stored afterwards (empty if
    /// the key is still missing).
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>>;
    /// Wait up to `timeout` until every key exists.
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()>;
    /// Whether every key exists now.
    fn check(&self, keys: &[&str]) -> Result<bool>;
    /// Delete `key`; true if it existed.
    fn delete(&self, key: &str) -> Result<bool>;
    /// Number of keys stored.
    fn num_keys(&self) -> Result<u64>;
    /// The default timeout of this store's calls.
    fn timeout(&self) -> Duration;
}

pub(crate) fn parse_counter(key: &str, v: &[u8]) -> Result<i64> {
    std::str::from_utf8(v)
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| crate::Error::invalid(format!("store key {key:?} holds {v:?}, not an integer counter")))
}

#[cfg(test)]
pub(crate) mod conformance {
    //! Behaviour every store must show; each store's tests call `check_store`.
    use super::Store;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    pub fn check_store(s: Arc<dyn Store>) {
        let t = Duration::from_millis(200);
        s.set("a", b"1").unwrap();
        assert_eq!(s.get("a", t).unwrap(), b"1");
        assert_eq!(s.add("n", 2).unwrap(), 2);
        assert_eq!(s.add("n", -5).unwrap(), -3);
        assert_eq!(s.get("n", t).unwrap(), b"-3");
        assert!(s.add("a", 1).is_ok(), "counter on a numeric value");
        s.set("text", b"x").unwrap();
        assert!(s.add("text", 1).is_err());
        assert_eq!(s.compare_set("c", b"", b"v1").unwrap(), b"v1");
        assert_eq!(s.compare_set("c", b"zz", b"v2").unwrap(), b"v1");
        assert_eq!(s.compare_set("c", b"v1", b"v2").unwrap(), b"v2");
        assert_eq!(s.compare_set("missing", b"x", b"y").unwrap(), b"");
        assert!(s.check(&["a", "c"]).unwrap());
        assert!(!s.check(&["a", "nope"]).unwrap());
        let start = Instant::now();
        let e = s.get("nope", Duration::from_millis(100)).unwrap_err();
        assert!(e.is_timeout(), "{e}");
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(s.wait(&["a", "nope"], Duration::from_millis(50)).unwrap_err().is_timeout());
        let n = s.num_keys().unwrap();
        assert!(s.delete("a").unwrap());
        assert!(!s.delete("a").unwrap());
        assert_eq!(s.num_keys().unwrap(), n - 1);
        // A waiter is woken by a set from another thread.
        let s2 = s.clone();
        let h = std::thread::spawn(move || s2.get("late", Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(50));
        s.set("late", b"here").unwrap();
        assert_eq!(h.join().unwrap().unwrap(), b"here");
        s.wait(&["late", "c"], t).unwrap();
    }
}
