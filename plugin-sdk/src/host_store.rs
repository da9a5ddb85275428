//! The host's store services as a weft `Store`, for backends running in a
//! plugin. ABI v1 offers get, set, add and wait; the other calls are
//! `Unsupported`.

use std::ffi::{c_void, CString};
use std::time::Duration;
use weft::plugin::abi::{self, HostV1, Status};
use weft::store::Store;
use weft::{Error, Result};

pub struct HostStore {
    host: *const HostV1,
    timeout: Duration,
}

// SAFETY: the host table is immutable and its services may be called from
// any thread (header contract); it lives until the plugin ctx is destroyed,
// which outlives the backend holding this store.
unsafe impl Send for HostStore {}
// SAFETY: as above.
unsafe impl Sync for HostStore {}

fn check(s: Status, what: &str, key: &str) -> Result<()> {
    match s {
        abi::OK => Ok(()),
        abi::ERR_TIMEOUT => Err(Error::timeout(format!("host store: {what} {key:?} timed out"))),
        _ => Err(Error::backend(format!("host store: {what} {key:?} failed (status {s})"))),
    }
}

fn cstr(key: &str) -> Result<CString> {
    CString::new(key).map_err(|_| Error::invalid("store key contains NUL"))
}

fn ms(d: Duration) -> i64 {
    d.as_millis().min(i64::MAX as u128) as i64
}

impl HostStore {
    pub fn new(host: *const HostV1, timeout: Duration) -> Self {
        HostStore { host, timeout }
    }
    fn h(&self) -> &HostV1 {
        // SAFETY: see the Send impl.
        unsafe { &*self.host }
    }
}

impl Store for HostStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = cstr(key)?;
        // SAFETY: valid key and value for the call.
        check(unsafe { (self.h().store_set)(self.h().host_ctx, k.as_ptr(), value.as_ptr() as *const c_void, value.len()) }, "set", key)
    }
    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let k = cstr(key)?;
        let mut buf = vec![0u8; 256];
        loop {
            let mut len = 0usize;
            // SAFETY: buf holds buf.len() writable bytes.
            let s = unsafe {
                (self.h().store_get)(self.h().host_ctx, k.as_ptr(), ms(timeout), buf.as_mut_ptr() as *mut c_void, buf.len(), &mut len)
            };
            check(s, "get", key)?;
            if len <= buf.len() {
                buf.truncate(len);
                return Ok(buf);
            }
            buf = vec![0u8; len];
        }
    }
    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = cstr(key)?;
        let mut v = 0i64;
        // SAFETY: valid pointers for the call.
        check(unsafe { (self.h().store_add)(self.h().host_ctx, k.as_ptr(), delta, &mut v) }, "add", key)?;
        Ok(v)
    }
    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<()> {
        let owned = keys.iter().map(|k| cstr(k)).collect::<Result<Vec<_>>>()?;
        let ptrs: Vec<_> = owned.iter().map(|k| k.as_ptr()).collect();
        // SAFETY: ptrs holds keys.len() valid strings for the call.
        check(unsafe { (self.h().store_wait)(self.h().host_ctx, ptrs.as_ptr(), ptrs.len(), ms(timeout)) }, "wait", &keys.join(","))
    }
    fn compare_set(&self, key: &str, _: &[u8], _: &[u8]) -> Result<Vec<u8>> {
        Err(Error::unsupported(format!("host store (ABI v1) has no compare_set ({key:?})")))
    }
    fn check(&self, _: &[&str]) -> Result<bool> {
        Err(Error::unsupported("host store (ABI v1) has no check"))
    }
    fn delete(&self, _: &str) -> Result<bool> {
        Err(Error::unsupported("host store (ABI v1) has no delete"))
    }
    fn num_keys(&self) -> Result<u64> {
        Err(Error::unsupported("host store (ABI v1) has no num_keys"))
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
}
