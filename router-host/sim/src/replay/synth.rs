//! The embedded default workload: deterministic multi-turn chat sessions.
//!
//! - `system_prompts` shared system prompts of `system_prompt_tokens` tokens each; every session
//!   starts from one of them (uniformly at random), so their full blocks are shared across
//!   sessions.
//! - A session has `1 ..= 2*turns - 1` turns (uniform, mean `turns`). Turn k's prompt is the whole
//!   conversation so far (system prompt, earlier user messages and answers) plus a new user message
//!   of `user_tokens * U(0.5, 1.5)` tokens; it generates `output_tokens * U(0.5, 1.5)` tokens.
//! - Block ids are prefix-chained like real prompt hashes: a full block keeps its id in every later
//!   turn of the session; a partial last block is not reusable (its content changes when the
//!   conversation grows), so it gets a new id when it fills up.
//! - Session starts are a Poisson process of rate `rate / turns` sessions per second (so about
//!   `rate` requests per second overall); the gap between a session's turns is
//!   `think_time * (1/2 + E/2)`, E ~ Exp(1) (mean `think_time`, never below half of it).
//! - Everything is drawn from one seeded generator (splitmix64): the same parameters and seed give
//!   the same workload, byte for byte.

use super::trace::{Workload, WorkloadRequest, MAX_TIMESTAMP_MS};
use router_core::rng::SplitMix64;

/// Generator knobs (the `replay` flags of the same names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthParams {
    pub sessions: u32,
    /// Mean turns per session (>= 1).
    pub turns: u32,
    pub system_prompts: u32,
    pub system_prompt_tokens: u64,
    /// Mean new user tokens per turn.
    pub user_tokens: u64,
    /// Mean generated tokens per turn.
    pub output_tokens: u64,
    /// Mean requests per second.
    pub rate: f64,
    /// Mean seconds between a session's turns.
    pub think_time_s: f64,
    pub block_size: u32,
    pub seed: u64,
}

impl Default for SynthParams {
    fn default() -> Self {
        SynthParams {
            sessions: 1000,
            turns: 5,
            system_prompts: 8,
            system_prompt_tokens: 3072,
            user_tokens: 600,
            output_tokens: 300,
            rate: 16.0,
            think_time_s: 10.0,
            block_size: super::trace::DEFAULT_TRACE_BLOCK_SIZE,
            seed: 42,
        }
    }
}

impl SynthParams {
    /// Reject values the generator cannot use, naming the flag.
    pub fn validate(&self) -> Result<(), String> {
        let positive = [
            ("--sessions", u64::from(self.sessions)),
            ("--turns", u64::from(self.turns)),
            ("--system-prompts", u64::from(self.system_prompts)),
            ("--user-tokens", self.user_tokens),
            ("--output-tokens", self.output_tokens),
            ("--trace-block-size", u64::from(self.block_size)),
        ];
        for (flag, value) in positive {
            if value == 0 {
                return Err(format!("{flag} must be at least 1"));
            }
        }
        for (flag, value, max) in [
            ("--sessions", u64::from(self.sessions), 10_000_000),
            ("--turns", u64::from(self.turns), 10_000),
            (
                "--system-prompts",
                u64::from(self.system_prompts),
                1_000_000,
            ),
            (
                "--system-prompt-tokens",
                self.system_prompt_tokens,
                10_000_000,
            ),
            ("--user-tokens", self.user_tokens, 10_000_000),
            ("--output-tokens", self.output_tokens, 10_000_000),
        ] {
            if value > max {
                return Err(format!("{flag} must be at most {max}, got {value}"));
            }
        }
        if !(self.rate.is_finite() && (1e-6..=1e9).contains(&self.rate)) {
            return Err(format!(
                "--rate must be from 1e-6 to 1e9 requests per second, got {}",
                self.rate
            ));
        }
        if !(self.think_time_s.is_finite() && (0.0..=1e6).contains(&self.think_time_s)) {
            return Err(format!(
                "--think-time must be from 0 to 1e6 seconds, got {}",
                self.think_time_s
            ));
        }
        Ok(())
    }

