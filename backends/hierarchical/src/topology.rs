//! Which ranks share a host: every rank publishes its host identity in the
//! store and reads everyone's.

use weft::backend::BackendContext;
use weft::Result;

/// The group's hosts, each a list of ranks in rank order; hosts in the
/// order of their lowest rank.
pub struct Topology {
    pub hosts: Vec<Vec<usize>>,
    /// Index of this rank's host.
    pub mine: usize,
}

impl Topology {
    /// Collective: every rank of the group calls it.
    pub fn discover(ctx: &BackendContext) -> Result<Topology> {
        let all = weft::store::all_gather(&*ctx.store, "host", ctx.rank, ctx.size, ctx.timeout, weft::locality::host_of(ctx).as_bytes())?;
        let mut ids: Vec<Vec<u8>> = Vec::new();
        let mut hosts: Vec<Vec<usize>> = Vec::new();
        for (r, id) in all.into_iter().enumerate() {
            match ids.iter().position(|h| *h == id) {
                Some(i) => hosts[i].push(r),
                None => {
                    ids.push(id);
                    hosts.push(vec![r]);
                }
            }
        }
        let mine = hosts.iter().position(|h| h.contains(&ctx.rank)).expect("this rank published its host");
        Ok(Topology { hosts, mine })
    }

    /// This rank's host-mates, itself included.
    pub fn local(&self) -> &[usize] {
        &self.hosts[self.mine]
    }

    /// When every host has the same number of ranks (L > 1): for each local
    /// index i, the i-th rank of every host.
    pub fn cross(&self) -> Option<Vec<Vec<usize>>> {
        let l = self.hosts[0].len();
        if l < 2 || self.hosts.iter().any(|h| h.len() != l) {
            return None;
        }
        Some((0..l).map(|i| self.hosts.iter().map(|h| h[i]).collect()).collect())
    }

    /// The first rank of each host.
    pub fn leaders(&self) -> Vec<usize> {
        self.hosts.iter().map(|h| h[0]).collect()
    }
}
