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
        api_overhead_ms: 0.0,
        cache_generated: true,
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

/// Five conversations at a time over a shared first block: each turn repeats its
/// conversation's last prompt and adds 1 to 3 blocks (the last one often partial); past 7
/// blocks a conversation ends and a new one takes its place.
fn conversations(turns: usize) -> Vec<WorkloadRequest> {
    let mut rng = router_core::rng::SplitMix64::new(7);
    let mut next = move |n: u64| rng.below(n);
    let mut prompts: Vec<Vec<u64>> = vec![vec![0]; 5];
    let mut fresh = 1u64;
    (0..turns)
        .map(|_| {
            let c = next(5) as usize;
            if prompts[c].len() > 7 {
                prompts[c].truncate(1); // a new conversation in that place
            }
            for _ in 0..=next(3) {
                prompts[c].push(fresh);
                fresh += 1;
            }
            let ids = prompts[c].clone();
            let input = ids.len() as u64 * 4 - next(4);
            request(input, 1 + next(3), &ids)
        })
        .collect()
}

#[test]
fn pooled_reference_of_one_engine_is_that_engine_serving_one_request_at_a_time() {
    // Far-apart arrivals: every request runs alone on the engine, which is what the reference
    // assumes. Capacity 12 blocks: conversations evict one another.
    let requests = conversations(80);
    let arrivals: Vec<u64> = (0..requests.len() as u64)
        .map(|i| i * 1_000_000_000)
        .collect();
    let p = params(KvCapacity::Blocks(12));
    let mut engine = Engine::new(0, p, 4);
    let jobs = run(&mut engine, &requests, &arrivals);
    assert!(engine.stats().evicted_blocks > 20, "{:?}", engine.stats());
    let reference = pooled_lru(&requests, 4, 1, &p);
    let engine_ttft: Vec<u64> = jobs
        .iter()
        .map(|j| j.first_token_ns.unwrap() - j.arrival_ns)
        .collect();
    assert_eq!(reference.ttft_ns, engine_ttft);
    let hits: u64 = jobs.iter().map(|j| u64::from(j.hit_blocks)).sum();
    assert!(hits > 0);
    assert_eq!(reference.hit_blocks, hits);
    assert_eq!(reference.capacity_blocks, Some(12));
}

#[test]
fn pooled_reference_pools_the_engines_and_skips_what_no_engine_holds() {
    let mut requests = conversations(80);
    let p = params(KvCapacity::Blocks(6));
    let pooled = pooled_lru(&requests, 4, 3, &p);
    let one_big = pooled_lru(&requests, 4, 1, &params(KvCapacity::Blocks(18)));
    assert_eq!(pooled.capacity_blocks, Some(18));
    // Requests over 6 blocks (prompt + output) are refused by every engine of 6 blocks.
    let fits = |r: &WorkloadRequest| r.hash_ids.len() + r.output_length.div_ceil(4) as usize <= 6;
    assert_eq!(
        pooled.ttft_ns.len(),
        requests.iter().filter(|r| fits(r)).count()
    );
    assert!(pooled.ttft_ns.len() < one_big.ttft_ns.len());
    requests.retain(fits);
    assert_eq!(
        pooled,
        PooledLru {
            capacity_blocks: Some(18),
            ..pooled_lru(&requests, 4, 1, &params(KvCapacity::Blocks(18)))
        }
    );
    // Unlimited: every block seen before is a hit, the workload's ideal.
    let all = conversations(80);
    let unlimited = pooled_lru(&all, 4, 3, &params(KvCapacity::Unlimited));
    let workload = crate::replay::Workload {
        block_size: 4,
        requests: all,
        source: String::new(),
        links: Vec::new(),
    };
    let stats = workload.stats();
    assert_eq!(unlimited.capacity_blocks, None);
    assert_eq!(
        unlimited.hit_blocks as f64 / unlimited.prompt_blocks as f64,
        stats.ideal_hit_rate
    );
}

#[test]
fn blocks_completed_by_generated_tokens_are_hit_by_the_next_turn() {
    // Block size 4. Turn 1: 6 prompt tokens (blocks 1 and a partial 2), 7 generated: 12 tokens
    // computed, so the reply completes blocks 10 and 11 (the prompt's tail and the reply's
    // first tokens, then more reply). Turn 2 repeats prompt and reply and adds block 12.
    let turn1 = request(6, 7, &[1, 2]);
    let turn2 = request(14, 1, &[1, 10, 11, 12]);
    for (cache_generated, hits) in [(true, 3), (false, 1)] {
        let p = EngineParams {
            cache_generated,
            ..params(KvCapacity::Blocks(8))
        };
        let requests = vec![turn1.clone(), turn2.clone()];
        let mut jobs: Vec<Job> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| Job::new(i as u32, r, 4, 0, 0))
            .collect();
        jobs[0] = jobs[0].clone().with_output_hash_ids(&[10, 11]);
        let mut engine = Engine::new(0, p, 4);
        let mut out = Outbox::default();
        engine
            .enqueue(0, 0, &mut jobs, &requests, &mut out)
            .unwrap();
        while let Some(w) = engine.wake() {
            engine.on_wake(w, &mut jobs, &requests, &mut out);
        }
        assert!(jobs[0].finish_ns.is_some());
        let stored: Vec<u64> = out
            .events
            .iter()
            .filter(|e| e.kind == KvEventKind::Stored)
            .map(|e| e.block)
            .collect();
        let expected: &[u64] = if cache_generated {
            &[1, 2, 10, 11]
        } else {
            &[1, 2]
        };
        assert_eq!(stored, expected, "cache_generated {cache_generated}");
        // The generated blocks took over the output's reserved block (7 tokens: 2 of 4), so
        // nothing stays in use once the request is done.
        assert_eq!(engine.kv_blocks_in_use(), 0);
        let now = 1_000_000_000;
        engine
            .enqueue(1, now, &mut jobs, &requests, &mut out)
            .unwrap();
        assert_eq!(
            jobs[1].hit_blocks, hits,
            "cache_generated {cache_generated}"
        );
    }
}
