//! Receive matching for byte-stream transports (cpu-tcp's sockets, shm's
//! rings): which posted receive an arriving frame fills, what happens to
//! frames that come before their receive, and how size and collective
//! mismatches are caught. Transports only read bytes into the slice this
//! hands them; the rules live here once.

use crate::backend::{OpKind, P2p, ANY_SOURCE};
use crate::error::{Error, Result};
use std::collections::{HashMap, VecDeque};

enum Dest {
    Recv(usize),
    Stash(Vec<u8>),
    /// A transport's own control message (e.g. an abort report).
    Control(Vec<u8>),
}

struct Frame {
    tag: u64,
    len: usize,
    got: usize,
    dest: Dest,
}

/// What came before its receive was posted.
enum Stashed {
    /// A whole message, copied aside.
    Message(Vec<u8>),
    /// Only the announcement of a message of this many bytes (a transport's
    /// rendezvous): checked against the receive when it is posted.
    Announced(usize),
}

/// Environment variable: how many bytes of messages that come before their
/// receive one rank keeps, per group's transport (a quarter of it per
/// peer).
pub const ENV_EARLY_BYTES: &str = "WEFT_EARLY_BYTES";
/// Default of [`ENV_EARLY_BYTES`]: 256 MiB per rank, 64 MiB per peer.
pub const DEFAULT_EARLY_BYTES: usize = 256 << 20;
/// Said of a receive that timed out while its peer's next frame was held
/// back (see [`Inbound::holds_back`]): why its message may never have come.
pub const HELD_BACK: &str = " (messages that no receive has taken yet fill this rank's budget for early messages, \
                             WEFT_EARLY_BYTES, and that peer's next one waits where it is)";

/// What one stashed entry costs beyond its payload (map and queue slots,
/// its header), so that floods of empty messages or announcements are
/// bounded too.
const ENTRY_COST: usize = 64;

/// Bytes of stash buffers kept for reuse, per peer: a sender that runs
/// ahead (a pipelined chain's, segment by segment) has one message after
/// another stashed, and fresh memory for each cost a page fault per 4 KiB
/// (figures: bench/RESULTS.md, "Measurements behind code comments").
const SPARE_BYTES: usize = 1 << 20;

/// How many bytes of early messages (no receive posted for them yet) a rank
/// keeps: from one peer, and from all together. Beyond it the transport
/// leaves the next frame where it is (the socket, the ring), so the sender
/// waits: memory stays bounded whatever peers send, and a program that
/// receives what it is sent still completes. One message per peer is
/// always taken by a rank with an op in progress, so a single early message
/// of any size gets through (shm leaves one in its ring while the rank has
/// no op in progress, for its receive to read there).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EarlyBudget {
    /// Bytes kept from one peer.
    pub per_peer: usize,
    /// Bytes kept from all peers together.
    pub per_rank: usize,
}

impl EarlyBudget {
    /// A budget of `per_rank` bytes in all, a quarter of it per peer.
    pub fn new(per_rank: usize) -> EarlyBudget {
        EarlyBudget { per_peer: (per_rank / 4).max(1), per_rank: per_rank.max(1) }
    }

