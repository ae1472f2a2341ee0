//! The client side of ZMTP 3.0 (ZeroMQ's wire protocol, RFC 23) that the KV-event subscribers
//! need: a SUB to an engine's PUB, a DEALER to its ROUTER replay socket, over a tokio
//! `TcpStream`, NULL mechanism only.
//!
//! Written here rather than taken from a crate because no pure-Rust ZeroMQ crate bounds what a
//! peer can make it allocate: their decoders reserve a frame's declared length before any of it
//! arrives. Here every frame header is checked against [`Limits`] on its *declared* length,
//! before anything is read or reserved, and the read buffer grows only with bytes received.
//!
//! What is spoken: our greeting (version 3.0, `NULL`, as client), READY with `Socket-Type`
//! (libzmq and pyzmq peers of 3.1 fall back to 3.0 for us), a subscription as a message frame
//! `0x01 + topic`, PONG to a PING, multipart messages. A peer that sends anything else (a bad
//! greeting, another mechanism, an ERROR or unknown command, an oversized frame or message,
//! reserved flag bits) is a [`ProtocolError`] and the caller drops the connection.

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;
const GREETING_LEN: usize = 64;
/// Most bytes read per socket read (the buffer grows with what arrives, never by what a header
/// declares).
const READ_CHUNK: usize = 64 << 10;
/// Most bytes of one command (READY carries a few short properties).
pub const MAX_COMMAND_BYTES: usize = 16 << 10;

/// What a peer may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes of one message, all its frames together (so of any one frame too).
    pub max_message: usize,
    /// Most frames in one message.
    pub max_frames: usize,
    /// Longest wait for the rest of a message (or of the handshake) once it started.
    pub stall: Duration,
}

/// Our side of the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SocketType {
    Sub,
    Dealer,
}

impl SocketType {
    fn name(self) -> &'static [u8] {
        match self {
            SocketType::Sub => b"SUB",
            SocketType::Dealer => b"DEALER",
        }
    }

    /// The peer socket types we can talk to (RFC 28, 29).
    fn accepts(self, peer: &[u8]) -> bool {
        match self {
            SocketType::Sub => peer == b"PUB" || peer == b"XPUB",
            SocketType::Dealer => matches!(peer, b"ROUTER" | b"DEALER" | b"REP"),
        }
    }
}

/// Why a connection was dropped.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("endpoint `{0}` is not tcp://HOST:PORT")]
    Endpoint(String),
    #[error("connect: {0}")]
    Connect(std::io::Error),
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    #[error("the peer closed the connection")]
    Closed,
    #[error("bad greeting: {0}")]
    Greeting(String),
    #[error("the peer wants security mechanism `{0}`; only NULL is supported")]
    Mechanism(String),
    #[error("bad handshake: {0}")]
    Handshake(String),
    #[error("frame flags {0:#04x} have reserved bits set")]
    FrameFlags(u8),
    #[error("a frame declares {declared} bytes; the limit is {limit}")]
    FrameTooLarge { declared: u64, limit: usize },
    #[error("a message would exceed {limit} bytes")]
    MessageTooLarge { limit: usize },
    #[error("a message has more than {0} frames")]
    TooManyFrames(usize),
    #[error("command: {0}")]
    Command(String),
    #[error("the peer sent ERROR: {0}")]
    PeerError(String),
    #[error("no byte for {0:?} in the middle of a message or handshake")]
    Stalled(Duration),
}

impl ProtocolError {
    /// The `kind` label of a protocol violation; `None` for what is not the peer's fault to
    /// the protocol (connection refused, reset, closed).
    pub fn kind(&self) -> Option<&'static str> {
        Some(match self {
            ProtocolError::Endpoint(_)
            | ProtocolError::Connect(_)
            | ProtocolError::Io(_)
            | ProtocolError::Closed => return None,
            ProtocolError::Greeting(_) => "greeting",
            ProtocolError::Mechanism(_) => "mechanism",
            ProtocolError::Handshake(_) => "handshake",
            ProtocolError::FrameFlags(_) => "frame",
            ProtocolError::FrameTooLarge { .. } | ProtocolError::MessageTooLarge { .. } => {
                "too_large"
            }
            ProtocolError::TooManyFrames(_) => "too_many_frames",
            ProtocolError::Command(_) => "command",
            ProtocolError::PeerError(_) => "peer_error",
            ProtocolError::Stalled(_) => "stalled",
        })
    }
}

