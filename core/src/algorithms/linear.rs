//! Gather and scatter: the root posts all W-1 transfers in one batch; and
//! the same one-batch exchange between every pair of ranks at once (an
//! all-gather's too).

use super::steps::Steps;
use crate::backend::{Gather, GatherSend, P2p};
use crate::error::Result;

/// Root's `outputs[i]` receives rank i's `input`.
pub fn gather(c: &Steps<'_>, input: &[u8], outputs: &mut [&mut [u8]], root: usize) -> Result<()> {
    let r = c.rank();
    if r != root {
        return c.send(0, root, input);
    }
    crate::kernels::copy(outputs[r], input);
    let tag = c.tag(0);
    let mut ops: Vec<P2p<'_>> =
        outputs.iter_mut().enumerate().filter(|(i, _)| *i != r).map(|(peer, buf)| P2p::Recv { peer, tag, buf }).collect();
    c.exchange(&mut ops)
}

/// Every rank's `output` receives root's `inputs[rank]`.
pub fn scatter(c: &Steps<'_>, inputs: &[&[u8]], output: &mut [u8], root: usize) -> Result<()> {
    let r = c.rank();
    if r != root {
        return c.recv(0, root, output);
    }
    crate::kernels::copy(output, inputs[r]);
    let tag = c.tag(0);
    let mut ops: Vec<P2p<'_>> =
        inputs.iter().enumerate().filter(|(i, _)| *i != r).map(|(peer, data)| P2p::Send { peer, tag, data }).collect();
    c.exchange(&mut ops)
}

/// Every rank exchanges with every other rank in one batch: for each part
/// j (tagged as step j), rank i receives `sends[j][i]` from this rank and
/// `outputs[i]` receives rank i's `input`: every send and receive at once.
pub fn all_gather(c: &Steps<'_>, input: &[u8], outputs: &mut [&mut [u8]]) -> Result<()> {
    crate::kernels::copy(outputs[c.rank()], input);
    let mut recvs = [outputs.iter_mut().map(|o| &mut **o).collect::<Vec<&mut [u8]>>()];
    exchange_all(c, &[vec![input; c.size()]], &mut recvs)
}

/// `recvs[j][i]` receives rank i's `sends[j][rank]`. This rank's own
/// entries are left alone. One step instead of the W-1 steps of a ring or a
/// pairwise exchange: for small, latency-bound messages, where the steps
/// cost more than the links running at once.
pub fn exchange_all(c: &Steps<'_>, sends: &[Vec<&[u8]>], recvs: &mut [Vec<&mut [u8]>]) -> Result<()> {
    exchange_all_gathered(c, sends, &[], recvs)
}

/// [`exchange_all`] with more parts whose sends are gathered (rows that
/// lie where the caller left them, [`Gather`]): part `sends.len() + j`
/// sends `gathered[j][i]` to rank i; `recvs` has every part's receives.
pub fn exchange_all_gathered(
    c: &Steps<'_>,
    sends: &[Vec<&[u8]>],
    gathered: &[Vec<&dyn Gather>],
    recvs: &mut [Vec<&mut [u8]>],
) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    debug_assert_eq!(sends.len() + gathered.len(), recvs.len());
    let mut ops: Vec<P2p<'_>> = Vec::with_capacity((2 * sends.len() + gathered.len()) * w);
    let mut gathered_sends = Vec::with_capacity(gathered.len() * w);
    for (j, ins) in recvs.iter_mut().enumerate() {
        let tag = c.tag(j as u32);
        let mut ins: Vec<Option<&mut [u8]>> = ins.iter_mut().map(|b| Some(&mut **b)).collect();
        // Peer r+s first for sends and r-s for receives, as pairwise exchange
        // orders them, so ranks do not all start on the same peer.
        for s in 1..w {
            let (to, from) = ((r + s) % w, (r + w - s) % w);
            match sends.get(j) {
                Some(outs) => ops.push(P2p::Send { peer: to, tag, data: outs[to] }),
                None => gathered_sends.push(GatherSend { peer: to, tag, src: gathered[j - sends.len()][to] }),
            }
            ops.push(P2p::Recv { peer: from, tag, buf: ins[from].take().expect("each peer once") });
        }
    }
    if gathered_sends.is_empty() {
        c.exchange(&mut ops)
    } else {
        c.exchange_gathered(&mut ops, &gathered_sends)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithms::testing::run_ranks;
    use crate::backend::OpKind;

    #[test]
    fn exchange_all_delivers_each_part_from_every_peer() {
        // Part 0: 3 bytes naming (from, to); part 1: a length that differs per pair.
        let msg = |j: usize, from: usize, to: usize| vec![(10 * from + to) as u8; if j == 0 { 3 } else { 1 + from + 2 * to }];
        // Bytes a send gathers (here: from one buffer, a piece at a time).
        struct Pieces(Vec<u8>);
        impl Gather for Pieces {
            fn len(&self) -> usize {
                self.0.len()
            }
            fn fill(&self, at: usize, dst: &mut [u8]) {
                dst.copy_from_slice(&self.0[at..at + dst.len()]);
            }
        }
        for (w, gather) in (1..=6).flat_map(|w| [(w, false), (w, true)]) {
            let got = run_ranks(w, OpKind::AllToAll, |r, b, ctx| {
                let c = Steps::new(b, ctx);
                let outs: Vec<Vec<Vec<u8>>> = (0..2).map(|j| (0..w).map(|to| msg(j, r, to)).collect()).collect();
                let mut ins: Vec<Vec<Vec<u8>>> = (0..2).map(|j| (0..w).map(|from| vec![0u8; msg(j, from, r).len()]).collect()).collect();
                let sends: Vec<Vec<&[u8]>> = outs.iter().map(|o| o.iter().map(Vec::as_slice).collect()).collect();
                let mut recvs: Vec<Vec<&mut [u8]>> = ins.iter_mut().map(|i| i.iter_mut().map(Vec::as_mut_slice).collect()).collect();
                if gather {
                    // Part 1 gathered: the same bytes must arrive.
                    let pieces: Vec<Pieces> = outs[1].iter().cloned().map(Pieces).collect();
                    let gathered = [pieces.iter().map(|p| p as &dyn Gather).collect()];
                    exchange_all_gathered(&c, &sends[..1], &gathered, &mut recvs).unwrap();
                } else {
                    exchange_all(&c, &sends, &mut recvs).unwrap();
                }
                ins
            });
            for (r, ins) in got.iter().enumerate() {
                for (j, part) in ins.iter().enumerate() {
                    for (from, m) in part.iter().enumerate() {
                        let want = if from == r { vec![0u8; m.len()] } else { msg(j, from, r) };
                        assert_eq!(m, &want, "w={w} rank {r} part {j} from {from}");
                    }
                }
            }
        }
    }
}
