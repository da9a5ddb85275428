//! Minimal diagnostics to stderr, controlled by `WEFT_LOG` (`debug` or `info`).

use std::sync::OnceLock;

fn level() -> u8 {
    static LEVEL: OnceLock<u8> = OnceLock::new();
    *LEVEL.get_or_init(|| match std::env::var("WEFT_LOG").as_deref() {
        Ok("debug") | Ok("DEBUG") => 2,
        Ok("info") | Ok("INFO") => 1,
        _ => 0,
    })
}

/// Print a debug line when `WEFT_LOG=debug`.
pub fn debug(args: std::fmt::Arguments<'_>) {
    if level() >= 2 {
        eprintln!("[weft debug] {args}");
    }
}

/// Print an info line when `WEFT_LOG` is `info` or `debug`.
pub fn info(args: std::fmt::Arguments<'_>) {
    if level() >= 1 {
        eprintln!("[weft] {args}");
    }
}
