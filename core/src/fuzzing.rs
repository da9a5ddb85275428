//! Entry points of the fuzz targets in `fuzz/` (feature `fuzzing`). Each
//! takes any bytes and must not panic, hang or allocate without bound; the
//! fuzz crate's replay test runs them over the stored corpus.

use crate::auth::Key;
use crate::plugin::abi::BackendV1;
use crate::store::session::{Answer, Session};
use crate::store::wire::{Decoder, Request};
use crate::store::MemoryStore;
use std::time::Duration;

/// The store's protocol as its server runs it: the bytes are the frames a
/// client sends (the first byte picks a store with or without a key). Every
/// request that decodes must encode back to itself; waits give up at once.
pub fn store_session(data: &[u8]) {
    let Some((first, mut rest)) = data.split_first() else { return };
    let key = Key::new(b"the fuzzing key, sixteen bytes or more".to_vec()).expect("a valid key");
    let state = MemoryStore::new(Duration::ZERO);
    let mut session = Session::new((first & 1 == 1).then_some(&key), &state);
    while rest.len() >= 4 {
        let n = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes")) as usize;
        let body = &rest[4..4 + n.min(rest.len() - 4)];
        rest = &rest[4 + body.len()..];
        // (The server drops a client whose frame does not decode; going on
        // reaches more states per input.)
        let Ok(req) = Request::decode(body) else { continue };
        assert_eq!(Request::decode(&req.encode()).ok().as_ref(), Some(&req), "a request encodes back to itself");
        match session.answer(req, &|| true) {
            Answer::Reply(reply) => {
                // As a client reads it.
                let _ = Decoder(&reply).u8();
            }
            Answer::Refuse(_) | Answer::Gone => return,
        }
    }
}

extern "C" fn entry() {}

/// A plugin's exported table, built from the bytes: its size and version
/// header, devices, layouts and priority, which entries it fills, and its
/// name (the rest of the bytes); checked as `plugin::open` checks it. The
/// statuses and messages a plugin returns are translated too.
pub fn plugin_table(data: &[u8]) {
    let word = |i: usize| data.get(4 * i..4 * i + 4).map_or(0, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")));
    let name: Vec<u8> = data.get(32..).unwrap_or_default().iter().copied().filter(|b| *b != 0).collect();
    let name = std::ffi::CString::new(name).expect("no NUL");
    // SAFETY: BackendV1 is plain data: zero is a valid value of every field.
    let mut table: BackendV1 = unsafe { std::mem::zeroed() };
    let present = word(5);
    let entries = [
        std::mem::offset_of!(BackendV1, probe),
        std::mem::offset_of!(BackendV1, init),
        std::mem::offset_of!(BackendV1, destroy),
        std::mem::offset_of!(BackendV1, start),
        std::mem::offset_of!(BackendV1, wait),
        std::mem::offset_of!(BackendV1, cancel),
        std::mem::offset_of!(BackendV1, abort),
        std::mem::offset_of!(BackendV1, last_error),
    ];
    for (bit, at) in entries.into_iter().enumerate() {
        if present & (1 << bit) != 0 {
            // SAFETY: `at` is the offset of an optional function pointer in
            // the table; any non-null address is a valid value of one. The
            // entries are never called here (a plugin's are called only
            // after its table is accepted, and this table never is used).
            unsafe {
                std::ptr::write_unaligned((&mut table as *mut BackendV1 as *mut u8).add(at) as *mut usize, entry as *const () as usize)
            };
        }
    }
    table.struct_size = word(0);
    table.abi_version = word(1);
    table.devices = word(2);
    table.layouts = word(3);
    table.priority = word(4) as i32;
    table.name = if present & (1 << 8) != 0 { name.as_ptr() } else { std::ptr::null() };
    // SAFETY: the table is a whole BackendV1 (more than any size its header
    // may claim is never read), its name a live C string or null.
    let _ = unsafe { crate::plugin::describe(&table, "fuzz") };
    let msg: Vec<std::ffi::c_char> = name.as_bytes_with_nul().iter().map(|b| *b as std::ffi::c_char).collect();
    let _ = crate::plugin::adapter::error_of(word(6) as i32, crate::plugin::adapter::message(&msg), word(7) as i32);
}

/// A window target's checks of what an origin sends ([`crate::window::frame`]):
/// the first 8 bytes are the target's registered size, the rest frames.
/// A frame that decodes lies inside that size and encodes back to itself.
pub fn window_frames(data: &[u8]) {
    use crate::window::frame::{Frame, FRAME_BYTES};
    let Some((size, rest)) = data.split_first_chunk::<8>() else { return };
    let local = u64::from_le_bytes(*size) as usize;
    for chunk in rest.chunks_exact(FRAME_BYTES) {
        let b: &[u8; FRAME_BYTES] = chunk.try_into().expect("a frame's bytes");
        let Ok(frame) = Frame::decode(b, 1, local) else { continue };
        if let Frame::Put { offset, len } | Frame::Get { offset, len } = frame {
            assert!(offset.checked_add(len).is_some_and(|end| end <= local as u64), "a frame past the window's end decoded");
        }
        assert_eq!(&frame.encode(Frame::inline(b))[..], &b[..], "a decoded frame encodes back to itself");
    }
}
