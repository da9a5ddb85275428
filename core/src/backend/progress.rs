//! Posted point-to-point ops that progress together, whoever drives them.
//!
//! A transport with a progress loop (cpu-tcp's sockets, shm's rings) keeps
//! every op posted to it in one [`Table`]: the steps of a collective posted
//! by a blocking [`Backend::exchange`](crate::backend::Backend::exchange),
//! and the background sends and receives of a scope or a batch
//! ([`Backend::post`](crate::backend::Backend::post)). One thread at a time
//! holds the transport's engine and drives every op in the table, its own
//! and everyone else's; it leaves once what it waits for is done, and a
//! waiting thread takes over ([`wait_until`]). So no op waits for an
//! unrelated one: a long send that needs its receiver's go-ahead never
//! stops a receive posted after it (MPI's progress rule).
//!
//! Ops are kept in post order (compaction keeps it), so receives of one
//! peer and tag match messages in the order they were posted (MPI's
//! non-overtaking rule), and a transport streams sends to a peer in that
//! order.
//!
//! No I/O here: the table, the batches and their completions, and the
//! hand-over between threads. The transports move the bytes.

use crate::backend::{Gather, GatherSend, P2p};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Called once when a posted batch has finished: `Ok` once every op of it
/// is done, else why it failed (after its buffers are no longer touched).
pub type Done = Box<dyn FnOnce(Result<()>) + Send>;

/// A batch of ops handed to a transport: they progress with every other
/// posted op, and its completion is called once all have completed or the
/// batch failed.
///
/// The ops borrow the poster's buffers until the completion runs, which
/// the compiler cannot check: so safe code never gets them for longer than
/// a call. A transport hands the batch to its [`Table`] ([`Table::add`]),
/// runs it at once ([`Post::run_now`]), or takes it apart under the
/// contract of [`Post::into_parts`] (`unsafe`); a wrapper renumbers its
/// peers and tags ([`Post::renumber`]) and wraps its completion
/// ([`Post::then`]).
///
/// A backend in safe Rust cannot keep a posted buffer past completion:
///
/// ```compile_fail,E0616
/// // The ops are not the backend's to take.
/// fn keep(post: weft::backend::progress::Post) -> Vec<weft::backend::P2p<'static>> {
///     post.ops
/// }
/// ```
///
/// ```compile_fail
/// // A look at them ends with the look (borrowed data escapes).
/// fn keep(post: &weft::backend::progress::Post) -> &'static [u8] {
///     match &post.ops()[0] {
///         weft::backend::P2p::Send { data, .. } => data,
///         weft::backend::P2p::Recv { .. } => &[],
///     }
/// }
/// ```
pub struct Post {
    /// The sends and receives, in issue order. The borrows are really of
    /// the poster's buffers: the poster keeps them valid until `done` runs.
    ops: Vec<P2p<'static>>,
    /// Sends whose bytes a [`Gather`] writes (after `ops`).
    gathered: Vec<GatherSend<'static>>,
    /// When the batch fails with `Timeout` if unfinished.
    deadline: Instant,
    /// Called once with the batch's outcome.
    done: Done,
    /// Where the sender of the batch's any-source receive is left (see
    /// [`crate::backend::ANY_SOURCE`]), before `done` is called.
    source: Option<Arc<AtomicUsize>>,
}

/// A [`Post`] taken apart ([`Post::into_parts`]).
pub struct PostParts {
    /// The sends and receives, in issue order; really borrowed until
    /// `done` has been called.
    pub ops: Vec<P2p<'static>>,
    /// Sends whose bytes a [`Gather`] writes (after `ops`); borrowed as `ops`.
    pub gathered: Vec<GatherSend<'static>>,
    /// When the batch fails with `Timeout` if unfinished.
    pub deadline: Instant,
    /// Called once with the batch's outcome.
    pub done: Done,
    /// Where the sender of an any-source receive is left before `done`.
    pub source: Option<Arc<AtomicUsize>>,
}

impl Post {
    /// A batch of `ops` (and `gathered` sends) whose borrows end when `done`
    /// has been called.
    ///
    /// # Safety
    /// The buffers `ops` and `gathered` borrow must stay valid (and not be
    /// used elsewhere) until `done` has been called.
    pub unsafe fn new(ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: Instant, done: Done) -> Post {
        // SAFETY: the caller's promise.
        let (ops, gathered) = unsafe { extend(ops, gathered) };
        Post { ops, gathered, deadline, done, source: None }
    }

