//! A namespace inside another store.

use super::Store;
use crate::error::Result;
use std::sync::Arc;
use std::time::Duration;

/// Prepends `prefix/` to every key before forwarding to the inner store.
pub struct PrefixStore {
    prefix: String,
    inner: Arc<dyn Store>,
}

impl PrefixStore {
    /// Keys become `"{prefix}/{key}"` in `inner`.
    pub fn new(prefix: impl Into<String>, inner: Arc<dyn Store>) -> Self {
        PrefixStore { prefix: prefix.into(), inner }
    }
    fn key(&self, k: &str) -> String {
        format!("{}/{k}", self.prefix)
    }
}

impl Store for PrefixStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner.set(&self.key(key), value)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.inner.get(&self.key(key), timeout)
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.inner.add(&self.key(key), delta)
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.inner.compare_set(&self.key(key), expected, desired)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let keys: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        self.inner.wait(&keys.iter().map(String::as_str).collect::<Vec<_>>(), timeout)
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        let keys: Vec<String> = keys.iter().map(|k| self.key(k)).collect();
        self.inner.check(&keys.iter().map(String::as_str).collect::<Vec<_>>())
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.inner.delete(&self.key(key))
    }
    /// Counts the keys of the whole inner store (as c10d's PrefixStore does).
    fn num_keys(&self) -> Result<u64> {
        self.inner.num_keys()
    }
    fn timeout(&self) -> Duration {
        self.inner.timeout()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::MemoryStore;

    #[test]
    fn conforms_and_isolates() {
        let inner: Arc<dyn Store> = Arc::new(MemoryStore::new(Duration::from_secs(5)));
        super::super::conformance::check_store(Arc::new(PrefixStore::new("p", inner.clone())));
        let q = PrefixStore::new("q", inner.clone());
        assert!(!q.check(&["late"]).unwrap());
        assert!(inner.check(&["p/late"]).unwrap());
    }
}
