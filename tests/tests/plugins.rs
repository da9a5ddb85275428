//! Plugins through the C ABI: the C example passes the conformance suite at
//! world sizes 2-5, and misbehaving plugins give precise errors, never a
//! crash of the host.

use std::time::Duration;
use weft::prelude::*;
use weft::ErrorKind;
use weft_tests::plugins::{c_uds, cc_text, example_lib, scratch};
use weft_tests::procs::run_world;
use weft_tests::{options, run_threads};

fn conformance(spec: &str, w: usize) {
    let results = run_threads(w, options(spec), |pg| weft_conformance::run(&pg, 5));
    for (r, checks) in results.iter().enumerate() {
        let (table, ok) = weft_conformance::summary(checks);
        assert!(ok, "{spec} at W={w}, rank {r}:\n{table}");
    }
}

/// The point-to-point patterns that need sends and receives to progress
/// together, through a plugin.
fn p2p(spec: &str, w: usize) {
    let results = run_threads(w, options(spec), |pg| weft_conformance::run_p2p(&pg, None, 16 << 20));
    for (r, checks) in results.iter().enumerate() {
        let (table, ok) = weft_conformance::summary(checks);
        assert!(ok, "{spec} p2p at W={w}, rank {r}:\n{table}");
    }
}

#[test]
fn c_plugin_passes_conformance_at_world_sizes_2_to_5() {
    let dir = scratch("c-uds");
    let lib = c_uds(&dir, "libweft-backend-c-uds.so", &[]);
    assert_eq!(weft::registry::load_plugin(&lib).unwrap(), "c-uds");
    // Loading another library with the same backend name is refused.
    let e = weft::registry::load_plugin(&lib).unwrap_err();
    assert!(e.to_string().contains("already registered"), "{e}");
    assert!(weft::registry::describe().iter().any(|l| l.contains("c-uds") && l.contains("ABI v1")));
    for w in 2..=5 {
        conformance("c-uds", w);
        p2p("c-uds", w);
    }
    // It runs batches one at a time (no WEFT_PLUGIN_CONCURRENT): a window,
    // which needs the target's transport to progress on its own, is
    // Unsupported on every rank, saying why.
    for e in run_threads(2, options("c-uds"), |pg| pg.new_window(64).unwrap_err()) {
        assert_eq!(e.kind(), &weft::ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains("c-uds cannot move bytes without the target"), "{e}");
    }
}

#[test]
fn built_in_cpu_tcp_passes_the_same_conformance_suite() {
    for w in [1, 3, 4] {
        conformance("cpu-tcp", w);
    }
}

const HEADER: &str = "#include \"weft_plugin.h\"\n#include <stdio.h>\n";
const STUBS: &str = r#"
static weft_status probe(char *w, size_t c) { (void)w; (void)c; return WEFT_OK; }
static weft_status init(const weft_init_v1_t *a, void **ctx, char *err, size_t cap) {
    (void)a; (void)ctx; snprintf(err, cap, "no network here (rank %u)", a->rank); return WEFT_ERR_BACKEND; }
static void destroy(void *c) { (void)c; }
static weft_status start(void *c, const weft_p2p_v1_t *o, size_t n, int64_t t, void **r) { (void)c; (void)o; (void)n; (void)t; (void)r; return WEFT_ERR_BACKEND; }
static weft_status wait_(void *c, void *r, int64_t t) { (void)c; (void)r; (void)t; return WEFT_ERR_BACKEND; }
static void cancel(void *c, void *r) { (void)c; (void)r; }
static void abort_(void *c) { (void)c; }
static const char *last_error(void *c, int32_t *p) { (void)c; *p = -1; return "x"; }
"#;

fn table(symbol: &str, name: &str, version: &str, size: &str) -> String {
    format!(
        "{HEADER}{STUBS}const weft_backend_v1_t {symbol} = {{ .struct_size = {size}, .abi_version = {version}, .name = \"{name}\", \
         .devices = WEFT_DEVICE_CPU, .layouts = WEFT_LAYOUT_DENSE, .probe = probe, .init = init, .destroy = destroy, \
         .start = start, .wait = wait_, .cancel = cancel, .abort = abort_, .last_error = last_error }};\n"
    )
}

#[test]
fn misbehaving_plugins_give_precise_errors() {
    weft_builtin::link();
    let dir = scratch("bad");
    let cases: Vec<(&str, String, &str)> = vec![
        ("nosym", format!("{HEADER}int not_a_plugin = 1;\n"), "is not a weft plugin: it exports no weft_backend_v1"),
        ("future", table("weft_backend_v3", "future", "3", "sizeof(weft_backend_v1_t)"), "exports weft_backend_v3 (ABI v3)"),
        ("badver", table("weft_backend_v1", "badver", "7", "sizeof(weft_backend_v1_t)"), "says ABI version 7"),
        ("short", table("weft_backend_v1", "short", "1", "16"), "at least"),
    ];
    for (name, text, needle) in cases {
        let lib = cc_text(&dir, name, &text, &[]);
        let e = weft::registry::load_plugin(&lib).unwrap_err();
        assert!(e.to_string().contains(needle) && e.to_string().contains(lib.to_str().unwrap()), "{name}: {e}");
    }
    let e = weft::registry::load_plugin(dir.join("libweft-backend-missing.so")).unwrap_err();
    assert!(e.to_string().contains("does not exist"), "{e}");

    // An init failure is a group-creation error naming the plugin, file and message.
    let lib = cc_text(&dir, "initfail", &table("weft_backend_v1", "initfail", "1", "sizeof(weft_backend_v1_t)"), &[]);
    assert_eq!(weft::registry::load_plugin(&lib).unwrap(), "initfail");
    let store: std::sync::Arc<dyn weft::store::Store> = std::sync::Arc::new(weft::store::MemoryStore::new(Duration::from_secs(5)));
    let e = ProcessGroup::new(store, 0, 1, options("initfail")).unwrap_err();
    let m = e.to_string();
    assert!(m.contains("initfail") && m.contains("no network here (rank 0)") && m.contains(lib.to_str().unwrap()), "{m}");
}

