use super::*;

fn stored(row: u32, block: u64) -> KvEvent {
    KvEvent::on_device(row, KvEventKind::Stored, block)
}

fn event(row: u32, kind: KvEventKind, block: u64, tier: Tier) -> KvEvent {
    KvEvent {
        row,
        kind,
        block,
        tier,
    }
}

#[test]
fn leading_runs_per_row_across_word_boundaries() {
    for rows in [3usize, 64, 70, 130] {
        let mut index = KvIndex::new(rows);
        let last = rows as u32 - 1;
        for b in [1, 2, 3] {
            index.apply(&stored(0, b));
            index.apply(&stored(last, b));
        }
        index.apply(&stored(1, 1));
        index.apply(&stored(1, 3)); // not leading: 2 missing
        let (mut out, mut alive) = (Vec::new(), Vec::new());
        index.overlaps(&[1, 2, 3, 4], &mut out, &mut alive);
        assert_eq!(out.len(), rows);
        assert_eq!(
            (out[0], out[1], out[last as usize]),
            (3, 1, 3),
            "rows {rows}"
        );
        if rows > 3 {
            assert_eq!(out[2], 0);
        }
        index.apply(&event(0, KvEventKind::Evicted, 2, Tier::Device));
        index.overlaps(&[1, 2, 3, 4], &mut out, &mut alive);
        assert_eq!((out[0], out[last as usize]), (1, 3));
        assert!(!index.holds(0, 2) && index.holds(last, 2));
    }
}

/// The walk (hints, their fallbacks, slot reuse, every word count) against the definition:
/// per row, the number of leading blocks it holds.
#[test]
fn overlaps_match_a_naive_reference_under_random_events() {
    use std::collections::HashSet;
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for rows in [1usize, 5, 64, 70, 128, 130] {
        let mut index = KvIndex::new(rows);
        let mut held: Vec<HashSet<u64>> = vec![HashSet::new(); rows];
        // Prompts over a small block alphabet: shared prefixes, repeats, reuse of freed slots.
        let prompts: Vec<Vec<u64>> = (0..24)
            .map(|p| {
                let mut blocks: Vec<u64> = (0..next(4)).map(|i| 1000 + i).collect();
                blocks.extend((0..2 + next(10)).map(|_| next(60)));
                if p % 5 == 0 {
                    blocks.push(blocks[0]);
                }
                blocks
            })
            .collect();
        let (mut out, mut alive) = (Vec::new(), Vec::new());
        for step in 0..3_000 {
            let row = next(rows as u64) as u32;
            let prompt = &prompts[next(prompts.len() as u64) as usize];
            match next(3) {
                // Store a leading run in order, as an engine does (skipping held blocks).
                0 | 1 => {
                    for &block in &prompt[..=next(prompt.len() as u64) as usize] {
                        if held[row as usize].insert(block) {
                            index.apply(&stored(row, block));
                        }
                    }
                }
                // Evict some blocks of the prompt.
                _ => {
                    for &block in prompt.iter().filter(|_| next(2) == 0) {
                        if held[row as usize].remove(&block) {
                            index.apply(&event(row, KvEventKind::Evicted, block, Tier::Device));
                        }
                    }
                }
            }
            let query = &prompts[next(prompts.len() as u64) as usize];
            index.overlaps(query, &mut out, &mut alive);
            for (r, set) in held.iter().enumerate() {
                let expected = query.iter().take_while(|b| set.contains(b)).count();
                assert_eq!(
                    out[r] as usize, expected,
                    "rows {rows}, step {step}, row {r}"
                );
            }
        }
        let pairs: usize = held.iter().map(HashSet::len).sum();
        assert_eq!(index.holdings(), pairs as u64);
    }
}

#[test]
fn evicting_the_last_holder_frees_the_block() {
    let mut index = KvIndex::new(2);
    index.apply(&stored(0, 9));
    index.apply(&stored(1, 9));
    for row in [0, 1] {
        index.apply(&event(row, KvEventKind::Evicted, 9, Tier::Device));
    }
    assert!(index.is_empty());
    index.apply(&stored(1, 10));
    assert_eq!(index.len(), 1);
    assert!(index.holds(1, 10));
}

