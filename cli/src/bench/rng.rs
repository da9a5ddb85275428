//! A small deterministic generator for the benchmarks' workloads
//! (xorshift64*; no dependency needed).

/// xorshift64*; seed it with any nonzero value.
pub struct Rng(pub u64);

impl Rng {
    /// A uniform float in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545F4914F6CDD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// A standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        (-2.0 * self.uniform().ln()).sqrt() * (std::f64::consts::TAU * self.uniform()).cos()
    }
}
