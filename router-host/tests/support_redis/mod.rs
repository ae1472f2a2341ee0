//! A real `redis-server` for the session-store tests: started on a free 127.0.0.1 port in the
//! test's own temp directory, killed (and waited for) when dropped.
//!
//! When `redis-server` is not installed the tests skip with a printed reason, unless
//! `ROUTER_REQUIRE_REDIS=1` (set by `.ci/run`), where they fail.

#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The `redis-server` binary, if installed.
fn binary() -> Option<PathBuf> {
    let candidates = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    candidates
        .into_iter()
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
}

/// `Some(binary)`, or `None` after printing why the test skips; panics when
/// `ROUTER_REQUIRE_REDIS=1` and there is none.
pub fn available(test: &str) -> Option<PathBuf> {
    match binary() {
        Some(path) => Some(path),
        None if std::env::var("ROUTER_REQUIRE_REDIS").as_deref() == Ok("1") => panic!(
            "{test}: redis-server is not installed and ROUTER_REQUIRE_REDIS=1 \
             (apt-get install redis-server)"
        ),
        None => {
            eprintln!(
                "{test}: SKIPPED: redis-server is not installed (apt-get install redis-server)"
            );
            None
        }
    }
}

/// A free port on 127.0.0.1 (bound and released; the server then binds it).
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local addr").port()
}

/// A running `redis-server`.
pub struct RedisServer {
    binary: PathBuf,
    dir: PathBuf,
    pub port: u16,
    password: Option<String>,
    child: Option<Child>,
}

impl RedisServer {
    /// Start one in `dir` (which must exist), optionally with a password.
    pub fn start(binary: &Path, dir: &Path, password: Option<&str>) -> RedisServer {
        let mut server = RedisServer {
            binary: binary.to_path_buf(),
            dir: dir.to_path_buf(),
            port: 0,
            password: password.map(str::to_owned),
            child: None,
        };
        // A port picked free can be taken before the server binds it: try a few.
        for _ in 0..5 {
            server.port = free_port();
            if server.spawn() {
                return server;
            }
        }
        panic!(
            "redis-server did not start (see {}/redis.log)",
            dir.display()
        );
    }

    /// Start (again) on the same port; returns whether it answers within 10 s.
    fn spawn(&mut self) -> bool {
        let mut command = Command::new(&self.binary);
        command
            .arg("--port")
            .arg(self.port.to_string())
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--protected-mode", "yes"])
            .arg("--dir")
            .arg(&self.dir)
            .arg("--logfile")
            .arg(self.dir.join("redis.log"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some(password) = &self.password {
            command.args(["--requirepass", password]);
        }
        let Ok(child) = command.spawn() else {
            return false;
        };
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(_)) = child.try_wait() {
                    self.child = None;
                    return false;
                }
            }
            if self.ping() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "redis-server on port {} did not answer within 10 s; its log:\n{}",
            self.port,
            std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default()
        );
        self.stop();
        false
    }

    fn ping(&self) -> bool {
        let Ok(client) = redis::Client::open(self.url().as_str()) else {
            return false;
        };
        let Ok(mut con) = client.get_connection_with_timeout(Duration::from_millis(200)) else {
            return false;
        };
        redis::cmd("PING").query::<String>(&mut con).is_ok()
    }

    /// `redis://[:password@]127.0.0.1:PORT/0`.
    /// A store configuration for this server: keys under `prefix`, a timeout generous for a
    /// busy machine (outages in these tests come from stopping the server, never from it).
    pub fn store_config(
        &self,
        prefix: &str,
        share_load: bool,
    ) -> router_host::config::RedisStoreConfig {
        router_host::config::RedisStoreConfig {
            url: self.url(),
            key_prefix: prefix.to_owned(),
            timeout: Duration::from_millis(500),
            on_unavailable: router_host::config::OnStoreUnavailable::Route,
            lease: Duration::from_secs(30),
            replica_id: None,
            share_load,
            load_publish: router_host::config::DEFAULT_LOAD_PUBLISH,
        }
    }

    pub fn url(&self) -> String {
        match &self.password {
            Some(p) => format!("redis://:{p}@127.0.0.1:{}/0", self.port),
            None => format!("redis://127.0.0.1:{}/0", self.port),
        }
    }

    /// A direct connection, for the tests' own reads and writes.
    pub fn connection(&self) -> redis::Connection {
        let client = redis::Client::open(self.url().as_str()).expect("url");
        let con = client
            .get_connection_with_timeout(Duration::from_secs(5))
            .expect("connect to the test redis-server");
        con.set_read_timeout(Some(Duration::from_secs(5)))
            .expect("timeout");
        con
    }

    /// Kill it (SIGKILL) and wait until it is gone.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Start it again on the same port (empty: it keeps nothing on disk).
    pub fn restart(&mut self) {
        self.stop();
        for _ in 0..50 {
            if self.spawn() {
                return;
            }
            // The port may linger a moment after the kill.
            std::thread::sleep(Duration::from_millis(100));
        }
        panic!("redis-server did not restart on port {}", self.port);
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}
