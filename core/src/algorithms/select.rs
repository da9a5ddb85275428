//! Choosing an algorithm per op: by message size and world size, unless the
//! op's hint `algorithm=NAME` or the group's `WEFT_ALGORITHM`
//! (`"all_reduce=ring,broadcast=binomial"`) names one.

use crate::backend::OpContext;
use crate::error::{Error, Result};

/// Environment variable with `op=algorithm` pairs for the whole group.
pub const ENV_ALGORITHM: &str = "WEFT_ALGORITHM";

/// The algorithm names each op accepts, the default first.
pub fn choices(op: &str) -> &'static [&'static str] {
    match op {
        "all_reduce" => &["auto", "ring", "recursive_doubling", "halving_doubling"],
        "broadcast" => &["auto", "binomial", "scatter_allgather", "chain"],
        "reduce" => &["auto", "binomial", "reduce_scatter_gather"],
        "all_to_all" => &["auto", "pairwise", "at_once"],
        "all_gather" => &["auto", "ring", "at_once"],
        _ => &["auto"],
    }
}

/// The algorithm `op` should use for `bytes` bytes, on a transport where a
/// message step costs about as much as `step_bytes` bytes
/// ([`Backend::step_bytes`](crate::backend::Backend::step_bytes)).
pub fn pick(ctx: &OpContext, op: &'static str, bytes: usize, step_bytes: usize) -> Result<&'static str> {
    let forced = ctx.hints.get("algorithm").cloned().or_else(|| from_env(op));
    let list = choices(op);
    let name = match forced {
        Some(n) => *list
            .iter()
            .find(|c| **c == n)
            .ok_or_else(|| Error::invalid(format!("{op} has no algorithm {n:?} (choices: {})", list.join(", "))))?,
        None => "auto",
    };
    if name != "auto" {
        return Ok(name);
    }
    Ok(match op {
        // Few, latency-bound steps for messages no larger than what a step
        // costs; bandwidth-optimal ring for large. (Measured at W=2: over
        // sockets recursive doubling wins up to 128 KiB; through shared
        // memory the ring wins from 32 KiB, where messages go single-copy
        // and its all-gather half is pushed by the rank that reduced it.)
        "all_reduce" if bytes <= step_bytes || ctx.size <= 1 => "recursive_doubling",
        // Medium sizes: a ring's 2(W-1) steps cost more than its bytes;
        // halving-doubling moves the same bytes in 2·log2(W) steps. Off a
        // power of two its fold moves the whole buffer once more.
        "all_reduce" if bytes <= 2 << 20 && ctx.size > 2 && ctx.size.is_power_of_two() => "halving_doubling",
        "all_reduce" => "ring",
        // The root sends the whole buffer log2(W) times with a tree. A
        // pipelined chain moves the fewest bytes (each link carries the
        // buffer once) once the buffer is long enough to fill the pipe;
        // between, scatter + all-gather needs only two phases (measured,
        // cpu-tcp and shm, W=4 and 8: the chain is 10-20 % faster from
        // 4 MiB, slower at 1 MiB on W=8).
        "broadcast" if bytes >= 4 << 20 && ctx.size > 2 => "chain",
        "broadcast" if bytes >= 512 << 10 && ctx.size > 2 => "scatter_allgather",
        "broadcast" => "binomial",
        // Likewise a tree reduce moves the whole buffer log2(W) times.
        "reduce" if bytes >= 512 << 10 && ctx.size > 2 => "reduce_scatter_gather",
        "reduce" => "binomial",
        // All-to-all (`bytes`: the largest block) posts every send and
        // receive at once: no rank waits on one peer while another could be
        // served. Measured with weft bench, shm, 64 MiB: W=4 24.0-27.8 ms
        // pairwise against 18.2-19.0 ms at once, W=8 63 against 40 ms;
        // W=4 1 MiB 96-99 against 82-83 µs; cpu-tcp W=4 1 MiB 475-484
        // against 323-334 µs. Only large blocks over sockets went the other
        // way (cpu-tcp W=4 64 MiB: 22.6-24.7 pairwise against 25.1-27.2 ms
        // at once): there, one stream per direction at a time.
        // (Two ranks: one peer, so nothing to overlap; pairwise as before.)
        "all_to_all" if ctx.size <= 2 || (bytes > 1 << 20 && step_bytes > 16 << 10) => "pairwise",
        "all_to_all" => "at_once",
        // All-gather (`bytes`: the largest block) likewise, where the ring's
        // W-1 steps each wait for a neighbour: through shared memory, with
        // blocks from 8 MiB (shm, 64 MiB in all: W=4 20.5-20.8 ring against
        // 16.9-18.3 ms at once, W=8 51-54 against 38 ms; 4 MiB blocks and
        // sockets showed no clear winner, and the ring stays).
        "all_gather" if ctx.size > 2 && bytes >= 8 << 20 && step_bytes <= 16 << 10 => "at_once",
        "all_gather" => "ring",
        _ => "auto",
    })
}

fn from_env(op: &str) -> Option<String> {
    // Read once: this runs on every op.
    static SETTING: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let v = SETTING.get_or_init(|| std::env::var(ENV_ALGORITHM).ok()).as_ref()?;
    v.split(',').filter_map(|p| p.split_once('=')).find(|(k, _)| k.trim() == op).map(|(_, a)| a.trim().to_string())
}

/// Default bytes per pipelined segment of a ring step: small enough that a
/// received segment is still in the L2 cache when it is reduced (measured
/// on 64 MiB all_reduce, W=2: 256 KiB beat 64 KiB, 1 MiB and unsegmented).
pub const SEGMENT_BYTES: usize = 256 << 10;

/// Bytes per segment of a pipelined ring step: the hint `segment_bytes`,
/// else [`SEGMENT_BYTES`]; rounded down to whole elements of `esize` bytes.
pub fn segment_bytes(ctx: &OpContext, esize: usize) -> Result<usize> {
    let bytes = match ctx.hints.get("segment_bytes") {
        None => SEGMENT_BYTES,
        Some(v) => v
            .parse::<usize>()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| Error::invalid(format!("hint segment_bytes={v:?} is not a positive byte count")))?,
    };
    Ok((bytes / esize).max(1) * esize)
}
