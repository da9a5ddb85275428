//! The cpu-tcp protocol without I/O: frames, the Announce/Ready
//! rendezvous of long messages, control frames between data frames, early
//! messages and their budget, and what a stalled or departed peer means
//! for every posted op. Bytes go through a [`Wire`] (non-blocking sends and
//! receives), time comes in as an argument: `engine.rs` drives it over
//! sockets, and `sim.rs` drives two of them against each other through a
//! simulated connection that cuts, stalls and splits the bytes.
//!
//! Long messages go by rendezvous (see `wire.rs`): their data is written
//! only into a receive the peer has posted; a send waiting for that never
//! holds up another send to the same peer with another tag.

use crate::wire::{lead_for, Header, Kind, EAGER_LIMIT, HEADER, MAX_ABORT, MAX_LEAD};
use smallvec::{smallvec, SmallVec};
use std::collections::HashMap;
use std::io::IoSlice;
use std::time::Instant;
use weft::backend::matching::{self, Early, EarlyBudget, Inbound};
use weft::backend::progress::{Columns, Post, Posting, Table, View};
use weft::backend::{Deadline, OpKind, P2p, ANY_SOURCE};
use weft::{Error, Result};

/// One connection's state.
pub struct Peer {
    hdr: [u8; HEADER],
    hdr_got: usize,
    /// Bytes of the current data frame's lead padding still to skip.
    lead: usize,
    inbound: Inbound,
    /// The peer said goodbye (or its stream ended cleanly after one).
    pub left: bool,
    /// A send stopped mid-frame: nothing more may be written.
    pub torn: bool,
    /// The peer shut its side or the connection broke (seen while its
    /// frames were held back): they are read to the end from then on.
    hung_up: bool,
    /// Rendezvous control frames (whole headers) not yet written, and how
    /// many of their bytes are.
    ctl: Vec<u8>,
    ctl_sent: usize,
    /// Ready frames received per tag and not yet used by a send.
    ready: HashMap<u64, usize>,
}

/// Most Ready frames kept for sends not yet posted: a correct peer sends
/// one per long send this rank announced.
const MAX_READY: usize = 1 << 16;

impl Peer {
    /// A connection whose early messages are kept within `budget`.
    fn new(budget: EarlyBudget) -> Peer {
        Peer {
            hdr: [0; HEADER],
            hdr_got: 0,
            lead: 0,
            inbound: Inbound::with_early_limit(EAGER_LIMIT).with_budget(budget),
            left: false,
            torn: false,
            hung_up: false,
            ctl: Vec::new(),
            ctl_sent: 0,
            ready: HashMap::new(),
        }
    }

    fn queue_control(&mut self, kind: Kind, tag: u64, len: usize) {
        self.ctl.extend_from_slice(&Header { kind, tag, len: len as u64, lead: 0 }.encode());
    }

    /// Write queued control frames as far as the connection takes them;
    /// true if any byte moved.
    fn flush_control(&mut self, peer: usize, wire: &mut impl Wire) -> Result<bool> {
        if self.ctl.is_empty() {
            return Ok(false);
        }
        let n = wire.send(peer, &[IoSlice::new(&self.ctl[self.ctl_sent..])])?;
        self.ctl_sent += n;
        if self.ctl_sent == self.ctl.len() {
            self.ctl.clear();
            self.ctl_sent = 0;
        }
        Ok(n > 0)
    }

    /// The connection hung up (seen by the driver's poll()): frames held
    /// back are read to the end from now on.
    pub fn hang_up(&mut self) {
        self.hung_up = true;
    }

    /// A whole frame header is read but its frame waits in the socket:
    /// stashing it would pass the budget for early messages.
    pub fn holds(&self) -> bool {
        self.hdr_got == HEADER
    }

    /// Use one Ready of `tag`, if the peer has sent one.
    fn take_ready(&mut self, tag: u64) -> bool {
        match self.ready.get_mut(&tag) {
            Some(n) => {
                *n -= 1;
                if *n == 0 {
                    self.ready.remove(&tag);
                }
                true
            }
            None => false,
        }
    }
}

