//! Asymmetric barriers between the ranks' processes (membarrier(2)).
//!
//! A rank about to sleep makes every processor that runs a registered
//! process pass a full barrier ([`global`]) before it looks once more for
//! what it waits for. A registered rank that writes to a peer and then
//! reads the peer's sleeping flag (`ShmBackend::notify`) needs no barrier
//! of its own: either the sleeper's look sees its writes, or its read sees
//! the flag. That barrier was a locked instruction on every small send,
//! which waited until the send's stores reached the peer's core.

use nix::libc;
use std::sync::OnceLock;

/// Commands of membarrier(2) (linux/membarrier.h).
const QUERY: libc::c_int = 0;
const GLOBAL_EXPEDITED: libc::c_int = 1 << 1;
const REGISTER_GLOBAL_EXPEDITED: libc::c_int = 1 << 2;

fn call(cmd: libc::c_int) -> libc::c_long {
    // SAFETY: membarrier takes two integers and touches no memory of ours;
    // an unknown command or a refused call returns -1.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0 as libc::c_uint, 0 as libc::c_int) }
}

/// Whether this kernel offers the barrier (a process anywhere on the host
/// may have registered for it).
fn supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        let commands = call(QUERY);
        commands >= 0 && commands & GLOBAL_EXPEDITED as libc::c_long != 0
    })
}

/// Register this process (once): from then on its threads pass the
/// barriers sleeping ranks ask for. False where the kernel (or a seccomp
/// policy) refuses.
pub(crate) fn register() -> bool {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    *REGISTERED.get_or_init(|| supported() && call(REGISTER_GLOBAL_EXPEDITED) == 0)
}

/// Make every processor running a registered process pass a full barrier;
/// false if the call failed.
pub(crate) fn global() -> bool {
    call(GLOBAL_EXPEDITED) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registered_process_can_ask_for_the_barrier() {
        // (A kernel or sandbox without membarrier makes both false, and
        // shm then fences every wake as before.)
        if register() {
            assert!(supported());
            assert!(global(), "membarrier(GLOBAL_EXPEDITED) failed after registering");
        }
    }
}
