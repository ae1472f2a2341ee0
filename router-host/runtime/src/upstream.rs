//! The client that sends completions to engines: HTTP/1.1 connections that the request's own
//! task drives (`http://` engines), or reqwest for `https://` ones.
//!
//! Why not one pooled client for all: in a pooled client (reqwest, hyper-util) every connection
//! is a task of its own that hands the response body over one chunk at a time, each only after
//! the one before was taken. An engine usually sends a short stream's events in one write, yet
//! the relay got them one per scheduler round trip, and hyper's server wrote each with its own
//! `writev` (about ten per short stream, a third of serve's CPU at 4,800 req/s,
//! docs/performance.md, "What the profiles showed"). Here the connection belongs to the request
//! while it runs: polling
//! the body first decodes whatever the connection has already read, on this task, so the
//! relay's [`super::coalesce::Coalesce`] takes every ready event at once. Between requests a
//! connection waits in `Http1Pool`, idle and unpolled; it is checked (one poll: has the engine
//! closed it?) before it is used again, and a request that a stale connection never sent is sent
//! once more on a new one.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http_body_util::Full;
use hyper::body::{Body as _, Incoming};
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper::client::conn::TrySendError;
use hyper::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// A response body as the relay reads it.
pub type BodyStream = Pin<Box<dyn Stream<Item = Result<Bytes, BodyError>> + Send>>;

/// The engine's body broke off (its connection failed, or reqwest's stream did).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BodyError(String);

/// An engine's answer: status and headers now, the body as it comes.
pub struct UpstreamResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: BodyStream,
    /// Which connection carried the request (`router_upstream_connections_total`).
    pub connection: ConnectionUse,
}

/// Which connection a request to an engine went on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionUse {
    /// A new connection: the pool held none to that engine.
    New,
    /// An idle pooled connection.
    Reused,
    /// A pooled connection the engine had closed before the request was written: the request
    /// went again on a new one.
    Reconnected,
    /// `https://`: reqwest's pool chose, and does not say which.
    Https,
}

impl ConnectionUse {
    pub const ALL: [ConnectionUse; 4] = [
        ConnectionUse::New,
        ConnectionUse::Reused,
        ConnectionUse::Reconnected,
        ConnectionUse::Https,
    ];

    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            ConnectionUse::New => "new",
            ConnectionUse::Reused => "reused",
            ConnectionUse::Reconnected => "reconnected",
            ConnectionUse::Https => "https",
        }
    }
}

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection to the engine (refused, unreachable, name not resolved, connect timeout).
    #[error("{0}")]
    Connect(String),
    /// Connected, but the exchange failed before a response head arrived.
    #[error("{0}")]
    Request(String),
    /// The router itself ran out of descriptors, local ports or memory for the connection:
    /// not the engine's failure.
    #[error("{0}")]
    LocalResources(String),
}

impl SendError {
    pub fn is_connect(&self) -> bool {
        matches!(self, SendError::Connect(_))
    }

    pub fn is_local(&self) -> bool {
        matches!(self, SendError::LocalResources(_))
    }
}

/// Sends completions to engines (see the module docs for the two kinds).
pub struct UpstreamClient {
    http: Arc<Http1Pool>,
    tls: reqwest::Client,
}

impl UpstreamClient {
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Result<Self, String> {
        let tls = reqwest::Client::builder()
            .connect_timeout(connect_timeout)
            .no_proxy()
            .tcp_nodelay(true)
            .pool_idle_timeout(idle_timeout)
            // A redirect is relayed to the client, never followed with its prompt.
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|err| err.to_string())?;
        Ok(UpstreamClient {
            http: Arc::new(Http1Pool::new(connect_timeout, idle_timeout)),
            tls,
        })
    }

    /// `POST url` with `headers` (the caller's; `Host` and the length are set here) and `body`.
    pub async fn post(
        &self,
        url: &reqwest::Url,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<UpstreamResponse, SendError> {
        if url.scheme() == "http" {
            return self.http.post(url, headers, body).await;
        }
        let response = self
            .tls
            .post(url.clone())
            .headers(headers)
            .body(body)
            .send()
            .await
            .map_err(|err| {
                let text = super::failure::error_chain(&err);
                if super::failure::is_local_resource(&err) {
                    SendError::LocalResources(text)
                } else if err.is_connect() {
                    SendError::Connect(text)
                } else {
                    SendError::Request(text)
                }
            })?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response
            .bytes_stream()
            .map(|chunk| chunk.map_err(|err| BodyError(super::failure::error_chain(&err))));
        Ok(UpstreamResponse {
            status,
            headers,
            body: Box::pin(body),
            connection: ConnectionUse::Https,
        })
    }

    /// Idle connections waiting in the pool, per engine authority (for tests and metrics).
    pub fn idle_connections(&self) -> usize {
        self.http.idle_count()
    }
}

