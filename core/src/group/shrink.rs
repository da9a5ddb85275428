//! Carrying on after a rank dies, as MPI's ULFM proposal and NCCL's
//! `ncclCommShrink` do: [`ProcessGroup::revoke`] fails the group on every
//! rank, [`ProcessGroup::shrink`] makes a new group of the ranks still
//! alive, [`ProcessGroup::agree`] gives the survivors one value.
//!
//! Survivors agree through the group's store (which must outlive the dead
//! rank: `weft run` and torchrun host it in the launcher), in a *survey*:
//! each survivor checks in (with the ranks it knows are dead and those it
//! wants left out), then watches the others' check-ins until [`decide`]
//! says every rank has checked in, is left out, or is known dead (after a
//! short grace, since a rank that gave up on a stalled peer may be blamed
//! while alive), or until its wait runs out. It then offers its decision
//! with the store's compare-and-set: the first offer is the decision, the
//! same for every survivor, whoever made it and whoever dies meanwhile.
//! The deciding rule is [`decide`], free of I/O.
//!
//! Limits: survivors must run their surveys (`shrink`, `agree`) in the
//! same order, and one that fails on some ranks only (its store
//! unreachable) puts them out of step; a rank left out must not survey the
//! old group again; a member that dies while the new group is being set up
//! fails that setup at the group's timeout (shrink again then).

use super::{GroupCore, ProcessGroup};
use crate::error::{Error, ErrorKind, Result};
use crate::store::{PrefixStore, Store};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The store key a rank sets (`revoked/RANK`) when it revokes the group,
/// or learns that it was revoked: its peers then know that its leaving is
/// the revocation, not a death.
const REVOKED: &str = "revoked";
/// Longest a survey waits, by default, for a rank that neither checked in
/// nor is known dead (the group's timeout if shorter).
const DEFAULT_WAIT: Duration = Duration::from_secs(10);
/// How often a survivor looks for new check-ins.
const POLL: Duration = Duration::from_millis(2);
/// How long a survey still waits for a rank that a survivor says is dead,
/// once every other rank is in: one that gave up on a stalled peer blames
/// itself to the others while it is alive, and checks in soon.
const GRACE: Duration = Duration::from_millis(100);

/// Options of [`ProcessGroup::shrink`] and [`ProcessGroup::agree`]. Each
/// survivor's `exclude` counts (their union is left out); `wait` bounds
/// each survivor's own wait.
#[derive(Clone, Debug, Default)]
pub struct ShrinkOptions {
    /// Ranks to leave out even if alive (`shrink(exclude=...)`).
    pub exclude: Vec<usize>,
    /// How long to wait for a rank that has not checked in and that no
    /// survivor knows to be dead (a stopped or hung process); None: the
    /// group's timeout, at most 10 s.
    pub wait: Option<Duration>,
}

impl ShrinkOptions {
    /// Leave out `ranks` too.
    pub fn exclude(mut self, ranks: impl IntoIterator<Item = usize>) -> Self {
        self.exclude.extend(ranks);
        self
    }
    /// Wait at most `wait` for ranks not heard from.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = Some(wait);
        self
    }
}

/// One survivor's check-in: the ranks it knows are dead, those it wants
/// left out, and its value (for `agree`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CheckIn {
    /// Ranks this survivor saw die.
    pub dead: Vec<usize>,
    /// Ranks this survivor wants left out.
    pub exclude: Vec<usize>,
    /// Its value.
    pub value: u64,
}

/// What the survivors agreed on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Decision {
    /// The ranks of the old group that go on, in rank order.
    pub members: Vec<usize>,
    /// The bitwise AND of their values.
    pub value: u64,
}

/// The decision once it can be made (None: keep waiting). Every rank of
/// `checkins` (indexed by rank; None: not heard from) must have checked
/// in, be left out by some survivor, or be said dead by one, and those
/// said dead are still waited for until `grace_over`; once `expired` (the
/// wait ran out) whoever has not checked in is left out. Left-out ranks
/// are left out even if they checked in.
pub(crate) fn decide(checkins: &[Option<CheckIn>], grace_over: bool, expired: bool) -> Option<Decision> {
    let heard = || checkins.iter().flatten();
    let excluded = |r: usize| heard().any(|c| c.exclude.contains(&r));
    let said_dead = |r: usize| heard().any(|c| c.dead.contains(&r));
    let missing = |r: usize| checkins[r].is_none() && !excluded(r);
    let waiting = (0..checkins.len()).any(|r| missing(r) && (!said_dead(r) || !grace_over));
    if waiting && !expired {
        return None;
    }
    let members: Vec<usize> = (0..checkins.len()).filter(|&r| checkins[r].is_some() && !excluded(r)).collect();
    let value = members.iter().filter_map(|&r| checkins[r].as_ref()).fold(u64::MAX, |v, c| v & c.value);
    Some(Decision { members, value })
}

