//! Point-to-point ops GPU to GPU (send, recv, their batches, sendrecv),
//! with no host step on the device path, so eager and captured ops run the
//! same way.
//!
//! Every rank has, in its staging allocation (mapped by every rank at
//! setup), an outbox of two halves of `chunk` bytes for each peer, and per
//! peer and half three words: `sent` (chunks it put in that half of its
//! outbox for the peer), `want` (chunks it began to take from that half of
//! the peer's outbox for it) and `got` (chunks it took). A message moves in
//! chunks, each direction's chunks alternating halves (across messages, so
//! two short ones in a row do not wait for each other):
//!
//! - the sender waits on the device until the receiver's `got` reaches its
//!   `sent` (the half is free), copies the chunk into its outbox, and bumps
//!   `sent` ([`Gpu::wait_flag`], a device copy, [`Gpu::signal`]);
//! - the receiver bumps `want`, waits until the sender's `sent` reaches it,
//!   copies the chunk out of the sender's outbox (mapped here) into its
//!   tensor, and stores `want` in `got`.
//!
//! So a rank's messages to a peer arrive in the order it issued them (one
//! stream of chunks per direction), each half holds one chunk at a time,
//! and while the receiver copies one chunk out the sender copies the next
//! in. Counters only grow and both sides count the same chunks, so a
//! replayed graph repeats the hand-offs exactly (as NCCL's graphs ask:
//! every rank launches the same work in the same order).
//!
//! Eager ops run each direction to each peer on a stream of its own,
//! ordered after the caller's: a rank's sends never wait behind its own
//! receives, so two ranks that both issue their sends, then their
//! receives, complete (as with NCCL, a send of more than two chunks is
//! done only once received). A captured op (the caller's stream capturing a graph)
//! queues its messages on the caller's stream, interleaved chunk by chunk
//! across peers and directions, which a batch (or `sendrecv`) needs; as
//! with NCCL, separately captured sends and receives that depend on each
//! other must be one batch.
//!
//! Where ranks are threads of one process, eager ops stay staged through
//! the host (`lib.rs`): the ranks share a CUDA context, whose `cuMemFree`
//! waits for all its work, including another rank's receive waiting on the
//! device for a send the freeing rank has yet to issue.
//!
//! Beside the device work, each message sends its peer a 16-byte record
//! through the CPU backend, under the message's own tag (with
//! [`weft::tag::DEVICE_RECORD`]): its place in the sender's order to that
//! peer and its size. A receive checks both when the record arrives (on
//! the host, in the background), so mismatched sizes or messages taken in
//! another order than sent fail the receive with `InvalidArgument` naming
//! the peer, instead of copying the wrong bytes silently. After such a
//! failure, or any other once an op's messages have their places (a record
//! that never came), the ranks' chunk counts may no longer agree: every
//! later point-to-point op of this rank fails with the same error. What a
//! failed op queued on the device still runs: its work handle waits for it
//! before the tensors are free.

use crate::setup::FLAGS;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use weft::backend::progress::{Done, Post};
use weft::backend::{Backend, Op, P2p, ANY_SOURCE};
use weft::stream::{CompletionSlot, DeviceCompletion};
use weft::{Device, Error, Result, StreamHandle};
use weft_cuda_driver::{order_after, synchronize_stream, DevicePtr, Gpu, StreamCompletion};

/// Words per peer: `sent`, `want`, `got`, each for two halves.
const WORDS_PER_PEER: usize = 6;

/// Default outbox bytes per rank, over all peers and both halves.
const OUTBOXES: usize = 32 << 20;

/// Where a rank's point-to-point words and outboxes lie in its staging
/// allocation (after the hand-off words, before the staging buffer). Every
/// rank computes the same from the group's size and hints.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    world: usize,
    /// Bytes of one half of an outbox: a message moves in chunks of this size.
    pub chunk: usize,
}

