//! Where a dispatch's tokens go and where they land, computed from the
//! routing alone (no I/O): what `mod.rs` sends and receives.
//!
//! Token side: a token crosses to a rank once, however many of its
//! experts live there ([`Plan`]). Its (token, slot) pairs routed to one
//! rank are listed in *canonical order* (token ascending, then slot
//! ascending), which both sides enumerate alike, so per-pair values (the
//! router's weights, their gradients) travel as plain lists in that order.
//!
//! Expert side: each sender's metadata (per token, its local experts)
//! says where each pair's row lands in the output, grouped by local
//! expert, then by source rank, then by the sender's token order
//! ([`Placement`]).

use crate::error::{Error, Result};

/// Bytes of a dispatch's header, one per peer: status, number of experts,
/// row bytes, dtype code, tokens and pairs sent to that peer, experts per
/// token (k), and whether the sender has a second part for any rank.
pub(crate) const HEADER: usize = 8 * 8;

/// Bytes of a dispatch's first part to each other rank of a group of
/// `world`: the header, then the start of the message (rows, then
/// metadata), zeros past its end. A size every rank knows, so that
/// receivers post it before they know any count; a message longer than
/// fits follows in a second part, sized by the header. 16 KiB up to 16
/// ranks, less beyond (a rank sends at most 256 KiB of first parts in all,
/// at least 1 KiB each).
pub(crate) fn first_part(world: usize) -> usize {
    ((256 << 10) / world.max(1)).clamp(1 << 10, 16 << 10) / 64 * 64
}

/// How many of a message's `len` bytes travel in its first part, in a
/// group of `world`.
pub(crate) fn in_first_part(len: usize, world: usize) -> usize {
    len.min(first_part(world) - HEADER)
}

/// What a rank tells each peer at the head of its data: whether its
/// routing is valid, what it agrees on with every rank, how much it sends,
/// and whether a second part follows anywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// Its routing was valid (else it sends nothing and every rank fails).
    pub ok: bool,
    /// The number of experts.
    pub experts: u64,
    /// Bytes per token row.
    pub row_bytes: u64,
    /// The rows' dtype code.
    pub dtype: u64,
    /// Tokens sent to this peer.
    pub tokens: u64,
    /// (token, expert) pairs sent to this peer.
    pub pairs: u64,
    /// Experts per token.
    pub k: u64,
    /// The sender has a message too long for its first part, to some rank
    /// (every rank learns from every header whether a second exchange runs).
    pub more: bool,
}

impl Header {
    /// Its bytes on the wire.
    pub(crate) fn encode(&self, out: &mut [u8]) {
        let words = [u64::from(!self.ok), self.experts, self.row_bytes, self.dtype, self.tokens, self.pairs, self.k, u64::from(self.more)];
        for (w, c) in words.iter().zip(out.chunks_exact_mut(8)) {
            c.copy_from_slice(&w.to_le_bytes());
        }
    }

    /// Bytes of the message this header announces (rows of `row` bytes,
    /// then the metadata), or why the counts cannot be a sender's: from
    /// one to `k` pairs per token, fewer than 2^32 pairs (`Plan::new`'s
    /// limit), a size that fits in memory's address range.
    pub(crate) fn message_bytes(&self, row: usize) -> std::result::Result<usize, String> {
        let most = self.tokens.saturating_mul(self.k);
        if self.pairs > u64::from(u32::MAX) || self.tokens > self.pairs || self.pairs > most {
            return Err(format!("{} tokens in {} pairs, with k = {}", self.tokens, self.pairs, self.k));
        }
        let (tokens, pairs) = (self.tokens as usize, self.pairs as usize);
        tokens
            .checked_mul(row)
            .and_then(|b| b.checked_add(meta_bytes(tokens, pairs)))
            .filter(|b| *b <= isize::MAX as usize)
            .ok_or_else(|| format!("{tokens} rows of {row} bytes"))
    }

