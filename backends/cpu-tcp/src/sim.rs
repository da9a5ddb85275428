//! Fault injection for the protocol (`protocol.rs`): two ranks' protocols
//! joined by a simulated connection and stepped in an order a seed picks,
//! deterministically. The connection takes and gives bytes in pieces of 0
//! (would block), 1 or a few bytes up to everything, within a socket buffer
//! the seed sizes; the scheduler stalls one rank for hundreds of steps at a
//! time; the clock is virtual. Each rank posts its sends and receives in
//! batches, in an order of its own (tags interleaved, receives before or
//! after their data arrives, long messages by rendezvous among short ones).
//!
//! - Every seed's exchange completes with every byte where it belongs.
//! - A rank that vanishes at any step of an exchange (every step of short
//!   ones, 65 points along long ones) leaves the other with every batch
//!   ended: done, or `PeerLost` naming it, before any deadline.
//! - A rank that stalls for good leaves the other's batches to end at
//!   their deadline, naming it, and the protocol usable for what follows.

use crate::protocol::{Flags, Got, Protocol, Watch, Wire};
use crate::wire::{EAGER_LIMIT, HEADER};
use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft::backend::matching::EarlyBudget;
use weft::backend::progress::{Post, Posting};
use weft::backend::P2p;
use weft::{Error, ErrorKind, Result};

/// splitmix64: every choice of a run comes from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn percent(&mut self, p: usize) -> bool {
        self.below(100) < p
    }
}

/// The connection: `pipes[r]` holds what rank r wrote and the other has not
/// read yet.
struct Link {
    pipes: [VecDeque<u8>; 2],
    /// Bytes a direction holds at most (the socket buffers).
    room: usize,
    /// The connection broke: writes fail, reads give what was in flight,
    /// then the end of the stream.
    cut: bool,
    rng: Rng,
}

impl Link {
    /// How many bytes one call moves at most: nothing, a byte, part of a
    /// header, a header, or more.
    fn piece(&mut self) -> usize {
        match self.rng.below(8) {
            0 => 0,
            1 => 1,
            2 => 7,
            3 => HEADER,
            4 => 4096,
            5 => 100_000,
            _ => usize::MAX,
        }
    }
}

/// One rank's end of the link.
struct SimWire {
    me: usize,
    link: Rc<RefCell<Link>>,
}

impl Wire for SimWire {
    fn send(&mut self, peer: usize, parts: &[IoSlice<'_>]) -> Result<usize> {
        let mut l = self.link.borrow_mut();
        if l.cut {
            return Err(Error::peer_lost(peer, format!("simulated: the connection to peer rank {peer} broke")));
        }
        let mut left = l.piece().min(l.room - l.pipes[self.me].len());
        let mut wrote = 0;
        for part in parts {
            let k = left.min(part.len());
            l.pipes[self.me].extend(&part[..k]);
            wrote += k;
            left -= k;
        }
        Ok(wrote)
    }

    fn recv(&mut self, peer: usize, buf: &mut [u8]) -> Result<Got> {
        let mut l = self.link.borrow_mut();
        if l.pipes[peer].is_empty() {
            return Ok(if l.cut { Got::Eof } else { Got::Nothing });
        }
        let n = l.piece().min(buf.len()).min(l.pipes[peer].len());
        for (b, x) in buf.iter_mut().zip(l.pipes[peer].drain(..n)) {
            *b = x;
        }
        Ok(if n == 0 { Got::Nothing } else { Got::Bytes(n) })
    }
}

/// As the backend judges failures: a lost peer or a broken stream fails the
/// transport for good (later ops fail with it); a timeout is the caller's.
#[derive(Default)]
struct Judge {
    failed: RefCell<Option<Error>>,
}

impl Watch for Judge {
    fn stop(&self) -> Option<Error> {
        self.failed.borrow().clone()
    }
    fn failed(&self, e: Error) -> Error {
        match e.kind() {
            ErrorKind::PeerLost { .. } | ErrorKind::Backend | ErrorKind::Aborted => self.failed.borrow_mut().get_or_insert(e).clone(),
            _ => e,
        }
    }
}

/// One message of an exchange.
struct Message {
    tag: u64,
    data: Vec<u8>,
}

/// Sizes around every boundary the protocol has: empty, within and across
/// a header, eager, the eager limit and just past it (rendezvous).
fn size(rng: &mut Rng, small: bool) -> usize {
    match rng.below(if small { 13 } else { 20 }) {
        0..=2 => 0,
        3..=5 => 1,
        6..=8 => 7,
        9..=10 => HEADER,
        11..=12 => HEADER + 1,
        13..=14 => 4099,
        15..=16 => 70_000,
        17 => EAGER_LIMIT,
        18 => EAGER_LIMIT + 1,
        _ => EAGER_LIMIT + 4097,
    }
}

/// A rank's messages: up to 8, or with `small` up to 3 of at most a header
/// and a byte each (an exchange short enough to cut at every step).
fn messages(rng: &mut Rng, from: usize, small: bool) -> Vec<Message> {
    (0..1 + rng.below(if small { 3 } else { 8 }))
        .map(|i| Message {
            tag: 1 + rng.below(3) as u64,
            data: (0..size(rng, small)).map(|k| (k * 31 + i * 7 + from * 101) as u8).collect(),
        })
        .collect()
}

/// `lists` merged in an order `rng` picks, each list's own order kept.
fn interleave<T>(rng: &mut Rng, mut lists: Vec<VecDeque<T>>) -> Vec<T> {
    let mut out = Vec::new();
    while lists.iter().any(|l| !l.is_empty()) {
        let open: Vec<usize> = (0..lists.len()).filter(|&i| !lists[i].is_empty()).collect();
        let pick = open[rng.below(open.len())];
        out.extend(lists[pick].pop_front());
    }
    out
}

/// What a rank does: send `sent`, receive what the other sends.
#[derive(Clone, Copy)]
enum Act {
    Send(usize),
    Recv(usize),
}

/// One rank: its protocol, its end of the link, and the batches it posts.
struct Rank {
    me: usize,
    proto: Protocol,
    wire: SimWire,
    flags: Flags,
    posting: Posting,
    judge: Judge,
    /// Batches not posted yet: (the step from which, ops, outcome slot).
    waiting: VecDeque<(usize, Post)>,
    /// Each batch's outcome, in post order.
    outcomes: Arc<Mutex<Vec<Option<Result<()>>>>>,
}

impl Rank {
    fn all_ended(&self) -> bool {
        self.waiting.is_empty() && self.outcomes.lock().unwrap().iter().all(Option::is_some)
    }

