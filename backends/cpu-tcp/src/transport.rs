//! The cpu-tcp backend: one TCP connection per peer, a reader thread per
//! connection that delivers frames to posted receives, and sends written by
//! the calling thread. Bytes touch the wire only in this file.

use crate::inbox::{Claim, Inbox, RawBuf};
use crate::wire::{Header, Kind, HEADER};
use socket2::Socket;
use std::io::{ErrorKind as IoKind, IoSlice, Read};
use std::net::Shutdown;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use weft::backend::{Backend, P2p};
use weft::{Error, Result};

/// How often a blocked socket call wakes to check deadlines and aborts.
const TICK: Duration = Duration::from_millis(100);
/// After a frame, how long a reader polls for the next one before it
/// blocks in `read` (a blocked thread takes tens of microseconds to wake).
const READER_SPIN: Duration = Duration::from_micros(40);
/// How long a clean shutdown waits for peers to close their side.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// Lifecycle of the connections, shared with the reader threads.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Phase {
    Running = 0,
    /// Goodbyes sent and write sides closed: readers drain until the peer
    /// closes too or the line goes quiet, so no unread data turns our close
    /// into a reset.
    Draining = 1,
    /// Aborted or closed: readers stop at once, quietly.
    Stopped = 2,
}

struct PhaseCell(AtomicU8);

impl PhaseCell {
    fn get(&self) -> Phase {
        match self.0.load(Ordering::Acquire) {
            0 => Phase::Running,
            1 => Phase::Draining,
            _ => Phase::Stopped,
        }
    }
    fn set(&self, p: Phase) {
        self.0.fetch_max(p as u8, Ordering::AcqRel);
    }
}

/// The sending half of a connection.
struct Writer {
    sock: Socket,
    /// A send stopped mid-frame: nothing more may be written.
    torn: bool,
}

pub struct TcpBackend {
    rank: usize,
    inbox: Arc<Inbox>,
    writers: Vec<Option<Mutex<Writer>>>,
    readers: Mutex<Vec<JoinHandle<()>>>,
    phase: Arc<PhaseCell>,
}

impl TcpBackend {
    /// Start a reader per connected peer. `stall` bounds how long a frame
    /// that nobody waits for may take to arrive once it has started.
    pub fn start(rank: usize, peers: Vec<Option<Socket>>, stall: Duration) -> Result<Self> {
        let size = peers.len();
        let inbox = Arc::new(Inbox::new(rank, size));
        let phase = Arc::new(PhaseCell(AtomicU8::new(Phase::Running as u8)));
        let mut writers = Vec::with_capacity(size);
        let mut readers = Vec::new();
        for (peer, sock) in peers.into_iter().enumerate() {
            let Some(sock) = sock else {
                writers.push(None);
                continue;
            };
            sock.set_read_timeout(Some(TICK))?;
            sock.set_write_timeout(Some(TICK))?;
            let reader = sock.try_clone()?;
            let (inbox2, phase2) = (inbox.clone(), phase.clone());
            readers.push(
                std::thread::Builder::new()
                    .name(format!("weft-tcp-r{rank}-p{peer}"))
                    .spawn(move || read_loop(reader, rank, peer, &inbox2, &phase2, stall))?,
            );
            writers.push(Some(Mutex::new(Writer { sock, torn: false })));
        }
        Ok(TcpBackend { rank, inbox, writers, readers: Mutex::new(readers), phase })
    }

    fn writer(&self, peer: usize) -> Result<&Mutex<Writer>> {
        match self.writers.get(peer) {
            Some(Some(w)) => Ok(w),
            _ => Err(Error::invalid(format!("cpu-tcp: rank {} has no connection to peer rank {peer}", self.rank))),
        }
    }

    fn send(&self, peer: usize, header: Header, data: &[u8], deadline: Instant) -> Result<()> {
        let mut w = self.writer(peer)?.lock().unwrap_or_else(|p| p.into_inner());
        self.inbox.check(peer)?;
        match write_frame(&mut w, header, data, deadline, || self.inbox.check(peer)) {
            Ok(()) => Ok(()),
            Err(WriteEnd::Deadline { sent }) => {
                let e = Error::timeout(format!(
                    "sending {} bytes to peer rank {peer} did not finish before the deadline ({sent} sent)",
                    data.len()
                ));
                if w.torn {
                    // Half a frame is on the wire: this stream cannot be used again.
                    self.inbox.fail_all(e.clone());
                }
                Err(e)
            }
            Err(WriteEnd::Stopped(e)) => Err(e),
            Err(WriteEnd::Broken(why)) => Err(self.lost(peer, why)),
        }
    }

