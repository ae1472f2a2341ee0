//! `epp:`: settings of the gateway endpoint picker, `router-host epp` (docs/gateway.md). Other
//! commands ignore them; they are still validated by every command that reads the file. The
//! request path's own settings (sessions, body limit, decision headers, timeouts) are
//! `serve:`'s, which the picker shares.

use std::net::SocketAddr;

use serde::Deserialize;

use super::serve::de_listen;

/// `epp:` settings, with their defaults filled in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EppConfig {
    /// The Envoy ext_proc (v3) gRPC address.
    pub listen: SocketAddr,
    /// The HTTP address of `/metrics`, `/health` and `/ready`.
    pub metrics_listen: SocketAddr,
    /// Fallback endpoints named after the picked one in the destination (`ip:port,ip:port`),
    /// for a data plane that goes down the list; 0 (the default): the picked one alone, which
    /// is all Envoy's `ORIGINAL_DST` cluster can read.
    pub fallbacks: usize,
}

/// The most fallback endpoints `epp.fallbacks` may ask for.
pub const MAX_FALLBACKS: u64 = 16;

/// Defaults: `127.0.0.1:9002` (the ext_proc port of the GIE reference picker) and
/// `127.0.0.1:9090`.
impl Default for EppConfig {
    fn default() -> Self {
        EppConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 9002)),
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            fallbacks: 0,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, expecting = "an `epp` mapping")]
pub(super) struct RawEpp {
    #[serde(default, deserialize_with = "de_listen")]
    listen: Option<SocketAddr>,
    #[serde(default, deserialize_with = "de_listen")]
    metrics_listen: Option<SocketAddr>,
    #[serde(default, deserialize_with = "de_fallbacks")]
    fallbacks: Option<u64>,
}

fn de_fallbacks<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    super::numbers::de_uint(d, 0, MAX_FALLBACKS)
}

impl RawEpp {
    pub(super) fn build(self) -> EppConfig {
        let defaults = EppConfig::default();
        EppConfig {
            listen: self.listen.unwrap_or(defaults.listen),
            metrics_listen: self.metrics_listen.unwrap_or(defaults.metrics_listen),
            fallbacks: self
                .fallbacks
                .and_then(|n| usize::try_from(n).ok())
                .unwrap_or(defaults.fallbacks),
        }
    }
}
