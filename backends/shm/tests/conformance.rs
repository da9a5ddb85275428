//! The conformance suite, point-to-point patterns and windows on
//! `shm`, at W up to 4 (ranks as threads of this test, over shared memory).

weft_conformance::backend_tests!("shm", weft_shm::link, 4);