    fn lost(&self, peer: usize, why: String) -> Error {
        let e = Error::peer_lost(peer, format!("connection to peer rank {peer} broke: {why}"));
        self.inbox.fail_all(e.clone());
        // The group's first failure wins (it may name another rank).
        self.inbox.check(peer).err().unwrap_or(e)
    }

    fn close_sockets(&self, how: Shutdown) {
        for w in self.writers.iter().flatten() {
            let _ = w.lock().unwrap_or_else(|p| p.into_inner()).sock.shutdown(how);
        }
    }

    /// Tell every reachable peer why this rank's group failed: the lost
    /// rank if that is the cause, else this rank. Best effort and brief; a
    /// writer busy in another thread or torn mid-frame is skipped.
    fn send_abort(&self, reason: &Error) {
        let (blame, why) = match reason.kind() {
            weft::ErrorKind::PeerLost { rank } if *rank != self.rank => (*rank, reason.message().to_string()),
            _ => (self.rank, format!("rank {} aborted its group: {reason}", self.rank)),
        };
        let mut payload = (blame as u32).to_le_bytes().to_vec();
        payload.extend_from_slice(why.as_bytes());
        payload.truncate(crate::wire::MAX_ABORT as usize);
        let header = Header { kind: Kind::Abort, tag: 0, len: payload.len() as u64 };
        let soon = Instant::now() + Duration::from_millis(200);
        for (peer, w) in self.writers.iter().enumerate() {
            let Some(w) = w else { continue };
            let Ok(mut w) = w.try_lock() else { continue };
            if !w.torn && !self.inbox.peer_gone(peer) {
                let _ = write_frame(&mut w, header, &payload, soon, || Ok(()));
            }
        }
    }

    /// Stop everything now and wait for the readers.
    fn stop(&self) {
        self.phase.set(Phase::Stopped);
        self.close_sockets(Shutdown::Both);
        for h in self.readers.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            let _ = h.join();
        }
    }
}

impl Backend for TcpBackend {
    fn name(&self) -> &str {
        "cpu-tcp"
    }

    fn exchange(&self, ops: &mut [P2p<'_>], deadline: Instant) -> Result<()> {
        for op in ops.iter() {
            self.writer(op.peer())?;
        }
        let mut posted = Vec::new();
        for op in ops.iter_mut() {
            if let P2p::Recv { peer, tag, buf } = op {
                let raw = RawBuf { ptr: buf.as_mut_ptr(), len: buf.len() };
                posted.push(self.inbox.post(*peer, *tag, raw, deadline));
            }
        }
        for op in ops.iter() {
            if let P2p::Send { peer, tag, data } = op {
                let header = Header { kind: Kind::Data, tag: *tag, len: data.len() as u64 };
                if let Err(e) = self.send(*peer, header, data, deadline) {
                    self.inbox.cancel(&posted);
                    return Err(e);
                }
            }
        }
        self.inbox.wait(&posted, deadline)
    }

    fn abort(&self, reason: &Error) {
        // Our own reason first: a peer's echo of this abort must not win.
        self.inbox.fail_all(reason.clone());
        self.send_abort(reason);
        self.phase.set(Phase::Stopped);
        self.close_sockets(Shutdown::Both);
    }

    fn shutdown(&self) {
        // Say goodbye to every peer still there (even after a failure: this
        // close is deliberate), close our write sides, and let the readers
        // drain until the peers close theirs.
        let bye = Header { kind: Kind::Goodbye, tag: 0, len: 0 };
        let soon = Instant::now() + Duration::from_millis(500);
        for (peer, w) in self.writers.iter().enumerate() {
            let Some(w) = w else { continue };
            let mut w = w.lock().unwrap_or_else(|p| p.into_inner());
            if !w.torn && !self.inbox.peer_gone(peer) {
                let _ = write_frame(&mut w, bye, &[], soon, || Ok(()));
            }
        }
        self.phase.set(Phase::Draining);
        self.close_sockets(Shutdown::Write);
        let until = Instant::now() + CLOSE_GRACE;
        while Instant::now() < until && !self.readers.lock().unwrap_or_else(|p| p.into_inner()).iter().all(|h| h.is_finished()) {
            std::thread::sleep(Duration::from_millis(2));
        }
        self.stop();
    }
}

impl Drop for TcpBackend {
    fn drop(&mut self) {
        self.stop();
    }
}

enum WriteEnd {
    /// The deadline passed after `sent` bytes.
    Deadline { sent: usize },
    /// `check` reported an error (group failed or peer gone).
    Stopped(Error),
    /// The connection broke.
    Broken(String),
}

/// Write one frame, waking every tick to run `check` and honour `deadline`.
fn write_frame(
    w: &mut Writer,
    header: Header,
    data: &[u8],
    deadline: Instant,
    check: impl Fn() -> Result<()>,
) -> std::result::Result<(), WriteEnd> {
    let hdr = header.encode();
    let total = HEADER + data.len();
    let mut sent = 0;
    while sent < total {
        let parts = if sent < HEADER {
            [IoSlice::new(&hdr[sent..]), IoSlice::new(data)]
        } else {
            [IoSlice::new(&data[sent - HEADER..]), IoSlice::new(&[])]
        };
        match w.sock.send_vectored_with_flags(&parts, nix::sys::socket::MsgFlags::MSG_NOSIGNAL.bits()) {
            Ok(0) => return Err(WriteEnd::Broken("the connection accepts no more data".into())),
            Ok(n) => sent += n,
            Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut | IoKind::Interrupted) => {
                let stop =
                    check().err().map(WriteEnd::Stopped).or_else(|| (Instant::now() >= deadline).then_some(WriteEnd::Deadline { sent }));
                if let Some(end) = stop {
                    w.torn |= sent > 0;
                    return Err(end);
                }
            }
            Err(e) => return Err(WriteEnd::Broken(format!("send failed: {e}"))),
        }
    }
    Ok(())
}

