//! `router-host serve`: KV-cache events from vLLM-style ZMQ publishers feed the KV index.
//!
//! Each test binds its own in-process PUB socket on 127.0.0.1 (the `zeromq` crate, as the mock
//! engine does: so these tests are also the router's ZMTP client against another
//! implementation), builds vLLM's msgpack payloads with `rmpv`, and watches the router's metrics
//! and KV index with bounded waits.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::engine::{client, eventually, header, post, Engine, TestRouter};
use rmpv::Value;
use router_core::blocks::{BlockHasher, Tenant};
use serde_json::json;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

const WAIT: Duration = Duration::from_secs(10);
const BLOCK: usize = 4;

/// A vLLM-like publisher: `[topic, seq BE, msgpack [ts, events, dp_rank]]`.
struct Publisher {
    socket: zeromq::PubSocket,
    port: u16,
    seq: u64,
}

impl Publisher {
    async fn bind(port: u16) -> Publisher {
        let mut socket = zeromq::PubSocket::new();
        let endpoint = socket
            .bind(&format!("tcp://127.0.0.1:{port}"))
            .await
            .expect("bind the test publisher");
        let port = match endpoint {
            zeromq::Endpoint::Tcp(_, port) => port,
            other => panic!("not a TCP endpoint: {other:?}"),
        };
        Publisher {
            socket,
            port,
            seq: 0,
        }
    }

    fn endpoint(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.port)
    }

    async fn frames(&mut self, frames: Vec<Vec<u8>>) {
        let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
        let message = ZmqMessage::try_from(frames).expect("frames");
        self.socket.send(message).await.expect("publish");
    }

    /// Publish a batch with an explicit sequence number.
    async fn send_seq(&mut self, seq: u64, events: Vec<Value>) {
        self.frames(vec![
            b"kv@test".to_vec(),
            seq.to_be_bytes().to_vec(),
            payload(events),
        ])
        .await;
        self.seq = seq + 1;
    }

    async fn send(&mut self, events: Vec<Value>) {
        self.send_seq(self.seq, events).await;
    }

    /// Send empty batches until the router has received one (a SUB misses what is published
    /// before its subscription arrives).
    async fn prime(&mut self, router: &TestRouter, worker: u64) {
        let sample = format!("router_kv_event_batches_total{{worker=\"{worker}\"}}");
        let before = router.metric(&sample);
        let deadline = std::time::Instant::now() + WAIT;
        while router.metric(&sample) <= before {
            assert!(
                std::time::Instant::now() < deadline,
                "the router never received a batch from worker {worker}"
            );
            self.send(vec![]).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Everything sent after the subscription arrives, in order: let it drain.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A batch stamped now, as vLLM stamps its batches (`time.time()`).
fn payload(events: Vec<Value>) -> Vec<u8> {
    payload_at(now_secs(), events)
}

fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64()
}

fn payload_at(ts: f64, events: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::F64(ts), Value::Array(events), Value::from(0)]),
    )
    .expect("encode");
    out
}

fn s(v: &str) -> Value {
    Value::from(v)
}

fn ints(values: &[u64]) -> Value {
    Value::Array(values.iter().map(|&v| Value::from(v)).collect())
}

/// `BlockStored` in the map form (vLLM since mid-2026), with fields this router ignores.
fn stored_map(hashes: &[u64], parent: Option<u64>, tokens: &[u32], block_size: u64) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), ints(hashes)),
        (
            s("parent_block_hash"),
            parent.map_or(Value::Nil, Value::from),
        ),
        (
            s("token_ids"),
            Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        ),
        (s("block_size"), Value::from(block_size)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), Value::Nil),
        (
            s("extra_keys"),
            Value::Array(vec![Value::Nil; hashes.len()]),
        ),
        (s("group_idx"), Value::from(0)),
        (s("kv_cache_spec_kind"), s("full_attention")),
    ])
}

/// `BlockStored` in the legacy positional form, with 32-byte hashes.
fn stored_array(hashes: &[[u8; 32]], parent: Option<[u8; 32]>, tokens: &[u32]) -> Value {
    Value::Array(vec![
        s("BlockStored"),
        Value::Array(hashes.iter().map(|h| Value::Binary(h.to_vec())).collect()),
        parent.map_or(Value::Nil, |h| Value::Binary(h.to_vec())),
        Value::Array(tokens.iter().map(|&t| Value::from(t)).collect()),
        Value::from(BLOCK as u64),
        Value::Nil,
        s("GPU"),
        Value::Nil,
        Value::Nil,
    ])
}

fn removed(hashes: &[u64]) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), ints(hashes)),
        (s("medium"), s("GPU")),
    ])
}

fn cleared() -> Value {
    Value::Map(vec![(s("type"), s("AllBlocksCleared"))])
}

fn yaml(workers: &[(&Engine, &Publisher)]) -> String {
    let mut out = String::from(
        "block_size: 4\nserve:\n  health:\n    interval_ms: 200\n  tokenizer: remote\nworkers:\n",
    );
    for (engine, publisher) in workers {
        out.push_str(&format!(
            "  - id: {}\n    url: {}\n    kv_events:\n      endpoint: {}\n      topic: kv\n",
            engine.state.id,
            engine.url(),
            publisher.endpoint()
        ));
    }
    out
}

