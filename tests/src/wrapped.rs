//! A test backend made of another: the in-process `loopback`, wrapped by
//! a test's own `Backend` (which records or alters what reaches it).

use std::sync::Arc;
use weft::backend::{Backend, BackendContext};
use weft::registry::BackendFactory;
use weft::{DeviceKind, Layout, Result};

/// A factory for host tensors named `name`, whose backends are `wrap`
/// around a `loopback` one. Register a static one with
/// `weft::inventory::submit! { StaticBackend(&FACTORY) }`.
pub struct WrappedLoopback {
    /// The backend's name (its spec).
    pub name: &'static str,
    /// Makes the test's backend around the loopback one.
    pub wrap: fn(Arc<dyn Backend>) -> Arc<dyn Backend>,
}

impl BackendFactory for WrappedLoopback {
    fn name(&self) -> &str {
        self.name
    }
    fn devices(&self) -> &[DeviceKind] {
        &[DeviceKind::Cpu]
    }
    fn layouts(&self) -> &[Layout] {
        &[Layout::Dense]
    }
    /// Never chosen by `auto`.
    fn priority(&self) -> i32 {
        -100
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        let inner = weft::registry::find("loopback").expect("loopback is always built").create(ctx)?;
        Ok((self.wrap)(inner))
    }
}