enum ReadEnd {
    /// The stream ended cleanly between frames.
    Eof,
    /// Local shutdown or abort.
    Closing,
    Failed(Error),
}

/// Fill `buf`, waking every tick to honour a stop and, once part of a
/// frame has arrived (or `mid_frame`), the `stall` deadline.
fn read_full(
    sock: &Socket,
    buf: &mut [u8],
    mid_frame: bool,
    stall: Instant,
    phase: &PhaseCell,
    peer: usize,
) -> std::result::Result<(), ReadEnd> {
    let mut got = 0;
    while got < buf.len() {
        match (&*sock).read(&mut buf[got..]) {
            Ok(0) if got == 0 && !mid_frame => return Err(ReadEnd::Eof),
            Ok(0) => {
                return Err(ReadEnd::Failed(Error::peer_lost(
                    peer,
                    format!("connection to peer rank {peer} closed in the middle of a frame"),
                )))
            }
            Ok(n) => got += n,
            Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::TimedOut | IoKind::Interrupted) => {
                // Stopped: leave now. Draining: a quiet tick between frames
                // means nothing more is on its way, so closing cannot reset.
                let idle = got == 0 && !mid_frame;
                if phase.get() == Phase::Stopped || (phase.get() == Phase::Draining && idle) {
                    return Err(ReadEnd::Closing);
                }
                if (mid_frame || got > 0) && Instant::now() >= stall {
                    return Err(ReadEnd::Failed(Error::timeout(format!("peer rank {peer} stalled in the middle of a frame"))));
                }
            }
            Err(_) if phase.get() != Phase::Running => return Err(ReadEnd::Closing),
            Err(e) => return Err(ReadEnd::Failed(Error::peer_lost(peer, format!("connection to peer rank {peer} broke: {e}")))),
        }
    }
    Ok(())
}

