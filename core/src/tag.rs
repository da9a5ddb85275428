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
//! user        : bits 32..40 space, bit 31 device record (below), low
//!               31 bits = the user's tag
//! collective  : bits 58..63 op code, bit 57 combines, bit 56 fresh,
//!               38..56 shape, 30..38 space, 16..30 sequence number
//!               (mod 2^14), 0..16 step
//! window      : bit 62 = 1 (bit 63 = 0), bits 54..62 space, 8..54 the
//!               window's number in the group, 0..8 the channel (see
//!               `crate::window`)
//! transport   : bit 61 = 1 (bits 62, 63 = 0): a transport's own frames,
//!               never matched with a receive (shm's ring padding)
//! ```
//!
//! The *space* keeps apart the messages of groups that share one transport:
//! a group has space 0 on the transports it created, and a sub-group that
//! runs over its parent's (`group/shared.rs`) has a space of its own there
//! ([`in_space`]), so its user tags, collective slots and windows never
//! meet the parent's or another sub-group's.
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
//! [`Steps::combining`](crate::algorithms::Steps::combining) and
//! [`Steps::sending_fresh`](crate::algorithms::Steps::sending_fresh).

/// Largest tag a user may pass to send/recv (tags are `u32`, top bit reserved).
pub const MAX_USER_TAG: u32 = (1 << 31) - 1;

/// Bit 31 of a user tag (above [`MAX_USER_TAG`]): a device backend's own
/// record of a user message whose payload travels another way
/// (cuda-device's point-to-point: its size and place in the sender's
/// order), matched like the message itself, never with a host message.
pub const DEVICE_RECORD: u64 = 1 << 31;

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
const SEQ_MASK: u64 = (1 << 14) - 1;
/// A collective tag's slot (space and sequence number) bits (after
/// shifting out the step).
const SLOT_MASK: u64 = (1 << 22) - 1;
/// How many spaces there are: space 0 (a group on its own transports) and
/// 255 for sub-groups sharing them ([`in_space`]).
pub const SPACES: usize = 256;

/// Tag of step `step` of collective number `seq` (op code `op`, below 32)
/// whose shape is `shape`.
pub const fn collective(op: u8, seq: u64, shape: u32, step: u32) -> u64 {
    (1 << 63) | ((op as u64 & 0x1f) << 58) | ((shape as u64 & SHAPE_MASK) << 38) | ((seq & SEQ_MASK) << 16) | (step as u64 & 0xffff)
}

/// Tag of channel `channel` of the group's window number `id` (one-sided
/// frames: never a user tag, which is below 2^31, nor a collective's).
pub const fn window(id: u64, channel: u8) -> u64 {
    (1 << 62) | ((id & ((1 << 46) - 1)) << 8) | channel as u64
}

/// `tag` (made in space 0 by [`user`], [`collective`] or [`window`]) in
/// space `space`: what a sub-group sharing its parent's transport sends and
/// receives there. A transport's own frames are left as they are.
pub const fn in_space(tag: u64, space: u8) -> u64 {
    let space = space as u64;
    if is_collective(tag) {
        tag | (space << 30)
    } else if is_window(tag) {
        tag | (space << 54)
    } else if tag >> 61 == 0 {
        tag | (space << 32)
    } else {
        tag
    }
}

/// The space of `tag` (see [`in_space`]; 0 for a transport's own frames).
pub const fn space(tag: u64) -> u8 {
    if is_collective(tag) {
        ((tag >> 30) & 0xff) as u8
    } else if is_window(tag) {
        ((tag >> 54) & 0xff) as u8
    } else if tag >> 61 == 0 {
        ((tag >> 32) & 0xff) as u8
    } else {
        0
    }
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

/// The sequence number of a collective tag (mod 2^14).
pub const fn seq(tag: u64) -> u64 {
    (tag >> 16) & SEQ_MASK
}

/// The slot of a collective tag: its space and sequence number.
const fn slot(tag: u64) -> u64 {
    (tag >> 16) & SLOT_MASK
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

/// True when two tags belong to the same collective slot (same space and
/// sequence number) but different ops or shapes: the two ranks disagree on
/// which collective they are in, or on its dtype, reduce op, sizes or root.
/// Transports use this to fail at once instead of waiting.
pub const fn conflicts(a: u64, b: u64) -> bool {
    is_collective(a) && is_collective(b) && slot(a) == slot(b) && (op_code(a) != op_code(b) || shape(a) != shape(b))
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
    fn spaces_keep_shared_transports_apart() {
        let tags = [user(MAX_USER_TAG), collective(31, SEQ_MASK, SHAPE_MASK as u32, 0xffff) | COMBINES | FRESH, window(3, 255)];
        for t in tags {
            assert_eq!(in_space(t, 0), t);
            assert_ne!(in_space(t, 1), t);
            assert_ne!(in_space(t, 1), in_space(t, 255));
            // The kind and the fields of the tag are kept.
            let s = in_space(t, 255);
            assert_eq!((space(t), space(s), space(in_space(t, 7))), (0, 255, 7));
            assert_eq!((is_collective(s), is_window(s), s >> 61 == 0), (is_collective(t), is_window(t), t >> 61 == 0));
            if is_collective(t) {
                let fields = |t| (seq(t), op_code(t), shape(t), step(t), combines(t), fresh(t));
                assert_eq!(fields(s), fields(t));
            } else {
                assert_eq!(s & 0xffff_ffff, t & 0xffff_ffff, "the user's tag, the window's channel and number");
            }
        }
        // The same collective in two spaces is two slots, not a conflict.
        let (a, b) = (collective(3, 9, 1, 0), collective(4, 9, 2, 0));
        assert!(conflicts(a, b) && !conflicts(in_space(a, 1), b) && conflicts(in_space(a, 1), in_space(b, 1)));
        // A sequence number past the mask does not spill into the space.
        assert_eq!(collective(3, SEQ_MASK + 1, 1, 0), collective(3, 0, 1, 0));
        assert_eq!(in_space(1 << 61, 7), 1 << 61, "a transport's own frames");
        assert_eq!(space(1 << 61), 0);
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
        let t = collective(3, (1 << 14) + 7, SHAPE_MASK as u32, 2);
        assert!(!combines(t) && combines(t | COMBINES) && !fresh(t | COMBINES));
        assert!(!fresh(t) && fresh(t | FRESH) && !combines(t | FRESH));
        for bits in [COMBINES, FRESH, COMBINES | FRESH] {
            assert_eq!((seq(t | bits), op_code(t | bits), (t | bits) & 0xffff), (7, 3, 2));
            assert!(!conflicts(t, t | bits), "one op's steps, whatever their locality");
        }
        assert!(!combines(user(u32::MAX >> 1)) && !fresh(user(u32::MAX >> 1)));
    }
}
