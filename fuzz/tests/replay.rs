//! Every stored input of every fuzz target runs without panicking (each
//! target checks its own properties), within an outer time limit.

use std::path::Path;
use std::time::{Duration, Instant};

#[test]
fn the_corpus_replays_cleanly() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let start = Instant::now();
    for t in weft_fuzz::TARGETS {
        let dir = root.join(t.name);
        let mut inputs: Vec<_> =
            std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).flatten().map(|e| e.path()).collect();
        inputs.sort();
        assert!(!inputs.is_empty(), "no corpus for {}", t.name);
        for path in inputs {
            let data = std::fs::read(&path).unwrap();
            (t.run)(&data);
            assert!(start.elapsed() < Duration::from_secs(120), "the replay is hanging (at {})", path.display());
        }
    }
}
