//! Unit tests of the engine's step loop: prefill chunks, decode jumps, prefix reuse, eviction.

use super::*;

fn params(kv: KvCapacity) -> EngineParams {
    EngineParams {
        kv_blocks: kv,
        max_num_batched_tokens: 8,
        max_num_seqs: 4,
        step_overhead_ms: 1.0,
        decode_ms_per_seq: 0.5,
        prefill_ms_per_token: 0.25,
    }
}

fn request(input: u64, output: u64, ids: &[u64]) -> WorkloadRequest {
    WorkloadRequest {
        arrival_ns: 0,
        input_length: input,
        output_length: output,
        hash_ids: ids.to_vec(),
        session_id: None,
    }
}

/// Run the engine alone until idle; returns the jobs.
fn run(engine: &mut Engine, requests: &[WorkloadRequest], arrivals: &[u64]) -> Vec<Job> {
    let mut jobs: Vec<Job> = requests
        .iter()
        .enumerate()
        .map(|(i, r)| Job::new(i as u32, r, 4, arrivals[i], arrivals[i]))
        .collect();
    let mut out = Outbox::default();
    let mut next = 0;
    loop {
        let wake = engine.wake();
        let arrival = arrivals.get(next).copied();
        let engine_first = match (wake, arrival) {
            (None, None) => break,
            (Some(w), Some(a)) => w <= a,
            (Some(_), None) => true,
            (None, Some(_)) => false,
        };
        if engine_first {
            let w = engine.wake().unwrap();
            engine.on_wake(w, &mut jobs, requests, &mut out);
        } else {
            let a = arrivals[next];
            engine
                .enqueue(next as u32, a, &mut jobs, requests, &mut out)
                .unwrap();
            next += 1;
        }
    }
    jobs
}

#[test]
fn prefill_chunks_decode_and_prefix_reuse() {
    // Block size 4, budget 8 tokens/step. Request 0: 10 tokens (3 blocks), 3 output tokens.
    let requests = vec![request(10, 3, &[1, 2, 3]), request(10, 1, &[1, 2, 3])];
    let mut engine = Engine::new(0, params(KvCapacity::Unlimited), 4);
    let jobs = run(&mut engine, &requests, &[0, 100_000_000]);
    // Step 1: 8 prefill tokens (1 + 2 ms = 3 ms); step 2: 2 tokens (1.5 ms) -> first token
    // at 4.5 ms; two decode steps of 1.5 ms -> done at 7.5 ms.
    assert_eq!(jobs[0].first_token_ns, Some(4_500_000));
    assert_eq!(jobs[0].finish_ns, Some(7_500_000));
    assert_eq!(jobs[0].hit_blocks, 0);
    // Request 1 finds all 3 blocks and computes only its last token: 1.25 ms.
    assert_eq!(jobs[1].hit_blocks, 3);
    assert_eq!(jobs[1].first_token_ns, Some(101_250_000));
    assert_eq!(jobs[1].finish_ns, jobs[1].first_token_ns);
    assert_eq!(engine.stats().prefill_tokens, 11);
}

#[test]
fn lru_evicts_unreferenced_tail_blocks_first_and_emits_events() {
    // Capacity 4 blocks: request 0 holds 2 prompt + 1 output block.
    let requests = vec![
        request(8, 1, &[1, 2]),
        request(8, 1, &[3, 4]),
        request(8, 1, &[1, 5]),
    ];
    let mut engine = Engine::new(0, params(KvCapacity::Blocks(4)), 4);
    let jobs = run(&mut engine, &requests, &[0, 50_000_000, 100_000_000]);
    // Request 1 needs 3 blocks with 2 free: evicts block 2 (tail of request 0) first.
    assert!(engine.holds(1));
    assert!(!engine.holds(2));
    assert_eq!(jobs[2].hit_blocks, 1);
    assert!(engine.stats().evicted_blocks >= 1);
}

#[test]
fn arrival_cuts_a_decode_jump_at_the_step_in_progress() {
    // Request 0 decodes 100 tokens alone (1.5 ms steps from 4.5 ms); request 1 arrives at
    // 10 ms, inside the fourth step of the stretch, and joins when it ends at 10.5 ms.
    let requests = vec![request(10, 101, &[1, 2, 3]), request(4, 1, &[9])];
    let mut engine = Engine::new(0, params(KvCapacity::Unlimited), 4);
    let jobs = run(&mut engine, &requests, &[0, 10_000_000]);
    assert_eq!(jobs[1].admitted_ns, Some(10_500_000));
    // The joined step: overhead 1 + 1 decoder 0.5 + 4 tokens 1.0 = 2.5 ms.
    assert_eq!(jobs[1].first_token_ns, Some(13_000_000));
    // Request 0: 100 decode steps, one of them 2.5 ms instead of 1.5 ms.
    assert_eq!(
        jobs[0].finish_ns,
        Some(4_500_000 + 100 * 1_500_000 + 1_000_000)
    );
}
