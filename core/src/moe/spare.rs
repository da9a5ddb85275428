//! Byte buffers a thread's MoE exchanges reuse from one call to the next.
//!
//! A dispatch or combine moves one buffer per peer each way, tens of MiB
//! at a training step's sizes. Fresh ones cost their page faults and
//! zeroing on every call (a fifth of a W = 4 step's time); kept ones are
//! already mapped. Buffers come back after each exchange and stay with
//! the thread that ran it (the caller's: Python's training loop, a
//! worker), up to [`KEEP_BYTES`] in all; their old contents are never
//! read: every taker overwrites all it takes.

use crate::error::{Error, Result};
use std::cell::RefCell;

/// Most bytes of spare buffers kept per thread.
pub(crate) const KEEP_BYTES: usize = 1 << 30;

/// Room a new buffer has past what was asked, so that a short trailer
/// (the exchange's status word) never moves it.
const ROOM: usize = 64;

thread_local! {
    static SPARE: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// A buffer of `n` bytes, whose contents the caller overwrites (a kept
/// buffer's old bytes, or zeros). An error where `n` bytes cannot be had
/// (a size a peer announced, perhaps falsely), never an abort. A new one
/// is zeroed pages the kernel maps as they are first written: of a size a
/// peer announced, only what it then sends is ever touched.
pub(crate) fn take(n: usize) -> Result<Vec<u8>> {
    let need = n.saturating_add(ROOM);
    let kept = SPARE.with_borrow_mut(|spare| {
        // The smallest that holds n and the room.
        let best = spare.iter().enumerate().filter(|(_, b)| b.capacity() >= need).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
        best.map(|i| spare.swap_remove(i))
    });
    let mut b = match kept {
        Some(b) => b,
        None => {
            // Asked first without zeroing, so that a size no allocator can
            // give is an error; `vec!` then takes zeroed memory (calloc:
            // fresh pages, untouched) and would abort instead.
            Vec::<u8>::new()
                .try_reserve_exact(need)
                .map_err(|e| Error::backend(format!("cannot allocate {n} bytes for an exchange: {e}")))?;
            let mut b = vec![0u8; need];
            b.truncate(n);
            return Ok(b);
        }
    };
    // Within its capacity: zeroed only past its current length.
    if b.len() >= n {
        b.truncate(n);
    } else {
        b.resize(n, 0);
    }
    Ok(b)
}

/// A buffer of `n` zero bytes.
pub(crate) fn zeros(n: usize) -> Result<Vec<u8>> {
    let mut b = take(n)?;
    b.fill(0);
    Ok(b)
}

/// Keep `bufs` for later takers, the largest first, up to [`KEEP_BYTES`]
/// (none too small to serve a taker).
pub(crate) fn give(bufs: impl IntoIterator<Item = Vec<u8>>) {
    SPARE.with_borrow_mut(|spare| {
        spare.extend(bufs.into_iter().filter(|b| b.capacity() > ROOM));
        spare.sort_unstable_by_key(|b| std::cmp::Reverse(b.capacity()));
        let mut kept = 0;
        spare.retain(|b| {
            kept += b.capacity();
            kept <= KEEP_BYTES
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_buffer_is_taken_again_without_new_memory() {
        let b = take(1 << 20).unwrap();
        let at = b.as_ptr();
        give([b]);
        let again = take(1000).unwrap();
        assert_eq!((again.as_ptr(), again.len()), (at, 1000));
        give([again]);
        // Grown back within its capacity, the same memory.
        let grown = take(1 << 20).unwrap();
        assert_eq!(grown.as_ptr(), at);
    }

    #[test]
    fn zeros_are_zero_even_in_a_used_buffer() {
        let mut b = take(64).unwrap();
        b.fill(7);
        give([b]);
        assert!(zeros(64).unwrap().iter().all(|x| *x == 0));
    }

    #[test]
    fn an_impossible_size_is_an_error() {
        let e = take(usize::MAX / 2).unwrap_err();
        assert!(e.to_string().contains("cannot allocate"), "{e}");
    }

    #[test]
    fn a_buffer_too_small_to_serve_is_not_kept() {
        give([Vec::with_capacity(8), Vec::new()]);
        assert!(SPARE.with_borrow(Vec::is_empty));
    }

    #[test]
    fn no_more_than_the_limit_is_kept() {
        give((0..5).map(|_| Vec::with_capacity(KEEP_BYTES / 4)));
        let kept: usize = SPARE.with_borrow(|s| s.iter().map(Vec::capacity).sum());
        assert!(kept <= KEEP_BYTES, "{kept}");
        SPARE.with_borrow_mut(Vec::clear);
    }
}
