//! The gRPC Health Checking Protocol (`grpc.health.v1.Health`) the endpoint-picker protocol asks
//! for, beside the ext_proc service on the same port: `liveness` (and the server's `""`) is
//! `SERVING` while the process runs; `readiness` and
//! `envoy.service.ext_proc.v3.ExternalProcessor` follow the runtime's readiness report (the
//! HTTP `/ready`), refreshed every [`REFRESH`], and turn `NOT_SERVING` at shutdown.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service};
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use router_runtime::App;

/// How often the readiness statuses are recomputed.
pub const REFRESH: Duration = Duration::from_secs(1);
/// The services whose status is the picker's readiness.
const READY_SERVICES: [&str; 2] = ["readiness", "envoy.service.ext_proc.v3.ExternalProcessor"];
/// The path prefix of the health service's methods.
const HEALTH_PATH: &str = "/grpc.health.v1.Health/";

/// Keep the statuses of `reporter` up to date until the runtime stops.
pub async fn report(app: Arc<App>, reporter: HealthReporter) {
    reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    loop {
        let ready = !app.stopping.is_cancelled() && router_runtime::ready::readiness(&app).ready;
        let status = if ready {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        for service in READY_SERVICES {
            reporter.set_service_status(service, status).await;
        }
        tokio::select! {
            () = app.stopping.cancelled() => {
                for service in READY_SERVICES {
                    reporter.set_service_status(service, ServingStatus::NotServing).await;
                }
                return;
            }
            () = tokio::time::sleep(REFRESH) => {}
        }
    }
}

/// One gRPC port, two services: the health service's methods by their path, everything else
/// the ext_proc service (tonic's router, which would do this, is built on axum).
#[derive(Clone)]
pub struct TwoServices<H, E> {
    pub health: H,
    pub ext_proc: E,
}

/// What tonic generates for a service, and what [`TwoServices`] serves: a cloneable
/// `Service` of HTTP requests that never fails and whose futures can move between threads.
pub trait GrpcService:
    Service<
        hyper::http::Request<Body>,
        Response = hyper::http::Response<Body>,
        Error = Infallible,
        Future: Send + 'static,
    > + Clone
    + Send
    + 'static
{
}

impl<S> GrpcService for S where
    S: Service<
            hyper::http::Request<Body>,
            Response = hyper::http::Response<Body>,
            Error = Infallible,
            Future: Send + 'static,
        > + Clone
        + Send
        + 'static
{
}

impl<H: GrpcService, E: GrpcService> Service<hyper::http::Request<Body>> for TwoServices<H, E> {
    type Response = hyper::http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Both generated services are always ready.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: hyper::http::Request<Body>) -> Self::Future {
        if request.uri().path().starts_with(HEALTH_PATH) {
            Box::pin(self.health.call(request))
        } else {
            Box::pin(self.ext_proc.call(request))
        }
    }
}