#[derive(Copy, Clone)]
enum Word {
    Sent = 0,
    Want = 1,
    Got = 2,
}

impl Layout {
    /// The layout of a group of `world` ranks; `hint`: `cuda_p2p_chunk_bytes`
    /// (default: 32 MiB of outboxes per rank, chunks of 64 KiB to 4 MiB).
    pub fn new(world: usize, hint: Option<&String>) -> Result<Layout> {
        let chunk = match hint {
            None => (OUTBOXES / (2 * world.max(1))).clamp(64 << 10, 4 << 20),
            Some(v) => v
                .parse::<usize>()
                .ok()
                .filter(|b| *b >= 256)
                .ok_or_else(|| Error::invalid(format!("hint cuda_p2p_chunk_bytes={v:?}: at least 256 bytes")))?,
        };
        Ok(Layout { world, chunk: chunk.next_multiple_of(256) })
    }

    fn words_bytes(&self) -> usize {
        (self.world * WORDS_PER_PEER * 8).next_multiple_of(256)
    }

    /// Bytes from the start of a staging allocation to its staging buffer.
    pub fn stage_offset(&self) -> usize {
        FLAGS + self.words_bytes() + 2 * self.world * self.chunk
    }

    /// Bytes at the start of a staging allocation that setup zeroes: the
    /// hand-off words and these words.
    pub fn zeroed(&self) -> usize {
        FLAGS + self.words_bytes()
    }

    /// The word `which` of half `half` for `peer` in the allocation at `base`.
    fn word(&self, base: DevicePtr, peer: usize, which: Word, half: usize) -> DevicePtr {
        base + (FLAGS + (peer * WORDS_PER_PEER + which as usize * 2 + half) * 8) as u64
    }

    /// Half `half` of the outbox for `peer` in the allocation at `base`.
    fn outbox(&self, base: DevicePtr, peer: usize, half: usize) -> DevicePtr {
        base + (FLAGS + self.words_bytes() + (peer * 2 + half) * self.chunk) as u64
    }
}

/// One message of an op: to or from `peer`.
#[derive(Copy, Clone, Debug)]
struct Message {
    peer: usize,
    send: bool,
    ptr: DevicePtr,
    bytes: usize,
    tag: u64,
    /// Its place among this rank's messages to (or from) `peer`.
    seq: u64,
}

/// A message's record: its place in the sender's order and its size.
type Record = [u64; 2];

/// Chunk `k` of message `m`, through half `half` of the outbox.
#[derive(Copy, Clone, Debug)]
struct Chunk {
    m: Message,
    k: usize,
    half: usize,
}

/// What this rank's point-to-point ops share: where every rank's words and
/// outboxes are, the eager ops' streams and the order of messages so far.
pub struct DeviceP2p {
    gpu: Arc<dyn Gpu>,
    device: usize,
    rank: usize,
    layout: Layout,
    /// Every rank's staging allocation (mine included), mapped here; owned
    /// by the backend's `Peers`, which outlives this.
    bases: Vec<DevicePtr>,
    /// The ranks in other processes (rank, pid): who to blame when a
    /// stream waits for a dead one.
    others: Vec<(usize, u32)>,
    state: Mutex<State>,
    /// Set once two ranks' orders or sizes disagreed (see the module doc).
    broken: Arc<Mutex<Option<Error>>>,
}

/// One direction to one peer: (peer, whether this rank sends).
type Lane = (usize, bool);

#[derive(Default)]
struct State {
    /// Eager ops' streams, by lane.
    streams: HashMap<Lane, StreamHandle>,
    /// Messages issued so far, by lane.
    issued: HashMap<Lane, u64>,
    /// Chunks queued so far, by lane: which half the next one takes.
    chunks: HashMap<Lane, u64>,
}

