//! Entry point of the shm fuzz target in `fuzz/` (feature `fuzzing`): what
//! peers leave in the fast path's slots and markers, as rank 0 reads it.

use crate::fastbox::{Fastbox, Kind, Waiter, FASTBOX_BYTES};
use weft::backend::Deadline;
use weft::{DType, Error, ReduceOp, Result};

/// Peers that have published whatever they will: never wait.
struct Published;

impl Waiter for Published {
    fn wait_until(&self, peer: usize, _: &dyn Fn() -> String, _: &Deadline, ready: &dyn Fn() -> bool) -> Result<()> {
        if ready() {
            Ok(())
        } else {
            Err(Error::timeout(format!("rank {peer} has not published")))
        }
    }
    fn wake_sleepers(&self) {}
}

/// The fast path's shared memory for 2-4 ranks, every peer's part (slots
/// and markers) filled from the bytes, then one op of rank 0 over it (the
/// first bytes pick the world size, the op, its sizes, and whether peers'
/// first slots carry the right sequence number and description, which
/// random bytes rarely would). The op must finish or fail, never panic.
pub fn slots(data: &[u8]) {
    let byte = |i: usize| data.get(i).copied().unwrap_or(0) as usize;
    let size = 2 + byte(0) % 3;
    let len = Fastbox::len(size);
    // 64-byte aligned and zeroed, as a segment is.
    #[derive(Clone, Copy)]
    #[repr(align(64))]
    struct Line {
        _bytes: [u8; 64],
    }
    let mut mem = vec![Line { _bytes: [0; 64] }; len.div_ceil(64)];
    let base = mem.as_mut_ptr() as *mut u8;
    let fill = data.get(4..).unwrap_or_default();
    // SAFETY: `len` bytes of `mem`, written before any Fastbox reads them.
    let bytes = unsafe { std::slice::from_raw_parts_mut(base, len) };
    if !fill.is_empty() {
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = fill[i % fill.len()];
        }
    }
    let (dtype, op) =
        [(DType::F32, ReduceOp::Sum), (DType::I64, ReduceOp::Max), (DType::U8, ReduceOp::Min), (DType::F64, ReduceOp::Product)]
            [byte(1) / 8 % 4];
    let n = (byte(2) | byte(3) << 8) % (FASTBOX_BYTES + 1) / size / 8 * 8;
    let kind = match byte(1) % 6 {
        0 => Kind::AllReduce(dtype, op),
        1 => Kind::Broadcast(byte(2) % size),
        2 => Kind::AllGather,
        3 => Kind::ReduceScatter(dtype, op),
        4 => Kind::AllToAll,
        _ => Kind::Barrier,
    };
    if byte(1) & 0x80 != 0 {
        // Peers' slots for this rank's first op (k = 1, call 1) hold it.
        let what = kind.describe(match kind {
            Kind::AllGather | Kind::ReduceScatter(..) => n * size,
            Kind::Barrier => 0,
            _ => n,
        });
        for p in 1..size {
            let at = (2 * p + 1) * crate::fastbox::SLOT;
            bytes[at..at + 8].copy_from_slice(&1u64.to_le_bytes());
            bytes[at + 8..at + 16].copy_from_slice(&what.to_le_bytes());
            bytes[at + 16..at + 24].copy_from_slice(&1u64.to_le_bytes());
        }
    }
    // SAFETY: `base` is 64-byte aligned with `len` bytes of `mem` after it,
    // alive until the end of this function and used only through `fb`.
    let fb = unsafe { Fastbox::at(base, 0, size) };
    let d = Deadline::after(std::time::Duration::ZERO);
    let (w, input) = (&Published, vec![3u8; n]);
    let mut parts = vec![vec![0u8; n]; size];
    let mut outs: Vec<&mut [u8]> = parts.iter_mut().map(|p| &mut p[..]).collect();
    let _ = match kind {
        Kind::AllReduce(dtype, op) => fb.all_reduce(w, &mut vec![1u8; n], dtype, op, &d),
        Kind::Broadcast(root) => fb.broadcast(w, &mut vec![1u8; n], root, &d),
        Kind::AllGather => fb.all_gather(w, &input, &mut outs, &d),
        Kind::ReduceScatter(dtype, op) => fb.reduce_scatter(w, &vec![&input[..]; size], &mut vec![0u8; n], dtype, op, &d),
        Kind::AllToAll => fb.all_to_all(w, &vec![&input[..]; size], &mut outs, &d).map(drop),
        Kind::Barrier => fb.barrier(w, &d),
    };
    let _ = fb.rings_mismatch();
}
