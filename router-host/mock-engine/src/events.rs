//! KV-cache events the way vLLM publishes them (docs/serve.md, "KV-cache events"): block hashes,
//! msgpack batches `[ts, events, data_parallel_rank]` in the map or the legacy array form, a
//! ZMQ PUB socket sending `[topic, seq (8 bytes BE), payload]`, and a ROUTER socket answering
//! replay requests from a buffer of recent batches.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use rmpv::Value;
use sha2::{Digest, Sha256};
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

/// How events are written.
#[derive(Debug, Clone, Copy, Default)]
pub struct Format {
    /// Positional arrays (vLLM before mid-2026) instead of maps tagged `type`.
    pub legacy: bool,
    /// 32-byte hashes instead of u64 integers.
    pub bytes_hashes: bool,
}

/// A block's engine hash: sha256 over the parent's digest and the block's tokens (vLLM hashes a
/// pickle with sha256; this is not the router's rule, so the router has to go through its
/// engine-hash map, as with real vLLM). A request's `cache_salt` goes into its first block, as
/// vLLM puts it in that block's extra keys. The model keys blocks by the first 8 bytes.
pub fn block_digest(parent: Option<&[u8; 32]>, tokens: &[u32], salt: Option<&str>) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(b"mock-engine block v1");
    match (parent, salt) {
        (Some(p), _) => h.update(p),
        (None, None) => h.update([0u8; 32]),
        (None, Some(salt)) => {
            h.update([1u8; 32]);
            h.update((salt.len() as u64).to_le_bytes());
            h.update(salt.as_bytes());
        }
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The model's id of a digest (the engine's u64 hash).
pub fn model_id(digest: &[u8; 32]) -> u64 {
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// One event, before encoding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Stored {
        hashes: Vec<[u8; 32]>,
        parent: Option<[u8; 32]>,
        tokens: Vec<u32>,
        block_size: u32,
        /// The `cache_salt` of a first block (its extra key).
        salt: Option<String>,
    },
    Removed {
        hash: [u8; 32],
    },
    AllCleared,
}

fn s(v: &str) -> Value {
    Value::from(v)
}

impl Format {
    fn hash(&self, digest: &[u8; 32]) -> Value {
        if self.bytes_hashes {
            Value::Binary(digest.to_vec())
        } else {
            Value::from(model_id(digest))
        }
    }

    fn event(&self, event: &Event) -> Value {
        match event {
            Event::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                salt,
            } => {
                let hashes = Value::Array(hashes.iter().map(|h| self.hash(h)).collect());
                let parent = parent.as_ref().map_or(Value::Nil, |p| self.hash(p));
                let n = match &hashes {
                    Value::Array(list) => list.len(),
                    _ => 0,
                };
                let tokens = Value::Array(tokens.iter().map(|&t| Value::from(t)).collect());
                let mut extra = vec![Value::Nil; n];
                if let (Some(salt), Some(first)) = (salt, extra.first_mut()) {
                    *first = Value::Array(vec![Value::from(salt.as_str())]);
                }
                let extra = Value::Array(extra);
                if self.legacy {
                    // type, block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                    // medium, lora_name, extra_keys
                    Value::Array(vec![
                        s("BlockStored"),
                        hashes,
                        parent,
                        tokens,
                        Value::from(*block_size),
                        Value::Nil,
                        s("GPU"),
                        Value::Nil,
                        extra,
                    ])
                } else {
                    Value::Map(vec![
                        (s("type"), s("BlockStored")),
                        (s("block_hashes"), hashes),
                        (s("parent_block_hash"), parent),
                        (s("token_ids"), tokens),
                        (s("block_size"), Value::from(*block_size)),
                        (s("lora_id"), Value::Nil),
                        (s("medium"), s("GPU")),
                        (s("lora_name"), Value::Nil),
                        (s("extra_keys"), extra),
                        (s("group_idx"), Value::from(0)),
                        (s("kv_cache_spec_kind"), s("full_attention")),
                    ])
                }
            }
            Event::Removed { hash } => {
                let hashes = Value::Array(vec![self.hash(hash)]);
                if self.legacy {
                    Value::Array(vec![s("BlockRemoved"), hashes, s("GPU")])
                } else {
                    Value::Map(vec![
                        (s("type"), s("BlockRemoved")),
                        (s("block_hashes"), hashes),
                        (s("medium"), s("GPU")),
                        (s("group_idx"), Value::from(0)),
                    ])
                }
            }
            Event::AllCleared => {
                if self.legacy {
                    Value::Array(vec![s("AllBlocksCleared")])
                } else {
                    Value::Map(vec![(s("type"), s("AllBlocksCleared"))])
                }
            }
        }
    }

    /// The msgpack payload `[ts, events, data_parallel_rank]`.
    pub fn payload(&self, ts: f64, events: &[Event], rank: u32) -> Vec<u8> {
        let value = Value::Array(vec![
            Value::F64(ts),
            Value::Array(events.iter().map(|e| self.event(e)).collect()),
            Value::from(rank),
        ]);
        let mut out = Vec::new();
        // Writing to a Vec cannot fail.
        let _ = rmpv::encode::write_value(&mut out, &value);
        out
    }
}

