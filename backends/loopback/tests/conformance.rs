//! The conformance suite, point-to-point patterns and windows on
//! `loopback`, at W up to 5 (ranks as threads of this test, handing messages between them).

weft_conformance::backend_tests!("loopback", weft_loopback::link, 5);
