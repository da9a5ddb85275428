//! The conformance suite, point-to-point patterns and windows on
//! `cpu-tcp`, at W up to 4 (ranks as threads of this test, over real sockets).

weft_conformance::backend_tests!("cpu-tcp", weft_cpu_tcp::link, 4);
