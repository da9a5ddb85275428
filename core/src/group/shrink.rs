//! Carrying on after a rank dies, as MPI's ULFM proposal and NCCL's
//! `ncclCommShrink` do: [`ProcessGroup::revoke`] fails the group on every
//! rank, [`ProcessGroup::shrink`] makes a new group of the ranks still
//! alive, [`ProcessGroup::agree`] gives the survivors one value.
//!
//! Survivors agree through the group's store (which must outlive the dead
//! rank: `weft run` and torchrun host it in the launcher), in a *survey*:
//! each survivor checks in with the ranks it knows are dead; the first to
//! arrive (by the store's atomic counter) decides once every rank has
//! checked in or is known dead, or when the wait runs out, and publishes
//! the decision, which every survivor reads. So every survivor gets the
//! same membership. If the deciding rank dies in the middle, the others
//! fail at their timeout rather than disagree. The deciding rule is
//! [`decide`], free of I/O.

use super::{GroupCore, ProcessGroup};
use crate::error::{Error, ErrorKind, Result};
use crate::store::{PrefixStore, Store};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The store key a revoking rank sets (to its rank) in the group's store.
const REVOKED: &str = "revoked";
/// Longest a survey waits, by default, for a rank that neither checked in
/// nor is known dead (the group's timeout if shorter).
const DEFAULT_WAIT: Duration = Duration::from_secs(10);
/// How often the deciding rank looks for new check-ins.
const POLL: Duration = Duration::from_millis(2);

/// Options of [`ProcessGroup::shrink`] and [`ProcessGroup::agree`].
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

/// One survivor's check-in: the ranks it knows are dead, and its value
/// (for `agree`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CheckIn {
    /// Ranks this survivor saw die.
    pub dead: Vec<usize>,
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

/// The decision once it can be made: every rank of `checkins` (indexed
/// by rank; None: not heard from) has checked in, is excluded, or is known
/// dead by some survivor that checked in; or `expired` (the wait ran out),
/// when whoever has not checked in is left out. Ranks excluded are left out
/// even if they checked in. None: keep waiting.
pub(crate) fn decide(checkins: &[Option<CheckIn>], exclude: &[usize], expired: bool) -> Option<Decision> {
    let known_dead = |r: usize| exclude.contains(&r) || checkins.iter().flatten().any(|c| c.dead.contains(&r));
    let waiting = checkins.iter().enumerate().any(|(r, c)| c.is_none() && !known_dead(r));
    if waiting && !expired {
        return None;
    }
    let members: Vec<usize> = (0..checkins.len()).filter(|&r| checkins[r].is_some() && !exclude.contains(&r)).collect();
    let value = members.iter().filter_map(|&r| checkins[r].as_ref()).fold(u64::MAX, |v, c| v & c.value);
    Some(Decision { members, value })
}

fn encode_list(v: &[usize]) -> String {
    v.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(",")
}

fn decode_list(s: &str) -> Result<Vec<usize>> {
    s.split(',').filter(|x| !x.is_empty()).map(|x| x.parse().map_err(|_| Error::backend(format!("bad rank {x:?} in a survey")))).collect()
}

impl CheckIn {
    fn encode(&self) -> Vec<u8> {
        format!("{};{}", encode_list(&self.dead), self.value).into_bytes()
    }
    fn decode(b: &[u8]) -> Result<CheckIn> {
        let s = String::from_utf8_lossy(b);
        let (dead, value) = s.split_once(';').ok_or_else(|| Error::backend(format!("bad check-in {s:?}")))?;
        Ok(CheckIn { dead: decode_list(dead)?, value: value.parse().map_err(|_| Error::backend(format!("bad check-in {s:?}")))? })
    }
}

impl Decision {
    fn encode(&self) -> Vec<u8> {
        format!("{};{}", encode_list(&self.members), self.value).into_bytes()
    }
    fn decode(b: &[u8]) -> Result<Decision> {
        let c = CheckIn::decode(b)?;
        Ok(Decision { members: c.dead, value: c.value })
    }
}

