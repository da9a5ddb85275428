//! Element types that can cross the wire, and the Rust types behind them.

use half::{bf16, f16};
use std::fmt;

/// The element type of a tensor.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    /// 32-bit float.
    F32 = 0,
    /// 64-bit float.
    F64 = 1,
    /// IEEE half precision.
    F16 = 2,
    /// bfloat16.
    BF16 = 3,
    /// Signed 8-bit integer.
    I8 = 4,
    /// Unsigned 8-bit integer.
    U8 = 5,
    /// Signed 32-bit integer.
    I32 = 6,
    /// Signed 64-bit integer.
    I64 = 7,
    /// Unsigned 32-bit integer.
    U32 = 8,
    /// Unsigned 64-bit integer.
    U64 = 9,
    /// Boolean, one byte, 0 or 1.
    Bool = 10,
}

impl DType {
    /// Every dtype, in code order.
    pub const ALL: [DType; 11] = [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I8,
        DType::U8,
        DType::I32,
        DType::I64,
        DType::U32,
        DType::U64,
        DType::Bool,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }
    /// True for f32, f64, f16 and bf16.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
    }
    /// The short lowercase name (`"f32"`, `"bf16"`, `"bool"`...).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I8 => "i8",
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
        }
    }
    /// The dtype with this numeric code, if any.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.get(code as usize).copied()
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::Error;
    fn from_str(s: &str) -> crate::Result<Self> {
        DType::ALL
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| crate::Error::invalid(format!("unknown dtype {s:?}")))
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that is one of weft's element types.
///
/// Sealed: only the types listed in [`DType`] implement it, which is what
/// lets tensor views reinterpret their memory as bytes soundly (every
/// implementor is plain old data without padding).
pub trait Element: sealed::Sealed + Copy + Send + Sync + 'static {
    /// The dtype tag of this type.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t { const DTYPE: DType = DType::$d; }
    )*};
}
element!(f32 => F32, f64 => F64, f16 => F16, bf16 => BF16, i8 => I8, u8 => U8,
         i32 => I32, i64 => I64, u32 => U32, u64 => U64, bool => Bool);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_rust_types() {
        assert_eq!(DType::BF16.size(), std::mem::size_of::<bf16>());
        assert_eq!(DType::Bool.size(), std::mem::size_of::<bool>());
        for d in DType::ALL {
            assert_eq!(DType::from_code(d as u8), Some(d));
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
        }
    }
}
