//! Connecting the ring: every rank exports its receive slots and events
//! through the store (CUDA IPC handles), opens its neighbours', and all
//! ranks agree whether it worked, so that a failure anywhere makes every
//! rank fall back together.

use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::backend::BackendContext;
use weft::store::Store;
use weft::{Error, Result, StreamHandle};
use weft_cuda_driver::{synchronize_event_checked, DevicePtr, Event, Gpu};

/// How long a host wait spins before it sleeps: a piece takes up to a few
/// hundred µs, and a sleeping waiter wakes up late (figures: bench/RESULTS.md, "Measurements behind code comments").
const HOST_SPIN: Duration = Duration::from_millis(2);

/// Receive slots per rank: pieces in flight between two neighbours.
pub const SLOTS: usize = 4;
/// Default bytes per slot (hint `cuda_slot_bytes`): 256 MiB of slots per
/// rank. Large, because on a GPU shared by several processes every piece
/// costs a switch between their contexts (figures: bench/RESULTS.md, "Measurements behind code comments").
pub const DEFAULT_SLOT_BYTES: usize = 64 << 20;

/// Default of `Peers::staged_max`. Staging copies each op in, and every
/// rank then reads all of every staging buffer ((3 + W) bytes of traffic
/// per byte reduced, against 2 mapping the callers' buffers), but mapping
/// and closing them costs more per op than staging up to this size
/// (figures: bench/RESULTS.md, "Measurements behind code comments").
pub const DEFAULT_STAGED_MAX: usize = 16 << 20;

/// Bytes of a rank's hand-off words, at the start of its staging
/// allocation (so every rank maps them with the staging buffer): its op
/// counter, then its `ready` and `done` flags (see `handoff.rs`). The
/// point-to-point words and outboxes follow ([`crate::p2p::Layout`]), then
/// the staging buffer.
pub const FLAGS: usize = 256;

/// What one rank of `cuda-device` shares with its peers: the ring's slots and events, the
/// direct all-reduce's staging buffer and events, and what it opened of
/// the other ranks'.
pub struct Peers {
    pub gpu: Arc<dyn Gpu>,
    pub device: usize,
    /// The group's store (this backend's namespace), this rank and the
    /// group's timeout: for closing down (`Drop`).
    store: Arc<dyn Store>,
    rank: usize,
    timeout: Duration,
    pub slot_bytes: usize,
    /// The direct all-reduce stages ops of up to this many bytes through
    /// the staging buffers, and a pulled collective (`pull.rs`) the buffers
    /// a rank exposes, when they fit (each padded to 256 bytes) (hint
    /// `cuda_direct_staged_bytes`).
    pub staged_max: usize,
    /// My receive slots (the previous rank writes into them).
    pub my_slots: DevicePtr,
    /// The next rank's receive slots, mapped here (or its pointer, in-process).
    pub next_slots: DevicePtr,
    /// My staging buffer for the direct all-reduce and pulled collectives of small ops
    /// (`staged_max` bytes; apart from the slots, which the ring may write
    /// while a staged op still reads its buffer).
    pub stage: DevicePtr,
    /// Every rank's staging buffer by rank (mine included), mapped here.
    pub ranks_stage: Vec<DevicePtr>,
    /// My staging allocation, which starts with my hand-off words
    /// ([`FLAGS`] bytes), then the point-to-point words and outboxes, then `stage`.
    pub flags: DevicePtr,
    /// Every rank's staging allocation (hand-off words first) by rank
    /// (mine included), mapped here.
    pub ranks_flags: Vec<DevicePtr>,
    /// Where the point-to-point words and outboxes lie in each.
    pub p2p: crate::p2p::Layout,
    /// Whether the hand-off kernels loaded on every rank (found at setup).
    pub kernels: bool,
    /// Other processes' buffers that captured ops read: a graph reads them
    /// on every launch, so they stay mapped until the group closes.
    pub kept: crate::peer_buffers::Kept,
    /// What `ipc_open` mapped here (closed on drop).
    opened: Vec<DevicePtr>,
    /// Recorded by me after writing slot q of the next rank.
    pub filled: [Event; SLOTS],
    /// Recorded by me after reading my slot q.
    pub consumed: [Event; SLOTS],
    /// The previous rank's `filled`, opened here.
    pub prev_filled: [Event; SLOTS],
    /// The next rank's `consumed`, opened here.
    pub next_consumed: [Event; SLOTS],
    /// Recorded by me when my input is ready for the direct all-reduce's
    /// readers, and when my part of the op is done.
    pub ready: Event,
    pub done: Event,
    /// Every rank's `ready` and `done` by rank (mine included), opened here.
    pub ranks_ready: Vec<Event>,
    pub ranks_done: Vec<Event>,
    /// Every rank's process id.
    pub pids: Vec<u32>,
    opened_events: Vec<Event>,
    /// (rank, pid) of the ranks in other processes: a stream waiting on a
    /// dead one's event never finishes, and this names who died.
    pub others: Vec<(usize, u32)>,
    /// Wait for other ranks' events on the host instead of on the device
    /// (see [`Peers::connect`]).
    pub host_wait: bool,
    /// Every rank uses this same GPU (its processes share it).
    pub one_gpu: bool,
    /// The hint `cuda_wait`, if given: host (true) or device (false).
    wait_hint: Option<bool>,
}

