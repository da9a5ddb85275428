//! Frames on a connection: a fixed header, then `len` payload bytes.
//!
//! ```text
//! u32 magic | u32 kind | u64 tag | u64 len      (little endian, 24 bytes)
//! ```
//! A header with another magic means the stream is corrupt (or not weft's):
//! the connection is failed, never "resynchronised". Messages up to
//! [`EAGER_LIMIT`] go as one data frame at once; longer ones by rendezvous:
//! the sender announces, the receiver says ready when its receive is
//! posted, and only then does the data frame follow.

use weft::{Error, Result};

pub const MAGIC: u32 = 0x5746_5431; // "WFT1"
pub const HEADER: usize = 24;
/// Longest message sent eagerly (without waiting for the receive). Longer
/// ones wait for the peer's [`Kind::Ready`], so a large payload is only
/// ever written into a posted receive: it is never copied aside, and never
/// blocks a connection while its receiver is busy elsewhere. A ring's
/// pipelined segments (256 KiB) stay eager.
pub const EAGER_LIMIT: usize = 1 << 20;
/// Largest payload accepted into an unexpected-message buffer.
pub const MAX_PAYLOAD: u64 = 1 << 40;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A message for a receive.
    Data = 1,
    /// The sender is closing this connection on purpose.
    Goodbye = 2,
    /// The sender's group failed; the payload names the rank to blame
    /// (u32 LE) and why (UTF-8), so every rank reports the same cause.
    Abort = 3,
    /// Rendezvous, sender to receiver: a message of `len` bytes under `tag`
    /// waits for the receive (no payload; checked like a data frame).
    Announce = 4,
    /// Rendezvous, receiver to sender: a receive of `len` bytes under `tag`
    /// is posted, so that message's data may come (no payload).
    Ready = 5,
}

/// Largest abort payload read.
pub const MAX_ABORT: u64 = 1 << 16;

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub tag: u64,
    pub len: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&(self.kind as u32).to_le_bytes());
        b[8..16].copy_from_slice(&self.tag.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; HEADER], peer: usize) -> Result<Header> {
        let word = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let long = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if word(0) != MAGIC {
            return Err(Error::backend(format!("garbage on the connection from peer rank {peer}: bad frame magic {:#010x}", word(0))));
        }
        let kind = match word(4) {
            1 => Kind::Data,
            2 => Kind::Goodbye,
            3 => Kind::Abort,
            4 => Kind::Announce,
            5 => Kind::Ready,
            k => return Err(Error::backend(format!("peer rank {peer} sent unknown frame kind {k}"))),
        };
        let len = long(16);
        if len > MAX_PAYLOAD {
            return Err(Error::backend(format!("peer rank {peer} announced a {len}-byte frame")));
        }
        Ok(Header { kind, tag: long(8), len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_garbage_fails() {
        let h = Header { kind: Kind::Data, tag: 77, len: 5 };
        assert_eq!(Header::decode(&h.encode(), 1).unwrap(), h);
        let mut g = h.encode();
        g[0] ^= 1;
        assert!(Header::decode(&g, 3).unwrap_err().to_string().contains("peer rank 3"));
    }
}