    /// The header in `b` (`HEADER` bytes).
    pub(crate) fn decode(b: &[u8]) -> Header {
        let w = |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
        Header { ok: w(0) == 0, experts: w(1), row_bytes: w(2), dtype: w(3), tokens: w(4), pairs: w(5), k: w(6), more: w(7) != 0 }
    }
}

/// The token side of a dispatch: per destination rank, the tokens it
/// gets and the pairs (as `token * k + slot`) in canonical order, with
/// each pair's expert numbered locally on that rank.
#[derive(Clone, Debug, Default)]
pub(crate) struct Plan {
    /// Tokens sent to each rank, ascending.
    pub tokens: Vec<Vec<u32>>,
    /// Pairs sent to each rank, canonical order, as `token * k + slot`.
    pub pairs: Vec<Vec<u32>>,
    /// Each pair's expert, numbered on its rank (parallel to `pairs`).
    pub local: Vec<Vec<u32>>,
}

impl Plan {
    /// The plan for `topk` (`k` expert ids per token, `-1` for none) over
    /// `experts` experts spread evenly over `world` ranks (rank r holds
    /// experts `r * E/W .. (r + 1) * E/W`).
    pub(crate) fn new(topk: &[i64], k: usize, experts: usize, world: usize) -> Result<Plan> {
        if k == 0 {
            return Err(Error::invalid("k (experts per token) must be at least 1"));
        }
        if !topk.len().is_multiple_of(k) {
            return Err(Error::invalid(format!("topk_idx has {} entries, not a multiple of k = {k}", topk.len())));
        }
        if experts == 0 || !experts.is_multiple_of(world) {
            return Err(Error::invalid(format!(
                "num_experts = {experts} must be a positive multiple of the group size {world} (each rank holds the same number of experts)"
            )));
        }
        if topk.len() > u32::MAX as usize {
            return Err(Error::invalid("more than 2^32 (token, expert) pairs in one dispatch"));
        }
        let per_rank = experts / world;
        let mut plan = Plan { tokens: vec![Vec::new(); world], pairs: vec![Vec::new(); world], local: vec![Vec::new(); world] };
        for (t, slots) in topk.chunks_exact(k).enumerate() {
            for (j, &e) in slots.iter().enumerate() {
                if e == -1 {
                    continue;
                }
                if e < -1 || e as u64 >= experts as u64 {
                    return Err(Error::invalid(format!("topk_idx[{t}][{j}] = {e} is not an expert id (0..{experts}, or -1 for none)")));
                }
                let (rank, local) = (e as usize / per_rank, (e as usize % per_rank) as u32);
                if plan.tokens[rank].last() != Some(&(t as u32)) {
                    plan.tokens[rank].push(t as u32);
                }
                plan.pairs[rank].push((t * k + j) as u32);
                plan.local[rank].push(local);
            }
        }
        Ok(plan)
    }

    /// The metadata sent to `rank` with its rows: per token, its number of
    /// pairs there, then their local experts (u32 each, little-endian).
    pub(crate) fn meta(&self, rank: usize, k: usize, out: &mut [u8]) {
        let mut words = out.chunks_exact_mut(4);
        let mut put = |v: u32| words.next().expect("sized by meta_bytes").copy_from_slice(&v.to_le_bytes());
        let (pairs, local) = (&self.pairs[rank], &self.local[rank]);
        let mut i = 0;
        for &t in &self.tokens[rank] {
            let n = pairs[i..].iter().take_while(|p| **p as usize / k == t as usize).count();
            put(n as u32);
            for l in &local[i..i + n] {
                put(*l);
            }
            i += n;
        }
    }
}

/// Bytes of the metadata for `tokens` tokens and `pairs` pairs.
pub(crate) fn meta_bytes(tokens: usize, pairs: usize) -> usize {
    4 * (tokens + pairs)
}

