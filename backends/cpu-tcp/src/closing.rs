//! Leaving without costing a peer a byte: a rank that shuts its group
//! down says goodbye on every connection, then keeps reading (and
//! discarding) until each peer has closed its side too, and only then
//! closes. A peer that is still inside its last op, however slow, reads
//! everything this rank sent, goodbye included, and its own sends never
//! block on this rank; a close that comes first could lose what the kernel
//! still holds for it (and a goodbye that does not fit in a full socket
//! buffer would never be sent at all, so the peer would take the close for
//! a crash).
//!
//! This runs on a thread of its own per group, so that groups may be shut
//! down in any order on different ranks; process exit waits for those
//! threads ([`wait_at_exit`]). Each is bounded: a peer that neither closes
//! nor dies within the group's timeout is named on stderr and its
//! connection closed anyway.

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use socket2::Socket;
use std::io::{ErrorKind as IoKind, Read};
use std::net::Shutdown;
use std::os::fd::AsFd;
use std::sync::{Mutex, Once};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// One connection being closed.
pub(crate) struct Leaving {
    /// The peer's rank, as the user knows it (its group rank), for what
    /// this prints.
    pub(crate) peer: usize,
    /// A handle of the connection's socket (non-blocking).
    pub(crate) sock: Socket,
    /// What is left to write before this side's close: the goodbye frame
    /// (empty where none is owed: a peer that left first, a connection
    /// broken mid-frame).
    pub(crate) goodbye: Vec<u8>,
}

/// The closing threads still running.
static CLOSERS: Mutex<Vec<JoinHandle<()>>> = Mutex::new(Vec::new());

/// Close `conns` (group rank `rank`'s connections of one group) once every
/// peer has closed its side, or at `deadline`; in the background.
pub(crate) fn close_after_peers(rank: usize, conns: Vec<Leaving>, deadline: Instant) {
    static AT_EXIT: Once = Once::new();
    AT_EXIT.call_once(|| {
        // SAFETY: registers a function of this library with no arguments;
        // it only joins threads (see `wait_at_exit`).
        unsafe { nix::libc::atexit(wait_at_exit) };
    });
    let mut closers = CLOSERS.lock().unwrap_or_else(|p| p.into_inner());
    closers.retain(|h| !h.is_finished());
    match std::thread::Builder::new().name("weft-tcp-close".into()).spawn(move || close(rank, conns, deadline)) {
        Ok(h) => closers.push(h),
        // No thread to be had: close now, as a crash would.
        Err(e) => eprintln!("weft: cpu-tcp rank {rank}: closing its connections at once (no thread to wait for peers: {e})"),
    }
}

/// At process exit: wait for the closing threads (each ends by its
/// deadline), so that no connection is closed while a peer still reads.
extern "C" fn wait_at_exit() {
    let closers = std::mem::take(&mut *CLOSERS.lock().unwrap_or_else(|p| p.into_inner()));
    for h in closers {
        let _ = h.join();
    }
}

/// Where one connection's close stands.
#[derive(Clone, Copy, Default)]
struct Progress {
    /// Bytes of the goodbye written.
    written: usize,
    /// This side is shut for writing.
    shut: bool,
    /// The peer has closed its side.
    peer_closed: bool,
    /// The connection broke: nothing more to do on it.
    broken: bool,
}

impl Progress {
    /// Done with it: it broke, or both sides have ended.
    fn done(&self) -> bool {
        self.broken || (self.peer_closed && self.shut)
    }
}

