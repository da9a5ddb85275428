//! One-sided windows on the host backends: the conformance cases
//! (`weft_conformance::run_windows`) at W = 2-4 and with 64 MiB, on a split
//! sub-group, a target busy computing while puts arrive, forged frames,
//! a target and an origin killed mid-put. (hierarchical runs the cases in
//! `hierarchical.rs`.)

use std::time::{Duration, Instant};
use weft::prelude::*;
use weft_tests::{options, run_threads};

fn o() -> OpOptions {
    OpOptions::default()
}

fn conformance(spec: &'static str, w: usize, big: usize) {
    run_threads(w, options(spec), move |pg| {
        let checks = weft_conformance::run_windows(&pg, big);
        let (table, ok) = weft_conformance::summary(&checks);
        assert!(ok, "{spec} W={w} rank {}:\n{table}", pg.rank());
    });
}

#[test]
fn window_cases_cpu_tcp() {
    for w in 2..=4 {
        conformance("cpu-tcp", w, 100_000);
    }
}

#[test]
fn window_cases_shm() {
    for w in 2..=4 {
        conformance("shm", w, 100_000);
    }
}

#[test]
fn window_cases_with_64_mib() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        conformance(spec, 2, 64 << 20);
    }
}

/// Windows on a split sub-group (ranks 1 and 3 of 4) while the others
/// make their own.
#[test]
fn windows_on_a_split_sub_group() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        run_threads(4, options(spec), move |pg| {
            let mine: Vec<usize> = if pg.rank() % 2 == 1 { vec![1, 3] } else { vec![0, 2] };
            let sub = pg.join_split(&mine).unwrap().expect("a member");
            let checks = weft_conformance::run_windows(&sub, 10_000);
            let (table, ok) = weft_conformance::summary(&checks);
            assert!(ok, "{spec} split {mine:?} rank {}:\n{table}", sub.rank());
        });
    }
}

