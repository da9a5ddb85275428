//! All-to-all, two ways: pairwise exchange (in step s, send to rank+s and
//! receive from rank-s, one peer in each direction at a time), or every
//! send and receive at once, for the transport to move in whatever order
//! its peers allow (`select.rs` chooses).

use super::steps::Steps;
use crate::error::Result;

/// `outputs[i]` receives rank i's `inputs[rank]`, pairwise.
pub fn all_to_all(c: &Steps<'_>, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    crate::kernels::copy(outputs[r], inputs[r]);
    for s in 1..w {
        let (to, from) = ((r + s) % w, (r + w - s) % w);
        c.send_recv(s as u32, to, inputs[to], from, outputs[from])?;
    }
    Ok(())
}

/// As [`all_to_all`], with every send and receive posted at once
/// ([`super::linear::exchange_all`]): no rank waits for one peer while
/// another could be served (on more ranks than cores, the peer of a
/// pairwise step is often not running).
pub fn all_to_all_at_once(c: &Steps<'_>, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) -> Result<()> {
    let r = c.rank();
    crate::kernels::copy(outputs[r], inputs[r]);
    let mut recvs = [outputs.iter_mut().map(|o| &mut **o).collect::<Vec<&mut [u8]>>()];
    super::linear::exchange_all(c, &[inputs.to_vec()], &mut recvs)
}
