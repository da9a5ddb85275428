//! Runs a group's ops one at a time, in issue order.
//!
//! Every op takes a ticket when issued. Direct ops run on the caller's
//! thread once their ticket comes up (no thread hop: lowest latency); ops
//! issued in a scope are queued for the group's worker thread. Collectives
//! also get a sequence number, identical on every rank because every rank
//! issues collectives in the same order.

use super::work::WorkState;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// A queued op, ready to run on the worker thread.
pub(crate) type Task = Box<dyn FnOnce() + Send + 'static>;

#[derive(Default)]
struct State {
    next_ticket: u64,
    serving: u64,
    next_seq: u64,
    queue: VecDeque<(u64, Task)>,
    worker: Option<JoinHandle<()>>,
    shutdown: bool,
    /// Threads blocked on `turn`: without any, passing the turn skips the
    /// wake-up (a system call on every op otherwise).
    waiters: usize,
}

#[derive(Default)]
pub(crate) struct Executor {
    state: Mutex<State>,
    turn: Condvar,
}

impl Executor {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take a ticket (and a sequence number if `collective`).
    pub(crate) fn issue(&self, collective: bool) -> (u64, u64) {
        let mut s = self.lock();
        let t = s.next_ticket;
        s.next_ticket += 1;
        let seq = s.next_seq;
        if collective {
            s.next_seq += 1;
        }
        (t, seq)
    }

    /// Run `f` on this thread when `ticket` comes up. The turn passes on
    /// even if `f` panics, so later ops never wait forever.
    pub(crate) fn run_inline<T>(&self, ticket: u64, f: impl FnOnce() -> T) -> T {
        let mut s = self.lock();
        while s.serving != ticket {
            s = self.wait(s);
        }
        drop(s);
        struct Turn<'a>(&'a Executor);
        impl Drop for Turn<'_> {
            fn drop(&mut self) {
                self.0.finish_turn();
            }
        }
        let _turn = Turn(self);
        f()
    }

    fn finish_turn(&self) {
        let mut s = self.lock();
        s.serving += 1;
        self.notify(s);
    }

    /// Block on `turn`, counted in `waiters`.
    fn wait<'a>(&self, mut s: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        s.waiters += 1;
        let mut s = self.turn.wait(s).unwrap_or_else(|p| p.into_inner());
        s.waiters -= 1;
        s
    }

    /// Wake the threads blocked on `turn`, if any.
    fn notify(&self, s: MutexGuard<'_, State>) {
        let blocked = s.waiters > 0;
        drop(s);
        if blocked {
            self.turn.notify_all();
        }
    }

    /// Queue `task` for the worker, starting it if needed.
    pub(crate) fn enqueue(self: &Arc<Self>, ticket: u64, task: Task) {
        let mut s = self.lock();
        s.queue.push_back((ticket, task));
        if s.worker.is_none() {
            let me = self.clone();
            s.worker = Some(
                std::thread::Builder::new()
                    .name("weft-group-worker".into())
                    .spawn(move || me.worker_loop())
                    .expect("spawn the group worker thread"),
            );
        }
        self.notify(s);
    }

    fn worker_loop(&self) {
        loop {
            let task = {
                let mut s = self.lock();
                loop {
                    if let Some((t, _)) = s.queue.front() {
                        if *t == s.serving {
                            break s.queue.pop_front().expect("front exists").1;
                        }
                    } else if s.shutdown {
                        return;
                    }
                    s = self.wait(s);
                }
            };
            // A task completes its own Work; catching here keeps the worker
            // (and every later op of the group) alive if one panics.
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task));
            self.finish_turn();
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

/// A fresh completion state.
pub(crate) fn new_state() -> Arc<WorkState> {
    Arc::new(WorkState::default())
}
