//! Runs a group's ops one at a time, in issue order: every collective, and
//! point-to-point ops on transports that cannot post them (plugins without
//! `WEFT_PLUGIN_CONCURRENT`; see `p2p.rs` for the others, which take no
//! ticket).
//!
//! What may overlap: collectives never overlap each other on one rank, and
//! every rank runs them in the same order (their sequence numbers must
//! agree). A posted send or receive overlaps everything: it may finish
//! before, during or after any collective issued before or after it, and a
//! collective never waits for it (both make progress in the same transport
//! loop, whichever thread drives it).
//!
//! Every op takes a ticket when issued. Direct ops run on the caller's
//! thread once their ticket comes up (no thread hop: lowest latency); ops
//! issued in a scope are queued for the group's worker thread. Collectives
//! also get a sequence number, identical on every rank because every rank
//! issues collectives in the same order: it is taken when the op's turn
//! comes, so it follows ticket order by construction.
//!
//! The uncontended path is two atomic read-modify-writes per op (take a
//! ticket, pass the turn on); the mutex and condition variable are only
//! touched by threads that must wait, and by whoever wakes them.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// A queued op, ready to run on the worker thread; it gets the op's
/// collective sequence number.
pub(crate) type Task = Box<dyn FnOnce(u64) + Send + 'static>;

/// A queued task and whether it is a collective (takes a sequence number).
struct Queued {
    ticket: u64,
    collective: bool,
    task: Task,
}

#[derive(Default)]
struct State {
    queue: VecDeque<Queued>,
    worker: Option<JoinHandle<()>>,
    shutdown: bool,
}

#[derive(Default)]
pub(crate) struct Executor {
    next_ticket: AtomicU64,
    /// The ticket whose turn it is.
    serving: AtomicU64,
    /// The next collective sequence number; only the op whose turn it is
    /// reads and advances it.
    next_seq: AtomicU64,
    /// Threads blocked (or about to block) on `turn`: without any, passing
    /// the turn skips the lock and the wake-up.
    waiters: AtomicUsize,
    state: Mutex<State>,
    turn: Condvar,
}

/// Passes the turn on when dropped, even if the op panicked, so later ops
/// never wait forever.
pub(crate) struct Turn<'a>(&'a Executor);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        self.0.finish_turn();
    }
}

impl Executor {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take a ticket: the op's place in the group's order.
    pub(crate) fn issue(&self) -> u64 {
        self.next_ticket.fetch_add(1, Ordering::Relaxed)
    }

    /// Run `f` on this thread when `ticket` comes up, with the op's
    /// collective sequence number (if `collective`; else the next one,
    /// unused).
    pub(crate) fn run_inline<T>(&self, ticket: u64, collective: bool, f: impl FnOnce(u64) -> T) -> T {
        let (_turn, seq) = self.begin(ticket, collective);
        f(seq)
    }

    /// Wait on this thread until `ticket` comes up: its turn, passed on
    /// when dropped, and its collective sequence number (as `run_inline`).
    pub(crate) fn begin(&self, ticket: u64, collective: bool) -> (Turn<'_>, u64) {
        if self.serving.load(Ordering::Acquire) != ticket {
            let mut s = self.lock();
            self.waiters.fetch_add(1, Ordering::SeqCst);
            while self.serving.load(Ordering::SeqCst) != ticket {
                s = self.turn.wait(s).unwrap_or_else(|p| p.into_inner());
            }
            self.waiters.fetch_sub(1, Ordering::SeqCst);
        }
        (Turn(self), self.take_seq(collective))
    }

    /// The sequence number of the op whose turn it is.
    fn take_seq(&self, collective: bool) -> u64 {
        let seq = self.next_seq.load(Ordering::Relaxed);
        if collective {
            self.next_seq.store(seq + 1, Ordering::Relaxed);
        }
        seq
    }

    fn finish_turn(&self) {
        // With the waiters' SeqCst increment before they check `serving`:
        // either this sees a waiter (and wakes it under the lock, which it
        // holds from its check until it sleeps), or the waiter sees the
        // new turn.
        self.serving.fetch_add(1, Ordering::SeqCst);
        if self.waiters.load(Ordering::SeqCst) > 0 {
            drop(self.lock());
            self.turn.notify_all();
        }
    }

