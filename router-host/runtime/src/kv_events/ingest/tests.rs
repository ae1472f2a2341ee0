use super::*;
use crate::kv_events::decode::{BlockKeys, EngineEvent, EngineHash, EventBatch};
use router_core::blocks::{BlockHasher, Tenant};

/// The index a row's updates build: per tier, the router ids held.
#[derive(Default)]
struct Recorder {
    events: Vec<Update>,
    held: [std::collections::BTreeSet<u64>; 3],
    clears: usize,
    tier_clears: Vec<Tier>,
}

impl Sink for Recorder {
    fn apply(&mut self, updates: &[Update]) {
        self.events.extend_from_slice(updates);
        for &(kind, tier, id) in updates {
            let set = &mut self.held[tier as usize];
            let changed = match kind {
                KvEventKind::Stored => set.insert(id),
                KvEventKind::Evicted => set.remove(&id),
            };
            assert!(changed, "{kind:?} of {id:#x} on {tier:?} changes nothing");
        }
    }
    fn clear(&mut self) {
        self.clears += 1;
        self.events.clear();
        self.held = Default::default();
    }
    fn clear_tier(&mut self, tier: Tier) {
        self.tier_clears.push(tier);
        self.held[tier as usize].clear();
    }
}

impl Recorder {
    fn on(&self, tier: Tier) -> Vec<u64> {
        self.held[tier as usize].iter().copied().collect()
    }
}

fn batch(events: Vec<EngineEvent>) -> EventBatch {
    EventBatch {
        ts: None,
        events: events.into_iter().map(Ok).collect(),
        dp_rank: None,
    }
}

fn stored(hashes: &[u64], parent: Option<u64>, tokens: Vec<u32>) -> EngineEvent {
    EngineEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().map(|&h| EngineHash::Int(h)).collect(),
        parent_block_hash: parent.map(EngineHash::Int),
        token_ids: tokens,
        block_size: Some(4),
        medium: Some("GPU".into()),
        extra_keys: Vec::new(),
        ..BlockStored::default()
    })
}

#[test]
fn stored_chains_like_prompts_and_removal_goes_through_the_map() {
    let mut row = RowIngest::new(4).expect("block size");
    let mut sink = Recorder::default();
    let mut tally = Tally::default();
    // Two events: the first block, then the second chained from it.
    row.apply(
        batch(vec![
            stored(&[100], None, vec![1, 2, 3, 4]),
            stored(&[200], Some(100), vec![5, 6, 7, 8]),
        ]),
        &mut sink,
        &mut tally,
    );
    let mut prompt = Vec::new();
    BlockHasher::new(4, Tenant::default())
        .expect("hasher")
        .prompt_blocks(&[1, 2, 3, 4, 5, 6, 7, 8, 9], &mut prompt);
    assert_eq!(prompt, vec![0xe17b6664480b6fea, 0x866dbff43edc58d6]);
    let ids: Vec<u64> = sink.events.iter().map(|(_, _, id)| *id).collect();
    assert_eq!(ids, prompt);
    assert_eq!(Tally::count(&tally.applied, "block_stored"), 2);

    row.apply(
        batch(vec![
            EngineEvent::BlockRemoved {
                block_hashes: vec![EngineHash::Int(200), EngineHash::Int(999)],
                medium: None,
                group_idx: None,
            },
            stored(&[300], Some(12345), vec![1, 1, 1, 1]),
            stored(&[400], None, vec![1, 1, 1]),
            EngineEvent::BlockStored(BlockStored {
                block_size: Some(16),
                ..match stored(&[500], None, vec![1; 16]) {
                    EngineEvent::BlockStored(b) => b,
                    _ => unreachable!(),
                }
            }),
            EngineEvent::BlockRemoved {
                block_hashes: vec![EngineHash::Int(100)],
                medium: Some("HBM".into()),
                group_idx: None,
            },
        ]),
        &mut sink,
        &mut tally,
    );
    assert_eq!(
        sink.events.last(),
        Some(&(KvEventKind::Evicted, Tier::Device, prompt[1]))
    );
    assert_eq!(row.len(), 1);
    assert_eq!(Tally::count(&tally.ignored, "unknown_block"), 1);
    assert_eq!(Tally::count(&tally.refused, "unknown_parent"), 1);
    assert_eq!(Tally::count(&tally.refused, "token_count"), 1);
    assert_eq!(Tally::count(&tally.refused, "block_size"), 1);
    assert_eq!(Tally::count(&tally.ignored, "medium"), 1);

    row.apply(
        batch(vec![EngineEvent::AllBlocksCleared { medium: None }]),
        &mut sink,
        &mut tally,
    );
    assert!(row.is_empty());
    assert_eq!(sink.tier_clears, vec![Tier::Device]);
    row.clear(&mut sink);
    assert_eq!(sink.clears, 1);
}

fn on(tier: &str, event: EngineEvent) -> EngineEvent {
    match event {
        EngineEvent::BlockStored(b) => EngineEvent::BlockStored(BlockStored {
            medium: Some(tier.into()),
            ..b
        }),
        other => other,
    }
}

