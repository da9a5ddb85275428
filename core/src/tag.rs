//! Message tags: how the algorithms keep concurrent messages apart, and
//! how a rank in another collective than its peers is caught at once.
//!
//! A tag is an opaque `u64` to transports, which match a receive with the
//! oldest message from the same peer carrying the same tag. Core builds tags
//! so that user point-to-point messages, each collective (by its sequence
//! number in the group) and each step inside it never collide:
//!
//! ```text
//! bit 63      : 1 = internal (collective), 0 = user send/recv
//! user        : low 32 bits = the user's tag
//! collective  : bits 58..63 op code, bit 57 combines, bit 56 fresh,
//!               38..56 shape, 16..38 sequence number (mod 2^22), 0..16 step
//! window      : bit 62 = 1 (bit 63 = 0), bits 8..62 the window's number
//!               in the group, 0..8 the channel (see `crate::window`)
//! transport   : bit 61 = 1 (bits 62, 63 = 0): a transport's own frames,
//!               never matched with a receive (shm's ring padding)
//! ```
//!
//! The *shape* ([`crate::shape`]) packs what every rank must agree on about
//! the collective (dtype, reduce op, a hash of its element counts and
//! root), so a message of the same collective slot with another op code or
//! shape is a mismatch ([`conflicts`]) that a transport reports when it
//! arrives, instead of reducing garbage or waiting for the timeout.
//!
//! The two locality bits tell a transport that can move a message with
//! either side's core (shared memory) which cache it should come from or
//! go to: *combines* marks steps whose receiver reduces what it receives as
//! it arrives (keep it in the receiver's cache), *fresh* steps whose sender
//! has just written what it sends (a reduced block, a forwarded one: move
//! it from the sender's cache). Set by
//! [`Comm::combining`](crate::algorithms::Comm::combining) and
//! [`Comm::sending_fresh`](crate::algorithms::Comm::sending_fresh).

/// Largest tag a user may pass to send/recv (tags are `u32`, top bit reserved).
pub const MAX_USER_TAG: u32 = (1 << 31) - 1;

/// Tag of a user send/recv.
pub const fn user(tag: u32) -> u64 {
    tag as u64
}

/// The bit of a collective tag whose step combines what it receives.
pub const COMBINES: u64 = 1 << 57;
/// The bit of a collective tag whose step sends what its sender has just written.
pub const FRESH: u64 = 1 << 56;
/// Bits of a collective's shape ([`crate::shape`]).
pub const SHAPE_BITS: u32 = 18;
const SHAPE_MASK: u64 = (1 << SHAPE_BITS) - 1;
/// A collective tag's sequence number bits (after shifting out the step).
const SEQ_MASK: u64 = (1 << 22) - 1;

/// Tag of step `step` of collective number `seq` (op code `op`, below 32)
/// whose shape is `shape`.
pub const fn collective(op: u8, seq: u64, shape: u32, step: u32) -> u64 {
    (1 << 63) | ((op as u64 & 0x1f) << 58) | ((shape as u64 & SHAPE_MASK) << 38) | ((seq & SEQ_MASK) << 16) | (step as u64 & 0xffff)
}

/// Tag of channel `channel` of the group's window number `id` (one-sided
/// frames: never a user tag, which is below 2^31, nor a collective's).
pub const fn window(id: u64, channel: u8) -> u64 {
    (1 << 62) | ((id & ((1 << 54) - 1)) << 8) | channel as u64
}

/// Whether `tag` carries a window's frames.
pub const fn is_window(tag: u64) -> bool {
    tag >> 62 == 1
}

/// Whether `tag` belongs to a collective (else it is a user message).
pub const fn is_collective(tag: u64) -> bool {
    tag >> 63 == 1
}

/// The step of a collective tag.
pub const fn step(tag: u64) -> u32 {
    (tag & 0xffff) as u32
}

/// The sequence number of a collective tag (mod 2^22).
pub const fn seq(tag: u64) -> u64 {
    (tag >> 16) & SEQ_MASK
}

/// The shape of a collective tag.
pub const fn shape(tag: u64) -> u32 {
    ((tag >> 38) & SHAPE_MASK) as u32
}

/// Whether `tag` is a collective step whose receiver combines (reduces)
/// what it receives as it arrives. False for user messages.
pub const fn combines(tag: u64) -> bool {
    is_collective(tag) && tag & COMBINES != 0
}

/// Whether `tag` is a collective step whose sender has just written what
/// it sends. False for user messages.
pub const fn fresh(tag: u64) -> bool {
    is_collective(tag) && tag & FRESH != 0
}

/// True when two tags belong to the same collective slot (same sequence
/// number) but different ops or shapes: the two ranks disagree on which
/// collective they are in, or on its dtype, reduce op, sizes or root.
/// Transports use this to fail at once instead of waiting.
pub const fn conflicts(a: u64, b: u64) -> bool {
    is_collective(a) && is_collective(b) && seq(a) == seq(b) && (op_code(a) != op_code(b) || shape(a) != shape(b))
}

/// Op code from a collective tag.
pub const fn op_code(tag: u64) -> u8 {
    ((tag >> 58) & 0x1f) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_do_not_collide() {
        assert_ne!(user(5), collective(0, 0, 0, 5));
        assert_ne!(collective(1, 7, 0, 0), collective(1, 8, 0, 0));
        assert!(conflicts(collective(1, 7, 0, 0), collective(2, 7, 0, 3)));
        assert!(!conflicts(collective(1, 7, 0, 0), collective(1, 7, 0, 3)));
        assert!(!conflicts(user(1), collective(2, 0, 0, 1)));
        assert_eq!(op_code(collective(9, 1, 0, 1)), 9);
        assert!(is_window(window(3, 1)) && !is_window(user(MAX_USER_TAG)) && !is_window(collective(31, SEQ_MASK, 0, 0xffff)));
        assert!(!is_collective(window(u64::MAX, 255)));
        assert_ne!(window(3, 1), window(4, 1));
    }

    #[test]
    fn another_shape_in_the_same_slot_conflicts() {
        let (a, b) = (collective(3, 9, 0x2_1234, 0), collective(3, 9, 0x2_1235, 4));
        assert!(conflicts(a, b));
        assert_eq!((shape(a), seq(a), op_code(a), step(b)), (0x2_1234, 9, 3, 4));
        assert!(!conflicts(a, collective(3, 10, 0x2_1235, 0)), "another slot");
    }

    #[test]
    fn locality_bits_are_apart_from_sequence_and_op() {
        let t = collective(3, (1 << 22) + 7, SHAPE_MASK as u32, 2);
        assert!(!combines(t) && combines(t | COMBINES) && !fresh(t | COMBINES));
        assert!(!fresh(t) && fresh(t | FRESH) && !combines(t | FRESH));
        for bits in [COMBINES, FRESH, COMBINES | FRESH] {
            assert_eq!((seq(t | bits), op_code(t | bits), (t | bits) & 0xffff), (7, 3, 2));
            assert!(!conflicts(t, t | bits), "one op's steps, whatever their locality");
        }
        assert!(!combines(user(u32::MAX >> 1)) && !fresh(user(u32::MAX >> 1)));
    }
}
