//! `serve` against KV-event publishers that misbehave on purpose, on 127.0.0.1.
//!
//! Each case runs a real `serve` in this process whose worker's `kv_events` endpoint is a raw
//! TCP listener scripted here: it speaks just enough ZMTP to be subscribed to (greeting, READY
//! as a PUB), then misbehaves. After each case `serve` still answers HTTP, the subscriber
//! dropped the connection (`router_kv_subscriber_connected` 0) and came back (1), the right
//! counter moved, and the process's peak RSS grew far less than the failure it guards against.
//!
//! The cases run one at a time (a lock) so that one case's memory is not another's, and the
//! peak RSS is reset before each (`/proc/self/clear_refs`), where the kernel allows it.

mod common;

use std::time::Duration;

use common::engine::{client, eventually, Engine, TestRouter};
use rmpv::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const WAIT: Duration = Duration::from_secs(8);
const MIB: u64 = 1 << 20;

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A ZMTP 3.0 greeting with `mechanism`, as server.
fn greeting(mechanism: &[u8]) -> [u8; 64] {
    let mut g = [0u8; 64];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[12..12 + mechanism.len()].copy_from_slice(mechanism);
    g[32] = 1;
    g
}

fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 9);
    match u8::try_from(body.len()) {
        Ok(short) => out.extend_from_slice(&[flags, short]),
        Err(_) => {
            out.push(flags | 0x02);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(body);
    out
}

fn ready_pub() -> Vec<u8> {
    frame(0x04, b"\x05READY\x0bSocket-Type\x00\x00\x00\x03PUB")
}

/// Read one frame: (flags, body); bodies here are tiny (the subscriber's READY and
/// subscription).
async fn read_frame(s: &mut TcpStream) -> (u8, Vec<u8>) {
    let mut head = [0u8; 2];
    s.read_exact(&mut head).await.expect("frame header");
    assert_eq!(head[0] & 0x02, 0, "the subscriber sends short frames");
    let mut body = vec![0u8; usize::from(head[1])];
    s.read_exact(&mut body).await.expect("frame body");
    (head[0], body)
}

/// A scripted publisher: a listener whose connections the test drives.
struct Hostile {
    listener: TcpListener,
}

impl Hostile {
    async fn bind() -> Hostile {
        Hostile {
            listener: TcpListener::bind("127.0.0.1:0").await.expect("bind"),
        }
    }

    fn endpoint(&self) -> String {
        format!(
            "tcp://{}",
            self.listener.local_addr().expect("local address")
        )
    }

    async fn accept(&self) -> TcpStream {
        let (s, _) = tokio::time::timeout(WAIT, self.listener.accept())
            .await
            .expect("the subscriber connects")
            .expect("accept");
        s
    }

    /// Accept and complete the handshake as a PUB: the subscriber is subscribed after this.
    async fn subscribed(&self) -> TcpStream {
        let mut s = self.accept().await;
        s.write_all(&greeting(b"NULL")).await.expect("greeting");
        s.write_all(&ready_pub()).await.expect("READY");
        let mut theirs = [0u8; 64];
        s.read_exact(&mut theirs).await.expect("their greeting");
        assert_eq!(
            (theirs[0], theirs[9], &theirs[12..16]),
            (0xff, 0x7f, &b"NULL"[..])
        );
        let (flags, ready) = read_frame(&mut s).await;
        assert_eq!(flags, 0x04);
        assert!(ready.starts_with(b"\x05READY"), "{ready:?}");
        let (flags, subscription) = read_frame(&mut s).await;
        assert_eq!((flags, &subscription[..]), (0, &b"\x01kv"[..]));
        s
    }
}

/// A `serve` with one worker whose events come from `hostile`; `worker` and `kv` are extra
/// YAML lines of the worker and of its `kv_events`.
async fn router(
    test: &str,
    engine: &Engine,
    hostile: &Hostile,
    worker: &str,
    kv: &str,
) -> TestRouter {
    let yaml = format!(
        "block_size: 4\nserve:\n  health:\n    interval_ms: 200\n  tokenizer: remote\n\
         workers:\n  - id: 1\n    url: {}\n{worker}    kv_events:\n      endpoint: {}\n      \
         topic: kv\n{kv}",
        engine.url(),
        hostile.endpoint()
    );
    TestRouter::start(test, &yaml).await
}

fn connected(router: &TestRouter) -> f64 {
    router.metric("router_kv_subscriber_connected{worker=\"1\",dp_rank=\"0\"}")
}

fn protocol_errors(router: &TestRouter, kind: &str) -> f64 {
    router.metric(&format!(
        "router_kv_protocol_errors_total{{worker=\"1\",dp_rank=\"0\",kind=\"{kind}\"}}"
    ))
}

/// `serve` answers HTTP.
async fn alive(router: &TestRouter) {
    let response = tokio::time::timeout(WAIT, client().get(router.url("/metrics")).send())
        .await
        .expect("serve answers in time")
        .expect("serve answers");
    assert_eq!(response.status(), 200);
}

/// Peak RSS of this process in bytes (`VmHWM`), 0 where unknown.
fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// Reset the peak RSS to the current RSS (Linux `clear_refs` 5), if allowed.
fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// After a violation: the subscriber counted `kind`, dropped the connection (gauge 0) and,
/// once accepted again, is subscribed (gauge 1); `serve` answers throughout.
async fn dropped_and_back(router: &TestRouter, hostile: &Hostile, kind: &str) -> TcpStream {
    assert!(
        eventually(WAIT, || protocol_errors(router, kind) >= 1.0).await,
        "no protocol error of kind {kind}:\n{}",
        router.handle.metrics_text()
    );
    assert!(eventually(WAIT, || connected(router) == 0.0).await);
    alive(router).await;
    let again = hostile.subscribed().await;
    assert!(eventually(WAIT, || connected(router) == 1.0).await);
    again
}

fn payload(events: Vec<Value>) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(
        &mut out,
        &Value::Array(vec![Value::F64(1.0), Value::Array(events), Value::from(0)]),
    )
    .expect("encode");
    out
}