/// How a read attempt ended.
pub enum Got {
    /// This many bytes came.
    Bytes(usize),
    /// Nothing now (the read would block).
    Nothing,
    /// The stream ended.
    Eof,
}

/// Where the protocol's bytes go and come from, without blocking: the
/// sockets (`engine::Sockets`), or an in-memory pair in the simulation
/// tests (`sim.rs`).
pub trait Wire {
    /// Write what `peer`'s connection takes now (`parts` in order); the
    /// bytes written (0: full for now). A broken connection is `PeerLost`.
    fn send(&mut self, peer: usize, parts: &[IoSlice<'_>]) -> Result<usize>;
    /// Read what `peer` has sent into `buf` (not empty), as far as it came.
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<Got>;
}

/// Write as much of a frame (header, `lead` bytes of padding, then the
/// payload, from offset `sent`) as the connection takes now; the new offset.
pub fn write_frame(wire: &mut impl Wire, peer: usize, hdr: &[u8; HEADER], lead: usize, data: &[u8], sent: usize) -> Result<usize> {
    static PADDING: [u8; MAX_LEAD] = [0; MAX_LEAD];
    let head = HEADER + lead;
    let parts = if sent < HEADER {
        [IoSlice::new(&hdr[sent..]), IoSlice::new(&PADDING[..lead]), IoSlice::new(data)]
    } else if sent < head {
        [IoSlice::new(&PADDING[sent - HEADER..lead]), IoSlice::new(data), IoSlice::new(&[])]
    } else {
        [IoSlice::new(&data[sent - head..]), IoSlice::new(&[]), IoSlice::new(&[])]
    };
    Ok(sent + wire.send(peer, &parts)?)
}

/// What the protocol needs from its owner.
pub trait Watch {
    /// An error that ends every posted op now (abort, group failure).
    fn stop(&self) -> Option<Error>;
    /// What a failure of the connections becomes (the root cause, and the
    /// transport marked failed where it cannot be used again).
    fn failed(&self, e: Error) -> Error;
}

/// The protocol's state for one posted op.
pub struct OpState {
    /// Bytes of a send written (header and lead included).
    sent: usize,
    /// A long send waits for the receiver's Ready.
    awaits_ready: bool,
    /// A long send has announced itself. Only once every earlier send of
    /// its tag to its peer is out: the receiver checks an announcement
    /// against the receive that message will fill.
    announced: bool,
    /// A send's frame header.
    header: [u8; HEADER],
    /// A send's lead padding (see `wire::lead_for`).
    lead: usize,
}

impl OpState {
    /// Whether all of a send of `len` bytes is written.
    fn written(&self, len: usize) -> bool {
        self.sent == HEADER + self.lead + len
    }
    /// Whether a send of `len` bytes is part written: its stream cannot
    /// carry another frame until the rest follows.
    fn mid_frame(&self, len: usize) -> bool {
        self.sent > 0 && !self.written(len)
    }
}

/// Every connection's protocol state and every posted op.
pub struct Protocol {
    /// `peers[r]`: the connection to rank r (`None`: no connection).
    pub peers: Vec<Option<Peer>>,
    /// The posted ops.
    pub table: Table<OpState>,
}

impl Protocol {
    /// The protocol over connections to the ranks `connected` marks; early
    /// messages are kept within `budget`.
    pub fn new(connected: impl IntoIterator<Item = bool>, budget: EarlyBudget) -> Protocol {
        let peers = connected.into_iter().map(|c| c.then(|| Peer::new(budget))).collect();
        Protocol { peers, table: Table::default() }
    }

    /// Why a batch over `peers` cannot run: a peer without a connection
    /// (the batch alone fails), or a broken stream (the transport has).
    fn refuse<'o>(&self, me: usize, mut peers: impl Iterator<Item = &'o P2p<'o>>, watch: &dyn Watch) -> Option<Error> {
        peers.find_map(|op| match self.peers.get(op.peer()) {
            None if matches!(op, P2p::Recv { peer: ANY_SOURCE, .. }) => None,
            Some(Some(p)) if p.torn => Some(watch.failed(Error::backend(format!("the stream to peer rank {} is broken", op.peer())))),
            Some(Some(_)) => None,
            _ => Some(Error::invalid(format!("cpu-tcp: rank {me} has no connection to peer rank {}", op.peer()))),
        })
    }

    /// The state of a new op.
    fn state_of(op: &P2p<'_>) -> OpState {
        match op {
            P2p::Send { tag, data, .. } => {
                let lead = lead_for(data.as_ptr() as usize, data.len());
                OpState {
                    sent: 0,
                    awaits_ready: data.len() > EAGER_LIMIT,
                    announced: false,
                    header: Header { kind: Kind::Data, tag: *tag, len: data.len() as u64, lead }.encode(),
                    lead,
                }
            }
            P2p::Recv { .. } => OpState { sent: 0, awaits_ready: false, announced: false, header: [0; HEADER], lead: 0 },
        }
    }

    /// Take a posted batch into the table (see `start`). A batch naming a
    /// peer without a connection fails alone.
    fn absorb(&mut self, me: usize, post: Post, watch: &dyn Watch, posting: &Posting) -> Result<()> {
        if let Some(e) = self.refuse(me, post.ops().iter(), watch) {
            post.fail(e);
            posting.notify();
            return Ok(());
        }
        let first = self.table.len();
        self.table.add(post, |op, _| Self::state_of(op));
        self.start(me, first)
    }

    /// The ops from `first` on are new: receives are served by messages
    /// that came early, and a long receive tells its sender it is ready (a
    /// long send announces itself when its turn comes, in `pass`).
    fn start(&mut self, me: usize, first: usize) -> Result<()> {
        // SAFETY: receives are filled and bound here; no op is put in.
        let Columns { ops, done, .. } = unsafe { self.table.columns() };
        for (i, op) in ops.iter_mut().enumerate().skip(first) {
            let P2p::Recv { peer, tag, buf } = op else { continue };
            if *peer == ANY_SOURCE {
                // The first peer with something for this tag; else the
                // first message or announcement that comes (`drain`).
                for (q, p) in self.peers.iter_mut().enumerate() {
                    let Some(p) = p else { continue };
                    match p.inbound.serve_early(me, q, *tag, buf)? {
                        Early::Served => done[i] = true,
                        Early::Announced => p.queue_control(Kind::Ready, *tag, buf.len()),
                        Early::Nothing => continue,
                    }
                    *peer = q;
                    break;
                }
                continue;
            }
            let p = self.peers[*peer].as_mut().expect("checked by refuse");
            match p.inbound.serve_early(me, *peer, *tag, buf)? {
                Early::Served => done[i] = true,
                _ if p.left => {
                    return Err(Error::peer_left(*peer));
                }
                _ if buf.len() > EAGER_LIMIT => p.queue_control(Kind::Ready, *tag, buf.len()),
                _ => {}
            }
        }
        Ok(())
    }

    /// Let go of the buffers of the ops `which` picks: a frame arriving
    /// into one of their receives continues into a stashed copy, and a
    /// stream with half a send of theirs on the wire is torn.
    fn release(&mut self, which: impl Fn(usize) -> bool) {
        let View { ops, state, done, .. } = self.table.view();
        for p in self.peers.iter_mut().flatten() {
            p.inbound.detach_where(ops, &which);
        }
        for (i, op) in ops.iter().enumerate() {
            if let P2p::Send { peer, data, .. } = op {
                if which(i) && !done[i] && state[i].mid_frame(data.len()) {
                    if let Some(p) = self.peers[*peer].as_mut() {
                        p.torn = true;
                    }
                }
            }
        }
    }

    /// Everything fails with `e`: posted ops and those still to be taken.
    pub fn fail_all(&mut self, e: &Error, posting: &Posting) {
        self.release(|_| true);
        // Half a control frame on the wire: that stream cannot be used
        // again. Control frames not yet written go with the ops.
        for p in self.peers.iter_mut().flatten() {
            p.torn |= p.ctl_sent % HEADER != 0;
            p.ctl.clear();
            p.ctl_sent = 0;
        }
        self.table.fail_all(e);
        posting.fail_new(e);
        posting.notify();
    }

    /// Fail the batches with a receive from a peer that has left (cleanly:
    /// its stream is sound, so only what waits for it fails; core decides
    /// what that means for the group).
    fn fail_departed(&mut self, posting: &Posting) {
        let departed = |peers: &[Option<Peer>], op: &P2p<'_>| match op {
            P2p::Recv { peer, .. } if *peer != ANY_SOURCE => {
                peers[*peer].as_ref().is_some_and(|p| p.left && !p.inbound.in_frame()).then_some(*peer)
            }
            _ => None,
        };
        while let Some((i, peer)) = (0..self.table.len())
            .find_map(|i| (!self.table.done[i]).then(|| departed(&self.peers, &self.table.ops()[i])).flatten().map(|p| (i, p)))
        {
            let id = self.table.batch(i);
            let pending = self.table.pending_of(id);
            self.release(|j| pending.contains(&j));
            self.table.withdraw(id, Error::peer_left(peer));
            posting.notify();
        }
    }

