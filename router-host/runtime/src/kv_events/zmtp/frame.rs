//! The ZMTP codec, without I/O: greetings, frame headers checked on their declared length,
//! commands, and the [`Decoder`] that assembles messages from bytes as they arrive.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{
    Limits, ProtocolError, SocketType, FLAG_COMMAND, FLAG_LONG, FLAG_MORE, GREETING_LEN,
    MAX_COMMAND_BYTES,
};

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

/// Frames → messages and commands, from bytes as they arrive (no I/O: see [`Connection`](super::Connection)).
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
pub(super) fn put_frame(out: &mut BytesMut, flags: u8, body: &[u8]) {
    if let Ok(short) = u8::try_from(body.len()) {
        out.put_u8(flags);
        out.put_u8(short);
    } else {
        out.put_u8(flags | FLAG_LONG);
        out.put_u64(body.len() as u64);
    }
    out.extend_from_slice(body);
}

pub(super) fn ready(socket: SocketType) -> BytesMut {
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
