//! Which way a large message moves (its *scheme*), chosen as the run goes
//! by what each scheme costs now, not once at setup.
//!
//! A message of at least [`super::MIN_BYTES`] moves one of three ways: the
//! ring's two copies (one on each core, through shared memory), or single
//! copy, pulled by the receiver (helped chunk by chunk by an idle sender)
//! or pushed whole by the sender. Which is cheapest changes with the
//! machine's phase (cross-core transfers on a VM come in slow phases that
//! cost the ring's copies most) and with where the bytes are (a payload
//! its sender has just written is in the sender's cache).
//!
//! **Keys.** Exchanges are sorted by the message that classifies them (its
//! largest, sent or received): its collective op code (or "user"), its
//! locality (plain, fresh: the sender has just written it, combines: the
//! receiver reduces it) and its size class (factors of 4 from 32 KiB).
//! Messages of sub-groups that run over their parent's transport (a tag
//! space other than 0) have no key: they take the rule, so they never
//! shift the parent's counts on their members alone.
//!
//! **Measuring.** Each rank counts the exchanges of each key, every batch
//! the engine takes (run by the calling thread or posted to whoever
//! drives), so the count does not depend on which thread ran it. The last
//! [`BURST`] of every period ([`PERIOD`] at full pace, longer at a slower
//! one: below; [`WARM_PERIOD`] in a key's first [`WARM_PERIODS`]) run a
//! scheme other than the key's current one: the three in a fixed order,
//! the same on every rank whatever rule each follows (a burst that lands
//! on the current scheme is an ordinary run of it), so every scheme keeps
//! being measured, at a bounded cost. Rank 0, the *decider*, times the
//! exchanges it runs itself in which it sends a message of the key: start
//! to end, on this rank, where it receives one too; where it only sends (a
//! broadcast's or a scatter's root), until its receivers have read every
//! byte it put in their rings, since a send alone through the ring ends
//! once its bytes are in the ring, before its receiver has copied them,
//! and would flatter the ring (`exchange.rs` waits for that only in
//! exchanges that are weighed, at most as long again; a late receiver
//! drops the runs that exchange belongs to, [`Chooser::missed`]). Keys
//! rank 0 only receives (a gather to it) keep the rule. A burst is weighed
//! against the exchanges just before it, which ran the current scheme: the
//! ratio of the medians of its last [`MEASURED`] and of those. Its first
//! exchange is not weighed: a scheme's first exchange after the others'
//! finds its memory cold (a lone exploring exchange measured 1.7 to 2
//! times the scheme's steady cost here). Pairs taken side by side cancel
//! what moves both (a busy moment, a slow phase's onset), where comparing
//! each scheme's recent times alone switched back and forth on noise. The
//! last [`WINDOW`] ratios of each scheme are kept.
//!
//! **Pace.** Exploring costs the exchanges that run a dearer scheme, and
//! those are the slow tail of a key's times (at full pace, 8 exchanges in
//! 192 explore: a 1 MiB op's 99th percentile is an exploring one). Where
//! every other scheme stays [`FAR`] dearer, the decider slows the key's
//! pace a step at a time (at a burst's end, each step on ratios measured
//! since the key was last at full pace), to periods of up to
//! `PERIOD << MAX_PACE`, but never so far that [`QUIET_NS`] would pass
//! between bursts at the current scheme's time. A burst that comes under
//! [`NEAR`], the current scheme's own time drifting by [`DRIFT`] from what
//! it was when the key left full pace (a phase change), or that time
//! outgrowing the pace, brings it back to full pace from the next period
//! start.
//!
//! **Agreeing.** Only the decider writes the group's table (one word per
//! key in the segment, [`Entry`]): from exchange number `from` of that key
//! on, use `new` at `new_pace`; before it, `old` at `old_pace`. It moves a
//! key to another scheme when that scheme's median ratio is below
//! [`SWITCH`] (hysteresis: a scheme must win clearly to take over; after a
//! change every scheme is measured afresh against the new one,
//! [`MIN_SAMPLES`] times at least, at full pace), and sets `from` [`lag`]
//! exchanges after the one it weighed (a change of pace: the first period
//! start from there, so that no burst is cut in two). It writes again only
//! once every rank is past `from` (the decider [`lag`] exchanges past it),
//! so that the word's `old` half is what every rank still short of the new
//! `from` runs. Every rank reads the word at each exchange of the key and
//! picks by its own count, so where the ranks' exchanges of a key line up
//! (every collective whose ranks exchange alike) all ranks use the same
//! scheme for the same exchange, with no message of their own. Where they
//! do not line up (uneven sizes, ranks whose batches classify differently,
//! a rank far ahead), nothing depends on it: each frame says how its
//! payload moves, and the receiver follows.
//!
//! Until the decider has measured a key, its word is zero: today's rule
//! (`offers.rs`), which a forced `shm_cma` keeps for good (unless
//! `shm_adapt=on` too). Here: keys, the table's words and the choice;
//! `exchange.rs` applies it.

// (std's atomics even under loom: one word written by one rank is no
// protocol to model-check, and the words live in the segment.)
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

