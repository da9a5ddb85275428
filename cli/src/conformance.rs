//! `weft conformance`: run the public conformance suite on a backend (a
//! registered name or a plugin file) across N local ranks.

use anyhow::{bail, Result};
use std::time::Duration;
use weft::prelude::*;
use weft_cli::launcher;

pub fn main(nproc: usize, backend: &str, count: usize, device: &str) -> Result<i32> {
    if std::env::var("RANK").is_err() {
        let args = ["conformance", "--backend", backend, "--count", &count.to_string(), "--device", device];
        return launcher::relaunch_local(nproc, args.iter().map(|a| a.to_string()).collect(), Some(Duration::from_secs(600)));
    }
    // A path loads that plugin; a name must be registered (built-in or on WEFT_PLUGIN_PATH).
    let name = if backend.contains('/') || backend.ends_with(".so") { weft::registry::load_plugin(backend)? } else { backend.to_string() };
    let pg = ProcessGroup::from_env(GroupOptions::from_env()?.backend(name.as_str()).timeout(Duration::from_secs(60)))?;
    let place = match device {
        "cpu" => None,
        "cuda" => Some(weft_conformance::cuda::local_placement(pg.rank())?),
        d => bail!("--device {d:?}: use cpu or cuda"),
    };
    let checks = weft_conformance::run_on(&pg, count, place);
    let (table, ok) = weft_conformance::summary(&checks);
    let r = pg.rank();
    if r == 0 {
        println!("weft conformance: backend {name:?} on {} ranks, {device} tensors, {count} elements per tensor", pg.size());
        print!("{table}");
    } else if !ok {
        eprint!("rank {r}:\n{table}");
    }
    if !ok {
        bail!("rank {r}: conformance failures");
    }
    Ok(0)
}
