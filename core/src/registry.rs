//! Which backends exist, and which one handles which tensors.
//!
//! Built-in backends register statically with [`inventory`] (see
//! [`StaticBackend`]); others with [`register`], plugins with
//! [`load_plugin`] or through `WEFT_PLUGIN_PATH` (read the first time the
//! registry is used; [`crate::plugin`] opens and checks the libraries). A
//! spec chooses among them per device:
//!
//! - `"auto"`: for every (device, layout), the available backend with the
//!   highest priority, falling back down the list;
//! - `"NAME"`: that backend for every device and layout it handles;
//! - `"cpu:NAME,cuda:NAME"`: per device kind (`auto` allowed as a NAME).
//!
//! Note: inventory only sees crates the final binary links. Depend on the
//! `weft-builtin` facade crate (and call `weft_builtin::link()`) to be sure
//! every built-in backend is present.

pub use crate::backend::BackendFactory;
use crate::backend::{Backend, BackendContext};
use crate::error::{Error, Result};
use crate::tensor::{DeviceKind, Layout};
use std::path::Path;
use std::sync::{Arc, Mutex, Once, OnceLock, RwLock};

/// A static registration: `inventory::submit! { StaticBackend(&MY_FACTORY) }`.
pub struct StaticBackend(pub &'static dyn BackendFactory);
inventory::collect!(StaticBackend);

struct StaticRef(&'static dyn BackendFactory);
impl BackendFactory for StaticRef {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn devices(&self) -> &[DeviceKind] {
        self.0.devices()
    }
    fn layouts(&self) -> &[Layout] {
        self.0.layouts()
    }
    fn priority(&self) -> i32 {
        self.0.priority()
    }
    fn probe(&self) -> std::result::Result<(), String> {
        self.0.probe()
    }
    fn origin(&self) -> String {
        self.0.origin()
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        self.0.create(ctx)
    }
}

fn registry() -> &'static RwLock<Vec<Arc<dyn BackendFactory>>> {
    static REG: OnceLock<RwLock<Vec<Arc<dyn BackendFactory>>>> = OnceLock::new();
    REG.get_or_init(|| {
        let mut v: Vec<Arc<dyn BackendFactory>> = Vec::new();
        for s in inventory::iter::<StaticBackend> {
            if v.iter().all(|f| f.name() != s.0.name()) {
                v.push(Arc::new(StaticRef(s.0)));
            }
        }
        RwLock::new(v)
    })
}

/// Add a backend at run time; a name already taken is an error.
pub fn register(factory: Arc<dyn BackendFactory>) -> Result<()> {
    let mut reg = registry().write().unwrap_or_else(|p| p.into_inner());
    if let Some(old) = reg.iter().find(|f| f.name() == factory.name()) {
        return Err(Error::invalid(format!(
            "backend name {:?} from {} is already registered by {}",
            factory.name(),
            factory.origin(),
            old.origin()
        )));
    }
    reg.push(factory);
    Ok(())
}

/// Failures met while loading `WEFT_PLUGIN_PATH`'s plugins.
static PLUGIN_ERRORS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Load the plugin at `path`, register its backend, and return its name.
pub fn load_plugin(path: impl AsRef<Path>) -> Result<String> {
    let factory = crate::plugin::open(path.as_ref())?;
    let name = factory.name().to_string();
    register(Arc::new(factory))?;
    Ok(name)
}

/// Failures met while loading `WEFT_PLUGIN_PATH` (empty when unset).
pub fn plugin_errors() -> Vec<String> {
    PLUGIN_ERRORS.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// Register `WEFT_PLUGIN_PATH`'s plugins, once; every failure is kept.
fn load_env_plugins_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let mut errors = Vec::new();
        for (file, opened) in crate::plugin::from_env(&mut errors) {
            match opened.and_then(|f| register(Arc::new(f))) {
                Ok(()) => crate::log::debug(format_args!("loaded plugin {}", file.display())),
                Err(e) => errors.push(e.to_string()),
            }
        }
        for e in &errors {
            crate::log::info(format_args!("{e}"));
        }
        PLUGIN_ERRORS.lock().unwrap_or_else(|p| p.into_inner()).extend(errors);
    });
}

/// Every registered backend, highest priority first (plugins on
/// `WEFT_PLUGIN_PATH` are loaded the first time this is called).
pub fn backends() -> Vec<Arc<dyn BackendFactory>> {
    load_env_plugins_once();
    let mut v = registry().read().unwrap_or_else(|p| p.into_inner()).clone();
    v.sort_by(|a, b| b.priority().cmp(&a.priority()).then_with(|| a.name().cmp(b.name())));
    v
}

