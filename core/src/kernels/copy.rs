//! Copies into op outputs, and cache prefetch hints.

/// Copies at least this long stream to memory (see [`copy`]). The
/// crossover sits near a core's L2 size; this is above it on current
/// x86 servers (1-2 MiB of L2 per core).
pub const STREAM_COPY_BYTES: usize = 4 << 20;

/// Whether a copy from `src` to `dst` falls where AMD's Zen cores run
/// `rep movsb` some 15-20 times slower: the destination 1 to 31 bytes
/// past the source within a page. The kernel copies with it (a socket's
/// buffers, a cross-memory read or write), and so does glibc's `memcpy`
/// from 4 KiB up to one core's L2 size (512 KiB here) (figures: bench/RESULTS.md, "Measurements behind code comments").
/// [`copy`] steers around it; copies the kernel makes must be placed away
/// from it.
pub fn slow_copy_distance(dst: usize, src: usize) -> bool {
    (1..32).contains(&(dst.wrapping_sub(src) % 4096))
}

/// Pieces a copy at [`slow_copy_distance`] is cut in: below the size from
/// which glibc's `memcpy` takes `rep movsb` on every x86 variant (2 KiB
/// for SSE2, 4 KiB for AVX2, 8 KiB for AVX-512), so each piece moves with
/// vector loads and stores (figures: bench/RESULTS.md, "Measurements behind code comments").
const PIECE: usize = 2 << 10;

/// `dst.copy_from_slice(src)`, for an op's output or a transport's
/// buffer. Up to 16 bytes (a frame's header, a small payload or part) it
/// is a few moves in line, not a `memcpy` call: most copies of a small op
/// are that short, and each call was some 15 instructions of it. From
/// [`STREAM_COPY_BYTES`] on x86_64 it uses non-temporal stores: a copy
/// that large cannot stay in this core's cache anyway, and streaming skips
/// reading each destination line before writing it (figures: bench/RESULTS.md, "Measurements behind code comments"). glibc does the same above a threshold it derives
/// from the L3 size, which virtual machines often report as the host's
/// whole cache (260 MiB here: never). Between, a copy at the
/// [`slow_copy_distance`] goes in pieces of 2 KiB.
#[inline]
pub fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy between slices of different lengths");
    let n = src.len();
    // Two moves of a word each, overlapping when `n` is between the sizes.
    if (8..=16).contains(&n) {
        let (a, b): ([u8; 8], [u8; 8]) = (src[..8].try_into().expect("8 bytes"), src[n - 8..].try_into().expect("8 bytes"));
        dst[..8].copy_from_slice(&a);
        dst[n - 8..].copy_from_slice(&b);
        return;
    }
    if (4..8).contains(&n) {
        let (a, b): ([u8; 4], [u8; 4]) = (src[..4].try_into().expect("4 bytes"), src[n - 4..].try_into().expect("4 bytes"));
        dst[..4].copy_from_slice(&a);
        dst[n - 4..].copy_from_slice(&b);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if src.len() >= STREAM_COPY_BYTES {
        return stream_copy(dst, src);
    }
    if n > PIECE && slow_copy_distance(dst.as_ptr() as usize, src.as_ptr() as usize) {
        for (d, s) in dst.chunks_mut(PIECE).zip(src.chunks(PIECE)) {
            d.copy_from_slice(s);
        }
        return;
    }
    dst.copy_from_slice(src);
}

/// `dst.copy_from_slice(src)` with non-temporal stores whatever its
/// length (on x86_64, from 64 bytes; elsewhere [`copy`]): for a piece of
/// a large destination filled piece by piece (a message arriving through
/// a transport's buffer), which cannot stay in this core's cache anyway;
/// streaming also skips reading each destination line before writing it
/// (figures: bench/RESULTS.md, twelfth session). Ends with a store fence,
/// as [`copy`]'s streaming does.
#[inline]
pub fn copy_to_memory(dst: &mut [u8], src: &[u8]) {
    assert_eq!(dst.len(), src.len(), "copy between slices of different lengths");
    #[cfg(target_arch = "x86_64")]
    if src.len() >= 64 {
        return stream_copy(dst, src);
    }
    copy(dst, src);
}

