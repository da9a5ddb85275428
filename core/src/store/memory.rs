//! In-process store for threads of one process (and the TCP server's state).

use super::{parse_counter, Store};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A store living in this process's memory.
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    timeout: Duration,
}

impl MemoryStore {
    /// An empty store whose non-waiting calls use `timeout` as their default.
    pub fn new(timeout: Duration) -> Self {
        MemoryStore { map: Mutex::new(HashMap::new()), changed: Condvar::new(), timeout }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while holding the lock cannot leave the map half-updated
        // (every update is one insert/remove), so poisoning is ignored.
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait_until<T>(
        &self,
        timeout: Duration,
        gone: Option<&dyn Fn() -> bool>,
        what: impl Fn(&HashMap<String, Vec<u8>>) -> String,
        mut ready: impl FnMut(&HashMap<String, Vec<u8>>) -> Option<T>,
    ) -> Result<T> {
        let deadline = Instant::now() + timeout;
        let mut map = self.lock();
        loop {
            if let Some(v) = ready(&map) {
                return Ok(v);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(format!("store: {} not set within {timeout:?}", what(&map))));
            }
            let slice = if gone.is_some() { (deadline - now).min(GONE_CHECK) } else { deadline - now };
            map = self.changed.wait_timeout(map, slice).unwrap_or_else(|p| p.into_inner()).0;
            if gone.is_some_and(|g| g()) {
                return Err(Error::aborted("the waiting client went away"));
            }
        }
    }

    /// [`Store::get`], given up (`Aborted`) once `gone()` says the one
    /// waiting for it has left (checked every 100 ms).
    pub(crate) fn get_unless_gone(&self, key: &str, timeout: Duration, gone: &dyn Fn() -> bool) -> Result<Vec<u8>> {
        self.wait_until(timeout, Some(gone), |_| format!("key {key:?}"), |m| m.get(key).cloned())
    }

    /// [`Store::wait`], given up as [`MemoryStore::get_unless_gone`].
    pub(crate) fn wait_unless_gone(&self, keys: &[&str], timeout: Duration, gone: &dyn Fn() -> bool) -> Result<()> {
        self.wait_until(timeout, Some(gone), |m| missing(m, keys), |m| keys.iter().all(|k| m.contains_key(*k)).then_some(()))
    }
}

/// How often a wait for a client checks whether that client is still there.
const GONE_CHECK: Duration = Duration::from_millis(100);

/// Which of `keys` are not set yet, for a timeout's message.
fn missing(m: &HashMap<String, Vec<u8>>, keys: &[&str]) -> String {
    format!("keys {:?}", keys.iter().filter(|k| !m.contains_key(**k)).collect::<Vec<_>>())
}

impl Store for MemoryStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.wait_until(timeout, None, |_| format!("key {key:?}"), |m| m.get(key).cloned())
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut m = self.lock();
        let now = match m.get(key) {
            Some(v) => parse_counter(key, v)?,
            None => 0,
        }
        .wrapping_add(delta);
        m.insert(key.to_string(), now.to_string().into_bytes());
        drop(m);
        self.changed.notify_all();
        Ok(now)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        let mut m = self.lock();
        let current = m.get(key).cloned();
        let matches = match &current {
            Some(v) => v == expected,
            None => expected.is_empty(),
        };
        if !matches {
            return Ok(current.unwrap_or_default());
        }
        m.insert(key.to_string(), desired.to_vec());
        drop(m);
        self.changed.notify_all();
        Ok(desired.to_vec())
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.wait_until(timeout, None, |m| missing(m, keys), |m| keys.iter().all(|k| m.contains_key(*k)).then_some(()))
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        let m = self.lock();
        Ok(keys.iter().all(|k| m.contains_key(*k)))
    }
    fn delete(&self, key: &str) -> Result<bool> {
        Ok(self.lock().remove(key).is_some())
    }
    fn num_keys(&self) -> Result<u64> {
        Ok(self.lock().len() as u64)
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
}
