//! The progress engine: one thread at a time moves every byte of an
//! exchange itself. It writes pending sends without blocking and reads
//! whatever every peer has sent (into posted receives, or a stash for
//! messages that come early), so two ranks sending to each other never
//! block each other, and no helper thread hands messages over. Long
//! messages go by rendezvous (see `wire.rs`): their data is written only
//! into a receive the peer has posted.

use crate::wire::{Header, Kind, EAGER_LIMIT, HEADER, MAX_ABORT};
use socket2::Socket;
use std::collections::HashMap;
use std::io::{ErrorKind as IoKind, IoSlice, Read};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};
use weft::backend::{OpKind, P2p};
use weft::matching::Inbound;
use weft::{Error, Result};

/// Spin this long without progress before blocking in poll().
const SPIN: Duration = Duration::from_micros(50);
/// Without progress for this long, read every peer's frames, awaited or
/// not (early ones go to the stash), so no cycle of full socket buffers
/// can block progress. Before that, frames no receive awaits stay in the
/// kernel: stashing them costs an allocation and a second copy. Longer
/// than a scheduler time slice: with more ranks than cores a peer is often
/// descheduled for a few ms, and stashing the next step's frames then
/// (at 2 ms) cost 64 MiB all_to_all and all_gather at W=4 about 10 %.
const EAGER_AFTER: Duration = Duration::from_millis(20);
/// Block at most this long per poll() (to re-check aborts).
const NAP: Duration = Duration::from_millis(100);

/// One connection's state.
pub struct Peer {
    pub sock: Socket,
    hdr: [u8; HEADER],
    hdr_got: usize,
    inbound: Inbound,
    /// The peer said goodbye (or its stream ended cleanly after one).
    pub left: bool,
    /// A send stopped mid-frame: nothing more may be written.
    pub torn: bool,
    /// Rendezvous control frames (whole headers) not yet written, and how
    /// many of their bytes are.
    ctl: Vec<u8>,
    ctl_sent: usize,
    /// Ready frames received per tag and not yet used by a send.
    ready: HashMap<u64, usize>,
}

impl Peer {
    pub fn new(sock: Socket) -> Peer {
        Peer {
            sock,
            hdr: [0; HEADER],
            hdr_got: 0,
            inbound: Inbound::default(),
            left: false,
            torn: false,
            ctl: Vec::new(),
            ctl_sent: 0,
            ready: HashMap::new(),
        }
    }

    fn queue_control(&mut self, kind: Kind, tag: u64, len: usize) {
        self.ctl.extend_from_slice(&Header { kind, tag, len: len as u64 }.encode());
    }