/// The router's ids of the prompt's full blocks (the core's rule).
fn prompt_ids(tokens: &[u32]) -> Vec<u64> {
    let mut out = Vec::new();
    BlockHasher::new(BLOCK as u32, Tenant::default())
        .expect("hasher")
        .prompt_blocks(tokens, &mut out);
    out
}

/// How many of `ids` (leading) the row of `worker` holds in the current core's index.
fn held(router: &TestRouter, worker: u64, ids: &[u64]) -> usize {
    common::engine::held_ids(router, worker, ids)
}

fn blocks_metric(router: &TestRouter, worker: u64) -> f64 {
    tier_blocks_metric(router, worker, "device")
}

fn tier_blocks_metric(router: &TestRouter, worker: u64, tier: &str) -> f64 {
    router.metric(&format!(
        "router_kv_index_blocks{{worker=\"{worker}\",dp_rank=\"0\",tier=\"{tier}\"}}"
    ))
}

/// An offload connector's store: vLLM's placeholder form (a bare hash, no tokens, no parent,
/// block size 0) when `tokens` is empty, else self-describing.
fn offloaded(hashes: &[u64], medium: &str) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), ints(hashes)),
        (s("parent_block_hash"), Value::Nil),
        (s("token_ids"), Value::Array(vec![])),
        (s("block_size"), Value::from(0)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s(medium)),
        (s("lora_name"), Value::Nil),
        (s("group_idx"), Value::from(0)),
    ])
}

fn removed_from(hashes: &[u64], medium: &str) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), ints(hashes)),
        (s("medium"), s(medium)),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_blocks_route_their_prompt_to_the_row_and_removal_takes_them_away() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let (mut p1, mut p2) = (Publisher::bind(0).await, Publisher::bind(0).await);
    let router = TestRouter::start("serve_kv_route", &yaml(&[(&e1, &p1), (&e2, &p2)])).await;
    p1.prime(&router, 1).await;
    p2.prime(&router, 2).await;
    assert_eq!(
        router.metric("router_kv_subscriber_connected{worker=\"2\",dp_rank=\"0\"}"),
        1.0
    );

    let tokens: Vec<u32> = (100..114).collect(); // 3 full blocks and 2 tokens
    let ids = prompt_ids(&tokens);
    assert_eq!(ids.len(), 3);
    // Blocks 0 and 1 in one map-form event with u64 hashes (one over i64::MAX), block 2 in a
    // second event chained from block 1's engine hash.
    let h0 = u64::MAX - 1;
    p2.send(vec![stored_map(&[h0, 22], None, &tokens[..8], 4)])
        .await;
    p2.send(vec![stored_map(&[33], Some(22), &tokens[8..12], 4)])
        .await;
    assert!(eventually(WAIT, || held(&router, 2, &ids) == 3).await);
    assert_eq!(held(&router, 1, &ids), 0);
    assert_eq!(blocks_metric(&router, 2), 3.0);
    assert_eq!(
        router.metric("router_kv_events_total{worker=\"2\",dp_rank=\"0\",kind=\"block_stored\"}"),
        2.0
    );

    // Legacy array form with 32-byte hashes on worker 1, another prompt.
    let other: Vec<u32> = (500..508).collect();
    let other_ids = prompt_ids(&other);
    p1.send(vec![stored_array(&[[1; 32]], None, &other[..4])])
        .await;
    p1.send(vec![stored_array(&[[2; 32]], Some([1; 32]), &other[4..8])])
        .await;
    assert!(eventually(WAIT, || held(&router, 1, &other_ids) == 2).await);

    // A request for the prompt goes to the row that holds it.
    let http = client();
    let url = router.url("/v1/completions");
    for _ in 0..3 {
        let response = post(&http, &url, &json!({"model": "tiny", "prompt": tokens})).await;
        assert_eq!(response.status(), 200);
        assert_eq!(header(&response, "x-router-worker"), "2");
        let _ = response.bytes().await;
    }
    let response = post(&http, &url, &json!({"model": "tiny", "prompt": other})).await;
    assert_eq!(header(&response, "x-router-worker"), "1");
    let _ = response.bytes().await;

    // BlockRemoved of the first block: the prompt has no overlap there any more.
    p2.send(vec![removed(&[h0, 987_654])]).await;
    assert!(eventually(WAIT, || held(&router, 2, &ids) == 0).await);
    assert!(eventually(WAIT, || blocks_metric(&router, 2) == 2.0).await);
    assert_eq!(
        router.metric(
            "router_kv_events_ignored_total{worker=\"2\",dp_rank=\"0\",kind=\"unknown_block\"}"
        ),
        1.0
    );
    router.stop().await;
}