/// Seconds since the Unix epoch (vLLM's `time.time()`).
pub fn wall_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The endpoint of rank `rank`: `tcp://HOST:PORT` with PORT + rank. `base` is rank 0's bound
/// port when the flag said port 0.
pub fn rank_endpoint(endpoint: &str, rank: u32, base: Option<u16>) -> Result<String, String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("`{endpoint}` is not tcp://HOST:PORT (only TCP is supported)"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("`{endpoint}` has no :PORT"))?;
    let port: u16 = port
        .parse()
        .map_err(|err| format!("`{endpoint}`: `{port}` is not a port number ({err})"))?;
    let port = match (port, base) {
        (0, Some(base)) => base,
        (p, _) => p,
    };
    let port = if port == 0 {
        0
    } else {
        port.checked_add(u16::try_from(rank).unwrap_or(u16::MAX))
            .ok_or_else(|| format!("`{endpoint}`: port {port} + rank {rank} is over 65535"))?
    };
    // vLLM binds `*`; the ZMQ library here wants an address.
    let host = if host == "*" { "0.0.0.0" } else { host };
    Ok(format!("tcp://{host}:{port}"))
}

/// With port 0 and several ranks, a base port whose next `count` ports are free too (rank r binds
/// base + r, so the ports must be consecutive); the endpoint unchanged otherwise.
pub fn free_base(endpoint: &str, count: u32) -> Result<String, String> {
    let Some((head, port)) = endpoint.rsplit_once(':') else {
        return Ok(endpoint.to_owned());
    };
    if port != "0" || count <= 1 {
        return Ok(endpoint.to_owned());
    }
    let host = head.strip_prefix("tcp://").unwrap_or(head);
    let host = if host == "*" { "0.0.0.0" } else { host };
    for _ in 0..50 {
        let first = std::net::TcpListener::bind((host, 0))
            .map_err(|err| format!("`{endpoint}`: cannot bind {host}: {err}"))?;
        let base = first
            .local_addr()
            .map_err(|err| format!("`{endpoint}`: {err}"))?
            .port();
        let Some(last) = base.checked_add(u16::try_from(count - 1).unwrap_or(u16::MAX)) else {
            continue;
        };
        let rest: Result<Vec<_>, _> = (base + 1..=last)
            .map(|p| std::net::TcpListener::bind((host, p)))
            .collect();
        if rest.is_ok() {
            return Ok(format!("{head}:{base}"));
        }
    }
    Err(format!(
        "`{endpoint}`: found no {count} consecutive free ports"
    ))
}

fn bound_port(endpoint: &zeromq::Endpoint) -> Option<u16> {
    match endpoint {
        zeromq::Endpoint::Tcp(_, port) => Some(*port),
        _ => None,
    }
}

pub struct PublisherOptions {
    pub endpoint: String,
    pub replay: Option<String>,
    pub topic: String,
    pub buffer: usize,
    pub drop_live: Vec<u64>,
}

/// A started publisher: send `(seq, payload)` to it.
pub struct Publisher {
    pub sender: mpsc::UnboundedSender<(u64, Bytes)>,
    pub endpoint: String,
    pub port: u16,
    pub replay_endpoint: Option<String>,
    pub replay_port: Option<u16>,
    /// The socket tasks, aborted when the engine stops.
    pub tasks: Vec<tokio::task::JoinHandle<()>>,
}

type Buffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

impl Publisher {
    /// Bind the PUB socket (and the ROUTER socket), and start their tasks.
    pub async fn start(options: PublisherOptions) -> Result<Publisher, crate::Error> {
        let mut socket = zeromq::PubSocket::new();
        let bound = socket.bind(&options.endpoint).await.map_err(|err| {
            crate::Error::KvEvents(format!(
                "cannot bind the event publisher on {}: {err}",
                options.endpoint
            ))
        })?;
        let port = bound_port(&bound).unwrap_or(0);
        let shown = |endpoint: &str, port: u16| -> String {
            let host = endpoint
                .strip_prefix("tcp://")
                .and_then(|r| r.rsplit_once(':'))
                .map_or("127.0.0.1", |(h, _)| h);
            format!("tcp://{host}:{port}")
        };
        let endpoint = shown(&options.endpoint, port);
        let buffer: Buffer = Arc::new(Mutex::new(VecDeque::new()));
        let (mut replay_endpoint, mut replay_port) = (None, None);
        let mut tasks = Vec::new();
        if let Some(replay) = &options.replay {
            let mut router = zeromq::RouterSocket::new();
            let bound = router.bind(replay).await.map_err(|err| {
                crate::Error::Replay(format!("cannot bind the replay socket on {replay}: {err}"))
            })?;
            let p = bound_port(&bound).unwrap_or(0);
            replay_endpoint = Some(shown(replay, p));
            replay_port = Some(p);
            tasks.push(tokio::spawn(serve_replay(
                router,
                buffer.clone(),
                Bytes::from(options.topic.clone().into_bytes()),
            )));
        }
        let (sender, receiver) = mpsc::unbounded_channel();
        tasks.push(tokio::spawn(publish(socket, receiver, options, buffer)));
        Ok(Publisher {
            sender,
            endpoint,
            port,
            replay_endpoint,
            replay_port,
            tasks,
        })
    }
}

fn seq_frame(seq: u64) -> Bytes {
    Bytes::copy_from_slice(&seq.to_be_bytes())
}

async fn publish(
    mut socket: zeromq::PubSocket,
    mut receiver: mpsc::UnboundedReceiver<(u64, Bytes)>,
    options: PublisherOptions,
    buffer: Buffer,
) {
    let topic = Bytes::from(options.topic.into_bytes());
    let mut warned = false;
    while let Some((seq, payload)) = receiver.recv().await {
        {
            let mut buffer = buffer
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            buffer.push_back((seq, payload.clone()));
            while buffer.len() > options.buffer {
                buffer.pop_front();
            }
        }
        if options.drop_live.contains(&seq) {
            continue;
        }
        let mut message = ZmqMessage::from(topic.clone());
        message.push_back(seq_frame(seq));
        message.push_back(payload);
        if let Err(err) = socket.send(message).await {
            if !warned {
                tracing::warn!(error = %err, "mock-engine: cannot publish a KV-event batch");
                warned = true;
            }
        }
    }
}

