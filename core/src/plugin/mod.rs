//! Third-party backends loaded from shared libraries through a small,
//! versioned C ABI (`core/include/weft_plugin.h`).
//!
//! - [`open`] loads and checks one plugin (it does not register it:
//!   [`crate::registry::load_plugin`] does both).
//! - `WEFT_PLUGIN_PATH` (`:`-separated directories and/or files) is read
//!   once, the first time the registry is used: every file listed and every
//!   `libweft-backend-*.so` in a listed directory is loaded and registered
//!   there. Nothing is printed when it is unset; every failure is kept
//!   ([`crate::registry::plugin_errors`]) and shown by `weft info` and by
//!   errors about unknown backends.
//! - Libraries are opened with `RTLD_NOW | RTLD_LOCAL` and never unloaded.

pub mod abi;
pub(crate) mod adapter;
mod host;

pub use adapter::{PluginBackend, PluginFactory};
pub use host::status_of;

use crate::error::{Error, Result};
use crate::tensor::{DeviceKind, Layout};
use abi::BackendV1;
use std::ffi::CStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Environment variable listing plugin directories and files.
pub const ENV_PLUGIN_PATH: &str = "WEFT_PLUGIN_PATH";
/// The newest ABI version this weft understands.
pub const ABI_VERSION: u32 = abi::ABI_VERSION;
/// File-name prefix of plugins found in a directory.
pub const FILE_PREFIX: &str = "libweft-backend-";

/// The plugins `WEFT_PLUGIN_PATH` lists (none when unset): each file
/// found, opened and checked (a file in a listed directory must export the
/// backend its name says). What cannot even be listed goes to `errors`.
pub(crate) fn from_env(errors: &mut Vec<String>) -> Vec<(PathBuf, Result<PluginFactory>)> {
    let Ok(paths) = std::env::var(ENV_PLUGIN_PATH) else { return Vec::new() };
    let mut found = Vec::new();
    for entry in paths.split(':').filter(|e| !e.is_empty()) {
        let p = Path::new(entry);
        let files: Vec<(PathBuf, Option<String>)> = if p.is_dir() {
            let mut v: Vec<(PathBuf, Option<String>)> = std::fs::read_dir(p)
                .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect::<Vec<_>>())
                .unwrap_or_default()
                .into_iter()
                .filter_map(|f| {
                    let n = f.file_name()?.to_str()?.to_string();
                    let name = n.strip_prefix(FILE_PREFIX)?.strip_suffix(".so")?.to_string();
                    Some((f, Some(name)))
                })
                .collect();
            v.sort();
            v
        } else if p.exists() {
            vec![(p.to_path_buf(), None)]
        } else {
            errors.push(format!("{ENV_PLUGIN_PATH} entry {entry} does not exist"));
            continue;
        };
        for (file, expected) in files {
            let opened = open(&file).and_then(|f| match &expected {
                Some(n) if *n != f.name => {
                    Err(Error::invalid(format!("{} exports backend {:?}, but its file name says {n:?}", file.display(), f.name)))
                }
                _ => Ok(f),
            });
            found.push((file, opened));
        }
    }
    found
}

/// Open and validate a plugin without registering it.
pub fn open(path: &Path) -> Result<PluginFactory> {
    let shown = path.display().to_string();
    if !path.exists() {
        return Err(Error::invalid(format!("plugin file {shown} does not exist")));
    }
    // An absolute path keeps dlopen from searching the library path.
    let abs = std::fs::canonicalize(path).map_err(|e| Error::invalid(format!("plugin {shown}: {e}")))?;
    let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL;
    // SAFETY: loading a library runs its initialisers; that is the point of a
    // plugin, and the user chose the file.
    let lib = unsafe { libloading::os::unix::Library::open(Some(&abs), flags) }
        .map_err(|e| Error::backend(format!("cannot load plugin {shown}: {e}")))?;
    let lib: libloading::Library = lib.into();
    // The newest version we know, then any newer one (to say why we refuse it).
    // SAFETY: the symbol is a data symbol; we only take its address here.
    let sym = unsafe { lib.get::<*const BackendV1>(b"weft_backend_v1\0") }.ok().map(|s| *s);
    let Some(ptr) = sym.filter(|p| !p.is_null()) else {
        let newer = (2..=16).rev().find(|v| {
            let name = format!("weft_backend_v{v}\0");
            // SAFETY: only probing whether the symbol exists.
            unsafe { lib.get::<*const u8>(name.as_bytes()) }.is_ok()
        });
        return Err(match newer {
            Some(v) => Error::unsupported(format!(
                "plugin {shown} exports weft_backend_v{v} (ABI v{v}), but this weft supports ABI v{ABI_VERSION} (weft_backend_v{ABI_VERSION}); use a newer weft or rebuild the plugin"
            )),
            None => Error::invalid(format!("{shown} is not a weft plugin: it exports no weft_backend_v{ABI_VERSION} symbol")),
        });
    };
    // SAFETY: the exported table, in a library kept loaded with the factory.
    let Described { table, name, devices, layouts } = unsafe { describe(ptr, &shown)? };
    Ok(PluginFactory { table, name, path: shown, devices, layouts, _lib: Arc::new(lib) })
}