    /// Queue `task` for the worker, starting it if needed.
    pub(crate) fn enqueue(self: &Arc<Self>, ticket: u64, collective: bool, task: Task) {
        let mut s = self.lock();
        // In ticket order: threads sharing a scope may enqueue out of order
        // (ticket taken, then the lock), and the worker serves the front.
        let at = s.queue.partition_point(|q| q.ticket < ticket);
        s.queue.insert(at, Queued { ticket, collective, task });
        if s.worker.is_none() {
            let me = self.clone();
            s.worker = Some(
                std::thread::Builder::new()
                    .name("weft-group-worker".into())
                    .spawn(move || me.worker_loop())
                    .expect("spawn the group worker thread"),
            );
        }
        drop(s);
        self.turn.notify_all();
    }

    fn worker_loop(&self) {
        loop {
            let Queued { collective, task, .. } = {
                let mut s = self.lock();
                loop {
                    let Some(front) = s.queue.front() else {
                        if s.shutdown {
                            return;
                        }
                        // `enqueue` and `shutdown` always wake the worker.
                        s = self.turn.wait(s).unwrap_or_else(|p| p.into_inner());
                        continue;
                    };
                    let ticket = front.ticket;
                    if self.serving.load(Ordering::SeqCst) == ticket {
                        break s.queue.pop_front().expect("front exists");
                    }
                    // Waiting for a turn: counted, so `finish_turn` wakes it.
                    self.waiters.fetch_add(1, Ordering::SeqCst);
                    if self.serving.load(Ordering::SeqCst) != ticket {
                        s = self.turn.wait(s).unwrap_or_else(|p| p.into_inner());
                    }
                    self.waiters.fetch_sub(1, Ordering::SeqCst);
                }
            };
            let _turn = Turn(self);
            let seq = self.take_seq(collective);
            // A task completes its own Work; catching here keeps the worker
            // (and every later op of the group) alive if one panics.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| task(seq)));
        }
    }

    /// Stop the worker after the queue drains.
    pub(crate) fn shutdown(&self) {
        let worker = {
            let mut s = self.lock();
            s.shutdown = true;
            s.worker.take()
        };
        // Unconditionally: cheap, once per group.
        self.turn.notify_all();
        if let Some(w) = worker {
            let _ = w.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct ops from several threads and queued ops interleave in ticket
    /// order, and collectives get consecutive sequence numbers in that
    /// order.
    #[test]
    fn turns_and_sequence_numbers_follow_tickets() {
        let exec = Arc::new(Executor::default());
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut threads = Vec::new();
        for t in 0..40u64 {
            let ticket = exec.issue();
            let collective = t % 3 != 0;
            let (exec2, log2) = (exec.clone(), log.clone());
            if t % 2 == 0 {
                exec.enqueue(ticket, collective, Box::new(move |seq| log2.lock().unwrap().push((ticket, collective, seq))));
            } else {
                threads.push(std::thread::spawn(move || {
                    exec2.run_inline(ticket, collective, |seq| log2.lock().unwrap().push((ticket, collective, seq)))
                }));
            }
        }
        threads.into_iter().for_each(|t| t.join().unwrap());
        exec.shutdown();
        let log = log.lock().unwrap();
        let tickets: Vec<u64> = log.iter().map(|e| e.0).collect();
        assert_eq!(tickets, (0..40).collect::<Vec<_>>());
        let mut next = 0;
        for &(ticket, collective, seq) in log.iter() {
            assert_eq!(seq, next, "ticket {ticket}");
            next += collective as u64;
        }
    }

    /// Tasks enqueued out of ticket order still run in ticket order (no
    /// worker waiting on a front whose turn never comes).
    #[test]
    fn tasks_enqueued_out_of_order_run_in_ticket_order() {
        let exec = Arc::new(Executor::default());
        let (t0, t1) = (exec.issue(), exec.issue());
        let (tx, rx) = std::sync::mpsc::channel();
        for t in [t1, t0] {
            let tx = tx.clone();
            exec.enqueue(t, true, Box::new(move |seq| tx.send((t, seq)).unwrap()));
        }
        let got: Vec<(u64, u64)> = (0..2).map(|_| rx.recv_timeout(std::time::Duration::from_secs(10)).expect("both tasks run")).collect();
        assert_eq!(got, [(t0, 0), (t1, 1)]);
        exec.shutdown();
    }

    /// A panicking op passes the turn on.
    #[test]
    fn a_panic_passes_the_turn() {
        let exec = Executor::default();
        let t0 = exec.issue();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| exec.run_inline(t0, true, |_| panic!("boom"))));
        assert!(r.is_err());
        let t1 = exec.issue();
        assert_eq!(exec.run_inline(t1, true, |seq| seq), 1);
    }
}
