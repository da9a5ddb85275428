//! The suite on CUDA memory, through `weft-cuda-driver` (a real GPU, or
//! the emulation under `WEFT_CUDA_EMULATION`).

use crate::placement::{Placement, SharedPlacement};
use crate::{assert_passed, checks_on_threads, Check};
use std::sync::Arc;
use std::time::{Duration, Instant};
use weft::{Device, Error, GroupOptions, ProcessGroup, StreamHandle};
use weft_cuda_driver::{synchronize_stream, Gpu};

/// This process's GPU, for one test at a time: take it first in every test
/// that uses the device in this process. Tests sharing one device run one
/// after another, as `scripts/gpu-tests.sh` runs them on a real one: freeing
/// memory waits for every stream's work, so another test's stream, stalled
/// on purpose, would hold this one up (past its deadline, once, in CI).
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static DEVICE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    DEVICE.lock().unwrap_or_else(|p| p.into_inner())
}

/// Run `suite` on `w` ranks that are threads of this process, in a group
/// of backend `spec` (`"cpu:NAME,cuda:NAME"`, linked) with group `hints`,
/// every tensor in the memory of CUDA device 0 (a stream of each rank's
/// own); panics with the failing checks' table if any rank has one. The GPU
/// is weft's emulated one unless `WEFT_TEST_REAL_GPU=1`: a CUDA backend's
/// conformance tests run in CI and, unchanged, on a real GPU.
pub fn on_threads(spec: &str, hints: &[(&str, &str)], w: usize, suite: fn(&ProcessGroup, SharedPlacement) -> Vec<Check>) {
    if std::env::var("WEFT_TEST_REAL_GPU").as_deref() != Ok("1") {
        weft_cuda_driver::emulate(1).expect("the emulated GPU");
    }
    let mut opts = GroupOptions::default().backend(spec).timeout(Duration::from_secs(60));
    for (k, v) in hints {
        opts = opts.hint(*k, *v);
    }
    let results = checks_on_threads(opts, w, |pg| suite(pg, placement(0).expect("CUDA device 0")));
    assert_passed(&results, &format!("{spec} {hints:?} W={w}"));
}

/// CUDA device `ordinal` with a stream of its own as the caller's stream.
pub fn placement(ordinal: usize) -> weft::Result<SharedPlacement> {
    let gpu = weft_cuda_driver::gpu().map_err(Error::unsupported)?;
    let stream = gpu.new_stream(ordinal)?;
    Ok(Arc::new(CudaPlacement { gpu, ordinal, stream }))
}

/// The device a launcher's local rank uses: `LOCAL_RANK` (else `rank`)
/// modulo the device count.
pub fn local_placement(rank: usize) -> weft::Result<SharedPlacement> {
    let gpu = weft_cuda_driver::gpu().map_err(Error::unsupported)?;
    let local: usize = std::env::var("LOCAL_RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(rank);
    placement(local % gpu.device_count().max(1))
}

struct CudaPlacement {
    gpu: Arc<dyn Gpu>,
    ordinal: usize,
    stream: StreamHandle,
}

impl CudaPlacement {
    fn sync(&self) -> weft::Result<()> {
        synchronize_stream(
            &*self.gpu,
            self.ordinal,
            self.stream,
            Instant::now() + Duration::from_secs(120),
            "the conformance suite's copies",
        )
    }
}

impl Drop for CudaPlacement {
    fn drop(&mut self) {
        let _ = self.sync();
        self.gpu.destroy_stream(self.stream);
    }
}

impl Placement for CudaPlacement {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal as u32)
    }
    fn stream(&self) -> StreamHandle {
        self.stream
    }
    fn alloc(&self, bytes: usize) -> weft::Result<u64> {
        self.gpu.alloc(self.ordinal, bytes)
    }
    fn upload(&self, addr: u64, data: &[u8]) -> weft::Result<()> {
        // SAFETY: `addr` holds data.len() bytes; `data` outlives the copy
        // (the trait's contract).
        unsafe { self.gpu.copy_htod(self.stream, addr, data.as_ptr(), data.len()) }
    }
    fn download(&self, addr: u64, out: &mut [u8]) -> weft::Result<()> {
        // SAFETY: `out` lives until the sync below returns.
        unsafe { self.gpu.copy_dtoh(self.stream, out.as_mut_ptr(), addr, out.len())? };
        self.sync()
    }
    fn copy(&self, dst: u64, src: u64, bytes: usize) -> weft::Result<()> {
        // SAFETY: both are allocations of this placement of at least `bytes`.
        unsafe { self.gpu.copy_dtod(self.stream, dst, src, bytes)? };
        self.sync()
    }
    fn free(&self, addr: u64) {
        let _ = self.sync();
        // SAFETY: allocated by `alloc`; the stream's work on it is done.
        unsafe { self.gpu.free(addr) }
    }
}