#[test]
fn an_op_failing_on_one_rank_is_an_error_there_and_never_a_hang_elsewhere() {
    let dir = scratch("opfail");
    let lib = c_uds(&dir, "libweft-backend-c-uds-failing.so", &["WEFT_UDS_TEST_FAIL_RANK=1", "WEFT_UDS_NAME=\"c-uds-failing\""]);
    assert_eq!(weft::registry::load_plugin(&lib).unwrap(), "c-uds-failing");
    let start = std::time::Instant::now();
    let errors = run_threads(3, options("c-uds-failing"), |pg| {
        let mut v = vec![1f32; 64];
        let result = pg.all_reduce(&mut v, ReduceOp::Sum, &OpOptions::default().timeout(Duration::from_secs(10))).unwrap().wait();
        result.unwrap_err()
    });
    assert!(start.elapsed() < Duration::from_secs(9), "other ranks must not wait for the timeout");
    let m = errors[1].to_string();
    assert!(m.contains("injected failure on rank 1") && m.contains("c-uds-failing") && m.contains("all_reduce"), "{m}");
    // The others fail promptly too. Which peer they blame depends on the
    // plugin's own protocol (this example has no abort message, so a rank
    // may see a neighbour's reset first).
    for r in [0, 2] {
        assert!(matches!(errors[r].kind(), ErrorKind::PeerLost { .. }), "rank {r}: {}", errors[r]);
    }
}

#[test]
fn rust_sdk_builds_cpu_tcp_as_a_plugin_that_passes_conformance() {
    let lib = example_lib("cpu_tcp_plugin");
    assert_eq!(weft::registry::load_plugin(&lib).unwrap(), "cpu-tcp-plugin");
    conformance("cpu-tcp-plugin", 3);
    for w in 2..=5 {
        p2p("cpu-tcp-plugin", w);
    }
    // Windows over its posted messages (the SDK sets WEFT_PLUGIN_CONCURRENT).
    for (r, checks) in run_threads(3, options("cpu-tcp-plugin"), |pg| weft_conformance::run_windows(&pg, 1 << 20)).iter().enumerate() {
        let (table, ok) = weft_conformance::summary(checks);
        assert!(ok, "windows through cpu-tcp-plugin, rank {r}:\n{table}");
    }
    // Across processes, found through WEFT_PLUGIN_PATH (a file entry).
    let path = lib.to_str().unwrap();
    let ends = run_world(
        env!("CARGO_BIN_EXE_weft-test-worker"),
        3,
        &["conformance"],
        &[("WEFT_PLUGIN_PATH", path), ("WEFT_BACKEND", "cpu-tcp-plugin")],
        Duration::from_secs(120),
    );
    for (r, e) in ends.iter().enumerate() {
        assert!(e.status.success() && e.output.contains("cpu-tcp-plugin"), "rank {r}: {}", e.output);
    }
}

#[test]
fn plugin_path_directories_resolve_names_to_libweft_backend_files() {
    let dir = scratch("dir");
    c_uds(&dir, "libweft-backend-c-uds.so", &[]);
    let d = dir.to_str().unwrap();
    let ends = run_world(
        env!("CARGO_BIN_EXE_weft-test-worker"),
        2,
        &["conformance"],
        &[("WEFT_PLUGIN_PATH", d), ("WEFT_BACKEND", "c-uds")],
        Duration::from_secs(120),
    );
    for (r, e) in ends.iter().enumerate() {
        assert!(e.status.success() && e.output.contains("c-uds"), "rank {r}: {}", e.output);
    }
    // A file whose name and exported backend disagree is refused, precisely.
    std::fs::rename(dir.join("libweft-backend-c-uds.so"), dir.join("libweft-backend-other.so")).unwrap();
    let ends = run_world(
        env!("CARGO_BIN_EXE_weft-test-worker"),
        1,
        &["conformance"],
        &[("WEFT_PLUGIN_PATH", d), ("WEFT_BACKEND", "c-uds")],
        Duration::from_secs(60),
    );
    assert!(!ends[0].status.success());
    assert!(ends[0].output.contains("exports backend \"c-uds\", but its file name says \"other\""), "{}", ends[0].output);
}

#[test]
fn a_panicking_rust_plugin_reports_an_error_and_the_host_survives() {
    let lib = example_lib("panicking_plugin");
    assert_eq!(weft::registry::load_plugin(&lib).unwrap(), "panicking");
    let store: std::sync::Arc<dyn weft::store::Store> = std::sync::Arc::new(weft::store::MemoryStore::new(Duration::from_secs(5)));
    let e = ProcessGroup::new(store, 0, 1, options("panicking").hint("panic_in", "init")).unwrap_err();
    assert!(e.to_string().contains("init panicked: deliberate panic in init"), "{e}");
    let errors = run_threads(2, options("panicking"), |pg| {
        let mut v = [1u8; 4];
        let result = pg.all_reduce(&mut v[..], ReduceOp::Max, &OpOptions::default()).unwrap().wait();
        result.unwrap_err()
    });
    for e in errors {
        assert_eq!(e.kind(), &ErrorKind::Backend, "{e}");
        assert!(e.to_string().contains("plugin panicked: deliberate panic inside the plugin"), "{e}");
    }
}
