//! Choosing an algorithm per op, in one place. When an op is issued,
//! [`forced`] settles the name it was told to use, if any: its hint
//! `algorithm=NAME`, else the group's hint, else the group's
//! `WEFT_ALGORITHM` entry for its family (`"all_reduce=ring,broadcast=binomial"`,
//! read once when the group is made, [`Setting`]), checked against core's
//! algorithms and the serving backend's own ([`Capabilities::native_algorithms`]).
//! The op carries it in [`OpContext::algorithm`]: a backend's fast path
//! steps aside for a name it does not offer (shm's fast path for small ops,
//! hierarchical's two-level all_reduce unless it is named), and the
//! family's choice ([`all_reduce`], [`broadcast`], ...) runs the name or,
//! with none, chooses by message size and world size.
//!
//! The families and core's algorithms are one table (`families!` below):
//! each family an enum whose variants the runner (`mod.rs`) matches
//! without a default, so a new algorithm is a line here, its rule in its
//! family's choice, and the arm the compiler then asks for in `mod.rs`.
//! (cuda-device offers `direct` and `staging` here as its own names; a
//! named `ring` is its device ring for all_reduce, and core's other names
//! run on the host, staged. Its hint `cuda_algorithm` takes the same names
//! and also reaches the families core has one way to run.)
//!
//! [`Capabilities::native_algorithms`]: crate::backend::Capabilities::native_algorithms

use crate::backend::{NativeAlgorithm, OpContext, OpKind};
use crate::error::{Error, Result};

/// Environment variable with `op=algorithm` pairs for the whole group.
pub const ENV_ALGORITHM: &str = "WEFT_ALGORITHM";

/// Declares the op families with a choice of algorithm and core's
/// algorithms for each, from one table: the [`Family`] enum, one enum per
/// family (its variants core's algorithms, matched exhaustively where they
/// run, `mod.rs`), and the names and choices derived from them.
/// One of core's algorithms, of one family (the enums `families!` makes).
pub trait Algorithm: Sized + Copy {
    /// The family it runs.
    const FAMILY: Family;
    /// The algorithm of that name, if core has it for this family.
    fn named(name: &str) -> Option<Self>;
    /// Its name.
    fn name(self) -> &'static str;
}

