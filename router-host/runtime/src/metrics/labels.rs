//! The label sets of the metrics.

use prometheus_client::encoding::EncodeLabelSet;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub endpoint: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    pub stage: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RowLabels {
    pub worker: String,
    pub dp_rank: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RowTierLabels {
    pub worker: String,
    pub dp_rank: String,
    /// `device`, `host` or `disk` (`router_core::kv_index::Tier::name`).
    pub tier: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    pub instance: String,
    pub policy: String,
    pub reason: String,
    pub fallback: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

/// `router_admission_rejected_total`'s labels: the policy class and why.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectedLabels {
    pub class: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabels {
    pub worker: String,
    pub kind: String,
}

/// `router_upstream_connections`' label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabels {
    pub connection: &'static str,
}

/// A metric with one `reason` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// `router_engine_answers_rejected_total`'s labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineAnswerLabels {
    pub worker: String,
    pub endpoint: &'static str,
    pub reason: &'static str,
}

/// `router_local_resource_errors_total`'s label: what the router was doing.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabels {
    pub op: &'static str,
}

/// A KV-index metric of one row's tier, with a reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RowTierReasonLabels {
    pub worker: String,
    pub dp_rank: String,
    pub tier: String,
    pub reason: String,
}

/// A KV-event metric of one row, with a kind or reason.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KvKindLabels {
    pub worker: String,
    pub dp_rank: String,
    pub kind: String,
}

/// `router_kv_index_state`'s labels: a row and one of its index states.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RowStateLabels {
    pub worker: String,
    pub dp_rank: String,
    pub state: &'static str,
}

/// `router_kv_index_state_transitions_total`'s labels: a row, the state it left and entered.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RowTransitionLabels {
    pub worker: String,
    pub dp_rank: String,
    pub from: &'static str,
    pub to: &'static str,
}
