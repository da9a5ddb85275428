//! CUDA graph capture through a group: collectives captured on the
//! caller's stream, then the graph launched again and again with new
//! inputs (a real GPU, or the emulation, which replays what a capture
//! recorded).

use crate::{Buf, Check, SharedPlacement};
use weft::prelude::*;
use weft::DType;

/// A CUDA graph that captured all_reduce (twice), all_gather,
/// reduce_scatter, all_to_all, broadcast and a ring of `sendrecv` (send
/// to the right, receive from the left) on every rank, launched 10
/// times with new inputs written between launches: every launch must give
/// the exact results of its inputs (a launch that skipped a hand-off
/// between ranks reads stale or half-written buffers), and the group runs
/// ops eagerly afterwards. One [`Check`].
pub fn replays(pg: &weft::ProcessGroup, p: SharedPlacement) -> Vec<Check> {
    weft::stream::set_current_stream(Some(p.stream()));
    let (r, w, n) = (pg.rank(), pg.size(), 300usize);
    let o = OpOptions::default().timeout(std::time::Duration::from_secs(20));
    // Integer-valued floats: every sum is exact.
    let value = |rank: usize, it: usize, part: usize, i: usize| ((rank * 7 + it * 3 + part * 11 + i % 5) % 64) as f32;
    let bytes = |v: Vec<f32>| -> Vec<u8> { v.iter().flat_map(|x| x.to_ne_bytes()).collect() };
    let part = |rank: usize, it: usize, part: usize| bytes((0..n).map(|i| value(rank, it, part, i)).collect());
    let sum = |it: usize, p: usize| bytes((0..n).map(|i| (0..w).map(|q| value(q, it, p, i)).sum()).collect());
    let root = 1 % w;
    let run = || -> weft::Result<Option<String>> {
        let g = weft_cuda_driver::gpu().map_err(weft::Error::unsupported)?;
        let zeros = |k: usize| -> weft::Result<Vec<Buf>> { (0..k).map(|_| Buf::zeros(DType::F32, n).place(Some(&p))).collect() };
        let (mut ar, mut ag_in, mut rs_out, mut bc) = (zeros(1)?, zeros(1)?, zeros(1)?, zeros(1)?);
        let (mut ag_out, mut rs_in, mut a2a_in, mut a2a_out) = (zeros(w)?, zeros(w)?, zeros(w)?, zeros(w)?);
        let (mut p2p_in, mut p2p_out) = (zeros(1)?, zeros(1)?);
        let (right, left) = ((r + 1) % w, (r + w - 1) % w);
        let stream = p.stream();
        g.begin_capture(stream)?;
        let captured = (|| -> weft::Result<()> {
            pg.all_reduce(ar[0].tm(), ReduceOp::Sum, &o)?.wait()?;
            // Twice, on the same buffers: a peer's buffer mapped once serves both.
            pg.all_reduce(ar[0].tm(), ReduceOp::Sum, &o)?.wait()?;
            pg.all_gather(ag_out.iter_mut().map(Buf::tm).collect(), ag_in[0].t(), &o)?.wait()?;
            pg.reduce_scatter(rs_out[0].tm(), rs_in.iter().map(Buf::t).collect(), ReduceOp::Sum, &o)?.wait()?;
            pg.all_to_all(a2a_out.iter_mut().map(Buf::tm).collect(), a2a_in.iter().map(Buf::t).collect(), &o)?.wait()?;
            pg.broadcast(bc[0].tm(), root, &o)?.wait()?;
            pg.sendrecv(p2p_in[0].t(), right, p2p_out[0].tm(), left, 7, &o)?.wait()
        })();
        let graph = g.end_capture(stream);
        captured?;
        let graph = graph?;
        if weft_cuda_driver::emulated::graph_tasks(graph.0) == Some(0) {
            return Ok(Some("nothing was captured".into()));
        }
        let mut problems = Vec::new();
        for it in 0..10 {
            ar[0].write(&part(r, it, 0))?;
            ag_in[0].write(&part(r, it, 1))?;
            for (q, b) in rs_in.iter_mut().enumerate() {
                b.write(&part(r, it, 2 + q))?;
            }
            for (q, b) in a2a_in.iter_mut().enumerate() {
                b.write(&part(r, it, 20 + q))?;
            }
            bc[0].write(&if r == root { part(r, it, 40) } else { vec![0; 4 * n] })?;
            p2p_in[0].write(&part(r, it, 50))?;
            g.launch_graph(graph, stream)?;
            let mut check = |what: &str, b: &Buf, want: Vec<u8>| -> weft::Result<()> {
                if b.read()? != want {
                    problems.push(format!("launch {it}: {what}"));
                }
                Ok(())
            };
            let twice = |b: Vec<u8>| -> Vec<u8> {
                b.chunks(4).flat_map(|c| (f32::from_ne_bytes(c.try_into().expect("4 bytes")) * w as f32).to_ne_bytes()).collect()
            };
            check("all_reduce (twice)", &ar[0], twice(sum(it, 0)))?;
            for (q, b) in ag_out.iter().enumerate() {
                check("all_gather", b, part(q, it, 1))?;
            }
            check("reduce_scatter", &rs_out[0], sum(it, 2 + r))?;
            for (q, b) in a2a_out.iter().enumerate() {
                check("all_to_all", b, part(q, it, 20 + r))?;
            }
            check("broadcast", &bc[0], part(root, it, 40))?;
            check("sendrecv", &p2p_out[0], part(left, it, 50))?;
        }
        g.destroy_graph(graph);
        // The same ops run eagerly after the graph, on the device (a
        // mapping the graph keeps serves them too), and the graph's
        // buffers are the group's to use again.
        ar[0].write(&part(r, 99, 0))?;
        pg.all_reduce(ar[0].tm(), ReduceOp::Sum, &o.clone().hint("cuda_algorithm", "direct"))?.wait()?;
        if ar[0].read()? != sum(99, 0) {
            problems.push("an eager all_reduce after the graph".into());
        }
        Ok(problems.into_iter().next())
    };
    vec![Check::of_scenario("collectives captured into a graph and replayed", weft::DType::F32, run())]
}
