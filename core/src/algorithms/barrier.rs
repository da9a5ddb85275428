//! Dissemination barrier: ceil(log2 W) rounds of empty messages; after round
//! k every rank has (transitively) heard from 2^(k+1) ranks.

use super::steps::Steps;
use crate::error::Result;

/// Return once every rank has entered.
pub fn dissemination(c: &Steps<'_>) -> Result<()> {
    let (w, r) = (c.size(), c.rank());
    let mut dist = 1;
    let mut step = 0;
    while dist < w {
        c.send_recv(step, (r + dist) % w, &[], (r + w - dist) % w, &mut [])?;
        dist <<= 1;
        step += 1;
    }
    Ok(())
}