/// The expert side of a dispatch: where each received pair's row lands.
#[derive(Clone, Debug, Default)]
pub(crate) struct Placement {
    /// Tokens received from each rank.
    pub tokens: Vec<usize>,
    /// Per source rank, each pair's output row, canonical order.
    pub rows: Vec<Vec<u32>>,
    /// Per source rank, each pair's token (its index in that rank's list).
    pub token_of: Vec<Vec<u32>>,
    /// Rows per local expert.
    pub counts: Vec<usize>,
}

impl Placement {
    /// The placement from every source's metadata (`metas[s]`, with
    /// `headers[s]`'s counts) for `per_rank` local experts; an error names
    /// the source whose metadata does not add up.
    pub(crate) fn new(metas: &[&[u8]], headers: &[Header], per_rank: usize) -> Result<Placement> {
        let world = metas.len();
        // Local expert of each pair, per source, and the token it belongs to.
        let mut experts: Vec<Vec<u32>> = Vec::with_capacity(world);
        let mut token_of: Vec<Vec<u32>> = Vec::with_capacity(world);
        let mut counts = vec![0usize; per_rank];
        for (s, (meta, h)) in metas.iter().zip(headers).enumerate() {
            let bad = |why: &str| Error::backend(format!("dispatch metadata from rank {s}: {why}"));
            let (tokens, pairs) = (h.tokens as usize, h.pairs as usize);
            if meta.len() != meta_bytes(tokens, pairs) {
                return Err(bad("wrong length"));
            }
            let mut words = meta.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")));
            let (mut ex, mut of) = (Vec::with_capacity(pairs), Vec::with_capacity(pairs));
            for t in 0..tokens {
                let n = words.next().ok_or_else(|| bad("ends early"))? as usize;
                if n == 0 || ex.len() + n > pairs {
                    return Err(bad("a token's pair count does not add up"));
                }
                for _ in 0..n {
                    let e = words.next().ok_or_else(|| bad("ends early"))? as usize;
                    if e >= per_rank {
                        return Err(bad("names an expert this rank does not hold"));
                    }
                    counts[e] += 1;
                    ex.push(e as u32);
                    of.push(t as u32);
                }
            }
            if ex.len() != pairs {
                return Err(bad("fewer pairs than announced"));
            }
            experts.push(ex);
            token_of.push(of);
        }
        // Rows grouped by local expert, then source, then token order.
        let mut next: Vec<usize> = counts.iter().scan(0, |at, c| Some(std::mem::replace(at, *at + c))).collect();
        let rows = experts
            .iter()
            .map(|ex| {
                ex.iter()
                    .map(|e| {
                        let row = next[*e as usize];
                        next[*e as usize] += 1;
                        row as u32
                    })
                    .collect()
            })
            .collect();
        Ok(Placement { tokens: headers.iter().map(|h| h.tokens as usize).collect(), rows, token_of, counts })
    }

