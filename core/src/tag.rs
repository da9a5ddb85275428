//! Message tags: how the algorithms keep concurrent messages apart.
//!
//! A tag is an opaque `u64` to transports, which match a receive with the
//! oldest message from the same peer carrying the same tag. Core builds tags
//! so that user point-to-point messages, each collective (by its sequence
//! number in the group) and each step inside it never collide:
//!
//! ```text
//! bit 63      : 1 = internal (collective), 0 = user send/recv
//! user        : low 32 bits = the user's tag
//! collective  : bits 56..63 op code, 16..56 sequence number (mod 2^40), 0..16 step
//! ```

/// Largest tag a user may pass to send/recv (tags are `u32`, top bit reserved).
pub const MAX_USER_TAG: u32 = (1 << 31) - 1;

/// Tag of a user send/recv.
pub const fn user(tag: u32) -> u64 {
    tag as u64
}

/// Tag of step `step` of collective number `seq` (op code `op`).
pub const fn collective(op: u8, seq: u64, step: u32) -> u64 {
    (1 << 63) | ((op as u64 & 0x7f) << 56) | ((seq & ((1 << 40) - 1)) << 16) | (step as u64 & 0xffff)
}

/// True when two tags belong to the same collective slot (same sequence
/// number) but different ops: the two ranks disagree on which collective
/// they are in. Transports may use this to fail fast instead of waiting.
pub const fn conflicts(a: u64, b: u64) -> bool {
    let internal = (a >> 63) == 1 && (b >> 63) == 1;
    let same_seq = ((a >> 16) & ((1 << 40) - 1)) == ((b >> 16) & ((1 << 40) - 1));
    internal && same_seq && ((a >> 56) & 0x7f) != ((b >> 56) & 0x7f)
}

/// Op code from a collective tag.
pub const fn op_code(tag: u64) -> u8 {
    ((tag >> 56) & 0x7f) as u8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_do_not_collide() {
        assert_ne!(user(5), collective(0, 0, 5));
        assert_ne!(collective(1, 7, 0), collective(1, 8, 0));
        assert!(conflicts(collective(1, 7, 0), collective(2, 7, 3)));
        assert!(!conflicts(collective(1, 7, 0), collective(1, 7, 3)));
        assert!(!conflicts(user(1), collective(2, 0, 1)));
        assert_eq!(op_code(collective(9, 1, 1)), 9);
    }

    #[test]
    fn reductions_combine_what_they_receive() {
        use crate::backend::OpKind;
        let t = |k: OpKind| collective(k as u8, 3, 1);
        assert!(OpKind::combines_received(t(OpKind::ReduceScatter)) && OpKind::combines_received(t(OpKind::AllReduce)));
        assert!(!OpKind::combines_received(t(OpKind::AllGather)) && !OpKind::combines_received(t(OpKind::AllToAll)));
        assert!(!OpKind::combines_received(user(OpKind::AllReduce as u32)));
    }
}
