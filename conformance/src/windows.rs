//! One-sided windows ([`weft::Window`]): puts of every size at every
//! offset, signals that order them, gets, many origins into one target,
//! overlapping puts, bad ranges, direct mapping. Each case has a window of
//! its own and runs whatever the earlier ones did.

use crate::Check;
use std::time::Duration;
use weft::prelude::*;
use weft::{AccessType, DType, ErrorKind, Window};

/// The byte a put from `origin` writes at `i` of a target's window.
pub fn byte(origin: usize, i: usize) -> u8 {
    ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(origin as u32 * 97) >> 7) as u8 ^ (i >> 13) as u8
}

fn pattern(origin: usize, from: usize, n: usize) -> Vec<u8> {
    (from..from + n).map(|i| byte(origin, i)).collect()
}

type Case = fn(&ProcessGroup, usize) -> Result<(), String>;

/// Every window case on `pg`; `big`: the largest window and put, in bytes
/// (every rank registers about this much).
pub fn run_windows(pg: &ProcessGroup, big: usize) -> Vec<Check> {
    let cases: [(&'static str, Case); 8] = [
        ("window: puts of every size at every offset", puts_land),
        ("window: many puts, one signal", many_puts_one_signal),
        ("window: every origin into one target", many_origins),
        ("window: overlapping puts in issue order", overlapping),
        ("window: gets", gets),
        ("window: bad ranges refused on the origin", bad_ranges),
        ("window: map_remote and get_attr", mapping),
        ("window: signals counted, a missing one times out", counted_signals),
    ];
    cases
        .into_iter()
        .map(|(op, case)| {
            let r = case(pg, big);
            Check { op, dtype: DType::U8, redop: None, passed: r.is_ok(), detail: r.err().unwrap_or_default() }
        })
        .collect()
}

fn o() -> OpOptions {
    OpOptions::default()
}

fn e(what: &str) -> impl Fn(weft::Error) -> String + '_ {
    move |e| format!("{what}: {e}")
}

fn neighbours(pg: &ProcessGroup) -> (usize, usize, usize) {
    let (r, w) = (pg.rank(), pg.size());
    (r, (r + 1) % w, (r + w - 1) % w)
}

/// This rank's bytes of `win`.
fn local(win: &Window) -> Vec<u8> {
    let mut v = vec![0u8; win.local().len()];
    win.local().read(0, &mut v).expect("in range");
    v
}

fn first_difference(got: &[u8], want: &[u8]) -> Result<(), String> {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(i) => Err(format!("byte {i} is {} instead of {}", got[i], want[i])),
        None if got.len() != want.len() => Err(format!("{} bytes instead of {}", got.len(), want.len())),
        None => Ok(()),
    }
}

/// Each rank registers `big + rank` bytes and puts ranges of each size to
/// the next rank (empty at both ends, a byte at the last offset, odd sizes
/// across the inline limit, the whole window); after one signal the target
/// finds every byte in place.
fn puts_land(pg: &ProcessGroup, big: usize) -> Result<(), String> {
    let (r, right, left) = neighbours(pg);
    let win = pg.new_window(big + r).map_err(e("new_window"))?;
    let theirs = win.len_of(right);
    let ranges = [(0, 0), (theirs, 0), (theirs - 1, 1), (0, 1), (7, 31), (40, 32), (72, 33), (1000, 4097), (0, theirs)];
    let full = pattern(r, 0, theirs);
    for &(at, n) in &ranges {
        win.put(&full[at..at + n], right, at, &o()).and_then(|w| w.wait()).map_err(e(&format!("put of {n} B at {at}")))?;
    }
    win.signal(right, &o()).and_then(|w| w.wait()).map_err(e("signal"))?;
    win.wait_signal(left, &o()).map_err(e("wait_signal"))?;
    first_difference(&local(&win), &pattern(left, 0, big + r))?;
    win.deregister().map_err(e("deregister"))
}