macro_rules! families {
    ($($family:ident $fname:literal $kind:ident => $alg:ident { $($variant:ident = $name:literal),+ $(,)? })+) => {
        /// An op family whose algorithm is chosen (other ops have one way to run).
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Family { $(#[doc = $fname] $family),+ }

        impl Family {
            /// Every family.
            pub const ALL: &'static [Family] = &[$(Family::$family),+];

            /// Its name (`WEFT_ALGORITHM`'s keys; what backends are asked about).
            pub fn name(self) -> &'static str {
                match self { $(Family::$family => $fname),+ }
            }

            /// The family an op of `kind` belongs to, if an algorithm is
            /// chosen for it (other ops ignore an `algorithm` hint).
            pub fn of(kind: OpKind) -> Option<Family> {
                match kind { $(OpKind::$kind => Some(Family::$family),)+ _ => None }
            }

            /// The names its ops accept from core: `"auto"` (the choice by
            /// size, the default) first, then its algorithms'.
            pub fn choices(self) -> &'static [&'static str] {
                match self { $(Family::$family => &["auto", $($name),+]),+ }
            }
        }

        $(
            #[doc = concat!("Core's algorithms for ", $fname, ".")]
            #[derive(Clone, Copy, Debug, PartialEq, Eq)]
            pub enum $alg { $(#[doc = $name] $variant),+ }

            impl Algorithm for $alg {
                const FAMILY: Family = Family::$family;
                fn named(name: &str) -> Option<$alg> {
                    match name { $($name => Some($alg::$variant),)+ _ => None }
                }
                fn name(self) -> &'static str {
                    match self { $($alg::$variant => $name),+ }
                }
            }
        )+
    };
}

families! {
    AllReduce "all_reduce" AllReduce => AllReduceAlgorithm { Ring = "ring", RecursiveDoubling = "recursive_doubling", HalvingDoubling = "halving_doubling" }
    Broadcast "broadcast" Broadcast => BroadcastAlgorithm { Binomial = "binomial", ScatterAllgather = "scatter_allgather", Chain = "chain" }
    Reduce "reduce" Reduce => ReduceAlgorithm { Binomial = "binomial", ReduceScatterGather = "reduce_scatter_gather" }
    AllToAll "all_to_all" AllToAll => AllToAllAlgorithm { Pairwise = "pairwise", AtOnce = "at_once" }
    AllGather "all_gather" AllGather => AllGatherAlgorithm { Ring = "ring", AtOnce = "at_once" }
}

/// A group's setting: its hint `algorithm` (every family) and
/// `WEFT_ALGORITHM`'s entries (per family), and its hint `segment_bytes`,
/// parsed once.
#[derive(Clone, Debug, Default)]
pub struct Setting {
    every: Option<String>,
    per_family: Vec<(Family, String)>,
    /// The group's segment size for pipelined steps, if it sets one.
    pub segment_bytes: Option<usize>,
}

impl Setting {
    /// The setting from a group hint `algorithm` and a `WEFT_ALGORITHM`
    /// value; a malformed entry or an unknown family is an error naming it.
    pub fn new(hint: Option<&str>, env: Option<&str>) -> Result<Setting> {
        let mut per_family = Vec::new();
        for entry in env.unwrap_or("").split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let bad = |why: String| Error::invalid(format!("{ENV_ALGORITHM}: entry {entry:?} {why}"));
            let (op, name) = entry.split_once('=').ok_or_else(|| bad("is not op=algorithm".into()))?;
            let family = Family::ALL.iter().find(|f| f.name() == op.trim()).ok_or_else(|| {
                let all: Vec<&str> = Family::ALL.iter().map(|f| f.name()).collect();
                bad(format!("names no op with a choice of algorithm ({})", all.join(", ")))
            })?;
            per_family.push((*family, name.trim().to_string()));
        }
        Ok(Setting { every: hint.map(str::to_string), per_family, segment_bytes: None })
    }

    /// The setting from the group's hints and the environment.
    pub fn from_env(hints: &std::collections::HashMap<String, String>) -> Result<Setting> {
        let mut s = Setting::new(hints.get("algorithm").map(String::as_str), std::env::var(ENV_ALGORITHM).ok().as_deref())?;
        s.segment_bytes = hints.get("segment_bytes").map(|v| parse_segment_bytes(v)).transpose()?;
        Ok(s)
    }

    fn for_family(&self, family: Family) -> Option<&str> {
        self.every.as_deref().or_else(|| self.per_family.iter().find(|(f, _)| *f == family).map(|(_, n)| n.as_str()))
    }
}

/// The algorithm an op of `family` is told to use: `hint` (the op's own
/// `algorithm` hint), else the group's `setting`; checked against core's
/// algorithms and `natives` (the serving backend's). `None`: none named,
/// or `"auto"`.
pub fn forced(family: Family, hint: Option<&str>, setting: &Setting, natives: &[NativeAlgorithm]) -> Result<Option<&'static str>> {
    let Some(name) = hint.or_else(|| setting.for_family(family)) else { return Ok(None) };
    let all = || family.choices().iter().copied().chain(natives.iter().filter(|a| a.family == family).map(|a| a.name));
    match all().find(|c| *c == name) {
        Some("auto") => Ok(None),
        Some(c) => Ok(Some(c)),
        None => {
            let all: Vec<&str> = all().collect();
            Err(Error::invalid(format!("{} has no algorithm {name:?} (choices: {})", family.name(), all.join(", "))))
        }
    }
}