    /// One turn of the driver's loop (`engine::drive`), at `now`.
    fn turn(&mut self, step: usize, now: Instant, eager: bool) {
        while self.waiting.front().is_some_and(|(at, _)| *at <= step) {
            let (_, post) = self.waiting.pop_front().expect("checked");
            self.posting.push(post);
        }
        if let Some(e) = self.judge.stop() {
            self.proto.fail_all(&e, &self.posting);
            return;
        }
        if self.proto.step(self.me, &mut self.wire, &mut self.flags, eager, &self.posting, &self.judge).is_ok() {
            let _ = self.proto.expire_at(now, &self.posting, &self.judge);
        }
    }
}

/// A seeded exchange between ranks 0 and 1, its buffers, and the clock.
struct Run {
    rng: Rng,
    link: Rc<RefCell<Link>>,
    ranks: [Rank; 2],
    /// `sent[r]`: what rank r sends; `got[r]`: rank r's receive buffers,
    /// one per message of the other rank (kept alive for the posts).
    sent: [Vec<Message>; 2],
    got: [Vec<Vec<u8>>; 2],
    /// Per rank, the batches' acts (to check what arrived).
    acts: [Vec<Vec<Act>>; 2],
    now: Instant,
    step: usize,
    /// A rank not stepped until this step (a stall).
    stalled: Option<(usize, usize)>,
}

impl Run {
    /// Batches whose deadline is `deadline` after the start.
    fn new(seed: u64, deadline: Duration) -> Box<Run> {
        Run::with(seed, deadline, false)
    }

    /// As `new`; `small`: a few short messages each (see `messages`).
    fn with(seed: u64, deadline: Duration, small: bool) -> Box<Run> {
        let mut rng = Rng(seed);
        let room = [4096, 65536, 1 << 20, 8 << 20][rng.below(4)];
        let link = Rc::new(RefCell::new(Link { pipes: Default::default(), room, cut: false, rng: Rng(seed ^ 0x5eed) }));
        let sent = [messages(&mut rng, 0, small), messages(&mut rng, 1, small)];
        let got = [
            sent[1].iter().map(|m| vec![0xEE; m.data.len()]).collect::<Vec<_>>(),
            sent[0].iter().map(|m| vec![0xEE; m.data.len()]).collect::<Vec<_>>(),
        ];
        let base = Instant::now();
        let rank = |me: usize| Rank {
            me,
            proto: Protocol::new([me != 0, me != 1], EarlyBudget::from_env().expect("default budget")),
            wire: SimWire { me, link: link.clone() },
            flags: Flags::new(2),
            posting: Posting::default(),
            judge: Judge::default(),
            waiting: VecDeque::new(),
            outcomes: Arc::default(),
        };
        let mut run = Box::new(Run {
            rng,
            link: link.clone(),
            ranks: [rank(0), rank(1)],
            sent,
            got,
            acts: [Vec::new(), Vec::new()],
            now: base,
            step: 0,
            stalled: None,
        });
        for me in 0..2 {
            run.plan(me, base + deadline);
        }
        run
    }

