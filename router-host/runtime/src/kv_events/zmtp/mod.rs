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
//!
//! Here: the limits, socket types and errors; `frame.rs` is the codec without I/O (greeting,
//! frame headers, commands, the [`Decoder`]), `connection.rs` the [`Connection`] that runs it
//! over a `TcpStream`.

mod connection;
mod frame;
#[cfg(test)]
mod tests;

pub use connection::{parse_endpoint, Connection};
pub use frame::{
    check_greeting, greeting, parse_command, parse_header, Command, Decoder, Header, Item,
};

use std::time::Duration;

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