/// Exported parts per rank: the slots, the staging allocation (hand-off
/// words, then the staging buffer), `filled`,
/// `consumed`, `ready`, `done`.
const PARTS: usize = 4 + 2 * SLOTS;

/// One rank's exported handles: `pid device_uuid slots stage filled.. consumed.. ready done`.
fn encode(pid: u32, uuid: [u8; 16], parts: &[Vec<u8>]) -> Vec<u8> {
    let mut v = pid.to_le_bytes().to_vec();
    v.extend(uuid);
    for p in parts {
        v.extend((p.len() as u32).to_le_bytes());
        v.extend(p);
    }
    v
}

fn decode(b: &[u8]) -> Result<(u32, [u8; 16], Vec<Vec<u8>>)> {
    let bad = || Error::backend("cuda-device: malformed IPC record in the store");
    let word = |at: usize| -> Result<u32> { Ok(u32::from_le_bytes(b.get(at..at + 4).ok_or_else(bad)?.try_into().expect("4 bytes"))) };
    let pid = word(0)?;
    let uuid: [u8; 16] = b.get(4..20).ok_or_else(bad)?.try_into().expect("16 bytes");
    let mut parts = Vec::new();
    let mut at = 20;
    while at < b.len() {
        let n = word(at)? as usize;
        parts.push(b.get(at + 4..at + 4 + n).ok_or_else(bad)?.to_vec());
        at += 4 + n;
    }
    if parts.len() != PARTS {
        return Err(bad());
    }
    Ok((pid, uuid, parts))
}

/// The device this rank uses: hint `cuda_device`, else `LOCAL_RANK` modulo
/// the device count, else 0.
pub fn choose_device(ctx: &BackendContext, gpu: &dyn Gpu) -> Result<usize> {
    let count = gpu.device_count().max(1);
    if let Some(v) = ctx.hints.get("cuda_device") {
        return v
            .parse::<usize>()
            .ok()
            .filter(|d| *d < count)
            .ok_or_else(|| Error::invalid(format!("hint cuda_device={v:?}: this host has {count} devices")));
    }
    Ok(std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse::<usize>().ok()).map_or(0, |l| l % count))
}

/// Zero this rank's hand-off and point-to-point words at `at` (`bytes`:
/// cuMemAlloc leaves memory as it was) and load the hand-off kernels,
/// through a stream of its own, before this returns; whether the kernels
/// loaded. Where they cannot be (no NVRTC), captured ops fail and
/// point-to-point is staged through the host.
fn prepare_flags(gpu: &dyn Gpu, device: usize, at: DevicePtr, bytes: usize, timeout: Duration) -> Result<bool> {
    let (zeros, stream) = (vec![0u8; bytes], gpu.new_stream(device)?);
    let mut loaded = true;
    // SAFETY: `at` holds `bytes` (just allocated), `zeros` outlives the
    // synchronisation below, and the kernels run after the zeroing.
    let r = unsafe { gpu.copy_htod(stream, at, zeros.as_ptr(), bytes) }.and_then(|()| {
        // SAFETY: as above.
        if let Err(e) = unsafe { crate::handoff::load_kernels(gpu, stream, at) } {
            loaded = false;
            weft::log::debug(format_args!(
                "cuda-device: the hand-off kernels are not loaded ({e}); captured ops would fail, and point-to-point is staged"
            ));
        }
        weft_cuda_driver::synchronize_stream(gpu, device, stream, Instant::now() + timeout, "preparing the hand-off words")
    });
    gpu.destroy_stream(stream);
    r.map(|()| loaded)
}