    /// The same batch, leaving the sender of its any-source receive in `cell`.
    pub fn with_source(self, cell: Arc<AtomicUsize>) -> Post {
        Post { source: Some(cell), ..self }
    }

    /// The ops, for a look (the borrow ends with this one).
    pub fn ops(&self) -> &[P2p<'_>] {
        &self.ops
    }

    /// The gathered sends, for a look.
    pub fn gathered(&self) -> &[GatherSend<'_>] {
        &self.gathered
    }

    /// Where the sender of its any-source receive is to be left, taken out
    /// (a wrapper that renumbers ranks puts its own there).
    pub fn take_source(&mut self) -> Option<Arc<AtomicUsize>> {
        self.source.take()
    }

    /// Give each op and gathered send another peer and tag: `f(peer, tag)`
    /// changes them in place (a view of a transport in other ranks).
    pub fn renumber(&mut self, mut f: impl FnMut(&mut usize, &mut u64)) {
        for op in &mut self.ops {
            let (peer, tag) = op.address_mut();
            f(peer, tag);
        }
        for g in &mut self.gathered {
            f(&mut g.peer, &mut g.tag);
        }
    }

    /// The same batch, its outcome passed through `f` before its completion
    /// sees it (a wrapper's error translation, its bookkeeping).
    pub fn then(self, f: impl FnOnce(Result<()>) -> Result<()> + Send + 'static) -> Post {
        let done = self.done;
        Post { done: Box::new(move |r| done(f(r))), ..self }
    }

    /// The same batch, `f` called once its completion has run.
    pub fn finally(self, f: impl FnOnce() + Send + 'static) -> Post {
        let done = self.done;
        Post {
            done: Box::new(move |r| {
                done(r);
                f()
            }),
            ..self
        }
    }

    /// Fail the batch with `e` without running it.
    pub fn fail(self, e: Error) {
        (self.done)(Err(e))
    }

    /// Run the batch now with `f` (a transport that does not post: an
    /// exchange) and complete it with the outcome. `f` gets the ops for
    /// the call only.
    pub fn run_now(mut self, f: impl FnOnce(&mut [P2p<'_>], &[GatherSend<'_>], Instant) -> Result<()>) {
        let r = f(&mut self.ops, &self.gathered, self.deadline);
        (self.done)(r)
    }

    /// The batch taken apart, for a transport that keeps its buffers in
    /// its own way (as raw pointers, for a C plugin).
    ///
    /// # Safety
    /// The borrows in `ops` and `gathered` last only until `done` has been
    /// called: the caller touches none of those buffers after calling it,
    /// and keeps no reference into them.
    pub unsafe fn into_parts(self) -> PostParts {
        PostParts { ops: self.ops, gathered: self.gathered, deadline: self.deadline, done: self.done, source: self.source }
    }
}

/// `ops` and `gathered` re-borrowed for as long as the caller promises.
///
/// # Safety
/// The buffers they borrow stay valid (and unused elsewhere) for as long as
/// the results are used.
unsafe fn extend(ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>]) -> (Vec<P2p<'static>>, Vec<GatherSend<'static>>) {
    // SAFETY: the caller's promise.
    unsafe { (extend_ops(ops).collect(), extend_gathered(gathered).collect()) }
}

