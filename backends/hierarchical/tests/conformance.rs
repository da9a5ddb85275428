//! The conformance suite, point-to-point patterns and windows on
//! `hierarchical`: ranks are threads of this test, each emulating its
//! host with the group hint `host_id` (shm among the ranks of a host,
//! cpu-tcp between hosts). Processes on emulated hosts (`WEFT_HOST_ID`)
//! run it in `tests/tests/hierarchical.rs`.

use weft_conformance::{assert_passed, checks_on_threads_each, run, run_p2p, run_windows, Check};

/// Hosts of each rank: two even hosts, and uneven ones out of rank order.
const LAYOUTS: [&[&str]; 2] = [&["a", "a", "b", "b"], &["a", "b", "b", "a", "b"]];

fn on_hosts(hosts: &[&str], suite: fn(&weft::ProcessGroup) -> Vec<Check>) {
    weft_shm::link();
    weft_cpu_tcp::link();
    weft_hierarchical::link();
    let opts = |r: usize| {
        weft::GroupOptions::default().backend("hierarchical").timeout(std::time::Duration::from_secs(60)).hint("host_id", hosts[r])
    };
    let results = checks_on_threads_each(opts, hosts.len(), |pg| {
        let served = pg.backend_name((weft::DeviceKind::Cpu, weft::Layout::Dense));
        assert_eq!(served.as_deref(), Some("hierarchical"), "rank {}", pg.rank());
        suite(pg)
    });
    assert_passed(&results, &format!("hosts {hosts:?}"));
}

#[test]
fn passes_the_conformance_suite() {
    for hosts in LAYOUTS {
        on_hosts(hosts, |pg| run(pg, 33));
    }
}

#[test]
fn point_to_point_progresses_together() {
    for hosts in LAYOUTS {
        on_hosts(hosts, |pg| run_p2p(pg, None, 16 << 20));
    }
}

#[test]
fn windows_pass_their_cases() {
    for hosts in LAYOUTS {
        on_hosts(hosts, |pg| run_windows(pg, 1 << 20));
    }
}