fn read_loop(sock: Socket, me: usize, peer: usize, inbox: &Inbox, phase: &PhaseCell, stall: Duration) {
    let mut left = false;
    let mut last_frame = Instant::now();
    let end = loop {
        // Busy traffic keeps the reader hot: poll briefly before blocking.
        while last_frame.elapsed() < READER_SPIN && !readable(&sock) {
            std::thread::yield_now();
        }
        let mut hb = [0u8; HEADER];
        if let Err(end) = read_full(&sock, &mut hb, false, Instant::now() + stall, phase, peer) {
            break end;
        }
        last_frame = Instant::now();
        let header = match Header::decode(&hb, peer) {
            Ok(h) => h,
            Err(e) => break ReadEnd::Failed(e),
        };
        if header.kind == Kind::Abort {
            let mut payload = vec![0u8; header.len.min(crate::wire::MAX_ABORT) as usize];
            if let Err(end) = read_full(&sock, &mut payload, true, Instant::now() + stall, phase, peer) {
                break end;
            }
            let blame = payload.get(..4).map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize).unwrap_or(peer);
            let why = String::from_utf8_lossy(payload.get(4..).unwrap_or_default());
            // A report blaming this rank is the echo of our own abort.
            let e = if blame == me {
                Error::aborted(format!("{why} (reported back by rank {peer})"))
            } else {
                Error::peer_lost(blame, format!("{why} (reported by rank {peer})"))
            };
            break ReadEnd::Failed(e);
        }
        if header.kind == Kind::Goodbye {
            inbox.fail_peer(peer, Error::peer_lost(peer, format!("peer rank {peer} left the group (its process group was closed)")));
            // Keep reading: the peer's FIN follows; leaving its bytes unread
            // would turn our close into a reset.
            left = true;
            continue;
        }
        let len = header.len as usize;
        match inbox.claim(peer, header.tag, len) {
            Claim::Into(id, buf, deadline) => {
                // SAFETY: the receive is claimed (state Reading): its poster
                // waits, keeping the buf.len-byte buffer alive and untouched,
                // until `complete` is called below.
                let dst = unsafe { std::slice::from_raw_parts_mut(buf.ptr, buf.len) };
                match read_full(&sock, dst, true, deadline, phase, peer) {
                    Ok(()) => inbox.complete(id, Ok(())),
                    Err(end) => {
                        let e = end_error(&end, peer);
                        inbox.complete(id, Err(e));
                        break end;
                    }
                }
            }
            Claim::Stash => {
                let mut msg = vec![0u8; len];
                if let Err(end) = read_full(&sock, &mut msg, true, Instant::now() + stall, phase, peer) {
                    break end;
                }
                inbox.stash(peer, header.tag, msg);
            }
            Claim::Discard => {
                // Drain the payload in pieces: its size came from the peer.
                let mut scratch = vec![0u8; len.min(1 << 16)];
                let mut left = len;
                let until = Instant::now() + stall;
                let drained = loop {
                    let n = left.min(scratch.len());
                    if n == 0 {
                        break Ok(());
                    }
                    if let Err(end) = read_full(&sock, &mut scratch[..n], true, until, phase, peer) {
                        break Err(end);
                    }
                    left -= n;
                };
                if let Err(end) = drained {
                    break end;
                }
            }
        }
    };
    if left || phase.get() != Phase::Running {
        return; // the peer left cleanly, or we are closing: nothing to report
    }
    match end {
        ReadEnd::Closing => {}
        ReadEnd::Eof => inbox.fail_all(Error::peer_lost(
            peer,
            format!("connection to peer rank {peer} closed without a goodbye: the process exited, crashed or aborted its group"),
        )),
        ReadEnd::Failed(e) => inbox.fail_all(e),
    }
}

/// Whether a read would find data now (a zero-timeout poll).
fn readable(sock: &Socket) -> bool {
    use std::os::fd::AsFd;
    let mut fds = [nix::poll::PollFd::new(sock.as_fd(), nix::poll::PollFlags::POLLIN)];
    matches!(nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO), Ok(n) if n > 0)
}

fn end_error(end: &ReadEnd, peer: usize) -> Error {
    match end {
        ReadEnd::Failed(e) => e.clone(),
        ReadEnd::Closing => Error::aborted("the group is closing"),
        ReadEnd::Eof => Error::peer_lost(peer, format!("connection to peer rank {peer} closed")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A rank-0 backend whose only peer is a raw socket the test controls.
    fn backend_with_raw_peer() -> (TcpBackend, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let raw = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (ours, _) = l.accept().unwrap();
        let b = TcpBackend::start(0, vec![None, Some(Socket::from(ours))], Duration::from_secs(5)).unwrap();
        (b, raw)
    }

    #[test]
    fn garbage_on_a_connection_fails_ops_with_a_clear_error() {
        let (b, mut raw) = backend_with_raw_peer();
        raw.write_all(b"\x00garbage bytes that are not a weft frame").unwrap();
        let mut buf = [0u8; 4];
        let e = b.exchange(&mut [P2p::Recv { peer: 1, tag: 1, buf: &mut buf }], Instant::now() + Duration::from_secs(5)).unwrap_err();
        assert!(e.to_string().contains("garbage on the connection from peer rank 1"), "{e}");
    }

    #[test]
    fn a_frame_then_eof_delivers_the_frame_then_reports_peer_lost() {
        let (b, mut raw) = backend_with_raw_peer();
        let h = Header { kind: Kind::Data, tag: 7, len: 3 };
        raw.write_all(&h.encode()).unwrap();
        raw.write_all(b"abc").unwrap();
        drop(raw);
        let mut buf = [0u8; 3];
        let deadline = Instant::now() + Duration::from_secs(5);
        // The message sent before the crash may or may not be delivered
        // (EOF poisons the group), but the error always names the peer.
        match b.exchange(&mut [P2p::Recv { peer: 1, tag: 7, buf: &mut buf }], deadline) {
            Ok(()) => assert_eq!(&buf, b"abc"),
            Err(e) => assert_eq!(e.kind(), &weft::ErrorKind::PeerLost { rank: 1 }),
        }
        let e = b.exchange(&mut [P2p::Recv { peer: 1, tag: 8, buf: &mut buf }], deadline).unwrap_err();
        assert_eq!(e.kind(), &weft::ErrorKind::PeerLost { rank: 1 }, "{e}");
    }
}