fn many_puts_one_signal(pg: &ProcessGroup, _: usize) -> Result<(), String> {
    let (_, right, left) = neighbours(pg);
    const N: usize = 1000;
    let win = pg.new_window(8 * N).map_err(e("new_window"))?;
    let mine = pattern(pg.rank(), 0, 8 * N);
    let works: Vec<_> =
        (0..N).map(|i| win.put(&mine[8 * i..8 * i + 8], right, 8 * i, &o())).collect::<weft::Result<_>>().map_err(e("put"))?;
    win.signal(right, &o()).map_err(e("signal"))?.wait().map_err(e("signal"))?;
    for w in works {
        w.wait().map_err(e("put"))?;
    }
    win.wait_signal(left, &o()).map_err(e("wait_signal"))?;
    first_difference(&local(&win), &pattern(left, 0, 8 * N))?;
    win.deregister().map_err(e("deregister"))
}

/// Every rank (rank 0 too) puts into its own part of rank 0's window.
fn many_origins(pg: &ProcessGroup, _: usize) -> Result<(), String> {
    let (r, w) = (pg.rank(), pg.size());
    const PART: usize = 70_001;
    let win = pg.new_window(if r == 0 { PART * w } else { 0 }).map_err(e("new_window"))?;
    let mine = pattern(r, r * PART, PART);
    win.put(&mine[..], 0, r * PART, &o()).and_then(|x| x.wait()).map_err(e("put"))?;
    win.signal(0, &o()).and_then(|x| x.wait()).map_err(e("signal"))?;
    if r == 0 {
        for origin in 0..w {
            win.wait_signal(origin, &o()).map_err(e("wait_signal"))?;
        }
        let want: Vec<u8> = (0..w).flat_map(|origin| pattern(origin, origin * PART, PART)).collect();
        first_difference(&local(&win), &want)?;
    }
    win.deregister().map_err(e("deregister"))
}

/// Long and inline puts over the same bytes land in issue order.
fn overlapping(pg: &ProcessGroup, _: usize) -> Result<(), String> {
    let (_, right, left) = neighbours(pg);
    let n = 1 << 20;
    let win = pg.new_window(n).map_err(e("new_window"))?;
    let puts: [(usize, usize, u8); 5] = [(0, n, 1), (100, 8, 2), (50, 100_000, 3), (60, 4, 4), (70_000, 200_000, 5)];
    let mut want = vec![0u8; n];
    let bufs: Vec<Vec<u8>> = puts.iter().map(|&(_, len, v)| vec![v; len]).collect();
    let mut works = Vec::new();
    for (&(at, len, _), b) in puts.iter().zip(&bufs) {
        works.push(win.put(&b[..], right, at, &o()).map_err(e("put"))?);
        want[at..at + len].copy_from_slice(b);
    }
    win.signal(right, &o()).and_then(|x| x.wait()).map_err(e("signal"))?;
    for w in works {
        w.wait().map_err(e("put"))?;
    }
    win.wait_signal(left, &o()).map_err(e("wait_signal"))?;
    first_difference(&local(&win), &want)?;
    win.deregister().map_err(e("deregister"))
}

/// Each rank fills its own window, then reads the next rank's back:
/// whole, odd pieces, the last byte.
fn gets(pg: &ProcessGroup, big: usize) -> Result<(), String> {
    let (r, right, _) = neighbours(pg);
    let n = big.min(3 << 20) + r;
    let win = pg.new_window(n).map_err(e("new_window"))?;
    win.local().write(0, &pattern(r, 0, n)).map_err(e("local write"))?;
    pg.barrier(&o()).and_then(|w| w.wait()).map_err(e("barrier"))?;
    let theirs = win.len_of(right);
    for (at, len) in [(0, theirs), (theirs - 1, 1), (3, 29), (33, 4099), (theirs, 0)] {
        let mut got = vec![0u8; len];
        win.get(&mut got[..], right, at, &o()).and_then(|w| w.wait()).map_err(e(&format!("get of {len} B at {at}")))?;
        first_difference(&got, &pattern(right, at, len)).map_err(|m| format!("get of {len} B at {at}: {m}"))?;
    }
    win.deregister().map_err(e("deregister"))
}

