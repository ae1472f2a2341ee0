//! One connection to a peer over a tokio `TcpStream`: connect and handshake within a timeout,
//! then send, subscribe and receive through the [`Decoder`].

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::frame::{check_greeting, greeting, put_frame, ready};
use super::{
    Command, Decoder, Item, Limits, ProtocolError, SocketType, FLAG_COMMAND, FLAG_MORE,
    GREETING_LEN, READ_CHUNK,
};

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