/// The per-tier runs against the definition, under random stores and evictions on every
/// tier, with rows added past a word boundary midway and rows or single tiers cleared.
#[test]
fn overlaps_by_tier_match_a_naive_reference() {
    use std::collections::HashSet;
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for (rows, grown) in [(1usize, 3usize), (5, 70), (64, 130), (70, 70)] {
        let mut index = KvIndex::new(rows);
        let mut rows = rows;
        // held[row][tier]
        let mut held: Vec<[HashSet<u64>; 3]> = vec![Default::default(); grown];
        let prompts: Vec<Vec<u64>> = (0..16)
            .map(|_| (0..3 + next(8)).map(|i| i * 7 + next(3)).collect())
            .collect();
        let (mut device, mut host, mut disk, mut alive) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for step in 0..2_000 {
            if step == 1_000 {
                index.ensure_rows(grown);
                rows = grown;
            }
            let row = next(rows as u64) as u32;
            let tier = Tier::ALL[next(3) as usize];
            let t = tier as usize;
            let prompt = &prompts[next(prompts.len() as u64) as usize];
            match next(7) {
                0..=3 => {
                    for &block in &prompt[..=next(prompt.len() as u64) as usize] {
                        if held[row as usize][t].insert(block) {
                            index.apply(&event(row, KvEventKind::Stored, block, tier));
                        }
                    }
                }
                4 | 5 => {
                    for &block in prompt.iter().filter(|_| next(2) == 0) {
                        if held[row as usize][t].remove(&block) {
                            index.apply(&event(row, KvEventKind::Evicted, block, tier));
                        }
                    }
                }
                _ if next(4) == 0 => {
                    let n: usize = held[row as usize].iter().map(HashSet::len).sum();
                    assert_eq!(index.clear_row(row), n as u64);
                    held[row as usize].iter_mut().for_each(HashSet::clear);
                }
                _ => {
                    let n = held[row as usize][t].len() as u64;
                    assert_eq!(index.clear_row_tier(row, tier), n, "step {step}");
                    held[row as usize][t].clear();
                }
            }
            let query = &prompts[next(prompts.len() as u64) as usize];
            index.overlaps_by_tier(query, &mut device, &mut host, &mut disk, &mut alive);
            for (r, sets) in held.iter().enumerate().take(rows) {
                let on = |tiers: &[usize], b: &u64| tiers.iter().any(|&t| sets[t].contains(b));
                let run = |tiers: &[usize]| query.iter().take_while(|b| on(tiers, b)).count();
                let (d, dh, all) = (run(&[0]), run(&[0, 1]), run(&[0, 1, 2]));
                let got = |v: &Vec<u32>| v.get(r).copied().unwrap_or(0) as usize;
                assert_eq!(
                    (got(&device), got(&host), got(&disk)),
                    (d, dh - d, all - dh),
                    "rows {rows}, step {step}, row {r}"
                );
                for (t, tier) in Tier::ALL.into_iter().enumerate() {
                    assert_eq!(
                        index.held_by(r as u32, tier),
                        sets[t].len() as u64,
                        "step {step}"
                    );
                    // The f64 column a decision copies follows every store, eviction, clear
                    // and growth too.
                    assert_eq!(
                        index.held_columns()[t].get(r).copied(),
                        Some(sets[t].len() as f64),
                        "step {step}, row {r}, {tier:?}"
                    );
                }
                for (t, tier) in Tier::ALL.into_iter().enumerate().filter(|_| step % 16 == 0) {
                    for b in query {
                        assert_eq!(index.holds_in(r as u32, *b, tier), sets[t].contains(b));
                    }
                }
            }
        }
        assert!(index.held_columns().iter().all(|c| c.len() == grown));
        for (t, tier) in Tier::ALL.into_iter().enumerate() {
            let pairs: usize = held.iter().map(|sets| sets[t].len()).sum();
            assert_eq!(index.holdings_in(tier), pairs as u64, "{tier:?}");
        }
        let distinct: HashSet<u64> = held.iter().flatten().flatten().copied().collect();
        assert_eq!(index.len(), distinct.len());
    }
}

