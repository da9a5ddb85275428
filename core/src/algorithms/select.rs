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
        "all_reduce" => &["auto", "ring", "recursive_doubling"],
        "broadcast" => &["auto", "binomial", "scatter_allgather"],
        "reduce" => &["auto", "binomial", "reduce_scatter_gather"],
        _ => &["auto"],
    }
}

/// The algorithm `op` should use for `bytes` bytes.
pub fn pick(ctx: &OpContext, op: &'static str, bytes: usize) -> Result<&'static str> {
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
        // Few, latency-bound steps for small messages; bandwidth-optimal ring for large.
        "all_reduce" if bytes <= 64 << 10 || ctx.size <= 1 => "recursive_doubling",
        "all_reduce" => "ring",
        // The root sends the whole buffer log2(W) times with a tree; for large
        // buffers scatter + all-gather sends it about twice in total.
        "broadcast" if bytes >= 512 << 10 && ctx.size > 2 => "scatter_allgather",
        "broadcast" => "binomial",
        // Likewise a tree reduce moves the whole buffer log2(W) times.
        "reduce" if bytes >= 512 << 10 && ctx.size > 2 => "reduce_scatter_gather",
        "reduce" => "binomial",
        _ => "auto",
    })
}

fn from_env(op: &str) -> Option<String> {
    // Read once: this runs on every op.
    static SETTING: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let v = SETTING.get_or_init(|| std::env::var(ENV_ALGORITHM).ok()).as_ref()?;
    v.split(',').filter_map(|p| p.split_once('=')).find(|(k, _)| k.trim() == op).map(|(_, a)| a.trim().to_string())
}