/// Point-to-point between ranks on one GPU through `pg` (cuda-device,
/// ranks in separate processes): a ring of sends and receives in a scope,
/// both neighbours sending before receiving, `sendrecv`, a batch and an
/// empty message, each exact, and (on the emulated GPU, which counts them)
/// no payload byte copied between host and device while they run. One
/// [`Check`] per case.
pub fn p2p_stays_on_the_device(pg: &ProcessGroup, p: SharedPlacement) -> Vec<Check> {
    use crate::Buf;
    use weft::prelude::*;
    use weft::{DType, P2pOp};
    weft::stream::set_current_stream(Some(p.stream()));
    let (r, w) = (pg.rank(), pg.size());
    let (right, left) = ((r + 1) % w, (r + w - 1) % w);
    let o = OpOptions::default().timeout(Duration::from_secs(30));
    let emulated = std::env::var("WEFT_TEST_REAL_GPU").as_deref() != Ok("1");
    let data = |seed: usize, n: usize| -> Vec<u8> { (0..n).map(|i| ((seed * 31 + i * 7) % 251) as u8).collect() };
    let place = |v: Vec<u8>| Buf::from_bytes(DType::U8, &v).place(Some(&p));
    // Run `op` between barriers; its result against `want`, and the payload
    // bytes the emulated GPU saw cross between host and device meanwhile.
    let counted = |op: &mut dyn FnMut() -> weft::Result<Vec<(Buf, Vec<u8>)>>| -> weft::Result<Option<String>> {
        pg.barrier(&o)?.wait()?;
        let before = weft_cuda_driver::emulated::host_bytes();
        let outs = op()?;
        pg.barrier(&o)?.wait()?;
        let moved = weft_cuda_driver::emulated::host_bytes() - before;
        for (i, (b, want)) in outs.iter().enumerate() {
            if b.read()? != *want {
                return Ok(Some(format!("output {i} wrong")));
            }
        }
        Ok((emulated && moved > 0).then(|| format!("{moved} payload bytes through the host")))
    };
    let n = 300_001;
    type Case<'a> = (&'static str, Box<dyn Fn() -> weft::Result<Option<String>> + 'a>);
    let cases: Vec<Case<'_>> = vec![
        (
            "p2p on the device: a ring in a scope",
            Box::new(|| {
                let input = place(data(r, n))?;
                let mut out = Some(place(vec![0; n])?);
                counted(&mut || {
                    let mut out = out.take().expect("one run");
                    pg.scope(|s| -> weft::Result<()> {
                        let a = s.send(input.t(), right, 11, &o)?;
                        let b = s.recv(out.tm(), left, 11, &o)?;
                        a.wait()?;
                        b.wait()
                    })?;
                    Ok(vec![(out, data(left, n))])
                })
            }),
        ),
        (
            "p2p on the device: every rank sends first, twice",
            Box::new(|| {
                let (x, y) = (place(data(r, n))?, place(data(r + 9, 1000))?);
                let mut outs = Some((place(vec![0; n])?, place(vec![0; 1000])?));
                counted(&mut || {
                    let (mut a, mut b) = outs.take().expect("one run");
                    pg.scope(|s| -> weft::Result<()> {
                        let sends = [s.send(x.t(), right, 12, &o)?, s.send(y.t(), right, 13, &o)?];
                        let recvs = [s.recv(a.tm(), left, 12, &o)?, s.recv(b.tm(), left, 13, &o)?];
                        sends.into_iter().chain(recvs).try_for_each(|wk| wk.wait())
                    })?;
                    Ok(vec![(a, data(left, n)), (b, data(left + 9, 1000))])
                })
            }),
        ),
        (
            "p2p on the device: two short sends, each waited for, before the receives",
            Box::new(|| {
                let (x, y) = (place(data(r + 1, 1000))?, place(data(r + 2, 1000))?);
                let mut outs = Some((place(vec![0; 1000])?, place(vec![0; 1000])?));
                counted(&mut || {
                    let (mut a, mut b) = outs.take().expect("one run");
                    // Each send fits one half of the outbox: neither waits for a receive.
                    let short = o.clone().timeout(Duration::from_secs(5));
                    pg.send(x.t(), right, 18, &short)?.wait()?;
                    pg.send(y.t(), right, 19, &short)?.wait()?;
                    pg.recv(a.tm(), left, 18, &short)?.wait()?;
                    pg.recv(b.tm(), left, 19, &short)?.wait()?;
                    Ok(vec![(a, data(left + 1, 1000)), (b, data(left + 2, 1000))])
                })
            }),
        ),
        (
            "p2p on the device: sendrecv and an empty message",
            Box::new(|| {
                let (x, empty) = (place(data(r + 3, n))?, place(vec![])?);
                let mut outs = Some((place(vec![0; n])?, place(vec![])?));
                counted(&mut || {
                    let (mut a, mut none) = outs.take().expect("one run");
                    pg.sendrecv(x.t(), right, a.tm(), left, 14, &o)?.wait()?;
                    pg.sendrecv(empty.t(), left, none.tm(), right, 15, &o)?.wait()?;
                    Ok(vec![(a, data(left + 3, n)), (none, vec![])])
                })
            }),
        ),
        (
            "p2p on the device: a batch, receives first, both ways",
            Box::new(|| {
                let (to_right, to_left) = (place(data(r + 5, n))?, place(data(r + 7, 4097))?);
                let mut outs = Some((place(vec![0; n])?, place(vec![0; 4097])?));
                counted(&mut || {
                    let (mut from_left, mut from_right) = outs.take().expect("one run");
                    let ops = vec![
                        P2pOp::recv(from_left.tm(), left, 16),
                        P2pOp::recv(from_right.tm(), right, 17),
                        P2pOp::send(to_right.t(), right, 16),
                        P2pOp::send(to_left.t(), left, 17),
                    ];
                    pg.batch_p2p(ops, &o)?.wait()?;
                    Ok(vec![(from_left, data(left + 5, n)), (from_right, data(right + 7, 4097))])
                })
            }),
        ),
    ];
    cases.into_iter().map(|(op, run)| Check::of_scenario(op, DType::U8, run())).collect()
}
