//! splitmix64: a tiny deterministic generator for seeded baselines, generated workloads and
//! benchmarks (same seed, same sequence, on every platform; no dependency).

/// The splitmix64 increment and output function: one definition, in `plugin_api::ties`, which
/// policies draw their tie order from.
pub use plugin_api::ties::{mix, GOLDEN_GAMMA};

/// A splitmix64 generator.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        mix(self.0)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Exp(1).
    pub fn exp(&mut self) -> f64 {
        -(1.0 - self.unit()).ln()
    }
}
