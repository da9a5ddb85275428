//! Posted point-to-point ops on device memory: what is sent is copied to
//! the host when the op is issued (after the caller's stream), the host
//! sends and receives are posted to the CPU backend, which progresses them
//! with everything else posted there, and what arrives is copied to the
//! device before the op completes. So a scope's CUDA sends and receives
//! never wait for each other, as on the host.

use crate::parts::{parts, Part};
use crate::pipeline::Staging;
use std::time::Instant;
use weft::backend::progress::{Done, Post};
use weft::backend::{Op, P2p};
use weft::{Result, StreamHandle};
use weft_cuda_driver::synchronize_stream;

/// A posted op's device tensors, their device and copy stream, and host
/// memory for each (holding what is sent).
struct Staged {
    parts: Vec<Part>,
    device: usize,
    stream: StreamHandle,
    host: Vec<Vec<u8>>,
}

impl Staging {
    /// Post a send, a receive or a batch of them whose tensors are on one
    /// CUDA device; `done` is called once every receive's bytes are on the
    /// device (or the op failed).
    ///
    /// # Safety
    /// The device memory of `op`'s tensors stays valid until `done` runs.
    pub unsafe fn post_p2p(&self, op: &mut Op<'_>, caller: Option<StreamHandle>, deadline: Instant, done: Done) {
        let name = match op {
            Op::Send { .. } => "send",
            Op::Recv { .. } => "recv",
            _ => "batch_p2p",
        };
        if let Err(e) = self.refuse_capture(caller, name) {
            return done(Err(e));
        }
        let Staged { parts, device, stream, host } = match self.stage(op, caller.unwrap_or_default(), deadline) {
            Ok(s) => s,
            Err(e) => return done(Err(e)),
        };
        // The host buffers move into the completion; their heap memory does
        // not move, so the transfers may point into it.
        let spans: Vec<(*mut u8, usize)> = host.iter().map(|h| (h.as_ptr() as *mut u8, h.len())).collect();
        let peers_tags: Vec<(usize, u64)> = match op {
            Op::Batch { ops } => ops.iter().map(peer_tag).collect(),
            op => vec![peer_tag(op)],
        };
        let mut transfers: Vec<P2p<'_>> = parts
            .iter()
            .zip(&spans)
            .zip(&peers_tags)
            .map(|((p, &(ptr, len)), &(peer, tag))| {
                if p.role.downloads() {
                    // SAFETY: `host` keeps these bytes until `done` runs.
                    P2p::Send { peer, tag, data: unsafe { std::slice::from_raw_parts(ptr, len) } }
                } else {
                    // SAFETY: as above; each part is one transfer's alone.
                    P2p::Recv { peer, tag, buf: unsafe { std::slice::from_raw_parts_mut(ptr, len) } }
                }
            })
            .collect();
        let g = self.gpu();
        let finish: Done = Box::new(move |r: Result<()>| done(r.and_then(|()| upload(&*g, device, stream, &parts, host, deadline))));
        // SAFETY: the host buffers live in `finish` until it has run.
        let post = unsafe { Post::new(&mut transfers, &[], deadline, finish) };
        self.cpu().post(post);
    }

    /// The op's parts staged: what is sent already on the host.
    fn stage(&self, op: &Op<'_>, caller: StreamHandle, deadline: Instant) -> Result<Staged> {
        let (parts, device) = parts(op, 0)?;
        let g = self.gpu();
        let stream = self.p2p.after(&*self.gpu(), device, caller)?;
        let mut host: Vec<Vec<u8>> = parts.iter().map(|p| vec![0u8; p.numel * p.dtype.size()]).collect();
        for (p, h) in parts.iter().zip(&mut host).filter(|(p, _)| p.role.downloads()) {
            // SAFETY: `h` is ours and outlives the synchronization below;
            // the device range is the caller's tensor (valid: see above).
            unsafe { g.copy_dtoh(stream, h.as_mut_ptr(), p.addr, h.len())? };
        }
        synchronize_stream(&*g, device, stream, deadline, "staging a send")?;
        Ok(Staged { parts, device, stream, host })
    }
}

fn peer_tag(op: &Op<'_>) -> (usize, u64) {
    match op {
        Op::Send { peer, tag, .. } | Op::Recv { peer, tag, .. } => (*peer, *tag),
        _ => (0, 0),
    }
}

/// Copy what the receives got to the device, and wait for it.
fn upload(
    g: &dyn weft_cuda_driver::Gpu,
    device: usize,
    stream: StreamHandle,
    parts: &[Part],
    mut host: Vec<Vec<u8>>,
    deadline: Instant,
) -> Result<()> {
    for (p, h) in parts.iter().zip(&mut host).filter(|(p, _)| p.role.uploads()) {
        weft::kernels::sanitize(h, p.dtype);
        // SAFETY: `h` lives until the synchronization below; the device
        // range is the caller's receive tensor, valid until the op completes.
        unsafe { g.copy_htod(stream, p.addr, h.as_ptr(), h.len())? };
    }
    synchronize_stream(g, device, stream, deadline, "receiving")
}