/// Our greeting: signature, version 3.0, NULL, as client, filler.
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = 0xff;
    g[9] = 0x7f;
    g[10] = 3;
    g[11] = 0;
    g[12..16].copy_from_slice(b"NULL");
    g
}

/// Check the peer's greeting.
pub fn check_greeting(g: &[u8]) -> Result<(), ProtocolError> {
    if g.len() < GREETING_LEN {
        return Err(ProtocolError::Greeting(format!("{} bytes", g.len())));
    }
    if g[0] != 0xff || g[9] & 0x01 == 0 {
        return Err(ProtocolError::Greeting("no ZMTP signature".into()));
    }
    if g[10] < 3 {
        return Err(ProtocolError::Greeting(format!(
            "version {}.{}, need 3.0 or later",
            g[10], g[11]
        )));
    }
    let mechanism = &g[12..32];
    let end = mechanism.iter().position(|&b| b == 0).unwrap_or(20);
    if &mechanism[..end] != b"NULL" || mechanism[end..].iter().any(|&b| b != 0) {
        return Err(ProtocolError::Mechanism(
            String::from_utf8_lossy(&mechanism[..end]).into_owned(),
        ));
    }
    Ok(())
}

/// One frame header: flags and the declared body length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub more: bool,
    pub command: bool,
    /// Bytes of the header itself (2 or 9).
    pub header_len: usize,
    pub size: usize,
}

/// Parse a frame header at the start of `buf` (`None`: not all of it arrived), checking the
/// declared size against `limit` before anything else happens.
pub fn parse_header(buf: &[u8], limit: usize) -> Result<Option<Header>, ProtocolError> {
    let Some(&flags) = buf.first() else {
        return Ok(None);
    };
    if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 {
        return Err(ProtocolError::FrameFlags(flags));
    }
    let command = flags & FLAG_COMMAND != 0;
    let (header_len, declared) = if flags & FLAG_LONG != 0 {
        let Some(bytes) = buf.get(1..9) else {
            return Ok(None);
        };
        let mut be = [0u8; 8];
        be.copy_from_slice(bytes);
        (9, u64::from_be_bytes(be))
    } else {
        let Some(&size) = buf.get(1) else {
            return Ok(None);
        };
        (2, u64::from(size))
    };
    let limit = if command {
        limit.min(MAX_COMMAND_BYTES)
    } else {
        limit
    };
    let size = usize::try_from(declared)
        .ok()
        .filter(|&s| s <= limit)
        .ok_or(ProtocolError::FrameTooLarge { declared, limit })?;
    Ok(Some(Header {
        more: flags & FLAG_MORE != 0 && !command,
        command,
        header_len,
        size,
    }))
}

/// A command from the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// READY with its properties.
    Ready(Vec<(String, Bytes)>),
    /// PING: answer PONG with its context.
    Ping(Bytes),
    /// PONG (to a PING we never send; ignored).
    Pong,
}