/// The work of one closing thread.
fn close(rank: usize, conns: Vec<Leaving>, deadline: Instant) {
    let mut buf = vec![0u8; 64 << 10];
    let mut state = vec![Progress::default(); conns.len()];
    loop {
        for (c, s) in conns.iter().zip(state.iter_mut()) {
            // Read whatever came: the peer's sends must never block on us.
            while !s.peer_closed && !s.broken {
                match (&c.sock).read(&mut buf) {
                    Ok(0) => s.peer_closed = true,
                    Ok(_) => {}
                    Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::Interrupted) => break,
                    Err(_) => s.broken = true,
                }
            }
            // Our goodbye, then the end of our stream (also when the peer
            // closed first: it may be reading until ours).
            while !s.shut && !s.broken && s.written < c.goodbye.len() {
                let flags = nix::sys::socket::MsgFlags::MSG_NOSIGNAL | nix::sys::socket::MsgFlags::MSG_DONTWAIT;
                match c.sock.send_with_flags(&c.goodbye[s.written..], flags.bits()) {
                    Ok(n) => s.written += n,
                    Err(e) if matches!(e.kind(), IoKind::WouldBlock | IoKind::Interrupted) => break,
                    Err(_) => s.broken = true,
                }
            }
            if !s.shut && !s.broken && s.written == c.goodbye.len() {
                let _ = c.sock.shutdown(Shutdown::Write);
                s.shut = true;
            }
        }
        let open: Vec<usize> = (0..conns.len()).filter(|&i| !state[i].done()).collect();
        if open.is_empty() {
            break;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let peers: Vec<usize> = open.iter().map(|&i| conns[i].peer).collect();
            eprintln!(
                "weft: cpu-tcp rank {rank}: peer rank(s) {peers:?} did not close their side of the group within its timeout \
                 (stuck, or still running without destroying the group); closing anyway"
            );
            break;
        }
        let mut fds: Vec<PollFd<'_>> = open
            .iter()
            .map(|&i| {
                let mut ev = PollFlags::empty();
                if !state[i].peer_closed {
                    ev |= PollFlags::POLLIN;
                }
                if !state[i].shut {
                    ev |= PollFlags::POLLOUT;
                }
                PollFd::new(conns[i].sock.as_fd(), ev)
            })
            .collect();
        let wait = PollTimeout::try_from(left.min(Duration::from_secs(1))).unwrap_or(PollTimeout::MAX);
        let _ = poll(&mut fds, wait);
    }
    for c in &conns {
        let _ = c.sock.shutdown(Shutdown::Both);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    fn pair() -> (Socket, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (ours, _) = l.accept().unwrap();
        (Socket::from(ours), peer)
    }

    /// The goodbye does not fit in the socket (a peer that does not read
    /// for seconds, as a straggler still in its last op): it is written
    /// once the peer reads, after everything sent before it, and the
    /// connection closes only after the peer has closed its side.
    #[test]
    fn a_goodbye_behind_a_full_buffer_reaches_a_late_reader_then_the_end() {
        let (ours, mut peer) = pair();
        ours.set_send_buffer_size(4096).unwrap();
        ours.set_nonblocking(true).unwrap();
        let mut sent = 0usize;
        let chunk = [7u8; 4096];
        loop {
            match (&ours).write(&chunk) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == IoKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            }
        }
        let goodbye = b"goodbye-frame-bytes".to_vec();
        let start = Instant::now();
        let conns = vec![Leaving { peer: 1, sock: ours.try_clone().unwrap(), goodbye: goodbye.clone() }];
        let closer = std::thread::spawn(move || close(0, conns, Instant::now() + Duration::from_secs(30)));
        drop(ours);
        // Later than any fixed grace the old close gave.
        std::thread::sleep(Duration::from_secs(3));
        peer.write_all(b"late bytes the leaver must read, not reset").unwrap();
        let mut got = Vec::new();
        peer.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut buf = [0u8; 65536];
        while got.len() < sent + goodbye.len() {
            let n = peer.read(&mut buf).unwrap();
            assert!(n > 0, "the stream ended after {} of {} bytes", got.len(), sent + goodbye.len());
            got.extend_from_slice(&buf[..n]);
        }
        assert!(got[..sent].iter().all(|&b| b == 7) && got[sent..] == goodbye[..]);
        // Then the end of the stream, and the leaver waits for ours.
        assert_eq!(peer.read(&mut buf).unwrap(), 0);
        drop(peer);
        closer.join().unwrap();
        assert!(start.elapsed() < Duration::from_secs(25), "the closer waited for its deadline");
    }

    /// A peer that never closes its side: the closer gives up at its deadline.
    #[test]
    fn a_peer_that_never_closes_is_given_up_at_the_deadline() {
        let (ours, peer) = pair();
        ours.set_nonblocking(true).unwrap();
        let start = Instant::now();
        close(0, vec![Leaving { peer: 1, sock: ours, goodbye: Vec::new() }], Instant::now() + Duration::from_millis(300));
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(300) && took < Duration::from_secs(5), "{took:?}");
        drop(peer);
    }
}