fn encode_list(v: &[usize]) -> String {
    v.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",")
}

fn decode_list(s: &str) -> Result<Vec<usize>> {
    s.split(',').filter(|x| !x.is_empty()).map(|x| x.parse().map_err(|_| Error::backend(format!("bad rank {x:?} in a survey")))).collect()
}

/// `a;b;value` (two rank lists and a number) from the store.
fn decode_parts(b: &[u8]) -> Result<(Vec<usize>, Vec<usize>, u64)> {
    let s = String::from_utf8_lossy(b);
    let bad = || Error::backend(format!("bad survey record {s:?}"));
    let mut parts = s.split(';');
    let (Some(a), Some(b), Some(v), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else { return Err(bad()) };
    Ok((decode_list(a)?, decode_list(b)?, v.parse().map_err(|_| bad())?))
}

impl CheckIn {
    fn encode(&self) -> Vec<u8> {
        format!("{};{};{}", encode_list(&self.dead), encode_list(&self.exclude), self.value).into_bytes()
    }
    fn decode(b: &[u8]) -> Result<CheckIn> {
        decode_parts(b).map(|(dead, exclude, value)| CheckIn { dead, exclude, value })
    }
}

impl Decision {
    fn encode(&self) -> Vec<u8> {
        format!("{};;{}", encode_list(&self.members), self.value).into_bytes()
    }
    fn decode(b: &[u8]) -> Result<Decision> {
        decode_parts(b).map(|(members, _, value)| Decision { members, value })
    }
}

impl GroupCore {
    /// `e`, explained: a lost peer that left because the group was revoked
    /// (it set `revoked/PEER`) is the revocation (`Aborted`), not a death;
    /// this rank then says it knows too, so its own leaving is read alike.
    /// Only on error paths (a store lookup).
    pub(super) fn explain(&self, e: Error) -> Error {
        let ErrorKind::PeerLost { rank: peer } = *e.kind() else { return e };
        let key = format!("{REVOKED}/{peer}");
        if !matches!(self.store.check(&[key.as_str()]), Ok(true)) {
            return e;
        }
        self.mark_revoked();
        Error::aborted(format!("the group was revoked (rank {peer} left because of it: {e})"))
    }

    /// Record in the store that this rank's group is revoked (once).
    fn mark_revoked(&self) {
        if !self.revoked.swap(true, Ordering::AcqRel) {
            let _ = self.store.set(&format!("{REVOKED}/{}", self.rank), b"1");
        }
    }

    /// The ranks this rank knows are dead: the one its group's failure
    /// names, if a peer was lost.
    fn known_dead(&self) -> Vec<usize> {
        match self.poisoned.get().map(|e| e.kind()) {
            Some(ErrorKind::PeerLost { rank }) => vec![*rank],
            _ => Vec::new(),
        }
    }

    /// Run survey number `n` (`what` names it in errors) with this rank's
    /// `value`: every survivor gets the same decision (see the module docs).
    fn survey(&self, what: &'static str, n: u64, value: u64, opts: &ShrinkOptions) -> Result<(Arc<dyn Store>, Decision)> {
        let fail = |e: Error| e.with_op(what).with_rank(self.rank);
        if let Some(r) = opts.exclude.iter().find(|&&r| r >= self.size) {
            return Err(fail(Error::invalid(format!("cannot exclude rank {r}: the group has {} ranks", self.size))));
        }
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(format!("survey{n}"), self.store.clone()));
        let start = Instant::now();
        let wait = opts.wait.unwrap_or(self.options.timeout.min(DEFAULT_WAIT));
        let mine = CheckIn { dead: self.known_dead(), exclude: opts.exclude.clone(), value };
        store.set(&format!("in/{}", self.rank), &mine.encode()).map_err(fail)?;
        let mut checkins: Vec<Option<CheckIn>> = vec![None; self.size];
        loop {
            // A decision made already (by another survivor) is the one.
            if store.check(&["decision"]).map_err(fail)? {
                let got = store.get("decision", self.options.timeout).map_err(fail)?;
                return Ok((store, Decision::decode(&got).map_err(fail)?));
            }
            for (r, slot) in checkins.iter_mut().enumerate() {
                let key = format!("in/{r}");
                if slot.is_none() && store.check(&[key.as_str()]).map_err(fail)? {
                    *slot = Some(CheckIn::decode(&store.get(&key, self.options.timeout).map_err(fail)?).map_err(fail)?);
                }
            }
            let waited = start.elapsed();
            if let Some(d) = decide(&checkins, waited >= GRACE, waited >= wait) {
                // Offer it: the first offer stored is everyone's decision.
                let got = store.compare_set("decision", b"", &d.encode()).map_err(fail)?;
                return Ok((store, Decision::decode(&got).map_err(fail)?));
            }
            std::thread::sleep(POLL);
        }
    }
}