impl State {
    /// The eager ops' stream of `lane`, made on first use.
    fn stream(&mut self, g: &dyn Gpu, device: usize, lane: Lane) -> Result<StreamHandle> {
        if let Some(s) = self.streams.get(&lane) {
            return Ok(*s);
        }
        let s = g.new_stream(device)?;
        self.streams.insert(lane, s);
        Ok(s)
    }
}

impl DeviceP2p {
    /// Over the staging allocations `bases` (by rank) of a group laid out as `layout`.
    pub fn new(
        gpu: Arc<dyn Gpu>,
        device: usize,
        rank: usize,
        layout: Layout,
        bases: Vec<DevicePtr>,
        others: Vec<(usize, u32)>,
    ) -> DeviceP2p {
        DeviceP2p { gpu, device, rank, layout, bases, others, state: Mutex::default(), broken: Arc::default() }
    }

    /// Whether `stream` (the caller's; `None`: the default) is capturing a
    /// CUDA graph (an error reads as not: the op then fails where it runs).
    pub fn capturing(&self, stream: Option<StreamHandle>) -> bool {
        self.gpu.is_capturing(stream.unwrap_or_default()).unwrap_or(false)
    }

    /// Post a send, a receive or a batch on `caller`'s stream (see the
    /// module doc); `done` runs once every record has arrived and been
    /// checked, with the device work left in `completion`.
    ///
    /// # Safety
    /// The memory of `op`'s tensors stays valid until `done` has run and
    /// the completion it leaves has completed.
    pub unsafe fn post(
        &self,
        cpu: &dyn Backend,
        op: &Op<'_>,
        caller: Option<StreamHandle>,
        deadline: Instant,
        completion: CompletionSlot,
        done: Done,
    ) {
        let name = match op {
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            _ => "batch_p2p",
        };
        if let Some(e) = self.broken.lock().unwrap_or_else(|p| p.into_inner()).clone() {
            return done(Err(e));
        }
        let mut messages = match self.messages(op) {
            Ok(m) => m,
            Err(e) => return done(Err(e.with_op(name).with_rank(self.rank))),
        };
        let caller = caller.unwrap_or_default();
        let limit = deadline.saturating_duration_since(Instant::now());
        // One op at a time takes its places, queues its chunks and posts
        // its records, so that messages of one tag reach the device and
        // the peer's matching in the same order.
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        for m in &mut messages {
            let n = state.issued.entry((m.peer, m.send)).or_default();
            m.seq = *n;
            *n += 1;
        }
        // SAFETY: the caller's promise: the tensors outlive the device work.
        let (device, queued) = unsafe { self.queue(&mut state, &messages, caller, limit) };
        // What was queued runs whatever happens next: the op's work handle
        // waits for it before the tensors are free again.
        if let Some(d) = device {
            completion.set(d);
        }
        match queued {
            // (Posting returns at once; `done` never takes this lock.)
            Ok(()) => self.exchange_records(cpu, &messages, deadline, done),
            Err(e) => {
                drop(state);
                done(Err(self.fail(self.explain(e).with_op(name).with_rank(self.rank))))
            }
        }
    }