async fn publish(s: &mut TcpStream, seq: u64, payload: &[u8]) {
    let mut wire = frame(0x01, b"kv");
    wire.extend(frame(0x01, &seq.to_be_bytes()));
    wire.extend(frame(0, payload));
    s.write_all(&wire).await.expect("publish");
}

/// A frame header declaring 2^62 bytes (26 bytes on the wire with the topic frame): the
/// zeromq crate reserved that much and aborted the process. Now: dropped, counted, back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_declaring_2_to_the_62_bytes_is_refused_on_its_header() {
    let _serial = SERIAL.lock().await;
    for declared in [1u64 << 62, u64::MAX] {
        let engine = Engine::start(1).await;
        let hostile = Hostile::bind().await;
        let router = router("hostile_kv_huge_frame", &engine, &hostile, "", "").await;
        let mut s = hostile.subscribed().await;
        assert!(eventually(WAIT, || connected(&router) == 1.0).await);
        reset_peak_rss();
        let before = peak_rss();
        let mut wire = frame(0x01, b"kv");
        wire.push(0x02);
        wire.extend_from_slice(&declared.to_be_bytes());
        s.write_all(&wire).await.expect("send the header");
        let _again = dropped_and_back(&router, &hostile, "too_large").await;
        // Nothing near the declared size was reserved (the bug: an abort at 2^62).
        let grown = peak_rss().saturating_sub(before);
        assert!(grown < 64 * MIB, "peak RSS grew {grown} bytes");
        router.stop().await;
    }
}