    pub fn describe(&self) -> String {
        format!(
            "synthetic: {} sessions x ~{} turns, {} system prompts of {} tokens, user {} / output {} tokens per turn, {} req/s, think {} s, seed {}",
            self.sessions,
            self.turns,
            self.system_prompts,
            self.system_prompt_tokens,
            self.user_tokens,
            self.output_tokens,
            self.rate,
            self.think_time_s,
            self.seed
        )
    }
}

/// `mean * U(0.5, 1.5)`, at least 1.
fn around(rng: &mut SplitMix64, mean: u64) -> u64 {
    ((mean as f64 * (0.5 + rng.unit())).round() as u64).max(1)
}

/// Generate the workload (see the module docs).
pub fn generate(p: &SynthParams) -> Workload {
    let bs = u64::from(p.block_size.max(1));
    let mut rng = SplitMix64::new(p.seed);
    let mut next_id: u64 = 0;
    let mut fresh = |n: u64, out: &mut Vec<u64>| {
        for _ in 0..n {
            out.push(next_id);
            next_id += 1;
        }
    };
    let system: Vec<Vec<u64>> = (0..p.system_prompts.max(1))
        .map(|_| {
            let mut ids = Vec::new();
            fresh(p.system_prompt_tokens / bs, &mut ids);
            ids
        })
        .collect();
    let session_rate = p.rate / f64::from(p.turns.max(1));
    let mut start_s = 0.0f64;
    let mut requests = Vec::new();
    for s in 0..p.sessions {
        if s > 0 {
            start_s += rng.exp() / session_rate;
        }
        let prompt = rng.below(system.len() as u64) as usize;
        let turns = 1 + rng.below(u64::from(2 * p.turns.max(1) - 1));
        let session_id = format!("session-{s:05}");
        // Full blocks of the conversation so far, and its length in tokens.
        let mut blocks = system[prompt].clone();
        let mut context = p.system_prompt_tokens;
        let mut at_s = start_s;
        for turn in 0..turns {
            if turn > 0 {
                at_s += p.think_time_s * (0.5 + 0.5 * rng.exp());
            }
            let input = context + around(&mut rng, p.user_tokens);
            let output = around(&mut rng, p.output_tokens);
            let mut hash_ids = blocks.clone();
            fresh(input.div_ceil(bs) - hash_ids.len() as u64, &mut hash_ids);
            // After this turn the conversation holds the prompt and the answer; blocks that were
            // full in the prompt keep their ids, the rest are new content.
            blocks.clear();
            blocks.extend_from_slice(&hash_ids[..(input / bs) as usize]);
            context = input + output;
            fresh(context / bs - blocks.len() as u64, &mut blocks);
            requests.push(WorkloadRequest {
                arrival_ns: (at_s * 1000.0).round().min(MAX_TIMESTAMP_MS) as u64 * 1_000_000,
                input_length: input,
                output_length: output,
                hash_ids,
                session_id: Some(session_id.clone()),
            });
        }
    }
    requests.sort_by_key(|r| r.arrival_ns);
    Workload {
        block_size: p.block_size,
        requests,
        source: p.describe(),
        links: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_chained_and_shaped_as_asked() {
        let p = SynthParams {
            sessions: 50,
            block_size: 64,
            ..SynthParams::default()
        };
        let a = generate(&p);
        assert_eq!(a, generate(&p));
        assert_ne!(a, generate(&SynthParams { seed: 7, ..p }));
        let stats = a.stats();
        assert_eq!(stats.sessions, 50);
        assert!(stats.ideal_hit_rate > 0.5, "{stats:?}");
        for r in &a.requests {
            assert_eq!(r.hash_ids.len() as u64, r.input_length.div_ceil(64));
        }
        // Within a session every turn extends the previous prompt's full blocks.
        let mut by_session: std::collections::BTreeMap<&str, Vec<&WorkloadRequest>> =
            Default::default();
        for r in &a.requests {
            by_session
                .entry(r.session_id.as_deref().unwrap())
                .or_default()
                .push(r);
        }
        for turns in by_session.values() {
            for pair in turns.windows(2) {
                let full = (pair[0].input_length / 64) as usize;
                assert_eq!(pair[1].hash_ids[..full], pair[0].hash_ids[..full]);
                assert!(pair[1].arrival_ns > pair[0].arrival_ns);
            }
        }
    }
}