    /// Mark the group's point-to-point broken by `e` (the ranks' chunk
    /// counts may no longer agree: see the module doc); `e`.
    fn fail(&self, e: Error) -> Error {
        *self.broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone());
        e
    }

    /// The messages of `op`, checked: contiguous tensors on this rank's GPU,
    /// peers in the group.
    fn messages(&self, op: &Op<'_>) -> Result<Vec<Message>> {
        let ops = match op {
            Op::Batch { ops } => ops.as_slice(),
            op => std::slice::from_ref(op),
        };
        let here = Device::Cuda(self.device as u32);
        ops.iter()
            .map(|op| {
                let (peer, tag, t, send) = match op {
                    Op::Send { data, peer, tag } => (*peer, *tag, data.clone(), true),
                    Op::Recv { buf, peer, tag } => (*peer, *tag, buf.as_tensor(), false),
                    _ => return Err(Error::invalid("cuda-device: a batch holds only sends and receives")),
                };
                if peer == ANY_SOURCE {
                    return Err(Error::unsupported("cuda-device cannot receive from any rank on the device"));
                }
                if peer >= self.bases.len() {
                    return Err(Error::invalid(format!("cuda-device: peer {peer} is not in this group of {}", self.bases.len())));
                }
                if t.device() != here {
                    return Err(Error::invalid(format!("cuda-device: this rank is on {here}, the tensor on {}", t.device())));
                }
                if !t.is_contiguous() {
                    return Err(Error::invalid("cuda-device: point-to-point ops take contiguous tensors"));
                }
                Ok(Message { peer, send, ptr: t.as_ptr() as u64, bytes: t.nbytes(), tag, seq: 0 })
            })
            .collect()
    }

    /// Queue `messages`' device work: captured on `caller`, else each
    /// direction to each peer on its own stream (see the module doc). The
    /// device side of what was queued (even where queueing failed part
    /// way), and whether all of it was.
    ///
    /// # Safety
    /// As [`DeviceP2p::post`].
    unsafe fn queue(
        &self,
        state: &mut State,
        messages: &[Message],
        caller: StreamHandle,
        limit: Duration,
    ) -> (Option<Arc<dyn DeviceCompletion>>, Result<()>) {
        let g = &*self.gpu;
        // Each direction to each peer: its chunks, in order, each with its
        // half (the lane's chunks so far alternate, across messages too, so
        // two short messages in a row do not wait for each other).
        let mut lanes: Vec<(Lane, Vec<Chunk>)> = Vec::new();
        for m in messages {
            let lane = (m.peer, m.send);
            let count = state.chunks.entry(lane).or_default();
            let chunks: Vec<Chunk> = (0..m.bytes.div_ceil(self.layout.chunk))
                .map(|k| {
                    let half = (*count % 2) as usize;
                    *count += 1;
                    Chunk { m: *m, k, half }
                })
                .collect();
            match lanes.iter_mut().find(|(key, _)| *key == lane) {
                Some((_, l)) => l.extend(chunks),
                None => lanes.push((lane, chunks)),
            }
        }
        let capturing = match g.is_capturing(caller) {
            Ok(c) => c,
            Err(e) => return (None, Err(e)),
        };
        if capturing {
            // Sends before receives at each step: a chunk's send waits only
            // for earlier steps' receives, on either rank.
            lanes.sort_by_key(|((_, send), _)| !*send);
            let steps = lanes.iter().map(|(_, l)| l.len()).max().unwrap_or(0);
            let queued = (0..steps).try_for_each(|step| {
                lanes.iter().filter_map(|(_, lane)| lane.get(step)).try_for_each(|c| {
                    // SAFETY: the caller's promise.
                    unsafe { self.chunk(caller, c, limit) }
                })
            });
            return (Some(Arc::new(crate::Captured)), queued);
        }
        let mut ends = Vec::new();
        let mut queued = Ok(());
        for (lane_key, lane) in lanes.iter().filter(|(_, l)| !l.is_empty()) {
            let stream = match state.stream(g, self.device, *lane_key) {
                Ok(s) => s,
                Err(e) => {
                    queued = Err(e);
                    break;
                }
            };
            queued = order_after(g, self.device, stream, caller).and_then(|()| {
                lane.iter().try_for_each(|c| {
                    // SAFETY: the caller's promise.
                    unsafe { self.chunk(stream, c, limit) }
                })
            });
            match StreamCompletion::record(self.gpu.clone(), self.device, stream, caller) {
                Ok(end) => ends.push(end),
                Err(e) => {
                    // Nothing marks the end of what this stream queued:
                    // wait for it here, so the tensors are free when the op is.
                    let _ = synchronize_stream(g, self.device, stream, Instant::now() + limit, "a failed point-to-point op");
                    queued = queued.and(Err(e));
                }
            }
            if queued.is_err() {
                break;
            }
        }
        let device = (!ends.is_empty()).then(|| Arc::new(Lanes { ends, others: self.others.clone() }) as Arc<dyn DeviceCompletion>);
        (device, queued)
    }

    /// Queue on `stream` chunk `c` (see the module doc).
    ///
    /// # Safety
    /// The chunk's tensor is valid until the stream has run this.
    unsafe fn chunk(&self, stream: StreamHandle, c: &Chunk, limit: Duration) -> Result<()> {
        let (g, l, me) = (&*self.gpu, &self.layout, self.rank);
        let (m, half, at) = (&c.m, c.half, c.k * l.chunk);
        let n = l.chunk.min(m.bytes - at);
        let (mine, theirs) = (self.bases[me], self.bases[m.peer]);
        // SAFETY: the words and outboxes lie in staging allocations mapped
        // for the group's life (`Layout`), only this direction's chunks use
        // them, and `m`'s range is the caller's tensor (the caller's promise).
        unsafe {
            if m.send {
                let sent = l.word(mine, m.peer, Word::Sent, half);
                g.wait_flag(stream, sent, l.word(theirs, me, Word::Got, half), limit)?;
                g.copy_dtod(stream, l.outbox(mine, m.peer, half), m.ptr + at as u64, n)?;
                g.signal(stream, sent, true, sent)
            } else {
                let want = l.word(mine, m.peer, Word::Want, half);
                g.signal(stream, want, true, want)?;
                g.wait_flag(stream, want, l.word(theirs, me, Word::Sent, half), limit)?;
                g.copy_dtod(stream, m.ptr + at as u64, l.outbox(theirs, me, half), n)?;
                g.signal(stream, want, false, l.word(mine, m.peer, Word::Got, half))
            }
        }
    }

    /// Send every message's record to its peer and take every receive's
    /// (not for messages to this rank itself), through `cpu`; then check
    /// the receives' and finish the op.
    fn exchange_records(&self, cpu: &dyn Backend, messages: &[Message], deadline: Instant, done: Done) {
        let me = self.rank;
        let mut records: Vec<(Message, Box<Record>)> = messages
            .iter()
            .filter(|m| m.peer != me)
            .map(|m| (*m, Box::new(if m.send { [m.seq, m.bytes as u64] } else { [0; 2] })))
            .collect();
        // The records' heap memory does not move with the boxes.
        let spans: Vec<*mut u8> = records.iter_mut().map(|(_, r)| r.as_mut_ptr() as *mut u8).collect();
        let mut transfers: Vec<P2p<'_>> = records
            .iter()
            .zip(&spans)
            .map(|((m, _), &at)| {
                let tag = m.tag | weft::tag::DEVICE_RECORD;
                // SAFETY: `records` keeps these 16 bytes until `finish` has run.
                let bytes = unsafe { std::slice::from_raw_parts_mut(at, 16) };
                if m.send {
                    P2p::Send { peer: m.peer, tag, data: bytes }
                } else {
                    P2p::Recv { peer: m.peer, tag, buf: bytes }
                }
            })
            .collect();
        let broken = self.broken.clone();
        let finish: Done = Box::new(move |r: Result<()>| {
            let checked = r.and_then(|()| records.iter().filter(|(m, _)| !m.send).try_for_each(|(m, got)| check(m, got)));
            // Whatever went wrong (a record missing, or one that disagrees),
            // this rank's counts may no longer match its peers'.
            done(checked.inspect_err(|e| *broken.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.clone())))
        });
        if transfers.is_empty() {
            // (Only messages to this rank itself: nothing to check.)
            return finish(Ok(()));
        }
        // SAFETY: the records live in `finish` until it has run.
        let post = unsafe { Post::new(&mut transfers, &[], deadline, finish) };
        cpu.post(post);
    }

    /// `e`, or the peer lost, where a rank's process is gone.
    fn explain(&self, e: Error) -> Error {
        explain(&self.others, e)
    }

    /// Wait for the eager ops' streams and destroy them (the group is closing).
    pub fn close(&self, deadline: Instant) {
        let streams: Vec<StreamHandle> = self.state.lock().unwrap_or_else(|p| p.into_inner()).streams.drain().map(|(_, s)| s).collect();
        for s in streams {
            let _ = synchronize_stream(&*self.gpu, self.device, s, deadline, "closing cuda-device");
            self.gpu.destroy_stream(s);
        }
    }
}

