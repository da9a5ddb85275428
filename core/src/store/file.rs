//! A store kept in one file, for ranks that share a file system but no
//! reachable master (as c10d's FileStore).
//!
//! The file is an append-only log of `set`/`delete` records; every operation
//! takes an exclusive `flock`, replays the log and, if it changes a key,
//! appends one record. Waiting calls poll with a growing sleep.

use super::{parse_counter, Store};
use crate::error::{Error, Result};
use nix::fcntl::{Flock, FlockArg};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// A store backed by the file at a path.
pub struct FileStore {
    path: PathBuf,
    timeout: Duration,
}

const SET: u8 = 1;
const DELETE: u8 = 2;

impl FileStore {
    /// Use (creating if needed) the file at `path`.
    pub fn new(path: impl AsRef<Path>, timeout: Duration) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| Error::invalid(format!("file store {}: {e}", path.display())))?;
        Ok(FileStore { path, timeout })
    }

    /// Run `f` on the replayed map under the file lock; records it returns are appended.
    fn locked<T>(&self, f: impl FnOnce(&HashMap<String, Vec<u8>>) -> Result<(T, Vec<(String, Option<Vec<u8>>)>)>) -> Result<T> {
        let io = |e: std::io::Error| Error::backend(format!("file store {}: {e}", self.path.display()));
        let file = OpenOptions::new().read(true).append(true).open(&self.path).map_err(io)?;
        let mut file = Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| io(e.into()))?;
        let map = replay(&mut file, &self.path)?;
        let (out, writes) = f(&map)?;
        if !writes.is_empty() {
            let mut rec = Vec::new();
            for (k, v) in writes {
                rec.push(if v.is_some() { SET } else { DELETE });
                rec.extend_from_slice(&(k.len() as u32).to_le_bytes());
                rec.extend_from_slice(k.as_bytes());
                let v = v.unwrap_or_default();
                rec.extend_from_slice(&(v.len() as u32).to_le_bytes());
                rec.extend_from_slice(&v);
            }
            file.write_all(&rec).map_err(io)?;
            file.flush().map_err(io)?;
        }
        Ok(out)
    }

    fn poll<T>(&self, timeout: Duration, what: &str, mut f: impl FnMut(&HashMap<String, Vec<u8>>) -> Option<T>) -> Result<T> {
        let deadline = crate::deadline::instant_after(timeout);
        let mut delay = Duration::from_millis(1);
        loop {
            if let Some(v) = self.locked(|m| Ok((f(m), vec![])))? {
                return Ok(v);
            }
            if Instant::now() >= deadline {
                return Err(Error::timeout(format!("file store {}: {what} not set within {timeout:?}", self.path.display())));
            }
            std::thread::sleep(delay.min(deadline.saturating_duration_since(Instant::now())));
            delay = (delay * 2).min(Duration::from_millis(50));
        }
    }
}

fn replay(file: &mut File, path: &Path) -> Result<HashMap<String, Vec<u8>>> {
    let mut data = Vec::new();
    file.seek(SeekFrom::Start(0))
        .and_then(|_| file.read_to_end(&mut data))
        .map_err(|e| Error::backend(format!("file store {}: {e}", path.display())))?;
    let mut map = HashMap::new();
    let mut d = super::wire::Decoder(&data);
    while !d.0.is_empty() {
        let corrupt = |_| Error::backend(format!("file store {} is corrupt (not written by weft?)", path.display()));
        let op = d.u8().map_err(corrupt)?;
        let key = d.string().map_err(corrupt)?;
        let val = d.bytes().map_err(corrupt)?;
        match op {
            SET => map.insert(key, val),
            DELETE => map.remove(&key),
            _ => return Err(corrupt(Error::backend(""))),
        };
    }
    Ok(map)
}

impl Store for FileStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.locked(|_| Ok(((), vec![(key.to_string(), Some(value.to_vec()))])))
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        self.poll(timeout, &format!("key {key:?}"), |m| m.get(key).cloned())
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.locked(|m| {
            let now = m.get(key).map(|v| parse_counter(key, v)).transpose()?.unwrap_or(0).wrapping_add(delta);
            Ok((now, vec![(key.to_string(), Some(now.to_string().into_bytes()))]))
        })
    }
    fn compare_set(&self, key: &str, expected: &[u8], desired: &[u8]) -> Result<Vec<u8>> {
        self.locked(|m| {
            let cur = m.get(key);
            if cur.map(|v| v.as_slice() == expected).unwrap_or(expected.is_empty()) {
                Ok((desired.to_vec(), vec![(key.to_string(), Some(desired.to_vec()))]))
            } else {
                Ok((cur.cloned().unwrap_or_default(), vec![]))
            }
        })
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        self.poll(timeout, &format!("keys {keys:?}"), |m| keys.iter().all(|k| m.contains_key(*k)).then_some(()))
    }
    fn check(&self, keys: &[&str]) -> Result<bool> {
        self.locked(|m| Ok((keys.iter().all(|k| m.contains_key(*k)), vec![])))
    }
    fn delete(&self, key: &str) -> Result<bool> {
        self.locked(|m| Ok(if m.contains_key(key) { (true, vec![(key.to_string(), None)]) } else { (false, vec![]) }))
    }
    fn num_keys(&self) -> Result<u64> {
        self.locked(|m| Ok((m.len() as u64, vec![])))
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
        let path = std::env::temp_dir().join(format!("weft-filestore-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        super::super::conformance::check_store(Arc::new(FileStore::new(&path, Duration::from_secs(5)).unwrap()));
        std::fs::write(&path, b"\x09garbage").unwrap();
        let e = FileStore::new(&path, Duration::from_secs(1)).unwrap().num_keys().unwrap_err();
        assert!(e.to_string().contains("corrupt"), "{e}");
        std::fs::remove_file(&path).unwrap();
    }
}
