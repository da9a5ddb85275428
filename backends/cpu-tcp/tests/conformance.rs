//! The conformance suite, point-to-point patterns and windows on `cpu-tcp`,
//! at W = 1 to 4 (ranks as threads of this test, over real sockets).

use weft_conformance::on_threads;

#[test]
fn passes_the_conformance_suite() {
    weft_cpu_tcp::link();
    for w in 1..=4 {
        on_threads("cpu-tcp", w, |pg| weft_conformance::run(pg, 33));
    }
}

#[test]
fn point_to_point_progresses_together() {
    weft_cpu_tcp::link();
    for w in 2..=4 {
        on_threads("cpu-tcp", w, |pg| weft_conformance::run_p2p(pg, None, 16 << 20));
    }
}

#[test]
fn windows_pass_their_cases() {
    weft_cpu_tcp::link();
    for w in 2..=4 {
        on_threads("cpu-tcp", w, |pg| weft_conformance::run_windows(pg, 1 << 20));
    }
}