/// What a plugin's table says, checked.
pub(crate) struct Described {
    table: BackendV1,
    name: String,
    devices: Vec<DeviceKind>,
    layouts: Vec<Layout>,
}

/// Check and copy the table a plugin exports (`shown`: its file, for
/// errors): its size and version header, its required entries, its name,
/// devices and layouts.
///
/// # Safety
/// `ptr` points to at least the two u32s of the header and as many bytes
/// as the header's size says (at most `size_of::<BackendV1>()` are read),
/// and a non-null `name` in it to a NUL-terminated string; all of it stays
/// valid while the result is used.
pub(crate) unsafe fn describe(ptr: *const BackendV1, shown: &str) -> Result<Described> {
    // Read the size/version header first, then only as many bytes as the
    // plugin says its table has; missing trailing fields stay zero (null).
    // SAFETY: every table starts with two u32s; the library stays loaded.
    let (size, version) = unsafe { (*(ptr as *const u32), *(ptr as *const u32).add(1)) };
    if version != ABI_VERSION {
        return Err(Error::unsupported(format!("plugin {shown}: weft_backend_v1 says ABI version {version}, expected {ABI_VERSION}")));
    }
    if (size as usize) < abi::BACKEND_V1_REQUIRED {
        return Err(Error::invalid(format!(
            "plugin {shown}: weft_backend_v1 is {size} bytes, at least {} expected (built against an older, incompatible header?)",
            abi::BACKEND_V1_REQUIRED
        )));
    }
    // SAFETY: BackendV1 is plain data; zero is a valid value (null pointers,
    // None functions); we copy at most `size` bytes the plugin provides.
    let table: BackendV1 = unsafe {
        let mut t: BackendV1 = std::mem::zeroed();
        std::ptr::copy_nonoverlapping(
            ptr as *const u8,
            &mut t as *mut BackendV1 as *mut u8,
            (size as usize).min(std::mem::size_of::<BackendV1>()),
        );
        t
    };
    let missing: Vec<&str> = [
        ("probe", table.probe.is_none()),
        ("init", table.init.is_none()),
        ("destroy", table.destroy.is_none()),
        ("start", table.start.is_none()),
        ("wait", table.wait.is_none()),
        ("cancel", table.cancel.is_none()),
        ("abort", table.abort.is_none()),
        ("last_error", table.last_error.is_none()),
    ]
    .into_iter()
    .filter_map(|(n, m)| m.then_some(n))
    .collect();
    if table.name.is_null() || !missing.is_empty() {
        return Err(Error::invalid(format!(
            "plugin {shown}: weft_backend_v1 lacks required entries: name={} {missing:?}",
            !table.name.is_null()
        )));
    }
    // SAFETY: non-null, NUL-terminated per the header, in a library never unloaded.
    let name = unsafe { CStr::from_ptr(table.name) }
        .to_str()
        .map_err(|_| Error::invalid(format!("plugin {shown}: name is not UTF-8")))?
        .to_string();
    if name.is_empty() || name == "auto" || name.contains([':', ',']) {
        return Err(Error::invalid(format!("plugin {shown}: invalid backend name {name:?}")));
    }
    let devices = [(abi::DEVICE_CPU, DeviceKind::Cpu), (abi::DEVICE_CUDA, DeviceKind::Cuda)]
        .into_iter()
        .filter(|(b, _)| table.devices & b != 0)
        .map(|(_, d)| d)
        .collect();
    let layouts = [(abi::LAYOUT_DENSE, Layout::Dense), (abi::LAYOUT_SPARSE_COO, Layout::SparseCoo)]
        .into_iter()
        .filter(|(b, _)| table.layouts & b != 0)
        .map(|(_, l)| l)
        .collect();
    Ok(Described { table, name, devices, layouts })
}
