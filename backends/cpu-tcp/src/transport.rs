//! The cpu-tcp backend: one TCP connection per peer, driven by whichever
//! thread runs the op (see `engine.rs`; what the bytes mean is
//! `protocol.rs`). Bytes touch the wire only in the engine, here (abort)
//! and in `closing.rs` (goodbye and close).

use crate::closing;
use crate::engine::{self, Engine, Wake};
use crate::protocol::{self, Watch};
use crate::wire::{Header, Kind, MAX_ABORT};
use socket2::Socket;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft::backend::progress::{self, DriverLock, Post, Posting};
use weft::backend::{Backend, Capabilities, Deadline, GatherSend, P2p};
use weft::store::Store;
use weft::{Error, ErrorKind, Result};

pub struct TcpBackend {
    rank: usize,
    /// The group's store, where an aborting rank leaves whom it blames.
    store: Arc<dyn Store>,
    /// The connections and posted ops; whoever holds it drives them all.
    engine: DriverLock<Engine>,
    /// Batches waiting for the driver.
    posting: Arc<Posting>,
    /// Wakes a driver sleeping in poll().
    wake: Wake,
    /// The sockets' descriptors, to shut them down from any thread without
    /// the engine (the engine owns the sockets for as long as this lives;
    /// no duplicates: a descriptor per peer is what limits the world size).
    fds: Vec<Option<RawFd>>,
    failed: Mutex<Option<Error>>,
    /// How long a clean shutdown waits, at most, for peers to close their
    /// side (the group's timeout).
    close_within: Duration,
    /// The rank the user knows each rank of this backend by (for what the
    /// closing thread prints; `BackendContext::group_ranks`).
    group_ranks: Arc<[usize]>,
}

impl Watch for TcpBackend {
    fn stop(&self) -> Option<Error> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
    fn failed(&self, e: Error) -> Error {
        match e.kind() {
            // A lost peer or a protocol violation ends this transport for
            // good; a timeout is the caller's to judge (core poisons the group).
            ErrorKind::PeerLost { .. } => {
                let e = self.root_cause(e);
                self.fail(e)
            }
            ErrorKind::Backend | ErrorKind::Aborted => self.fail(e),
            _ => e,
        }
    }
}

impl progress::DrivenTransport for TcpBackend {
    fn posting(&self) -> &Arc<Posting> {
        &self.posting
    }
    fn try_drive(&self, until: &dyn Fn() -> bool) -> bool {
        let Some(mut eng) = self.engine.try_lock() else { return false };
        engine::drive(self.rank, &mut eng, &self.posting, &self.wake, self, false, until);
        true
    }
    fn try_exchange(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: &Deadline) -> Option<Result<()>> {
        if !gathered.is_empty() {
            // Not a transport that writes gathered bytes in place (see
            // `Backend::exchange_gathered`): they come packed as sends.
            return Some(Err(Error::backend("cpu-tcp: gathered sends reach the transport packed")));
        }
        let mut eng = self.engine.try_lock()?;
        Some(engine::exchange(self.rank, &mut eng, &self.posting, &self.wake, self, ops, deadline))
    }
    fn abandon(&self, e: &Error) {
        let e = self.fail(e.clone());
        self.engine.lock().fail_all(&e, &self.posting);
    }
    fn wake_driver(&self) {
        self.wake.wake();
    }
}

impl TcpBackend {
    /// Take over connected sockets (`peers[r]` is the one to rank r).
    pub fn start(rank: usize, peers: Vec<Option<Socket>>, store: Arc<dyn Store>, close_within: Duration) -> Result<Self> {
        let budget = weft::backend::matching::EarlyBudget::from_env()?;
        let mut fds = Vec::with_capacity(peers.len());
        for sock in &peers {
            if let Some(s) = sock {
                s.set_nonblocking(true)?;
            }
            fds.push(sock.as_ref().map(|s| s.as_raw_fd()));
        }
        let wake = Wake::new()?;
        let fds_len = fds.len();
        Ok(TcpBackend {
            rank,
            store,
            engine: DriverLock::new(Engine::new(peers, budget)),
            posting: Arc::default(),
            wake,
            fds,
            failed: Mutex::new(None),
            close_within,
            group_ranks: (0..fds_len).collect(),
        })
    }

