//! Frames on a connection: a fixed header, `lead` bytes of padding (data
//! frames only, see [`lead_for`]), then `len` payload bytes.
//!
//! ```text
//! u32 magic | u8 kind, u8 lead, u16 0 | u64 tag | u64 len      (little endian, 24 bytes)
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
/// Most bytes of padding between a data frame's header and its payload.
pub const MAX_LEAD: usize = 63;
/// Shorter payloads get no lead: their copy is short however it is aligned.
const LEAD_FROM: usize = 1024;

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
    /// Padding bytes after the header (data frames; at most [`MAX_LEAD`]).
    pub lead: usize,
}

/// The lead padding for a data frame whose payload starts at `addr`.
///
/// The kernel copies a payload between the user's buffer and the pages of
/// its socket buffers, and a copy whose destination lies 1 to 31 bytes
/// past its source within a page is some 15 times slower on AMD's Zen
/// cores ([`weft::kernels::slow_copy_distance`]). A quiet connection's next
/// frame starts at a page's start (the kernel reuses a page fragment once
/// everything in it has been read), so a bare 24-byte header put every
/// payload from a page-aligned buffer 24 bytes past its source (figures: bench/RESULTS.md, "Measurements behind code comments").
///
/// The lead puts the payload at its buffer's page offset, or at least 32
/// bytes from it either way, so the sender's copy is fast, and so is the
/// receiver's into a buffer placed as the sender's (the same allocator,
/// or a collective's matching offsets); among those leads, the first that
/// also suits the receive buffers of `LIKELY_RECEIVES`.
pub fn lead_for(addr: usize, len: usize) -> usize {
    use weft::kernels::slow_copy_distance as slow;
    if len < LEAD_FROM {
        return 0;
    }
    let src = addr % 4096;
    // (One suits every page offset: `leads_keep_both_copies_off...` tries them all.)
    (0..=MAX_LEAD)
        .find(|lead| {
            let at = HEADER + lead;
            !slow(at, src) && !slow(src, at) && !LIKELY_RECEIVES.iter().any(|&r| slow(r, at))
        })
        .unwrap_or(0)
}

/// Page offsets a large receive buffer most likely has: a page's start
/// (page-aligned allocations), 16 bytes in (glibc's `malloc` from its own
/// mapping) and 64 (glibc's `posix_memalign(64)`, as torch's CPU
/// allocator asks). The first two lie behind any payload offset (at least
/// 24), so only 64 constrains the lead.
const LIKELY_RECEIVES: [usize; 3] = [0, 16, 64];

impl Header {
    pub fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.lead as u8;
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
        let kind = match (b[4], b[6], b[7]) {
            (1, 0, 0) => Kind::Data,
            (2, 0, 0) => Kind::Goodbye,
            (3, 0, 0) => Kind::Abort,
            (4, 0, 0) => Kind::Announce,
            (5, 0, 0) => Kind::Ready,
            _ => return Err(Error::backend(format!("peer rank {peer} sent unknown frame kind {:#010x}", word(4)))),
        };
        let len = long(16);
        if len > MAX_PAYLOAD {
            return Err(Error::backend(format!("peer rank {peer} announced a {len}-byte frame")));
        }
        let lead = b[5] as usize;
        if lead > MAX_LEAD || (lead > 0 && kind != Kind::Data) {
            return Err(Error::backend(format!("peer rank {peer} sent a {kind:?} frame with {lead} bytes of padding")));
        }
        Ok(Header { kind, tag: long(8), len, lead })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_garbage_fails() {
        let h = Header { kind: Kind::Data, tag: 77, len: 5, lead: 40 };
        assert_eq!(Header::decode(&h.encode(), 1).unwrap(), h);
        let mut g = h.encode();
        g[0] ^= 1;
        assert!(Header::decode(&g, 3).unwrap_err().to_string().contains("peer rank 3"));
        for (i, v) in [(4, 9), (5, MAX_LEAD as u8 + 1), (6, 1), (7, 1)] {
            let mut g = h.encode();
            g[i] = v;
            assert!(Header::decode(&g, 2).is_err(), "byte {i} = {v}");
        }
        let ready = Header { kind: Kind::Ready, tag: 1, len: 5, lead: 8 };
        assert!(Header::decode(&ready.encode(), 2).unwrap_err().to_string().contains("padding"));
    }

    #[test]
    fn leads_keep_both_copies_off_the_slow_distance() {
        use weft::kernels::slow_copy_distance as slow;
        for src in 0..4096 {
            let lead = lead_for(src, 1 << 20);
            assert!(lead <= MAX_LEAD);
            let at = HEADER + lead;
            assert!(!slow(at, src), "send from page offset {src}: payload at {at}");
            // A receive buffer placed as the send buffer is, or as large
            // buffers usually are.
            for r in std::iter::once(src).chain(LIKELY_RECEIVES) {
                assert!(!slow(r, at), "receive at {r} from {at} (send from {src})");
            }
        }
        // The bare header put a page-aligned buffer's payload 24 bytes past it.
        assert!(slow(HEADER, 0) && !slow(HEADER + lead_for(0, 1 << 20), 0));
        assert_eq!(lead_for(0, 8), 0, "short payloads go without");
    }
}
