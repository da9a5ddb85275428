//! Single-copy transfers of large messages (cross-memory attach): the
//! sender puts only a descriptor (its buffer's address) in the ring and the
//! receiver copies straight out of the sender's memory with
//! `process_vm_readv`, one copy instead of two through the ring.
//!
//! One transfer per ordered pair is in flight at a time (the transport
//! streams one send per peer), tracked by a cell in the segment holding
//! `sequence << 3 | phase`:
//!
//! ```text
//! sender: POSTED ──receiver claims──> READING ──receiver done──> DONE
//!            │                            └─ sender waits (one syscall)
//!            ├─ sender gives up (timeout) ─> REVOKED: never read after this
//!            └─ receiver cannot read ──────> REFUSED: payload follows inline
//! ```
//!
//! The sender returns (and its buffer is the caller's again) only at DONE,
//! REVOKED or REFUSED-and-sent-inline, so the receiver never reads memory
//! the sender has given back.

use crate::sync::{AtomicU64, Ordering};

/// Messages at least this large go single-copy (below, the ring is faster
/// than a system call).
pub const MIN_BYTES: usize = 32 << 10;
/// Bytes of the descriptor after the frame header: address, sequence.
pub const DESCRIPTOR: usize = 16;

pub const POSTED: u64 = 0;
pub const READING: u64 = 1;
pub const DONE: u64 = 2;
pub const REVOKED: u64 = 3;
pub const REFUSED: u64 = 4;

/// The state of one ordered pair's transfer, on its own cache line.
#[repr(C, align(64))]
pub struct Cell(AtomicU64);

const fn word(seq: u64, phase: u64) -> u64 {
    (seq << 3) | phase
}

impl Cell {
    /// Sender: transfer `seq` is offered.
    pub fn post(&self, seq: u64) {
        self.0.store(word(seq, POSTED), Ordering::Release);
    }
    /// The phase of transfer `seq` (`None` if the cell holds another one).
    pub fn phase(&self, seq: u64) -> Option<u64> {
        let w = self.0.load(Ordering::Acquire);
        (w >> 3 == seq).then_some(w & 7)
    }
    /// Move `seq` from POSTED to `to`; the phase found if it was not POSTED.
    pub fn advance(&self, seq: u64, to: u64) -> std::result::Result<(), Option<u64>> {
        self.0.compare_exchange(word(seq, POSTED), word(seq, to), Ordering::AcqRel, Ordering::Acquire).map(drop).map_err(|w| {
            if w >> 3 == seq {
                Some(w & 7)
            } else {
                None
            }
        })
    }
    /// Receiver: leave READING for `to` (REFUSED when it cannot read).
    pub fn advance_from_reading(&self, seq: u64, to: u64) {
        self.0.store(word(seq, to), Ordering::Release);
    }
    /// Receiver: the read of `seq` is over.
    pub fn done(&self, seq: u64) {
        self.0.store(word(seq, DONE), Ordering::Release);
    }
}

/// The descriptor: the sender's buffer address and the transfer's sequence.
pub fn descriptor(addr: u64, seq: u64) -> [u8; DESCRIPTOR] {
    let mut d = [0u8; DESCRIPTOR];
    d[..8].copy_from_slice(&addr.to_le_bytes());
    d[8..].copy_from_slice(&seq.to_le_bytes());
    d
}

/// Address and sequence from a descriptor.
pub fn parse(d: &[u8]) -> (u64, u64) {
    (u64::from_le_bytes(d[..8].try_into().expect("8 bytes")), u64::from_le_bytes(d[8..16].try_into().expect("8 bytes")))
}

/// Why a read failed.
pub enum ReadError {
    /// The kernel or a security policy forbids reading the peer (EPERM,
    /// ENOSYS): fall back to inline transfers.
    Forbidden(nix::errno::Errno),
    /// Anything else (a bad address: a protocol error).
    Failed(nix::errno::Errno),
}

/// Copy `dst.len()` bytes from `addr` in process `pid` into `dst`.
pub fn read(pid: u32, addr: u64, dst: &mut [u8]) -> std::result::Result<(), ReadError> {
    use nix::sys::uio::{process_vm_readv, RemoteIoVec};
    let mut got = 0;
    while got < dst.len() {
        let remote = [RemoteIoVec { base: addr as usize + got, len: dst.len() - got }];
        let mut local = [std::io::IoSliceMut::new(&mut dst[got..])];
        match process_vm_readv(nix::unistd::Pid::from_raw(pid as i32), &mut local, &remote) {
            Ok(0) => return Err(ReadError::Failed(nix::errno::Errno::EFAULT)),
            Ok(n) => got += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(e @ (nix::errno::Errno::EPERM | nix::errno::Errno::ENOSYS | nix::errno::Errno::EACCES)) => {
                return Err(ReadError::Forbidden(e))
            }
            Err(e) => return Err(ReadError::Failed(e)),
        }
    }
    Ok(())
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn phases_and_races() {
        let c = Cell(AtomicU64::new(0));
        c.post(5);
        assert_eq!(c.phase(5), Some(POSTED));
        assert_eq!(c.phase(4), None);
        // The receiver claims it; the sender can then no longer revoke.
        assert!(c.advance(5, READING).is_ok());
        assert_eq!(c.advance(5, REVOKED), Err(Some(READING)));
        c.done(5);
        assert_eq!(c.phase(5), Some(DONE));
        // A revoked transfer cannot be claimed.
        c.post(6);
        assert!(c.advance(6, REVOKED).is_ok());
        assert_eq!(c.advance(6, READING), Err(Some(REVOKED)));
    }

    #[test]
    fn reads_this_process() {
        let src: Vec<u8> = (0..100_000u32).map(|i| i as u8).collect();
        let mut dst = vec![0u8; src.len()];
        match read(std::process::id(), src.as_ptr() as u64, &mut dst) {
            Ok(()) => assert_eq!(dst, src),
            Err(ReadError::Forbidden(_)) => {} // a sandbox without CMA: the fallback covers it
            Err(ReadError::Failed(e)) => panic!("{e}"),
        }
    }
}

/// Model check of claim against withdraw (`RUSTFLAGS="--cfg loom"`): the
/// receiver reads the sender's buffer only if it claimed the offer, and the
/// sender reuses it only after DONE or a successful withdrawal. The buffer
/// is a tracked cell, so a read after reuse is a reported race.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;

    #[test]
    fn loom_a_withdrawn_offer_is_never_read() {
        loom::model(|| {
            let cell = Arc::new(Cell(AtomicU64::new(0)));
            let buffer = Arc::new(UnsafeCell::new(7u8));
            cell.post(1);
            let receiver = {
                let (cell, buffer) = (cell.clone(), buffer.clone());
                loom::thread::spawn(move || {
                    if cell.advance(1, READING).is_ok() {
                        // SAFETY: claimed: the sender keeps the buffer until DONE.
                        let v = buffer.with(|p| unsafe { *p });
                        assert_eq!(v, 7);
                        cell.done(1);
                    }
                })
            };
            // The sender gives up: withdraw, or wait for a read in progress.
            match cell.advance(1, REVOKED) {
                Ok(()) => {}
                Err(_) => {
                    while cell.phase(1) != Some(DONE) {
                        loom::thread::yield_now();
                    }
                }
            }
            // SAFETY: withdrawn or read: the buffer is the sender's again.
            buffer.with_mut(|p| unsafe { *p = 0xEE });
            receiver.join().unwrap();
        });
    }
}