    /// Name ranks in what it prints as `group_ranks` does (entry r: rank r).
    pub fn with_group_ranks(mut self, group_ranks: Arc<[usize]>) -> Self {
        self.group_ranks = group_ranks;
        self
    }

    /// The rank the user knows rank `r` of this backend by (`r` itself
    /// where the map has no entry).
    fn group_rank(&self, r: usize) -> usize {
        self.group_ranks.get(r).copied().unwrap_or(r)
    }

    fn fail(&self, e: Error) -> Error {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(e).clone()
    }

    /// A peer's connection dropped: if it aborted on purpose, it left the
    /// rank to blame in the store (a half-sent frame can hide its abort
    /// message); report that rank, so every rank blames the same one.
    fn root_cause(&self, e: Error) -> Error {
        let ErrorKind::PeerLost { rank: peer } = *e.kind() else { return e };
        let key = format!("abort/{peer}");
        // (A peer that died without aborting left no key: no waiting for it.)
        match self.store.check(&[key.as_str()]).and_then(|found| {
            if found {
                self.store.get(&key, Duration::from_millis(200))
            } else {
                Ok(Vec::new())
            }
        }) {
            Ok(v) => match String::from_utf8_lossy(&v).parse::<usize>() {
                // It gave up waiting for this rank: it is gone all the same.
                Ok(b) if b == self.rank => Error::peer_lost(peer, format!("peer rank {peer} gave up waiting for this rank and left")),
                Ok(b) if b != peer => Error::peer_lost(b, format!("peer rank {b} lost (rank {peer} aborted because of it)")),
                _ => e,
            },
            Err(_) => e,
        }
    }

    /// Shut every connection down both ways (an abort: peers see the end).
    fn shut_all(&self) {
        for &fd in self.fds.iter().flatten() {
            let _ = nix::sys::socket::shutdown(fd, nix::sys::socket::Shutdown::Both);
        }
    }

    /// Write one small control frame to every peer still there (best effort, brief).
    fn tell_all(eng: &mut Engine, header: Header, payload: &[u8]) {
        let hdr = header.encode();
        let until = Instant::now() + Duration::from_millis(200);
        let Engine { protocol, sockets } = eng;
        for (r, p) in protocol.peers.iter_mut().enumerate() {
            let Some(p) = p else { continue };
            if p.torn || p.left {
                continue;
            }
            let mut sent = 0;
            while sent < hdr.len() + payload.len() && Instant::now() < until {
                match protocol::write_frame(sockets, r, &hdr, 0, payload, sent) {
                    Ok(s) if s == sent => std::thread::yield_now(),
                    Ok(s) => sent = s,
                    Err(_) => break,
                }
            }
            p.torn |= sent > 0 && sent < hdr.len() + payload.len();
        }
    }
}

impl Backend for TcpBackend {
    fn name(&self) -> &str {
        "cpu-tcp"
    }

