//! Ranks in other network namespaces, as containers on one kernel are. With
//! `/dev/shm` shared they are on one host: `auto` picks shm and every op
//! passes. With a `/dev/shm` of their own (a mount namespace) shared memory
//! cannot reach them: they count as another host, and `auto` picks the
//! hierarchical backend, whose leaders talk over a veth pair between the
//! namespaces. Creating namespaces needs root and iproute2, so the test is
//! ignored by a plain `cargo test`; `.ci/run` (root) runs it with
//! `--ignored`, where failing to create them fails it.

use std::process::Command;
use std::time::Duration;
use weft_tests::procs::{free_port, run_world_with, RankEnd};

/// Two network namespaces joined by a veth pair, removed on drop.
struct Namespaces {
    names: [String; 2],
    /// Rank 0's address, in the first namespace.
    master: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Namespaces {
    fn create() -> Result<Namespaces, String> {
        let id = std::process::id();
        let names = [format!("weft-{id}-a"), format!("weft-{id}-b")];
        let ns = Namespaces { names: names.clone(), master: format!("10.250.{}.1", id % 250) };
        let (va, vb) = (format!("wv{}a", id % 1_000_000), format!("wv{}b", id % 1_000_000));
        ip(&["netns", "add", &names[0]])?;
        ip(&["netns", "add", &names[1]])?;
        ip(&["link", "add", &va, "type", "veth", "peer", "name", &vb])?;
        for (n, (v, host)) in names.iter().zip([(&va, 1), (&vb, 2)]) {
            ip(&["link", "set", v, "netns", n])?;
            ip(&["-n", n, "addr", "add", &format!("10.250.{}.{host}/24", id % 250), "dev", v])?;
            ip(&["-n", n, "link", "set", v, "up"])?;
            ip(&["-n", n, "link", "set", "lo", "up"])?;
        }
        Ok(ns)
    }

    /// Run the worker's `scenario` as 4 ranks: 0 and 1 in the first
    /// namespace, 2 and 3 in the second (with their own /dev/shm if
    /// `private_shm`).
    fn run(&self, scenario: &str, private_shm: bool) -> Vec<RankEnd> {
        let worker = env!("CARGO_BIN_EXE_weft-test-worker");
        // Chooses the namespace from RANK, then runs the worker in it.
        let wrap = r#"ns=$NS_A; [ "$RANK" -ge 2 ] && ns=$NS_B
if [ "$RANK" -ge 2 ] && [ "$PRIVATE_SHM" = 1 ]; then
  exec ip netns exec "$ns" unshare -m sh -c 'mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"' "$@"
fi
exec ip netns exec "$ns" "$@""#;
        let port = free_port().to_string();
        let vars = |r: usize| {
            [
                ("RANK", r.to_string()),
                ("WORLD_SIZE", "4".into()),
                ("MASTER_ADDR", self.master.clone()),
                ("MASTER_PORT", port.clone()),
                ("WEFT_BACKEND", "auto".into()),
                ("NS_A", self.names[0].clone()),
                ("NS_B", self.names[1].clone()),
                ("PRIVATE_SHM", (private_shm as u8).to_string()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect()
        };
        run_world_with("sh", 4, &["-c", wrap, "sh", worker, scenario], &[], Duration::from_secs(120), vars)
    }
}

impl Drop for Namespaces {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and so both.
        for n in &self.names {
            let _ = ip(&["netns", "delete", n]);
        }
    }
}

#[test]
#[ignore = "needs root and iproute2: .ci/run runs it with --ignored"]
fn ranks_in_other_network_namespaces_share_memory_unless_dev_shm_differs() {
    let ns = Namespaces::create().unwrap_or_else(|e| panic!("cannot create network namespaces (needs root and iproute2): {e}"));
    for (private_shm, backend) in [(false, "shm"), (true, "hierarchical")] {
        for e in ns.run("which_backend", private_shm) {
            assert!(e.status.success() && e.output.contains(&format!("backend={backend}")), "private /dev/shm {private_shm}: {}", e.output);
        }
        for (r, e) in ns.run("conformance", private_shm).iter().enumerate() {
            assert!(e.status.success() && e.output.contains("checks passed"), "private /dev/shm {private_shm}, rank {r}:\n{}", e.output);
        }
    }
}