/// The streaming part of [`copy`]: plain copies up to the first 16-byte
/// aligned destination address and for the tail, 16-byte non-temporal
/// stores between, then a store fence so that later stores (a flag a peer
/// waits on, an offer to read this memory) are seen after the data.
#[cfg(target_arch = "x86_64")]
fn stream_copy(dst: &mut [u8], src: &[u8]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.as_ptr().align_offset(16).min(dst.len());
    let body = (dst.len() - head) / 64 * 64;
    dst[..head].copy_from_slice(&src[..head]);
    let (d, s) = (dst[head..head + body].as_mut_ptr(), src[head..head + body].as_ptr());
    for at in (0..body).step_by(64) {
        // SAFETY: `at + 64 <= body`, so every access lies inside the two
        // sub-slices taken above (which do not overlap: `&mut` and `&`);
        // loads are unaligned, stores are 16-byte aligned (`head`). SSE2 is
        // part of x86_64.
        unsafe {
            for lane in 0..4 {
                let v = _mm_loadu_si128(s.add(at + 16 * lane) as *const __m128i);
                _mm_stream_si128(d.add(at + 16 * lane) as *mut __m128i, v);
            }
        }
    }
    // SAFETY: a fence has no memory-safety preconditions.
    unsafe { _mm_sfence() };
    dst[head + body..].copy_from_slice(&src[head + body..]);
}

/// Ask the CPU to start loading `bytes` into cache: for rows read in an
/// order the hardware prefetcher cannot guess (a sorted view of unsorted
/// rows), issued a few rows ahead of their use. A hint only.
#[inline]
pub fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch never faults and changes no memory; the address
        // is inside a live slice anyway.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr() as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slow_copy_distance_is_1_to_31_bytes_ahead_within_a_page() {
        assert!(!slow_copy_distance(4096, 0) && !slow_copy_distance(16, 16) && !slow_copy_distance(0, 24));
        assert!(slow_copy_distance(24, 0) && slow_copy_distance(8192 + 31, 4096) && slow_copy_distance(4104, 0));
        assert!(!slow_copy_distance(32, 0) && !slow_copy_distance(4095, 4094 + 32));
        assert!(slow_copy_distance(5, usize::MAX - 10), "wraps around the address space");
    }

    #[test]
    fn short_copies_move_exactly_their_bytes() {
        let src: Vec<u8> = (1..=40).collect();
        for n in 0..=32 {
            let mut dst = [0u8; 40];
            copy(&mut dst[1..1 + n], &src[1..1 + n]);
            assert_eq!(&dst[1..1 + n], &src[1..1 + n], "{n} bytes");
            assert!(dst[0] == 0 && dst[1 + n..].iter().all(|&b| b == 0), "{n} bytes: a byte outside them moved");
        }
    }

    /// Every byte lands, whatever the destination's alignment and the
    /// length's remainder, on both sides of the streaming threshold.
    #[test]
    fn copy_is_exact_at_any_alignment_and_length() {
        let src: Vec<u8> = (0..STREAM_COPY_BYTES + 200).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut dst = vec![0u8; src.len() + 32];
        let lens = [0, 5, 63, 64, 65, 1000, PIECE + 1, 64 << 10, STREAM_COPY_BYTES - 1, STREAM_COPY_BYTES, STREAM_COPY_BYTES + 129];
        for (name, f) in [("copy", copy as fn(&mut [u8], &[u8])), ("copy_to_memory", copy_to_memory)] {
            for len in lens {
                for (d_off, s_off) in [(0, 0), (1, 0), (7, 3), (15, 17), (16, 1)] {
                    dst.fill(0);
                    f(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                    assert!(dst[d_off..d_off + len] == src[s_off..s_off + len], "{name}: len {len}, offsets {d_off}/{s_off}");
                    assert!(dst[..d_off].iter().chain(&dst[d_off + len..]).all(|b| *b == 0), "{name}: len {len}: wrote outside");
                }
            }
        }
    }

    /// A copy at the slow distance (cut in pieces) moves every byte and
    /// no other, whatever its remainder of a piece.
    #[test]
    fn copies_at_the_slow_distance_are_exact() {
        let room = (64 << 10) + 4096;
        let mut buf = vec![0u8; 2 * room + 4096];
        for (len, dist) in [(PIECE + 1, 16), (64 << 10, 1), ((64 << 10) + 77, 31), (3 * PIECE - 5, 24)] {
            buf.fill(0);
            let (src, dst) = buf.split_at_mut(room);
            src.iter_mut().enumerate().for_each(|(i, b)| *b = (i * 13 + i / 509) as u8 | 1);
            // `dst` starts `room` (whole pages) past `src`: `dist` more is
            // that far past it within a page.
            assert!(slow_copy_distance(dst[dist..].as_ptr() as usize, src.as_ptr() as usize), "{len}/{dist}");
            copy(&mut dst[dist..dist + len], &src[..len]);
            assert!(dst[dist..dist + len] == src[..len], "len {len}, distance {dist}");
            assert!(dst[..dist].iter().chain(&dst[dist + len..]).all(|b| *b == 0), "len {len}: wrote outside");
        }
    }
}
