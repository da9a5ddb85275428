//! weft: collective communication for Rust programs.
//!
//! A [`ProcessGroup`] gives every op a training or inference job uses
//! (send/recv, broadcast, all_reduce, reduce, all_gather, reduce_scatter,
//! all_to_all, gather, scatter, barrier, split) over backends chosen by name
//! at run time and dispatched by each tensor's device and layout.
//!
//! ```no_run
//! use weft::prelude::*;
//! // A program also calls `weft_builtin::link()` first, so that the built-in
//! // backends are linked and registered.
//! let pg = ProcessGroup::from_env(GroupOptions::from_env()?)?;
//! let mut grads = vec![1.0f32; 1024];
//! pg.all_reduce(&mut grads, ReduceOp::Avg, &OpOptions::default())?.wait()?;
//! # Ok::<(), weft::Error>(())
//! ```
//!
//! Where things live: the API in [`group`](ProcessGroup), backend selection
//! in [`registry`], the generic algorithms in [`algorithms`], the
//! transport interface in [`backend`], rendezvous in [`store`], one-sided
//! windows in [`window`].

#![warn(missing_docs)]

pub mod algorithms;
pub mod auth;
pub mod backend;
mod deadline;
mod dtype;
mod error;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
mod group;
pub mod kernels;
pub mod launch;
pub mod locality;
pub mod log;
pub mod moe;
mod options;
pub mod plugin;
mod reduce_op;
pub mod registry;
pub mod shape;
pub mod store;
pub mod stream;
pub mod tag;
mod tensor;
pub mod window;

pub use dtype::{DType, Element};
pub use error::{Error, ErrorKind, Result};
pub use group::{Collectives, P2pOp, ProcessGroup, Scope, ShrinkOptions, Unscoped, Work};
pub use options::{parse_timeout, timeout_from_env, GroupOptions, OpOptions, DEFAULT_TIMEOUT, ENV_BACKEND, ENV_TIMEOUT};
pub use reduce_op::ReduceOp;
pub use stream::StreamHandle;
pub use tensor::{Device, DeviceKind, Layout, SparseCoo, SparseCooTensor, Tensor, TensorMut};
pub use window::{AccessType, Window, WindowAttr, WindowMemory};

/// Re-exported so backend crates register with the same `inventory`.
pub use inventory;

/// The names most programs need: `use weft::prelude::*;`.
pub mod prelude {
    pub use crate::{Collectives, GroupOptions, OpOptions, P2pOp, ProcessGroup, ReduceOp, Tensor, TensorMut, Work};
}
