//! Everything a test process logs at `warn` and above, captured for assertions. Process-wide:
//! events from other threads (the watchdog's, serve's probe tasks) are seen too, so assertions
//! filter by what identifies their own test (an instance name, a worker id).

use std::io::Write;
use std::sync::{Mutex, OnceLock};

/// Install the capture (the first call in the process does; call it before the events a test
/// looks for can happen) and return the captured bytes.
pub fn logs() -> &'static Mutex<Vec<u8>> {
    static LOGS: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        struct Sink;
        impl Write for Sink {
            fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
                logs()
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(buf);
                Ok(buf.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let _ = tracing_subscriber::fmt()
            .with_writer(|| Sink)
            .with_ansi(false)
            .with_max_level(tracing::Level::WARN)
            .try_init();
        Mutex::new(Vec::new())
    })
}

/// Logged lines that mention `needle`.
pub fn log_lines_with(needle: &str) -> Vec<String> {
    let text = logs().lock().unwrap_or_else(|e| e.into_inner()).clone();
    String::from_utf8_lossy(&text)
        .lines()
        .filter(|l| l.contains(needle))
        .map(str::to_owned)
        .collect()
}
