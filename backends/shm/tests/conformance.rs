//! The conformance suite, point-to-point patterns and windows on `shm`,
//! at W = 1 to 4 (ranks as threads of this test, over shared memory).

use weft_conformance::on_threads;

#[test]
fn passes_the_conformance_suite() {
    weft_shm::link();
    for w in 1..=4 {
        on_threads("shm", w, |pg| weft_conformance::run(pg, 33));
    }
}

#[test]
fn point_to_point_progresses_together() {
    weft_shm::link();
    for w in 2..=4 {
        on_threads("shm", w, |pg| weft_conformance::run_p2p(pg, None, 16 << 20));
    }
}

#[test]
fn windows_pass_their_cases() {
    weft_shm::link();
    for w in 2..=4 {
        on_threads("shm", w, |pg| weft_conformance::run_windows(pg, 1 << 20));
    }
}