/// Core's algorithm the op was told to use ([`OpContext::algorithm`],
/// checked when it was issued), else `by_size`.
fn told_or<A: Algorithm>(ctx: &OpContext, by_size: A) -> Result<A> {
    let Some(name) = ctx.algorithm else { return Ok(by_size) };
    // A backend's own name reaches here only if that backend declined the op.
    A::named(name).ok_or_else(|| {
        let core = &A::FAMILY.choices()[1..];
        Error::invalid(format!("{}: algorithm {name:?} is not one of core's ({})", A::FAMILY.name(), core.join(", ")))
    })
}

// Each family's choice: the algorithm the op was told to use, else one
// by size, on a transport where a message step costs about as much as
// `step_bytes` bytes ([`Capabilities::step_bytes`](crate::backend::Capabilities::step_bytes)).

/// All-reduce of `bytes` bytes.
pub fn all_reduce(ctx: &OpContext, bytes: usize, step_bytes: usize) -> Result<AllReduceAlgorithm> {
    use AllReduceAlgorithm::*;
    told_or(ctx, {
        // Few, latency-bound steps for messages no larger than what a step
        // costs; bandwidth-optimal ring for large (through shared memory
        // the ring wins early: its messages go single-copy and its
        // all-gather half is pushed by the rank that reduced it).
        if bytes <= step_bytes || ctx.size <= 1 {
            RecursiveDoubling
        // Medium sizes: a ring's 2(W-1) steps cost more than its bytes;
        // halving-doubling moves the same bytes in 2·log2(W) steps. Off a
        // power of two its fold moves the whole buffer once more. Up to 8
        // steps' worth: beyond, its large exchanges with ever farther
        // partners lose to the ring's pipelined neighbours (figures:
        // bench/RESULTS.md, "Algorithm choices").
        } else if bytes <= 8 * step_bytes && ctx.size > 2 && ctx.size.is_power_of_two() {
            HalvingDoubling
        } else {
            Ring
        }
    })
}

/// Broadcast of `bytes` bytes.
pub fn broadcast(ctx: &OpContext, bytes: usize) -> Result<BroadcastAlgorithm> {
    use BroadcastAlgorithm::*;
    // The root sends the whole buffer log2(W) times with a tree. A
    // pipelined chain moves the fewest bytes (each link carries the
    // buffer once) once the buffer is long enough to fill the pipe;
    // between, scatter + all-gather needs only two phases (figures:
    // bench/RESULTS.md, "Algorithm choices").
    told_or(
        ctx,
        match bytes {
            _ if ctx.size <= 2 => Binomial,
            b if b >= 4 << 20 => Chain,
            b if b >= 512 << 10 => ScatterAllgather,
            _ => Binomial,
        },
    )
}

/// Reduce of `bytes` bytes.
pub fn reduce(ctx: &OpContext, bytes: usize) -> Result<ReduceAlgorithm> {
    // Likewise a tree reduce moves the whole buffer log2(W) times.
    let by_size = if bytes >= 512 << 10 && ctx.size > 2 { ReduceAlgorithm::ReduceScatterGather } else { ReduceAlgorithm::Binomial };
    told_or(ctx, by_size)
}

/// All-to-all whose largest block is `bytes` bytes.
pub fn all_to_all(ctx: &OpContext, bytes: usize, step_bytes: usize) -> Result<AllToAllAlgorithm> {
    // Posts every send and receive at once: no rank waits on one peer while
    // another could be served. Only large blocks over sockets went the
    // other way: there, one stream per direction at a time (figures:
    // bench/RESULTS.md, "Algorithm choices").
    // (Two ranks: one peer, so nothing to overlap; pairwise as before.)
    let pairwise = ctx.size <= 2 || (bytes > 1 << 20 && step_bytes > 16 << 10);
    let by_size = if pairwise { AllToAllAlgorithm::Pairwise } else { AllToAllAlgorithm::AtOnce };
    told_or(ctx, by_size)
}