    /// Rows in all.
    pub(crate) fn total(&self) -> usize {
        self.counts.iter().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_crosses_once_to_a_rank_holding_several_of_its_experts() {
        // 4 experts on 2 ranks; token 0 -> experts 0, 1 (both rank 0);
        // token 1 -> 3, -1; token 2 -> 2, 0.
        let plan = Plan::new(&[0, 1, 3, -1, 2, 0], 2, 4, 2).unwrap();
        assert_eq!(plan.tokens, vec![vec![0, 2], vec![1, 2]]);
        assert_eq!(plan.pairs, vec![vec![0, 1, 5], vec![2, 4]]);
        assert_eq!(plan.local, vec![vec![0, 1, 0], vec![1, 0]]);
    }

    #[test]
    fn bad_routing_is_refused_with_its_position() {
        let e = Plan::new(&[0, 4], 2, 4, 2).unwrap_err();
        assert!(e.to_string().contains("topk_idx[0][1] = 4"), "{e}");
        assert!(Plan::new(&[0, -2], 2, 4, 2).is_err());
        let e = Plan::new(&[0, 1], 2, 3, 2).unwrap_err();
        assert!(e.to_string().contains("multiple of the group size"), "{e}");
        assert!(Plan::new(&[0, 1, 2], 2, 4, 2).is_err());
    }

    #[test]
    fn rows_land_grouped_by_expert_then_source_then_token() {
        // Rank 1 of 2 with experts 2, 3 (local 0, 1). Rank 0 sends token
        // 0 -> (3), token 1 -> (2, 3); rank 1 itself sends token 0 -> (2).
        let from0 = Plan::new(&[3, -1, 2, 3], 2, 4, 2).unwrap();
        let from1 = Plan::new(&[2, -1], 2, 4, 2).unwrap();
        let mut metas = Vec::new();
        let mut headers = Vec::new();
        for plan in [&from0, &from1] {
            let (t, p) = (plan.tokens[1].len(), plan.pairs[1].len());
            let mut m = vec![0u8; meta_bytes(t, p)];
            plan.meta(1, 2, &mut m);
            metas.push(m);
            headers.push(Header { ok: true, experts: 4, row_bytes: 8, dtype: 0, tokens: t as u64, pairs: p as u64, k: 8, more: false });
        }
        let metas: Vec<&[u8]> = metas.iter().map(|m| &m[..]).collect();
        let placed = Placement::new(&metas, &headers, 2).unwrap();
        assert_eq!(placed.counts, vec![2, 2]);
        // Expert 2 (local 0): rank 0's token 1, then rank 1's token 0.
        // Expert 3 (local 1): rank 0's token 0, then its token 1.
        assert_eq!(placed.rows, vec![vec![2, 0, 3], vec![1]]);
        assert_eq!(placed.token_of, vec![vec![0, 1, 1], vec![0]]);
        assert_eq!(placed.total(), 4);
    }

    #[test]
    fn a_header_no_sender_could_write_is_refused_before_its_size_is_used() {
        let h = |tokens: u64, pairs: u64| Header { ok: true, experts: 8, row_bytes: 16, dtype: 0, tokens, pairs, k: 2, more: false };
        assert_eq!(h(2, 3).message_bytes(16), Ok(2 * 16 + 4 * 5));
        assert_eq!(h(0, 0).message_bytes(16), Ok(0));
        assert!(h(3, 2).message_bytes(16).is_err(), "more tokens than pairs");
        assert!(h(0, 1).message_bytes(16).is_err(), "pairs without tokens");
        assert!(h(2, 5).message_bytes(16).is_err(), "more than k pairs a token");
        let many = Header { k: 1 << 40, ..h(1, 1 << 32) };
        assert!(many.message_bytes(16).is_err(), "2^32 pairs");
        let huge = Header { k: 1, ..h(u32::MAX.into(), u32::MAX.into()) };
        assert!(huge.message_bytes(usize::MAX / 4).is_err(), "past the address range");
    }

    #[test]
    fn first_parts_are_16_kib_up_to_16_ranks_and_256_kib_in_all_beyond() {
        assert_eq!((first_part(1), first_part(2), first_part(16)), (16 << 10, 16 << 10, 16 << 10));
        assert_eq!((first_part(64), first_part(256), first_part(4096)), (4 << 10, 1 << 10, 1 << 10));
        assert_eq!(first_part(3) % 64, 0);
        assert_eq!((in_first_part(100, 2), in_first_part(1 << 20, 2)), (100, (16 << 10) - HEADER));
    }

    #[test]
    fn metadata_that_does_not_add_up_is_refused() {
        let h = Header { ok: true, experts: 4, row_bytes: 8, dtype: 0, tokens: 1, pairs: 1, k: 1, more: true };
        // One token with 2 pairs where 1 was announced.
        let meta: Vec<u8> = [2u32, 0].iter().flat_map(|w| w.to_le_bytes()).collect();
        assert!(Placement::new(&[&meta], &[h], 2).is_err());
        // An expert the rank does not hold.
        let meta: Vec<u8> = [1u32, 7].iter().flat_map(|w| w.to_le_bytes()).collect();
        assert!(Placement::new(&[&meta], &[h], 2).is_err());
        let mut b = [0u8; HEADER];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b), h);
    }
}