fn removed(hashes: &[u64], medium: &str) -> EngineEvent {
    EngineEvent::BlockRemoved {
        block_hashes: hashes.iter().map(|&h| EngineHash::Int(h)).collect(),
        medium: Some(medium.into()),
        group_idx: None,
    }
}

/// vLLM's offloading connector without self-describing events: a bare hash, no tokens, no
/// parent, block size 0.
fn placeholder(hash: u64, medium: &str) -> EngineEvent {
    EngineEvent::BlockStored(BlockStored {
        block_hashes: vec![EngineHash::Int(hash)],
        block_size: Some(0),
        medium: Some(medium.into()),
        extra_keys: Vec::new(),
        ..BlockStored::default()
    })
}

#[test]
fn offload_tiers_follow_the_device_hashes_and_count_references() {
    let mut row = RowIngest::new(4).expect("block size");
    let (mut sink, mut tally) = (Recorder::default(), Tally::default());
    let mut prompt = Vec::new();
    BlockHasher::new(4, Tenant::default())
        .expect("hasher")
        .prompt_blocks(&[1, 2, 3, 4, 5, 6, 7, 8], &mut prompt);
    row.apply(
        batch(vec![
            stored(&[100], None, vec![1, 2, 3, 4]),
            stored(&[200], Some(100), vec![5, 6, 7, 8]),
            // Offloaded: a bare hash the row knows, one it does not.
            placeholder(100, "CPU"),
            placeholder(777, "CPU"),
            // Self-describing, announced twice (two overlapping chunks), on disk.
            on(
                "STORAGE",
                stored(&[100, 200], None, vec![1, 2, 3, 4, 5, 6, 7, 8]),
            ),
            on("STORAGE", stored(&[200], Some(100), vec![5, 6, 7, 8])),
        ]),
        &mut sink,
        &mut tally,
    );
    assert_eq!(sink.on(Tier::Device), sorted(&prompt));
    assert_eq!(sink.on(Tier::Host), vec![prompt[0]]);
    assert_eq!(sink.on(Tier::Disk), sorted(&prompt));
    assert_eq!(Tally::count(&tally.ignored, "unknown_block"), 1);
    assert_eq!(
        (
            row.blocks_on(Tier::Device),
            row.blocks_on(Tier::Host),
            row.blocks_on(Tier::Disk)
        ),
        (2, 1, 2)
    );

    // The device copy goes; the host still maps the hash, and a later bare store of it
    // on disk still resolves.
    row.apply(
        batch(vec![
            removed(&[100, 200], "GPU"),
            removed(&[200], "STORAGE"),
        ]),
        &mut sink,
        &mut tally,
    );
    assert!(sink.on(Tier::Device).is_empty());
    // 200 was announced twice on disk: one removal keeps it.
    assert_eq!(sink.on(Tier::Disk), sorted(&prompt));
    row.apply(
        batch(vec![removed(&[200], "STORAGE"), placeholder(100, "CPU")]),
        &mut sink,
        &mut tally,
    );
    assert_eq!(sink.on(Tier::Disk), vec![prompt[0]]);
    let seeded: Vec<Update> = {
        let mut s: Vec<Update> = row.holdings().collect();
        s.sort();
        s
    };
    assert_eq!(
        seeded,
        vec![
            (KvEventKind::Stored, Tier::Host, prompt[0]),
            (KvEventKind::Stored, Tier::Disk, prompt[0]),
        ]
    );
    // Two host stores of 100 (the second above) need two removals.
    row.apply(batch(vec![removed(&[100], "CPU")]), &mut sink, &mut tally);
    assert_eq!(sink.on(Tier::Host), vec![prompt[0]]);
    row.apply(
        batch(vec![removed(&[100], "CPU"), removed(&[100], "CPU")]),
        &mut sink,
        &mut tally,
    );
    assert!(sink.on(Tier::Host).is_empty());
    assert_eq!(Tally::count(&tally.ignored, "unknown_block"), 2);
    // AllBlocksCleared is the device's; the disk copy stays. A restart clears all.
    row.apply(
        batch(vec![EngineEvent::AllBlocksCleared { medium: None }]),
        &mut sink,
        &mut tally,
    );
    assert_eq!(sink.on(Tier::Disk), vec![prompt[0]]);
    assert_eq!(row.len(), 1);
    row.clear(&mut sink);
    assert!(row.is_empty() && sink.on(Tier::Disk).is_empty());
    assert!(row.has_seen(Tier::Host) && row.has_seen(Tier::Disk));
}

fn sorted(ids: &[u64]) -> Vec<u64> {
    let mut ids = ids.to_vec();
    ids.sort_unstable();
    ids
}

