//! `shm`: CPU tensors between ranks on one host through shared memory.
//! See the crate README for the design and its current limits.

#![warn(missing_docs)]

mod cma;
mod cores;
mod fastbox;
mod liveness;
mod ring;
mod segment;
mod stream;
mod sync;
mod transport;

use std::sync::Arc;
use weft::backend::{Backend, BackendContext};
use weft::registry::{BackendFactory, StaticBackend};
use weft::{DeviceKind, Error, Layout, Result};

/// The registration of `shm`.
pub struct ShmFactory;

impl BackendFactory for ShmFactory {
    fn name(&self) -> &str {
        "shm"
    }
    fn devices(&self) -> &[DeviceKind] {
        &[DeviceKind::Cpu]
    }
    fn layouts(&self) -> &[Layout] {
        &[Layout::Dense]
    }
    /// Above cpu-tcp: `auto` takes shm when every rank is on one host
    /// (create() says `Unsupported` otherwise, and auto falls back).
    fn priority(&self) -> i32 {
        20
    }
    fn probe(&self) -> std::result::Result<(), String> {
        if std::path::Path::new("/dev/shm").is_dir() {
            Ok(())
        } else {
            Err("no /dev/shm on this machine".into())
        }
    }
    fn create(&self, ctx: BackendContext) -> Result<Arc<dyn Backend>> {
        let deadline = ctx.setup_deadline();
        let left = || deadline.saturating_duration_since(std::time::Instant::now());
        weft::locality::check("shm", &*ctx.store, ctx.rank, ctx.size, ctx.timeout)?;
        // Rank 0 chooses the name and ring size (from the free space it
        // sees) and publishes them: every rank must use the same layout.
        let (name, cap) = if ctx.rank == 0 {
            let cap = transport::ring_cap(ctx.size, segment::available());
            let name = format!("/weft-{}-{:x}", std::process::id(), nonce());
            ctx.store.set("layout", format!("{name} {cap}").as_bytes())?;
            (name, cap)
        } else {
            let layout = String::from_utf8_lossy(&ctx.store.get("layout", left())?).into_owned();
            let (name, cap) = layout.split_once(' ').ok_or_else(|| Error::backend("shm: malformed layout in the store"))?;
            (name.to_string(), cap.parse().map_err(|_| Error::backend("shm: malformed ring size in the store"))?)
        };
        let len = transport::segment_len(ctx.size, cap);
        let seg = if ctx.rank == 0 {
            let seg = segment::Segment::map(&name, len, true);
            // Tell the others whether to go on; unlink whatever happens next.
            ctx.store.set("created", if seg.is_ok() { b"1" } else { b"0" })?;
            let seg = seg?;
            let waited = (1..ctx.size).try_for_each(|r| ctx.store.get(&format!("mapped/{r}"), left()).map(drop));
            segment::Segment::unlink(&name);
            waited?;
            seg
        } else {
            if ctx.store.get("created", left())? != b"1" {
                return Err(Error::backend("shm: rank 0 could not create the segment"));
            }
            let seg = segment::Segment::map(&name, len, false)?;
            ctx.store.set(&format!("mapped/{}", ctx.rank), b"1")?;
            seg
        };
        // Everyone waits until rank 0 has seen every mapping (and unlinked).
        ctx.store.add("ready", 1)?;
        let until = std::time::Instant::now() + left();
        while weft::store::Store::add(&*ctx.store, "ready", 0)? < ctx.size as i64 {
            if std::time::Instant::now() >= until {
                return Err(Error::timeout("shm: ranks did not all map the segment"));
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // Single-copy large messages as the group's copy costs say
        // (`cma::Policy::agreed`, alike on every rank), unless the hint
        // `shm_cma` (or WEFT_SHM_CMA) says `on` (from 32 KiB, every
        // message), `large` (the policy for slow kernel copies) or `off`; a
        // peer that may not read our memory refuses offers and everything
        // goes through the ring.
        let forced = match ctx.hints.get("shm_cma").cloned().or_else(|| std::env::var("WEFT_SHM_CMA").ok()).as_deref() {
            None | Some("auto") => None,
            Some("on" | "1") => Some(Some(cma::Policy::FAST)),
            Some("large") => Some(Some(cma::Policy::SLOW)),
            Some("off" | "0") => Some(None),
            Some(v) => return Err(Error::invalid(format!("shm_cma={v:?}: use auto, on, large or off"))),
        };
        let agreed = cma::Policy::agreed(&*ctx.store, ctx.rank, ctx.size, left(), forced.is_none())?;
        let cma = forced.unwrap_or(Some(agreed));
        let oversubscribed = cores::oversubscribed(&*ctx.store, ctx.rank, ctx.size, left())?;
        let budget = weft::matching::EarlyBudget::from_env()?;
        Ok(Arc::new(transport::ShmBackend::new(ctx.rank, ctx.size, seg, cap, cma, oversubscribed, budget)))
    }
}

fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    h.finish()
}

static SHM: ShmFactory = ShmFactory;
weft::inventory::submit! { StaticBackend(&SHM) }

/// Reference this crate so the linker keeps its registration.
pub fn link() {}
