//! Whether a peer's process is still alive.
//!
//! `kill(pid, 0)` answers cheaply, but it also finds a process that died
//! and was not reaped yet (a zombie, whose parent is busy or is the
//! launcher that has not looked) and a stranger that reused the pid after
//! the peer was reaped. `/proc/<pid>/stat` tells those apart: the state
//! (`Z`, `X`) and the process's start time, recorded the first time the
//! peer is seen alive. Reading it costs a few system calls, so it is done
//! at most every [`PROC_EVERY`] per peer, from waits that already slept.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Least time between two `/proc` reads for one peer.
const PROC_EVERY: Duration = Duration::from_millis(50);

/// Per-peer liveness checks of one group.
pub(crate) struct Liveness {
    epoch: Instant,
    /// Per rank: the process's start time (clock ticks after boot) + 1,
    /// 0 until first seen.
    starts: Vec<AtomicU64>,
    /// Per rank: when (ms after `epoch`) `/proc` may be read again.
    next_read: Vec<AtomicU64>,
}

impl Liveness {
    /// Checks for a group of `size` ranks.
    pub(crate) fn new(size: usize) -> Liveness {
        Liveness {
            epoch: Instant::now(),
            starts: (0..size).map(|_| AtomicU64::new(0)).collect(),
            next_read: (0..size).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// How rank `peer`'s process `pid` died, if it did.
    pub(crate) fn dead(&self, peer: usize, pid: u32) -> Option<String> {
        if nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), None) == Err(nix::errno::Errno::ESRCH) {
            return Some(format!("peer rank {peer} (pid {pid}) died"));
        }
        let now = self.epoch.elapsed().as_millis() as u64;
        let next = &self.next_read[peer];
        let due = next.load(Ordering::Relaxed);
        if now < due || next.compare_exchange(due, now + PROC_EVERY.as_millis() as u64, Ordering::Relaxed, Ordering::Relaxed).is_err() {
            return None;
        }
        let (state, start) = proc_stat(pid)?;
        if matches!(state, 'Z' | 'X') {
            return Some(format!("peer rank {peer} (pid {pid}) died (a zombie its parent has not reaped)"));
        }
        match self.starts[peer].compare_exchange(0, start + 1, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => None,
            Err(known) if known != start + 1 => Some(format!("peer rank {peer} (pid {pid}) died (the pid now belongs to another process)")),
            Err(_) => None,
        }
    }
}

/// Whether process `pid` is stopped (by a signal or a debugger): it will
/// not finish what it was doing until it is resumed, if ever.
pub(crate) fn stopped(pid: u32) -> bool {
    matches!(proc_stat(pid), Some(('T' | 't', _)))
}

/// The state letter and start time of process `pid`, from
/// `/proc/<pid>/stat`; None where it cannot be read (no procfs, or the
/// process is gone, which `kill` reports).
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&text)
}

/// `(state, starttime)` from a `/proc/<pid>/stat` line. The command name
/// (field 2) is in parentheses and may hold spaces and parentheses itself:
/// the fields after it start after its last `)`.
fn parse_stat(text: &str) -> Option<(char, u64)> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace();
    let state = fields.next()?.chars().next()?;
    // starttime is field 22; `state` was field 3.
    let start = fields.nth(22 - 4)?.parse().ok()?;
    Some((state, start))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_state_and_start_time_even_with_odd_command_names() {
        let line = "1234 (we ird) )name) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 18446744073709551615";
        assert_eq!(parse_stat(line), Some(('S', 987654)));
        assert_eq!(parse_stat("garbage"), None);
        let (state, _) = proc_stat(std::process::id()).expect("this process's stat");
        assert!(matches!(state, 'R' | 'S'), "{state}");
    }

    #[test]
    fn this_process_is_alive_and_a_missing_pid_is_dead() {
        let l = Liveness::new(2);
        assert_eq!(l.dead(0, std::process::id()), None);
        std::thread::sleep(PROC_EVERY + Duration::from_millis(10));
        assert_eq!(l.dead(0, std::process::id()), None, "the start time matches on a second read");
        // Pids above the kernel's maximum (2^22) never exist.
        assert!(l.dead(1, (1 << 22) + 7).is_some());
    }
}