/// How a large message moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// Inline through the pair's ring: the sender copies in, the receiver
    /// copies out.
    Ring = 1,
    /// Single copy pulled by the receiver (an idle sender copies chunks
    /// alongside).
    Pull = 2,
    /// Single copy pushed whole by the sender.
    Push = 3,
}

/// Every scheme, in the order exploration takes them.
const SCHEMES: [Scheme; 3] = [Scheme::Ring, Scheme::Pull, Scheme::Push];

impl Scheme {
    fn from_code(c: u64) -> Option<Scheme> {
        SCHEMES.into_iter().find(|s| *s as u64 == c)
    }
    /// Whether it may carry a message of `key`: the receiver reduces a
    /// combining step's message as it arrives, so it is never pushed
    /// (it wants the bytes in the receiver's cache).
    fn serves(self, key: Key) -> bool {
        self != Scheme::Push || key.locality() != COMBINES
    }
}

/// Exchanges of a key per exploring burst, at full pace (pace 0).
pub const PERIOD: u64 = 64;
/// Exchanges per burst in a key's first [`WARM_PERIODS`] periods: a rule
/// that is wrong on this machine from the start (one threshold cannot
/// suit every host) is found out within the first 150 or so exchanges,
/// where 64-exchange periods took 450 (a broadcast of 1 MiB, W = 2, AMD
/// Zen 5 under KVM: 47 µs pulled, 24 µs through the ring).
pub const WARM_PERIOD: u64 = 16;
/// Short periods a key starts with: every other scheme explored
/// [`MIN_SAMPLES`] times.
pub const WARM_PERIODS: u64 = 3 * MIN_SAMPLES as u64;
/// The exchanges of the short periods.
const WARM: u64 = WARM_PERIOD * WARM_PERIODS;
/// The slowest pace: a period of `PERIOD << MAX_PACE` (512) exchanges.
pub const MAX_PACE: u8 = 3;
/// Every other scheme at least this much dearer (its median ratio and its
/// last) slows a key's pace one step, halving what exploring costs it.
pub const FAR: f64 = 1.25;
/// A burst whose ratio comes under this brings a slowed key back to full
/// pace: another scheme is close to taking over.
pub const NEAR: f64 = 1.0;
/// So does the current scheme's time moving this far (either way) from
/// what it was when the key left full pace: the phase has changed.
pub const DRIFT: f64 = 1.3;
/// A slowed pace keeps a key at most this long between bursts, by its
/// current scheme's time, so a phase change is still found within a few
/// tenths of a second: large messages keep the full pace (a 64 MiB
/// exchange of 3 ms is 0.2 s a period already).
pub const QUIET_NS: u64 = 20_000_000;

/// Where exchange `n` of a key falls at `pace`: its period's number, its
/// place in the period, and the period's length. Periods start at fixed
/// exchange numbers (multiples of their length past the warm ones), so
/// every rank places an exchange alike from the pace alone.
fn position(n: u64, pace: u8) -> (u64, u64, u64) {
    if n < WARM {
        return (n / WARM_PERIOD, n % WARM_PERIOD, WARM_PERIOD);
    }
    let len = PERIOD << pace;
    let m = n - WARM;
    (WARM_PERIODS + m / len, m % len, len)
}

/// The first exchange from `n` on that starts a period at `pace` (and so
/// at every faster pace). A change of pace applies from one at the faster
/// of the two paces: the slower's periods end there too (or further on),
/// so no burst is cut in two.
fn period_start(n: u64, pace: u8) -> u64 {
    WARM + n.saturating_sub(WARM).next_multiple_of(PERIOD << pace)
}
/// The exchanges of a burst: the last ones of each period.
pub const BURST: u64 = 4;
/// The exchanges weighed, the burst's last and the current scheme's
/// before it.
pub const MEASURED: usize = 3;
/// The ratios kept per key and scheme (their median decides).
pub const WINDOW: usize = 3;
/// A scheme needs this many ratios before it is weighed.
pub const MIN_SAMPLES: usize = 3;
/// Another scheme takes over when its median ratio to the current one is
/// below this.
pub const SWITCH: f64 = 0.8;
/// How many exchanges of a key after the decider's a change applies from,
/// in a group of `size`: ranks of one collective are at most one exchange
/// apart, or W - 1 down a pipelined chain whose rings buffer its steps.
pub fn lag(size: usize) -> u64 {
    (2 * size as u64).max(8)
}

/// Size classes: [32 KiB, 128 KiB), [128 KiB, 512 KiB), ... and from 32 MiB.
const CLASSES: usize = 6;
/// Op codes below 32, plus one for user and window messages.
const KINDS: usize = 33;
const PLAIN: usize = 0;
const FRESH: usize = 1;
const COMBINES: usize = 2;
/// How many keys there are (the table's words).
pub const KEYS: usize = KINDS * 3 * CLASSES;

/// Bytes of the table in the segment (a multiple of 64).
pub const TABLE_BYTES: usize = (KEYS * 8).next_multiple_of(64);

/// What sorts an exchange: see the module notes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key(u16);