/// `[ts, [nil x N]]` of 16 MiB: about 250 bytes of memory per byte received before (16 MiB
/// -> 3.8 GB). Now the events decode one at a time, each nil an undecodable event counted,
/// the connection kept; and a message over the 16 MiB payload limit is refused on its header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_mib_of_nil_events_costs_about_its_own_size() {
    let _serial = SERIAL.lock().await;
    let engine = Engine::start(1).await;
    let hostile = Hostile::bind().await;
    let router = router("hostile_kv_nils", &engine, &hostile, "", "").await;
    let mut s = hostile.subscribed().await;
    assert!(eventually(WAIT, || connected(&router) == 1.0).await);
    // Array32 header, then nils up to 16 MiB of payload in all.
    let total = router_host::serve::kv_events::decode::MAX_PAYLOAD_BYTES;
    let header = [0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd];
    let n = total - header.len() - 4;
    let mut body = header.to_vec();
    body.extend_from_slice(&(n as u32).to_be_bytes());
    body.resize(total, 0xc0);
    reset_peak_rss();
    let before = peak_rss();
    publish(&mut s, 0, &body).await;
    drop(body);
    let sample = "router_kv_event_decode_errors_total{worker=\"1\",dp_rank=\"0\",kind=\"event\"}";
    assert!(
        eventually(Duration::from_secs(30), || router.metric(sample)
            == n as f64)
        .await,
        "{}",
        router.metric(sample)
    );
    // The message's bytes (and the test's own copy, sent before) and the read buffer's growth:
    // a few times 16 MiB, against ~4 GB before.
    let grown = peak_rss().saturating_sub(before);
    assert!(grown < 256 * MIB, "peak RSS grew {} MiB", grown / MIB);
    assert_eq!(connected(&router), 1.0);
    alive(&router).await;

    // One byte over the limit: refused on the declared length, connection dropped.
    let mut wire = frame(0x01, b"kv");
    wire.extend(frame(0x01, &1u64.to_be_bytes()));
    wire.push(0x02);
    wire.extend_from_slice(&(total as u64 + (64 << 10) + 1).to_be_bytes());
    s.write_all(&wire).await.expect("send");
    let _again = dropped_and_back(&router, &hostile, "too_large").await;
    router.stop().await;
}

/// A peer that sends garbage without end instead of a greeting, and one that sends frames
/// with reserved flag bits after a good handshake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endless_garbage_is_refused_at_its_first_bytes() {
    let _serial = SERIAL.lock().await;
    let engine = Engine::start(1).await;
    let hostile = Hostile::bind().await;
    let router = router("hostile_kv_garbage", &engine, &hostile, "", "").await;
    let garbage = tokio::spawn({
        let mut s = hostile.accept().await;
        async move {
            let chunk = vec![0x47u8; 64 << 10];
            // Until the subscriber hangs up (bounded: 1 GiB).
            for _ in 0..16_384 {
                if s.write_all(&chunk).await.is_err() {
                    return true;
                }
            }
            false
        }
    });
    reset_peak_rss();
    let before = peak_rss();
    assert!(eventually(WAIT, || protocol_errors(&router, "greeting") >= 1.0).await);
    assert!(
        tokio::time::timeout(WAIT, garbage)
            .await
            .expect("the subscriber hangs up")
            .expect("writer"),
        "the subscriber kept reading garbage"
    );
    let mut s = hostile.subscribed().await;
    assert!(eventually(WAIT, || connected(&router) == 1.0).await);
    s.write_all(&[0xf0, 3, 1, 2, 3]).await.expect("send");
    let _again = dropped_and_back(&router, &hostile, "frame").await;
    assert!(peak_rss().saturating_sub(before) < 64 * MIB);
    router.stop().await;
}

/// A publisher that asks for the CURVE mechanism, and one whose READY says it is not a PUB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_mechanism_or_socket_type_is_refused() {
    let _serial = SERIAL.lock().await;
    let engine = Engine::start(1).await;
    let hostile = Hostile::bind().await;
    let router = router("hostile_kv_mechanism", &engine, &hostile, "", "").await;
    let mut s = hostile.accept().await;
    s.write_all(&greeting(b"CURVE")).await.expect("greeting");
    let _again = dropped_and_back(&router, &hostile, "mechanism").await;
    drop(s);
    drop(_again);
    let mut s = hostile.accept().await;
    s.write_all(&greeting(b"NULL")).await.expect("greeting");
    s.write_all(&frame(
        0x04,
        b"\x05READY\x0bSocket-Type\x00\x00\x00\x04PULL",
    ))
    .await
    .expect("READY");
    let _again = dropped_and_back(&router, &hostile, "handshake").await;
    router.stop().await;
}