/// See [`extend`].
unsafe fn extend_ops<'s, 'a: 's>(ops: &'s mut [P2p<'a>]) -> impl Iterator<Item = P2p<'static>> + use<'s, 'a> {
    ops.iter_mut().map(|op| {
        // SAFETY: only the lifetime changes; the caller of `extend_ops`
        // keeps the buffers valid.
        unsafe { std::mem::transmute::<P2p<'_>, P2p<'static>>(op.reborrow()) }
    })
}

/// See [`extend`].
unsafe fn extend_gathered<'s, 'a: 's>(gathered: &'s [GatherSend<'a>]) -> impl Iterator<Item = GatherSend<'static>> + use<'s, 'a> {
    // SAFETY: as in `extend_ops`.
    gathered.iter().map(|g| unsafe { std::mem::transmute::<GatherSend<'_>, GatherSend<'static>>(*g) })
}

struct Batch {
    id: u64,
    deadline: When,
    /// `None`: the driving thread's own batch (see [`Table::add_local`]).
    done: Option<Done>,
    /// Where the sender of its any-source receive is left (see [`Post::with_source`]).
    source: Option<Arc<AtomicUsize>>,
}

/// A batch's deadline: fixed when it was posted, or the driving thread's
/// own op's [`Deadline`], fixed by the first look at it (at the first
/// turn that moves nothing, when the transport reads the clock), so an
/// exchange that finishes at once never reads the clock.
enum When {
    At(Instant),
    /// Really borrowed from the driving thread, for as long as its batch
    /// is in the table (see [`Table::add_local`]).
    Of(&'static Deadline),
}

impl When {
    /// The instant; if not yet fixed, fixed from `now` (or the clock).
    fn get(&self, now: Option<Instant>) -> Instant {
        match (self, now) {
            (When::At(at), _) => *at,
            (When::Of(d), Some(now)) => d.get_from(now),
            (When::Of(d), None) => d.get(),
        }
    }
}

impl Batch {
    /// Report the outcome: call `done`, or leave it for the driving thread.
    fn finish(self, local: &mut Option<Result<()>>, r: Result<()>) {
        match self.done {
            Some(done) => done(r),
            None => *local = Some(r),
        }
    }
}

/// Every op posted to one transport and not yet finished, in post order,
/// each with the transport's own state `S` for it.
///
/// `ops[i]`, `done[i]`, `gathered[i]` and `state[i]` describe op `i`; a
/// transport marks an op finished by setting `done[i]`. Op indices stay
/// valid until [`Table::compact`], which returns how they moved.
///
/// The ops borrow their posters' buffers until their batch completes,
/// which the compiler cannot check. So the table lends them for a borrow
/// of itself only: to look at ([`Table::ops`], [`Table::view`]) or, to
/// fill receives, under the contract of [`Table::columns`] (`unsafe`); a
/// batch completes only through the table's own calls, which need it
/// whole, so no borrowed buffer outlives its batch:
///
/// ```compile_fail
/// // A send's bytes kept after the table has moved on (`settle` may have
/// // completed its batch): the borrow of the table is still held.
/// fn keep(table: &mut weft::backend::progress::Table<()>) {
///     let data: &[u8] = match &table.ops()[0] {
///         weft::backend::P2p::Send { data, .. } => data,
///         weft::backend::P2p::Recv { .. } => &[],
///     };
///     table.settle();
///     println!("{}", data.len());
/// }
/// ```
pub struct Table<S> {
    /// The ops (a gathered send is a `Send` with empty `data`).
    ops: Vec<P2p<'static>>,
    /// Which ops are finished.
    pub done: Vec<bool>,
    /// The source of a gathered send.
    gathered: Vec<Option<&'static dyn Gather>>,
    /// The transport's state for each op.
    pub state: Vec<S>,
    batch_of: Vec<u64>,
    batches: VecDeque<Batch>,
    next_batch: u64,
    /// The outcome of the driving thread's own batch, once finished.
    local: Option<Result<()>>,
}

impl<S> Default for Table<S> {
    fn default() -> Self {
        Table {
            ops: Vec::new(),
            done: Vec::new(),
            gathered: Vec::new(),
            state: Vec::new(),
            batch_of: Vec::new(),
            batches: VecDeque::new(),
            next_batch: 0,
            local: None,
        }
    }
}

/// A [`Table`]'s columns, lent together for a look ([`Table::view`]).
pub struct View<'t, S> {
    /// The ops.
    pub ops: &'t [P2p<'t>],
    /// Which are finished.
    pub done: &'t [bool],
    /// The source of each gathered send.
    pub gathered: &'t [Option<&'t dyn Gather>],
    /// The transport's state for each.
    pub state: &'t [S],
}

/// A [`Table`]'s columns, lent together to fill receives and mark ops
/// finished ([`Table::columns`]).
pub struct Columns<'t, S> {
    /// The ops: their receive buffers writable, their peers bindable.
    pub ops: &'t mut [P2p<'t>],
    /// Which are finished.
    pub done: &'t mut [bool],
    /// The source of each gathered send.
    pub gathered: &'t [Option<&'t dyn Gather>],
    /// The transport's state for each.
    pub state: &'t mut [S],
    batches: &'t VecDeque<Batch>,
}

impl<S> Columns<'_, S> {
    /// [`Table::next_deadline`], while the columns are lent.
    pub fn next_deadline(&self) -> Option<Instant> {
        next_deadline(self.batches)
    }
}

/// The earliest deadline of `batches` (one not yet fixed is fixed from the clock).
fn next_deadline(batches: &VecDeque<Batch>) -> Option<Instant> {
    batches.iter().map(|b| b.deadline.get(None)).min()
}

impl<S> Table<S> {
    /// The ops, for as long as this borrow of the table.
    pub fn ops(&self) -> &[P2p<'_>] {
        &self.ops
    }