/// vLLM's replay protocol: a DEALER sends `["", start_seq (8 bytes BE)]`; the answer is every
/// buffered batch from `start_seq` on as `["", topic, seq, payload]` (vLLM 0.33's form), then
/// `["", u64::MAX, ""]`.
async fn serve_replay(mut socket: zeromq::RouterSocket, buffer: Buffer, topic: Bytes) {
    loop {
        let request = match socket.recv().await {
            Ok(message) => message.into_vec(),
            Err(err) => {
                tracing::warn!(error = %err, "mock-engine: the replay socket failed");
                return;
            }
        };
        // [identity, "", start] (or [identity, start]).
        let Some(identity) = request.first().cloned() else {
            continue;
        };
        let Some(start) = request
            .last()
            .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
            .map(u64::from_be_bytes)
        else {
            tracing::warn!(
                frames = request.len(),
                "mock-engine: a replay request without an 8-byte start sequence"
            );
            continue;
        };
        let batches: Vec<(u64, Bytes)> = buffer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let frames = vec![
                identity.clone(),
                Bytes::new(),
                topic.clone(),
                seq_frame(seq),
                payload,
            ];
            if let Ok(message) = ZmqMessage::try_from(frames) {
                if socket.send(message).await.is_err() {
                    break;
                }
            }
        }
        let end = vec![identity, Bytes::new(), seq_frame(u64::MAX), Bytes::new()];
        if let Ok(message) = ZmqMessage::try_from(end) {
            let _ = socket.send(message).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use router_runtime::kv_events::decode::{decode_payload, EngineEvent, EngineHash};

    #[test]
    fn both_forms_decode_with_the_routers_decoder() {
        let a = block_digest(None, &[1, 2, 3, 4], None);
        let b = block_digest(Some(&a), &[5, 6, 7, 8], None);
        assert_ne!(a, block_digest(None, &[1, 2, 3, 4], Some("s")));
        let events = vec![
            Event::Stored {
                hashes: vec![a, b],
                parent: None,
                tokens: (1..=8).collect(),
                block_size: 4,
                salt: None,
            },
            Event::Stored {
                hashes: vec![a],
                parent: None,
                tokens: (1..=4).collect(),
                block_size: 4,
                salt: Some("tenant-1".into()),
            },
            Event::Removed { hash: b },
            Event::AllCleared,
        ];
        for (legacy, bytes_hashes) in [(false, false), (true, false), (false, true), (true, true)] {
            let format = Format {
                legacy,
                bytes_hashes,
            };
            let batch = decode_payload(&format.payload(12.5, &events, 3)).expect("decodes");
            assert_eq!((batch.ts, batch.dp_rank), (Some(12.5), Some(3)));
            let hash = |d: &[u8; 32]| {
                if bytes_hashes {
                    EngineHash::Bytes(*d)
                } else {
                    EngineHash::Int(model_id(d))
                }
            };
            let Ok(EngineEvent::BlockStored(stored)) = &batch.events[0] else {
                panic!("not a BlockStored: {:?}", batch.events[0]);
            };
            assert_eq!(stored.block_hashes, vec![hash(&a), hash(&b)]);
            assert_eq!(stored.parent_block_hash, None);
            assert_eq!(stored.token_ids, (1..=8).collect::<Vec<u32>>());
            assert_eq!(stored.block_size, Some(4));
            assert!(stored.plain_keys());
            assert_eq!(stored.medium.as_deref(), Some("GPU"));
            let Ok(EngineEvent::BlockStored(salted)) = &batch.events[1] else {
                panic!("not a BlockStored: {:?}", batch.events[1]);
            };
            assert!(!salted.plain_keys());
            assert_eq!(
                batch.events[2],
                Ok(EngineEvent::BlockRemoved {
                    block_hashes: vec![hash(&b)],
                    medium: Some("GPU".into()),
                    group_idx: if legacy { None } else { Some(0) },
                })
            );
            assert_eq!(
                batch.events[3],
                Ok(EngineEvent::AllBlocksCleared { medium: None })
            );
        }
    }

    #[test]
    fn rank_endpoints() {
        assert_eq!(
            rank_endpoint("tcp://*:5557", 2, None).unwrap(),
            "tcp://0.0.0.0:5559"
        );
        assert_eq!(
            rank_endpoint("tcp://127.0.0.1:0", 0, None).unwrap(),
            "tcp://127.0.0.1:0"
        );
        assert_eq!(
            rank_endpoint("tcp://127.0.0.1:0", 1, Some(40000)).unwrap(),
            "tcp://127.0.0.1:40001"
        );
        assert!(rank_endpoint("ipc:///tmp/x", 0, None).is_err());
        assert!(rank_endpoint("tcp://127.0.0.1:65535", 1, None).is_err());
        assert!(rank_endpoint("tcp://127.0.0.1", 0, None).is_err());
        assert_eq!(
            free_base("tcp://127.0.0.1:5557", 4).unwrap(),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(
            free_base("tcp://127.0.0.1:0", 1).unwrap(),
            "tcp://127.0.0.1:0"
        );
        let base = free_base("tcp://127.0.0.1:0", 3).unwrap();
        let port: u16 = base.rsplit_once(':').unwrap().1.parse().unwrap();
        assert_ne!(port, 0);
    }
}