/// Blocks an engine offloaded to host memory stay reusable after its device copy is evicted:
/// the index keeps them on the host tier, and the built-in policy credits them (at the host's
/// `host_cache_hit_weight`, 0.75) above another row's single device block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offloaded_blocks_count_as_host_overlap_after_the_device_copy_goes() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let (mut p1, mut p2) = (Publisher::bind(0).await, Publisher::bind(0).await);
    let router = TestRouter::start("serve_kv_tiers", &yaml(&[(&e1, &p1), (&e2, &p2)])).await;
    p1.prime(&router, 1).await;
    p2.prime(&router, 2).await;

    let tokens: Vec<u32> = (700..712).collect(); // 3 full blocks
    let ids = prompt_ids(&tokens);
    // Worker 1: the first block on its device.
    p1.send(vec![stored_map(&[11], None, &tokens[..4], 4)])
        .await;
    // Worker 2: all three on the device, offloaded to the host, then evicted from the device.
    p2.send(vec![
        stored_map(&[21, 22, 23], None, &tokens, 4),
        offloaded(&[21, 22, 23], "CPU"),
        removed_from(&[21, 22, 23], "GPU"),
    ])
    .await;
    assert!(eventually(WAIT, || tier_blocks_metric(&router, 2, "host") == 3.0).await);
    assert_eq!(blocks_metric(&router, 2), 0.0);
    assert_eq!(
        held(&router, 2, &ids),
        0,
        "nothing left on worker 2's device"
    );
    {
        let loaded = router.handle.loaded();
        let core = loaded.host.core();
        let slot = core
            .topology()
            .slot(router_host::model::RowId {
                worker_id: 2,
                dp_rank: 0,
            })
            .expect("worker 2's slot");
        let index = core.kv_index();
        assert!(ids
            .iter()
            .all(|&id| index.holds_in(slot, id, router_core::kv_index::Tier::Host)));
    }

    let http = client();
    let url = router.url("/v1/completions");
    for _ in 0..3 {
        let response = post(&http, &url, &json!({"model": "tiny", "prompt": tokens})).await;
        assert_eq!(response.status(), 200);
        assert_eq!(header(&response, "x-router-worker"), "2");
        let _ = response.bytes().await;
    }

    // The host copy evicted too: worker 1's device block wins again.
    p2.send(vec![removed_from(&[21, 22, 23], "CPU")]).await;
    assert!(eventually(WAIT, || tier_blocks_metric(&router, 2, "host") == 0.0).await);
    let response = post(&http, &url, &json!({"model": "tiny", "prompt": tokens})).await;
    assert_eq!(header(&response, "x-router-worker"), "1");
    let _ = response.bytes().await;
    // A medium this router does not know is ignored and counted, never indexed.
    p2.send(vec![offloaded(&[21], "NVME")]).await;
    assert!(
        eventually(WAIT, || router.metric(
            "router_kv_events_ignored_total{worker=\"2\",dp_rank=\"0\",kind=\"medium\"}"
        ) == 1.0)
        .await
    );
    router.stop().await;
}