/// Decode a command body.
pub fn parse_command(mut body: Bytes) -> Result<Command, ProtocolError> {
    let bad = |what: &str| ProtocolError::Command(what.to_owned());
    if body.is_empty() {
        return Err(bad("empty"));
    }
    let name_len = usize::from(body.get_u8());
    if body.len() < name_len {
        return Err(bad("truncated name"));
    }
    let name = body.split_to(name_len);
    match &name[..] {
        b"READY" => {
            let mut properties = Vec::new();
            while !body.is_empty() {
                let key_len = usize::from(body.get_u8());
                if body.len() < key_len + 4 {
                    return Err(bad("truncated READY property"));
                }
                let key = String::from_utf8_lossy(&body.split_to(key_len)).into_owned();
                let value_len = body.get_u32() as usize;
                if body.len() < value_len {
                    return Err(bad("truncated READY property value"));
                }
                properties.push((key, body.split_to(value_len)));
            }
            Ok(Command::Ready(properties))
        }
        b"PING" => {
            // ttl (2 bytes), then the context to echo.
            if body.len() < 2 {
                return Err(bad("truncated PING"));
            }
            body.advance(2);
            Ok(Command::Ping(body))
        }
        b"PONG" => Ok(Command::Pong),
        b"ERROR" => {
            let reason = match body.first() {
                Some(&n) if body.len() > usize::from(n) => {
                    String::from_utf8_lossy(&body[1..=usize::from(n)]).into_owned()
                }
                _ => String::from_utf8_lossy(&body).into_owned(),
            };
            Err(ProtocolError::PeerError(reason))
        }
        other => Err(ProtocolError::Command(format!(
            "unknown command `{}`",
            String::from_utf8_lossy(other)
        ))),
    }
}

/// What the decoder produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    Message(Vec<Bytes>),
    Command(Command),
}

/// Frames → messages and commands, from bytes as they arrive (no I/O: see [`Connection`]).
#[derive(Debug)]
pub struct Decoder {
    limits: Limits,
    parts: Vec<Bytes>,
    /// Bytes of `parts`.
    message_bytes: usize,
}

impl Decoder {
    pub fn new(limits: Limits) -> Decoder {
        Decoder {
            limits,
            parts: Vec::new(),
            message_bytes: 0,
        }
    }

    /// Whether a message is partly received.
    pub fn mid_message(&self) -> bool {
        !self.parts.is_empty()
    }

    /// Take the next item from the front of `buf`, or `None` when more bytes are needed.
    pub fn decode(&mut self, buf: &mut BytesMut) -> Result<Option<Item>, ProtocolError> {
        loop {
            // A frame may be at most what is left of the message budget.
            let room = self.limits.max_message - self.message_bytes;
            let Some(header) = parse_header(buf, room).map_err(|err| match err {
                ProtocolError::FrameTooLarge { .. } if self.message_bytes > 0 => {
                    ProtocolError::MessageTooLarge {
                        limit: self.limits.max_message,
                    }
                }
                other => other,
            })?
            else {
                return Ok(None);
            };
            if buf.len() < header.header_len + header.size {
                return Ok(None);
            }
            buf.advance(header.header_len);
            let body = buf.split_to(header.size).freeze();
            if header.command {
                if self.mid_message() {
                    return Err(ProtocolError::Command(
                        "a command in the middle of a message".into(),
                    ));
                }
                return parse_command(body).map(|c| Some(Item::Command(c)));
            }
            if self.parts.len() == self.limits.max_frames {
                return Err(ProtocolError::TooManyFrames(self.limits.max_frames));
            }
            self.message_bytes += body.len();
            self.parts.push(body);
            if !header.more {
                self.message_bytes = 0;
                return Ok(Some(Item::Message(std::mem::take(&mut self.parts))));
            }
        }
    }
}

/// Encode one frame.
fn put_frame(out: &mut BytesMut, flags: u8, body: &[u8]) {
    if let Ok(short) = u8::try_from(body.len()) {
        out.put_u8(flags);
        out.put_u8(short);
    } else {
        out.put_u8(flags | FLAG_LONG);
        out.put_u64(body.len() as u64);
    }
    out.extend_from_slice(body);
}

fn ready(socket: SocketType) -> BytesMut {
    let name = socket.name();
    let mut body = BytesMut::new();
    body.put_u8(5);
    body.extend_from_slice(b"READY");
    body.put_u8(11);
    body.extend_from_slice(b"Socket-Type");
    body.put_u32(name.len() as u32);
    body.extend_from_slice(name);
    let mut out = BytesMut::new();
    put_frame(&mut out, FLAG_COMMAND, &body);
    out
}

