//! Where a tensor lives (device kind and ordinal) and how its elements are
//! laid out (dense or sparse COO): the keys that dispatch picks backends by.

use std::fmt;

/// The kind of device memory lives on, without the ordinal.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DeviceKind {
    /// Host memory.
    Cpu,
    /// NVIDIA GPU memory.
    Cuda,
}

impl DeviceKind {
    /// Lowercase name as used in backend specs (`"cpu"`, `"cuda"`).
    pub const fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }
}

/// Where a tensor's memory lives.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// Memory of the CUDA device with this ordinal.
    Cuda(u32),
}

impl Device {
    /// The device kind.
    pub const fn kind(self) -> DeviceKind {
        match self {
            Device::Cpu => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// How a tensor's elements are laid out.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Layout {
    /// Strided dense memory (ops require it contiguous for now).
    Dense,
    /// Sparse COO: indices plus values, see [`SparseCooTensor`](super::SparseCooTensor).
    SparseCoo,
}

impl Layout {
    /// Lowercase name (`"dense"`, `"sparse"`).
    pub const fn name(self) -> &'static str {
        match self {
            Layout::Dense => "dense",
            Layout::SparseCoo => "sparse",
        }
    }
}