impl GroupCore {
    /// `e`, explained: a lost peer in a group some rank revoked is the
    /// revocation (`Aborted`), not a death. Only on error paths (one store
    /// lookup).
    pub(super) fn explain(&self, e: Error) -> Error {
        if !matches!(e.kind(), ErrorKind::PeerLost { .. }) {
            return e;
        }
        match self.store.check(&[REVOKED]) {
            Ok(true) => match self.store.get(REVOKED, Duration::from_millis(200)) {
                Ok(by) => Error::aborted(format!("rank {} revoked the group ({e})", String::from_utf8_lossy(&by))),
                Err(_) => e,
            },
            _ => e,
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
    /// `value`: every survivor gets the same decision.
    fn survey(&self, what: &'static str, n: u64, value: u64, opts: &ShrinkOptions) -> Result<(Arc<dyn Store>, Decision)> {
        let fail = |e: Error| e.with_op(what).with_rank(self.rank);
        if let Some(r) = opts.exclude.iter().find(|&&r| r >= self.size) {
            return Err(fail(Error::invalid(format!("cannot exclude rank {r}: the group has {} ranks", self.size))));
        }
        let store: Arc<dyn Store> = Arc::new(PrefixStore::new(format!("survey{n}"), self.store.clone()));
        let wait = opts.wait.unwrap_or(self.options.timeout.min(DEFAULT_WAIT));
        let mine = CheckIn { dead: self.known_dead(), value };
        store.set(&format!("in/{}", self.rank), &mine.encode()).map_err(fail)?;
        if store.add("decider", 1).map_err(fail)? == 1 {
            let decision = self.decide_survey(&*store, opts, wait).map_err(fail)?;
            store.set("decision", &decision.encode()).map_err(fail)?;
        }
        let got = store.get("decision", wait + self.options.timeout).map_err(|e| fail(e.context("waiting for the survivors' decision")))?;
        Ok((store, Decision::decode(&got).map_err(fail)?))
    }

    /// As the deciding rank: gather check-ins until [`decide`] says.
    fn decide_survey(&self, store: &dyn Store, opts: &ShrinkOptions, wait: Duration) -> Result<Decision> {
        let until = Instant::now() + wait;
        let mut checkins: Vec<Option<CheckIn>> = vec![None; self.size];
        loop {
            for (r, slot) in checkins.iter_mut().enumerate() {
                let key = format!("in/{r}");
                if slot.is_none() && store.check(&[key.as_str()])? {
                    *slot = Some(CheckIn::decode(&store.get(&key, self.options.timeout)?)?);
                }
            }
            if let Some(d) = decide(&checkins, &opts.exclude, Instant::now() >= until) {
                return Ok(d);
            }
            std::thread::sleep(POLL);
        }
    }
}

impl ProcessGroup {
    /// Mark this group failed on every rank (ULFM's `MPI_Comm_revoke`):
    /// this rank's pending and later ops fail with `Aborted` at once, and
    /// so do every other rank's as they touch this one (their pending ops
    /// promptly; the failure spreads through each rank that sees it). Then
    /// [`ProcessGroup::shrink`] makes a usable group, with everyone if
    /// nobody died.
    pub fn revoke(&self) {
        let c = &self.core;
        // Set before the transports fail, so peers that see this rank go
        // find why.
        let _ = c.store.set(REVOKED, c.rank.to_string().as_bytes());
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
        Some(CheckIn { dead: dead.to_vec(), value })
    }

    #[test]
    fn decides_once_every_rank_is_in_or_known_dead() {
        // Rank 2 died; rank 1 saw it; rank 3 has not checked in yet.
        let mut c = vec![ck(&[], 7), ck(&[2], 3), None, None];
        assert_eq!(decide(&c, &[], false), None);
        c[3] = ck(&[], 1);
        assert_eq!(decide(&c, &[], false), Some(Decision { members: vec![0, 1, 3], value: 1 }));
        // Nobody knows rank 2 is dead: wait until the time runs out.
        c[1] = ck(&[], 3);
        assert_eq!(decide(&c, &[], false), None);
        assert_eq!(decide(&c, &[], true), Some(Decision { members: vec![0, 1, 3], value: 1 }));
        // Excluded ranks are left out even when alive.
        c[2] = ck(&[], 0);
        assert_eq!(decide(&c, &[0], false), Some(Decision { members: vec![1, 2, 3], value: 0 }));
    }

    #[test]
    fn check_ins_and_decisions_survive_the_store() {
        let c = CheckIn { dead: vec![1, 4], value: u64::MAX };
        assert_eq!(CheckIn::decode(&c.encode()).unwrap(), c);
        let d = Decision { members: vec![], value: 0 };
        assert_eq!(Decision::decode(&d.encode()).unwrap(), d);
        assert!(CheckIn::decode(b"1,x;2").is_err());
    }
}