    /// Every column, for a look.
    pub fn view(&self) -> View<'_, S> {
        View { ops: &self.ops, done: &self.done, gathered: &self.gathered, state: &self.state }
    }

    /// Every column, the ops writable (receive buffers, the peer a
    /// receive from any rank binds to), for as long as this borrow.
    ///
    /// # Safety
    /// Put no op into `ops` (assigning, replacing or swapping in one from
    /// elsewhere): the table would keep its borrow past this one. Writing
    /// through the ops' buffers and binding a receive's peer are fine.
    pub unsafe fn columns(&mut self) -> Columns<'_, S> {
        // SAFETY: only the ops' lifetime shrinks to this borrow, so no
        // borrow taken from them outlives it; the caller puts no op with a
        // shorter one in (the reason `&mut` forbids this in general).
        let ops = unsafe { std::mem::transmute::<&mut [P2p<'static>], &mut [P2p<'_>]>(self.ops.as_mut_slice()) };
        Columns { ops, done: &mut self.done, gathered: &self.gathered, state: &mut self.state, batches: &self.batches }
    }

    /// Append `post`'s ops, each with the state `init` gives it; the new
    /// batch's id. Its first op is at the table's old length.
    pub fn add(&mut self, post: Post, init: impl FnMut(&P2p<'_>, Option<&dyn Gather>) -> S) -> u64 {
        let id = self.append(post.ops, post.gathered, When::At(post.deadline), Some(post.done), init);
        if let Some(b) = self.batches.back_mut() {
            b.source = post.source;
        }
        id
    }

    /// Append the driving thread's own batch (it drives until
    /// [`Table::local_done`], then takes the outcome with
    /// [`Table::take_local`]): no completion to allocate and call.
    ///
    /// Its `deadline` is fixed (if it is not yet) by the table's first look
    /// at it ([`Table::expired`], [`Table::next_deadline`]).
    ///
    /// # Safety
    /// The buffers `ops` and `gathered` borrow, and `deadline`, stay valid
    /// until the outcome is in (the ops have then left the table).
    pub unsafe fn add_local(
        &mut self,
        ops: &mut [P2p<'_>],
        gathered: &[GatherSend<'_>],
        deadline: &Deadline,
        init: impl FnMut(&P2p<'_>, Option<&dyn Gather>) -> S,
    ) -> u64 {
        self.local = None;
        // SAFETY: the caller's promise.
        let (ops, gathered) = unsafe { (extend_ops(ops), extend_gathered(gathered)) };
        // SAFETY: the caller's promise; the batch leaves the table with its
        // outcome, before the caller's `deadline` goes.
        let deadline = unsafe { std::mem::transmute::<&Deadline, &'static Deadline>(deadline) };
        self.append(ops, gathered, When::Of(deadline), None, init)
    }

    /// Whether the driving thread's own batch has finished.
    pub fn local_done(&self) -> bool {
        self.local.is_some()
    }

    /// The outcome of the driving thread's own batch, if finished.
    pub fn take_local(&mut self) -> Option<Result<()>> {
        self.local.take()
    }

    fn append(
        &mut self,
        ops: impl IntoIterator<Item = P2p<'static>>,
        gathered: impl IntoIterator<Item = GatherSend<'static>>,
        deadline: When,
        done: Option<Done>,
        mut init: impl FnMut(&P2p<'_>, Option<&dyn Gather>) -> S,
    ) -> u64 {
        let id = self.next_batch;
        self.next_batch += 1;
        for op in ops {
            self.state.push(init(&op, None));
            self.ops.push(op);
            self.gathered.push(None);
        }
        for g in gathered {
            let op = P2p::Send { peer: g.peer, tag: g.tag, data: &[] };
            self.state.push(init(&op, Some(g.src)));
            self.ops.push(op);
            self.gathered.push(Some(g.src));
        }
        self.done.resize(self.ops.len(), false);
        self.batch_of.resize(self.ops.len(), id);
        self.batches.push_back(Batch { id, deadline, done, source: None });
        id
    }

    /// Number of ops (finished ones included, until compaction).
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// Whether the table holds no op.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Whether nothing is posted: no op and no batch (a batch of no ops
    /// is still to be reported).
    pub fn is_idle(&self) -> bool {
        self.ops.is_empty() && self.batches.is_empty()
    }

    /// Whether every op is finished (or there are none).
    pub fn all_done(&self) -> bool {
        self.done.iter().all(|d| *d)
    }

    /// Whether batch `id` still has an unfinished op.
    fn unfinished(&self, id: u64) -> bool {
        self.batch_of.iter().zip(&self.done).any(|(b, d)| *b == id && !*d)
    }

    /// Call `done` of every batch whose ops have all finished; true if any.
    pub fn settle(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.batches.len() {
            let id = self.batches[i].id;
            if self.unfinished(id) {
                i += 1;
                continue;
            }
            if let Some(cell) = &self.batches[i].source {
                // Its receives are bound to their senders by now.
                let from = self.ops.iter().zip(&self.batch_of).find_map(|(op, b)| match op {
                    P2p::Recv { peer, .. } if *b == id => Some(*peer),
                    _ => None,
                });
                cell.store(from.unwrap_or(crate::backend::ANY_SOURCE), Ordering::Release);
            }
            self.batches.remove(i).expect("in range").finish(&mut self.local, Ok(()));
            any = true;
        }
        any
    }

    /// The earliest deadline of an unfinished batch (one not yet fixed is
    /// fixed from the clock).
    pub fn next_deadline(&self) -> Option<Instant> {
        next_deadline(&self.batches)
    }

    /// An unfinished batch whose deadline has passed at `now` (one not yet
    /// fixed is fixed from `now`, and has not).
    pub fn expired(&self, now: Instant) -> Option<u64> {
        self.batches.iter().find(|b| b.deadline.get(Some(now)) <= now).map(|b| b.id)
    }

    /// The batch op `i` belongs to.
    pub fn batch(&self, i: usize) -> u64 {
        self.batch_of[i]
    }

    /// The unfinished ops of batch `id`.
    pub fn pending_of(&self, id: u64) -> Vec<usize> {
        (0..self.ops.len()).filter(|&i| self.batch_of[i] == id && !self.done[i]).collect()
    }

    /// Give up batch `id`: its ops count as finished (the transport has
    /// already let go of their buffers) and its `done` gets `e`.
    pub fn withdraw(&mut self, id: u64, e: Error) {
        for i in 0..self.ops.len() {
            if self.batch_of[i] == id {
                self.done[i] = true;
            }
        }
        if let Some(at) = self.batches.iter().position(|b| b.id == id) {
            self.batches.remove(at).expect("found").finish(&mut self.local, Err(e));
        }
    }

    /// Fail every batch with `e` (the transport has let go of every
    /// buffer) and empty the table.
    pub fn fail_all(&mut self, e: &Error) {
        for b in std::mem::take(&mut self.batches) {
            b.finish(&mut self.local, Err(e.clone()));
        }
        self.ops.clear();
        self.done.clear();
        self.gathered.clear();
        self.state.clear();
        self.batch_of.clear();
    }

    /// Drop finished ops (nothing refers to them any more: their buffers
    /// may be gone); `Some(map)` if unfinished ops moved (`map[old]` is the
    /// new index of a kept op). Ops keep their order.
    pub fn compact(&mut self) -> Option<Vec<usize>> {
        if self.all_done() {
            // Nothing refers to a finished op: no map to hand out.
            self.ops.clear();
            self.done.clear();
            self.gathered.clear();
            self.state.clear();
            self.batch_of.clear();
            return None;
        }
        if !self.done.iter().any(|d| *d) {
            return None;
        }
        let keep: Vec<bool> = self.done.iter().map(|d| !d).collect();
        let mut map = vec![usize::MAX; self.ops.len()];
        let mut next = 0;
        for (old, slot) in map.iter_mut().enumerate() {
            if keep[old] {
                *slot = next;
                next += 1;
            }
        }
        retain_by(&mut self.ops, &keep);
        retain_by(&mut self.gathered, &keep);
        retain_by(&mut self.state, &keep);
        retain_by(&mut self.batch_of, &keep);
        self.done.clear();
        self.done.resize(self.ops.len(), false);
        Some(map)
    }
}

fn retain_by<T>(v: &mut Vec<T>, keep: &[bool]) {
    let mut i = 0;
    v.retain(|_| {
        i += 1;
        keep[i - 1]
    });
}

/// Where posters leave batches for the thread that drives a transport, and
/// how waiting threads learn that something finished or that nobody
/// drives any more.
#[derive(Default)]
pub struct Posting {
    inbox: Mutex<Vec<Post>>,
    /// Batches in the inbox (read without the lock on every pass).
    waiting: AtomicUsize,
    /// Bumped when a batch finishes or a driver leaves.
    changes: Mutex<u64>,
    changed: Condvar,
    /// Threads in `wait_change`: without any, `notify` costs one load.
    sleepers: AtomicUsize,
}

impl Posting {
    /// Leave `post` for the driver (in call order: the order ops match in).
    pub fn push(&self, post: Post) {
        let mut inbox = self.inbox.lock().unwrap_or_else(|p| p.into_inner());
        inbox.push(post);
        self.waiting.fetch_add(1, Ordering::Release);
    }

    /// Whether batches wait in the inbox.
    pub fn has_new(&self) -> bool {
        self.waiting.load(Ordering::Acquire) > 0
    }

    /// Hand `f` the batches left since the last call, in post order (the
    /// inbox keeps its memory for the next ones); stops at `f`'s first
    /// error, leaving the rest for [`Posting::fail_new`].
    pub fn take(&self, mut f: impl FnMut(Post) -> Result<()>) -> Result<bool> {
        if !self.has_new() {
            return Ok(false);
        }
        let mut inbox = self.inbox.lock().unwrap_or_else(|p| p.into_inner());
        self.waiting.store(0, Ordering::Release);
        let mut posts = inbox.drain(..);
        for post in posts.by_ref() {
            if let Err(e) = f(post) {
                let rest: Vec<Post> = posts.collect();
                drop(inbox);
                for post in rest {
                    (post.done)(Err(e.clone()));
                }
                return Err(e);
            }
        }
        Ok(true)
    }

    /// Fail every batch still in the inbox with `e`.
    pub fn fail_new(&self, e: &Error) {
        let _ = self.take(|post| {
            (post.done)(Err(e.clone()));
            Ok(())
        });
    }

    /// Tell waiting threads that a batch finished or the driver left.
    #[inline]
    pub fn notify(&self) {
        // With the sleeper's SeqCst increment before it reads the count
        // under the lock: either this sees the sleeper, or the sleeper sees
        // what finished before it sleeps.
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            self.notify_sleepers();
        }
    }

    #[cold]
    fn notify_sleepers(&self) {
        let mut n = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        *n += 1;
        self.changed.notify_all();
    }

    /// The current change count (pass it to [`Posting::wait_change`]).
    pub fn changes(&self) -> u64 {
        *self.changes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sleep until the change count moves past `seen`, or `at_most` passes.
    pub fn wait_change(&self, seen: u64, at_most: Duration) {
        let n = self.changes.lock().unwrap_or_else(|p| p.into_inner());
        let _ = self.changed.wait_timeout_while(n, at_most, |n| *n == seen);
    }

    /// Run `f` (which checks whether to sleep, then sleeps in
    /// [`Posting::wait_change`]) counted as a sleeper.
    fn sleeping<T>(&self, f: impl FnOnce() -> T) -> T {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        let r = f();
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
        r
    }
}

/// A transport whose posted ops one thread at a time drives.
pub trait DrivenTransport {
    /// Where batches are posted.
    fn posting(&self) -> &Arc<Posting>;
    /// If no other thread drives, drive every posted op (taking new posts
    /// as they come) until `until()` holds, then return true; false if
    /// another thread drives now.
    fn try_drive(&self, until: &dyn Fn() -> bool) -> bool;
    /// Wake the driver if it sleeps (a new batch is in the inbox).
    fn wake_driver(&self);
    /// If no other thread drives now: take the inbox, then run `ops` (and
    /// `gathered` sends) as this thread's own batch, driving everything
    /// until it has finished ([`Table::add_local`]); `None` if another
    /// thread drives.
    fn try_exchange(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>], deadline: &Deadline) -> Option<Result<()>>;
    /// Fail every posted op with `e` and let go of every buffer (a panic
    /// unwound through the driver: the table must not keep ops whose
    /// buffers the unwinding frees).
    fn abandon(&self, e: &Error);
}

/// The outcome of one batch, for a thread that waits for it.
#[derive(Default)]
pub struct Slot {
    set: AtomicBool,
    result: Mutex<Option<Result<()>>>,
}

impl Slot {
    /// Whether the outcome is in.
    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }
    /// A [`Done`] that leaves the outcome here (the driver then wakes
    /// waiting threads: see [`Posting::notify`]).
    pub fn completer(self: &Arc<Self>) -> Done {
        let slot = self.clone();
        Box::new(move |r| {
            *slot.result.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
            // SeqCst: with the driver's SeqCst read of the sleepers after
            // it (`Posting::notify`) and the sleeper's SeqCst count before it
            // reads this, one of them sees the other.
            slot.set.store(true, Ordering::SeqCst);
        })
    }
    /// The outcome (`Ok` if none was left).
    pub fn take(&self) -> Result<()> {
        self.result.lock().unwrap_or_else(|p| p.into_inner()).take().unwrap_or(Ok(()))
    }
}

/// Return once `until()` holds, driving the engine whenever no other
/// thread does. Waiters wake when a batch finishes (the driver calls
/// [`Posting::notify`] after [`Table::settle`] finished any) or the driver
/// leaves, and at least every few milliseconds.
pub fn wait_until<E: DrivenTransport + ?Sized>(transport: &E, until: &dyn Fn() -> bool) {
    let posting = transport.posting();
    loop {
        if until() {
            return;
        }
        if transport.try_drive(until) {
            // Whoever waits now may drive.
            posting.notify();
            continue;
        }
        // Counted as a sleeper before looking again: a driver that
        // finishes this or leaves from now on wakes this thread.
        let drove = posting.sleeping(|| {
            let seen = posting.changes();
            if until() {
                return false;
            }
            if transport.try_drive(until) {
                return true;
            }
            posting.wait_change(seen, Duration::from_millis(5));
            false
        });
        if drove {
            posting.notify();
        }
    }
}

/// Post `ops` (and `gathered` sends) and return once they have finished:
/// what a transport's blocking `exchange` is, over its [`DrivenTransport`] side.
///
/// Generic, so that a transport's own transport is called directly (an 8 B
/// send or receive is a few hundred instructions, and the layers were a
/// good part of them); `&dyn DrivenTransport` works as well.
#[inline]
pub fn exchange<E: DrivenTransport + ?Sized>(
    transport: &E,
    ops: &mut [P2p<'_>],
    gathered: &[GatherSend<'_>],
    deadline: &Deadline,
) -> Result<()> {
    // Usually nobody else drives: no posting, no completion to allocate.
    let tried = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| transport.try_exchange(ops, gathered, deadline)));
    match tried {
        Ok(Some(r)) => {
            // Whoever waits now may drive.
            transport.posting().notify();
            return r;
        }
        Ok(None) => {}
        Err(panic) => {
            transport.abandon(&Error::backend("internal error: a panic while driving the transport"));
            std::panic::resume_unwind(panic);
        }
    }
    post_and_wait_on(transport, ops, gathered, deadline)
}

/// [`exchange`]'s path when another thread drives: post the batch and
/// wait for it (out of line: the common path never takes it).
#[cold]
fn post_and_wait_on<E: DrivenTransport + ?Sized>(
    transport: &E,
    ops: &mut [P2p<'_>],
    gathered: &[GatherSend<'_>],
    deadline: &Deadline,
) -> Result<()> {
    post_and_wait(
        ops,
        gathered,
        deadline.get(),
        |post| {
            transport.posting().push(post);
            transport.wake_driver();
        },
        |until| wait_until(transport, until),
    )
}

/// Hand `ops` (and `gathered` sends) to `post` as one batch, then run
/// `progress` until it has finished; its outcome. The blocking form of any
/// transport that posts.
pub fn post_and_wait(
    ops: &mut [P2p<'_>],
    gathered: &[GatherSend<'_>],
    deadline: Instant,
    post: impl FnOnce(Post),
    progress: impl FnOnce(&dyn Fn() -> bool),
) -> Result<()> {
    let slot = Arc::new(Slot::default());
    // SAFETY: this returns only after `done` has been called (`progress`
    // returns once the slot is set), so the borrows outlive the batch.
    post(unsafe { Post::new(ops, gathered, deadline, slot.completer()) });
    progress(&|| slot.is_set());
    slot.take()
}

/// The driver lock of an engine: whoever holds it drives the table.
///
/// An op's path only tries it (`try_lock`: a thread that finds it held
/// waits another way, see [`wait_until`]); `lock`, which yields between
/// tries, is for failing everything and closing. It is released by a
/// plain store: a `Mutex`'s release is a locked instruction, which waits
/// until every store the op made (a message in a peer's ring) has reached
/// the peer's cache, and that wait cost every small exchange after a
/// context switch (figures: bench/RESULTS.md, "Measurements behind code comments"). A
/// panic while driving does not poison it: that op failed, and the state
/// is consistent between passes.
pub type DriverLock<T> = spin::mutex::SpinMutex<T, spin::relax::Yield>;

/// A held [`DriverLock`].
pub type DriverGuard<'a, T> = spin::mutex::SpinMutexGuard<'a, T>;

#[cfg(test)]
mod tests {
    use super::*;

    fn post(ops: Vec<P2p<'static>>, log: &Arc<Mutex<Vec<(usize, bool)>>>, tag: usize) -> Post {
        let log = log.clone();
        Post {
            ops,
            gathered: Vec::new(),
            deadline: Instant::now() + Duration::from_secs(60),
            done: Box::new(move |r| log.lock().unwrap().push((tag, r.is_ok()))),
            source: None,
        }
    }

    /// Batches finish when their own ops do, whatever the order; compaction
    /// keeps the survivors' order and says where they went.
    #[test]
    fn batches_finish_independently_and_compaction_keeps_order() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut t: Table<u32> = Table::default();
        let recv = |tag| P2p::Recv { peer: 1, tag, buf: Box::leak(Box::new([0u8; 1])) };
        let a = t.add(post(vec![recv(1), recv(2)], &log, 0), |_, _| 0);
        let _b = t.add(post(vec![recv(3)], &log, 1), |_, _| 0);
        assert_eq!(t.pending_of(a), vec![0, 1]);
        t.done[2] = true;
        assert!(t.settle());
        assert_eq!(*log.lock().unwrap(), vec![(1, true)]);
        t.done[0] = true;
        assert!(!t.settle());
        let map = t.compact().expect("half the table finished");
        assert_eq!(map[1], 0);
        assert_eq!(t.len(), 1);
        assert!(matches!(t.ops[0], P2p::Recv { tag: 2, .. }));
        t.withdraw(a, Error::timeout("late"));
        assert_eq!(*log.lock().unwrap(), vec![(1, true), (0, false)]);
        assert!(t.all_done());
    }

    /// A batch of no ops finishes at the first settle; the driving
    /// thread's own batch reports into the table, not through a callback.
    #[test]
    fn empty_and_local_batches_finish() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut t: Table<()> = Table::default();
        t.add(post(vec![], &log, 7), |_, _| ());
        assert!(!t.is_idle());
        assert!(t.settle());
        assert_eq!(*log.lock().unwrap(), vec![(7, true)]);
        let mut buf = [0u8; 2];
        let mut ops = [P2p::Recv { peer: 1, tag: 1, buf: &mut buf }];
        let deadline = Deadline::after(Duration::from_secs(60));
        // SAFETY: `buf` and `deadline` outlive the batch (it leaves the
        // table below).
        unsafe { t.add_local(&mut ops, &[], &deadline, |_, _| ()) };
        assert!(!t.local_done());
        t.done[0] = true;
        t.settle();
        assert!(t.compact().is_none());
        assert!(t.is_idle());
        assert!(t.take_local().unwrap().is_ok());
    }

    /// The driving thread's own deadline is fixed by the table's first look
    /// at it, from the reading that look was given, and is the caller's.
    #[test]
    fn a_local_batch_fixes_its_deadline_at_the_first_look() {
        let mut t: Table<()> = Table::default();
        let mut ops = [P2p::Send { peer: 1, tag: 1, data: &[] }];
        let deadline = Deadline::after(Duration::from_secs(5));
        // SAFETY: `deadline` outlives the batch (withdrawn below).
        let id = unsafe { t.add_local(&mut ops, &[], &deadline, |_, _| ()) };
        let first = Instant::now() + Duration::from_secs(3);
        assert_eq!(t.expired(first), None);
        assert_eq!(deadline.get(), first + Duration::from_secs(5), "fixed by that look");
        assert_eq!(t.next_deadline(), Some(first + Duration::from_secs(5)));
        assert_eq!(t.expired(first + Duration::from_secs(5)), Some(id));
        t.withdraw(id, Error::timeout("late"));
        t.settle();
        assert!(t.take_local().unwrap().is_err());
    }

    /// A deadline passes only for the batch it belongs to.
    #[test]
    fn expiry_names_the_late_batch() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut t: Table<()> = Table::default();
        let mut p = post(vec![P2p::Send { peer: 1, tag: 1, data: &[] }], &log, 0);
        p.deadline = Instant::now();
        let late = t.add(p, |_, _| ());
        t.add(post(vec![P2p::Send { peer: 1, tag: 2, data: &[] }], &log, 1), |_, _| ());
        assert_eq!(t.expired(Instant::now()), Some(late));
        t.fail_all(&Error::aborted("stop"));
        assert_eq!(log.lock().unwrap().len(), 2);
        assert!(t.is_empty());
    }
}
