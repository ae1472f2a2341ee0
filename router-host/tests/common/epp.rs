//! `router-host epp` in this process, on free ports: the harness tests/epp.rs and
//! tests/epp_envoy.rs share (the picker's counterpart of [`super::engine::TestRouter`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use router_runtime::{App, ServeOptions};

use super::engine::metric_value;

/// How long a test waits for bookings to be released or the picker to stop.
const WAIT: Duration = Duration::from_secs(60);

/// A picker running in this process.
pub struct Picker {
    pub app: Arc<App>,
    pub grpc: std::net::SocketAddr,
    pub metrics: std::net::SocketAddr,
    /// The configuration file it was started with.
    pub config: PathBuf,
    task: tokio::task::JoinHandle<Result<(), router_epp::EppError>>,
    _dir: Option<super::TempDir>,
}

impl Picker {
    /// Write `yaml` (plus an `epp:` on free ports) to a fresh directory and start the picker.
    pub async fn start(test: &str, yaml: &str) -> Picker {
        let dir = super::temp_dir(test);
        let mut picker = Picker::start_in(dir.path(), yaml, 0).await;
        picker._dir = Some(dir);
        picker
    }

    /// As [`Picker::start`], with more `epp:` keys (`"  fallbacks: 2\n"`).
    pub async fn start_with(test: &str, yaml: &str, epp_keys: &str) -> Picker {
        let dir = super::temp_dir(test);
        let mut picker = Picker::start_in_with(dir.path(), yaml, 0, epp_keys).await;
        picker._dir = Some(dir);
        picker
    }

    /// Write `yaml` (plus an `epp:` with the gRPC port `port`, 0: a free one) to `dir` and
    /// start the picker there.
    pub async fn start_in(dir: &Path, yaml: &str, port: u16) -> Picker {
        Picker::start_in_with(dir, yaml, port, "").await
    }

    /// As [`Picker::start_in`], with more `epp:` keys.
    pub async fn start_in_with(dir: &Path, yaml: &str, port: u16, epp_keys: &str) -> Picker {
        let yaml = format!(
            "{yaml}epp:\n  listen: 127.0.0.1:{port}\n  metrics_listen: 127.0.0.1:0\n{epp_keys}"
        );
        let config = super::write(dir, "router.yaml", &yaml);
        let epp = router_epp::Epp::bind(ServeOptions {
            config: config.clone(),
            plugin_dirs: Vec::new(),
            listen: None,
        })
        .await
        .unwrap_or_else(|err| panic!("the picker did not start: {err}\n{yaml}"));
        let addresses = epp.addresses().expect("addresses");
        let app = epp.app.clone();
        let task = tokio::spawn(epp.run());
        Picker {
            app,
            grpc: addresses.grpc,
            metrics: addresses.metrics,
            config,
            task,
            _dir: None,
        }
    }

    /// Shut down (as SIGTERM does) and wait for the servers to stop.
    pub async fn stop(self) {
        self.app.stopping.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the picker stops")
            .expect("the picker's task")
            .expect("the picker ran without error");
    }

    /// The value of one sample of `/metrics` (`name{labels}` as written there), 0 if absent.
    pub fn metric(&self, sample: &str) -> f64 {
        metric_value(&self.app.metrics.encode(), sample)
    }

    /// Requests booked and not finished, in the front ends' count and the core's.
    pub fn in_flight(&self) -> (usize, usize) {
        (
            self.app.flights.load(Ordering::SeqCst),
            self.app.current.load().host.core().in_flight(),
        )
    }

    /// Requests booked on worker `id`'s rank 0 in the serving configuration's core.
    pub fn booked_on(&self, id: u64) -> u64 {
        let loaded = self.app.current.load();
        let row = router_host::model::RowId {
            worker_id: id,
            dp_rank: 0,
        };
        loaded.host.load().get(row).active_requests
    }

    /// Wait (bounded) until every booking is released.
    pub async fn released(&self) {
        let start = Instant::now();
        while self.in_flight() != (0, 0) {
            assert!(
                start.elapsed() < WAIT,
                "bookings held: {:?}",
                self.in_flight()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
