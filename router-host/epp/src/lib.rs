//! `router-host epp`: the router as a Gateway API Inference Extension endpoint picker
//! (docs/gateway.md). Envoy's `ext_proc` filter asks it, over one gRPC stream per HTTP request,
//! which engine should take the request; the picker answers with the engine's `ip:port` in
//! the `x-gateway-destination-endpoint` header and `envoy.lb` metadata, and Envoy proxies.
//!
//! What a request does is router-runtime's pipeline (`prepare`, then `legs::route`: tokens,
//! block ids, limits, sessions, admission, the policy, the booking); this crate maps the
//! ext_proc protocol onto it: `picker.rs` (one stream: the request phase in each body mode,
//! the pick or an immediate refusal, the response phase that drives the booking's
//! `Flight`), `proto.rs` (the Envoy messages it reads and writes), `status.rs` (the HTTP port
//! for `/metrics`, `/health`, `/ready`), `grpc_health.rs` (the gRPC health service on the
//! ext_proc port), this file ([`Epp`]: start, serve, shut down). It knows
//! nothing of proxying HTTP (Envoy's) and is the only crate that names tonic and Envoy's
//! protos.

pub mod grpc_health;
pub mod picker;
pub mod proto;
pub mod status;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

use proto::ext_proc::external_processor_server::ExternalProcessorServer;
use router_config::RouterConfig;
use router_runtime::{App, ServeError, ServeOptions};

/// Headroom over `serve.max_body_bytes` for one gRPC message's framing and headers.
const MESSAGE_OVERHEAD: usize = 1024 * 1024;
/// HTTP/2 pings on an idle connection, and how long one may go unanswered: a gateway that
/// vanished without closing its connection must not hold its requests' bookings for ever.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Why the picker cannot start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum EppError {
    #[error(transparent)]
    Runtime(#[from] ServeError),
    #[error("cannot listen on {addr} ({what}): {cause}")]
    Bind {
        addr: SocketAddr,
        what: &'static str,
        cause: std::io::Error,
    },
    #[error("the ext_proc gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
}

/// The picker's rule on `workers`: every URL's host is an IP literal. The destination it names
/// is `ip:port`, which a gateway connects to as it is (Envoy's `ORIGINAL_DST` cluster reads
/// an address, it resolves no name); `serve` resolves names itself and accepts them.
pub fn workers_by_ip(config: &RouterConfig) -> Result<(), String> {
    for (index, worker) in config.workers.iter().enumerate() {
        let host = picker::host_port(&worker.url).and_then(|hp| {
            hp.rsplit_once(':').map(|(host, _)| {
                host.trim_start_matches('[')
                    .trim_end_matches(']')
                    .to_owned()
            })
        });
        let Some(host) = host else {
            continue;
        };
        if host.parse::<IpAddr>().is_ok() {
            continue;
        }
        let file = match (&config.workers_file, &config.source) {
            (Some(file), _) => file.path.display().to_string(),
            (None, Some(source)) => source.display().to_string(),
            (None, None) => "<string>".to_owned(),
        };
        let line = worker
            .line
            .map(|line| format!(" (line {line})"))
            .unwrap_or_default();
        return Err(format!(
            "config {file}: workers[{index}].url{line}: worker {id}'s host `{host}` is not an IP \
             address: `router-host epp` names the picked endpoint to the gateway as ip:port, \
             and Envoy's ORIGINAL_DST cluster connects to that address without resolving a \
             name; give the worker by IP (`serve` accepts host names)",
            id = worker.id,
        ));
    }
    Ok(())
}

/// A started, not yet serving picker: the runtime, and its two bound ports.
pub struct Epp {
    pub app: Arc<App>,
    grpc: TcpListener,
    metrics: TcpListener,
}

/// Where each port listens (`:0` in the configuration: the bound port).
#[derive(Debug, Clone, Copy)]
pub struct Addresses {
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
}

impl Epp {
    /// Load the configuration (plugins, instances, workers, tokenizer), probe the engines once
    /// and bind `epp.listen` and `epp.metrics_listen` (defaults when the file has no `epp:`).
    pub async fn bind(options: ServeOptions) -> Result<Epp, EppError> {
        let app = App::start(options).await?;
        workers_by_ip(&app.current.load().config)
            .map_err(|reason| EppError::Runtime(ServeError::FrontEnd { reason }))?;
        // Reloads keep to it too: a host name added later is refused as at start.
        let _ = app.front_end_rule.set(workers_by_ip);
        let epp = app.current.load().config.epp.clone().unwrap_or_default();
        let bind = |addr: SocketAddr, what: &'static str| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|cause| EppError::Bind { addr, what, cause })
        };
        let grpc = bind(epp.listen, "epp.listen").await?;
        let metrics = bind(epp.metrics_listen, "epp.metrics_listen").await?;
        app.probe_engines().await;
        Ok(Epp { app, grpc, metrics })
    }

    pub fn addresses(&self) -> Result<Addresses, std::io::Error> {
        Ok(Addresses {
            grpc: self.grpc.local_addr()?,
            metrics: self.metrics.local_addr()?,
        })
    }

    /// Serve until `app.stopping` is cancelled (SIGTERM); then stop accepting and wait for
    /// streams in flight, at most `serve.timeouts.shutdown_ms`.
    pub async fn run(self) -> Result<(), EppError> {
        let Epp { app, grpc, metrics } = self;
        let background = router_runtime::background::start(&app);
        let status = tokio::spawn(status::serve(app.clone(), metrics));
        let limit = app
            .current
            .load()
            .serve
            .max_body_bytes
            .try_into()
            .unwrap_or(usize::MAX)
            .saturating_add(MESSAGE_OVERHEAD);
        let ext_proc = ExternalProcessorServer::new(picker::Picker { app: app.clone() })
            .max_decoding_message_size(limit);
        let (reporter, health) = tonic_health::server::health_reporter();
        let health_task = tokio::spawn(grpc_health::report(app.clone(), reporter));
        let service = grpc_health::TwoServices { health, ext_proc };
        let stopping = app.stopping.clone();
        let server = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
            .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
            .serve_with_incoming_shutdown(
                service,
                TcpIncoming::from(grpc).with_nodelay(Some(true)),
                async move { stopping.cancelled().await },
            );
        let result = tokio::select! {
            served = server => served.map_err(EppError::from),
            () = router_runtime::background::shutdown_deadline(&app) => Ok(()),
        };
        app.stopping.cancel();
        status.abort();
        health_task.abort();
        background.stop();
        tracing::info!("stopped");
        result
    }
}
