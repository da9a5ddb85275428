//! `loopback`: a world of ranks that are threads of one process. See the
//! crate README.

#![warn(missing_docs)]

mod world;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use weft::backend::{Backend, BackendContext};
use weft::registry::{BackendFactory, StaticBackend};
use weft::{DeviceKind, Error, Layout, Result};
use world::World;

/// The registration of `loopback`.
pub struct LoopbackFactory;

/// The worlds of this process, by the key their rank 0 published.
fn worlds() -> &'static Mutex<HashMap<u64, Weak<World>>> {
    static WORLDS: OnceLock<Mutex<HashMap<u64, Weak<World>>>> = OnceLock::new();
    WORLDS.get_or_init(Mutex::default)
}

impl BackendFactory for LoopbackFactory {
    fn name(&self) -> &str {
        "loopback"
    }
    fn devices(&self) -> &[DeviceKind] {
        &[DeviceKind::Cpu]
    }
    fn layouts(&self) -> &[Layout] {
        &[Layout::Dense]
    }
    /// Last in `auto`: it serves only ranks that are threads of one
    /// process, which shm serves too.
    fn priority(&self) -> i32 {
        -10
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        let timeout = ctx.setup_deadline().saturating_duration_since(std::time::Instant::now());
        let me = std::process::id();
        let joined = if ctx.rank == 0 {
            let world = Arc::new(World::new(ctx.size));
            let key = weft::auth::random_u64()?;
            let mut all = worlds().lock().unwrap_or_else(|p| p.into_inner());
            all.retain(|_, w| w.strong_count() > 0);
            all.insert(key, Arc::downgrade(&world));
            drop(all);
            ctx.store.set("world", format!("{me} {key}").as_bytes())?;
            Ok(world)
        } else {
            let text = String::from_utf8_lossy(&ctx.store.get("world", timeout)?).into_owned();
            let bad = || Error::backend(format!("loopback: malformed world in the store: {text:?}"));
            let (pid, key) = text.split_once(' ').ok_or_else(bad)?;
            let (pid, key): (u32, u64) = (pid.parse().map_err(|_| bad())?, key.parse().map_err(|_| bad())?);
            if pid != me {
                Err(Error::unsupported(format!(
                    "loopback: rank 0 is process {pid} and this rank process {me}: every rank must be a thread of one process"
                )))
            } else {
                let found = worlds().lock().unwrap_or_else(|p| p.into_inner()).get(&key).and_then(Weak::upgrade);
                found.ok_or_else(|| Error::backend("loopback: rank 0's world is gone"))
            }
        };
        // Rank 0 holds the world until every rank has joined it.
        let world = weft::store::all_or_none(&*ctx.store, "joined", ctx.rank, ctx.size, timeout, joined, "loopback: joining the world")?;
        Ok(Arc::new(world::LoopbackBackend::new(world, ctx.rank)))
    }
}

static LOOPBACK: LoopbackFactory = LoopbackFactory;
weft::inventory::submit! { StaticBackend(&LOOPBACK) }

/// Reference this crate so the linker keeps its registration.
pub fn link() {}