    /// The budget `WEFT_EARLY_BYTES` sets, or the default.
    pub fn from_env() -> Result<EarlyBudget> {
        match std::env::var(ENV_EARLY_BYTES) {
            Err(_) => Ok(EarlyBudget::new(DEFAULT_EARLY_BYTES)),
            Ok(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .map(EarlyBudget::new)
                .ok_or_else(|| Error::invalid(format!("{ENV_EARLY_BYTES}={v:?} is not a positive number of bytes"))),
        }
    }
}

impl Default for EarlyBudget {
    fn default() -> EarlyBudget {
        EarlyBudget::new(DEFAULT_EARLY_BYTES)
    }
}

/// One peer's inbound state, kept across exchanges.
#[derive(Default)]
pub struct Inbound {
    frame: Option<Frame>,
    stash: HashMap<u64, VecDeque<Stashed>>,
    /// Longest data frame taken before its receive is posted (None: any).
    early_limit: Option<usize>,
    /// What the stash (and a frame arriving into it) holds, in bytes
    /// counted as [`EarlyBudget`] counts them.
    stashed: usize,
    budget: EarlyBudget,
    /// Buffers of stashed messages since served, for the next ones.
    spare: Vec<Vec<u8>>,
}

fn size_mismatch(peer: usize, me: usize, got: usize, want: usize, tag: u64) -> Error {
    Error::backend(format!(
        "size mismatch: peer rank {peer} sent {got} bytes, rank {me} expected {want} bytes ({})",
        OpKind::describe_tag(tag)
    ))
}

/// Ranks in different collectives, or in one they called differently: an
/// invalid call (`InvalidArgument`), found when the first message arrives.
fn collective_mismatch(peer: usize, theirs: u64, mine: u64) -> Error {
    let what = match crate::shape::difference(crate::tag::shape(mine), crate::tag::shape(theirs)) {
        Some(d) if crate::tag::op_code(mine) == crate::tag::op_code(theirs) => format!(": {d}"),
        _ => String::new(),
    };
    Error::invalid(format!(
        "collective mismatch: peer rank {peer} sent a message for {} while this rank waits in {}{what}",
        OpKind::describe_tag(theirs),
        OpKind::describe_tag(mine)
    ))
}

/// The first unfinished receive of the batch waiting for (`peer`, `tag`):
/// from that peer or from any.
fn waiting(ops: &[P2p<'_>], done: &[bool], peer: usize, tag: u64) -> Option<usize> {
    (0..ops.len())
        .find(|i| !done[*i] && matches!(&ops[*i], P2p::Recv { peer: p, tag: t, .. } if (*p == peer || *p == ANY_SOURCE) && *t == tag))
}

/// Receive `i`, if it waits for any rank, now waits for `peer` (the rank
/// whose message it takes); true if it was an any-source receive.
pub fn bind(ops: &mut [P2p<'_>], i: usize, peer: usize) -> bool {
    match &mut ops[i] {
        P2p::Recv { peer: p, .. } if *p == ANY_SOURCE => {
            *p = peer;
            true
        }
        _ => false,
    }
}

/// How [`Inbound::serve_early`] served a receive.
#[derive(Debug, PartialEq, Eq)]
pub enum Early {
    /// The message had come: the receive is done.
    Served,
    /// Only its announcement had (a rendezvous): the receive takes that
    /// message, which follows once the sender is told to go.
    Announced,
    /// Nothing had come.
    Nothing,
}

impl Inbound {
    /// Inbound state for a transport whose messages longer than `limit`
    /// bytes wait for their receive (a rendezvous): a longer data frame
    /// with no receive posted for it is a protocol error, found before
    /// anything is allocated for it, whatever length a peer announces.
    pub fn with_early_limit(limit: usize) -> Inbound {
        Inbound { early_limit: Some(limit), ..Inbound::default() }
    }

    /// This state with `budget` for early messages (see [`EarlyBudget`]).
    pub fn with_budget(self, budget: EarlyBudget) -> Inbound {
        Inbound { budget, ..self }
    }

    /// Whether nothing is kept and no frame is open: the next frame from
    /// this peer is the next message, and a receive it matches is the one
    /// it fills.
    pub fn is_idle(&self) -> bool {
        self.stash.is_empty() && self.frame.is_none()
    }

    /// Bytes held for early messages (as [`EarlyBudget`] counts them).
    pub fn stashed_bytes(&self) -> usize {
        self.stashed
    }

    /// Whether a frame of `len` bytes under `tag` (an announcement: `None`)
    /// must stay where it is for now: no receive of the batch awaits it,
    /// and stashing it would pass the budget, this peer's or, with
    /// `rank_stashed()` bytes already held from all peers, the rank's. The
    /// transport then leaves it unread and asks again when a receive is
    /// posted or the stash has drained; it never holds a peer's first
    /// early message. A transport whose control messages travel in the
    /// same stream must not hold back a peer whose control message this
    /// rank waits for (see cpu-tcp's engine): holding it could deadlock a
    /// correct program.
    pub fn holds_back(
        &self,
        peer: usize,
        tag: u64,
        len: Option<usize>,
        ops: &[P2p<'_>],
        done: &[bool],
        rank_stashed: impl FnOnce() -> usize,
    ) -> bool {
        if self.stashed == 0 || waiting(ops, done, peer, tag).is_some() {
            return false;
        }
        let cost = len.unwrap_or(0) + ENTRY_COST;
        self.stashed + cost > self.budget.per_peer || rank_stashed() + cost > self.budget.per_rank
    }

    /// Set aside an early entry of `cost` payload bytes.
    fn keep(&mut self, tag: u64, entry: Stashed, cost: usize) {
        self.stashed += cost + ENTRY_COST;
        self.stash.entry(tag).or_default().push_back(entry);
    }

    /// A buffer of `len` bytes for a message to stash: a spare one if one
    /// is large enough (its old bytes are overwritten as the message
    /// arrives), else a new one.
    fn stash_buffer(&mut self, len: usize) -> Vec<u8> {
        match self.spare.iter().position(|b| b.capacity() >= len) {
            Some(i) => {
                let mut b = self.spare.swap_remove(i);
                b.resize(len, 0);
                b
            }
            None => vec![0u8; len],
        }
    }

    /// Keep a served message's buffer for the next early message, up to
    /// [`SPARE_BYTES`] in all.
    fn recycle(&mut self, buf: Vec<u8>) {
        let kept: usize = self.spare.iter().map(Vec::capacity).sum();
        if kept + buf.capacity() <= SPARE_BYTES {
            self.spare.push(buf);
        }
    }

    /// Whether a frame is partly read.
    pub fn in_frame(&self) -> bool {
        self.frame.is_some()
    }

    /// Serve a new receive (from `peer` under `tag`) from a message that
    /// came early. A stashed message of another collective at the same
    /// sequence number is a mismatch.
    pub fn serve_early(&mut self, me: usize, peer: usize, tag: u64, buf: &mut [u8]) -> Result<Early> {
        if let Some(other) = self.stash.keys().find(|t| crate::tag::conflicts(**t, tag)).copied() {
            return Err(collective_mismatch(peer, other, tag));
        }
        let msg = self.stash.get_mut(&tag).and_then(VecDeque::pop_front);
        // No empty queues are kept: the stash stays as small as what is pending.
        if self.stash.get(&tag).is_some_and(VecDeque::is_empty) {
            self.stash.remove(&tag);
        }
        self.stashed -= match &msg {
            Some(Stashed::Message(m)) => m.len() + ENTRY_COST,
            Some(Stashed::Announced(_)) => ENTRY_COST,
            None => 0,
        };
        match msg {
            Some(Stashed::Message(msg)) if msg.len() != buf.len() => Err(size_mismatch(peer, me, msg.len(), buf.len(), tag)),
            Some(Stashed::Message(msg)) => {
                crate::kernels::copy(buf, &msg);
                self.recycle(msg);
                Ok(Early::Served)
            }
            Some(Stashed::Announced(len)) if len != buf.len() => Err(size_mismatch(peer, me, len, buf.len(), tag)),
            Some(Stashed::Announced(_)) => Ok(Early::Announced),
            None => Ok(Early::Nothing),
        }
    }

    /// A message of `len` bytes under `tag` is announced, its payload to
    /// follow once the receive is posted (a transport's rendezvous): check
    /// it against the batch's matching receive now (returned: an
    /// any-source one is the transport's to bind and tell the sender), or
    /// against the receive posted later. Sizes and collectives are checked
    /// as for a data frame.
    pub fn announce(&mut self, me: usize, peer: usize, tag: u64, len: usize, ops: &[P2p<'_>], done: &[bool]) -> Result<Option<usize>> {
        let matched = self.matching_receive(me, peer, tag, len, ops, done)?;
        if matched.is_none() {
            self.keep(tag, Stashed::Announced(len), 0);
        }
        Ok(matched)
    }

    /// The batch's receive a frame of `len` bytes under `tag` fills (None:
    /// none yet); a size or collective mismatch is an error.
    fn matching_receive(&self, me: usize, peer: usize, tag: u64, len: usize, ops: &[P2p<'_>], done: &[bool]) -> Result<Option<usize>> {
        if let Some(i) = waiting(ops, done, peer, tag) {
            let want = if let P2p::Recv { buf, .. } = &ops[i] { buf.len() } else { 0 };
            if want != len {
                return Err(size_mismatch(peer, me, len, want, tag));
            }
            return Ok(Some(i));
        }
        let conflict = ops.iter().enumerate().find_map(|(i, op)| match op {
            P2p::Recv { peer: q, tag: t, .. } if !done[i] && *q == peer && crate::tag::conflicts(*t, tag) => Some(*t),
            _ => None,
        });
        match conflict {
            Some(mine) => Err(collective_mismatch(peer, tag, mine)),
            None => Ok(None),
        }
    }

    /// A data frame of `len` bytes under `tag` starts: it fills the
    /// matching receive of the batch (returned, to [`bind`] if it waits for
    /// any rank), or is stashed for a later one.
    pub fn begin(&mut self, me: usize, peer: usize, tag: u64, len: usize, ops: &[P2p<'_>], done: &[bool]) -> Result<Option<usize>> {
        let matched = self.matching_receive(me, peer, tag, len, ops, done)?;
        let dest = match matched {
            Some(i) => Dest::Recv(i),
            None if self.early_limit.is_some_and(|limit| len > limit) => {
                return Err(Error::backend(format!(
                    "peer rank {peer} sent a {len}-byte message ({}) before rank {me} posted its receive, \
                     unannounced (at most {} bytes may come early)",
                    OpKind::describe_tag(tag),
                    self.early_limit.unwrap_or_default()
                )))
            }
            None => {
                self.stashed += len;
                Dest::Stash(self.stash_buffer(len))
            }
        };
        self.frame = Some(Frame { tag, len, got: 0, dest });
        Ok(matched)
    }

    /// A transport control frame of `len` bytes starts (returned by `finish`).
    pub fn begin_control(&mut self, len: usize) {
        self.frame = Some(Frame { tag: 0, len, got: 0, dest: Dest::Control(vec![0u8; len]) });
    }

    /// Where the open frame's next bytes go (empty once it is complete).
    pub fn payload<'b>(&'b mut self, ops: &'b mut [P2p<'_>]) -> &'b mut [u8] {
        let Some(f) = self.frame.as_mut() else { return &mut [] };
        let got = f.got;
        match &mut f.dest {
            Dest::Recv(i) => match &mut ops[*i] {
                P2p::Recv { buf, .. } => &mut buf[got..],
                P2p::Send { .. } => unreachable!("only receives are destinations"),
            },
            Dest::Stash(v) | Dest::Control(v) => &mut v[got..],
        }
    }

    /// The open frame's whole payload length, if a frame is open.
    pub fn frame_len(&self) -> Option<usize> {
        self.frame.as_ref().map(|f| f.len)
    }

    /// Whether the open frame fills a receive posted in this batch (not a
    /// copy set aside for a later one).
    pub fn fills_receive(&self) -> bool {
        matches!(self.frame, Some(Frame { dest: Dest::Recv(_), .. }))
    }

    /// `n` more bytes of the open frame arrived.
    pub fn advance(&mut self, n: usize) {
        if let Some(f) = self.frame.as_mut() {
            f.got += n;
        }
    }

    /// If the open frame is complete, deliver it: mark its receive done, or
    /// hand it to a receive posted while it arrived (bound to `peer` if it
    /// waited for any rank), or stash it. Returns a completed control
    /// frame's payload.
    pub fn finish(&mut self, me: usize, peer: usize, ops: &mut [P2p<'_>], done: &mut [bool]) -> Result<Option<Vec<u8>>> {
        match &self.frame {
            Some(f) if f.got == f.len => {}
            _ => return Ok(None),
        }
        let f = self.frame.take().expect("checked above");
        match f.dest {
            Dest::Recv(i) => done[i] = true,
            Dest::Control(payload) => return Ok(Some(payload)),
            Dest::Stash(msg) => match waiting(ops, done, peer, f.tag) {
                Some(i) => {
                    self.stashed -= msg.len();
                    let P2p::Recv { buf, .. } = &mut ops[i] else { unreachable!("matched a receive") };
                    if buf.len() != msg.len() {
                        return Err(size_mismatch(peer, me, msg.len(), buf.len(), f.tag));
                    }
                    crate::kernels::copy(buf, &msg);
                    self.recycle(msg);
                    done[i] = true;
                    bind(ops, i, peer);
                }
                None => {
                    // (Its payload was counted when the frame began.)
                    self.stashed -= msg.len();
                    let len = msg.len();
                    self.keep(f.tag, Stashed::Message(msg), len);
                }
            },
        }
        Ok(None)
    }

    /// Before a failed batch hands its buffers back: a frame arriving into
    /// one of them continues into a stashed copy instead.
    pub fn detach(&mut self, ops: &[P2p<'_>]) {
        self.detach_where(ops, |_| true)
    }

    /// [`Inbound::detach`] for the receives `which` picks (by index): the
    /// ops of one batch that gives up while others go on.
    pub fn detach_where(&mut self, ops: &[P2p<'_>], which: impl Fn(usize) -> bool) {
        if let Some(f) = &mut self.frame {
            if let Dest::Recv(i) = f.dest {
                if !which(i) {
                    return;
                }
                if let P2p::Recv { buf, .. } = &ops[i] {
                    let mut copy = vec![0u8; f.len];
                    copy[..f.got].copy_from_slice(&buf[..f.got]);
                    f.dest = Dest::Stash(copy);
                    self.stashed += f.len;
                }
            }
        }
    }

    /// The receives moved: `map[old]` is each kept receive's new index
    /// (see [`crate::backend::progress::Table::compact`]).
    pub fn remap(&mut self, map: &[usize]) {
        if let Some(Frame { dest: Dest::Recv(i), .. }) = &mut self.frame {
            *i = map[*i];
        }
    }

    /// The index of the receive the open frame fills, if any.
    pub fn filling(&self) -> Option<usize> {
        match self.frame {
            Some(Frame { dest: Dest::Recv(i), .. }) => Some(i),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn early_late_and_mismatched_frames() {
        let mut inb = Inbound::default();
        // A frame with no receive posted is stashed, then serves one.
        inb.begin(0, 1, 5, 2, &[], &[]).unwrap();
        let mut none: Vec<P2p<'_>> = vec![];
        inb.payload(&mut none).copy_from_slice(b"hi");
        inb.advance(2);
        assert_eq!(inb.finish(0, 1, &mut none, &mut []).unwrap(), None);
        let mut b = [0u8; 2];
        assert_eq!(inb.serve_early(0, 1, 5, &mut b).unwrap(), Early::Served);
        assert_eq!(&b, b"hi");
        // Nothing is kept for a served tag (tags are per collective: a map
        // of empty queues would grow with every op).
        assert!(inb.stash.is_empty());
        // A frame that began early goes to a receive posted meanwhile.
        inb.begin(0, 1, 6, 1, &[], &[]).unwrap();
        let mut buf = [0u8; 1];
        let mut ops = vec![P2p::Recv { peer: 1, tag: 6, buf: &mut buf }];
        let mut done = vec![false];
        inb.payload(&mut ops)[0] = 9;
        inb.advance(1);
        inb.finish(0, 1, &mut ops, &mut done).unwrap();
        assert!(done[0]);
        // Size and collective mismatches.
        let mut small = [0u8; 1];
        let ops = vec![P2p::Recv { peer: 1, tag: 7, buf: &mut small }];
        assert!(inb.begin(0, 1, 7, 4, &ops, &[false]).unwrap_err().to_string().contains("sent 4 bytes"));
        let a = crate::tag::collective(OpKind::AllReduce as u8, 3, 0, 0);
        let g = crate::tag::collective(OpKind::AllGather as u8, 3, 0, 0);
        let mut r = [0u8; 1];
        let ops = vec![P2p::Recv { peer: 1, tag: g, buf: &mut r }];
        assert!(inb.begin(0, 1, a, 1, &ops, &[false]).unwrap_err().to_string().contains("collective mismatch"));
    }

    #[test]
    fn served_stash_buffers_are_reused_up_to_a_bound() {
        let mut inb = Inbound::default();
        let first = stash(&mut inb, 5, 1000, 1);
        let mut got = vec![0u8; 1000];
        assert_eq!(inb.serve_early(0, 1, 5, &mut got).unwrap(), Early::Served);
        assert!(got.iter().all(|b| *b == 1));
        assert_eq!(inb.spare.iter().map(|b| b.as_ptr()).collect::<Vec<_>>(), [first]);
        // A smaller message comes into the same memory, whole and only its own.
        assert_eq!(stash(&mut inb, 6, 600, 2), first);
        assert!(inb.spare.is_empty());
        let mut got = vec![0u8; 600];
        assert_eq!(inb.serve_early(0, 1, 6, &mut got).unwrap(), Early::Served);
        assert!(got.iter().all(|b| *b == 2));
        // A larger one than any kept gets new memory; one larger than the
        // bound is not kept.
        let big = stash(&mut inb, 7, SPARE_BYTES + 1, 3);
        assert_ne!(big, first);
        let mut got = vec![0u8; SPARE_BYTES + 1];
        inb.serve_early(0, 1, 7, &mut got).unwrap();
        assert!(inb.spare.iter().map(Vec::capacity).sum::<usize>() <= SPARE_BYTES);
        assert!(inb.spare.iter().all(|b| b.capacity() < SPARE_BYTES + 1));
    }

    #[test]
    fn a_receive_from_any_rank_takes_the_first_message_and_is_bound_to_its_sender() {
        let mut inb = Inbound::default();
        let mut buf = [0u8; 2];
        let mut ops = vec![P2p::Recv { peer: ANY_SOURCE, tag: 5, buf: &mut buf }];
        let mut done = vec![false];
        assert_eq!(inb.begin(0, 3, 5, 2, &ops, &done).unwrap(), Some(0));
        assert!(bind(&mut ops, 0, 3));
        assert_eq!(ops[0].peer(), 3);
        inb.payload(&mut ops).copy_from_slice(b"ok");
        inb.advance(2);
        inb.finish(0, 3, &mut ops, &mut done).unwrap();
        assert!(done[0]);
        // Bound once: a later sender does not rebind it.
        assert!(!bind(&mut ops, 0, 4));
        // A stashed message binds the receive it is handed to.
        let mut other = [0u8; 1];
        let mut ops = vec![P2p::Recv { peer: ANY_SOURCE, tag: 6, buf: &mut other }];
        let mut done = vec![false];
        inb.begin(0, 2, 6, 1, &[], &[]).unwrap();
        inb.payload(&mut []).copy_from_slice(b"x");
        inb.advance(1);
        inb.finish(0, 2, &mut ops, &mut done).unwrap();
        assert!(done[0] && ops[0].peer() == 2);
    }

    #[test]
    fn announcements_are_checked_now_or_when_the_receive_is_posted() {
        let mut inb = Inbound::default();
        let mut b4 = [0u8; 4];
        // Announced before the receive: kept, checked at posting, not served.
        inb.announce(0, 1, 5, 4, &[], &[]).unwrap();
        assert_eq!(inb.serve_early(0, 1, 5, &mut b4).unwrap(), Early::Announced);
        assert!(inb.stash.is_empty());
        inb.announce(0, 1, 6, 8, &[], &[]).unwrap();
        assert!(inb.serve_early(0, 1, 6, &mut b4).unwrap_err().to_string().contains("sent 8 bytes, rank 0 expected 4"));
        // Announced while the receive is posted: checked at once, nothing kept.
        let ops = vec![P2p::Recv { peer: 1, tag: 7, buf: &mut b4 }];
        inb.announce(0, 1, 7, 4, &ops, &[false]).unwrap();
        assert!(inb.announce(0, 1, 7, 3, &ops, &[false]).unwrap_err().to_string().contains("sent 3 bytes"));
        assert!(inb.stash.is_empty());
        // Another collective at the same sequence number.
        let a = crate::tag::collective(OpKind::AllReduce as u8, 3, 0, 0);
        let g = crate::tag::collective(OpKind::AllGather as u8, 3, 0, 0);
        let ops = vec![P2p::Recv { peer: 1, tag: g, buf: &mut b4 }];
        assert!(inb.announce(0, 1, a, 4, &ops, &[false]).unwrap_err().to_string().contains("collective mismatch"));
        inb.announce(0, 1, a, 4, &[], &[]).unwrap();
        assert!(inb.serve_early(0, 1, g, &mut b4).unwrap_err().to_string().contains("collective mismatch"));
    }

    /// One early frame of `len` bytes of `fill` under `tag` from peer 1,
    /// stashed; where its buffer is.
    fn stash(inb: &mut Inbound, tag: u64, len: usize, fill: u8) -> *const u8 {
        inb.begin(0, 1, tag, len, &[], &[]).unwrap();
        let dst = inb.payload(&mut []);
        dst.fill(fill);
        let at = dst.as_ptr();
        inb.advance(len);
        assert_eq!(inb.finish(0, 1, &mut [], &mut []).unwrap(), None);
        at
    }

    #[test]
    fn early_messages_are_held_back_beyond_the_budget_but_never_the_first_or_an_awaited_one() {
        let budget = EarlyBudget { per_peer: 1000, per_rank: 1500 };
        let mut inb = Inbound::default().with_budget(budget);
        // The first early message of any size is taken.
        assert!(!inb.holds_back(1, 5, Some(5000), &[], &[], || 0));
        stash(&mut inb, 5, 600, 0);
        assert_eq!(inb.stashed_bytes(), 600 + ENTRY_COST);
        // Past this peer's budget, or the rank's: held back.
        assert!(inb.holds_back(1, 6, Some(400), &[], &[], || inb.stashed_bytes()));
        assert!(!inb.holds_back(1, 6, Some(100), &[], &[], || inb.stashed_bytes()));
        assert!(inb.holds_back(1, 6, Some(100), &[], &[], || 1450));
        // Announcements count too.
        assert!(!inb.holds_back(1, 6, None, &[], &[], || inb.stashed_bytes()));
        // A frame a posted receive awaits is never held back.
        let mut buf = [0u8; 400];
        let ops = vec![P2p::Recv { peer: 1, tag: 6, buf: &mut buf }];
        assert!(!inb.holds_back(1, 6, Some(400), &ops, &[false], || inb.stashed_bytes()));
        // Served: the stash is empty again, and so is its count.
        let mut out = [0u8; 600];
        assert_eq!(inb.serve_early(0, 1, 5, &mut out).unwrap(), Early::Served);
        assert_eq!(inb.stashed_bytes(), 0);
        // An announcement, then a frame that went to a receive posted
        // while it arrived: nothing stays counted.
        inb.announce(0, 1, 7, 10, &[], &[]).unwrap();
        inb.begin(0, 1, 8, 3, &[], &[]).unwrap();
        let mut three = [0u8; 3];
        let mut ops = vec![P2p::Recv { peer: 1, tag: 8, buf: &mut three }];
        let mut done = vec![false];
        inb.advance(3);
        inb.finish(0, 1, &mut ops, &mut done).unwrap();
        assert!(done[0]);
        let mut ten = [0u8; 10];
        assert_eq!(inb.serve_early(0, 1, 7, &mut ten).unwrap(), Early::Announced);
        assert_eq!(inb.stashed_bytes(), 0);
    }

    #[test]
    fn the_budget_comes_from_weft_early_bytes() {
        assert_eq!(EarlyBudget::new(1 << 20), EarlyBudget { per_peer: 1 << 18, per_rank: 1 << 20 });
        assert_eq!(EarlyBudget::default().per_rank, DEFAULT_EARLY_BYTES);
    }
}