impl Key {
    /// The key of a message of `len` bytes under `tag`, if it is large
    /// enough to have a choice.
    pub fn of(tag: u64, len: usize) -> Option<Key> {
        if len < super::MIN_BYTES || weft::tag::space(tag) != 0 {
            return None;
        }
        let kind = if weft::tag::is_collective(tag) { weft::tag::op_code(tag) as usize } else { KINDS - 1 };
        let locality = if weft::tag::combines(tag) {
            COMBINES
        } else if weft::tag::fresh(tag) {
            FRESH
        } else {
            PLAIN
        };
        let class = ((len.ilog2() as usize - super::MIN_BYTES.ilog2() as usize) / 2).min(CLASSES - 1);
        Some(Key(((kind * 3 + locality) * CLASSES + class) as u16))
    }
    fn locality(self) -> usize {
        self.0 as usize / CLASSES % 3
    }
    fn index(self) -> usize {
        self.0 as usize
    }
}

/// A key's word in the group's table: `old` and `old_pace` before
/// exchange `from` of the key, `new` and `new_pace` from it on (`None`:
/// today's rule). Zero (the segment's start) is the rule throughout, at
/// full pace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    /// The exchange of the key from which `new` and `new_pace` apply.
    pub from: u64,
    /// The scheme before it.
    pub old: Option<Scheme>,
    /// The scheme from it on.
    pub new: Option<Scheme>,
    /// The exploring pace before it (periods of `PERIOD << pace`).
    pub old_pace: u8,
    /// The pace from it on.
    pub new_pace: u8,
}

impl Entry {
    fn pack(self) -> u64 {
        debug_assert!(self.from < 1 << 48, "an exchange count past 2^48");
        debug_assert!(self.old_pace <= MAX_PACE && self.new_pace <= MAX_PACE);
        let code = |s: Option<Scheme>| s.map_or(0, |s| s as u64);
        (self.from << 16) | (u64::from(self.old_pace) << 12) | (u64::from(self.new_pace) << 8) | (code(self.new) << 4) | code(self.old)
    }
    fn unpack(w: u64) -> Entry {
        let pace = |shift: u32| (((w >> shift) & 0xf) as u8).min(MAX_PACE);
        Entry {
            from: w >> 16,
            old: Scheme::from_code(w & 0xf),
            new: Scheme::from_code((w >> 4) & 0xf),
            old_pace: pace(12),
            new_pace: pace(8),
        }
    }
    /// The scheme of exchange `n` of the key (`None`: the rule).
    pub fn at(self, n: u64) -> Option<Scheme> {
        if n >= self.from {
            self.new
        } else {
            self.old
        }
    }
    /// The exploring pace of exchange `n` of the key.
    pub fn pace_at(self, n: u64) -> u8 {
        if n >= self.from {
            self.new_pace
        } else {
            self.old_pace
        }
    }
}

/// The group's table: one word per key, in the segment (written by the
/// decider only).
pub struct Table<'a>(pub &'a [AtomicU64]);

impl Table<'_> {
    /// The entry of `key`.
    pub fn entry(&self, key: Key) -> Entry {
        Entry::unpack(self.0[key.index()].load(Ordering::Acquire))
    }
    fn set(&self, key: Key, e: Entry) {
        self.0[key.index()].store(e.pack(), Ordering::Release);
    }
}

/// What one exchange runs: its key, its number among the key's exchanges
/// on this rank, and the scheme its sends of that key take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The key.
    pub key: Key,
    /// The exchange's number.
    pub n: u64,
    /// Its scheme.
    pub scheme: Scheme,
    /// Whether it runs another scheme than the current one, to measure it.
    pub explores: bool,
    /// The exploring pace it was placed at.
    pub pace: u8,
}

impl Plan {
    /// Whether the decider weighs this exchange's time: one of the last
    /// [`MEASURED`] before a burst, or of the burst past its first.
    pub fn weighed_soon(&self) -> bool {
        let (_, at, len) = position(self.n, self.pace);
        (len - BURST - MEASURED as u64..len - BURST).contains(&at) || at > len - BURST
    }
}

/// The last `N` values of a series (an exchange's times, or one scheme's
/// ratios to the current one), and their median.
#[derive(Clone, Copy)]
struct Window<T, const N: usize> {
    v: [T; N],
    count: usize,
}

impl<T: Copy + Default, const N: usize> Default for Window<T, N> {
    fn default() -> Self {
        Window { v: [T::default(); N], count: 0 }
    }
}

impl<T: Copy + PartialOrd, const N: usize> Window<T, N> {
    fn add(&mut self, x: T) {
        self.v[self.count % N] = x;
        self.count += 1;
    }
    /// The value added last.
    fn last(&self) -> Option<T> {
        self.count.checked_sub(1).map(|i| self.v[i % N])
    }
    /// The median of the values kept, once at least `min` have come (of an
    /// even count, the upper middle: a scheme must win clearly).
    fn median(&self, min: usize) -> Option<T> {
        if self.count < min {
            return None;
        }
        let mut v = self.v;
        let v = &mut v[..self.count.min(N)];
        v.sort_unstable_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        Some(v[v.len() / 2])
    }
}

