//! `cpu-tcp`: weft's TCP backend for CPU tensors, within a host or across
//! hosts (Gloo's role). See the crate README for the protocol.
//!
//! It only moves bytes ([`weft::backend::Backend::exchange`]);
//! every collective runs on weft's generic algorithms over it.

#![warn(missing_docs)]

mod addr;
mod closing;
mod connect;
mod engine;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod protocol;
#[cfg(test)]
mod sim;
mod transport;
mod tune;
mod wire;

pub use addr::{local_addr, ENV_IFNAME};

use std::sync::Arc;
use weft::backend::{Backend, BackendContext};
use weft::registry::{BackendFactory, StaticBackend};
use weft::{DeviceKind, Layout, Result};

/// The registration of `cpu-tcp`.
pub struct CpuTcp;

impl BackendFactory for CpuTcp {
    fn name(&self) -> &str {
        "cpu-tcp"
    }
    fn devices(&self) -> &[DeviceKind] {
        &[DeviceKind::Cpu]
    }
    fn layouts(&self) -> &[Layout] {
        &[Layout::Dense]
    }
    fn priority(&self) -> i32 {
        10
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        let (ip, why) = local_addr()?;
        weft::log::debug(format_args!("cpu-tcp rank {}: using address {ip} ({why})", ctx.rank));
        let key = weft::auth::Key::from_env()?;
        let peers = connect::mesh(&*ctx.store, ctx.rank, ctx.size, ip, ctx.setup_deadline(), key.as_ref())?;
        Ok(Arc::new(transport::TcpBackend::start(ctx.rank, peers, ctx.store, ctx.timeout)?.with_group_ranks(ctx.group_ranks)))
    }
}

static CPU_TCP: CpuTcp = CpuTcp;
weft::inventory::submit! { StaticBackend(&CPU_TCP) }

/// Reference this crate so the linker keeps its registration.
pub fn link() {}