type Sender = SendRequest<Full<Bytes>>;
type Driver = Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// One HTTP/1.1 connection: the half that sends requests and the half that moves bytes.
struct Conn {
    sender: Sender,
    driver: Driver,
    /// The driver finished (the engine closed the connection, or it failed): never poll it
    /// again, never reuse the connection.
    done: bool,
}

impl Conn {
    /// Let the connection read, write and decode what it can now; `cx` is woken for more.
    fn drive(&mut self, cx: &mut Context<'_>) {
        if !self.done && Pin::new(&mut self.driver).poll(cx).is_ready() {
            self.done = true;
        }
    }

    /// Whether it can carry another request: not closed by either side, and idle.
    fn reusable(&mut self) -> bool {
        // A poll with a waker nobody listens to: it only reads what is already there (an end of
        // file from an engine that closed it while idle).
        self.drive(&mut Context::from_waker(Waker::noop()));
        !self.done && self.sender.is_ready()
    }
}

struct Idle {
    conn: Conn,
    since: Instant,
}

/// Idle connections per engine (`host:port`), most recently used last.
struct Http1Pool {
    idle: Mutex<HashMap<String, Vec<Idle>>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
}

/// Idle connections kept per engine; more are closed when their requests end.
const MAX_IDLE_PER_ENGINE: usize = 256;

impl Http1Pool {
    fn new(connect_timeout: Duration, idle_timeout: Duration) -> Http1Pool {
        Http1Pool {
            idle: Mutex::new(HashMap::new()),
            connect_timeout,
            idle_timeout,
        }
    }