/// One scheme's last [`WINDOW`] ratios of times to the current scheme's.
type Ratios = Window<f64, WINDOW>;
/// The last [`MEASURED`] times (ns) of a run of exchanges.
type Recent = Window<u64, MEASURED>;

/// One key's state on this rank: its exchange count, and on the decider
/// the times of the current scheme's last exchanges and of the burst under
/// way, and every other scheme's ratios to the current one.
#[derive(Default)]
struct KeyState {
    n: u64,
    /// The table's scheme for the last exchange (`None`: the rule).
    applied: Option<Scheme>,
    /// The table's pace for the last exchange.
    applied_pace: u8,
    /// The table's scheme the ratios are against (`None`: the rule, whatever
    /// it gives each exchange).
    base: Option<Option<Scheme>>,
    current: Recent,
    burst: Recent,
    ratios: [Ratios; 3],
    /// The current scheme's median time (ns) when the key left full pace.
    calm: u64,
    /// Each scheme's count of ratios when the key last came back to full
    /// pace: only ratios since then slow it again.
    fresh: [usize; 3],
    /// A burst came under [`NEAR`] while a change was pending.
    near: bool,
}

/// A change the decider made: to print, and for tests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Change {
    /// The key.
    pub key: Key,
    /// The scheme it leaves.
    pub from: Scheme,
    /// The scheme it takes, and its median ratio of times to the other.
    pub to: (Scheme, f64),
    /// The exchange from which it applies.
    pub at: u64,
}

/// What the decider wrote into the group's table.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Decision {
    /// A key moves to another scheme (at full pace).
    Move(Change),
    /// A key's exploring pace changes, from exchange `at` on.
    Pace {
        /// The key.
        key: Key,
        /// Its new pace.
        pace: u8,
        /// The exchange from which it applies.
        at: u64,
    },
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (kind, locality, class) = (self.0 as usize / CLASSES / 3, self.locality(), self.0 as usize % CLASSES);
        let low = super::MIN_BYTES << (2 * class);
        match kind {
            k if k == KINDS - 1 => write!(f, "point-to-point")?,
            k => write!(f, "op {k}")?,
        }
        let locality = ["", ", fresh", ", combining"][locality];
        if class == CLASSES - 1 {
            write!(f, "{locality} messages from {} KiB", low >> 10)
        } else {
            write!(f, "{locality} messages of {}-{} KiB", low >> 10, (low << 2) >> 10)
        }
    }
}

impl std::fmt::Display for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: {:?} -> {:?} (median {:.2} x the time in paired exchanges) from exchange {}",
            self.key, self.from, self.to.0, self.to.1, self.at
        )
    }
}

impl std::fmt::Display for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Decision::Move(c) => c.fmt(f),
            // (Worded apart from a move's "from exchange", which tests
            // look for in every rank's log.)
            Decision::Pace { key, pace, at } => {
                write!(f, "{key}: one exploring burst in {} exchanges, starting with exchange {at}", PERIOD << pace)
            }
        }
    }
}

/// This rank's side of the choice (kept with the engine: one driver at a
/// time).
pub struct Chooser {
    decider: bool,
    lag: u64,
    keys: HashMap<Key, KeyState>,
}

impl Chooser {
    /// The choice on `rank` of `size` (rank 0 decides).
    pub fn new(rank: usize, size: usize) -> Chooser {
        Chooser { decider: rank == 0, lag: lag(size), keys: HashMap::new() }
    }

    /// Whether this rank decides (and times its exchanges).
    pub fn decides(&self) -> bool {
        self.decider
    }

    /// The plan of the next exchange of `key`, whose sends the rule would
    /// give `rule` (`None`: this rank sends nothing of the key, it only
    /// counts).
    pub fn plan(&mut self, table: &Table<'_>, key: Key, rule: Option<Scheme>) -> Option<Plan> {
        let st = self.keys.entry(key).or_default();
        let n = st.n;
        st.n += 1;
        let entry = table.entry(key);
        if entry.at(n) != st.applied {
            // What the tests read to see that every rank moved at the same exchange.
            st.applied = entry.at(n);
            weft::log::debug(format_args!("shm: {key}: {:?} from exchange {n}", st.applied));
        }
        let pace = entry.pace_at(n);
        if pace != st.applied_pace {
            st.applied_pace = pace;
            weft::log::debug(format_args!("shm: {key}: exploring pace {pace} at exchange {n}"));
        }
        let current = st.applied.or(rule)?;
        let (period, at, len) = position(n, pace);
        let scheme = match SCHEMES[period as usize % SCHEMES.len()] {
            other if at >= len - BURST && other.serves(key) => other,
            _ => current,
        };
        Some(Plan { key, n, scheme, explores: scheme != current, pace })
    }

    /// The decider could not time exchange `plan` (a receiver came late):
    /// the runs it belonged to are dropped, so that no older time stands in
    /// for it.
    pub fn missed(&mut self, plan: Plan) {
        if let Some(st) = self.keys.get_mut(&plan.key) {
            (st.current, st.burst) = (Recent::default(), Recent::default());
        }
    }