#[test]
fn a_device_only_index_has_no_offload_columns() {
    let mut index = KvIndex::new(2);
    index.apply(&stored(0, 1));
    // An eviction from a tier never stored changes nothing and allocates nothing.
    index.apply(&event(0, KvEventKind::Evicted, 1, Tier::Host));
    assert!(!index.has_offload_tiers());
    let (mut device, mut host, mut disk, mut alive) = (vec![9], vec![9], vec![9], Vec::new());
    index.overlaps_by_tier(&[1, 2], &mut device, &mut host, &mut disk, &mut alive);
    assert_eq!((device, host, disk), (vec![1, 0], vec![], vec![]));
    // A block kept only on the host keeps its slot after the device copy goes.
    index.apply(&event(1, KvEventKind::Stored, 1, Tier::Host));
    index.apply(&event(0, KvEventKind::Evicted, 1, Tier::Device));
    assert_eq!(index.len(), 1);
    assert!(index.holds_in(1, 1, Tier::Host) && !index.holds(0, 1));
    index.apply(&event(1, KvEventKind::Evicted, 1, Tier::Host));
    assert!(index.is_empty());
}

/// The holder sets against a plain model, in the sparse layout (past 256 rows) and across the
/// switch to it: random stores, evictions and clears over a few blocks held by many rows, so
/// that sets spill to bitsets and return inline, on every tier, with rows added midway.
#[test]
fn holder_sets_match_a_model_across_the_spill_threshold() {
    use std::collections::HashSet;
    let mut x = 0x853c_49e6_748f_ea9bu64;
    let mut next = move |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    for (rows, grown) in [(40usize, 300usize), (300, 300), (1_000, 1_100)] {
        let mut index = KvIndex::new(rows);
        let mut rows = rows;
        let mut held: Vec<[HashSet<u64>; 3]> = vec![Default::default(); grown];
        let (mut device, mut host, mut disk, mut alive) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut out = Vec::new();
        let mut peak_spilled = 0;
        for step in 0..6_000u64 {
            if step == 3_000 {
                index.ensure_rows(grown);
                rows = grown;
            }
            // Phases of mostly stores then mostly evictions, so that holder counts climb past
            // the inline capacity and fall back below it.
            let storing = (step / 500) % 2 == 0;
            // Rows drawn from a few at a time, so that a block gathers holders.
            let row = (next(12) * 7 + next(3) * (rows as u64 / 3)) as u32 % rows as u32;
            let tier = if next(4) == 0 {
                Tier::ALL[1 + next(2) as usize]
            } else {
                Tier::Device
            };
            let t = tier as usize;
            let block = next(12);
            match next(40) {
                0 => {
                    let n: usize = held[row as usize].iter().map(HashSet::len).sum();
                    assert_eq!(index.clear_row(row), n as u64, "step {step}");
                    held[row as usize].iter_mut().for_each(HashSet::clear);
                }
                1 => {
                    let n = held[row as usize][t].len() as u64;
                    assert_eq!(index.clear_row_tier(row, tier), n, "step {step}");
                    held[row as usize][t].clear();
                }
                k if (k % 4 != 0) == storing => {
                    if held[row as usize][t].insert(block) {
                        index.apply(&event(row, KvEventKind::Stored, block, tier));
                    }
                }
                _ => {
                    if held[row as usize][t].remove(&block) {
                        index.apply(&event(row, KvEventKind::Evicted, block, tier));
                    }
                }
            }
            peak_spilled = peak_spilled.max(index.device.spill_sets());
            if step % 7 != 0 {
                continue;
            }
            for tier in Tier::ALL.into_iter().filter(|_| step % 98 == 0) {
                let t = tier as usize;
                for block in 0..12 {
                    for (r, sets) in held.iter().enumerate().take(rows) {
                        assert_eq!(
                            index.holds_in(r as u32, block, tier),
                            sets[t].contains(&block),
                            "rows {rows}, step {step}, row {r}, block {block}, {tier:?}"
                        );
                    }
                }
                let pairs: usize = held.iter().map(|sets| sets[t].len()).sum();
                assert_eq!(index.holdings_in(tier), pairs as u64, "step {step}");
            }
            let query: Vec<u64> = (0..1 + next(6)).map(|_| next(12)).collect();
            index.overlaps(&query, &mut out, &mut alive);
            index.overlaps_by_tier(&query, &mut device, &mut host, &mut disk, &mut alive);
            for (r, sets) in held.iter().enumerate().take(rows) {
                let on = |tiers: &[usize], b: &u64| tiers.iter().any(|&t| sets[t].contains(b));
                let run = |tiers: &[usize]| query.iter().take_while(|b| on(tiers, b)).count();
                let (d, dh, all) = (run(&[0]), run(&[0, 1]), run(&[0, 1, 2]));
                assert_eq!(out[r] as usize, d, "rows {rows}, step {step}, row {r}");
                let got = |v: &Vec<u32>| v.get(r).copied().unwrap_or(0) as usize;
                assert_eq!(
                    (got(&device), got(&host), got(&disk)),
                    (d, dh - d, all - dh),
                    "rows {rows}, step {step}, row {r}"
                );
                for tier in Tier::ALL {
                    let n = sets[tier as usize].len() as u64;
                    assert_eq!(index.held_by(r as u32, tier), n);
                }
            }
            let distinct: HashSet<u64> = held.iter().flatten().flatten().copied().collect();
            assert_eq!(index.len(), distinct.len(), "step {step}");
        }
        if rows > 64 * super::holders::DENSE_MAX_WORDS {
            assert!(
                peak_spilled > 0,
                "rows {rows}: some block was held by more than {} rows",
                super::holders::SMALL
            );
        }
        // Everything evicted: no block, no spilled set and no slot-list entry is left.
        for (r, sets) in held.iter().enumerate() {
            for (t, tier) in Tier::ALL.into_iter().enumerate() {
                for &block in &sets[t] {
                    index.apply(&event(r as u32, KvEventKind::Evicted, block, tier));
                }
            }
        }
        assert!(index.is_empty());
        assert_eq!(index.device.spill_sets(), 0);
        for r in 0..rows as u32 {
            assert_eq!(index.clear_row(r), 0);
            assert!(index.row_slots[r as usize].is_empty());
        }
    }
}