    /// Rank `me`'s batches: its sends and its receives, each tag's in
    /// order (the order messages of a tag match in), tags interleaved,
    /// sends and receives interleaved, cut into batches posted at steps
    /// that come later and later.
    fn plan(&mut self, me: usize, deadline: Instant) {
        let other = 1 - me;
        let by_tag = |msgs: &[Message], act: fn(usize) -> Act| {
            (1..=3u64).map(|t| (0..msgs.len()).filter(|&i| msgs[i].tag == t).map(act).collect::<VecDeque<_>>()).collect::<Vec<_>>()
        };
        let sends = interleave(&mut self.rng, by_tag(&self.sent[me], Act::Send));
        let recvs = interleave(&mut self.rng, by_tag(&self.sent[other], Act::Recv));
        let acts = interleave(&mut self.rng, vec![sends.into(), recvs.into()]);
        let mut at = 0;
        let mut rest = &acts[..];
        while !rest.is_empty() {
            let n = (1 + self.rng.below(3)).min(rest.len());
            let (batch, tail) = rest.split_at(n);
            rest = tail;
            at += self.rng.below(40);
            let mut ops: Vec<P2p<'_>> = batch
                .iter()
                .map(|a| match *a {
                    Act::Send(i) => P2p::Send { peer: other, tag: self.sent[me][i].tag, data: &self.sent[me][i].data },
                    Act::Recv(i) => {
                        let buf = &mut self.got[me][i];
                        // SAFETY: every buffer is a separate allocation that
                        // lives (unmoved) as long as the run; each is in one
                        // receive only.
                        let buf = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr(), buf.len()) };
                        P2p::Recv { peer: other, tag: self.sent[other][i].tag, buf }
                    }
                })
                .collect();
            let outcomes = self.ranks[me].outcomes.clone();
            let slot = {
                let mut o = outcomes.lock().unwrap();
                o.push(None);
                o.len() - 1
            };
            let done = Box::new(move |r: Result<()>| {
                let mut o = outcomes.lock().unwrap();
                assert!(o[slot].is_none(), "a batch ended twice");
                o[slot] = Some(r);
            });
            // SAFETY: the buffers live as long as the run (boxed, not
            // moved), which the protocol does not outlive.
            let post = unsafe { Post::new(&mut ops, &[], deadline, done) };
            self.ranks[me].waiting.push_back((at, post));
            self.acts[me].push(batch.to_vec());
        }
    }

    /// One step: the clock moves on, and a rank the scheduler picks takes
    /// a turn (a stalled one does not). `alive` says which ranks still run.
    fn tick(&mut self, alive: [bool; 2], advance: Duration) {
        self.step += 1;
        self.now += advance;
        if self.stalled.is_some_and(|(_, until)| until <= self.step) {
            self.stalled = None;
        }
        if self.stalled.is_none() && self.rng.percent(1) {
            self.stalled = Some((self.rng.below(2), self.step + 1 + self.rng.below(500)));
        }
        let mut r = self.rng.below(2);
        if self.stalled.is_some_and(|(s, _)| s == r) || !alive[r] {
            r = 1 - r;
        }
        if !alive[r] {
            return;
        }
        // Reading frames nobody awaits yet: now and then, as the engine
        // does once idle.
        let eager = self.rng.percent(10);
        let (step, now) = (self.step, self.now);
        self.ranks[r].turn(step, now, eager);
    }

    /// Step until every batch of the ranks in `alive` has ended, or panic
    /// after `limit` steps (a hang).
    fn until_ended(&mut self, alive: [bool; 2], advance: Duration, limit: usize, what: &str) {
        let start = self.step;
        while !(0..2).all(|r| !alive[r] || self.ranks[r].all_ended()) {
            assert!(self.step - start < limit, "{what}: batches still pending after {limit} steps");
            self.tick(alive, advance);
        }
    }

    /// The outcomes of rank `r`'s batches.
    fn outcomes(&self, r: usize) -> Vec<Result<()>> {
        self.ranks[r].outcomes.lock().unwrap().iter().map(|o| o.clone().expect("ended")).collect()
    }

    /// Every receive of rank `r` in a batch that succeeded holds its
    /// message.
    fn check_received(&self, r: usize) {
        for (acts, outcome) in self.acts[r].iter().zip(self.outcomes(r)) {
            if outcome.is_ok() {
                for a in acts {
                    if let Act::Recv(i) = *a {
                        assert!(self.got[r][i] == self.sent[1 - r][i].data, "rank {r}: message {i} arrived wrong");
                    }
                }
            }
        }
    }
}