/// The first of `ranks` (rank, pid) whose process has exited.
pub fn first_gone(ranks: &[(usize, u32)]) -> Option<(usize, u32)> {
    ranks.iter().copied().find(|(_, pid)| !std::path::Path::new(&format!("/proc/{pid}")).exists())
}

/// `e` (a device wait that failed or timed out while `waiter` waited on
/// the GPU), or, where a rank of `others` (rank, pid) has exited, that
/// peer lost: its events and flags will never come. An error that already
/// names a lost peer stays (a rank gone now may only have exited after
/// seeing that same loss).
pub fn blame_gone(others: &[(usize, u32)], e: Error, waiter: &str) -> Error {
    if matches!(e.kind(), weft::ErrorKind::PeerLost { .. }) {
        return e;
    }
    match first_gone(others) {
        Some((peer, pid)) => Error::peer_lost(peer, format!("rank {peer} (pid {pid}) exited while {waiter} waited for it on the GPU: {e}")),
        None => e,
    }
}

impl Peers {
    /// Set up (collective). `Unsupported` on every rank if any rank failed.
    ///
    /// Waits on a neighbour's events happen on the host (hint `cuda_wait=host`)
    /// or on the device (`cuda_wait=device`). By default on the host when a
    /// neighbour is another process on this same GPU: a stream blocked on
    /// another context's event keeps its time slice while the GPU switches
    /// between the processes' contexts, and with MPS a host wait was faster too
    /// (figures: bench/RESULTS.md, "Measurements behind code comments"). On the
    /// device otherwise: the host then never waits for the GPU.
    pub fn connect(ctx: &BackendContext, gpu: Arc<dyn Gpu>) -> Result<Peers> {
        let (store, what) = (&*ctx.store, "cuda-device: CUDA IPC");
        let mut ring = weft::store::all_or_none(store, "export", ctx.rank, ctx.size, ctx.timeout, Self::export(ctx, &gpu), what)?;
        let opened = ring.open_peers(ctx);
        weft::store::all_or_none(store, "open", ctx.rank, ctx.size, ctx.timeout, opened, what)?;
        // Point-to-point runs on the device only where every rank has the
        // hand-off kernels: a rank staging its messages meets no peer.
        let loaded = weft::store::all_gather(store, "kernels", ctx.rank, ctx.size, ctx.timeout, &[u8::from(ring.kernels)])?;
        ring.kernels = loaded.iter().all(|k| k.as_slice() == [1]);
        Ok(ring)
    }

