//! `WEFT_DEBUG=detail`: before each collective, ranks compare what they are
//! about to run, and a mismatch names the ranks and both calls (as
//! `TORCH_DISTRIBUTED_DEBUG=DETAIL` does). Costs one small all-to-all per op.

use crate::backend::{Backend, OpContext, OpKind, P2p};
use crate::error::{Error, Result};

/// Fixed size of a fingerprint on the wire.
const WIRE: usize = 256;

/// What must agree across ranks for one collective, hashed, plus a
/// human-readable description for the error.
#[derive(Clone, Debug)]
pub(crate) struct Fingerprint {
    hash: u64,
    text: String,
}

impl Fingerprint {
    /// `canon` lists the fields every rank must agree on for `kind`.
    pub(crate) fn new(name: &str, kind: OpKind, canon: String) -> Self {
        let hash = crate::shape::fnv1a(format!("{kind:?} {canon}").into_bytes());
        Fingerprint { hash, text: format!("{name}({canon})") }
    }

    fn encode(&self) -> [u8; WIRE] {
        let mut b = [0u8; WIRE];
        b[..8].copy_from_slice(&self.hash.to_le_bytes());
        let t = self.text.as_bytes();
        let n = t.len().min(WIRE - 10);
        b[8..10].copy_from_slice(&(n as u16).to_le_bytes());
        b[10..10 + n].copy_from_slice(&t[..n]);
        b
    }

    fn decode(b: &[u8; WIRE]) -> Self {
        let hash = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let n = (u16::from_le_bytes([b[8], b[9]]) as usize).min(WIRE - 10);
        Fingerprint { hash, text: String::from_utf8_lossy(&b[10..10 + n]).into_owned() }
    }
}

/// Exchange fingerprints with every rank; error naming the ranks that differ.
pub(crate) fn check(backend: &dyn Backend, ctx: &OpContext, mine: &Fingerprint) -> Result<()> {
    let (w, r) = (ctx.size, ctx.rank);
    if w == 1 {
        return Ok(());
    }
    let tag = crate::tag::collective(OpKind::DebugCheck as u8, ctx.seq, 0, 0);
    let out = mine.encode();
    let mut theirs = vec![[0u8; WIRE]; w];
    let mut ops: Vec<P2p<'_>> = (0..w).filter(|p| *p != r).map(|peer| P2p::Send { peer, tag, data: &out[..] }).collect();
    ops.extend(theirs.iter_mut().enumerate().filter(|(p, _)| *p != r).map(|(peer, buf)| P2p::Recv { peer, tag, buf: &mut buf[..] }));
    backend.exchange(&mut ops, &ctx.deadline)?;
    let prints: Vec<Fingerprint> = (0..w).map(|p| if p == r { mine.clone() } else { Fingerprint::decode(&theirs[p]) }).collect();
    if prints.iter().all(|f| f.hash == mine.hash) {
        return Ok(());
    }
    // Group ranks by what they called, most common first.
    let mut groups: Vec<(u64, String, Vec<usize>)> = Vec::new();
    for (p, f) in prints.iter().enumerate() {
        match groups.iter_mut().find(|g| g.0 == f.hash) {
            Some(g) => g.2.push(p),
            None => groups.push((f.hash, f.text.clone(), vec![p])),
        }
    }
    groups.sort_by_key(|g| std::cmp::Reverse(g.2.len()));
    let desc: Vec<String> = groups.iter().map(|(_, t, ranks)| format!("rank(s) {ranks:?} called {t}")).collect();
    Err(Error::invalid(format!("collective mismatch at collective #{} (WEFT_DEBUG=detail): {}", ctx.seq, desc.join("; "))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_round_trip_and_distinguish_ops() {
        let a = Fingerprint::new("all_reduce", OpKind::AllReduce, "f32 x 8 op sum".into());
        let b = Fingerprint::decode(&a.encode());
        assert_eq!((a.hash, a.text.as_str()), (b.hash, b.text.as_str()));
        let g = Fingerprint::new("all_gather_single", OpKind::AllGather, "f32 x 8 op sum".into());
        assert_ne!(a.hash, g.hash);
        // list and single forms of one canonical op agree
        let l = Fingerprint::new("all_gather", OpKind::AllGather, "f32 x 8 op sum".into());
        assert_eq!(l.hash, g.hash);
    }
}