/// The target computes for 2 s without calling weft while rank 1 puts
/// 64 MiB and signals: both finish before the target is done computing
/// (cpu-tcp's target needs its progress thread for that), and the data
/// is there when it looks.
#[test]
fn a_target_busy_computing_takes_puts() {
    const BUSY: Duration = Duration::from_secs(2);
    for spec in ["cpu-tcp", "shm", "loopback"] {
        let ends = run_threads(2, options(spec), move |pg| {
            let n = 64 << 20;
            let win = pg.new_window(n).unwrap();
            pg.barrier(&o()).unwrap().wait().unwrap();
            let start = Instant::now();
            let at = if pg.rank() == 0 {
                let mut x = 1u64;
                while start.elapsed() < BUSY {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
                let done = start.elapsed();
                // Already there: no time to wait.
                win.wait_signal(1, &OpOptions::default().timeout(Duration::from_millis(1))).unwrap();
                let mut got = vec![0u8; n];
                win.local().read(0, &mut got).unwrap();
                assert!(got.iter().enumerate().all(|(i, b)| *b == weft_conformance::windows_byte(1, i)), "{spec}: wrong data");
                done
            } else {
                let data: Vec<u8> = (0..n).map(|i| weft_conformance::windows_byte(1, i)).collect();
                win.put(&data[..], 0, 0, &o()).unwrap().wait().unwrap();
                win.signal(0, &o()).unwrap().wait().unwrap();
                start.elapsed()
            };
            win.deregister().unwrap();
            at
        });
        assert!(ends[1] < ends[0], "{spec}: the put and signal finished after {:?}, the target computed until {:?}", ends[1], ends[0]);
    }
}

/// A rank killed (SIGKILL) while it is the target of puts and the origin
/// of signals: every survivor gets `PeerLost` naming it within 10 s, over
/// sockets and over shared memory.
#[test]
fn a_window_peer_killed_mid_put_is_named_within_10s() {
    for backend in ["cpu-tcp", "shm"] {
        weft_tests::procs::last_rank_killed_is_named_within_10s(env!("CARGO_BIN_EXE_weft-test-worker"), "window_sigkill", backend, 3);
    }
}

/// Frames forged on the wire (a put past the target's end; a frame of the
/// wrong length): the target refuses them, writes nothing, and names the
/// sender where it waits for it. A put past the end leaves the group
/// usable; a frame of the wrong length breaks the transport's framing,
/// which fails the group on the target, naming the sender.
#[test]
fn forged_frames_are_refused_by_the_target() {
    use weft::window::frame::{Frame, CONTROL};
    let forged: [(&str, Vec<u8>); 2] = [
        ("a put past the end", Frame::Put { offset: 98, len: 8 }.encode(&[7; 8]).to_vec()),
        ("a frame of the wrong length", vec![0x57; 10]),
    ];
    for (what, bytes) in forged {
        run_threads(2, options("cpu-tcp"), move |pg| {
            let win = pg.new_window(100).unwrap();
            if pg.rank() == 1 {
                pg.forge_send(&bytes, 0, weft::tag::window(0, CONTROL)).unwrap();
            } else {
                let e = win.wait_signal(1, &OpOptions::default().timeout(Duration::from_secs(10))).unwrap_err();
                assert!(e.to_string().contains("rank 1") && e.kind() != &weft::ErrorKind::Timeout, "{what}: {e}");
                let mut got = vec![1u8; 100];
                win.local().read(0, &mut got).unwrap();
                assert!(got.iter().all(|b| *b == 0), "{what}: the target's memory was written");
            }
            let mut v = [pg.rank() as u32 + 1];
            let ok = pg.all_reduce(&mut v[..], ReduceOp::Sum, &o()).and_then(|w| w.wait());
            (ok.map(|()| v[0]), win.deregister().is_ok())
        })
        .into_iter()
        .enumerate()
        .for_each(|(r, (sum, closed))| {
            println!("{what}: rank {r}: {sum:?}, deregistered: {closed}");
            if what.contains("past the end") {
                assert_eq!(sum.unwrap(), 3, "{what}: the group is still usable");
                assert_eq!(closed, r == 1, "{what}: rank 0 reports the forged frame at deregistration");
            } else if r == 0 {
                let e = sum.unwrap_err().to_string();
                assert!(e.contains("peer rank 1") && e.contains("window"), "{what}: {e}");
            }
        });
    }
}

/// A window outliving its group (dropped after it): every later call
/// fails at once and dropping the window does not wait for its timeout.
#[test]
fn a_window_outliving_its_group_fails_promptly() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        run_threads(2, options(spec).timeout(Duration::from_secs(20)), move |pg| {
            let win = pg.new_window(64).unwrap();
            pg.barrier(&o()).unwrap().wait().unwrap();
            drop(pg);
            let start = Instant::now();
            let put = win.put(&[1u8; 8][..], 0, 0, &o()).and_then(|w| w.wait());
            let wait = win.wait_signal(1 - win.rank(), &o());
            drop(win);
            assert!(start.elapsed() < Duration::from_secs(10), "{spec}: {:?} (put: {put:?}, wait: {wait:?})", start.elapsed());
            assert!(wait.is_err(), "{spec}: a wait for a signal nobody can send");
        });
    }
}

/// A wait for a signal from a peer that deregisters instead fails at once
/// (not at its deadline), saying so.
#[test]
fn a_wait_on_a_peer_that_deregistered_fails_at_once() {
    for spec in ["cpu-tcp", "shm", "loopback"] {
        run_threads(2, options(spec), move |pg| {
            let win = pg.new_window(64).unwrap();
            if pg.rank() == 0 {
                let start = Instant::now();
                let e = win.wait_signal(1, &OpOptions::default().timeout(Duration::from_secs(20))).unwrap_err();
                assert!(start.elapsed() < Duration::from_secs(10), "{spec}: {:?}", start.elapsed());
                assert!(e.to_string().contains("deregistered"), "{spec}: {e}");
            }
            win.deregister().unwrap();
        });
    }
}