    fn idle_count(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<Idle>>> {
        // Nothing panics while holding it; a poisoned pool is still a valid set of connections.
        self.idle
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The most recently used idle connection to `authority` that is still usable.
    fn checkout(&self, authority: &str) -> Option<Conn> {
        loop {
            let idle = self.lock().get_mut(authority)?.pop()?;
            let mut conn = idle.conn;
            if idle.since.elapsed() < self.idle_timeout && conn.reusable() {
                return Some(conn);
            }
            // Expired or closed: dropped here, outside the lock.
        }
    }

    fn put(&self, authority: &str, conn: Conn) {
        let mut idle = self.lock();
        let list = idle.entry(authority.to_owned()).or_default();
        let timeout = self.idle_timeout;
        list.retain(|i| i.since.elapsed() < timeout);
        if list.len() < MAX_IDLE_PER_ENGINE {
            list.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    async fn connect(&self, host: &str, port: u16) -> Result<Conn, SendError> {
        // An IPv6 literal comes bracketed from the URL; the resolver wants it bare.
        let name = host.trim_start_matches('[').trim_end_matches(']');
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect((name, port)))
            .await
            .map_err(|_| {
                SendError::Connect(format!(
                    "connect to {host}:{port}: no connection within {} ms \
                     (serve.timeouts.connect_ms)",
                    self.connect_timeout.as_millis()
                ))
            })?
            .map_err(|err| {
                let text = format!("connect to {host}:{port}: {err}");
                if super::failure::is_local_resource_io(&err) {
                    SendError::LocalResources(text)
                } else {
                    SendError::Connect(text)
                }
            })?;
        // Small SSE events must leave at once, not wait for an ACK (Nagle).
        stream
            .set_nodelay(true)
            .map_err(|err| SendError::Connect(format!("connect to {host}:{port}: {err}")))?;
        let (sender, driver) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|err| SendError::Connect(format!("connect to {host}:{port}: {err}")))?;
        Ok(Conn {
            sender,
            driver,
            done: false,
        })
    }

    async fn post(
        self: &Arc<Self>,
        url: &reqwest::Url,
        headers: HeaderMap,
        body: Bytes,
    ) -> Result<UpstreamResponse, SendError> {
        let host = url
            .host_str()
            .ok_or_else(|| SendError::Request(format!("{url}: no host")))?;
        let port = url.port_or_known_default().unwrap_or(80);
        let authority = match url.port() {
            Some(port) => format!("{host}:{port}"),
            None => host.to_owned(),
        };
        let target = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        let uri: Uri = target
            .parse()
            .map_err(|err| SendError::Request(format!("{url}: {err}")))?;
        let mut request = hyper::Request::new(Full::new(body));
        *request.method_mut() = Method::POST;
        *request.uri_mut() = uri;
        *request.headers_mut() = headers;
        let host_value = HeaderValue::from_str(&authority)
            .map_err(|err| SendError::Request(format!("{url}: {err}")))?;
        request.headers_mut().insert(header::HOST, host_value);

        let key = format!("{host}:{port}");
        let mut connection = ConnectionUse::Reused;
        let mut conn = match self.checkout(&key) {
            Some(conn) => conn,
            None => {
                connection = ConnectionUse::New;
                self.connect(host, port).await?
            }
        };
        loop {
            match exchange(&mut conn, request).await {
                Ok(response) => {
                    let (head, body) = response.into_parts();
                    let body = Relayed {
                        body,
                        conn: Some(conn),
                        pool: self.clone(),
                        key,
                    };
                    return Ok(UpstreamResponse {
                        status: head.status,
                        headers: head.headers,
                        body: Box::pin(body),
                        connection,
                    });
                }
                // A pooled connection the engine had closed: the request was never written, so
                // it goes once more on a new connection.
                Err(mut err) if connection == ConnectionUse::Reused => match err.take_message() {
                    Some(message) => {
                        request = message;
                        connection = ConnectionUse::Reconnected;
                        conn = self.connect(host, port).await?;
                    }
                    None => return Err(failed(err)),
                },
                Err(err) => return Err(failed(err)),
            }
        }
    }
}

fn failed<T>(err: TrySendError<T>) -> SendError {
    SendError::Request(super::failure::error_chain(&err.into_error()))
}

/// Send `request` on `conn` and wait for the response head, driving the connection meanwhile.
async fn exchange(
    conn: &mut Conn,
    request: hyper::Request<Full<Bytes>>,
) -> Result<hyper::Response<Incoming>, TrySendError<hyper::Request<Full<Bytes>>>> {
    let mut response = std::pin::pin!(conn.sender.try_send_request(request));
    std::future::poll_fn(|cx| {
        conn.drive(cx);
        response.as_mut().poll(cx)
    })
    .await
}

/// A response body read on the request's task: each poll first decodes what the connection
/// already holds. At the end the connection goes back to the pool; dropped early (the client
/// left), it is closed, which tells the engine to stop.
struct Relayed {
    body: Incoming,
    conn: Option<Conn>,
    pool: Arc<Http1Pool>,
    key: String,
}

impl Relayed {
    /// The next data frame the body already holds (trailers and empty frames skipped).
    fn ready_frame(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        loop {
            match Pin::new(&mut self.body).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) if !data.is_empty() => return Poll::Ready(Some(Ok(data))),
                    _ => continue,
                },
                Poll::Ready(Some(Err(err))) => {
                    self.conn = None;
                    return Poll::Ready(Some(Err(BodyError(super::failure::error_chain(&err)))));
                }
                Poll::Ready(None) => {
                    if let Some(mut conn) = self.conn.take() {
                        if conn.reusable() {
                            self.pool.put(&self.key, conn);
                        }
                    }
                    return Poll::Ready(None);
                }
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl Stream for Relayed {
    type Item = Result<Bytes, BodyError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Poll::Ready(item) = self.ready_frame(cx) {
            return Poll::Ready(item);
        }
        // Nothing decoded yet: let the connection read and decode on this task, then look again.
        match self.conn.as_mut() {
            Some(conn) => conn.drive(cx),
            None => return Poll::Pending,
        }
        self.ready_frame(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A server on 127.0.0.1 that answers every request on a connection with `response` (one
    /// write), counting connections; `close_after_one` closes each connection after one answer.
    async fn engine(response: &'static [u8], close_after_one: bool) -> (String, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        // One request: headers, then a body of the declared length.
                        let Ok(n) = socket.read(&mut chunk).await else {
                            return;
                        };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                            continue;
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        if buf.len() < end + 4 + length {
                            continue;
                        }
                        buf.drain(..end + 4 + length);
                        if socket.write_all(response).await.is_err() {
                            return;
                        }
                        if close_after_one {
                            return;
                        }
                    }
                });
            }
        });
        (format!("http://{addr}/v1/completions"), accepted)
    }

    const STREAM: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
        transfer-encoding: chunked\r\n\r\n\
        9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n9\r\ndata: 3\n\n\r\n9\r\ndata: 4\n\n\r\n\
        9\r\ndata: 5\n\n\r\n9\r\ndata: 6\n\n\r\n9\r\ndata: 7\n\n\r\n9\r\ndata: 8\n\n\r\n\
        e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n";

    fn client() -> UpstreamClient {
        UpstreamClient::new(Duration::from_secs(5), Duration::from_secs(30)).unwrap()
    }

    async fn post(client: &UpstreamClient, url: &str) -> (StatusCode, Vec<Bytes>, ConnectionUse) {
        let url = reqwest::Url::parse(url).unwrap();
        let response = tokio::time::timeout(
            Duration::from_secs(10),
            client.post(
                &url,
                HeaderMap::new(),
                Bytes::from_static(b"{\"prompt\":\"x\"}"),
            ),
        )
        .await
        .expect("answered in time")
        .expect("answered");
        let connection = response.connection;
        let pieces = super::super::coalesce::Coalesce::new(response.body);
        let pieces: Vec<Bytes> =
            tokio::time::timeout(Duration::from_secs(10), pieces.collect::<Vec<_>>())
                .await
                .expect("body in time")
                .into_iter()
                .map(|p| p.expect("body"))
                .collect();
        (response.status, pieces, connection)
    }

    fn text(pieces: &[Bytes]) -> String {
        pieces
            .iter()
            .map(|p| String::from_utf8_lossy(p).into_owned())
            .collect()
    }

    /// Events that arrived in one read come out as one piece (one write to the client), byte for
    /// byte; the connection is reused by the next requests.
    #[tokio::test]
    async fn ready_events_come_out_joined_and_connections_are_reused() {
        let (url, accepted) = engine(STREAM, false).await;
        let client = client();
        for round in 0..5 {
            let (status, pieces, connection) = post(&client, &url).await;
            assert_eq!(status, StatusCode::OK);
            let expected = if round == 0 {
                ConnectionUse::New
            } else {
                ConnectionUse::Reused
            };
            assert_eq!(connection, expected, "round {round}");
            let expected: String = (1..=8)
                .map(|i| format!("data: {i}\n\n"))
                .chain(["data: [DONE]\n\n".to_owned()])
                .collect();
            assert_eq!(text(&pieces), expected, "round {round}");
            assert_eq!(
                pieces.len(),
                1,
                "round {round}: one piece, not {}",
                pieces.len()
            );
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one connection for five requests"
        );
        assert_eq!(client.idle_connections(), 1);
    }

    /// An engine that closes each connection after answering: the pooled connection is found
    /// closed (or the unsent request is sent again on a new one), and every request succeeds.
    #[tokio::test]
    async fn a_connection_the_engine_closed_is_not_reused() {
        const ONE: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        let (url, accepted) = engine(ONE, true).await;
        let client = client();
        for round in 0..4 {
            let (status, pieces, connection) = post(&client, &url).await;
            assert_eq!(status, StatusCode::OK);
            assert_eq!(text(&pieces), "ok");
            // Found closed before the send (new) or at it (reconnected); never reused.
            assert_ne!(connection, ConnectionUse::Reused, "round {round}");
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 4);
    }

    /// The metric's counters are indexed by discriminant: `ALL` must list them in that order.
    #[test]
    fn connection_uses_are_listed_in_declaration_order() {
        for (i, used) in ConnectionUse::ALL.iter().enumerate() {
            assert_eq!(*used as usize, i, "{used:?}");
        }
    }

    /// A refused connection is a connect error (the caller marks the engine down).
    #[tokio::test]
    async fn a_refused_connection_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let url = reqwest::Url::parse(&format!("http://{addr}/v1/completions")).unwrap();
        let err = client()
            .post(&url, HeaderMap::new(), Bytes::new())
            .await
            .err()
            .expect("refused");
        assert!(err.is_connect(), "{err}");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
    }

    /// A body cut off mid-stream is an error after the bytes that came, and the broken
    /// connection is not pooled.
    #[tokio::test]
    async fn a_body_cut_off_is_an_error_and_not_pooled() {
        const CUT: &[u8] =
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n";
        let (url, _) = engine(CUT, true).await;
        let client = client();
        let url = reqwest::Url::parse(&url).unwrap();
        let response = client
            .post(&url, HeaderMap::new(), Bytes::new())
            .await
            .expect("head");
        let items: Vec<_> =
            tokio::time::timeout(Duration::from_secs(10), response.body.collect::<Vec<_>>())
                .await
                .expect("in time");
        assert_eq!(items.len(), 2, "{items:?}");
        assert_eq!(items[0].as_ref().expect("data").as_ref(), b"data: 1\n\n");
        assert!(items[1].is_err());
        assert_eq!(client.idle_connections(), 0);
    }
}