    /// The decider: exchange `plan` took `ns`; maybe move its key to a
    /// cheaper scheme, or change how often it explores (returned).
    pub fn record(&mut self, table: &Table<'_>, plan: Plan, ns: u64, rule: Option<Scheme>) -> Option<Decision> {
        if !self.decider {
            return None;
        }
        let st = self.keys.get_mut(&plan.key)?;
        let entry = table.entry(plan.key);
        let current = entry.at(plan.n).or(rule)?;
        if st.base != Some(entry.at(plan.n)) {
            // A new current scheme: every ratio is measured afresh.
            *st = KeyState {
                n: st.n,
                applied: st.applied,
                applied_pace: st.applied_pace,
                base: Some(entry.at(plan.n)),
                ..KeyState::default()
            };
        }
        let (_, at, len) = position(plan.n, plan.pace);
        if plan.explores {
            // (A burst's first exchange is not weighed: see the module notes.)
            if at != len - BURST {
                st.burst.add(ns);
            }
        } else {
            st.current.add(ns);
            st.burst = Recent::default();
        }
        if at != len - 1 {
            return None;
        }
        // A period's end: its burst is weighed where it explored; in one
        // period of three exploring comes round to the current scheme, whose
        // time alone still says whether the phase has changed.
        let cur = st.current.median(MEASURED)?;
        if plan.explores {
            let alt = st.burst.median(MEASURED)?;
            let ratio = alt as f64 / cur.max(1) as f64;
            st.ratios[plan.scheme as usize - 1].add(ratio);
            st.near |= ratio < NEAR;
        }
        if plan.n < entry.from + self.lag {
            return None; // The last change is not in force on every rank yet.
        }
        let best = SCHEMES
            .into_iter()
            .filter(|s| *s != current)
            .filter_map(|s| Some((s, st.ratios[s as usize - 1].median(MIN_SAMPLES)?)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        // (Past `from`, the plan's pace is the word's new one.)
        let pace = plan.pace;
        if let Some((best, ratio)) = best.filter(|b| b.1 < SWITCH) {
            let at = plan.n + self.lag;
            table.set(plan.key, Entry { from: at, old: entry.new, new: Some(best), old_pace: pace, new_pace: 0 });
            return Some(Decision::Move(Change { key: plan.key, from: current, to: (best, ratio), at }));
        }
        let near = std::mem::take(&mut st.near);
        let next = next_pace(st, plan.key, current, pace, cur, near, plan.explores);
        if next == pace {
            return None;
        }
        if pace == 0 {
            st.calm = cur;
        }
        if next == 0 {
            st.fresh = st.ratios.each_ref().map(|r| r.count);
        }
        let at = period_start(plan.n + self.lag, pace.min(next));
        table.set(plan.key, Entry { from: at, old: entry.new, new: entry.new, old_pace: pace, new_pace: next });
        Some(Decision::Pace { key: plan.key, pace: next, at })
    }
}

/// The pace a key of `current` scheme explores at next, from `pace`, at a
/// period's end where the current scheme's median time is `cur` ns, `near`
/// says whether a burst came under [`NEAR`] since the last decision, and
/// `explored` whether this period's burst explored: back to full pace
/// where another scheme came close, the current one's time drifted, or the
/// pace keeps the key too long between bursts; one step slower, at a
/// burst's end, where every other scheme stays [`FAR`] dearer (its median
/// ratio and its last, over [`MIN_SAMPLES`] ratios at least since the key
/// was last back at full pace).
fn next_pace(st: &KeyState, key: Key, current: Scheme, pace: u8, cur: u64, near: bool, explored: bool) -> u8 {
    let fits = |p: u8| (PERIOD << p).saturating_mul(cur) <= QUIET_NS;
    let drifted = (cur as f64) > st.calm as f64 * DRIFT || (cur as f64) * DRIFT < st.calm as f64;
    if pace > 0 && (near || drifted || !fits(pace)) {
        return 0;
    }
    let far = SCHEMES.into_iter().filter(|s| *s != current && s.serves(key)).all(|s| {
        let (r, fresh) = (&st.ratios[s as usize - 1], st.fresh[s as usize - 1]);
        r.count >= fresh + MIN_SAMPLES && r.median(MIN_SAMPLES).is_some_and(|m| m >= FAR) && r.last().is_some_and(|l| l >= FAR)
    });
    if explored && far && pace < MAX_PACE && fits(pace + 1) {
        pace + 1
    } else {
        pace
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn table(words: &[AtomicU64]) -> Table<'_> {
        Table(words)
    }

    #[test]
    fn keys_sort_by_op_locality_and_size() {
        let ag = weft::tag::collective(3, 7, 0, 1);
        assert_eq!(Key::of(ag, (32 << 10) - 1), None, "too small to choose");
        let k = Key::of(ag, 32 << 10).unwrap();
        assert_eq!(Key::of(ag, (128 << 10) - 1), Some(k), "one class up to 128 KiB");
        assert_ne!(Key::of(ag, 128 << 10), Some(k));
        assert_eq!(Key::of(ag, 1 << 40), Key::of(ag, 32 << 20), "the last class is open");
        assert_eq!(Key::of(weft::tag::in_space(ag, 3), 1 << 20), None, "a sub-group's message takes the rule");
        // Another op, another sequence number, locality bits, user messages.
        assert_ne!(Key::of(weft::tag::collective(4, 7, 0, 1), 32 << 10), Some(k));
        assert_eq!(Key::of(weft::tag::collective(3, 9, 5, 2), 32 << 10), Some(k));
        let fresh = Key::of(ag | weft::tag::FRESH, 1 << 20).unwrap();
        let combines = Key::of(ag | weft::tag::COMBINES, 1 << 20).unwrap();
        assert_eq!((fresh.locality(), combines.locality(), Key::of(ag, 1 << 20).unwrap().locality()), (FRESH, COMBINES, PLAIN));
        let user = Key::of(weft::tag::user(5), 1 << 20).unwrap();
        assert!(user.index() < KEYS && Key::of(weft::tag::collective(31, 0, 0, 0) | weft::tag::COMBINES, 1 << 40).unwrap().index() < KEYS);
        assert!(!Scheme::Push.serves(combines) && Scheme::Pull.serves(combines) && Scheme::Push.serves(fresh));
    }

    #[test]
    fn entries_pack_and_pick_by_exchange_number() {
        let e = Entry { from: (1 << 48) - 1, old: None, new: Some(Scheme::Push), old_pace: MAX_PACE, new_pace: 0 };
        assert_eq!(Entry::unpack(e.pack()), e);
        let e = Entry { from: 40, old: Some(Scheme::Ring), new: Some(Scheme::Pull), old_pace: 1, new_pace: 2 };
        assert_eq!(Entry::unpack(e.pack()), e);
        assert_eq!((e.at(39), e.at(40)), (Some(Scheme::Ring), Some(Scheme::Pull)));
        assert_eq!((e.pace_at(39), e.pace_at(40)), (1, 2));
        assert_eq!(Entry::unpack(0), Entry { from: 0, old: None, new: None, old_pace: 0, new_pace: 0 }, "a zeroed segment is the rule");
        assert_eq!(Entry::unpack(0xff00).new_pace, MAX_PACE, "a pace past the slowest is the slowest");
    }

    /// Run `exchanges` exchanges of one key on `ranks` ranks, each costing
    /// `cost(scheme, n)` ns: the decider finishes exchange n (and may
    /// change the table) after the others have planned exchange n + 1, and
    /// the last rank trails it (see [`run_deciding`]). Every rank's schemes
    /// per exchange, and the moves.
    fn run(ranks: usize, exchanges: u64, rule: Scheme, cost: impl Fn(Scheme, u64) -> u64) -> (Vec<Vec<Scheme>>, Vec<Change>) {
        let (schemes, decisions) = run_deciding(ranks, exchanges, rule, cost);
        let moves = decisions.iter().filter_map(|d| if let Decision::Move(c) = d { Some(*c) } else { None }).collect();
        (schemes, moves)
    }

    /// [`run`], with every decision (changes of pace too). The last rank
    /// runs `lag - 2` exchanges behind the decider, as far as ranks of one
    /// collective get (a pipelined chain whose rings buffer its steps).
    fn run_deciding(ranks: usize, exchanges: u64, rule: Scheme, cost: impl Fn(Scheme, u64) -> u64) -> (Vec<Vec<Scheme>>, Vec<Decision>) {
        let words: Vec<AtomicU64> = (0..KEYS).map(|_| AtomicU64::new(0)).collect();
        let t = table(&words);
        let key = Key::of(weft::tag::collective(3, 1, 0, 0), 1 << 20).unwrap();
        let mut choosers: Vec<Chooser> = (0..ranks).map(|r| Chooser::new(r, ranks)).collect();
        let mut schemes = vec![Vec::new(); ranks];
        let mut decisions = Vec::new();
        let mut decider_plan: Option<Plan> = None;
        let behind = lag(ranks) - 2;
        for n in 0..=exchanges + behind {
            for r in 1..ranks {
                let m = if r == ranks - 1 { n.checked_sub(behind) } else { Some(n) };
                if let Some(m) = m.filter(|m| *m < exchanges) {
                    let plan = choosers[r].plan(&t, key, Some(rule)).unwrap();
                    assert_eq!(plan.n, m);
                    schemes[r].push(plan.scheme);
                }
            }
            if let Some(plan) = decider_plan.take() {
                let before = t.entry(key).from;
                if let Some(d) = choosers[0].record(&t, plan, cost(plan.scheme, plan.n), Some(rule)) {
                    // The last rank is past the word's `from` before it is written again.
                    assert!(plan.n >= before + lag(ranks), "{d:?} at {} over from {before}", plan.n);
                    decisions.push(d);
                }
            }
            if n < exchanges {
                let plan = choosers[0].plan(&t, key, Some(rule)).unwrap();
                schemes[0].push(plan.scheme);
                decider_plan = Some(plan);
            }
        }
        (schemes, decisions)
    }

    #[test]
    fn ranks_agree_on_every_exchange_and_move_to_the_cheaper_scheme_and_back() {
        // Pull costs 100, then (a slow phase from exchange 400 to 1200) 400;
        // the ring 200 throughout, Push more than either.
        let slow = |n: u64| (400..1200).contains(&n);
        let cost = |s: Scheme, n: u64| match s {
            Scheme::Ring => 200,
            Scheme::Pull if slow(n) => 400,
            Scheme::Pull => 100,
            Scheme::Push => 450,
        };
        let (schemes, changes) = run(3, 2500, Scheme::Pull, cost);
        assert!(schemes.iter().all(|s| *s == schemes[0]), "every rank runs the same scheme in each exchange");
        let s = &schemes[0];
        // Calm: the rule's Pull, with the bursts trying another.
        let explored = |range: std::ops::Range<usize>| {
            range
                .filter(|n| {
                    let (_, at, len) = position(*n as u64, 0);
                    at >= len - BURST
                })
                .count() as u64
        };
        let others = s[..400].iter().filter(|x| **x != Scheme::Pull).count();
        assert!(others > 0 && others as u64 <= explored(0..400), "{others}");
        // The slow phase moves it to the ring (the cheapest then), within a few explorations ...
        let to_ring = changes.iter().find(|c| c.to.0 == Scheme::Ring).expect("moved to the ring");
        // (A scheme is explored every third period; its window of ratios
        // must turn over past the calm ones, plus where the periods fall.)
        assert!(to_ring.at > 400 && to_ring.at < 400 + 4 * 3 * PERIOD, "{to_ring:?}");
        assert!(s[1000..1200].iter().filter(|x| **x != Scheme::Ring).count() as u64 <= explored(1000..1200));
        // ... and once calm again, back to Pull; and only these two changes (no flapping).
        let back = changes.iter().find(|c| c.to.0 == Scheme::Pull).expect("moved back");
        assert!(back.at > 1200 && back.at < 1200 + 4 * 3 * PERIOD, "{back:?}");
        assert_eq!(changes.len(), 2, "{changes:?}");
        assert!(s[2000..].iter().filter(|x| **x != Scheme::Pull).count() as u64 <= explored(2000..2500));
    }

    #[test]
    fn exploring_slows_while_the_others_stay_far_dearer_and_speeds_up_when_the_current_scheme_drifts() {
        // Pull half the ring's cost and a quarter of Push's, then (from
        // exchange 4000) 1.4 times dearer: still the cheapest, but moved.
        let cost = |s: Scheme, n: u64| match s {
            Scheme::Pull if n >= 4000 => 140,
            Scheme::Pull => 100,
            Scheme::Ring => 200,
            Scheme::Push => 400,
        };
        // At 32 ranks a change lands (lag 64) where a burst would be cut
        // without `period_start`; at 40 the last rank trails the decider
        // by 78 exchanges, more than a period at full pace.
        for ranks in [32, 40] {
            let (schemes, _) = run_deciding(ranks, 6000, Scheme::Pull, cost);
            assert!(schemes.iter().all(|s| *s == schemes[0]), "{ranks} ranks: every rank runs the same scheme in each exchange");
            bursts_are_whole(&schemes[0], Scheme::Pull);
        }
        let (schemes, decisions) = run_deciding(3, 6000, Scheme::Pull, cost);
        bursts_are_whole(&schemes[0], Scheme::Pull);
        let paces = paces(&decisions);
        let explored = |range: std::ops::Range<usize>| schemes[0][range].iter().filter(|s| **s != Scheme::Pull).count();
        // Slowest pace well before the drift: a burst (4 exchanges) in 512,
        // two of every three exploring; at full pace, in 64.
        let slowest = paces.iter().find(|p| p.0 == MAX_PACE).expect("reached the slowest pace").1;
        assert!(slowest < 1500, "{paces:?}");
        let full = 8 * 2000 / (3 * PERIOD as usize);
        assert!(explored(1500..3500) <= full / 4, "{} explored, {full} at full pace", explored(1500..3500));
        // The drift brings it back to full pace within a slowest period
        // (and the change's lag), and it stays there for fresh ratios.
        let back = paces.iter().position(|p| p.0 == 0 && p.1 > 4000).expect("back to full pace");
        assert!(paces[back].1 <= 4000 + (PERIOD << MAX_PACE) + 2 * lag(3), "{paces:?}");
        let again = paces.get(back + 1).expect("slows again once calm").1;
        assert!(again >= paces[back].1 + 3 * MIN_SAMPLES as u64 * PERIOD, "{paces:?}");
        // Exchanges of 1 ms keep the full pace: a slower one would leave
        // more than `QUIET_NS` between bursts.
        let (schemes, decisions) = run_deciding(2, 2000, Scheme::Pull, |s, n| cost(s, n) * 10_000);
        assert!(decisions.is_empty(), "{decisions:?}");
        let explored = schemes[0][500..2000].iter().filter(|s| **s != Scheme::Pull).count();
        assert!(explored >= 8 * 1500 / (3 * PERIOD as usize) - 8, "{explored}");
    }

    #[test]
    fn a_scheme_coming_close_brings_full_pace_back_and_keeps_it() {
        // The ring turns 10 % cheaper than Pull at exchange 3000: not
        // enough to take over, but the key keeps watching it closely.
        let cost = |s: Scheme, n: u64| match s {
            Scheme::Pull => 100,
            Scheme::Ring if n >= 3000 => 90,
            Scheme::Ring => 200,
            Scheme::Push => 400,
        };
        let (schemes, decisions) = run_deciding(3, 6000, Scheme::Pull, cost);
        assert!(schemes.iter().all(|s| *s == schemes[0]), "every rank runs the same scheme in each exchange");
        bursts_are_whole(&schemes[0], Scheme::Pull);
        let paces = paces(&decisions);
        assert_eq!(paces.iter().filter(|p| p.1 < 3000).map(|p| p.0).max(), Some(MAX_PACE), "{paces:?}");
        // The ring is explored every third period: within three of the
        // slowest, back to full pace, and no slower after.
        let last = *paces.last().unwrap();
        assert_eq!(last.0, 0, "{paces:?}");
        assert!(last.1 > 3000 && last.1 <= 3000 + 3 * (PERIOD << MAX_PACE) + 2 * lag(3), "{paces:?}");
    }

    /// The decisions, all changes of pace: (pace, from exchange).
    fn paces(decisions: &[Decision]) -> Vec<(u8, u64)> {
        decisions.iter().map(|d| if let Decision::Pace { pace, at, .. } = d { (*pace, *at) } else { panic!("{d:?}") }).collect()
    }

    /// Every exploring burst in `schemes` (a run of schemes other than
    /// `current`) after the warm periods is whole, of one scheme: a change
    /// of pace never cut one short.
    fn bursts_are_whole(schemes: &[Scheme], current: Scheme) {
        let mut run = 0;
        for (n, s) in schemes.iter().enumerate().skip(WARM as usize) {
            if *s != current {
                assert!(run == 0 || *s == schemes[n - 1], "a burst of two schemes at exchange {n}");
                run += 1;
            } else {
                assert!(run == 0 || run == BURST, "a burst of {run} ending at exchange {n}");
                run = 0;
            }
        }
    }

    #[test]
    fn a_rule_wrong_from_the_start_is_left_within_the_short_periods() {
        let (schemes, changes) = run(2, 400, Scheme::Pull, |s, _| if s == Scheme::Ring { 50 } else { 100 });
        let warm = WARM;
        assert_eq!(changes.len(), 1, "{changes:?}");
        assert_eq!(changes[0].to.0, Scheme::Ring);
        assert!(changes[0].at <= warm + lag(2), "{:?}", changes[0]);
        assert!(schemes[0][warm as usize + 8..].iter().filter(|s| **s != Scheme::Ring).count() as u64 <= 8, "long periods after");
    }

    #[test]
    fn a_scheme_that_wins_narrowly_does_not_take_over_and_push_never_carries_a_reduction() {
        // 10 % apart: within the hysteresis.
        let (_, changes) = run(2, 3000, Scheme::Pull, |s, _| if s == Scheme::Push { 90 } else { 100 });
        assert!(changes.is_empty(), "{changes:?}");
        // A combining key never tries Push, however cheap it would be.
        let words: Vec<AtomicU64> = (0..KEYS).map(|_| AtomicU64::new(0)).collect();
        let key = Key::of(weft::tag::collective(1, 1, 0, 0) | weft::tag::COMBINES, 1 << 20).unwrap();
        let mut c = Chooser::new(0, 2);
        for _ in 0..1500 {
            let plan = c.plan(&table(&words), key, Some(Scheme::Ring)).unwrap();
            assert_ne!(plan.scheme, Scheme::Push);
            c.record(&table(&words), plan, if plan.scheme == Scheme::Pull { 100 } else { 300 }, Some(Scheme::Ring));
        }
        assert_eq!(table(&words).entry(key).new, Some(Scheme::Pull));
    }

    #[test]
    fn a_rank_that_only_receives_counts_and_a_change_waits_until_the_last_is_in_force() {
        let words: Vec<AtomicU64> = (0..KEYS).map(|_| AtomicU64::new(0)).collect();
        let t = table(&words);
        let key = Key::of(weft::tag::user(1), 1 << 20).unwrap();
        let mut receiver = Chooser::new(1, 2);
        assert_eq!(receiver.plan(&t, key, None), None);
        t.set(key, Entry { from: 1, old: None, new: Some(Scheme::Push), old_pace: 0, new_pace: 0 });
        assert_eq!(receiver.plan(&t, key, None).map(|p| (p.n, p.scheme)), Some((1, Scheme::Push)));
        // The decider weighs nothing while a change is pending.
        let mut decider = Chooser::new(0, 2);
        t.set(key, Entry { from: 2000, old: None, new: Some(Scheme::Ring), old_pace: 0, new_pace: 0 });
        for _ in 0..1999 {
            let plan = decider.plan(&t, key, Some(Scheme::Pull)).unwrap();
            assert_eq!(decider.record(&t, plan, if plan.scheme == Scheme::Ring { 1 } else { 1000 }, Some(Scheme::Pull)), None);
        }
    }
}
