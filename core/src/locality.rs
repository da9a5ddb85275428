//! Are all ranks of the group on this host? Decided through the store
//! (every rank publishes its host identity), never from LOCAL_WORLD_SIZE.
//! Backends that need one host (shm, CUDA IPC) check it at creation.

use crate::backend::BackendContext;
use crate::error::{Error, Result};
use std::os::unix::fs::MetadataExt;

/// Environment variable overriding the host identity (tests; containers
/// that share a kernel but not /dev/shm).
pub const ENV_HOST_ID: &str = "WEFT_HOST_ID";

/// This host's identity: hostname plus the kernel's boot id (two machines
/// may share a hostname; they do not share a boot) plus the identity of the
/// `/dev/shm` file system (containers on one kernel may each mount their
/// own: then shared memory does not reach across, and they count as
/// different hosts). Ranks in other network namespaces with the same
/// `/dev/shm` do share memory, and count as one host.
pub fn host_id() -> String {
    if let Ok(id) = std::env::var(ENV_HOST_ID) {
        return id;
    }
    let host = nix::unistd::gethostname().map(|h| h.to_string_lossy().into_owned()).unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let shm = std::fs::metadata("/dev/shm").map(|m| format!("{:x}:{:x}", m.dev(), m.ino())).unwrap_or_default();
    format!("{host}/{}/{shm}", boot.trim())
}

/// Group hint overriding the host identity for one rank's group (ranks that
/// are threads of one process, emulating several hosts in a test).
pub const HINT_HOST_ID: &str = "host_id";

/// The host identity a backend being created sees: the group's hint
/// [`HINT_HOST_ID`], else [`host_id`].
pub fn host_of(ctx: &BackendContext) -> String {
    ctx.hints.get(HINT_HOST_ID).cloned().unwrap_or_else(host_id)
}

/// `Ok` if every rank published the same identity ([`host_of`]), else
/// `Unsupported` naming the first rank on another host. `who` names the
/// backend asking (each asks in its own store namespace).
pub fn check(who: &str, ctx: &BackendContext) -> Result<()> {
    let (rank, me) = (ctx.rank, host_of(ctx));
    for (r, other) in crate::store::all_gather(&*ctx.store, "host", rank, ctx.size, ctx.timeout, me.as_bytes())?.into_iter().enumerate() {
        if other != me.as_bytes() {
            return Err(Error::unsupported(format!(
                "{who} needs every rank on one host: rank {rank} is on {me}, rank {r} on {}",
                String::from_utf8_lossy(&other)
            )));
        }
    }
    Ok(())
}
