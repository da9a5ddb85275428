//! Building test plugins with the system C compiler.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is in the repo").to_path_buf()
}

/// A directory for a test's build outputs, removed with everything in it
/// when dropped (a library loaded from it stays mapped).
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh directory for build outputs of this test process.
pub fn scratch(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("weft-plugins-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

/// Compile C `source` (a file) into `out` as a shared library with `cc`.
pub fn cc(source: &Path, out: &Path, defines: &[&str]) {
    let include = repo().join("core/include");
    let mut cmd = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()));
    cmd.args(["-O2", "-Wall", "-Werror", "-shared", "-fPIC", "-I"]).arg(&include).arg("-o").arg(out).arg(source);
    for d in defines {
        cmd.arg(format!("-D{d}"));
    }
    let res = cmd.output().expect("run the C compiler (cc)");
    assert!(res.status.success(), "cc failed:\n{}", String::from_utf8_lossy(&res.stderr));
}

/// Compile C source text into `dir/libweft-backend-{name}.so`.
pub fn cc_text(dir: &Path, name: &str, text: &str, defines: &[&str]) -> PathBuf {
    let src = dir.join(format!("{name}.c"));
    std::fs::write(&src, text).unwrap();
    let out = dir.join(format!("libweft-backend-{name}.so"));
    cc(&src, &out, defines);
    out
}

/// The C example plugin, built into `dir` (optionally with defines).
pub fn c_uds(dir: &Path, file_name: &str, defines: &[&str]) -> PathBuf {
    let out = dir.join(file_name);
    cc(&repo().join("examples/plugins/c-uds/weft_uds.c"), &out, defines);
    out
}

/// A cdylib example of this package, built by `cargo test` next to the tests.
pub fn example_lib(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    let dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps");
    let lib = dir.join("examples").join(format!("lib{name}.so"));
    // `cargo test` without `--test` filters (re)builds examples; a filtered
    // run uses whatever an earlier build left.
    assert!(lib.exists(), "{} is missing: run `cargo test -p weft-tests` (or `cargo build -p weft-tests --examples`)", lib.display());
    lib
}
