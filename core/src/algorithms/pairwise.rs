//! Pairwise exchange for all-to-all: in step s, send to rank+s and receive
//! from rank-s, so every rank talks to one peer in each direction at a time.

use super::Comm;
use crate::error::Result;

/// `outputs[i]` receives rank i's `inputs[rank]`.
pub fn all_to_all(c: &Comm<'_>, inputs: &[&[u8]], outputs: &mut [&mut [u8]]) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    crate::kernels::copy(outputs[r], inputs[r]);
    for s in 1..w {
        let (to, from) = ((r + s) % w, (r + w - s) % w);
        c.send_recv(s as u32, to, inputs[to], from, outputs[from])?;
    }
    Ok(())
}
