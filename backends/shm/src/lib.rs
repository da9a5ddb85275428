//! `shm`: CPU tensors between ranks on one host through shared memory.
//! See the crate README for the design and its current limits.

#![warn(missing_docs)]

mod cma;
mod cores;
mod direct;
mod exchange;
mod fastbox;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod liveness;
mod membarrier;
mod nappers;
mod posted;
mod ring;
mod segment;
mod state;
mod sync;
mod transport;
mod window;

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
        weft::locality::check("shm", &ctx)?;
        // Rank 0 creates the segment (its ring size from the free space it
        // sees) and publishes how to open it: every rank uses that layout.
        let (seg, cap) = if ctx.rank == 0 {
            let cap = state::ring_cap(ctx.size, segment::available());
            let len = state::segment_len(ctx.size, cap);
            let made = weft::auth::random_u64().map(|n| format!("{n:x}")).and_then(|tag| Ok((segment::Segment::create(&tag, len)?, tag)));
            match made {
                Ok((seg, tag)) => {
                    let fd = seg.creator_fd().expect("the creator holds it");
                    ctx.store.set("layout", format!("{} {fd} {tag} {cap}", std::process::id()).as_bytes())?;
                    (Ok(seg), cap)
                }
                Err(e) => {
                    ctx.store.set("layout", format!("failed {e}").as_bytes())?;
                    return Err(e);
                }
            }
        } else {
            let layout = String::from_utf8_lossy(&ctx.store.get("layout", left())?).into_owned();
            if let Some(why) = layout.strip_prefix("failed ") {
                return Err(Error::backend(format!("shm: rank 0 could not create the segment: {why}")));
            }
            let bad = || Error::backend(format!("shm: malformed layout in the store: {layout:?}"));
            let fields: Vec<&str> = layout.split(' ').collect();
            let [pid, fd, tag, cap] = fields[..] else { return Err(bad()) };
            let (pid, fd, cap) = (pid.parse().map_err(|_| bad())?, fd.parse().map_err(|_| bad())?, cap.parse().map_err(|_| bad())?);
            (segment::Segment::open(0, pid, fd, tag, state::segment_len(ctx.size, cap)), cap)
        };
        // Every rank has opened it, or all fail together, naming the first
        // that could not; then rank 0 closes its descriptor (the mappings
        // keep the memory).
        let mut seg = weft::store::all_or_none(&*ctx.store, "opened", ctx.rank, ctx.size, left(), seg, "shm: opening the segment")?;
        seg.close_fd();
        // Single-copy large messages as the group's copy costs say
        // (`cma::Policy::agreed`, alike on every rank), unless the hint
        // `shm_cma` (or WEFT_SHM_CMA) says `on` (from 32 KiB, every
        // message), `large` (from 4 MiB, 1 MiB from an idle sender),
        // `ring` (every message starts on the ring: the policy for slow
        // kernel copies) or `off`; a
        // peer that may not read our memory refuses offers and everything
        // goes through the ring.
        let forced = match ctx.hints.get("shm_cma").cloned().or_else(|| std::env::var("WEFT_SHM_CMA").ok()).as_deref() {
            None | Some("auto") => None,
            Some("on" | "1") => Some(Some(cma::Policy::FAST)),
            Some("large") => Some(Some(cma::Policy::SLOW)),
            Some("ring") => Some(Some(cma::Policy::RING)),
            Some("off" | "0") => Some(None),
            Some(v) => return Err(Error::invalid(format!("shm_cma={v:?}: use auto, on, large, ring or off"))),
        };
        let agreed = cma::Policy::agreed(&*ctx.store, ctx.rank, ctx.size, left(), forced.is_none())?;
        let cma = forced.unwrap_or(Some(agreed));
        // The policy is only where each large message's scheme starts: the
        // group then moves each kind of exchange to the scheme that costs
        // least as the run goes (`cma/scheme.rs`), unless the hint
        // `shm_adapt` (or WEFT_SHM_ADAPT) says `off`, or (without it) a
        // forced policy fixes the scheme.
        let adapt = match ctx.hints.get("shm_adapt").cloned().or_else(|| std::env::var("WEFT_SHM_ADAPT").ok()).as_deref() {
            None => forced.is_none(),
            Some("on" | "1") => true,
            Some("off" | "0") => false,
            Some(v) => return Err(Error::invalid(format!("shm_adapt={v:?}: use on or off"))),
        };
        let placement = cores::placement(&*ctx.store, ctx.rank, ctx.size, left())?;
        let budget = weft::backend::matching::EarlyBudget::from_env()?;
        let backend = state::ShmBackend::new(ctx.rank, ctx.size, seg, cap, cma, adapt, placement, budget);
        Ok(Arc::new_cyclic(|me| backend.knowing(me.clone())))
    }
}

static SHM: ShmFactory = ShmFactory;
weft::inventory::submit! { StaticBackend(&SHM) }

/// Reference this crate so the linker keeps its registration.
pub fn link() {}