/// The backend registered under `name`.
pub fn find(name: &str) -> Option<Arc<dyn BackendFactory>> {
    backends().into_iter().find(|f| f.name() == name)
}

/// A route key: the tensors one backend instance handles in a group.
pub type Route = (DeviceKind, Layout);

/// Every route a group tries to fill.
pub const ROUTES: [Route; 4] = [
    (DeviceKind::Cpu, Layout::Dense),
    (DeviceKind::Cpu, Layout::SparseCoo),
    (DeviceKind::Cuda, Layout::Dense),
    (DeviceKind::Cuda, Layout::SparseCoo),
];

/// A parsed backend spec: per route, the candidates in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// `(route, candidate names, explicitly requested)`.
    pub routes: Vec<(Route, Vec<String>, bool)>,
}

/// Parse a spec against the registry.
pub fn plan(spec: &str) -> Result<Plan> {
    let regs = backends();
    let names = || {
        let mut s = regs.iter().map(|f| f.name().to_string()).collect::<Vec<_>>().join(", ");
        let failed = plugin_errors();
        if !failed.is_empty() {
            s += &format!("; plugins that failed to load: {}", failed.join("; "));
        }
        s
    };
    let candidates = |name: &str, route: Route| -> Result<(Vec<String>, bool)> {
        if name == "auto" {
            let c = regs
                .iter()
                .filter(|f| f.devices().contains(&route.0) && f.layouts().contains(&route.1))
                .map(|f| f.name().to_string())
                .collect();
            return Ok((c, false));
        }
        let f = regs
            .iter()
            .find(|f| f.name() == name)
            .ok_or_else(|| Error::invalid(format!("unknown backend {name:?} (registered: {})", names())))?;
        if f.devices().contains(&route.0) && f.layouts().contains(&route.1) {
            return Ok((vec![name.to_string()], true));
        }
        // A device backend named for dense tensors keeps the layers built
        // over it (sparse on top of cpu-tcp): other layouts of the same
        // device fall back to auto's candidates.
        if f.devices().contains(&route.0) {
            let c = regs
                .iter()
                .filter(|g| g.devices().contains(&route.0) && g.layouts().contains(&route.1) && !g.layouts().contains(&Layout::Dense))
                .map(|g| g.name().to_string())
                .collect();
            return Ok((c, false));
        }
        Ok((vec![], false))
    };
    let spec = spec.trim();
    let mut routes = Vec::new();
    if !spec.contains(':') {
        for route in ROUTES {
            let (c, explicit) = candidates(spec, route)?;
            routes.push((route, c, explicit));
        }
        if spec != "auto" && routes.iter().all(|r| r.1.is_empty()) {
            return Err(Error::invalid(format!("backend {spec:?} handles no device")));
        }
        return Ok(Plan { routes });
    }
    let mut seen = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (dev, name) = part.split_once(':').ok_or_else(|| Error::invalid(format!("backend spec part {part:?} is not DEVICE:NAME")))?;
        let dev = match dev.trim() {
            "cpu" => DeviceKind::Cpu,
            "cuda" => DeviceKind::Cuda,
            d => return Err(Error::invalid(format!("unknown device {d:?} in backend spec {spec:?} (use cpu or cuda)"))),
        };
        if seen.contains(&dev) {
            return Err(Error::invalid(format!("device {} named twice in backend spec {spec:?}", dev.name())));
        }
        seen.push(dev);
        let name = name.trim();
        for route in ROUTES.into_iter().filter(|r| r.0 == dev) {
            let (c, explicit) = candidates(name, route)?;
            routes.push((route, c, explicit));
        }
        if name != "auto" && !routes.iter().any(|r| r.0 .0 == dev && !r.1.is_empty()) {
            return Err(Error::invalid(format!("backend {name:?} does not handle {} tensors", dev.name())));
        }
    }
    Ok(Plan { routes })
}

/// One line per backend for `weft info`: name, origin, devices, layouts,
/// availability; then one line per plugin that failed to load.
pub fn describe() -> Vec<String> {
    let mut lines: Vec<String> = backends()
        .iter()
        .map(|f| {
            let devs: Vec<_> = f.devices().iter().map(|d| d.name()).collect();
            let lays: Vec<_> = f.layouts().iter().map(|l| l.name()).collect();
            let avail = match f.probe() {
                Ok(()) => "available".to_string(),
                Err(why) => format!("unavailable: {why}"),
            };
            format!(
                "{:<20} {:<10} devices={:<9} layouts={:<13} priority={:<4} {}",
                f.name(),
                f.origin(),
                devs.join(","),
                lays.join(","),
                f.priority(),
                avail
            )
        })
        .collect();
    lines.extend(plugin_errors().into_iter().map(|e| format!("failed plugin: {e}")));
    lines
}
