//! The frames of windows over point-to-point messages (`over_p2p.rs`):
//! their layout and the target's checks, with no I/O.
//!
//! An origin sends every frame for one target under the window's control
//! channel, so the target reads them in issue order. A frame is
//! [`FRAME_BYTES`] long: a put of at most [`INLINE`] bytes carries them
//! inside; a longer one is followed by one message of exactly its length
//! on the data channel, which the target receives straight into its
//! registered memory once it has checked the range.
//!
//! ```text
//! 0..4  magic "WFRM"   4 kind   5 inline length   6..8 zero
//! 8..16 offset (LE)    16..24 length (LE)          24..56 inline bytes
//! ```
//!
//! Everything else is zero: a target refuses a frame with any other byte
//! set, so that what decodes encodes back to the same bytes.

use crate::error::{Error, Result};

/// Bytes of every frame.
pub const FRAME_BYTES: usize = 56;
/// Put payloads this short travel inside the frame.
pub const INLINE: usize = 32;
const MAGIC: &[u8; 4] = b"WFRM";

/// Channel (low byte of the tag, see [`crate::tag::window`]) of frames.
pub const CONTROL: u8 = 0;
/// Channel of a long put's bytes, origin to target.
pub const DATA: u8 = 1;
/// Channel of a get's bytes, target to origin.
pub const REPLY: u8 = 2;

/// What a frame asks of its target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Write `len` bytes at `offset` (inline, or in the next data message).
    Put {
        /// Where, in the target's registered bytes.
        offset: u64,
        /// How many.
        len: u64,
    },
    /// Count one signal from the origin (after its earlier puts landed).
    Signal,
    /// Send `len` bytes from `offset` back on the reply channel.
    Get {
        /// Where, in the target's registered bytes.
        offset: u64,
        /// How many.
        len: u64,
    },
    /// The origin sends nothing more to this window (its `deregister`).
    Close,
}

const PUT: u8 = 1;
const SIGNAL: u8 = 2;
const GET: u8 = 3;
const CLOSE: u8 = 4;

impl Frame {
    /// The frame's bytes; a put of at most [`INLINE`] bytes carries `inline`.
    pub fn encode(self, inline: &[u8]) -> [u8; FRAME_BYTES] {
        let mut b = [0u8; FRAME_BYTES];
        b[..4].copy_from_slice(MAGIC);
        let (kind, offset, len) = match self {
            Frame::Put { offset, len } => (PUT, offset, len),
            Frame::Signal => (SIGNAL, 0, 0),
            Frame::Get { offset, len } => (GET, offset, len),
            Frame::Close => (CLOSE, 0, 0),
        };
        b[4] = kind;
        if kind == PUT && len as usize <= INLINE {
            debug_assert_eq!(inline.len() as u64, len);
            b[5] = inline.len() as u8;
            b[24..24 + inline.len()].copy_from_slice(inline);
        }
        b[8..16].copy_from_slice(&offset.to_le_bytes());
        b[16..24].copy_from_slice(&len.to_le_bytes());
        b
    }

    /// Read a frame from `origin` and check it against the target's
    /// `local` registered bytes: a put or get must lie inside them, and
    /// nothing else may be set. The error says what was wrong (a forged or
    /// corrupted frame: the target stops reading that origin).
    pub fn decode(b: &[u8; FRAME_BYTES], origin: usize, local: usize) -> Result<Frame> {
        let bad = |why: String| Err(Error::backend(format!("window: rank {origin} sent a malformed frame: {why}")));
        if &b[..4] != MAGIC {
            return bad("no frame marker".into());
        }
        let u64_at = |at: usize| u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        let (offset, len) = (u64_at(8), u64_at(16));
        let inline = b[5] as usize;
        let frame = match b[4] {
            PUT => Frame::Put { offset, len },
            SIGNAL => Frame::Signal,
            GET => Frame::Get { offset, len },
            CLOSE => Frame::Close,
            k => return bad(format!("unknown kind {k}")),
        };
        let carries = matches!(frame, Frame::Put { len, .. } if len as usize <= INLINE);
        let fields = matches!(frame, Frame::Put { .. } | Frame::Get { .. }) || (offset == 0 && len == 0);
        let padding = b[6..8].iter().chain(&b[24 + inline.min(INLINE)..]).all(|x| *x == 0);
        if !padding || !fields || (carries && inline as u64 != len) || (!carries && inline != 0) {
            return bad(format!("inconsistent fields (kind {}, inline {inline}, offset {offset}, length {len})", b[4]));
        }
        if let Frame::Put { offset, len } | Frame::Get { offset, len } = frame {
            if offset.checked_add(len).is_none_or(|end| end > local as u64) {
                return bad(format!("{len} bytes at offset {offset} lie outside its {local} registered bytes"));
            }
        }
        Ok(frame)
    }

    /// The bytes a decoded inline put carries.
    pub fn inline(b: &[u8; FRAME_BYTES]) -> &[u8] {
        &b[24..24 + (b[5] as usize).min(INLINE)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_carry_short_puts() {
        for f in [
            Frame::Put { offset: 3, len: 5 },
            Frame::Put { offset: 0, len: 1000 },
            Frame::Signal,
            Frame::Get { offset: 8, len: 8 },
            Frame::Close,
        ] {
            let inline: Vec<u8> = match f {
                Frame::Put { len, .. } if len as usize <= INLINE => (0..len as u8).collect(),
                _ => vec![],
            };
            let b = f.encode(&inline);
            assert_eq!(Frame::decode(&b, 1, 4096).unwrap(), f);
            assert_eq!(Frame::inline(&b), &inline[..]);
        }
    }

    #[test]
    fn ranges_outside_the_target_and_forged_fields_are_refused() {
        let local = 100;
        for f in [
            Frame::Put { offset: 96, len: 5 },
            Frame::Put { offset: u64::MAX, len: 2 },
            Frame::Get { offset: 101, len: 0 },
            Frame::Put { offset: 0, len: 101 },
        ] {
            let inline = vec![
                0u8;
                match f {
                    Frame::Put { len, .. } if len as usize <= INLINE => len as usize,
                    _ => 0,
                }
            ];
            let e = Frame::decode(&f.encode(&inline), 2, local).unwrap_err();
            assert!(e.to_string().contains("outside its 100 registered bytes"), "{e}");
            assert!(e.to_string().contains("rank 2"), "{e}");
        }
        assert!(Frame::decode(&Frame::Put { offset: 100, len: 0 }.encode(&[]), 0, local).is_ok(), "an empty put at the end");
        let mut b = Frame::Put { offset: 0, len: 4 }.encode(&[1, 2, 3, 4]);
        b[5] = 31;
        assert!(Frame::decode(&b, 0, local).is_err(), "inline length beyond the put's");
        let mut b = Frame::Signal.encode(&[]);
        b[0] = b'X';
        assert!(Frame::decode(&b, 0, local).is_err());
        let mut b = Frame::Signal.encode(&[]);
        b[4] = 9;
        assert!(Frame::decode(&b, 0, local).is_err());
        let mut b = Frame::Get { offset: 0, len: 64 }.encode(&[]);
        b[5] = 3;
        assert!(Frame::decode(&b, 0, local).is_err(), "a get carries nothing");
        let mut b = Frame::Signal.encode(&[]);
        b[9] = 1;
        assert!(Frame::decode(&b, 0, local).is_err(), "a signal has no offset");
        let mut b = Frame::Put { offset: 0, len: 2 }.encode(&[1, 2]);
        b[26] = 7;
        assert!(Frame::decode(&b, 0, local).is_err(), "bytes past the inline ones");
    }
}
