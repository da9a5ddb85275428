//! The TcpStore wire format: length-prefixed frames, decoded without trust.
//!
//! ```text
//! frame    = u32 length (LE) + body (at most MAX_FRAME bytes)
//! request  = u8 opcode + fields      (bytes = u32 len + data, ints LE)
//! response = u8 status (0 ok, 1 timeout, 2 error) + fields | message
//! ```
//!
//! With a key ([`crate::auth`]), a connection opens with `Hello` (the
//! client's nonce; the server answers with its nonce and proof) and
//! `Proof` (the client's), before any other request.

use crate::error::{Error, Result};
use std::io::{Read, Write};
use std::time::Duration;

/// Largest frame either side accepts; a larger length is a protocol error.
pub const MAX_FRAME: usize = 64 << 20;

/// A decoded request.
#[derive(Debug, PartialEq)]
pub enum Request {
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
        timeout: Duration,
    },
    Add {
        key: String,
        delta: i64,
    },
    CompareSet {
        key: String,
        expected: Vec<u8>,
        desired: Vec<u8>,
    },
    Wait {
        keys: Vec<String>,
        timeout: Duration,
    },
    Check {
        keys: Vec<String>,
    },
    Delete {
        key: String,
    },
    NumKeys,
    /// Authentication, first: the client's nonce.
    Hello {
        nonce: Vec<u8>,
    },
    /// Authentication, second: the client's proof over both nonces.
    Proof {
        proof: Vec<u8>,
    },
}

/// Response status byte.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Status {
    Ok = 0,
    Timeout = 1,
    Error = 2,
}

/// Appends fields to a frame body.
#[derive(Default)]
pub struct Encoder(pub Vec<u8>);

impl Encoder {
    pub fn u8(mut self, v: u8) -> Self {
        self.0.push(v);
        self
    }
    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(mut self, v: &[u8]) -> Self {
        self.0.extend_from_slice(&(v.len() as u32).to_le_bytes());
        self.0.extend_from_slice(v);
        self
    }
    pub fn keys(self, keys: &[&str]) -> Self {
        let mut e = self.u64(keys.len() as u64);
        for k in keys {
            e = e.bytes(k.as_bytes());
        }
        e
    }
}

/// Reads fields from a frame body; every read is bounds-checked.
pub struct Decoder<'a>(pub &'a [u8]);

impl<'a> Decoder<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            return Err(Error::backend(format!("store frame truncated: wanted {n} more bytes, {} left", self.0.len())));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }
    pub fn bytes(&mut self) -> Result<Vec<u8>> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")) as usize;
        Ok(self.take(n)?.to_vec())
    }
    pub fn string(&mut self) -> Result<String> {
        String::from_utf8(self.bytes()?).map_err(|_| Error::backend("store key is not UTF-8"))
    }
    fn keys(&mut self) -> Result<Vec<String>> {
        let n = self.u64()?;
        // Each key needs at least its 4-byte length: bound n by what is left.
        if n > (self.0.len() / 4) as u64 {
            return Err(Error::backend(format!("store frame claims {n} keys in {} bytes", self.0.len())));
        }
        (0..n).map(|_| self.string()).collect()
    }
    fn end(&self) -> Result<()> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Error::backend(format!("store frame has {} trailing bytes", self.0.len())))
        }
    }
}

impl Request {
    /// Encode as a frame body.
    pub fn encode(&self) -> Vec<u8> {
        let e = Encoder::default();
        let ms = |d: &Duration| d.as_millis().min(u64::MAX as u128) as u64;
        match self {
            Request::Set { key, value } => e.u8(1).bytes(key.as_bytes()).bytes(value),
            Request::Get { key, timeout } => e.u8(2).bytes(key.as_bytes()).u64(ms(timeout)),
            Request::Add { key, delta } => e.u8(3).bytes(key.as_bytes()).u64(*delta as u64),
            Request::CompareSet { key, expected, desired } => e.u8(4).bytes(key.as_bytes()).bytes(expected).bytes(desired),
            Request::Wait { keys, timeout } => e.u8(5).keys(&keys.iter().map(String::as_str).collect::<Vec<_>>()).u64(ms(timeout)),
            Request::Check { keys } => e.u8(6).keys(&keys.iter().map(String::as_str).collect::<Vec<_>>()),
            Request::Delete { key } => e.u8(7).bytes(key.as_bytes()),
            Request::NumKeys => e.u8(8),
            Request::Hello { nonce } => e.u8(9).bytes(nonce),
            Request::Proof { proof } => e.u8(10).bytes(proof),
        }
        .0
    }

    /// Decode a frame body, rejecting anything malformed.
    pub fn decode(body: &[u8]) -> Result<Request> {
        let mut d = Decoder(body);
        let ms = |v: u64| Duration::from_millis(v);
        let req = match d.u8()? {
            1 => Request::Set { key: d.string()?, value: d.bytes()? },
            2 => Request::Get { key: d.string()?, timeout: ms(d.u64()?) },
            3 => Request::Add { key: d.string()?, delta: d.u64()? as i64 },
            4 => Request::CompareSet { key: d.string()?, expected: d.bytes()?, desired: d.bytes()? },
            5 => Request::Wait { keys: d.keys()?, timeout: ms(d.u64()?) },
            6 => Request::Check { keys: d.keys()? },
            7 => Request::Delete { key: d.string()? },
            8 => Request::NumKeys,
            9 => Request::Hello { nonce: d.bytes()? },
            10 => Request::Proof { proof: d.bytes()? },
            op => return Err(Error::backend(format!("unknown store opcode {op}"))),
        };
        d.end()?;
        Ok(req)
    }
}

/// Write one frame.
pub fn write_frame(w: &mut impl Write, body: &[u8]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)
}

/// Read one frame; `Ok(None)` on a clean end of stream before a frame starts.
pub fn read_frame(r: &mut impl Read) -> Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(Error::backend(format!("store frame of {n} bytes exceeds the {MAX_FRAME}-byte limit")));
    }
    let mut body = vec![0u8; n];
    r.read_exact(&mut body).map_err(|e| Error::backend(format!("store frame truncated ({n} bytes announced): {e}")))?;
    Ok(Some(body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        let reqs = [
            Request::Set { key: "k".into(), value: vec![1, 2] },
            Request::Get { key: "k".into(), timeout: Duration::from_millis(7) },
            Request::Add { key: "c".into(), delta: -3 },
            Request::CompareSet { key: "k".into(), expected: vec![], desired: vec![9] },
            Request::Wait { keys: vec!["a".into(), "b".into()], timeout: Duration::from_millis(1) },
            Request::Check { keys: vec![] },
            Request::Delete { key: "k".into() },
            Request::NumKeys,
            Request::Hello { nonce: vec![3; 16] },
            Request::Proof { proof: vec![4; 32] },
        ];
        for r in reqs {
            assert_eq!(Request::decode(&r.encode()).unwrap(), r);
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for body in [&[][..], &[0xff], &[1, 200, 0, 0, 0, b'a'], &[5, 255, 255, 255, 255, 255, 255, 255, 255], &[8, 0]] {
            assert!(Request::decode(body).is_err(), "{body:?}");
        }
        let mut big = &((MAX_FRAME as u32 + 1).to_le_bytes())[..];
        assert!(read_frame(&mut big).is_err());
    }
}
