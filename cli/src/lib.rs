//! The pieces of the `weft` command that tests reuse: the launcher.

pub mod launcher;