/// A publisher that stops in the middle of a frame: dropped after the stall limit (3 s), not
/// waited for forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_stalled_mid_frame_is_dropped() {
    let _serial = SERIAL.lock().await;
    let engine = Engine::start(1).await;
    let hostile = Hostile::bind().await;
    let router = router("hostile_kv_stall", &engine, &hostile, "", "").await;
    let mut s = hostile.subscribed().await;
    assert!(eventually(WAIT, || connected(&router) == 1.0).await);
    let mut wire = frame(0x01, b"kv");
    wire.extend_from_slice(&[0x00, 200, 1, 2, 3]);
    s.write_all(&wire).await.expect("send");
    let _again = dropped_and_back(&router, &hostile, "stalled").await;
    drop(s);
    router.stop().await;
}

fn chain(first: u64, blocks: u64) -> Value {
    let s = |v: &str| Value::from(v);
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            Value::Array((first..first + blocks).map(Value::from).collect()),
        ),
        (s("parent_block_hash"), Value::Nil),
        (
            s("token_ids"),
            Value::Array(
                (first * 4..(first + blocks) * 4)
                    .map(|t| Value::from(t as u32))
                    .collect(),
            ),
        ),
        (s("block_size"), Value::from(4)),
        (s("medium"), s("GPU")),
    ])
}

/// An engine that reports 100 blocks of KV capacity and stores 2,000: the row's index stays
/// within 100 + 100/4 + 64 = 189 blocks, the overflow counted; `max_indexed_blocks` bounds it
/// without a known capacity, and with a larger one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_storing_far_over_its_capacity_leaves_the_index_bounded() {
    let _serial = SERIAL.lock().await;
    for (worker, kv, limit, reason) in [
        ("    total_kv_blocks: 100\n", "", 189.0, "over_capacity"),
        ("", "      max_indexed_blocks: 300\n", 300.0, "over_limit"),
        // A capacity the engine claims cannot raise the bound.
        (
            "    total_kv_blocks: 100000\n",
            "      max_indexed_blocks: 300\n",
            300.0,
            "over_limit",
        ),
    ] {
        let engine = Engine::start(1).await;
        let hostile = Hostile::bind().await;
        let router = router("hostile_kv_capacity", &engine, &hostile, worker, kv).await;
        let mut s = hostile.subscribed().await;
        assert!(eventually(WAIT, || connected(&router) == 1.0).await);
        let blocks = "router_kv_index_blocks{worker=\"1\",dp_rank=\"0\",tier=\"device\"}";
        let mut max_seen: f64 = 0.0;
        for seq in 0..40u64 {
            publish(&mut s, seq, &payload(vec![chain(1 + seq * 50, 50)])).await;
        }
        let batches = "router_kv_event_batches_total{worker=\"1\",dp_rank=\"0\"}";
        assert!(
            eventually(WAIT, || {
                max_seen = max_seen.max(router.metric(blocks));
                router.metric(batches) == 40.0
            })
            .await
        );
        let held = router
            .handle
            .loaded()
            .host
            .core()
            .kv_index()
            .holdings_in(router_core::kv_index::Tier::Device);
        assert!(held as f64 <= limit, "{held} blocks indexed, limit {limit}");
        assert!(max_seen <= limit, "{max_seen}");
        let evicted = router.metric(&format!(
            "router_kv_index_evictions_total{{worker=\"1\",dp_rank=\"0\",tier=\"device\",\
             reason=\"{reason}\"}}"
        ));
        assert_eq!(evicted + router.metric(blocks), 2000.0);
        assert!(evicted >= 1500.0, "{evicted}");
        router.stop().await;
    }
}