    /// Write queued control frames as far as the socket takes them; true if
    /// any byte moved.
    fn flush_control(&mut self, peer: usize) -> Result<bool> {
        if self.ctl.is_empty() {
            return Ok(false);
        }
        let n = send_now(&self.sock, &[IoSlice::new(&self.ctl[self.ctl_sent..])], peer)?;
        self.ctl_sent += n;
        if self.ctl_sent == self.ctl.len() {
            self.ctl.clear();
            self.ctl_sent = 0;
        }
        Ok(n > 0)
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
enum Got {
    Some(usize),
    None,
    Eof,
}

fn read_some(sock: &Socket, buf: &mut [u8], peer: usize) -> Result<Got> {
    if buf.is_empty() {
        return Ok(Got::Some(0));
    }
    match (&*sock).read(buf) {
        Ok(0) => Ok(Got::Eof),
        Ok(n) => Ok(Got::Some(n)),
        Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::Interrupted) => Ok(Got::None),
        Err(e) => Err(Error::peer_lost(peer, format!("connection to peer rank {peer} broke: {e}"))),
    }
}

/// Write as much of `parts` (header then payload, from offset `sent`) as
/// the socket takes now; the new offset.
pub fn write_some(sock: &Socket, hdr: &[u8; HEADER], data: &[u8], sent: usize, peer: usize) -> Result<usize> {
    let parts = if sent < HEADER {
        [IoSlice::new(&hdr[sent..]), IoSlice::new(data)]
    } else {
        [IoSlice::new(&data[sent - HEADER..]), IoSlice::new(&[])]
    };
    Ok(sent + send_now(sock, &parts, peer)?)
}

/// Write what the socket takes now, without blocking; the bytes written.
fn send_now(sock: &Socket, parts: &[IoSlice<'_>], peer: usize) -> Result<usize> {
    let flags = (nix::sys::socket::MsgFlags::MSG_NOSIGNAL | nix::sys::socket::MsgFlags::MSG_DONTWAIT).bits();
    match sock.send_vectored_with_flags(parts, flags) {
        Ok(n) => Ok(n),
        Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::Interrupted) => Ok(0),
        Err(e) => Err(Error::peer_lost(peer, format!("connection to peer rank {peer} broke: send failed: {e}"))),
    }
}

/// What the engine needs from its owner on each turn.
pub trait Watch {
    /// An error that ends the exchange now (abort, group failure).
    fn stop(&self) -> Option<Error>;
}

/// Run one exchange to completion.
pub fn exchange(me: usize, peers: &mut [Option<Peer>], ops: &mut [P2p<'_>], deadline: Instant, watch: &dyn Watch) -> Result<()> {
    let n = ops.len();
    let mut done = vec![false; n];
    let mut sent = vec![0usize; n];
    let headers: Vec<[u8; HEADER]> = ops
        .iter()
        .map(|op| match op {
            P2p::Send { tag, data, .. } => Header { kind: Kind::Data, tag: *tag, len: data.len() as u64 }.encode(),
            P2p::Recv { .. } => [0; HEADER],
        })
        .collect();
    // Receives served by messages that came early; conflicts fail at once.
    // Rendezvous: a long receive tells its sender it is ready, a long send
    // announces itself and waits for that.
    let mut awaits_ready = vec![false; n];
    for (i, op) in ops.iter_mut().enumerate() {
        let p = peers[op.peer()].as_mut().expect("validated peers are connected");
        match op {
            P2p::Recv { peer, tag, buf } => {
                if p.inbound.serve_early(me, *peer, *tag, buf)? {
                    done[i] = true;
                } else if p.left {
                    return Err(Error::peer_lost(*peer, format!("peer rank {peer} left the group (its process group was closed)")));
                } else if buf.len() > EAGER_LIMIT {
                    p.queue_control(Kind::Ready, *tag, buf.len());
                }
            }
            P2p::Send { tag, data, .. } if data.len() > EAGER_LIMIT => {
                p.queue_control(Kind::Announce, *tag, data.len());
                awaits_ready[i] = true;
            }
            P2p::Send { .. } => {}
        }
    }
    let result = run(me, peers, ops, &mut done, &mut sent, &mut awaits_ready, &headers, deadline, watch);
    if result.is_err() {
        // A frame arriving into a receive of this batch is kept as a stashed
        // copy: the caller's buffer is about to be handed back.
        for p in peers.iter_mut().flatten() {
            p.inbound.detach(ops);
        }
        // Half a frame on the wire: that stream cannot be used again.
        // Control frames not yet written are dropped with the batch.
        for p in peers.iter_mut().flatten() {
            p.torn |= p.ctl_sent % HEADER != 0;
            p.ctl.clear();
            p.ctl_sent = 0;
        }
        for (i, op) in ops.iter().enumerate() {
            if let P2p::Send { peer, data, .. } = op {
                if sent[i] > 0 && sent[i] < HEADER + data.len() {
                    if let Some(p) = peers[*peer].as_mut() {
                        p.torn = true;
                    }
                }
            }
        }
    }
    result
}

#[allow(clippy::too_many_arguments)]
fn run(
    me: usize,
    peers: &mut [Option<Peer>],
    ops: &mut [P2p<'_>],
    done: &mut [bool],
    sent: &mut [usize],
    awaits_ready: &mut [bool],
    headers: &[[u8; HEADER]],
    deadline: Instant,
    watch: &dyn Watch,
) -> Result<()> {
    let w = peers.len();
    // Per peer: a send is under way (its first unfinished one); something
    // waits to be written; a send waits for the peer's Ready.
    let (mut current, mut busy, mut hear) = (vec![None; w], vec![false; w], vec![false; w]);
    let mut idle_since = Instant::now();
    loop {
        if let Some(e) = watch.stop() {
            return Err(e);
        }
        let mut moved = false;
        // Sends: the first unfinished send to each peer goes out as far as
        // it can; control frames go first, between data frames.
        current.fill(None);
        hear.fill(false);
        for i in 0..ops.len() {
            if let P2p::Send { peer, .. } = &ops[i] {
                if !done[i] && current[*peer].is_none() {
                    current[*peer] = Some(i);
                }
            }
        }
        for peer in 0..w {
            let Some(p) = peers[peer].as_mut() else { continue };
            let Some(mut i) = current[peer] else {
                moved |= p.flush_control(peer)?;
                busy[peer] = !p.ctl.is_empty();
                continue;
            };
            if p.left {
                return Err(Error::peer_lost(peer, format!("peer rank {peer} left the group (its process group was closed)")));
            }
            loop {
                let P2p::Send { tag, data, .. } = &ops[i] else { unreachable!("current is a send") };
                if awaits_ready[i] && p.take_ready(*tag) {
                    awaits_ready[i] = false;
                }
                if sent[i] == 0 {
                    moved |= p.flush_control(peer)?;
                }
                if awaits_ready[i] || !p.ctl.is_empty() {
                    break;
                }
                let before = sent[i];
                sent[i] = write_some(&p.sock, &headers[i], data, sent[i], peer)?;
                moved |= sent[i] != before;
                if sent[i] < HEADER + data.len() {
                    break;
                }
                done[i] = true;
                // The next send to this peer may start at once.
                match (i + 1..ops.len()).find(|j| !done[*j] && matches!(&ops[*j], P2p::Send { peer: q, .. } if *q == peer)) {
                    Some(j) => i = j,
                    None => break,
                }
            }
            hear[peer] = awaits_ready[i];
            busy[peer] = !p.ctl.is_empty() || (!done[i] && !awaits_ready[i]);
        }
        // Receives: from the peers this exchange awaits, only as far as it
        // needs, until stalled (see EAGER_AFTER).
        let eager = Instant::now().duration_since(idle_since) >= EAGER_AFTER;
        for peer in 0..w {
            if peers[peer].is_some() {
                moved |= drain(me, peer, peers, ops, done, eager || hear[peer])?;
            }
        }
        if done.iter().all(|d| *d) {
            return Ok(());
        }
        // Receives from a peer that has left can never complete.
        for (i, op) in ops.iter().enumerate() {
            if let P2p::Recv { peer, .. } = op {
                let p = peers[*peer].as_ref().expect("connected");
                if !done[i] && p.left && !p.inbound.in_frame() {
                    return Err(Error::peer_lost(*peer, format!("peer rank {peer} left the group (its process group was closed)")));
                }
            }
        }
        let now = Instant::now();
        if moved {
            idle_since = now;
            continue;
        }
        if now >= deadline {
            let pending: Vec<String> = (0..ops.len())
                .filter(|i| !done[*i])
                .map(|i| match &ops[i] {
                    P2p::Send { peer, tag, data } if awaits_ready[i] => format!(
                        "peer rank {peer} never posted the receive for {} ({} bytes to send)",
                        OpKind::describe_tag(*tag),
                        data.len()
                    ),
                    P2p::Send { peer, tag, .. } => format!("sending to peer rank {peer} ({})", OpKind::describe_tag(*tag)),
                    P2p::Recv { peer, tag, buf } => {
                        format!("no message from peer rank {peer} for {} ({} bytes expected)", OpKind::describe_tag(*tag), buf.len())
                    }
                })
                .collect();
            return Err(Error::timeout(format!("{} before the deadline", pending.join("; "))));
        }
        if now.duration_since(idle_since) < SPIN {
            std::thread::yield_now();
            continue;
        }
        // Block until a socket is readable (or writable, for a pending send).
        let mut fds: Vec<nix::poll::PollFd<'_>> = Vec::with_capacity(w);
        for (peer, p) in peers.iter().enumerate() {
            if let Some(p) = p {
                let mut ev = nix::poll::PollFlags::empty();
                // A peer with unread frames nobody awaits would wake poll() at
                // once: watch it only once reading everything.
                if eager || hear[peer] || awaited(ops, done, peer) {
                    ev |= nix::poll::PollFlags::POLLIN;
                }
                if busy[peer] {
                    ev |= nix::poll::PollFlags::POLLOUT;
                }
                fds.push(nix::poll::PollFd::new(p.sock.as_fd(), ev));
            }
        }
        // Wake by the time reading everything starts, then every NAP.
        let nap = if eager { NAP } else { EAGER_AFTER.saturating_sub(now.duration_since(idle_since)) };
        let wait = nap.min(deadline.saturating_duration_since(now)).max(Duration::from_millis(1));
        let ms = nix::poll::PollTimeout::try_from(wait.as_millis() as u32).unwrap_or(nix::poll::PollTimeout::MAX);
        let _ = nix::poll::poll(&mut fds, ms);
    }
}

/// Whether a receive of `ops` still waits for `peer`.
fn awaited(ops: &[P2p<'_>], done: &[bool], peer: usize) -> bool {
    ops.iter().zip(done).any(|(op, d)| !d && matches!(op, P2p::Recv { peer: q, .. } if *q == peer))
}

/// Read what `peer` has sent; true if any byte moved. Unless `eager`, stop
/// at a frame boundary once no receive of `ops` awaits this peer: a frame
/// left in the socket costs nothing, one read early is copied twice.
fn drain(me: usize, peer: usize, peers: &mut [Option<Peer>], ops: &mut [P2p<'_>], done: &mut [bool], eager: bool) -> Result<bool> {
    let p = peers[peer].as_mut().expect("connected");
    let mut moved = false;
    loop {
        if !p.inbound.in_frame() {
            if p.left {
                return Ok(moved);
            }
            if !eager && p.hdr_got == 0 && !awaited(ops, done, peer) {
                return Ok(moved);
            }
            match read_some(&p.sock, &mut p.hdr[p.hdr_got..], peer)? {
                Got::None => return Ok(moved),
                Got::Eof if p.hdr_got == 0 => {
                    return Err(Error::peer_lost(
                        peer,
                        format!(
                            "connection to peer rank {peer} closed without a goodbye: the process exited, crashed or aborted its group"
                        ),
                    ))
                }
                Got::Eof => return Err(Error::peer_lost(peer, format!("connection to peer rank {peer} closed in the middle of a frame"))),
                Got::Some(k) => p.hdr_got += k,
            }
            moved = true;
            if p.hdr_got < HEADER {
                continue;
            }
            p.hdr_got = 0;
            let h = Header::decode(&p.hdr, peer)?;
            match h.kind {
                Kind::Goodbye => {
                    p.left = true;
                    return Ok(true);
                }
                Kind::Abort => p.inbound.begin_control((h.len as usize).min(MAX_ABORT as usize)),
                Kind::Data => p.inbound.begin(me, peer, h.tag, h.len as usize, ops, done)?,
                Kind::Announce => {
                    p.inbound.announce(me, peer, h.tag, h.len as usize, ops, done)?;
                    continue;
                }
                Kind::Ready => {
                    *p.ready.entry(h.tag).or_default() += 1;
                    continue;
                }
            }
        }
        let dst = p.inbound.payload(ops);
        if !dst.is_empty() {
            match read_some(&p.sock, dst, peer)? {
                Got::None => return Ok(moved),
                Got::Eof => return Err(Error::peer_lost(peer, format!("connection to peer rank {peer} closed in the middle of a frame"))),
                Got::Some(k) => {
                    p.inbound.advance(k);
                    moved = true;
                }
            }
        }
        if let Some(payload) = p.inbound.finish(me, peer, ops, done)? {
            // An abort report: the rank to blame, then why.
            let blame = payload.get(..4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize).unwrap_or(peer);
            let why = String::from_utf8_lossy(payload.get(4..).unwrap_or_default()).into_owned();
            return Err(if blame == me {
                Error::aborted(format!("{why} (reported back by rank {peer})"))
            } else {
                Error::peer_lost(blame, format!("{why} (reported by rank {peer})"))
            });
        }
    }
}