/// A LoRA adapter's blocks (vLLM names the adapter in `lora_name` and in every block's
/// `extra_keys`) are indexed in the adapter's tenant; with the adapter in
/// `serve.lora_adapters`, a request for it matches them, and the base model's does not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adapters_blocks_match_only_requests_for_that_adapter() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let (mut p1, mut p2) = (Publisher::bind(0).await, Publisher::bind(0).await);
    let config =
        yaml(&[(&e1, &p1), (&e2, &p2)]).replace("serve:\n", "serve:\n  lora_adapters: [ad]\n");
    let router = TestRouter::start("serve_kv_lora", &config).await;
    p1.prime(&router, 1).await;
    p2.prime(&router, 2).await;

    let tokens: Vec<u32> = (900..908).collect(); // 2 full blocks
                                                 // Worker 1 caches the tokens for the base model, worker 2 for the adapter.
    p1.send(vec![stored_map(&[11, 12], None, &tokens, 4)]).await;
    let with_adapter = |event: Value| match event {
        Value::Map(fields) => Value::Map(
            fields
                .into_iter()
                .map(|(k, v)| match k.as_str() {
                    Some("lora_name") => (k, s("ad")),
                    Some("extra_keys") => (k, Value::Array(vec![Value::Array(vec![s("ad")]); 2])),
                    _ => (k, v),
                })
                .collect(),
        ),
        other => other,
    };
    p2.send(vec![with_adapter(stored_map(&[21, 22], None, &tokens, 4))])
        .await;
    assert!(eventually(WAIT, || blocks_metric(&router, 2) == 2.0).await);
    assert_eq!(
        router.metric(
            "router_kv_events_refused_total{worker=\"2\",dp_rank=\"0\",kind=\"extra_keys\"}"
        ),
        0.0
    );
    assert!(eventually(WAIT, || held(&router, 1, &prompt_ids(&tokens)) == 2).await);
    assert_eq!(
        held(&router, 2, &prompt_ids(&tokens)),
        0,
        "the adapter's ids differ"
    );

    let http = client();
    let url = router.url("/v1/completions");
    for (model, worker) in [("ad", "2"), ("tiny", "1"), ("ad", "2"), ("tiny", "1")] {
        let response = post(&http, &url, &json!({"model": model, "prompt": tokens})).await;
        assert_eq!(response.status(), 200);
        assert_eq!(
            header(&response, "x-router-worker"),
            worker,
            "model {model}"
        );
        let _ = response.bytes().await;
    }
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clears_restarts_gaps_refusals_and_malformed_messages() {
    let e1 = Engine::start(1).await;
    let mut p = Publisher::bind(0).await;
    let router = TestRouter::start("serve_kv_clear", &yaml(&[(&e1, &p)])).await;
    p.prime(&router, 1).await;
    let tokens: Vec<u32> = (1..=8).collect();
    let ids = prompt_ids(&tokens);
    let metric = |name: &str, kind: &str| {
        router.metric(&format!(
            "{name}{{worker=\"1\",dp_rank=\"0\",kind=\"{kind}\"}}"
        ))
    };

    // AllBlocksCleared empties the row.
    p.send(vec![stored_map(&[1, 2], None, &tokens, 4)]).await;
    assert!(eventually(WAIT, || held(&router, 1, &ids) == 2).await);
    p.send(vec![cleared()]).await;
    assert!(eventually(WAIT, || held(&router, 1, &ids) == 0).await);
    assert_eq!(
        metric("router_kv_row_clears_total", "all_blocks_cleared"),
        1.0
    );
    assert_eq!(blocks_metric(&router, 1), 0.0);

    // A sequence that goes backwards is a restart: the row is cleared, then the batch applied.
    p.send(vec![stored_map(&[1, 2], None, &tokens, 4)]).await;
    assert!(eventually(WAIT, || held(&router, 1, &ids) == 2).await);
    p.send_seq(0, vec![stored_map(&[7], None, &[9, 9, 9, 9], 4)])
        .await;
    assert!(
        eventually(WAIT, || metric("router_kv_row_clears_total", "restart")
            == 1.0)
        .await
    );
    assert!(eventually(WAIT, || blocks_metric(&router, 1) == 1.0).await);
    assert_eq!(held(&router, 1, &ids), 0);
    assert_eq!(held(&router, 1, &prompt_ids(&[9, 9, 9, 9])), 1);

    // A gap is counted (no replay endpoint); the batch after it is applied.
    let next = p.seq + 4;
    p.send_seq(next, vec![stored_map(&[1, 2], None, &tokens, 4)])
        .await;
    assert!(
        eventually(WAIT, || {
            router.metric("router_kv_event_gaps_total{worker=\"1\",dp_rank=\"0\"}") == 1.0
        })
        .await
    );
    assert!(eventually(WAIT, || held(&router, 1, &ids) == 2).await);

    // A block size that is not the configured one is refused and counted.
    p.send(vec![stored_map(&[50], None, &[1; 16], 16)]).await;
    assert!(
        eventually(WAIT, || metric(
            "router_kv_events_refused_total",
            "block_size"
        ) == 1.0)
        .await
    );

    // Malformed messages are counted and the subscriber goes on.
    p.frames(vec![b"kv".to_vec(), vec![0; 8]]).await;
    p.frames(vec![b"kv".to_vec(), vec![1, 2, 3], payload(vec![])])
        .await;
    let seq = p.seq;
    p.frames(vec![
        b"kv".to_vec(),
        seq.to_be_bytes().to_vec(),
        vec![0x93, 0xc1, 0xff],
    ])
    .await;
    p.seq += 1;
    p.send(vec![
        Value::from(5),
        Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), s("x")),
        ]),
        Value::Map(vec![(s("type"), s("FromTheFuture"))]),
        stored_map(&[60], None, &[4, 4, 4, 4], 4),
    ])
    .await;
    assert!(eventually(WAIT, || held(&router, 1, &prompt_ids(&[4, 4, 4, 4])) == 1).await);
    assert_eq!(metric("router_kv_event_decode_errors_total", "frames"), 2.0);
    assert_eq!(
        metric("router_kv_event_decode_errors_total", "payload"),
        1.0
    );
    assert_eq!(metric("router_kv_event_decode_errors_total", "event"), 2.0);
    assert_eq!(
        metric("router_kv_events_ignored_total", "unknown_type"),
        1.0
    );
    // A parent the row never saw is refused, never indexed under a wrong id.
    p.send(vec![stored_map(&[70], Some(123_456), &[3, 3, 3, 3], 4)])
        .await;
    assert!(
        eventually(WAIT, || metric(
            "router_kv_events_refused_total",
            "unknown_parent"
        ) == 1.0)
        .await
    );
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_subscriber_reconnects_after_the_publisher_restarts() {
    let e1 = Engine::start(1).await;
    let mut p = Publisher::bind(0).await;
    let port = p.port;
    let router = TestRouter::start("serve_kv_reconnect", &yaml(&[(&e1, &p)])).await;
    // An engine that has run a while: its sequence is well past what a restarted one reaches
    // before the subscriber is back.
    p.seq = 1_000_000;
    p.prime(&router, 1).await;
    let tokens: Vec<u32> = (1..=8).collect();
    let ids = prompt_ids(&tokens);
    p.send(vec![stored_map(&[1, 2], None, &tokens, 4)]).await;
    assert!(eventually(WAIT, || held(&router, 1, &ids) == 2).await);

    // The engine goes away and comes back on the same port with its sequence from 0.
    drop(p);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut p = Publisher::bind(port).await;
    p.prime(&router, 1).await;
    // Its first batch went backwards: the row was cleared.
    assert!(
        eventually(WAIT, || {
            router.metric("router_kv_row_clears_total{worker=\"1\",dp_rank=\"0\",kind=\"restart\"}")
                == 1.0
        })
        .await
    );
    assert_eq!(held(&router, 1, &ids), 0);
    p.send(vec![stored_map(&[1, 2], None, &tokens, 4)]).await;
    assert!(eventually(WAIT, || held(&router, 1, &ids) == 2).await);
    assert_eq!(
        router.metric("router_kv_subscriber_connected{worker=\"1\",dp_rank=\"0\"}"),
        1.0
    );
    router.stop().await;
}