/// Clearing one row (an engine restart) leaves every other row's holdings as they were, on
/// blocks held by few rows (inline) and by many (spilled), and touches only that row's slots.
#[test]
fn clearing_a_row_leaves_other_rows_intact() {
    for rows in [128usize, 4_096] {
        let mut index = KvIndex::new(rows);
        // Block 0 held by every 100th row (spilled at 4,096 rows), blocks 1..=3 by rows 0 to 2,
        // block 10 + r by row r alone.
        let many: Vec<u32> = (0..rows as u32).step_by(100).collect();
        for &r in &many {
            index.apply(&stored(r, 0));
        }
        for r in 0..3 {
            for b in 1..=3 {
                index.apply(&stored(r, b));
            }
            index.apply(&stored(r, 10 + u64::from(r)));
            index.apply(&event(r, KvEventKind::Stored, 20, Tier::Host));
        }
        let blocks = index.len();
        assert_eq!(index.clear_row(0), 6);
        assert!((0..=3).chain([10, 20]).all(|b| !index.holds(0, b)));
        assert!(!index.holds_in(0, 20, Tier::Host));
        for &r in &many[1..] {
            assert!(
                index.holds(r, 0),
                "rows {rows}: row {r} still holds block 0"
            );
        }
        for r in 1..3 {
            assert!((1..=3).all(|b| index.holds(r, b)));
            assert!(index.holds(r, 10 + u64::from(r)) && index.holds_in(r, 20, Tier::Host));
            assert_eq!(index.held_by_tier(r), [4, 1, 0]);
        }
        assert_eq!(index.len(), blocks - 1, "only block 10 went with row 0");
        let (mut out, mut alive) = (Vec::new(), Vec::new());
        index.overlaps(&[0, 1, 2, 3], &mut out, &mut alive);
        assert_eq!((out[0], out[1], out[2], out[100]), (0, 0, 0, 1));
        index.overlaps(&[1, 2, 3, 11], &mut out, &mut alive);
        assert_eq!((out[0], out[1], out[2]), (0, 4, 3));
        // The cleared row's list is empty; the others keep theirs.
        assert!(index.row_slots[0].is_empty());
        assert_eq!(index.row_slots[1].len(), 5);
    }
}

/// A row's slot list stays bounded however often it stores and evicts the same blocks.
#[test]
fn a_rows_slot_list_stays_bounded_under_churn() {
    let mut index = KvIndex::new(1_000);
    for round in 0..10_000u64 {
        let block = round % 5;
        index.apply(&stored(7, block));
        index.apply(&event(7, KvEventKind::Evicted, block, Tier::Device));
        index.apply(&stored(7, 100 + round % 3));
    }
    let held = index.held_by(7, Tier::Device) as usize;
    assert_eq!(held, 3);
    assert!(
        index.row_slots[7].len() < 2 * held + 32,
        "{} entries for {held} blocks",
        index.row_slots[7].len()
    );
    assert_eq!(index.clear_row(7), 3);
    assert!(index.is_empty());
}
