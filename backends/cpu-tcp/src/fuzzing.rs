//! Entry points of the fuzz targets in `fuzz/` (feature `fuzzing`): bytes
//! a peer or a stranger sends, arriving on one end of a socket pair.

use crate::transport::TcpBackend;
use socket2::Socket;
use std::io::Write;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::backend::{Backend, P2p};

/// At most this much of an input is sent (a socket pair holds it all, so
/// writing never waits for the reader).
const MAX_INPUT: usize = 64 << 10;

/// Rank 0's end of a socket pair, and the other end, which sent `data` and
/// then shut its side.
fn pair_with(data: &[u8]) -> (Socket, UnixStream) {
    let (ours, mut theirs) = UnixStream::pair().expect("a socket pair");
    let _ = theirs.write_all(&data[..data.len().min(MAX_INPUT)]);
    let _ = theirs.shutdown(std::net::Shutdown::Write);
    (Socket::from(std::os::fd::OwnedFd::from(ours)), theirs)
}

/// A peer's frames: the bytes after the first arrive from rank 1 while rank
/// 0 waits in an exchange whose receives (and one send) the first byte
/// picks. The exchange must end, with its receives filled or an error.
pub fn frames(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else { return };
    let (ours, _theirs) = pair_with(rest);
    let store = Arc::new(weft::store::MemoryStore::new(Duration::from_secs(1)));
    let Ok(b) = TcpBackend::start(0, vec![None, Some(ours)], store, std::time::Duration::from_secs(1)) else { return };
    let sizes = [0usize, 1, 8, 24, 4096];
    let (mut a, mut c) = (vec![0u8; sizes[pick as usize % 5]], vec![0u8; sizes[(pick as usize / 5) % 5]]);
    let out = [7u8; 16];
    let mut ops = vec![P2p::Recv { peer: 1, tag: u64::from(pick & 3), buf: &mut a }, P2p::Recv { peer: 1, tag: 9, buf: &mut c }];
    if pick & 0x80 != 0 {
        ops.push(P2p::Send { peer: 1, tag: 5, data: &out });
    }
    let _ = b.exchange(&mut ops, &weft::backend::Deadline::after(Duration::from_millis(50)));
    b.shutdown();
}

/// A stranger's handshake: the bytes after the first arrive on a connection
/// rank 0 of 4 accepted (the first byte picks whether the job has a key).
/// It is refused, or accepted as one peer, within the handshake's time.
pub fn handshake(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else { return };
    let (ours, _theirs) = pair_with(rest);
    let key = weft::auth::Key::new(b"the fuzzing key, sixteen bytes or more".to_vec()).expect("a valid key");
    let accepted = std::sync::Mutex::new(Vec::new());
    let until = Instant::now() + Duration::from_millis(50);
    let _ = crate::connect::handshake(&ours, 0, 4, 0x5eed, until, (pick & 1 == 1).then_some(&key), &accepted);
}
