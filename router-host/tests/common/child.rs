//! `router-host serve` run as a child process, for the cases that need a process of their own:
//! a lower open-files limit (`setrlimit` before `exec`), or a peak memory (`VmHWM`) that only
//! `serve` contributes to. Killed (and reaped) when dropped.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub struct ServeChild {
    child: Child,
    pub addr: SocketAddr,
    /// Everything the child wrote to stderr so far.
    log: Arc<Mutex<String>>,
    _dir: super::TempDir,
}

impl ServeChild {
    /// Start `serve` on `yaml` (listening on a free loopback port), with its open-files limit
    /// set to `open_files` (soft and hard, so that serve cannot raise it) when given; waits
    /// until it listens (at most 60 s).
    pub fn start(test: &str, yaml: &str, open_files: Option<u64>) -> ServeChild {
        let dir = super::temp_dir(test);
        let config = super::write(&dir, "router.yaml", yaml);
        let mut cmd = Command::new(super::router_host_bin());
        cmd.args(["serve", "--config"])
            .arg(&config)
            .args(["--listen", "127.0.0.1:0"])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        if let Some(limit) = open_files {
            // SAFETY: only `setrlimit` (async-signal-safe) runs between fork and exec.
            unsafe {
                cmd.pre_exec(move || {
                    let rl = libc::rlimit {
                        rlim_cur: limit,
                        rlim_max: limit,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &rl) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let mut child = cmd.spawn().expect("start router-host serve");
        let stderr = child.stderr.take().expect("stderr piped");
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel::<SocketAddr>();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.split("listening on http://").nth(1) {
                    if let Some(addr) = rest.split_whitespace().next() {
                        if let Ok(addr) = addr.parse() {
                            let _ = tx.send(addr);
                        }
                    }
                }
                let mut log = sink.lock().unwrap_or_else(|e| e.into_inner());
                log.push_str(&line);
                log.push('\n');
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "serve did not start within 60 s:\n{}",
                    log.lock().unwrap_or_else(|e| e.into_inner())
                );
            }
        };
        ServeChild {
            child,
            addr,
            log,
            _dir: dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// What serve logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// A `/proc/PID/status` field in kB (`VmHWM`, `VmRSS`).
    pub fn status_kb(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("read /proc/PID/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {field} in /proc/PID/status"))
    }

    /// Descriptors the child holds now numbered below `limit` (the ones an open-files limit
    /// of `limit` counts: one inherited with a higher number takes no slot).
    pub fn open_fds_below(&self, limit: usize) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        e.file_name()
                            .to_str()
                            .and_then(|n| n.parse::<usize>().ok())
                            .is_some_and(|n| n < limit)
                    })
                    .count()
            })
            .unwrap_or(0)
    }

    /// Whether the child is still running.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for ServeChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Poll `check` every 50 ms until it returns `Some`, or `limit` passes.
pub fn poll<T>(limit: Duration, mut check: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(value) = check() {
            return Some(value);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// `GET` `url` with a short timeout: `Some((status, body))`, `None` when not answered.
pub fn get(url: &str) -> Option<(u16, String)> {
    exchange("GET", url, "")
}

/// `POST` `body` as JSON to `url` with a short timeout.
pub fn post(url: &str, body: &str) -> Option<(u16, String)> {
    exchange("POST", url, body)
}

/// One HTTP/1.1 exchange on a new connection, by hand (no client pool to hide a shed
/// connection): `None` when the connection is refused, reset or closed without an answer.
fn exchange(method: &str, url: &str, body: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let rest = url.strip_prefix("http://")?;
    let (host, path) = rest
        .split_once('/')
        .map_or((rest, "/".to_owned()), |(h, p)| (h, format!("/{p}")));
    let addr: SocketAddr = host.parse().ok()?;
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .ok()?;
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .strip_prefix("HTTP/1.1 ")?
        .get(..3)?
        .parse::<u16>()
        .ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((status, body))
}

/// The outcome of a child run with [`run_within`].
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Run `program args` with stdout and stderr sent to files in `dir` (and stdout replaced by
/// `stdout` when given); kill it and fail the test if it outlives `deadline`.
pub fn run_within(
    dir: &Path,
    program: &Path,
    args: &[&str],
    stdout: Option<Stdio>,
    deadline: Duration,
) -> Run {
    let out_path = dir.join("child.stdout");
    let err_path = dir.join("child.stderr");
    let stdout = match stdout {
        Some(s) => s,
        None => Stdio::from(std::fs::File::create(&out_path).unwrap()),
    };
    let mut child = Command::new(program)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(Stdio::from(std::fs::File::create(&err_path).unwrap()))
        .spawn()
        .expect("spawn child");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{} {args:?} still running after {deadline:?}",
                program.display()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Run {
        code: status.code(),
        stdout: std::fs::read_to_string(&out_path).unwrap_or_default(),
        stderr: std::fs::read_to_string(&err_path).unwrap_or_default(),
    }
}