/// Ranges past a target's end, offsets that overflow and ranks out of
/// range are `InvalidArgument` before a byte moves: the target's memory
/// stays zero.
fn bad_ranges(pg: &ProcessGroup, _: usize) -> Result<(), String> {
    let (r, right, left) = neighbours(pg);
    let w = pg.size();
    let win = pg.new_window(100 + r).map_err(e("new_window"))?;
    let theirs = win.len_of(right);
    let four = [9u8; 4];
    let mut sink = [0u8; 4];
    let tries: [(&str, weft::Result<weft::Work<'_>>); 5] = [
        ("put past the end", win.put(&four[..], right, theirs - 3, &o())),
        ("put at an overflowing offset", win.put(&four[..], right, usize::MAX - 1, &o())),
        ("put to a rank out of range", win.put(&four[..], w, 0, &o())),
        ("signal to a rank out of range", win.signal(w, &o())),
        ("get past the end", win.get(&mut sink[..], right, theirs, &o())),
    ];
    for (what, t) in tries {
        match t {
            Err(err) if err.kind() == &ErrorKind::InvalidArgument => {}
            Err(err) => return Err(format!("{what}: {err} (not InvalidArgument)")),
            Ok(_) => return Err(format!("{what} was accepted")),
        }
    }
    win.signal(right, &o()).and_then(|x| x.wait()).map_err(e("signal"))?;
    win.wait_signal(left, &o()).map_err(e("wait_signal"))?;
    first_difference(&local(&win), &vec![0u8; 100 + r]).map_err(|m| format!("a refused put wrote: {m}"))?;
    win.deregister().map_err(e("deregister"))
}

/// Where a peer's memory is mapped, writes through the view are seen
/// after a signal; elsewhere `map_remote` is `Unsupported`. This rank's
/// own is always mapped.
fn mapping(pg: &ProcessGroup, _: usize) -> Result<(), String> {
    let (r, right, left) = neighbours(pg);
    let win = pg.new_window(4096).map_err(e("new_window"))?;
    let own = win.map_remote(r).map_err(e("map_remote of this rank"))?;
    if own.as_ptr() != win.local().as_ptr() || win.attr(r).map_err(e("get_attr"))?.access != AccessType::Unified {
        return Err("this rank's own memory is not its local view".into());
    }
    let unified = win.attr(right).map_err(e("get_attr"))?.access == AccessType::Unified;
    match win.map_remote(right) {
        Ok(view) if unified => view.write(5, &pattern(r, 5, 1000)).map_err(e("write through the view"))?,
        Err(err) if !unified && err.kind() == &ErrorKind::Unsupported => {
            win.put(&pattern(r, 5, 1000)[..], right, 5, &o()).and_then(|x| x.wait()).map_err(e("put"))?
        }
        other => return Err(format!("map_remote of a peer ({}): {other:?}", if unified { "unified" } else { "separate" })),
    }
    win.signal(right, &o()).and_then(|x| x.wait()).map_err(e("signal"))?;
    win.wait_signal(left, &o()).map_err(e("wait_signal"))?;
    let mut want = vec![0u8; 4096];
    want[5..1005].copy_from_slice(&pattern(left, 5, 1000));
    first_difference(&local(&win), &want)?;
    win.deregister().map_err(e("deregister"))
}

/// Three signals are three; a fourth that never comes times out, naming
/// its origin.
fn counted_signals(pg: &ProcessGroup, _: usize) -> Result<(), String> {
    let (_, right, left) = neighbours(pg);
    let win = pg.new_window(0).map_err(e("new_window"))?;
    for _ in 0..3 {
        win.signal(right, &o()).and_then(|x| x.wait()).map_err(e("signal"))?;
    }
    win.wait_signals(left, 3, &o()).map_err(e("wait_signals(3)"))?;
    let short = OpOptions::default().timeout(Duration::from_millis(50));
    match win.wait_signal(left, &short) {
        Err(err) if err.kind() == &ErrorKind::Timeout && err.to_string().contains(&format!("rank {left}")) => {}
        other => return Err(format!("a fourth wait_signal: {other:?} (expected a timeout naming rank {left})")),
    }
    // (No peer deregisters while another still waits for it.)
    pg.barrier(&o()).and_then(|w| w.wait()).map_err(e("barrier"))?;
    win.deregister().map_err(e("deregister"))
}

/// Window cases on device memory (`placement`'s device, its stream the
/// caller's current one, as torch's would be): puts of odd sizes at odd
/// offsets then one signal, a get, every peer's memory mapped.
pub fn run_windows_on(pg: &ProcessGroup, placement: crate::SharedPlacement) -> Vec<Check> {
    crate::suite::on_stream_of(Some(&placement), || device_window_cases(pg, placement.clone()))
}

fn device_window_cases(pg: &ProcessGroup, placement: crate::SharedPlacement) -> Vec<Check> {
    let r = (|| -> Result<(), String> {
        let (r, right, left) = neighbours(pg);
        let o = OpOptions::default().stream(placement.stream());
        let n = 3 << 20;
        let win = pg.new_window_on(n + r, placement.device()).map_err(e("new_window_on"))?;
        let theirs = win.len_of(right);
        let src = crate::Buf::from_bytes(DType::U8, &pattern(r, 0, theirs)).place(Some(&placement)).map_err(e("upload"))?;
        let whole = src.t();
        for (at, len) in [(0, theirs), (theirs - 1, 1), (5, 77), (4096, 100_003)] {
            let piece = whole.split(&[at, len, theirs - at - len]).map_err(e("split"))?.swap_remove(1);
            win.put(piece, right, at, &o).and_then(|w| w.wait()).map_err(e(&format!("put of {len} B at {at}")))?;
        }
        win.signal(right, &o).and_then(|w| w.wait()).map_err(e("signal"))?;
        win.wait_signal(left, &o).map_err(e("wait_signal"))?;
        let mut got = vec![0u8; n + r];
        placement.download(win.local().as_ptr() as u64, &mut got).map_err(e("download"))?;
        first_difference(&got, &pattern(left, 0, n + r))?;
        // A window made from a device tensor holds its bytes everywhere,
        // though the stream is still busy with a long copy before `init`'s
        // upload: the window's copy must follow the current stream.
        let _busy = crate::Buf::zeros(DType::U8, 64 << 20).place(Some(&placement)).map_err(e("upload"))?;
        let init = crate::Buf::from_bytes(DType::U8, &pattern(r, 0, 5000)).place(Some(&placement)).map_err(e("upload"))?;
        let from = pg.new_window_from(init.t()).map_err(e("new_window_from"))?;
        let mut first = vec![0u8; 5000];
        placement.download(from.local().as_ptr() as u64, &mut first).map_err(e("download"))?;
        first_difference(&first, &pattern(r, 0, 5000)).map_err(|m| format!("new_window_from: {m}"))?;
        from.deregister().map_err(e("deregister"))?;
        let mut back = crate::Buf::zeros(DType::U8, 1000).place(Some(&placement)).map_err(e("upload"))?;
        win.get(back.tm(), right, 3, &o).and_then(|w| w.wait()).map_err(e("get"))?;
        first_difference(&back.read().map_err(e("download"))?, &pattern(r, 3, 1000)).map_err(|m| format!("get: {m}"))?;
        if win.attr(right).map_err(e("get_attr"))?.access != AccessType::Unified {
            return Err("a peer's device memory is not mapped".into());
        }
        pg.barrier(&OpOptions::default()).and_then(|w| w.wait()).map_err(e("barrier"))?;
        win.deregister().map_err(e("deregister"))
    })();
    vec![Check {
        op: "window on a device: puts, signal, get",
        dtype: DType::U8,
        redop: None,
        passed: r.is_ok(),
        detail: r.err().unwrap_or_default(),
    }]
}
