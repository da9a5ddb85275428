//! A shared secret that keeps strangers out of a job: the store and
//! cpu-tcp's connections start with a challenge-response over it, so a
//! process that can reach their ports but lacks the key learns nothing and
//! changes nothing.
//!
//! The key comes from `WEFT_AUTH_KEY` (its bytes), or `WEFT_AUTH_KEY_FILE`
//! (the file's contents, trailing newline removed). `weft run` makes one
//! for the ranks it starts. Without a key, nothing is authenticated (as
//! before); a side with a key and a side without refuse each other.
//!
//! Each handshake: both sides send a fresh 16-byte nonce, and each proves
//! it holds the key by an HMAC-SHA256 over a label naming its role and
//! both nonces (so a recorded handshake replayed against new nonces
//! fails). The key protects who may join and speak; it does not encrypt
//! payloads.

use crate::error::{Error, Result};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::io::Read;

/// The environment variable holding the key.
pub const ENV_KEY: &str = "WEFT_AUTH_KEY";
/// The environment variable naming a file holding the key.
pub const ENV_KEY_FILE: &str = "WEFT_AUTH_KEY_FILE";
/// Bytes of a nonce.
pub const NONCE: usize = 16;
/// Bytes of a proof (an HMAC-SHA256).
pub const PROOF: usize = 32;

/// A job's shared secret.
#[derive(Clone)]
pub struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    /// A key of these bytes (at least 16).
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Key> {
        let bytes = bytes.into();
        if bytes.len() < 16 {
            return Err(Error::invalid(format!("an auth key needs at least 16 bytes, this one has {}", bytes.len())));
        }
        Ok(Key(bytes))
    }

    /// The key from `WEFT_AUTH_KEY` or `WEFT_AUTH_KEY_FILE`, if either is set.
    pub fn from_env() -> Result<Option<Key>> {
        if let Some(k) = std::env::var_os(ENV_KEY).filter(|k| !k.is_empty()) {
            return Key::new(k.into_encoded_bytes()).map(Some);
        }
        let Some(path) = std::env::var_os(ENV_KEY_FILE).filter(|p| !p.is_empty()) else { return Ok(None) };
        let mut text = std::fs::read(&path).map_err(|e| Error::invalid(format!("{ENV_KEY_FILE}={path:?}: {e}")))?;
        while text.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
            text.pop();
        }
        Key::new(text).map(Some)
    }

    /// A fresh random key of 64 hex digits (text fit for [`ENV_KEY`]).
    pub fn generate() -> Result<Key> {
        let mut b = [0u8; 32];
        random(&mut b)?;
        Key::new(b.iter().map(|x| format!("{x:02x}")).collect::<String>())
    }

    /// The key as text, if it is (a generated one is: what a launcher puts
    /// in [`ENV_KEY`] for its ranks).
    pub fn as_text(&self) -> Option<&str> {
        std::str::from_utf8(&self.0).ok()
    }

    /// This key's proof for `label` over `parts`.
    pub fn prove(&self, label: &str, parts: &[&[u8]]) -> [u8; PROOF] {
        self.mac(label, parts).finalize().into_bytes().into()
    }

    /// Whether `proof` is this key's for `label` over `parts` (in constant time).
    pub fn verify(&self, label: &str, parts: &[&[u8]], proof: &[u8]) -> bool {
        self.mac(label, parts).verify_slice(proof).is_ok()
    }

    fn mac(&self, label: &str, parts: &[&[u8]]) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(label.as_bytes());
        for p in parts {
            // Lengths first: no two lists of parts read alike.
            m.update(&(p.len() as u64).to_le_bytes());
            m.update(p);
        }
        m
    }
}

/// A fresh nonce.
pub fn nonce() -> Result<[u8; NONCE]> {
    let mut n = [0u8; NONCE];
    random(&mut n)?;
    Ok(n)
}

/// A random 64-bit number from the kernel's random source (names and
/// nonces that must not repeat between jobs).
pub fn random_u64() -> Result<u64> {
    let mut b = [0u8; 8];
    random(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

/// Fill `buf` from the kernel's random source.
fn random(buf: &mut [u8]) -> Result<()> {
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(buf))
        .map_err(|e| Error::backend(format!("no randomness from /dev/urandom: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_key_label_and_parts() {
        let k = Key::new(*b"0123456789abcdef0123").unwrap();
        let p = k.prove("store client", &[b"abc", b"d"]);
        assert!(k.verify("store client", &[b"abc", b"d"], &p));
        assert!(!k.verify("store server", &[b"abc", b"d"], &p), "another role");
        assert!(!k.verify("store client", &[b"ab", b"cd"], &p), "parts are delimited");
        assert!(!Key::new(*b"0123456789abcdef0124").unwrap().verify("store client", &[b"abc", b"d"], &p));
        assert!(Key::new(*b"short").is_err());
        assert_eq!(Key::generate().unwrap().as_text().unwrap().len(), 64);
        assert_ne!(nonce().unwrap(), nonce().unwrap());
        assert_eq!(format!("{k:?}"), "Key(..)");
    }
}