impl ProcessGroup {
    /// Mark this group failed (ULFM's `MPI_Comm_revoke`): this rank's
    /// pending and later ops fail with `Aborted` at once; another rank's
    /// fail with `Aborted` as they touch this one or a rank that already
    /// failed (its pending collectives promptly), and each rank that fails
    /// so passes it on. A rank idle meanwhile learns at its next op with
    /// one of them. Then [`ProcessGroup::shrink`] makes a usable group,
    /// with everyone if nobody died.
    pub fn revoke(&self) {
        let c = &self.core;
        // Marked before the transports fail, so peers that see this rank go
        // find why.
        c.mark_revoked();
        c.poison(Error::aborted(format!("rank {} revoked the group", c.rank)).with_rank(c.rank));
    }

    /// A new group of the ranks still alive (ULFM's `MPI_Comm_shrink`,
    /// NCCL's `ncclCommShrink`). Every survivor calls it, typically after
    /// an op failed with `PeerLost` (or after [`ProcessGroup::revoke`]);
    /// they agree on who is alive (see the module docs), leaving out dead
    /// ranks, ranks that did not check in within `opts.wait`, and
    /// `opts.exclude`; ranks keep their order. The new group has fresh
    /// connections and segments, so nothing of this group's can reach it.
    /// A rank left out gets `Aborted`. Survivors must call `shrink` and
    /// [`ProcessGroup::agree`] in the same order.
    pub fn shrink(&self, opts: &ShrinkOptions) -> Result<ProcessGroup> {
        let c = &self.core;
        let n = c.surveys.fetch_add(1, Ordering::Relaxed);
        let (store, d) = c.survey("shrink", n, 0, opts)?;
        let Some(new_rank) = d.members.iter().position(|&r| r == c.rank) else {
            return Err(Error::aborted(format!(
                "rank {} was left out of the shrunk group (the survivors agreed on ranks {:?})",
                c.rank, d.members
            ))
            .with_op("shrink")
            .with_rank(c.rank));
        };
        crate::log::info(format_args!("rank {} shrinks its group to ranks {:?} as rank {new_rank}", c.rank, d.members));
        ProcessGroup::new(Arc::new(PrefixStore::new("group", store)), new_rank, d.members.len(), c.options.clone())
            .map_err(|e| e.context("shrink: setting up the new group"))
    }

    /// The bitwise AND of `value` over the ranks still alive (ULFM's
    /// `MPI_Comm_agree`), the same on every survivor: whether all of them
    /// succeeded at a step, say. Usable on a failed group; the survivors are
    /// found as [`ProcessGroup::shrink`] finds them (`opts`), and must call
    /// it in the same order as `shrink`.
    pub fn agree(&self, value: u64, opts: &ShrinkOptions) -> Result<u64> {
        let n = self.core.surveys.fetch_add(1, Ordering::Relaxed);
        self.core.survey("agree", n, value, opts).map(|(_, d)| d.value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ck(dead: &[usize], value: u64) -> Option<CheckIn> {
        Some(CheckIn { dead: dead.to_vec(), exclude: vec![], value })
    }

    #[test]
    fn decides_once_every_rank_is_in_or_known_dead() {
        // Rank 2 died; rank 1 saw it; rank 3 has not checked in yet.
        let mut c = vec![ck(&[], 7), ck(&[2], 3), None, None];
        assert_eq!(decide(&c, true, false), None);
        c[3] = ck(&[], 1);
        let d = Some(Decision { members: vec![0, 1, 3], value: 1 });
        assert_eq!(decide(&c, true, false), d);
        // A rank said dead is still waited for during the grace.
        assert_eq!(decide(&c, false, false), None);
        // Nobody knows rank 2 is dead: wait until the time runs out.
        c[1] = ck(&[], 3);
        assert_eq!(decide(&c, true, false), None);
        assert_eq!(decide(&c, true, true), d);
        // Ranks any survivor leaves out are left out even when alive.
        c[2] = ck(&[], 0);
        c[3] = Some(CheckIn { dead: vec![], exclude: vec![0], value: 1 });
        assert_eq!(decide(&c, false, false), Some(Decision { members: vec![1, 2, 3], value: 0 }));
    }

    #[test]
    fn check_ins_and_decisions_survive_the_store() {
        let c = CheckIn { dead: vec![1, 4], exclude: vec![2], value: u64::MAX };
        assert_eq!(CheckIn::decode(&c.encode()).unwrap(), c);
        let d = Decision { members: vec![], value: 0 };
        assert_eq!(Decision::decode(&d.encode()).unwrap(), d);
        assert!(CheckIn::decode(b"1,x;;2").is_err());
        assert!(CheckIn::decode(b"1;2").is_err());
    }
}
