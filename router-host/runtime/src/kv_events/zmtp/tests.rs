use super::frame::{put_frame, ready};
use super::*;
use bytes::{BufMut, Bytes, BytesMut};

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
            let other =
                ZmqMessage::try_from(vec![Bytes::from_static(b"other"), Bytes::from_static(b"x")])
                    .expect("frames");
            publisher.send(other).await.expect("publish");
            let message = ZmqMessage::try_from(vec![
                Bytes::from_static(b"kv@1"),
                Bytes::from_static(&[0, 0, 0, 0, 0, 0, 0, 7]),
                Bytes::from(vec![0x5a; 300]),
            ])
            .expect("frames");
            publisher.send(message).await.expect("publish");
            if let Ok(frames) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
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