/// vLLM's untagged keys: the adapter's name on every block, the salt on the first.
#[test]
fn lora_and_salt_keys_root_the_chain_in_their_tenant() {
    let strings = |keys: &[&str]| BlockKeys::Strings(keys.iter().map(|k| k.to_string()).collect());
    let keyed = |hashes: &[u64], parent: Option<u64>, keys: Vec<BlockKeys>, lora: Option<&str>| {
        EngineEvent::BlockStored(BlockStored {
            block_hashes: hashes.iter().map(|&h| EngineHash::Int(h)).collect(),
            parent_block_hash: parent.map(EngineHash::Int),
            token_ids: (1..=4 * hashes.len() as u32).collect(),
            block_size: Some(4),
            lora_name: lora.map(str::to_owned),
            medium: Some("GPU".into()),
            extra_keys: keys,
            ..BlockStored::default()
        })
    };
    let ids = |lora, cache_salt| {
        let mut out = Vec::new();
        BlockHasher::new(4, Tenant { lora, cache_salt })
            .expect("hasher")
            .prompt_blocks(&(1..=8).collect::<Vec<u32>>(), &mut out);
        out
    };
    for (keys, lora, expected) in [
        (
            vec![strings(&["ad"]), strings(&["ad"])],
            Some("ad"),
            ids(Some("ad"), None),
        ),
        (
            vec![strings(&["ad", "s1"]), strings(&["ad"])],
            Some("ad"),
            ids(Some("ad"), Some("s1")),
        ),
        (
            vec![strings(&["s1"]), BlockKeys::None],
            None,
            ids(None, Some("s1")),
        ),
    ] {
        let mut row = RowIngest::new(4).expect("block size");
        let (mut sink, mut tally) = (Recorder::default(), Tally::default());
        row.apply(
            batch(vec![keyed(&[1, 2], None, keys.clone(), lora)]),
            &mut sink,
            &mut tally,
        );
        let got: Vec<u64> = sink.events.iter().map(|(_, _, id)| *id).collect();
        assert_eq!(got, expected, "{keys:?}");
    }
    let mut row = RowIngest::new(4).expect("block size");
    let (mut sink, mut tally) = (Recorder::default(), Tally::default());
    row.apply(
        batch(vec![
            keyed(&[1], None, vec![BlockKeys::None], None),
            // A salt-like key past a prompt's first block, a multimodal key, an adapter's
            // key on an event that names another adapter: none can be followed.
            keyed(&[2], Some(1), vec![strings(&["s1"])], None),
            keyed(&[3], None, vec![BlockKeys::Other], None),
            keyed(&[4], None, vec![strings(&["other"])], Some("ad")),
        ]),
        &mut sink,
        &mut tally,
    );
    assert_eq!(sink.events.len(), 1);
    assert_eq!(Tally::count(&tally.refused, "extra_keys"), 3);
}

#[test]
fn mediums_map_to_tiers() {
    assert_eq!(tier_of(None), Some(Tier::Device));
    assert_eq!(tier_of(Some("gpu")), Some(Tier::Device));
    assert_eq!(tier_of(Some("CPU")), Some(Tier::Host));
    assert_eq!(tier_of(Some("STORAGE")), Some(Tier::Disk));
    assert_eq!(tier_of(Some("NVME")), None);
}

#[test]
fn sequence_numbers() {
    let mut row = RowIngest::new(4).expect("block size");
    assert_eq!(row.check_seq(5), SeqCheck::First);
    assert_eq!(row.check_seq(6), SeqCheck::InOrder);
    assert_eq!(
        row.check_seq(9),
        SeqCheck::Gap {
            expected: 7,
            got: 9
        }
    );
    assert_eq!(row.check_seq(0), SeqCheck::Restart { last: 9, got: 0 });
    assert_eq!(row.check_seq(0), SeqCheck::Restart { last: 0, got: 0 });
}

#[test]
fn a_tier_over_its_limit_is_cleared_and_counted() {
    let mut row = RowIngest::new(4).expect("block size");
    row.set_limit(Tier::Device, capacity_limit(100), "over_capacity");
    assert_eq!(capacity_limit(100), 189);
    let mut sink = Recorder::default();
    let mut tally = Tally::default();
    // 1,000 unchained blocks, 10 per event, never removed: far over 100 blocks.
    for chunk in 0..100u64 {
        let events: Vec<EngineEvent> = (0..10)
            .map(|i| {
                let h = chunk * 10 + i + 1;
                stored(&[h], None, vec![h as u32; 4])
            })
            .collect();
        row.apply(batch(events), &mut sink, &mut tally);
        assert!(
            row.blocks_on(Tier::Device) <= 189,
            "{}",
            row.blocks_on(Tier::Device)
        );
        assert!(sink.held[0].len() <= 189);
        assert!(row.len() <= 189);
    }
    let dropped: u64 = tally.evicted.iter().map(|(_, _, n)| n).sum();
    assert!(tally
        .evicted
        .iter()
        .all(|(t, r, _)| *t == Tier::Device && *r == "over_capacity"));
    assert_eq!(dropped + row.blocks_on(Tier::Device) as u64, 1000);
    assert_eq!(
        Tally::count(&tally.clears, "over_capacity"),
        tally.evicted.len() as u64
    );
    assert!(tally.evicted.len() >= 5);
}
