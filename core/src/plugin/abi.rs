//! The C ABI of `include/weft_plugin.h`, version 1, mirrored in Rust.
//! Field order and types must match the header exactly.

#![allow(non_camel_case_types, missing_docs)]

use std::ffi::{c_char, c_void};

pub type Status = i32;
pub const OK: Status = 0;
pub const PENDING: Status = 1;
pub const ERR_TIMEOUT: Status = 2;
pub const ERR_PEER_LOST: Status = 3;
pub const ERR_INVALID: Status = 4;
pub const ERR_UNSUPPORTED: Status = 5;
pub const ERR_ABORTED: Status = 6;
pub const ERR_BACKEND: Status = 7;

pub const ABI_VERSION: u32 = 1;
pub const DEVICE_CPU: u32 = 1 << 0;
pub const DEVICE_CUDA: u32 = 1 << 1;
pub const LAYOUT_DENSE: u32 = 1 << 0;
pub const LAYOUT_SPARSE_COO: u32 = 1 << 1;
pub const P2P_SEND: u32 = 0;
pub const P2P_RECV: u32 = 1;
/// `BackendV1::flags`: several requests may be outstanding and progress
/// together (see the header's Threading notes).
pub const PLUGIN_CONCURRENT: u32 = 1 << 0;

#[repr(C)]
pub struct HostV1 {
    pub struct_size: u32,
    pub abi_version: u32,
    pub host_ctx: *mut c_void,
    pub store_set: unsafe extern "C" fn(*mut c_void, *const c_char, *const c_void, usize) -> Status,
    pub store_get: unsafe extern "C" fn(*mut c_void, *const c_char, i64, *mut c_void, usize, *mut usize) -> Status,
    pub store_add: unsafe extern "C" fn(*mut c_void, *const c_char, i64, *mut i64) -> Status,
    pub store_wait: unsafe extern "C" fn(*mut c_void, *const *const c_char, usize, i64) -> Status,
    pub log: unsafe extern "C" fn(*mut c_void, i32, *const c_char),
}

#[repr(C)]
pub struct InitV1 {
    pub struct_size: u32,
    pub abi_version: u32,
    pub rank: u32,
    pub size: u32,
    pub timeout_ms: i64,
    pub num_hints: usize,
    pub hint_keys: *const *const c_char,
    pub hint_values: *const *const c_char,
    pub host: *const HostV1,
}

#[repr(C)]
pub struct P2pV1 {
    pub kind: u32,
    pub peer: u32,
    pub tag: u64,
    pub buf: *mut c_void,
    pub len: usize,
}

#[repr(C)]
pub struct BackendV1 {
    pub struct_size: u32,
    pub abi_version: u32,
    pub name: *const c_char,
    pub devices: u32,
    pub layouts: u32,
    pub priority: i32,
    pub probe: Option<unsafe extern "C" fn(*mut c_char, usize) -> Status>,
    pub init: Option<unsafe extern "C" fn(*const InitV1, *mut *mut c_void, *mut c_char, usize) -> Status>,
    pub destroy: Option<unsafe extern "C" fn(*mut c_void)>,
    pub start: Option<unsafe extern "C" fn(*mut c_void, *const P2pV1, usize, i64, *mut *mut c_void) -> Status>,
    pub wait: Option<unsafe extern "C" fn(*mut c_void, *mut c_void, i64) -> Status>,
    pub cancel: Option<unsafe extern "C" fn(*mut c_void, *mut c_void)>,
    pub abort: Option<unsafe extern "C" fn(*mut c_void)>,
    pub last_error: Option<unsafe extern "C" fn(*mut c_void, *mut i32) -> *const c_char>,
    pub all_reduce: Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize, i32, i32, f64, i64) -> Status>,
    pub broadcast: Option<unsafe extern "C" fn(*mut c_void, *mut c_void, usize, u32, i64) -> Status>,
    pub barrier: Option<unsafe extern "C" fn(*mut c_void, i64) -> Status>,
    /// ABI 1.1: `PLUGIN_*` bits (zero for older plugins).
    pub flags: u32,
}

// SAFETY: a BackendV1 is an immutable table of a name and function
// pointers; plugins export it as a `const` (Rust SDK: a `static`).
unsafe impl Sync for BackendV1 {}

/// Bytes of `BackendV1` up to and including `last_error`: what a v1 plugin
/// must provide (the collectives after it are optional).
pub const BACKEND_V1_REQUIRED: usize = std::mem::offset_of!(BackendV1, all_reduce);