/// All-gather whose largest block is `bytes` bytes.
pub fn all_gather(ctx: &OpContext, bytes: usize, step_bytes: usize) -> Result<AllGatherAlgorithm> {
    // Likewise, where the ring's W-1 steps each wait for a neighbour:
    // through shared memory, with blocks from 8 MiB (smaller blocks and
    // sockets showed no clear winner, and the ring stays; figures:
    // bench/RESULTS.md, "Algorithm choices").
    let at_once = ctx.size > 2 && bytes >= 8 << 20 && step_bytes <= 16 << 10;
    let by_size = if at_once { AllGatherAlgorithm::AtOnce } else { AllGatherAlgorithm::Ring };
    told_or(ctx, by_size)
}

pub use super::pipeline::SEGMENT_BYTES;

/// The hint `segment_bytes`: a positive byte count.
pub fn parse_segment_bytes(v: &str) -> Result<usize> {
    v.parse::<usize>()
        .ok()
        .filter(|n| *n > 0)
        .ok_or_else(|| Error::invalid(format!("hint segment_bytes={v:?} is not a positive byte count")))
}

/// The segment size for a transport that hands over at most `buffered`
/// bytes to a peer before it receives ([`Capabilities::buffered_bytes`]), where
/// that calls for less than [`SEGMENT_BYTES`]: a chain keeps
/// four segments in flight (`chain.rs`), so they must fit together,
/// or every send waits for its receiver to run, which oversubscribed
/// ranks wait long for. Never below 16 KiB (a step's fixed cost).
/// (figures: bench/RESULTS.md, "Algorithm choices")
///
/// [`Capabilities::buffered_bytes`]: crate::backend::Capabilities::buffered_bytes
pub fn segment_for(buffered: Option<usize>) -> Option<usize> {
    let fitting = buffered? / super::chain::WINDOW;
    (fitting < SEGMENT_BYTES).then_some(fitting.max(16 << 10))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx(size: usize) -> OpContext {
        OpContext {
            rank: 0,
            size,
            name: "all_reduce",
            kind: OpKind::AllReduce,
            seq: 0,
            shape: 0,
            deadline: crate::backend::Deadline::after(std::time::Duration::from_secs(1)),
            hints: Default::default(),
            algorithm: None,
            segment_bytes: None,
            stream: None,
            completion: Default::default(),
        }
    }

    #[test]
    fn segments_shrink_to_fit_a_window_in_what_the_transport_buffers() {
        assert_eq!(segment_for(None), None, "sockets: the default");
        assert_eq!(segment_for(Some(4 << 20)), None, "shm W=2: rings of 4 MiB");
        assert_eq!(segment_for(Some(1 << 20)), None, "W=4: four of 256 KiB fill one");
        assert_eq!(segment_for(Some(256 << 10)), Some(64 << 10), "W=8");
        assert_eq!(segment_for(Some(16 << 10)), Some(16 << 10), "never below a step's cost");
    }

    #[test]
    fn all_reduce_takes_halving_doubling_for_up_to_eight_steps_worth() {
        let pick = |w: usize, bytes: usize, step: usize| all_reduce(&ctx(w), bytes, step).unwrap().name();
        // shm's steps (16 KiB): the ring from 256 KiB; sockets' (64 KiB): from 1 MiB.
        assert_eq!(pick(4, 16 << 10, 16 << 10), "recursive_doubling");
        assert_eq!(pick(4, 128 << 10, 16 << 10), "halving_doubling");
        assert_eq!(pick(4, 256 << 10, 16 << 10), "ring");
        assert_eq!(pick(8, 512 << 10, 64 << 10), "halving_doubling");
        assert_eq!(pick(8, 1 << 20, 64 << 10), "ring");
        // Off a power of two, or two ranks: never.
        assert_eq!(pick(6, 128 << 10, 16 << 10), "ring");
        assert_eq!(pick(2, 128 << 10, 16 << 10), "ring");
    }

    #[test]
    fn an_op_hint_beats_the_groups_hint_which_beats_the_environment() {
        let env = Setting::new(None, Some(" all_reduce = ring , broadcast=chain")).unwrap();
        assert_eq!(forced(Family::AllReduce, None, &env, &[]).unwrap(), Some("ring"));
        assert_eq!(forced(Family::Broadcast, None, &env, &[]).unwrap(), Some("chain"));
        assert_eq!(forced(Family::Reduce, None, &env, &[]).unwrap(), None);
        assert_eq!(forced(Family::AllReduce, Some("recursive_doubling"), &env, &[]).unwrap(), Some("recursive_doubling"));
        assert_eq!(forced(Family::AllReduce, Some("auto"), &env, &[]).unwrap(), None);
        let group = Setting::new(Some("halving_doubling"), Some("all_reduce=ring")).unwrap();
        assert_eq!(forced(Family::AllReduce, None, &group, &[]).unwrap(), Some("halving_doubling"));
    }

    #[test]
    fn unknown_names_are_invalid_arguments_listing_the_choices() {
        let e = forced(Family::AllReduce, Some("butterfly"), &Setting::default(), &[]).unwrap_err();
        assert_eq!(e.kind(), &crate::ErrorKind::InvalidArgument);
        assert!(e.to_string().contains("no algorithm \"butterfly\" (choices: auto, ring, recursive_doubling, halving_doubling)"), "{e}");
        // A backend's own name is a choice where that backend serves the op.
        let hier = [NativeAlgorithm { family: Family::AllReduce, name: "hierarchical" }];
        assert_eq!(forced(Family::AllReduce, Some("hierarchical"), &Setting::default(), &hier).unwrap(), Some("hierarchical"));
        let e = forced(Family::AllReduce, Some("hierarchical"), &Setting::default(), &[]).unwrap_err();
        assert!(e.to_string().contains("hierarchical"), "{e}");
        // ... for the family it declares, not another.
        let e = forced(Family::Broadcast, Some("hierarchical"), &Setting::default(), &hier).unwrap_err();
        assert!(e.to_string().contains("choices: auto, binomial, scatter_allgather, chain)"), "{e}");
    }

    #[test]
    fn names_parse_to_their_algorithms_and_an_unknown_one_is_refused_at_run_time() {
        for family in Family::ALL {
            assert_eq!(family.choices()[0], "auto");
            assert_eq!(
                Family::of(match family {
                    Family::AllReduce => OpKind::AllReduce,
                    Family::Broadcast => OpKind::Broadcast,
                    Family::Reduce => OpKind::Reduce,
                    Family::AllToAll => OpKind::AllToAll,
                    Family::AllGather => OpKind::AllGather,
                }),
                Some(*family)
            );
        }
        assert_eq!(Family::of(OpKind::Barrier), None);
        assert_eq!(BroadcastAlgorithm::named("chain"), Some(BroadcastAlgorithm::Chain));
        assert_eq!(ReduceAlgorithm::named("chain"), None, "another family's name");
        let mut c = ctx(4);
        c.algorithm = Some("chain");
        assert_eq!(broadcast(&c, 8).unwrap(), BroadcastAlgorithm::Chain, "a told name beats the size");
        c.algorithm = Some("hierarchical");
        let e = all_reduce(&c, 8, 1).unwrap_err();
        assert!(e.to_string().contains("not one of core's (ring, recursive_doubling, halving_doubling)"), "{e}");
    }

    #[test]
    fn segment_sizes_are_positive_byte_counts() {
        assert_eq!(parse_segment_bytes("4096").unwrap(), 4096);
        for bad in ["0", "-1", "12k", ""] {
            let e = parse_segment_bytes(bad).unwrap_err();
            assert!(e.to_string().contains(&format!("segment_bytes={bad:?}")), "{e}");
        }
    }

    #[test]
    fn a_malformed_environment_is_an_error_naming_the_entry() {
        for (text, says) in [("all_reduce", "is not op=algorithm"), ("allreduce=ring", "names no op"), ("barrier=ring", "names no op")] {
            let e = Setting::new(None, Some(text)).unwrap_err();
            assert!(e.to_string().contains(ENV_ALGORITHM) && e.to_string().contains(says), "{text}: {e}");
        }
        assert!(Setting::new(None, Some("")).is_ok());
    }
}