    /// Take the driving thread's own batch `ops`, after the batches posted
    /// before it: true if it is in the table (drive until `table.local_done`,
    /// then `table.take_local`), false if it has failed already
    /// (`take_local` has the error). Refused outright (a peer without a
    /// connection or with a broken stream): the error, and nothing taken.
    ///
    /// # Safety
    /// `ops`' buffers and `deadline` stay valid until `table.take_local`
    /// has returned the batch's outcome (the ops leave the table with it).
    pub unsafe fn add_local(
        &mut self,
        me: usize,
        ops: &mut [P2p<'_>],
        deadline: &Deadline,
        posting: &Posting,
        watch: &dyn Watch,
    ) -> Result<bool> {
        if let Err(e) = posting.take(|post| self.absorb(me, post, watch, posting)) {
            let e = watch.failed(e);
            self.fail_all(&e, posting);
            return Err(e);
        }
        if let Some(e) = self.refuse(me, ops.iter(), watch) {
            return Err(e);
        }
        let first = self.table.len();
        // SAFETY: the caller's promise.
        unsafe { self.table.add_local(ops, &[], deadline, |op, _| Self::state_of(op)) };
        if let Err(e) = self.start(me, first) {
            let e = watch.failed(e);
            self.fail_all(&e, posting);
            return Ok(false);
        }
        Ok(true)
    }

    /// One turn, the clock aside: take the batches posted since the last,
    /// move what the wire takes now (`eager`: read frames no receive
    /// awaits yet too), and report what finished or what a departed peer
    /// failed. True if a batch came or a byte moved. An error has failed
    /// every op (as `watch` makes it) and ends the driver's loop.
    pub fn step(
        &mut self,
        me: usize,
        wire: &mut impl Wire,
        flags: &mut Flags,
        eager: bool,
        posting: &Posting,
        watch: &dyn Watch,
    ) -> Result<bool> {
        let moved =
            posting.take(|post| self.absorb(me, post, watch, posting)).and_then(|took| Ok(pass(me, self, wire, flags, eager)? | took));
        let moved = moved.map_err(|e| {
            let e = watch.failed(e);
            self.fail_all(&e, posting);
            e
        })?;
        // (Also after no byte moved: a receive served early finishes its
        // batch at once.)
        self.settle(posting);
        self.fail_departed(posting);
        Ok(moved)
    }

    /// Fail the batches past their deadline at `now` (see `expire`); an
    /// error (a stream left torn) has failed every op, as in `step`.
    pub fn expire_at(&mut self, now: Instant, posting: &Posting, watch: &dyn Watch) -> Result<()> {
        match self.expire(now, posting) {
            None => Ok(()),
            Some(e) => {
                let e = watch.failed(e);
                self.fail_all(&e, posting);
                Err(e)
            }
        }
    }

    /// Fail batches whose deadline has passed, naming what each still waits
    /// for; their ops leave the table.
    ///
    /// A batch that gives up with half a frame on the wire leaves that
    /// stream unusable: then the error that fails every other op.
    fn expire(&mut self, now: Instant, posting: &Posting) -> Option<Error> {
        // (Usually none has expired: nothing to do.)
        self.table.expired(now)?;
        let mut torn = None;
        while let Some(id) = self.table.expired(now) {
            let pending = self.table.pending_of(id);
            let View { ops, state, .. } = self.table.view();
            torn = torn.or_else(|| {
                pending.iter().find_map(|&i| match &ops[i] {
                    P2p::Send { peer, data, .. } if state[i].mid_frame(data.len()) => Some(*peer),
                    _ => None,
                })
            });
            let what: Vec<String> = pending
                .iter()
                .map(|&i| match &ops[i] {
                    P2p::Send { peer, tag, data } if state[i].awaits_ready => format!(
                        "peer rank {peer} never posted the receive for {} ({} bytes to send)",
                        OpKind::describe_tag(*tag),
                        data.len()
                    ),
                    P2p::Send { peer, tag, .. } => format!("sending to peer rank {peer} ({})", OpKind::describe_tag(*tag)),
                    P2p::Recv { peer: ANY_SOURCE, tag, buf } => {
                        format!("no message from any rank for {} ({} bytes expected)", OpKind::describe_tag(*tag), buf.len())
                    }
                    P2p::Recv { peer, tag, buf } => format!(
                        "no message from peer rank {peer} for {} ({} bytes expected){}",
                        OpKind::describe_tag(*tag),
                        buf.len(),
                        if self.peers[*peer].as_ref().is_some_and(Peer::holds) { matching::HELD_BACK } else { "" }
                    ),
                })
                .collect();
            let stalled = weft::backend::first_named_peer(ops, &pending);
            self.release(|i| pending.contains(&i));
            self.table.withdraw(id, Error::timeout(format!("{} before the deadline", what.join("; "))).stalled_on(stalled));
            posting.notify();
        }
        self.settle(posting);
        torn.map(|peer| Error::backend(format!("the stream to peer rank {peer} is broken: a send timed out half written")))
    }

    /// Finished batches report (and threads waiting for them wake);
    /// finished ops leave the table.
    fn settle(&mut self, posting: &Posting) {
        if self.table.is_idle() {
            return;
        }
        if self.table.settle() {
            posting.notify();
        }
        if let Some(map) = self.table.compact() {
            for p in self.peers.iter_mut().flatten() {
                p.inbound.remap(&map);
            }
        }
    }
}

/// Per peer, from the last pass: something waits to be written (watch
/// for POLLOUT); a send waits for the peer's Ready (read it).
pub struct Flags {
    /// Something waits to be written to the peer.
    pub busy: SmallVec<[bool; 8]>,
    /// A send waits for the peer's Ready.
    pub hear: SmallVec<[bool; 8]>,
}

impl Flags {
    /// Flags for `w` peers.
    pub fn new(w: usize) -> Flags {
        Flags { busy: smallvec![false; w], hear: smallvec![false; w] }
    }
}

/// One turn over every posted op: sends go out as far as the connections
/// take them, then receives read what has come. True if any byte moved.
fn pass(me: usize, proto: &mut Protocol, wire: &mut impl Wire, flags: &mut Flags, eager: bool) -> Result<bool> {
    let w = proto.peers.len();
    let mut moved = false;
    let Protocol { peers, table } = proto;
    // SAFETY: sends are written and receives filled and bound; no op is put in.
    let Columns { ops, done, state, .. } = unsafe { table.columns() };
    // Per peer: the send with half a frame on the wire (it must finish
    // before any other frame), and whether this pass wrote all it could.
    let mut mid: SmallVec<[Option<usize>; 8]> = smallvec![None; w];
    for (i, op) in ops.iter().enumerate() {
        if let P2p::Send { peer, .. } = op {
            if !done[i] && state[i].sent > 0 {
                mid[*peer] = Some(i);
            }
        }
    }
    flags.busy.fill(false);
    flags.hear.fill(false);
    let mut stopped: SmallVec<[bool; 8]> = smallvec![false; w];
    // Tags of unfinished sends this pass passes over (waiting for Ready, or
    // behind another frame), per peer: a later send of the same tag must
    // not overtake them (the receiver matches in stream order).
    let mut held: SmallVec<[(usize, u64); 8]> = SmallVec::new();
    for (peer, p) in peers.iter_mut().enumerate() {
        let Some(p) = p else { continue };
        // Control frames go between data frames.
        if mid[peer].is_none() {
            moved |= p.flush_control(peer, wire)?;
            flags.busy[peer] = !p.ctl.is_empty();
        }
    }
    for i in 0..ops.len() {
        let P2p::Send { peer, tag, data } = &ops[i] else { continue };
        let (peer, tag) = (*peer, *tag);
        if done[i] {
            continue;
        }
        if stopped[peer] || mid[peer].is_some_and(|m| m != i) || held.contains(&(peer, tag)) {
            held.push((peer, tag));
            continue;
        }
        let p = peers[peer].as_mut().expect("validated peers are connected");
        if p.left {
            return Err(Error::peer_left(peer));
        }
        let st = &mut state[i];
        if st.awaits_ready && !st.announced {
            // First of its tag to this peer still unfinished, at a frame
            // boundary: announce it now.
            p.queue_control(Kind::Announce, tag, data.len());
            st.announced = true;
            moved |= p.flush_control(peer, wire)?;
        }
        if st.awaits_ready && p.take_ready(tag) {
            st.awaits_ready = false;
        }
        if st.awaits_ready {
            // Later sends to this peer go ahead of it (another tag's Ready
            // may come first): only a frame begun blocks the stream.
            held.push((peer, tag));
            flags.hear[peer] = true;
            continue;
        }
        if st.sent == 0 && !p.ctl.is_empty() {
            stopped[peer] = true;
            held.push((peer, tag));
            continue;
        }
        let before = st.sent;
        st.sent = write_frame(wire, peer, &st.header, st.lead, data, st.sent)?;
        moved |= st.sent != before;
        if !st.written(data.len()) {
            stopped[peer] = true;
            flags.busy[peer] = true;
            held.push((peer, tag));
            continue;
        }
        done[i] = true;
        mid[peer] = None;
    }
    // Receives: from the peers a receive awaits, only as far as needed,
    // until stalled (see EAGER_AFTER).
    for peer in 0..w {
        if peers[peer].is_some() {
            moved |= drain(me, peer, peers, wire, ops, done, eager || flags.hear[peer], flags.hear[peer])?;
        }
    }
    Ok(moved)
}

/// Whether a receive of `ops` still waits for `peer`.
pub fn awaited(ops: &[P2p<'_>], done: &[bool], peer: usize) -> bool {
    ops.iter().zip(done).any(|(op, d)| !d && matches!(op, P2p::Recv { peer: q, .. } if *q == peer || *q == ANY_SOURCE))
}

/// The error for a connection that ended inside a frame.
fn torn_off(peer: usize) -> Error {
    Error::peer_lost(peer, format!("connection to peer rank {peer} closed in the middle of a frame"))
}

/// Read the next bytes of a frame begun from `peer` into `buf` (not
/// empty): how many came (`None`: none yet); the stream ending here is
/// an error.
fn read_within_frame(wire: &mut impl Wire, peer: usize, buf: &mut [u8]) -> Result<Option<usize>> {
    match wire.recv(peer, buf)? {
        Got::Nothing => Ok(None),
        Got::Eof => Err(torn_off(peer)),
        Got::Bytes(k) => Ok(Some(k)),
    }
}

/// Read what `peer` has sent; true if any byte moved. Unless `eager`, stop
/// at a frame boundary once no receive of `ops` awaits this peer: a frame
/// left in the socket costs nothing, one read early is copied twice.
///
/// `urgent`: a send waits for this peer's Ready, so its frames are read
/// past the budget for early messages (the Ready may stand behind them).
#[allow(clippy::too_many_arguments)]
fn drain(
    me: usize,
    peer: usize,
    peers: &mut [Option<Peer>],
    wire: &mut impl Wire,
    ops: &mut [P2p<'_>],
    done: &mut [bool],
    eager: bool,
    urgent: bool,
) -> Result<bool> {
    let mut moved = false;
    loop {
        let mut p = peers[peer].as_mut().expect("connected");
        if !p.inbound.in_frame() {
            if p.left {
                return Ok(moved);
            }
            if !eager && p.hdr_got == 0 && !awaited(ops, done, peer) {
                return Ok(moved);
            }
            if !p.holds() {
                match wire.recv(peer, &mut p.hdr[p.hdr_got..])? {
                    Got::Nothing => return Ok(moved),
                    Got::Eof if p.hdr_got == 0 => {
                        return Err(Error::peer_lost(
                            peer,
                            format!(
                                "connection to peer rank {peer} closed without a goodbye: the process exited, crashed or aborted its group"
                            ),
                        ))
                    }
                    Got::Eof => return Err(torn_off(peer)),
                    Got::Bytes(k) => p.hdr_got += k,
                }
                moved = true;
                if p.hdr_got < HEADER {
                    continue;
                }
            }
            let h = Header::decode(&p.hdr, peer)?;
            if matches!(h.kind, Kind::Data | Kind::Announce) {
                let len = (h.kind == Kind::Data).then_some(h.len as usize);
                let rank_stashed = || peers.iter().flatten().map(|q| q.inbound.stashed_bytes()).sum();
                let q = peers[peer].as_ref().expect("connected");
                // Never while a send waits for this peer's Ready, or once it
                // has hung up: what stands behind the frame (a Ready, an
                // abort report, the end of the stream) must be read.
                if !urgent && !q.hung_up && q.inbound.holds_back(peer, h.tag, len, ops, done, rank_stashed) {
                    // Left in the socket (header read) until there is room.
                    return Ok(moved);
                }
                p = peers[peer].as_mut().expect("connected");
            }
            p.hdr_got = 0;
            match h.kind {
                Kind::Goodbye => {
                    p.left = true;
                    return Ok(true);
                }
                Kind::Abort => p.inbound.begin_control((h.len as usize).min(MAX_ABORT as usize)),
                Kind::Data => {
                    if let Some(i) = p.inbound.begin(me, peer, h.tag, h.len as usize, ops, done)? {
                        matching::bind(ops, i, peer);
                    }
                    p.lead = h.lead;
                }
                Kind::Announce => {
                    // A receive from any rank takes this message: tell
                    // this sender to go.
                    if let Some(i) = p.inbound.announce(me, peer, h.tag, h.len as usize, ops, done)? {
                        if matching::bind(ops, i, peer) {
                            p.queue_control(Kind::Ready, h.tag, h.len as usize);
                        }
                    }
                    continue;
                }
                Kind::Ready if p.ready.len() >= MAX_READY && !p.ready.contains_key(&h.tag) => {
                    return Err(Error::backend(format!("peer rank {peer} sent more than {MAX_READY} unrequested Ready frames")));
                }
                Kind::Ready => {
                    *p.ready.entry(h.tag).or_default() += 1;
                    continue;
                }
            }
        }
        if p.lead > 0 {
            let Some(k) = read_within_frame(wire, peer, &mut [0u8; MAX_LEAD][..p.lead])? else { return Ok(moved) };
            p.lead -= k;
            moved = true;
            continue;
        }
        let dst = p.inbound.payload(ops);
        if !dst.is_empty() {
            let Some(k) = read_within_frame(wire, peer, dst)? else { return Ok(moved) };
            p.inbound.advance(k);
            moved = true;
        }
        if let Some(payload) = p.inbound.finish(me, peer, ops, done)? {
            // An abort report: the rank to blame, then why.
            let blame = payload.get(..4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize).unwrap_or(peer);
            let why = String::from_utf8_lossy(payload.get(4..).unwrap_or_default()).into_owned();
            return Err(if blame == me {
                // It gave up waiting for this rank (or reports our own
                // failure back): it is gone all the same.
                Error::peer_lost(peer, format!("{why} (reported by rank {peer}, which left)"))
            } else {
                Error::peer_lost(blame, format!("{why} (reported by rank {peer})"))
            });
        }
    }
}
