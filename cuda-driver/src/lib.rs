//! The GPU calls weft's CUDA backends make, behind one trait ([`Gpu`]),
//! implemented by the CUDA driver ([`driver`]) and by a host-memory
//! emulation ([`emulated`]) that CPU-only CI runs everything against.
//!
//! [`gpu()`] picks one per process: the emulation when
//! `WEFT_CUDA_EMULATION=N` (N devices) is set, otherwise the CUDA driver if
//! it is present and has a device. Nothing here panics when CUDA is missing:
//! the probe says why it is unavailable.

#![warn(missing_docs)]

mod completion;
pub mod driver;
pub mod emulated;
mod gpu;
mod pinned;
mod tensor;

pub use completion::{order_after, synchronize_event, synchronize_event_checked, synchronize_stream, StreamCompletion};
pub use gpu::{DevicePtr, Event, Gpu, Graph, MAX_REDUCE_ALL};
pub use pinned::PinnedPool;
pub use tensor::{cudarc_views, tensor_from_raw, tensor_mut_from_raw};

use std::sync::{Arc, OnceLock};

/// Environment variable selecting the emulation and its device count.
pub const ENV_EMULATION: &str = "WEFT_CUDA_EMULATION";

type Choice = std::result::Result<Arc<dyn Gpu>, String>;
static GPU: OnceLock<Choice> = OnceLock::new();

/// Use the emulation with `devices` devices in this process (tests call it
/// first thing); `Err` if the process already chose its GPU otherwise.
pub fn emulate(devices: usize) -> std::result::Result<(), String> {
    let chosen = GPU.get_or_init(|| Ok(Arc::new(emulated::EmulatedGpu::new(devices)) as Arc<dyn Gpu>));
    match chosen {
        Ok(g) if g.name() == "emulated" && g.device_count() == devices => Ok(()),
        Ok(g) => Err(format!("this process already uses {} with {} devices", g.name(), g.device_count())),
        Err(why) => Err(why.clone()),
    }
}

/// This process's GPU, or why there is none (shown by `weft info`).
pub fn gpu() -> Choice {
    GPU.get_or_init(|| {
        if let Ok(v) = std::env::var(ENV_EMULATION) {
            return match v.trim().parse::<usize>() {
                Ok(0) => Err(format!("{ENV_EMULATION}=0: no emulated devices")),
                Ok(n) => Ok(Arc::new(emulated::EmulatedGpu::new(n)) as Arc<dyn Gpu>),
                Err(_) => Err(format!("{ENV_EMULATION}={v:?} is not a device count")),
            };
        }
        driver::DriverGpu::open().map(|g| Arc::new(g) as Arc<dyn Gpu>)
    })
    .clone()
}
