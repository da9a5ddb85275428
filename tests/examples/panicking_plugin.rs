//! A Rust plugin whose transfers panic: the SDK must turn the panic into an
//! error status, and the host must report it without crashing.

use std::sync::Arc;
use weft::backend::{Backend, BackendContext, P2p};
use weft::registry::BackendFactory;
use weft::{DeviceKind, Error, Layout, Result};
use weft_plugin_sdk::{export_backend, CPU, DENSE};

struct Panics;
impl Backend for Panics {
    fn name(&self) -> &str {
        "panicking"
    }
    fn exchange(&self, _: &mut [P2p<'_>], _: &weft::backend::Deadline) -> Result<()> {
        panic!("deliberate panic inside the plugin")
    }
    fn abort(&self, _: &Error) {}
}

struct Factory;
impl BackendFactory for Factory {
    fn name(&self) -> &str {
        "panicking"
    }
    fn devices(&self) -> &[DeviceKind] {
        &[DeviceKind::Cpu]
    }
    fn layouts(&self) -> &[Layout] {
        &[Layout::Dense]
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        if ctx.hints.get("panic_in") == Some(&"init".to_string()) {
            panic!("deliberate panic in init");
        }
        Ok(Arc::new(Panics))
    }
}

static FACTORY: Factory = Factory;
export_backend!(FACTORY, name = "panicking", devices = CPU, layouts = DENSE, priority = 0);