    /// Allocate and export this rank's slots and events.
    fn export(ctx: &BackendContext, gpu: &Arc<dyn Gpu>) -> Result<Peers> {
        let device = choose_device(ctx, &**gpu)?;
        let slot_bytes = match ctx.hints.get("cuda_slot_bytes") {
            None => DEFAULT_SLOT_BYTES,
            Some(v) => v
                .parse::<usize>()
                .ok()
                .filter(|b| *b >= 64)
                .ok_or_else(|| Error::invalid(format!("hint cuda_slot_bytes={v:?}: at least 64 bytes")))?,
        }
        .next_multiple_of(64);
        let staged_max = match ctx.hints.get("cuda_direct_staged_bytes") {
            None => DEFAULT_STAGED_MAX,
            Some(v) => v.parse::<usize>().map_err(|_| Error::invalid(format!("hint cuda_direct_staged_bytes={v:?}: a byte count")))?,
        };
        let wait_hint = match ctx.hints.get("cuda_wait").map(String::as_str) {
            None => None,
            Some("host") => Some(true),
            Some("device") => Some(false),
            Some(v) => return Err(Error::invalid(format!("hint cuda_wait={v:?}: \"host\" or \"device\""))),
        };
        let uuid = gpu.device_uuid(device)?;
        let my_slots = gpu.alloc(device, slot_bytes * SLOTS)?;
        let p2p = crate::p2p::Layout::new(ctx.size, ctx.hints.get("cuda_p2p_chunk_bytes"))?;
        let flags = gpu.alloc(device, p2p.stage_offset() + staged_max)?;
        let stage = flags + p2p.stage_offset() as u64;
        let kernels = prepare_flags(&**gpu, device, flags, p2p.zeroed(), ctx.timeout)?;
        let ev = || gpu.new_event(device, true);
        let ring = Peers {
            gpu: gpu.clone(),
            device,
            store: ctx.store.clone(),
            rank: ctx.rank,
            timeout: ctx.timeout,
            slot_bytes,
            staged_max,
            my_slots,
            next_slots: my_slots,
            stage,
            ranks_stage: Vec::new(),
            flags,
            ranks_flags: Vec::new(),
            p2p,
            kernels,
            kept: std::sync::Mutex::default(),
            opened: Vec::new(),
            filled: [ev()?, ev()?, ev()?, ev()?],
            consumed: [ev()?, ev()?, ev()?, ev()?],
            prev_filled: [Event(0); SLOTS],
            next_consumed: [Event(0); SLOTS],
            ready: ev()?,
            done: ev()?,
            ranks_ready: Vec::new(),
            ranks_done: Vec::new(),
            pids: Vec::new(),
            opened_events: Vec::new(),
            others: Vec::new(),
            host_wait: false,
            one_gpu: true,
            wait_hint,
        };
        let events: Vec<Event> = ring.events().collect();
        let mut parts = vec![gpu.ipc_export(my_slots)?.0, gpu.ipc_export(flags)?.0];
        for e in &events {
            parts.push(gpu.ipc_export_event(*e)?);
        }
        // In-process peers (ranks as threads) use pointers and events as they
        // are: CUDA IPC cannot open a handle in the process that made it.
        parts.push(my_slots.to_le_bytes().to_vec());
        parts.push(flags.to_le_bytes().to_vec());
        parts.extend(events.iter().map(|e| e.0.to_le_bytes().to_vec()));
        let record = encode(std::process::id(), uuid, &parts[..PARTS]);
        let local = encode(std::process::id(), uuid, &parts[PARTS..]);
        ctx.store.set(&format!("ipc/{}", ctx.rank), &record)?;
        ctx.store.set(&format!("local/{}", ctx.rank), &local)?;
        Ok(ring)
    }

    /// My exported events in record order: `filled`, `consumed`, `ready`, `done`.
    fn events(&self) -> impl Iterator<Item = Event> + '_ {
        self.filled.iter().chain(&self.consumed).copied().chain([self.ready, self.done])
    }

    /// Open the next rank's slots and `consumed` events, the previous
    /// rank's `filled`, and every rank's staging buffer, `ready` and `done`.
    fn open_peers(&mut self, ctx: &BackendContext) -> Result<()> {
        let (next, prev) = ((ctx.rank + 1) % ctx.size, (ctx.rank + ctx.size - 1) % ctx.size);
        let me = std::process::id();
        let my_uuid = self.gpu.device_uuid(self.device)?;
        let as_u64 = |b: &[u8]| u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
        for r in 0..ctx.size {
            if r == ctx.rank {
                self.pids.push(me);
                self.ranks_stage.push(self.stage);
                self.ranks_flags.push(self.flags);
                self.ranks_ready.push(self.ready);
                self.ranks_done.push(self.done);
                continue;
            }
            let (pid, uuid, parts) = decode(&ctx.store.get(&format!("ipc/{r}"), ctx.timeout)?)?;
            self.pids.push(pid);
            self.one_gpu &= uuid == my_uuid;
            // This rank's events (its parts: slots, staging buffer, events).
            let events: Vec<Event> = if pid == me {
                let (_, _, local) = decode(&ctx.store.get(&format!("local/{r}"), ctx.timeout)?)?;
                if r == next {
                    self.next_slots = as_u64(&local[0]);
                }
                self.ranks_flags.push(as_u64(&local[1]));
                self.ranks_stage.push(as_u64(&local[1]) + self.p2p.stage_offset() as u64);
                local[2..].iter().map(|b| Event(as_u64(b))).collect()
            } else {
                self.others.push((r, pid));
                self.host_wait |= uuid == my_uuid;
                if r == next {
                    self.next_slots = self.gpu.ipc_open(self.device, &parts[0])?;
                    self.opened.push(self.next_slots);
                }
                let flags = self.gpu.ipc_open(self.device, &parts[1])?;
                self.opened.push(flags);
                self.ranks_flags.push(flags);
                self.ranks_stage.push(flags + self.p2p.stage_offset() as u64);
                // Only the events this rank waits on: the neighbours' ring
                // events, and everyone's ready and done.
                let wanted = |i: usize| (r == prev && i < SLOTS) || (r == next && (SLOTS..2 * SLOTS).contains(&i)) || i >= 2 * SLOTS;
                let mut events = Vec::with_capacity(PARTS - 2);
                for (i, h) in parts[2..].iter().enumerate() {
                    events.push(if wanted(i) {
                        let e = self.gpu.ipc_open_event(h)?;
                        self.opened_events.push(e);
                        e
                    } else {
                        Event(0)
                    });
                }
                events
            };
            if r == prev {
                self.prev_filled.copy_from_slice(&events[..SLOTS]);
            }
            if r == next {
                self.next_consumed.copy_from_slice(&events[SLOTS..2 * SLOTS]);
            }
            self.ranks_ready.push(events[2 * SLOTS]);
            self.ranks_done.push(events[2 * SLOTS + 1]);
        }
        if let Some(host) = self.wait_hint {
            self.host_wait = host;
        }
        Ok(())
    }
}

