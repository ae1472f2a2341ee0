use super::*;
use rmpv::Value;

fn encode(value: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, value).expect("encode");
    out
}

fn s(v: &str) -> Value {
    Value::from(v)
}

fn stored_map(hashes: Vec<Value>, parent: Value, tokens: &[u32], extra: Value) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(hashes)),
        (s("parent_block_hash"), parent),
        (
            s("token_ids"),
            Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        ),
        (s("block_size"), Value::from(4)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), Value::Nil),
        (s("extra_keys"), extra),
        (s("group_idx"), Value::from(0)),
        (s("kv_cache_spec_kind"), s("full_attention")),
        (s("a_field_from_the_future"), Value::from(7)),
    ])
}

fn payload(events: Vec<Value>) -> Vec<u8> {
    encode(&Value::Array(vec![
        Value::F64(1.5),
        Value::Array(events),
        Value::from(0),
    ]))
}

#[test]
fn map_form_with_a_u64_hash_over_i64_max_and_unknown_fields() {
    let big = u64::MAX - 5;
    let bytes = payload(vec![stored_map(
        vec![Value::from(big)],
        Value::from(16798410040177476104u64),
        &[1, 2, 3, 4],
        Value::Array(vec![Value::Nil]),
    )]);
    let batch = decode_payload(&bytes).expect("decodes");
    assert_eq!(batch.ts, Some(1.5));
    assert_eq!(batch.dp_rank, Some(0));
    let Ok(EngineEvent::BlockStored(b)) = &batch.events[0] else {
        panic!("not a BlockStored: {:?}", batch.events)
    };
    assert_eq!(b.block_hashes, vec![EngineHash::Int(big)]);
    assert_eq!(
        b.parent_block_hash,
        Some(EngineHash::Int(16798410040177476104))
    );
    assert_eq!(b.token_ids, vec![1, 2, 3, 4]);
    assert_eq!(b.block_size, Some(4));
    assert_eq!(b.medium.as_deref(), Some("GPU"));
    assert!(b.plain_keys());
    assert_eq!(b.group_idx, Some(0));
}

#[test]
fn legacy_array_forms() {
    let stored = Value::Array(vec![
        s("BlockStored"),
        Value::Array(vec![Value::Binary(vec![7; 32])]),
        Value::Nil,
        Value::Array((1..=4).map(Value::from).collect()),
        Value::from(4),
        Value::Nil,
        s("GPU"),
    ]);
    let removed = Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(vec![Value::from(9)]),
        s("CPU"),
    ]);
    let cleared = Value::Array(vec![s("AllBlocksCleared")]);
    let batch = decode_payload(&payload(vec![stored, removed, cleared])).expect("decodes");
    assert_eq!(
        batch.events[0],
        Ok(EngineEvent::BlockStored(BlockStored {
            block_hashes: vec![EngineHash::Bytes([7; 32])],
            parent_block_hash: None,
            token_ids: vec![1, 2, 3, 4],
            block_size: Some(4),
            lora_name: None,
            medium: Some("GPU".into()),
            extra_keys: Vec::new(),
            group_idx: None,
        }))
    );
    assert_eq!(
        batch.events[1],
        Ok(EngineEvent::BlockRemoved {
            block_hashes: vec![EngineHash::Int(9)],
            medium: Some("CPU".into()),
            group_idx: None,
        })
    );
    assert_eq!(
        batch.events[2],
        Ok(EngineEvent::AllBlocksCleared { medium: None })
    );
    // A payload without the dp rank.
    let two = encode(&Value::Array(vec![Value::F64(0.0), Value::Array(vec![])]));
    assert_eq!(decode_payload(&two).expect("decodes").dp_rank, None);
    // The batch as a map.
    let map = encode(&Value::Map(vec![
        (s("ts"), Value::F64(2.0)),
        (
            s("events"),
            Value::Array(vec![Value::Array(vec![s("AllBlocksCleared")])]),
        ),
        (s("data_parallel_rank"), Value::from(3)),
    ]));
    let batch = decode_payload(&map).expect("decodes");
    assert_eq!(
        (batch.ts, batch.dp_rank, batch.events.len()),
        (Some(2.0), Some(3), 1)
    );
}

