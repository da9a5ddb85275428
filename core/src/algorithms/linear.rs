//! Gather and scatter: the root posts all W-1 transfers in one batch.

use super::Comm;
use crate::backend::P2p;
use crate::error::Result;

/// Root's `outputs[i]` receives rank i's `input`.
pub fn gather(c: &Comm<'_>, input: &[u8], outputs: &mut [&mut [u8]], root: usize) -> Result<()> {
    let r = c.rank();
    if r != root {
        return c.send(0, root, input);
    }
    outputs[r].copy_from_slice(input);
    let tag = c.tag(0);
    let mut ops: Vec<P2p<'_>> =
        outputs.iter_mut().enumerate().filter(|(i, _)| *i != r).map(|(peer, buf)| P2p::Recv { peer, tag, buf }).collect();
    c.exchange(&mut ops)
}

/// Every rank's `output` receives root's `inputs[rank]`.
pub fn scatter(c: &Comm<'_>, inputs: &[&[u8]], output: &mut [u8], root: usize) -> Result<()> {
    let r = c.rank();
    if r != root {
        return c.recv(0, root, output);
    }
    output.copy_from_slice(inputs[r]);
    let tag = c.tag(0);
    let mut ops: Vec<P2p<'_>> =
        inputs.iter().enumerate().filter(|(i, _)| *i != r).map(|(peer, data)| P2p::Send { peer, tag, data }).collect();
    c.exchange(&mut ops)
}
