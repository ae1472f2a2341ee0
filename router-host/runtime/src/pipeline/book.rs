//! The booking step: the core's decision turned into a [`Flight`] (the booking this leg holds
//! until it ends), counted in the metrics and logged, and the headers that tell the client
//! which row took it.

use std::sync::Arc;
use std::time::Instant;

use hyper::http::{HeaderMap, HeaderName, HeaderValue};

use crate::app::App;
use crate::lifecycle::{DecisionInfo, Flight};
use crate::prompt::Endpoint;
use crate::state::LoadedConfig;
use router_policies::host::{Routed, SessionOutcome};

/// Book `routed` for `endpoint`: record the decision and open its [`Flight`]. `received` is
/// when the request arrived (the request's duration counts from it).
pub fn book(
    app: &Arc<App>,
    loaded: &Arc<LoadedConfig>,
    routed: &Routed,
    endpoint: Endpoint,
    received: Instant,
) -> Flight {
    let info = decision_info(loaded, routed);
    record_decision(app, loaded, routed, &info);
    Flight::new(
        app.clone(),
        loaded.clone(),
        routed,
        info,
        endpoint.label(),
        received,
    )
}

fn decision_info(loaded: &LoadedConfig, routed: &Routed) -> DecisionInfo {
    let d = &routed.decision;
    let router = loaded.host.policy_set();
    let session = match &routed.session {
        None => "-".to_owned(),
        Some(SessionOutcome::Dispatched(o)) => o.as_str().to_owned(),
        Some(SessionOutcome::HardBindingGone) => "hard_binding_gone".to_owned(),
        Some(SessionOutcome::NotRecorded(_)) => "not_recorded".to_owned(),
    };
    DecisionInfo {
        row: d.row,
        instance: router.instance(d.instance).name.clone(),
        policy: router.instance(d.decided_by).type_name.clone(),
        reason: d
            .explanation
            .as_ref()
            .map(|e| e.reason.clone())
            .filter(|r| !r.is_empty())
            .unwrap_or_else(|| "none".to_owned()),
        fallback: d.fallback.as_ref().map(ToString::to_string),
        session,
        queued: routed.queued_for,
    }
}

fn record_decision(app: &App, loaded: &LoadedConfig, routed: &Routed, info: &DecisionInfo) {
    app.metrics
        .decisions
        .get_or_create(&crate::metrics::DecisionLabels {
            instance: info.instance.clone(),
            policy: info.policy.clone(),
            reason: info.reason.clone(),
            fallback: info.fallback.is_some().to_string(),
        })
        .inc();
    if info.session != "-" {
        app.metrics.session(&info.session);
    }
    if let Some(e) = &routed.decision.explanation {
        tracing::debug!(
            worker = info.row.worker_id,
            dp_rank = info.row.dp_rank,
            instance = %info.instance,
            reason = %e.reason,
            fields = ?e.fields,
            labels = ?e.labels,
            candidates = routed.decision.candidates,
            pick_ns = routed.decision.pick_ns,
            config = loaded.number,
            "decision explained"
        );
    }
}

/// Header text from a policy-supplied value: visible ASCII kept, anything else as `?`.
fn header_value(text: &str) -> HeaderValue {
    HeaderValue::from_str(text).unwrap_or_else(|_| {
        let cleaned: String = text
            .chars()
            .map(|c| {
                if c.is_ascii_graphic() || c == ' ' {
                    c
                } else {
                    '?'
                }
            })
            .collect();
        HeaderValue::from_str(&cleaned).unwrap_or_else(|_| HeaderValue::from_static("?"))
    })
}

/// The `x-router-*` headers that say which row took a request and why
/// (`serve.decision_headers`).
pub fn decision_headers(headers: &mut HeaderMap, info: &DecisionInfo, config_number: u64) {
    let mut put = |name: &'static str, value: HeaderValue| {
        headers.insert(HeaderName::from_static(name), value);
    };
    put("x-router-worker", HeaderValue::from(info.row.worker_id));
    put("x-router-dp-rank", HeaderValue::from(info.row.dp_rank));
    put("x-router-instance", header_value(&info.instance));
    put("x-router-policy", header_value(&info.policy));
    put("x-router-reason", header_value(&info.reason));
    put("x-router-session", header_value(&info.session));
    put("x-router-config", HeaderValue::from(config_number));
    if let Some(fallback) = &info.fallback {
        put("x-router-fallback", header_value(fallback));
    }
}
