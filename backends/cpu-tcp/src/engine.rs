//! The progress engine: one thread at a time moves every byte of every
//! posted op itself (see `weft::backend::progress`: a collective's exchange and
//! background sends and receives alike). It writes pending sends without
//! blocking and reads whatever every peer has sent (into posted receives,
//! or a stash for messages that come early), so two ranks sending to each
//! other never block each other, and no helper thread hands messages over.
//!
//! What the bytes mean is `protocol.rs`; this file is the loop over the
//! sockets: non-blocking reads and writes, spinning, and poll().

use crate::protocol::{self, Flags, Got, Protocol, Watch, Wire};
use smallvec::SmallVec;
use socket2::Socket;
use std::io::{ErrorKind as IoKind, IoSlice, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use weft::backend::matching::EarlyBudget;
use weft::backend::progress::Posting;
use weft::backend::{Deadline, P2p};
use weft::{Error, Result};

/// Spin this long without progress before blocking in poll().
const SPIN: Duration = Duration::from_micros(50);
/// Without progress for this long, read every peer's frames, awaited or
/// not (early ones go to the stash), so no cycle of full socket buffers
/// can block progress. Before that, frames no receive awaits stay in the
/// kernel: stashing them costs an allocation and a second copy. Longer
/// than a scheduler time slice: with more ranks than cores a peer is often
/// descheduled for a few ms, and stashing the next step's frames then
/// slowed large ops (figures: bench/RESULTS.md, "Measurements behind code comments").
const EAGER_AFTER: Duration = Duration::from_millis(20);
/// Block at most this long per poll() (to re-check aborts).
const NAP: Duration = Duration::from_millis(100);

fn read_some(sock: &Socket, buf: &mut [u8], peer: usize) -> Result<Got> {
    if buf.is_empty() {
        return Ok(Got::Bytes(0));
    }
    match (&*sock).read(buf) {
        Ok(0) => Ok(Got::Eof),
        Ok(n) => Ok(Got::Bytes(n)),
        Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::Interrupted) => Ok(Got::Nothing),
        Err(e) => Err(Error::peer_lost(peer, format!("connection to peer rank {peer} broke: {e}"))),
    }
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

/// The connections' sockets (`socks[r]`: to rank r), the protocol's wire.
pub struct Sockets {
    /// `socks[r]`: the socket to rank r.
    pub socks: Vec<Option<Socket>>,
}

impl Wire for Sockets {
    fn send(&mut self, peer: usize, parts: &[IoSlice<'_>]) -> Result<usize> {
        send_now(self.socks[peer].as_ref().expect("a connected peer"), parts, peer)
    }
    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<Got> {
        read_some(self.socks[peer].as_ref().expect("a connected peer"), buf, peer)
    }
}

/// The protocol and its sockets, driven by one thread at a time.
pub struct Engine {
    /// What the bytes mean, and every posted op.
    pub protocol: Protocol,
    /// Where they go.
    pub sockets: Sockets,
}

impl Engine {
    /// An engine over connected sockets (non-blocking); early messages are
    /// kept within `budget`.
    pub fn new(socks: Vec<Option<Socket>>, budget: EarlyBudget) -> Engine {
        Engine { protocol: Protocol::new(socks.iter().map(Option::is_some), budget), sockets: Sockets { socks } }
    }

    /// Everything fails with `e`: posted ops and those still to be taken.
    pub fn fail_all(&mut self, e: &Error, posting: &Posting) {
        self.protocol.fail_all(e, posting);
    }
}

/// How a poster wakes a driver that sleeps in poll(): a byte on a socket
/// pair, written only while the driver naps (a system call per post
/// otherwise).
pub struct Wake {
    tx: UnixStream,
    rx: UnixStream,
    napping: AtomicBool,
}

impl Wake {
    /// A socket pair, both ends non-blocking.
    pub fn new() -> std::io::Result<Wake> {
        let (tx, rx) = UnixStream::pair()?;
        tx.set_nonblocking(true)?;
        rx.set_nonblocking(true)?;
        Ok(Wake { tx, rx, napping: AtomicBool::new(false) })
    }

    /// Wake the driver if it naps (call after posting).
    pub fn wake(&self) {
        // With the driver's SeqCst store of `napping` before it looks at the
        // inbox: either it sees the new batch, or this sees it napping.
        if self.napping.load(Ordering::SeqCst) {
            // A full socket already holds a wake-up.
            let _ = (&self.tx).write(&[1]);
        }
    }

    /// Wake the driver whatever it does (an abort).
    pub fn wake_now(&self) {
        let _ = (&self.tx).write(&[1]);
    }

    /// Empty the socket (its bytes only say "look at the inbox").
    fn drain(&self) {
        let mut sink = [0u8; 64];
        while matches!((&self.rx).read(&mut sink), Ok(n) if n > 0) {}
    }
}

/// Run `ops` as the driving thread's own batch, after the batches posted
/// before it, driving everything until it has finished.
pub fn exchange(
    me: usize,
    eng: &mut Engine,
    posting: &Posting,
    wake: &Wake,
    watch: &dyn Watch,
    ops: &mut [P2p<'_>],
    deadline: &Deadline,
) -> Result<()> {
    // SAFETY: this returns only once the batch's outcome is in, and its ops
    // have then left the table (`take_local`); `deadline` is borrowed as
    // long.
    if unsafe { eng.protocol.add_local(me, ops, deadline, posting, watch)? } {
        drive(me, eng, posting, wake, watch, true, &|| false);
    }
    eng.protocol.table.take_local().unwrap_or_else(|| Err(Error::backend("cpu-tcp: an exchange ended without an outcome")))
}

/// Drive every posted op (taking new batches from `posting` as they come)
/// until `until()` holds, or with `local`, until the driving thread's own
/// batch has finished; `wake` rouses it from poll() when a batch is posted.
pub fn drive(me: usize, eng: &mut Engine, posting: &Posting, wake: &Wake, watch: &dyn Watch, local: bool, until: &dyn Fn() -> bool) {
    let Engine { protocol: proto, sockets } = eng;
    let w = proto.peers.len();
    let mut idle_since = Instant::now();
    // The clock once per turn: the last turn's reading decides eagerness.
    let mut now = idle_since;
    let mut flags = Flags::new(w);
    loop {
        if let Some(e) = watch.stop() {
            proto.fail_all(&e, posting);
            return;
        }
        let eager = now.duration_since(idle_since) >= EAGER_AFTER;
        let Ok(moved) = proto.step(me, sockets, &mut flags, eager, posting, watch) else { return };
        now = Instant::now();
        if proto.expire_at(now, posting, watch).is_err() {
            return;
        }
        if (local && proto.table.local_done()) || until() {
            return;
        }
        if moved {
            idle_since = now;
            continue;
        }
        if now.duration_since(idle_since) < SPIN && !proto.table.all_done() {
            std::thread::yield_now();
            continue;
        }
        // Block until a socket is readable (or writable, for a pending
        // send), a batch is posted, or a deadline comes.
        let weft::backend::progress::View { ops, done, .. } = proto.table.view();
        let mut fds: Vec<nix::poll::PollFd<'_>> = Vec::with_capacity(w + 1);
        fds.push(nix::poll::PollFd::new(wake.rx.as_fd(), nix::poll::PollFlags::POLLIN));
        for (peer, (p, sock)) in proto.peers.iter().zip(&sockets.socks).enumerate() {
            if let (Some(p), Some(sock)) = (p, sock) {
                let mut ev = nix::poll::PollFlags::empty();
                // A peer with unread frames nobody awaits would wake poll() at
                // once: watch it only once reading everything.
                if p.holds() {
                    // Its next frame waits for room: only its hang-up
                    // matters (then its frames are read to the end).
                    ev |= nix::poll::PollFlags::from_bits_retain(nix::libc::POLLRDHUP);
                } else if eager || flags.hear[peer] || protocol::awaited(ops, done, peer) {
                    ev |= nix::poll::PollFlags::POLLIN;
                }
                if flags.busy[peer] {
                    ev |= nix::poll::PollFlags::POLLOUT;
                }
                fds.push(nix::poll::PollFd::new(sock.as_fd(), ev));
            }
        }
        // Wake by the time reading everything starts, then every NAP.
        let nap = if eager || proto.table.all_done() { NAP } else { EAGER_AFTER.saturating_sub(now.duration_since(idle_since)) };
        let deadline = proto.table.next_deadline().unwrap_or(now + NAP);
        let wait = nap.min(deadline.saturating_duration_since(now)).max(Duration::from_millis(1));
        let ms = nix::poll::PollTimeout::try_from(wait.as_millis() as u32).unwrap_or(nix::poll::PollTimeout::MAX);
        wake.napping.store(true, Ordering::SeqCst);
        if !posting.has_new() {
            let _ = nix::poll::poll(&mut fds, ms);
        }
        wake.napping.store(false, Ordering::SeqCst);
        let woken = fds[0].revents().is_some_and(|r| r.contains(nix::poll::PollFlags::POLLIN));
        // (A reset connection reports POLLHUP or POLLERR whatever was asked.)
        let gone =
            nix::poll::PollFlags::from_bits_retain(nix::libc::POLLRDHUP) | nix::poll::PollFlags::POLLHUP | nix::poll::PollFlags::POLLERR;
        let hung_up: SmallVec<[bool; 8]> = fds[1..].iter().map(|fd| fd.revents().is_some_and(|r| r.intersects(gone))).collect();
        drop(fds);
        for (p, h) in proto.peers.iter_mut().flatten().zip(hung_up) {
            if h {
                p.hang_up();
            }
        }
        if woken {
            wake.drain();
        }
    }
}