/// A receive's record against the receive: the same place in the
/// sender's order and the same size, else `InvalidArgument` naming the peer.
fn check(m: &Message, got: &Record) -> Result<()> {
    let [seq, bytes] = *got;
    let tag = m.tag & u64::from(weft::tag::MAX_USER_TAG);
    if bytes != m.bytes as u64 {
        return Err(Error::invalid(format!(
            "cuda-device: rank {} sent {bytes} bytes with tag {tag}, and this receive takes {} bytes: the sizes must match",
            m.peer, m.bytes
        )));
    }
    if seq != m.seq {
        return Err(Error::invalid(format!(
            "cuda-device: the message with tag {tag} is rank {}'s message {seq} to this rank, and this is this rank's receive {} from it: on the device a rank's messages to a peer are received in the order sent",
            m.peer, m.seq
        )));
    }
    Ok(())
}

/// `e`, or the peer lost, where a rank of `others` (rank, pid) has exited.
fn explain(others: &[(usize, u32)], e: Error) -> Error {
    crate::setup::blame_gone(others, e, "a point-to-point op")
}

/// The device side of an eager op: the end of each stream it used.
struct Lanes {
    ends: Vec<StreamCompletion>,
    others: Vec<(usize, u32)>,
}

impl DeviceCompletion for Lanes {
    fn order_caller_stream(&self) -> Result<()> {
        self.ends.iter().try_for_each(DeviceCompletion::order_caller_stream)
    }
    fn is_complete(&self) -> Result<bool> {
        for e in &self.ends {
            if !e.is_complete().map_err(|e| explain(&self.others, e))? {
                return Ok(false);
            }
        }
        Ok(true)
    }
    fn synchronize(&self, deadline: Instant) -> Result<()> {
        self.ends.iter().try_for_each(|e| e.synchronize(deadline)).map_err(|e| explain(&self.others, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_layout_keeps_words_outboxes_and_stage_apart() {
        let l = Layout::new(3, Some(&"1000".to_string())).unwrap();
        assert_eq!(l.chunk, 1024);
        let last_word = l.word(0, 2, Word::Got, 1) + 8;
        assert!(last_word <= l.outbox(0, 0, 0));
        assert_eq!(l.outbox(0, 2, 1) + l.chunk as u64, l.stage_offset() as u64);
        assert_eq!(l.zeroed() as u64, l.outbox(0, 0, 0));
        // The default spends 32 MiB of outboxes, in chunks of 64 KiB to 4 MiB.
        assert_eq!(Layout::new(2, None).unwrap().chunk, 4 << 20);
        assert_eq!(Layout::new(8, None).unwrap().chunk, 2 << 20);
        assert_eq!(Layout::new(1024, None).unwrap().chunk, 64 << 10);
        assert!(Layout::new(2, Some(&"100".to_string())).is_err());
    }

    #[test]
    fn a_record_that_disagrees_names_the_peer() {
        let m = Message { peer: 1, send: false, ptr: 0, bytes: 64, tag: 7, seq: 2 };
        assert!(check(&m, &[2, 64]).is_ok());
        assert!(check(&m, &[2, 32]).unwrap_err().to_string().contains("rank 1 sent 32 bytes"));
        assert!(check(&m, &[3, 64]).unwrap_err().to_string().contains("in the order sent"));
    }
}
