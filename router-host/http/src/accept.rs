//! The server's side of client connections: the open-files limit, the cap on open connections,
//! shedding at accept, and hyper's HTTP/1 server with a header-read timeout (which axum's own
//! `serve` does not set). The routes are axum's (`routes` in this module's parent).
//!
//! Why a cap below the open-files limit: every client connection in flight also holds a
//! connection to an engine, and the probes, `/tokenize` calls and KV-event subscribers need
//! descriptors of their own. A process that lets clients take every descriptor can no longer
//! reach its engines (and used to blame them for it). Over the cap, or when `accept` itself
//! runs out of descriptors, the new connection is answered a minimal `503` where the socket
//! takes it at once, and closed.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};

use router_core::log_limit::LogLimit;
use router_runtime::app::App;

/// Descriptors kept out of the client connections' share for the listener, the probes and
/// `/tokenize` calls, KV-event subscribers, plugin files, the runtime and logs.
pub const RESERVED_DESCRIPTORS: u64 = 128;

/// `serve.max_connections` when unset: half of what is left of the open-files limit after
/// [`RESERVED_DESCRIPTORS`] (the other half is for the engine connections those clients'
/// requests open), at least 16.
pub fn default_max_connections(open_files: u64) -> u64 {
    (open_files.saturating_sub(RESERVED_DESCRIPTORS) / 2).max(16)
}

/// The soft open-files limit, after raising it to the hard limit (logged either way).
pub fn raise_open_files_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes the struct it is given, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        let err = std::io::Error::last_os_error();
        tracing::warn!(error = %err, "cannot read the open-files limit (RLIMIT_NOFILE); assuming 1024");
        return 1024;
    }
    let soft = limit.rlim_cur;
    // An unlimited hard limit cannot be the soft one on Linux (fs.nr_open bounds it).
    let target = if limit.rlim_max == libc::RLIM_INFINITY {
        std::fs::read_to_string("/proc/sys/fs/nr_open")
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .unwrap_or(1 << 20)
    } else {
        limit.rlim_max
    };
    if soft >= target {
        tracing::info!(
            soft,
            hard = limit.rlim_max,
            "open-files limit (RLIMIT_NOFILE) already at its hard limit"
        );
        return soft;
    }
    let raised = libc::rlimit {
        rlim_cur: target,
        rlim_max: limit.rlim_max,
    };
    // SAFETY: `setrlimit` reads the struct it is given, which lives for the call.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        let err = std::io::Error::last_os_error();
        tracing::warn!(
            soft,
            hard = limit.rlim_max,
            error = %err,
            "cannot raise the open-files limit (RLIMIT_NOFILE) to its hard limit"
        );
        return soft;
    }
    tracing::info!(
        was = soft,
        now = target,
        hard = limit.rlim_max,
        "open-files limit (RLIMIT_NOFILE) raised to the hard limit"
    );
    target
}