const STEP: Duration = Duration::from_micros(1);

#[test]
fn every_exchange_completes_whatever_the_pieces_and_the_order() {
    for seed in 0..150 {
        let mut run = Run::new(seed, Duration::from_secs(3600));
        run.until_ended([true, true], STEP, 2_000_000, &format!("seed {seed}"));
        for r in 0..2 {
            for (i, o) in run.outcomes(r).iter().enumerate() {
                assert!(o.is_ok(), "seed {seed}: rank {r} batch {i}: {o:?}");
            }
            run.check_received(r);
        }
    }
}

/// Seed `seed`'s exchange (`small`: a short one), rank 1 vanishing at
/// each step `cuts` picks from the clean run's step count: with the
/// deadline an hour away, every batch of rank 0 must end on the cut, done
/// (with the right bytes) or failed with `PeerLost` naming rank 1.
fn vanish(seed: u64, small: bool, cuts: impl Fn(usize) -> Vec<usize>) {
    let hour = Duration::from_secs(3600);
    let mut clean = Run::with(seed, hour, small);
    clean.until_ended([true, true], STEP, 2_000_000, &format!("seed {seed}"));
    for cut in cuts(clean.step) {
        let mut run = Run::with(seed, hour, small);
        while run.step < cut {
            run.tick([true, true], STEP);
        }
        run.link.borrow_mut().cut = true;
        run.until_ended([true, false], STEP, 100_000, &format!("seed {seed}, cut at step {cut}"));
        for (i, o) in run.outcomes(0).iter().enumerate() {
            if let Err(e) = o {
                assert_eq!(e.kind(), &ErrorKind::PeerLost { rank: 1 }, "seed {seed}, cut at {cut}, batch {i}: {e}");
            }
        }
        run.check_received(0);
    }
}

#[test]
fn a_rank_that_vanishes_along_an_exchange_leaves_the_other_with_every_batch_ended() {
    for seed in 0..24 {
        // 65 points from the start to the end.
        vanish(seed, false, |steps| if steps <= 64 { (0..=steps).collect() } else { (0..=64).map(|k| k * steps / 64).collect() });
    }
}

#[test]
fn a_rank_that_vanishes_at_every_step_of_short_exchanges_leaves_the_other_with_every_batch_ended() {
    for seed in 0..40 {
        vanish(seed, true, |steps| (0..=steps).collect());
    }
}

#[test]
fn a_rank_that_stalls_for_good_fails_the_others_batches_at_their_deadline_naming_it() {
    for seed in 0..40 {
        let deadline = Duration::from_millis(50);
        let mut clean = Run::new(seed, deadline);
        clean.until_ended([true, true], STEP, 2_000_000, &format!("seed {seed}"));
        let stop = clean.step / 2;
        let mut run = Run::new(seed, deadline);
        while run.step < stop {
            run.tick([true, true], STEP);
        }
        // Rank 1 never runs again, but its connection stays up.
        run.until_ended([true, false], Duration::from_micros(100), 100_000, &format!("seed {seed}, stalled at step {stop}"));
        for (i, o) in run.outcomes(0).iter().enumerate() {
            let Err(e) = o else { continue };
            let text = e.to_string();
            match e.kind() {
                ErrorKind::Timeout => assert!(text.contains("peer rank 1"), "seed {seed}, batch {i}: {text}"),
                // A send that timed out half written leaves the stream
                // unusable: what was still pending fails with that.
                ErrorKind::Backend => assert!(text.contains("stream to peer rank 1 is broken"), "seed {seed}, batch {i}: {text}"),
                other => panic!("seed {seed}, batch {i}: {other:?}: {text}"),
            }
        }
        run.check_received(0);
    }
}

/// The harness itself: a clean exchange takes more than a handful of
/// steps, so the cuts above land inside it.
#[test]
fn the_simulation_moves_bytes_in_many_pieces() {
    let mut run = Run::new(7, Duration::from_secs(3600));
    run.until_ended([true, true], STEP, 2_000_000, "seed 7");
    assert!(run.step > 10, "{} steps", run.step);
}