#[test]
fn bad_input_is_an_error_never_a_panic() {
    assert!(matches!(
        decode_payload(&[0x92]),
        Err(DecodeError::Msgpack(_))
    ));
    let full = payload(vec![stored_map(
        vec![Value::from(1)],
        Value::Nil,
        &[1, 2, 3, 4],
        Value::Nil,
    )]);
    for cut in 0..full.len() {
        let _ = decode_payload(&full[..cut]);
    }
    assert_eq!(
        decode_payload(&encode(&Value::from(3))),
        Err(DecodeError::PayloadShape)
    );
    let batch = decode_payload(&payload(vec![
        Value::from(1),
        Value::Array(vec![
            s("BlockStored"),
            Value::Array(vec![Value::Binary(vec![1; 5])]),
        ]),
        Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), s("x")),
        ]),
        stored_map(vec![Value::from(1)], Value::Nil, &[], Value::Nil)
            .as_map()
            .map(|m| {
                let mut m = m.clone();
                m[3].1 = Value::Array(vec![Value::from(-1)]);
                Value::Map(m)
            })
            .unwrap_or(Value::Nil),
        Value::Map(vec![(s("type"), s("SomethingNew"))]),
    ]))
    .expect("the envelope decodes");
    assert_eq!(batch.events[0], Err(DecodeError::EventShape));
    assert_eq!(batch.events[1], Err(DecodeError::HashSize(5)));
    assert_eq!(batch.events[2], Err(DecodeError::Field("block_hashes")));
    assert_eq!(batch.events[3], Err(DecodeError::TokenId));
    assert_eq!(
        batch.events[4],
        Ok(EngineEvent::Unknown("SomethingNew".into()))
    );
    assert_eq!(decode_seq(&[0, 0, 0, 0, 0, 0, 1, 2]), Ok(258));
    assert_eq!(decode_seq(&[1, 2]), Err(DecodeError::SeqSize(2)));
}

#[test]
fn non_null_extra_keys_are_flagged() {
    let bytes = payload(vec![stored_map(
        vec![Value::from(1)],
        Value::Nil,
        &[1, 2, 3, 4],
        Value::Array(vec![Value::Array(vec![s("salt")])]),
    )]);
    let batch = decode_payload(&bytes).expect("decodes");
    let Ok(EngineEvent::BlockStored(b)) = &batch.events[0] else {
        panic!("not a BlockStored")
    };
    assert!(!b.plain_keys());
    assert_eq!(b.extra_keys, vec![BlockKeys::Strings(vec!["salt".into()])]);
    // A multimodal `(identifier, offset)` pair is not a string key.
    let bytes = payload(vec![stored_map(
        vec![Value::from(1)],
        Value::Nil,
        &[1, 2, 3, 4],
        Value::Array(vec![Value::Array(vec![Value::Array(vec![
            s("img-hash"),
            Value::from(0),
        ])])]),
    )]);
    let batch = decode_payload(&bytes).expect("decodes");
    let Ok(EngineEvent::BlockStored(b)) = &batch.events[0] else {
        panic!("not a BlockStored")
    };
    assert_eq!(b.extra_keys, vec![BlockKeys::Other]);
}

#[test]
fn declared_lengths_are_checked_before_anything_is_read() {
    // An array32 declaring 2^32-1 events, a map32 declaring as many pairs, a str32 of
    // 4 GiB, on a few bytes: errors, nothing reserved.
    let cases: [&[u8]; 4] = [
        &[
            0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff, 0xc0,
        ],
        &[0xdf, 0xff, 0xff, 0xff, 0xff, 0xc0, 0xc0],
        &[0x92, 0xdb, 0xff, 0xff, 0xff, 0xff, b'x'],
        &[0x92, 0xc0, 0x91, 0xc7, 0xff, 0x01],
    ];
    for bytes in cases {
        assert!(
            matches!(decode_payload(bytes), Err(DecodeError::Msgpack(_))),
            "{bytes:x?}: {:?}",
            decode_payload(bytes)
        );
    }
}