/// What a shed connection is told, written once without waiting (it may not all go).
const SHED_RESPONSE: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\n\
content-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: 149\r\n\r\n\
{\"error\":{\"message\":\"the router has too many open connections; retry later\",\
\"type\":\"service_unavailable\",\"param\":null,\"code\":\"too_many_connections\"}}";

static SHED_LOG: LogLimit = LogLimit::new(10_000);
static HEADER_TIMEOUT_LOG: LogLimit = LogLimit::new(10_000);
static ACCEPT_ERROR_LOG: LogLimit = LogLimit::new(10_000);

/// Tell `stream` no and close it.
fn shed(app: &App, stream: TcpStream, reason: &'static str, open: usize, limit: u64) {
    let _ = stream.try_write(SHED_RESPONSE);
    drop(stream);
    app.metrics.connection_shed(reason);
    if let Some(left_out) = SHED_LOG.check() {
        tracing::warn!(
            reason,
            open_connections = open,
            max_connections = limit,
            similar_lines_left_out = left_out,
            "client connection shed at accept (router_client_connections_shed_total); raise \
             serve.max_connections or the open-files limit, or add replicas"
        );
    }
}

/// An open client connection, counted until dropped.
struct Open {
    app: Arc<App>,
    count: Arc<AtomicUsize>,
}

impl Drop for Open {
    fn drop(&mut self) {
        self.count.fetch_sub(1, Ordering::SeqCst);
        self.app.metrics.client_connections_open.dec();
    }
}

fn is_fd_limit(err: &std::io::Error) -> bool {
    matches!(err.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Whether a connection waits in `listener`'s backlog, asked without taking a descriptor.
///
/// Linux's `accept` fails with `EMFILE` whenever the descriptor table is full, whether or not a
/// connection waits (it reserves the descriptor first). Giving up the spare on every such
/// failure would free a descriptor for a while after each last-slot accept, so whether a
/// request's engine connection gets one would depend on timing.
fn connection_waiting(listener: &TcpListener) -> bool {
    let mut fds = libc::pollfd {
        fd: listener.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: `poll` reads and writes the one struct it is given, which lives for the call; a
    // zero timeout never blocks.
    let ready = unsafe { libc::poll(&mut fds, 1, 0) };
    ready > 0 && fds.revents & libc::POLLIN != 0
}

/// Accept and serve client connections until `app.stopping`; then stop accepting, ask every
/// connection to finish its request in flight and close, and return once all have.
pub async fn serve(app: Arc<App>, listener: TcpListener, routes: axum::Router, max_default: u64) {
    let open = Arc::new(AtomicUsize::new(0));
    let (close_tx, close_rx) = tokio::sync::watch::channel(());
    // One descriptor held back, given up when `accept` runs out so that the connection
    // waiting can be accepted and shed instead of staying in the backlog unanswered.
    let mut spare = File::open("/dev/null").ok();
    loop {
        if spare.is_none() {
            // Given up and not yet taken back (descriptors were still short then): take it back
            // as soon as one is free, or the next exhaustion would find none to give up.
            spare = File::open("/dev/null").ok();
        }
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = app.stopping.cancelled() => break,
        };
        let limit = app
            .current
            .load()
            .serve
            .max_connections
            .unwrap_or(max_default);
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(err) if is_fd_limit(&err) && !connection_waiting(&listener) => {
                // Out of descriptors with no one waiting: keep the spare, look again shortly
                // (the listener stays ready after an error, so `accept` would not wait).
                tokio::time::sleep(Duration::from_millis(20)).await;
                continue;
            }
            Err(err) if is_fd_limit(&err) => {
                drop(spare.take());
                if let Ok(Ok((stream, _))) =
                    tokio::time::timeout(Duration::from_millis(10), listener.accept()).await
                {
                    shed(&app, stream, "fd_limit", open.load(Ordering::SeqCst), limit);
                } else {
                    app.metrics.connection_shed("fd_limit");
                }
                spare = File::open("/dev/null").ok();
                if spare.is_none() {
                    // Nothing freed yet: do not spin on `accept`.
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                continue;
            }
            Err(err) => {
                if let Some(left_out) = ACCEPT_ERROR_LOG.check() {
                    tracing::warn!(error = %err, similar_lines_left_out = left_out, "accept failed");
                }
                if !matches!(
                    err.kind(),
                    std::io::ErrorKind::ConnectionAborted | std::io::ErrorKind::ConnectionReset
                ) {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                continue;
            }
        };
        let now_open = open.load(Ordering::SeqCst);
        if now_open as u64 >= limit {
            shed(&app, stream, "over_limit", now_open, limit);
            continue;
        }
        open.fetch_add(1, Ordering::SeqCst);
        app.metrics.client_connections_open.inc();
        let guard = Open {
            app: app.clone(),
            count: open.clone(),
        };
        // Streamed chunks are small separate writes: without TCP_NODELAY each waits for the
        // client's delayed ACK (Nagle), about 40 ms per response (docs/performance.md,
        // "`serve`: added latency").
        if let Err(err) = stream.set_nodelay(true) {
            tracing::debug!(error = %err, "cannot set TCP_NODELAY on a client connection");
        }
        let header_read = app.current.load().serve.timeouts.header_read;
        let service = TowerToHyperService::new(routes.clone());
        let close_rx = close_rx.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_read)
                .keep_alive(true);
            let conn = builder.serve_connection(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            let stopping = guard.app.stopping.clone();
            let mut stop = std::pin::pin!(stopping.cancelled());
            let mut asked = false;
            let result = loop {
                tokio::select! {
                    result = conn.as_mut() => break result,
                    () = &mut stop, if !asked => {
                        asked = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            };
            if let Err(err) = result {
                if err.is_timeout() {
                    guard.app.metrics.client_timeout("header");
                    if let Some(left_out) = HEADER_TIMEOUT_LOG.check() {
                        tracing::warn!(
                            header_read_ms = header_read.as_millis() as u64,
                            similar_lines_left_out = left_out,
                            "client connection closed: no complete request head in time \
                             (serve.timeouts.header_read_ms)"
                        );
                    }
                } else {
                    tracing::debug!(error = %err, "client connection ended with an error");
                }
            }
            drop(guard);
            drop(close_rx);
        });
    }
    drop(close_rx);
    drop(listener);
    close_tx.closed().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_cap_leaves_descriptors_for_engines() {
        assert_eq!(default_max_connections(1024), 448);
        assert_eq!(default_max_connections(256), 64);
        assert_eq!(default_max_connections(100), 16);
        assert_eq!(default_max_connections(1 << 20), ((1 << 20) - 128) / 2);
    }

    #[test]
    fn the_shed_answer_is_well_formed() {
        let text = std::str::from_utf8(SHED_RESPONSE).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        let body: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(body["error"]["code"], "too_many_connections");
    }
}