    fn exchange(&self, ops: &mut [P2p<'_>], deadline: &Deadline) -> Result<()> {
        progress::exchange(self, ops, &[], deadline)
    }

    fn capabilities(&self) -> &Capabilities {
        static POSTING: Capabilities = Capabilities::POSTING;
        &POSTING
    }

    fn post(&self, post: Post) {
        self.posting.push(post);
        self.wake.wake();
    }

    fn progress(&self, until: &dyn Fn() -> bool) {
        progress::wait_until(self, until)
    }

    fn abort(&self, reason: &Error) {
        // Our own reason first: a peer's echo of this abort must not win.
        self.fail(reason.clone());
        // A lost peer, or the one a timeout waited for; else this rank.
        let (blame, why) = match reason.blamed_peer() {
            Some(p) if p != self.rank && matches!(reason.kind(), ErrorKind::PeerLost { .. }) => (p, reason.message().to_string()),
            Some(p) if p != self.rank => (p, format!("rank {} gave up waiting for rank {p}: {reason}", self.rank)),
            _ => (self.rank, format!("rank {} aborted its group: {reason}", self.rank)),
        };
        // Leave the blame where peers look when our connections drop.
        let _ = self.store.set(&format!("abort/{}", self.rank), blame.to_string().as_bytes());
        // Tell peers the root cause, unless an op holds the connections
        // (it sees the failure and returns; peers then see us close).
        if let Some(mut eng) = self.engine.try_lock() {
            let mut payload = (blame as u32).to_le_bytes().to_vec();
            payload.extend_from_slice(why.as_bytes());
            payload.truncate(MAX_ABORT as usize);
            Self::tell_all(&mut eng, Header { kind: Kind::Abort, tag: 0, len: payload.len() as u64, lead: 0 }, &payload);
        }
        self.shut_all();
        self.wake.wake_now();
    }

    fn shutdown(&self) {
        // Every op has finished: no frame is half written but on a
        // connection marked torn, which gets no goodbye.
        let eng = self.engine.lock();
        let goodbye = Header { kind: Kind::Goodbye, tag: 0, len: 0, lead: 0 }.encode().to_vec();
        let mut conns = Vec::new();
        let Engine { protocol, sockets } = &*eng;
        for (peer, (sock, p)) in sockets.socks.iter().zip(&protocol.peers).enumerate() {
            let (Some(sock), Some(p)) = (sock, p) else { continue };
            // The closing thread's own handle: this backend's sockets close
            // when it is dropped, the connection only when both are.
            let Ok(sock) = sock.try_clone() else { continue };
            let owed = !(p.torn || p.left);
            let peer = self.group_rank(peer);
            conns.push(closing::Leaving { peer, sock, goodbye: if owed { goodbye.clone() } else { Vec::new() } });
        }
        drop(eng);
        closing::close_after_peers(self.group_rank(self.rank), conns, Instant::now() + self.close_within);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// A rank-0 backend whose only peer is a raw socket the test controls.
    fn backend_with_raw_peer() -> (TcpBackend, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let raw = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (ours, _) = l.accept().unwrap();
        let store: Arc<dyn Store> = Arc::new(weft::store::MemoryStore::new(Duration::from_secs(1)));
        let b = TcpBackend::start(0, vec![None, Some(Socket::from(ours))], store, Duration::from_secs(5)).unwrap();
        (b, raw)
    }

    #[test]
    fn garbage_on_a_connection_fails_ops_with_a_clear_error() {
        let (b, mut raw) = backend_with_raw_peer();
        raw.write_all(b"\x00garbage bytes that are not a weft frame").unwrap();
        let mut buf = [0u8; 4];
        let e = b.exchange(&mut [P2p::Recv { peer: 1, tag: 1, buf: &mut buf }], &Deadline::after(Duration::from_secs(5))).unwrap_err();
        assert!(e.to_string().contains("garbage on the connection from peer rank 1"), "{e}");
    }

    #[test]
    fn a_huge_unannounced_frame_is_refused_before_anything_is_allocated() {
        let (b, mut raw) = backend_with_raw_peer();
        // 2^40 bytes announced by a bare data frame (no rendezvous), with no
        // receive posted for it.
        raw.write_all(&Header { kind: Kind::Data, tag: 9, len: 1 << 40, lead: 0 }.encode()).unwrap();
        let mut buf = [0u8; 4];
        let e = b.exchange(&mut [P2p::Recv { peer: 1, tag: 1, buf: &mut buf }], &Deadline::after(Duration::from_secs(5))).unwrap_err();
        assert!(e.to_string().contains("peer rank 1 sent a 1099511627776-byte message"), "{e}");
        assert!(e.to_string().contains("unannounced"), "{e}");
    }

    #[test]
    fn a_frame_then_eof_delivers_the_frame_then_reports_peer_lost() {
        let (b, mut raw) = backend_with_raw_peer();
        let h = Header { kind: Kind::Data, tag: 7, len: 3, lead: 0 };
        raw.write_all(&h.encode()).unwrap();
        raw.write_all(b"abc").unwrap();
        drop(raw);
        let mut buf = [0u8; 3];
        let deadline = Deadline::after(Duration::from_secs(5));
        // The message sent before the crash may or may not be delivered
        // (EOF fails the transport), but the error always names the peer.
        match b.exchange(&mut [P2p::Recv { peer: 1, tag: 7, buf: &mut buf }], &deadline) {
            Ok(()) => assert_eq!(&buf, b"abc"),
            Err(e) => assert_eq!(e.kind(), &weft::ErrorKind::PeerLost { rank: 1 }),
        }
        let e = b.exchange(&mut [P2p::Recv { peer: 1, tag: 8, buf: &mut buf }], &deadline).unwrap_err();
        assert_eq!(e.kind(), &weft::ErrorKind::PeerLost { rank: 1 }, "{e}");
    }

    fn read_header(raw: &mut std::net::TcpStream) -> Header {
        let mut h = [0u8; crate::wire::HEADER];
        raw.read_exact(&mut h).unwrap();
        Header::decode(&h, 1).unwrap()
    }

    #[test]
    fn long_messages_wait_for_the_receiver_to_be_ready() {
        use crate::wire::EAGER_LIMIT;
        let (b, mut raw) = backend_with_raw_peer();
        raw.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let long = EAGER_LIMIT + 1;
        let deadline = Deadline::after(Duration::from_secs(10));
        std::thread::scope(|s| {
            // A long send: only its announcement goes out until Ready comes.
            let sender = s.spawn(|| {
                let data = vec![7u8; long];
                b.exchange(&mut [P2p::Send { peer: 1, tag: 3, data: &data }], &deadline)
            });
            assert_eq!(read_header(&mut raw), Header { kind: Kind::Announce, tag: 3, len: long as u64, lead: 0 });
            let mut byte = [0u8; 1];
            assert!(raw.read(&mut byte).is_err(), "data must wait for Ready");
            raw.write_all(&Header { kind: Kind::Ready, tag: 3, len: long as u64, lead: 0 }.encode()).unwrap();
            raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            // The payload follows the padding its lead names (wire::lead_for).
            let h = read_header(&mut raw);
            assert_eq!((h.kind, h.tag, h.len), (Kind::Data, 3, long as u64));
            let mut payload = vec![0u8; h.lead + long];
            raw.read_exact(&mut payload).unwrap();
            let payload = &payload[h.lead..];
            assert!(payload.iter().all(|x| *x == 7));
            sender.join().unwrap().unwrap();
        });
        // A long receive says Ready as soon as it is posted.
        std::thread::scope(|s| {
            let receiver = s.spawn(|| {
                let mut buf = vec![0u8; long];
                b.exchange(&mut [P2p::Recv { peer: 1, tag: 4, buf: &mut buf }], &deadline).map(|_| buf)
            });
            assert_eq!(read_header(&mut raw), Header { kind: Kind::Ready, tag: 4, len: long as u64, lead: 0 });
            // With padding between header and payload, which is skipped.
            raw.write_all(&Header { kind: Kind::Data, tag: 4, len: long as u64, lead: 40 }.encode()).unwrap();
            raw.write_all(&[0xee; 40]).unwrap();
            raw.write_all(&vec![9u8; long]).unwrap();
            assert!(receiver.join().unwrap().unwrap().iter().all(|x| *x == 9));
        });
        // An announcement that does not fit the posted receive fails it.
        raw.write_all(&Header { kind: Kind::Announce, tag: 5, len: long as u64, lead: 0 }.encode()).unwrap();
        let mut small = [0u8; 4];
        let e = b.exchange(&mut [P2p::Recv { peer: 1, tag: 5, buf: &mut small }], &deadline).unwrap_err();
        assert!(e.to_string().contains(&format!("sent {long} bytes, rank 0 expected 4 bytes")), "{e}");
    }

    #[test]
    fn a_long_send_whose_receive_is_never_posted_times_out_naming_the_peer() {
        let (b, _raw) = backend_with_raw_peer();
        let data = vec![1u8; crate::wire::EAGER_LIMIT + 1];
        let e = b.exchange(&mut [P2p::Send { peer: 1, tag: 3, data: &data }], &Deadline::after(Duration::from_millis(300))).unwrap_err();
        assert_eq!(e.kind(), &weft::ErrorKind::Timeout, "{e}");
        assert!(e.to_string().contains("peer rank 1 never posted the receive"), "{e}");
    }
}