/// At most this long, on dropping a group, for the other processes to close
/// what they opened of this rank's (a process that keeps its group open
/// longer, or is gone, does not hold this one up further).
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// Say (in `store`) that rank `rank` has closed what it opened of the
/// others', and wait until every rank of `others` (rank, pid) has said the
/// same or exited: CUDA leaves it undefined to free memory or destroy an
/// event that another process still has open, and a rank in this process
/// may still be using them in its last op.
pub fn await_peers_closed(store: &dyn Store, rank: usize, others: &[(usize, u32)], timeout: Duration) {
    let key = |r: usize| format!("closed/{r}");
    if others.is_empty() || store.set(&key(rank), b"1").is_err() {
        return;
    }
    let deadline = Instant::now() + CLOSE_WAIT.min(timeout);
    for &(peer, pid) in others {
        while let Err(e) = store.get(&key(peer), Duration::from_millis(50)) {
            let waiting = e.kind() == &weft::ErrorKind::Timeout && Instant::now() < deadline;
            if !waiting || first_gone(&[(peer, pid)]).is_some() {
                break;
            }
        }
    }
}

impl Peers {
    /// Order `stream` after another rank's `event`: on the device, or
    /// (`host_wait`) by blocking this thread until it has completed or a
    /// rank's process is found gone (its events would never complete).
    pub fn after(&self, stream: StreamHandle, event: Event, deadline: Instant, what: &str) -> Result<()> {
        if !self.host_wait {
            return self.gpu.wait_event(stream, event);
        }
        self.wait_host(event, deadline, what)
    }

    /// Block this thread until `event` has completed, or until a rank's
    /// process is found gone.
    pub fn wait_host(&self, event: Event, deadline: Instant, what: &str) -> Result<()> {
        let alive = || match first_gone(&self.others) {
            Some((peer, pid)) => Err(Error::peer_lost(peer, format!("rank {peer} (pid {pid}) exited while this rank waited for {what}"))),
            None => Ok(()),
        };
        synchronize_event_checked(&*self.gpu, event, deadline, what, HOST_SPIN, &alive)
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        let g = &self.gpu;
        for e in self.opened_events.drain(..) {
            g.destroy_event(e);
        }
        let kept = std::mem::take(&mut *self.kept.lock().unwrap_or_else(|p| p.into_inner()));
        for mapped in self.opened.drain(..).chain(kept.into_values()) {
            // SAFETY: opened by ipc_open; the backend is shutting down and
            // its stream was drained.
            unsafe { g.ipc_close(mapped) };
        }
        // Every other rank, in this process too: a rank whose last op is
        // still ordering its stream after our `done` uses our event.
        let everyone: Vec<(usize, u32)> = self.pids.iter().copied().enumerate().filter(|(r, _)| *r != self.rank).collect();
        await_peers_closed(&*self.store, self.rank, &everyone, self.timeout);
        for e in self.events().collect::<Vec<_>>() {
            g.destroy_event(e);
        }
        // SAFETY: allocated in `export`; `free` waits for device work.
        unsafe {
            g.free(self.my_slots);
            g.free(self.flags);
        }
    }
}
