//! Ranks as real processes, initialised from the environment like a
//! launched job.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;
use weft_tests::procs::{run_world, run_world_on_free_port};

const WORKER: &str = env!("CARGO_BIN_EXE_weft-test-worker");

/// These are cpu-tcp's process tests (`auto` would take shm on one host;
/// tests/tests/shm.rs covers that backend).
fn world(n: usize, args: &[&str], env: &[(&str, &str)], limit: Duration) -> Vec<weft_tests::procs::RankEnd> {
    let mut env = env.to_vec();
    env.push(("WEFT_BACKEND", "cpu-tcp"));
    run_world(WORKER, n, args, &env, limit)
}

fn assert_all_ok(ends: &[weft_tests::procs::RankEnd]) {
    for (r, e) in ends.iter().enumerate() {
        assert!(e.status.success(), "rank {r} failed: {:?}\n{}", e.status, e.output);
    }
}

#[test]
fn ops_across_processes_at_several_world_sizes() {
    for n in [1, 2, 3, 5] {
        assert_all_ok(&world(n, &["ops"], &[], Duration::from_secs(60)));
    }
}

#[test]
fn sigkill_mid_all_reduce_gives_peer_lost_on_every_other_rank_within_10s() {
    for n in [2, 4] {
        let ends = world(n, &["sigkill"], &[], Duration::from_secs(90));
        let victim = &ends[n - 1];
        assert_eq!(victim.status.signal(), Some(9), "the victim was killed: {}", victim.output);
        for (r, e) in ends[..n - 1].iter().enumerate() {
            assert!(e.status.success(), "rank {r}: {:?}\n{}", e.status, e.output);
            let after = e.at.saturating_duration_since(victim.at);
            assert!(after < Duration::from_secs(10), "rank {r} reported {after:?} after the kill");
            assert!(e.output.contains(&format!("peer rank {} lost", n - 1)), "{}", e.output);
        }
    }
}

#[test]
fn weft_debug_detail_names_the_mismatched_rank_across_processes() {
    assert_all_ok(&world(3, &["debug_mismatch"], &[("WEFT_DEBUG", "detail")], Duration::from_secs(60)));
}

#[test]
fn rank_zero_hosts_the_store_under_open_mpi_and_slurm_variables() {
    let ompi = |r: usize, port: &str| {
        vec![
            ("OMPI_COMM_WORLD_RANK".to_string(), r.to_string()),
            ("OMPI_COMM_WORLD_SIZE".into(), "3".into()),
            ("MASTER_ADDR".into(), "127.0.0.1".into()),
            ("MASTER_PORT".into(), port.to_string()),
            ("WEFT_BACKEND".into(), "cpu-tcp".into()),
        ]
    };
    assert_all_ok(&run_world_on_free_port(WORKER, 3, &["ops"], &[], Duration::from_secs(60), ompi));
    let slurm = |r: usize, port: &str| {
        vec![
            ("SLURM_PROCID".to_string(), r.to_string()),
            ("SLURM_NTASKS".into(), "2".into()),
            ("SLURM_LOCALID".into(), r.to_string()),
            ("MASTER_ADDR".into(), "localhost".into()),
            ("MASTER_PORT".into(), port.to_string()),
            ("WEFT_BACKEND".into(), "cpu-tcp".into()),
        ]
    };
    assert_all_ok(&run_world_on_free_port(WORKER, 2, &["ops"], &[], Duration::from_secs(60), slurm));
}

#[test]
fn socket_interface_selection() {
    assert_all_ok(&world(2, &["ops"], &[("WEFT_SOCKET_IFNAME", "lo")], Duration::from_secs(60)));
    let ends = world(2, &["ops"], &[("WEFT_SOCKET_IFNAME", "no-such-if0")], Duration::from_secs(60));
    for e in ends {
        assert!(!e.status.success());
        assert!(e.output.contains("WEFT_SOCKET_IFNAME") && e.output.contains("matches no interface"), "{}", e.output);
    }
}

#[test]
fn weft_algorithm_forces_algorithms_for_the_whole_group() {
    let env = [("WEFT_ALGORITHM", "all_reduce=ring,broadcast=scatter_allgather")];
    assert_all_ok(&world(3, &["ops"], &env, Duration::from_secs(60)));
}

#[test]
fn the_default_timeout_comes_from_weft_timeout_seconds() {
    assert_all_ok(&world(2, &["default_timeout"], &[("WEFT_TIMEOUT_SECONDS", "1")], Duration::from_secs(60)));
}
