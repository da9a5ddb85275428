//! In-process store for threads of one process (and the TCP server's state).
//! A write wakes only the waiters of its key: with thousands of clients
//! blocked on other keys, a write costs the same as with none.

use super::{parse_counter, Store};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The keys and values, and who waits for which key.
#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    /// Per key, the condition variables of the waiters it concerns.
    watchers: HashMap<String, Vec<Arc<Condvar>>>,
}

impl State {
    /// Store `value` under `key` and wake that key's waiters.
    fn put(&mut self, key: &str, value: Vec<u8>) {
        self.map.insert(key.to_string(), value);
        for w in self.watchers.get(key).into_iter().flatten() {
            w.notify_one();
        }
    }

    /// Stop (`on` false) or start waking `cv` on writes to `keys`.
    fn watch(&mut self, keys: &[&str], cv: &Arc<Condvar>, on: bool) {
        for k in keys {
            if on {
                self.watchers.entry(k.to_string()).or_default().push(cv.clone());
                continue;
            }
            if let Some(ws) = self.watchers.get_mut(*k) {
                ws.retain(|w| !Arc::ptr_eq(w, cv));
                if ws.is_empty() {
                    self.watchers.remove(*k);
                }
            }
        }
    }
}

/// A store living in this process's memory.
pub struct MemoryStore {
    state: Mutex<State>,
    timeout: Duration,
}

impl MemoryStore {
    /// An empty store whose non-waiting calls use `timeout` as their default.
    pub fn new(timeout: Duration) -> Self {
        MemoryStore { state: Mutex::new(State::default()), timeout }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the map half-updated
        // (every update is one insert/remove), so poisoning is ignored.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Wait until `ready` finds what it needs, woken by writes to `keys`.
    fn wait_until<T>(
        &self,
        keys: &[&str],
        timeout: Duration,
        gone: Option<&dyn Fn() -> bool>,
        mut ready: impl FnMut(&HashMap<String, Vec<u8>>) -> Option<T>,
    ) -> Result<T> {
        let deadline = crate::deadline::instant_after(timeout);
        let mut st = self.lock();
        if let Some(v) = ready(&st.map) {
            return Ok(v);
        }
        let cv = Arc::new(Condvar::new());
        st.watch(keys, &cv, true);
        let outcome = loop {
            if let Some(v) = ready(&st.map) {
                break Ok(v);
            }
            let now = Instant::now();
            if now >= deadline {
                break Err(Error::timeout(format!("store: {} not set within {timeout:?}", missing(&st.map, keys))));
            }
            if gone.is_some_and(|g| g()) {
                break Err(Error::aborted("the waiting client went away"));
            }
            let slice = if gone.is_some() { (deadline - now).min(GONE_CHECK) } else { deadline - now };
            st = cv.wait_timeout(st, slice).unwrap_or_else(|p| p.into_inner()).0;
        };
        st.watch(keys, &cv, false);
        outcome
    }

    /// [`Store::get`], given up (`Aborted`) once `gone()` says the one
    /// waiting for it has left (checked every 100 ms).
    pub(crate) fn get_unless_gone(&self, key: &str, timeout: Duration, gone: &dyn Fn() -> bool) -> Result<Vec<u8>> {
        self.wait_until(&[key], timeout, Some(gone), |m| m.get(key).cloned())
    }

    /// [`Store::wait`], given up as [`MemoryStore::get_unless_gone`].
    pub(crate) fn wait_unless_gone(&self, keys: &[&str], timeout: Duration, gone: &dyn Fn() -> bool) -> Result<()> {
        self.wait_until(keys, timeout, Some(gone), |m| keys.iter().all(|k| m.contains_key(*k)).then_some(()))
    }
}

/// How often a wait for a client checks whether that client is still there.
const GONE_CHECK: Duration = Duration::from_millis(100);

/// Which of `keys` are not set yet, for a timeout's message.
fn missing(m: &HashMap<String, Vec<u8>>, keys: &[&str]) -> String {
    match keys {
        [key] => format!("key {key:?}"),
        _ => format!("keys {:?}", keys.iter().filter(|k| !m.contains_key(**k)).collect::<Vec<_>>()),
    }
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().put(key, value.to_vec());
        Ok(())
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait_until(&[key], timeout, None, |m| m.get(key).cloned())
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut st = self.lock();
        let now = match st.map.get(key) {
            Some(v) => parse_counter(key, v)?,
            None => 0,
        }
        .wrapping_add(delta);
        st.put(key, now.to_string().into_bytes());
        Ok(now)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let mut st = self.lock();
        let current = st.map.get(key).cloned();
        let matches = match &current {
            Some(v) => v == expected,
            None => expected.is_empty(),
        };
        if !matches {
            return Ok(current.unwrap_or_default());
        }
        st.put(key, desired.to_vec());
        Ok(desired.to_vec())
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_until(keys, timeout, None, |m| keys.iter().all(|k| m.contains_key(*k)).then_some(()))
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        let st = self.lock();
        Ok(keys.iter().all(|k| st.map.contains_key(*k)))
    }
    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.lock().map.remove(key).is_some())
    }
    fn num_keys(&self) -> Result<u64> {
        Ok(self.lock().map.len() as u64)
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn conforms() {
        super::super::conformance::check_store(Arc::new(MemoryStore::new(Duration::from_secs(5))));
    }

    #[test]
    fn a_write_wakes_only_the_waiters_of_its_key_and_waiters_leave_no_trace() {
        let s = Arc::new(MemoryStore::new(Duration::from_secs(5)));
        let waiter = {
            let s = s.clone();
            std::thread::spawn(move || s.wait(&["a", "b"], Duration::from_secs(5)))
        };
        while s.lock().watchers.len() < 2 {
            std::thread::yield_now();
        }
        // Another key's writes do not concern it; its keys' do.
        s.set("c", b"x").unwrap();
        assert_eq!(s.lock().watchers.get("a").map(Vec::len), Some(1));
        s.set("a", b"1").unwrap();
        s.add("b", 1).unwrap();
        waiter.join().unwrap().unwrap();
        assert!(s.lock().watchers.is_empty());
        // A wait of any length (a client may ask for u64::MAX ms) for a
        // client that has left ends at once.
        let e = s.get_unless_gone("never", Duration::MAX, &|| true).unwrap_err();
        assert_eq!(e.kind(), &crate::ErrorKind::Aborted, "{e}");
        // A timed-out waiter leaves no watcher behind either.
        assert!(s.get("never", Duration::from_millis(10)).is_err());
        assert!(s.lock().watchers.is_empty());
    }
}
