//! Reduction operators and the rule for which dtypes each applies to.

use crate::dtype::DType;
use crate::error::{Error, Result};
use std::fmt;

/// A reduction operator.
///
/// Which dtypes each op accepts (anything else is `InvalidArgument`):
/// - `Sum`, `Product`, `Min`, `Max`: every dtype. Integers wrap on overflow;
///   for `bool`, `Sum`/`Max` are logical OR and `Product`/`Min` logical AND.
///   Float `Min`/`Max` propagate NaN.
/// - `Avg`, `PremulSum`: floating-point dtypes only. `Avg` is an exact `Sum`
///   followed by one division by the group size; `PremulSum(f)` multiplies
///   each rank's contribution by `f` before summing.
/// - `Band`, `Bor`, `Bxor`: integer dtypes and `bool` only.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Product.
    Product,
    /// Minimum.
    Min,
    /// Maximum.
    Max,
    /// Mean over ranks (floats only).
    Avg,
    /// Bitwise and (integers, bool).
    Band,
    /// Bitwise or (integers, bool).
    Bor,
    /// Bitwise xor (integers, bool).
    Bxor,
    /// Sum of each contribution multiplied by the factor (floats only).
    PremulSum(f64),
}

impl ReduceOp {
    /// Every op (PremulSum with factor 1.0 as its representative).
    pub const ALL: [ReduceOp; 9] = [
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::Band,
        ReduceOp::Bor,
        ReduceOp::Bxor,
        ReduceOp::PremulSum(1.0),
    ];

    /// Lowercase name.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::Band => "band",
            ReduceOp::Bor => "bor",
            ReduceOp::Bxor => "bxor",
            ReduceOp::PremulSum(_) => "premul_sum",
        }
    }

    /// A small numeric code (used in debug fingerprints and ABIs).
    pub const fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Product => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
            ReduceOp::Avg => 4,
            ReduceOp::Band => 5,
            ReduceOp::Bor => 6,
            ReduceOp::Bxor => 7,
            ReduceOp::PremulSum(_) => 8,
        }
    }

    /// Whether this op applies to `dtype`.
    pub fn supports(self, dtype: DType) -> bool {
        match self {
            ReduceOp::Sum | ReduceOp::Product | ReduceOp::Min | ReduceOp::Max => true,
            ReduceOp::Avg | ReduceOp::PremulSum(_) => dtype.is_float(),
            ReduceOp::Band | ReduceOp::Bor | ReduceOp::Bxor => !dtype.is_float(),
        }
    }

    /// `Ok` if this op applies to `dtype`, else an `InvalidArgument` stating the rule.
    pub fn check(self, dtype: DType) -> Result<()> {
        if self.supports(dtype) {
            return Ok(());
        }
        let rule = match self {
            ReduceOp::Avg | ReduceOp::PremulSum(_) => "applies to floating-point dtypes only",
            _ => "is bitwise and applies to integer and bool dtypes only",
        };
        Err(Error::invalid(format!("reduce op {} {rule}, got {dtype}", self.name())))
    }

    /// The elementwise combiner used during the reduction: `Avg` and
    /// `PremulSum` reduce with `Sum` (scaling happens before or after).
    pub fn combiner(self) -> ReduceOp {
        match self {
            ReduceOp::Avg | ReduceOp::PremulSum(_) => ReduceOp::Sum,
            op => op,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::PremulSum(x) => write!(f, "premul_sum({x})"),
            op => f.write_str(op.name()),
        }
    }
}

impl std::str::FromStr for ReduceOp {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let s = s.to_ascii_lowercase();
        if let Some(rest) = s.strip_prefix("premul_sum") {
            let f = rest.trim_matches(|c| c == '(' || c == ')' || c == ':' || c == '=');
            let factor = if f.is_empty() { 1.0 } else { f.parse().map_err(|_| Error::invalid(format!("bad premul_sum factor {f:?}")))? };
            return Ok(ReduceOp::PremulSum(factor));
        }
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == s || (s == "prod" && *o == ReduceOp::Product))
            .ok_or_else(|| Error::invalid(format!("unknown reduce op {s:?}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_rules() {
        assert!(ReduceOp::Avg.check(DType::I32).is_err());
        assert!(ReduceOp::Band.check(DType::F32).is_err());
        assert!(ReduceOp::Bxor.check(DType::Bool).is_ok());
        assert!(ReduceOp::PremulSum(2.0).check(DType::BF16).is_ok());
        let msg = ReduceOp::Bor.check(DType::F16).unwrap_err().to_string();
        assert!(msg.contains("bor") && msg.contains("f16"), "{msg}");
        assert_eq!("premul_sum(0.5)".parse::<ReduceOp>().unwrap(), ReduceOp::PremulSum(0.5));
        assert_eq!("prod".parse::<ReduceOp>().unwrap(), ReduceOp::Product);
    }
}