/// `tcp://HOST:PORT` → `(host, port)`.
pub fn parse_endpoint(endpoint: &str) -> Result<(String, u16), ProtocolError> {
    let bad = || ProtocolError::Endpoint(endpoint.to_owned());
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(bad)?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = port.parse::<u16>().map_err(|_| bad())?;
    if host.is_empty() || host == "*" {
        return Err(bad());
    }
    Ok((host.to_owned(), port))
}

/// One connection to a peer, after the handshake.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    buf: BytesMut,
    out: BytesMut,
    decoder: Decoder,
    limits: Limits,
    /// When the last byte arrived (the stall clock while a message is partly received).
    last_progress: Instant,
}

impl Connection {
    /// Connect, greet and exchange READY, all within `timeout`.
    pub async fn connect(
        endpoint: &str,
        socket: SocketType,
        limits: Limits,
        timeout: Duration,
    ) -> Result<Connection, ProtocolError> {
        let (host, port) = parse_endpoint(endpoint)?;
        let deadline = Instant::now() + timeout;
        let stream = tokio::time::timeout_at(deadline, TcpStream::connect((host.as_str(), port)))
            .await
            .map_err(|_| {
                ProtocolError::Connect(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "timed out",
                ))
            })?
            .map_err(ProtocolError::Connect)?;
        let _ = stream.set_nodelay(true);
        let mut conn = Connection {
            stream,
            buf: BytesMut::with_capacity(READ_CHUNK),
            out: BytesMut::new(),
            decoder: Decoder::new(limits),
            limits,
            last_progress: Instant::now(),
        };
        match tokio::time::timeout_at(deadline, conn.handshake(socket)).await {
            Ok(result) => result.map(|()| conn),
            Err(_) => Err(ProtocolError::Stalled(timeout)),
        }
    }

    async fn handshake(&mut self, socket: SocketType) -> Result<(), ProtocolError> {
        self.stream.write_all(&greeting()).await?;
        while self.buf.len() < GREETING_LEN {
            // Check what arrived as it arrives: garbage fails at its first byte.
            if self.buf.first().is_some_and(|&b| b != 0xff) {
                return Err(ProtocolError::Greeting("no ZMTP signature".into()));
            }
            self.fill().await?;
        }
        let peer = self.buf.split_to(GREETING_LEN);
        check_greeting(&peer)?;
        self.stream.write_all(&ready(socket)).await?;
        let properties = loop {
            match self.decoder.decode(&mut self.buf)? {
                Some(Item::Command(Command::Ready(properties))) => break properties,
                Some(Item::Command(Command::Ping(context))) => self.queue_pong(&context),
                Some(Item::Command(Command::Pong)) => {}
                Some(Item::Message(_)) => {
                    return Err(ProtocolError::Handshake("a message before READY".into()))
                }
                None => self.fill().await?,
            }
        };
        let peer_type = properties
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case("Socket-Type"))
            .map(|(_, v)| v.clone())
            .ok_or_else(|| ProtocolError::Handshake("READY without Socket-Type".into()))?;
        if !socket.accepts(&peer_type) {
            return Err(ProtocolError::Handshake(format!(
                "peer socket type `{}` cannot talk to {}",
                String::from_utf8_lossy(&peer_type),
                String::from_utf8_lossy(socket.name())
            )));
        }
        self.flush().await
    }

    /// Read what has arrived, at most [`READ_CHUNK`] bytes (the decoder takes every whole
    /// frame out of the buffer before the next read, so it holds at most the frame in
    /// progress plus one read).
    async fn fill(&mut self) -> Result<(), ProtocolError> {
        self.buf.reserve(READ_CHUNK);
        let n = {
            let mut limited = (&mut self.stream).take(READ_CHUNK as u64);
            limited.read_buf(&mut self.buf).await?
        };
        if n == 0 {
            return Err(ProtocolError::Closed);
        }
        self.last_progress = Instant::now();
        Ok(())
    }

    fn queue_pong(&mut self, context: &[u8]) {
        let mut body = BytesMut::new();
        body.put_u8(4);
        body.extend_from_slice(b"PONG");
        body.extend_from_slice(&context[..context.len().min(16)]);
        put_frame(&mut self.out, FLAG_COMMAND, &body);
    }

    /// Write what is queued. Cancel-safe: what was written is gone from the queue.
    async fn flush(&mut self) -> Result<(), ProtocolError> {
        while self.out.has_remaining() {
            let n = self.stream.write_buf(&mut self.out).await?;
            if n == 0 {
                return Err(ProtocolError::Closed);
            }
        }
        Ok(())
    }

    /// Send a multipart message.
    pub async fn send(&mut self, frames: &[&[u8]]) -> Result<(), ProtocolError> {
        for (i, frame) in frames.iter().enumerate() {
            let flags = if i + 1 < frames.len() { FLAG_MORE } else { 0 };
            put_frame(&mut self.out, flags, frame);
        }
        self.flush().await
    }

    /// Subscribe to messages whose first frame starts with `topic` (ZMTP 3.0's form).
    pub async fn subscribe(&mut self, topic: &[u8]) -> Result<(), ProtocolError> {
        let mut body = Vec::with_capacity(1 + topic.len());
        body.push(0x01);
        body.extend_from_slice(topic);
        self.send(&[&body]).await
    }

    /// The next message. Cancel-safe (state lives in `self`), so it can sit in a `select!`.
    /// Waits for a message without limit, but for the rest of one that started at most
    /// `limits.stall` after its last byte.
    pub async fn recv(&mut self) -> Result<Vec<Bytes>, ProtocolError> {
        loop {
            self.flush().await?;
            match self.decoder.decode(&mut self.buf)? {
                Some(Item::Message(frames)) => return Ok(frames),
                Some(Item::Command(Command::Ping(context))) => self.queue_pong(&context),
                Some(Item::Command(Command::Pong)) => {}
                Some(Item::Command(Command::Ready(_))) => {
                    return Err(ProtocolError::Command("a second READY".into()))
                }
                None => {
                    if self.decoder.mid_message() || !self.buf.is_empty() {
                        let deadline = self.last_progress + self.limits.stall;
                        match tokio::time::timeout_at(deadline, self.fill()).await {
                            Ok(result) => result?,
                            Err(_) => return Err(ProtocolError::Stalled(self.limits.stall)),
                        }
                    } else {
                        self.fill().await?;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        max_message: 1024,
        max_frames: 4,
        stall: Duration::from_secs(1),
    };

    fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
        let mut out = BytesMut::new();
        put_frame(&mut out, flags, body);
        out.to_vec()
    }

    fn long_header(flags: u8, declared: u64) -> Vec<u8> {
        let mut h = vec![flags | FLAG_LONG];
        h.extend_from_slice(&declared.to_be_bytes());
        h
    }

    #[test]
    fn oversized_declared_lengths_fail_on_the_header_alone() {
        for declared in [1u64 << 62, u64::MAX, 1025, 1 << 32] {
            let mut buf = BytesMut::from(&long_header(0, declared)[..]);
            let err = Decoder::new(LIMITS).decode(&mut buf).unwrap_err();
            assert!(
                matches!(err, ProtocolError::FrameTooLarge { declared: d, limit: 1024 } if d == declared),
                "{err}"
            );
            assert_eq!(err.kind(), Some("too_large"));
        }
        // A command is held to the command limit even under a large message limit.
        let big = Limits {
            max_message: 1 << 30,
            ..LIMITS
        };
        let mut buf = BytesMut::from(&long_header(FLAG_COMMAND, 1 << 20)[..]);
        assert!(matches!(
            Decoder::new(big).decode(&mut buf),
            Err(ProtocolError::FrameTooLarge { .. })
        ));
    }

    #[test]
    fn truncated_frames_wait_for_more_and_multipart_assembles() {
        let mut wire = frame(FLAG_MORE, b"topic");
        wire.extend(frame(FLAG_MORE, &7u64.to_be_bytes()));
        wire.extend(frame(0, &[0xaa; 300]));
        let mut decoder = Decoder::new(LIMITS);
        let mut buf = BytesMut::new();
        let mut got = None;
        // Byte by byte: nothing until the last byte, then the message.
        for (i, &b) in wire.iter().enumerate() {
            buf.put_u8(b);
            let item = decoder.decode(&mut buf).expect("valid");
            if i + 1 < wire.len() {
                assert_eq!(item, None, "at byte {i}");
            } else {
                got = item;
            }
        }
        let Some(Item::Message(frames)) = got else {
            panic!("no message: {got:?}")
        };
        assert_eq!(frames.len(), 3);
        assert_eq!(&frames[0][..], b"topic");
        assert_eq!(frames[2].len(), 300);
        assert!(buf.is_empty() && !decoder.mid_message());
    }

    #[test]
    fn message_and_frame_count_limits_span_frames() {
        // Two frames of 600 bytes: each fits, together they do not.
        let mut buf = BytesMut::from(&frame(FLAG_MORE, &[0; 600])[..]);
        buf.extend_from_slice(&frame(0, &[0; 600]));
        let err = Decoder::new(LIMITS).decode(&mut buf).unwrap_err();
        assert!(
            matches!(err, ProtocolError::MessageTooLarge { limit: 1024 }),
            "{err}"
        );
        let mut buf = BytesMut::new();
        for _ in 0..5 {
            buf.extend_from_slice(&frame(FLAG_MORE, b"x"));
        }
        let err = Decoder::new(LIMITS).decode(&mut buf).unwrap_err();
        assert!(matches!(err, ProtocolError::TooManyFrames(4)), "{err}");
        let mut buf = BytesMut::from(&[0x80u8, 1, 0][..]);
        assert_eq!(
            Decoder::new(LIMITS).decode(&mut buf).unwrap_err().kind(),
            Some("frame")
        );
    }

    #[test]
    fn commands() {
        let mut ready_bytes = ready(SocketType::Sub);
        let Ok(Some(Item::Command(Command::Ready(props)))) =
            Decoder::new(LIMITS).decode(&mut ready_bytes)
        else {
            panic!("READY does not decode")
        };
        assert_eq!(
            props,
            vec![("Socket-Type".into(), Bytes::from_static(b"SUB"))]
        );
        let mut ping = BytesMut::from(&frame(FLAG_COMMAND, b"\x04PING\x00\x0actx")[..]);
        assert_eq!(
            Decoder::new(LIMITS).decode(&mut ping).unwrap(),
            Some(Item::Command(Command::Ping(Bytes::from_static(b"ctx"))))
        );
        let mut error = BytesMut::from(&frame(FLAG_COMMAND, b"\x05ERROR\x06denied")[..]);
        let err = Decoder::new(LIMITS).decode(&mut error).unwrap_err();
        assert!(
            matches!(&err, ProtocolError::PeerError(r) if r == "denied"),
            "{err}"
        );
        let mut unknown = BytesMut::from(&frame(FLAG_COMMAND, b"\x05HELLO")[..]);
        assert_eq!(
            Decoder::new(LIMITS)
                .decode(&mut unknown)
                .unwrap_err()
                .kind(),
            Some("command")
        );
        for bad in [
            &b""[..],
            b"\x09READY",
            b"\x05READY\x0bSocket-Type\x00\x00\x00\x09SUB",
        ] {
            let mut buf = BytesMut::from(&frame(FLAG_COMMAND, bad)[..]);
            assert_eq!(
                Decoder::new(LIMITS).decode(&mut buf).unwrap_err().kind(),
                Some("command"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn greetings() {
        assert!(check_greeting(&greeting()).is_ok());
        let mut curve = greeting();
        curve[12..32].copy_from_slice(&[0; 20]);
        curve[12..17].copy_from_slice(b"CURVE");
        assert!(matches!(check_greeting(&curve), Err(ProtocolError::Mechanism(m)) if m == "CURVE"));
        let mut old = greeting();
        old[10] = 2;
        assert_eq!(check_greeting(&old).unwrap_err().kind(), Some("greeting"));
        assert_eq!(
            check_greeting(&[0x47; 64]).unwrap_err().kind(),
            Some("greeting")
        );
        // libzmq's signature carries a length in its padding and 3.1: accepted.
        let mut libzmq = greeting();
        libzmq[8] = 1;
        libzmq[11] = 1;
        assert!(check_greeting(&libzmq).is_ok());
    }

    #[test]
    fn endpoints() {
        assert_eq!(
            parse_endpoint("tcp://127.0.0.1:5557").unwrap(),
            ("127.0.0.1".into(), 5557)
        );
        assert_eq!(parse_endpoint("tcp://[::1]:1").unwrap(), ("::1".into(), 1));
        for bad in [
            "tcp://*:5557",
            "ipc:///tmp/x",
            "tcp://host",
            "tcp://h:99999",
        ] {
            assert!(parse_endpoint(bad).is_err(), "{bad}");
        }
    }

    /// Against another implementation: the `zeromq` crate's PUB (topic filtering, multipart)
    /// and ROUTER (a DEALER's request and the reply), as the mock engine runs them.
    #[tokio::test]
    async fn interoperates_with_the_zeromq_crates_pub_and_router() {
        use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};
        let limits = Limits {
            max_message: 1 << 20,
            max_frames: 8,
            stall: Duration::from_secs(3),
        };
        let wait = Duration::from_secs(10);
        let port = |endpoint: zeromq::Endpoint| match endpoint {
            zeromq::Endpoint::Tcp(_, port) => port,
            other => panic!("not TCP: {other:?}"),
        };

        let mut publisher = zeromq::PubSocket::new();
        let p = port(publisher.bind("tcp://127.0.0.1:0").await.expect("bind"));
        let endpoint = format!("tcp://127.0.0.1:{p}");
        let mut sub = Connection::connect(&endpoint, SocketType::Sub, limits, wait)
            .await
            .expect("subscribes");
        sub.subscribe(b"kv").await.expect("subscription sent");
        // A SUB misses what is published before its subscription arrives: publish until one
        // comes, another topic first each time (filtered out by the publisher).
        let got = tokio::time::timeout(wait, async {
            loop {
                let other = ZmqMessage::try_from(vec![
                    Bytes::from_static(b"other"),
                    Bytes::from_static(b"x"),
                ])
                .expect("frames");
                publisher.send(other).await.expect("publish");
                let message = ZmqMessage::try_from(vec![
                    Bytes::from_static(b"kv@1"),
                    Bytes::from_static(&[0, 0, 0, 0, 0, 0, 0, 7]),
                    Bytes::from(vec![0x5a; 300]),
                ])
                .expect("frames");
                publisher.send(message).await.expect("publish");
                if let Ok(frames) =
                    tokio::time::timeout(Duration::from_millis(50), sub.recv()).await
                {
                    return frames.expect("a message");
                }
            }
        })
        .await
        .expect("a message within the wait");
        assert_eq!(got.len(), 3);
        assert_eq!(&got[0][..], b"kv@1");
        assert_eq!(got[2].len(), 300);

        let mut router = zeromq::RouterSocket::new();
        let r = port(router.bind("tcp://127.0.0.1:0").await.expect("bind"));
        let endpoint = format!("tcp://127.0.0.1:{r}");
        let mut dealer = Connection::connect(&endpoint, SocketType::Dealer, limits, wait)
            .await
            .expect("connects");
        dealer
            .send(&[b"", &5u64.to_be_bytes()])
            .await
            .expect("request");
        let request = tokio::time::timeout(wait, router.recv())
            .await
            .expect("in time")
            .expect("request")
            .into_vec();
        assert_eq!(request.len(), 3, "{request:?}");
        assert_eq!(&request[2][..], &5u64.to_be_bytes());
        let reply = ZmqMessage::try_from(vec![
            request[0].clone(),
            Bytes::new(),
            Bytes::from_static(b"done"),
        ])
        .expect("frames");
        router.send(reply).await.expect("reply");
        let reply = tokio::time::timeout(wait, dealer.recv())
            .await
            .expect("in time")
            .expect("reply");
        assert_eq!(reply, vec![Bytes::new(), Bytes::from_static(b"done")]);
    }
}