/// Reconnects back off from 100 ms doubling to 5 s, no further: a publisher down for 20 s
/// (tries at about 0.1, 0.3, 0.7, 1.5, 3.1 and 6.3 s, then at most 5 s apart) has its batches
/// received again within 2 x 5 s of coming back. (With the zeromq crate's reconnection,
/// growing to 30 s, that took 16 s.) Slow by nature: about 23 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_down_a_while_is_resubscribed_within_twice_the_longest_backoff() {
    let e1 = Engine::start(1).await;
    let mut p = Publisher::bind(0).await;
    let port = p.port;
    let router = TestRouter::start("serve_kv_backoff", &yaml(&[(&e1, &p)])).await;
    p.prime(&router, 1).await;
    drop(p);
    assert!(
        eventually(WAIT, || {
            router.metric("router_kv_subscriber_connected{worker=\"1\",dp_rank=\"0\"}") == 0.0
        })
        .await
    );
    tokio::time::sleep(Duration::from_secs(20)).await;
    let mut p = Publisher::bind(port).await;
    let up = std::time::Instant::now();
    let sample = "router_kv_event_batches_total{worker=\"1\"}";
    let before = router.metric(sample);
    while router.metric(sample) <= before {
        assert!(
            up.elapsed() < Duration::from_secs(10),
            "no batch received within 10 s of the publisher coming back"
        );
        p.send(vec![]).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_asks_the_replay_socket_and_applies_what_it_returns() {
    let e1 = Engine::start(1).await;
    let mut p = Publisher::bind(0).await;
    let mut replay = zeromq::RouterSocket::new();
    let replay_port = match replay
        .bind("tcp://127.0.0.1:0")
        .await
        .expect("bind the replay socket")
    {
        zeromq::Endpoint::Tcp(_, port) => port,
        other => panic!("not TCP: {other:?}"),
    };
    let config = yaml(&[(&e1, &p)]).replace(
        "      topic: kv\n",
        // No warm start: this test answers the replay socket by hand, for the gap only.
        &format!(
            "      topic: kv\n      replay_endpoint: tcp://127.0.0.1:{replay_port}\n      warm_start_ms: 0\n"
        ),
    );
    let router = TestRouter::start("serve_kv_replay", &config).await;
    p.prime(&router, 1).await;
    let tokens: Vec<u32> = (1..=8).collect();
    let ids = prompt_ids(&tokens);

    // Batches `lost` and `lost + 1` never reach the subscriber; the replay socket has them.
    let lost = p.seq;
    let first = payload(vec![stored_map(&[1], None, &tokens[..4], 4)]);
    let second = payload(vec![stored_map(&[2], Some(1), &tokens[4..], 4)]);
    let answer = tokio::spawn(async move {
        let request = tokio::time::timeout(WAIT, replay.recv())
            .await
            .expect("a replay request in time")
            .expect("receive")
            .into_vec();
        // [identity, "", start seq]
        assert_eq!(request.len(), 3, "{request:?}");
        assert!(request[1].is_empty());
        assert_eq!(request[2].as_ref(), lost.to_be_bytes());
        let identity = request[0].clone();
        let seq = |n: u64| Bytes::copy_from_slice(&n.to_be_bytes());
        let replies = [
            // vLLM 0.32: [identity, "", seq, payload].
            vec![
                identity.clone(),
                Bytes::new(),
                seq(lost),
                Bytes::from(first),
            ],
            // vLLM 0.33: [identity, "", topic, seq, payload].
            vec![
                identity.clone(),
                Bytes::new(),
                Bytes::from_static(b"kv@test"),
                seq(lost + 1),
                Bytes::from(second),
            ],
            // The live batch is in the buffer too: not applied twice.
            vec![identity.clone(), Bytes::new(), seq(lost + 2), Bytes::new()],
            vec![identity, Bytes::new(), seq(u64::MAX), Bytes::new()],
        ];
        for frames in replies {
            replay
                .send(ZmqMessage::try_from(frames).expect("frames"))
                .await
                .expect("reply");
        }
    });
    p.send_seq(lost + 2, vec![stored_map(&[3], Some(2), &[9, 9, 9, 9], 4)])
        .await;
    answer.await.expect("the replay socket answered");
    let mut all = tokens.clone();
    all.extend([9, 9, 9, 9]);
    assert!(eventually(WAIT, || held(&router, 1, &prompt_ids(&all)) == 3).await);
    assert_eq!(held(&router, 1, &ids), 2);
    assert_eq!(
        router.metric("router_kv_event_gaps_total{worker=\"1\",dp_rank=\"0\"}"),
        1.0
    );
    assert_eq!(
        router.metric("router_kv_event_replays_total{worker=\"1\",dp_rank=\"0\",kind=\"ok\"}"),
        1.0
    );
    router.stop().await;
}

#[test]
fn kv_events_configuration_is_checked_with_file_line_and_key() {
    let parse = |yaml: &str| router_host::config::RouterConfig::from_yaml_str(yaml, None);
    let ok = parse(
        "block_size: 32\nworkers:\n  - id: 1\n    url: http://127.0.0.1:8101\n    dp_size: 2\n    \
         kv_events:\n      endpoint: tcp://127.0.0.1:5557\n      replay_endpoint: \
         tcp://127.0.0.1:6557\n    block_size: 32\n",
    )
    .expect("valid");
    let kv = ok.workers[0].kv_events.clone().expect("kv_events");
    assert_eq!(kv.endpoint_for(1), "tcp://127.0.0.1:5558");
    assert_eq!(
        kv.replay_endpoint_for(1).as_deref(),
        Some("tcp://127.0.0.1:6558")
    );
    assert_eq!(kv.topic, "");
    assert_eq!(kv.max_indexed_blocks, 1 << 20);
    assert_eq!((kv.max_lag_ms, kv.stale_clear_ms), (5_000, 30_000));
    assert_eq!(ok.workers[0].block_size, 32);

    let cases = [
        (
            "    block_size: 16\n",
            "block_size",
            "differs from the top-level",
        ),
        (
            "    kv_events:\n      endpoint: tcp://*:5557\n",
            "endpoint",
            "wildcard",
        ),
        (
            "    kv_events:\n      endpoint: http://127.0.0.1:5557\n",
            "endpoint",
            "tcp://",
        ),
        (
            "    kv_events:\n      endpoint: tcp://127.0.0.1:5557\n      colour: red\n",
            "colour",
            "unknown field",
        ),
        (
            "    kv_events:\n      endpoint: tcp://127.0.0.1:5557\n      max_indexed_blocks: 0\n",
            "max_indexed_blocks",
            "an integer >= 1",
        ),
        (
            "    kv_events:\n      endpoint: tcp://127.0.0.1:5557\n      max_lag_ms: 0\n",
            "max_lag_ms",
            "an integer from 1 to 86400000",
        ),
        (
            "    kv_events:\n      endpoint: tcp://127.0.0.1:5557\n      stale_clear_ms: 86400001\n",
            "stale_clear_ms",
            "an integer from 1 to 86400000",
        ),
    ];
    for (extra, key, why) in cases {
        let yaml =
            format!("block_size: 32\nworkers:\n  - id: 1\n    url: http://127.0.0.1:8101\n{extra}");
        let err = parse(&yaml).expect_err(&yaml).to_string();
        assert!(err.contains(key) && err.contains(why), "{err}");
        assert!(err.contains("line "), "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_keeps_the_rows_blocks_in_the_new_configuration() {
    let e1 = Engine::start(1).await;
    let mut p = Publisher::bind(0).await;
    let router = TestRouter::start("serve_kv_reload", &yaml(&[(&e1, &p)])).await;
    p.prime(&router, 1).await;
    let tokens: Vec<u32> = (1..=8).collect();
    let ids = prompt_ids(&tokens);
    p.send(vec![stored_map(&[1, 2], None, &tokens, 4)]).await;
    assert!(eventually(WAIT, || held(&router, 1, &ids) == 2).await);

    assert_eq!(router.handle.reload().await.expect("reload"), 2);
    assert_eq!(router.handle.loaded().number, 2);
    // The subscriber kept running and seeded the new core's index with the row's blocks.
    assert!(eventually(WAIT, || held(&router, 1, &ids) == 2).await);
    p.send(vec![removed(&[2])]).await;
    assert!(eventually(WAIT, || held(&router, 1, &ids) == 1).await);
    assert_eq!(
        router.metric("router_kv_event_gaps_total{worker=\"1\",dp_rank=\"0\"}"),
        0.0
    );
    router.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_removed_by_a_reload_leaves_no_gauges_behind() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let (mut p1, mut p2) = (Publisher::bind(0).await, Publisher::bind(0).await);
    let router = TestRouter::start("serve_kv_removed", &yaml(&[(&e1, &p1), (&e2, &p2)])).await;
    p1.prime(&router, 1).await;
    p2.prime(&router, 2).await;
    let tokens: Vec<u32> = (1..=8).collect();
    p2.send(vec![stored_map(&[1, 2], None, &tokens, 4)]).await;
    let series = |worker: u64| -> Vec<String> {
        let row = format!("worker=\"{worker}\",dp_rank=\"0\"");
        router
            .handle
            .metrics_text()
            .lines()
            .filter(|l| !l.starts_with('#') && l.contains(&row))
            .map(|l| l.split_once(' ').map_or(l, |(name, _)| name).to_owned())
            .collect()
    };
    let gauges = [
        "router_kv_subscriber_connected{",
        "router_kv_index_state{",
        "router_kv_index_blocks{",
        "router_kv_event_lag_seconds{",
    ];
    let has = |worker: u64, name: &str| series(worker).iter().any(|s| s.starts_with(name));
    assert!(
        eventually(WAIT, || gauges.iter().all(|g| has(2, g))).await,
        "{:?}",
        series(2)
    );

    std::fs::write(&router.config, yaml(&[(&e1, &p1)])).expect("rewrite the config");
    assert_eq!(router.handle.reload().await.expect("reload"), 2);
    assert!(
        eventually(WAIT, || gauges.iter().all(|g| !has(2, g))).await,
        "worker 2's gauges stayed: {:?}",
        series(2)
    );
    // Its counters stay, and worker 1's gauges are untouched.
    assert!(has(2, "router_kv_event_batches_total{"), "{:?}", series(2));
    assert_eq!(
        router.metric("router_kv_subscriber_connected{worker=\"1\",dp_rank=\"0\"}"),
        1.0
    );
    assert!(gauges.iter().all(|g| has(1, g)), "{:?}", series(1));
    router.stop().await;
}

/// `router_kv_index_state` of worker `worker`'s rank 0: the state whose gauge is 1 (and the
/// others' 0).
fn index_state(router: &TestRouter, worker: u64) -> &'static str {
    let mut on = Vec::new();
    for state in ["current", "unknown", "stale", "lagging"] {
        let sample =
            format!("router_kv_index_state{{worker=\"{worker}\",dp_rank=\"0\",state=\"{state}\"}}");
        if router.metric(&sample) == 1.0 {
            on.push(state);
        }
    }
    match on.as_slice() {
        [state] => state,
        [] => "none",
        _ => "several",
    }
}

fn transitions(router: &TestRouter, worker: u64, from: &str, to: &str) -> f64 {
    router.metric(&format!(
        "router_kv_index_state_transitions_total{{worker=\"{worker}\",dp_rank=\"0\",from=\"{from}\",to=\"{to}\"}}"
    ))
}

/// The core's own state of worker `worker`'s rank 0 (what decisions read).
fn core_state(router: &TestRouter, worker: u64) -> &'static str {
    router
        .handle
        .loaded()
        .host
        .core()
        .kv_index_state(router_core::model::RowId {
            worker_id: worker,
            dp_rank: 0,
        })
        .map_or("none", |s| s.as_str())
}

/// `/ready`'s status and its `kv_index` list as `worker:rank=state`.
async fn ready_kv_index(router: &TestRouter) -> (u16, Vec<String>) {
    let response = client()
        .get(router.url("/ready"))
        .send()
        .await
        .expect("GET /ready");
    let status = response.status().as_u16();
    let bytes = response.bytes().await.expect("the body");
    let body: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON body");
    let rows = body["kv_index"]
        .as_array()
        .expect("kv_index list")
        .iter()
        .map(|r| {
            format!(
                "{}:{}={}",
                r["worker"],
                r["dp_rank"],
                r["state"].as_str().unwrap_or("?")
            )
        })
        .collect();
    (status, rows)
}

/// Where a request for `tokens` goes, and why.
async fn route(router: &TestRouter, tokens: &[u32]) -> (String, String) {
    let response = post(
        &client(),
        &router.url("/v1/completions"),
        &json!({"model": "tiny", "prompt": tokens}),
    )
    .await;
    assert_eq!(response.status(), 200);
    let routed = (
        header(&response, "x-router-worker"),
        header(&response, "x-router-reason"),
    );
    let _ = response.bytes().await;
    routed
}

/// Each row's index state, end to end: unknown before the first batch and after a disconnect;
/// current while batches come in order; stale after a gap with no replay endpoint, until the
/// engine clears its cache or `stale_clear_ms` clears the row; lagging while batches come
/// later than `max_lag_ms`. Metrics, the core, `/ready` and the decisions follow it, and the
/// built-in policy does not prefer the row holding the prompt while it is not current.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_rows_index_state_follows_its_events_and_the_policy_routes_load_only_there() {
    let (e1, e2) = (Engine::start(1).await, Engine::start(2).await);
    let (mut p1, mut p2) = (Publisher::bind(0).await, Publisher::bind(0).await);
    let port2 = p2.port;
    // Ties go to the lowest row, so a decision without overlap is worker 1's.
    let config = yaml(&[(&e1, &p1), (&e2, &p2)])
        .replace(
            "block_size: 4\n",
            "block_size: 4\ndefault_selector:\n  tie_break: lowest_row\n",
        )
        .replace(
            "      topic: kv\n",
            "      topic: kv\n      stale_clear_ms: 1000\n",
        );
    let router = TestRouter::start("serve_kv_trust", &config).await;
    // Before any batch: unknown, though the router is ready.
    assert!(eventually(WAIT, || index_state(&router, 2) == "unknown").await);
    assert_eq!(core_state(&router, 2), "unknown");
    let (status, rows) = ready_kv_index(&router).await;
    assert_eq!(status, 200);
    assert_eq!(rows, ["1:0=unknown", "2:0=unknown"]);

    p1.prime(&router, 1).await;
    // An engine that has run a while: when it restarts below, its new sequence is behind.
    p2.seq = 1_000_000;
    p2.prime(&router, 2).await;
    assert!(eventually(WAIT, || index_state(&router, 2) == "current").await);
    assert_eq!(core_state(&router, 2), "current");
    assert_eq!(transitions(&router, 2, "unknown", "current"), 1.0);
    assert_eq!(
        ready_kv_index(&router).await.1,
        ["1:0=current", "2:0=current"]
    );

    let tokens: Vec<u32> = (1..=8).collect();
    let ids = prompt_ids(&tokens);
    p2.send(vec![stored_map(&[1, 2], None, &tokens, 4)]).await;
    assert!(eventually(WAIT, || held(&router, 2, &ids) == 2).await);
    assert_eq!(
        route(&router, &tokens).await,
        ("2".into(), "lowest_cost".into())
    );

    // A gap, no replay endpoint: stale. The prompt's row is not preferred for it any more.
    p2.send_seq(p2.seq + 3, vec![]).await;
    assert!(eventually(WAIT, || index_state(&router, 2) == "stale").await);
    assert_eq!(core_state(&router, 2), "stale");
    assert_eq!(
        held(&router, 2, &ids),
        2,
        "the entries are kept, just not trusted"
    );
    assert_eq!(
        route(&router, &tokens).await,
        ("1".into(), "lowest_cost_kv_load_only".into())
    );
    let (status, rows) = ready_kv_index(&router).await;
    assert_eq!(
        (status, rows),
        (200, vec!["1:0=current".into(), "2:0=stale".into()])
    );

    // The engine cleared its cache: what comes from now on is the whole truth.
    p2.send(vec![cleared(), stored_map(&[1, 2], None, &tokens, 4)])
        .await;
    assert!(eventually(WAIT, || index_state(&router, 2) == "current").await);
    assert_eq!(transitions(&router, 2, "stale", "current"), 1.0);
    assert_eq!(
        route(&router, &tokens).await,
        ("2".into(), "lowest_cost".into())
    );

    // Another gap: stale until stale_clear_ms (1 s) clears the row; then current, empty.
    let gapped = std::time::Instant::now();
    p2.send_seq(p2.seq + 2, vec![]).await;
    assert!(eventually(WAIT, || index_state(&router, 2) == "stale").await);
    assert!(eventually(WAIT, || index_state(&router, 2) == "current").await);
    assert!(
        gapped.elapsed() >= Duration::from_millis(1000),
        "cleared after {:?}, before stale_clear_ms",
        gapped.elapsed()
    );
    assert_eq!(held(&router, 2, &ids), 0);
    assert_eq!(
        router.metric("router_kv_row_clears_total{worker=\"2\",dp_rank=\"0\",kind=\"stale\"}"),
        1.0
    );
    assert_eq!(transitions(&router, 2, "stale", "current"), 2.0);

    // Batches older than max_lag_ms (5 s): lagging; on time again: current.
    p2.send(vec![stored_map(&[1, 2], None, &tokens, 4)]).await;
    assert!(eventually(WAIT, || held(&router, 2, &ids) == 2).await);
    let seq = p2.seq;
    p2.frames(vec![
        b"kv@test".to_vec(),
        seq.to_be_bytes().to_vec(),
        payload_at(now_secs() - 30.0, vec![]),
    ])
    .await;
    p2.seq += 1;
    assert!(eventually(WAIT, || index_state(&router, 2) == "lagging").await);
    assert_eq!(
        route(&router, &tokens).await,
        ("1".into(), "lowest_cost_kv_load_only".into())
    );
    p2.send(vec![]).await;
    assert!(eventually(WAIT, || index_state(&router, 2) == "current").await);
    assert_eq!(transitions(&router, 2, "lagging", "current"), 1.0);

    // The publisher goes away: unknown, and /ready still 200.
    drop(p2);
    assert!(eventually(WAIT, || index_state(&router, 2) == "unknown").await);
    assert_eq!(core_state(&router, 2), "unknown");
    let (status, rows) = ready_kv_index(&router).await;
    assert_eq!(
        (status, rows),
        (200, vec!["1:0=current".into(), "2:0=unknown".into()])
    );
    assert_eq!(
        route(&router, &tokens).await,
        ("1".into(), "lowest_cost_kv_load_only".into())
    );
    // Back (a restarted engine, its sequence from 0): the first batch makes it current.
    let mut p2 = Publisher::bind(port2).await;
    p2.prime(&router, 2).await;
    assert!(eventually(WAIT, || index_state(&router, 2) == "current").await);
    assert_eq!(core_state(&router, 2), "current");
    assert_eq!(transitions(&router, 2, "unknown", "current"), 2.0);
    assert_eq!(index_state(&router, 1), "current");
    router.stop().await;
}
