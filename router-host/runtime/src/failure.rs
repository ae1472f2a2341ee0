//! Failures that are not a client's answer: what can stop the server from starting or
//! reloading ([`ServeError`]), an error's cause chain on one line (`Chain`, `error_chain`),
//! and whether an error is the router's own resources running out.

use std::path::PathBuf;

use router_config::ConfigError;
use router_policies::policy_set::StartupError;

/// Why `serve` could not start, or a reload was refused.
///
/// Its message is the whole story, cause included, and it has no `source()` of its own: the
/// reload log line prints it with `%` (Display only), `main` with `{:#}` (the chain), and both
/// must say every context once. So a cause is a field named `cause`, rendered into the message,
/// never a `#[source]` or `#[from]` (thiserror would make it a `source()` as well, printed a
/// second time by `{:#}`). `Config` is transparent: message and source are the `ConfigError`'s.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("config {file}: {}", Chain(cause.as_ref()))]
    Startup {
        file: PathBuf,
        cause: Box<StartupError>,
    },
    #[error("config {file}: workers: `serve` needs at least one engine in `workers:` (each with `id` and `url`)")]
    NoWorkers { file: PathBuf },
    #[error("config {file}: workers: {reason}")]
    Cluster { file: PathBuf, reason: String },
    #[error("config {file}: workers[{index}].url: `{url}` is not a usable URL: {reason}")]
    WorkerUrl {
        file: PathBuf,
        index: usize,
        url: String,
        reason: String,
    },
    #[error("config {file}: serve.tokenizer.path: {reason}")]
    Tokenizer { file: PathBuf, reason: String },
    #[error("config {file}: block_size: {reason}")]
    BlockSize { file: PathBuf, reason: String },
    #[error("config {file}: {}", Chain(cause))]
    SessionStore {
        file: PathBuf,
        cause: crate::session_store::StoreError,
    },
    #[error("cannot build the upstream HTTP client: {0}")]
    Client(String),
    #[error("cannot listen on {addr}: {cause}")]
    Bind {
        addr: std::net::SocketAddr,
        cause: std::io::Error,
    },
    #[error("server failed: {0}")]
    Io(std::io::Error),
    #[error("reload {started} finished after a later one was swapped in (configuration {serving} is serving); it was discarded")]
    ReloadSuperseded { started: u64, serving: u64 },
    #[error("the reload task stopped before it finished: {0}")]
    ReloadTask(String),
    /// The configuration breaks the front end's rule ([`crate::app::FrontEndRule`]).
    #[error("{reason}")]
    FrontEnd { reason: String },
}

impl From<std::io::Error> for ServeError {
    fn from(err: std::io::Error) -> Self {
        ServeError::Io(err)
    }
}

/// An error and its `source()` chain on one line, `error: cause: its cause`, as `{:#}` prints an
/// `anyhow` chain (anyhow is the binary's; this is the library's).
pub(crate) struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            write!(f, ": {cause}")?;
            next = cause.source();
        }
        Ok(())
    }
}

/// An error and its `source()` chain on one line, leaving out a cause whose text the line
/// already holds (HTTP client errors often repeat their source in their own message).
pub(crate) fn error_chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// OS errors that say the router itself ran out (descriptors, local ports, buffers, memory),
/// not that the engine at the other end failed.
const LOCAL_RESOURCE_ERRNOS: [i32; 5] = [
    libc::EMFILE,
    libc::ENFILE,
    libc::ENOBUFS,
    libc::ENOMEM,
    libc::EADDRNOTAVAIL,
];

/// Whether `err` is one of the router's own resources running out.
pub fn is_local_resource_io(err: &std::io::Error) -> bool {
    err.raw_os_error()
        .is_some_and(|code| LOCAL_RESOURCE_ERRNOS.contains(&code))
}

/// Whether `err`, or an error in its source chain, is one of the router's own resources
/// running out (an engine must not be blamed for it).
pub fn is_local_resource(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(err);
    while let Some(e) = next {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(is_local_resource_io)
        {
            return true;
        }
        next = e.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use std::error::Error;

    use super::*;
    use crate::session_store::StoreError;
    use router_policies::host::RouteError;
    use router_policies::loader::LoadError;

    /// No link of `err`'s chain both says its cause and returns it as `source()`: such a link
    /// prints its cause twice under `{:#}` (and any chain walker).
    fn says_each_context_once(err: &(dyn Error + 'static)) {
        let mut link = Some(err);
        while let Some(current) = link {
            if let Some(source) = current.source() {
                assert!(
                    !current.to_string().contains(&source.to_string()),
                    "`{current}` says its source `{source}` and returns it too"
                );
            }
            link = current.source();
        }
    }

    #[test]
    fn serve_errors_say_their_cause_once_whether_printed_alone_or_with_their_chain() {
        let not_found = || LoadError::NotFound {
            name: "two_tier_cost_fm".to_owned(),
            tried: vec![PathBuf::from("./libtwo_tier_cost_fm.so")],
        };
        let startup = ServeError::Startup {
            file: PathBuf::from("router.yaml"),
            cause: Box::new(StartupError::Plugin {
                index: 0,
                line: Some(10),
                source: Box::new(not_found()),
            }),
        };
        let cases = [
            (
                startup,
                "config router.yaml: plugins[0] (line 10): plugin `two_tier_cost_fm` not found; \
                 tried: ./libtwo_tier_cost_fm.so",
            ),
            (
                ServeError::SessionStore {
                    file: PathBuf::from("router.yaml"),
                    cause: StoreError::Unreachable {
                        url: "redis://127.0.0.1:1".to_owned(),
                        reason: "connection refused".to_owned(),
                    },
                },
                "config router.yaml: session store redis://127.0.0.1:1: connection refused",
            ),
            (
                ServeError::Bind {
                    addr: "127.0.0.1:8000".parse().unwrap(),
                    cause: std::io::Error::other("address in use"),
                },
                "cannot listen on 127.0.0.1:8000: address in use",
            ),
            (
                ServeError::from(std::io::Error::other("accept failed")),
                "server failed: accept failed",
            ),
        ];
        for (err, text) in cases {
            says_each_context_once(&err);
            // The whole message, alone (the reload log line) and as a chain (`main`'s `{:#}`).
            assert_eq!(err.to_string(), text);
            assert_eq!(Chain(&err).to_string(), text);
        }
        let route = RouteError::from(router_core::sessions::SessionError::EmptySessionId);
        says_each_context_once(&route);
        assert_eq!(Chain(&route).to_string(), "session: session id is empty");
    }

    #[derive(Debug, thiserror::Error)]
    #[error("wrapped")]
    struct Wrapped(#[source] std::io::Error);

    #[test]
    fn local_resource_errors_are_found_in_the_chain() {
        for code in [
            libc::EMFILE,
            libc::ENFILE,
            libc::ENOBUFS,
            libc::EADDRNOTAVAIL,
        ] {
            let err = Wrapped(std::io::Error::from_raw_os_error(code));
            assert!(is_local_resource(&err), "{code}");
        }
        for code in [libc::ECONNREFUSED, libc::ECONNRESET, libc::EHOSTUNREACH] {
            let err = Wrapped(std::io::Error::from_raw_os_error(code));
            assert!(!is_local_resource(&err), "{code}");
        }
    }
}