#[test]
fn nils_and_unknown_fields_cost_nothing_and_events_come_one_at_a_time() {
    // `[ts, [nil x N]]`: the envelope walks N bytes without allocating; each event is an
    // error taken and dropped in turn.
    let n = 100_000;
    let mut bytes = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd];
    bytes.extend_from_slice(&(n as u32).to_be_bytes());
    bytes.resize(bytes.len() + n, 0xc0);
    let batch = decode_batch(&bytes).expect("the envelope decodes");
    assert_eq!(batch.events.size_hint(), (n, Some(n)));
    let mut count = 0;
    for event in batch.events {
        assert_eq!(event, Err(DecodeError::EventShape));
        count += 1;
    }
    assert_eq!(count, n);
    // A payload over the limit is refused unread.
    assert_eq!(
        decode_batch(&vec![0xc0; MAX_PAYLOAD_BYTES + 1]).err(),
        Some(DecodeError::TooLarge(MAX_PAYLOAD_BYTES + 1))
    );
}

#[test]
fn an_event_decodes_within_its_budget_or_not_at_all() {
    let tokens = |blocks: usize| -> Vec<u32> { (0..blocks as u32 * 4).map(|t| 1000 + t).collect() };
    // Real hashes (u64 over 2^32: 9 bytes each) with their tokens decode.
    let real: Vec<Value> = (0..20_000u64).map(|i| Value::from(u64::MAX - i)).collect();
    let bytes = payload(vec![stored_map(
        real,
        Value::Nil,
        &tokens(20_000),
        Value::Nil,
    )]);
    let batch = decode_payload(&bytes).expect("decodes");
    assert!(
        matches!(&batch.events[0], Ok(EngineEvent::BlockStored(b)) if b.block_hashes.len() == 20_000)
    );
    // 1-byte hashes would expand 40x: refused, counted as an event that did not decode.
    let tiny: Vec<Value> = (0..20_000).map(|_| Value::from(1)).collect();
    let bytes = payload(vec![Value::Array(vec![
        s("BlockRemoved"),
        Value::Array(tiny),
    ])]);
    let batch = decode_payload(&bytes).expect("the envelope decodes");
    assert!(
        matches!(batch.events[0], Err(DecodeError::Budget(_))),
        "{:?}",
        batch.events[0]
    );
    // The nils of a map's `extra_keys` without tokens: 32x, refused.
    let bytes = payload(vec![Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(vec![])),
        (s("extra_keys"), Value::Array(vec![Value::Nil; 50_000])),
    ])]);
    let batch = decode_payload(&bytes).expect("the envelope decodes");
    assert!(matches!(batch.events[0], Err(DecodeError::Budget(_))));
}

#[test]
fn token_ids_of_every_width_decode_and_skip_as_any_other_integer() {
    let tokens = [0, 1, 127, 128, 255, 256, 65_535, 65_536, u32::MAX];
    let bytes = payload(vec![stored_map(
        vec![Value::from(1)],
        Value::Nil,
        &tokens,
        Value::Nil,
    )]);
    let batch = decode_payload(&bytes).expect("decodes");
    let Ok(EngineEvent::BlockStored(b)) = &batch.events[0] else {
        panic!("not a BlockStored: {:?}", batch.events)
    };
    assert_eq!(b.token_ids, tokens);
    // A small id in the 64-bit form, an id past u32, and values cut short take the general
    // path: read, refused or reported, never misread.
    let mut r = Reader::new(&[0xcf, 0, 0, 0, 0, 0, 0, 0, 7]);
    assert_eq!(r.next_u32(), None);
    assert!(matches!(r.next(), Ok(Tok::Uint(7))));
    for cut in [&[0xcc][..], &[0xcd, 1], &[0xce, 1, 2, 3]] {
        let mut r = Reader::new(cut);
        assert_eq!(r.next_u32(), None, "{cut:?}");
        assert!(r.next().is_err(), "{cut:?}");
    }
    // Skipping an array of mixed integers lands after it; one cut short is an error.
    let mut r = Reader::new(&[0x94, 0x05, 0xcc, 0xff, 0xcd, 1, 2, 0xd0, 0xff, 0x2a]);
    let head = r.next().expect("array");
    r.skip_children(head).expect("skips");
    assert!(matches!(r.next(), Ok(Tok::Uint(42))));
    let mut r = Reader::new(&[0x92, 0x05, 0xce, 1, 2]);
    let head = r.next().expect("array");
    assert!(r.skip_children(head).is_err());
}
