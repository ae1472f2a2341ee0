//! # plugin-api: write worker-selection policies that `router-host` loads from a `.so`
//!
//! This crate is the only place that defines types crossing the host/plugin boundary
//! ([`abi`]). Policy authors use the safe layer instead:
//!
//! 1. implement [`Policy`] (`inputs`, `pick`, optionally `explain`) over plain slices
//!    ([`Rows`]) and a [`Context`];
//! 2. implement [`PolicyType`] (name, summary, parameter docs, `create`), parsing parameters with
//!    [`Parameters::parse`] into a `#[serde(deny_unknown_fields)]` struct;
//! 3. export the library with [`export_plugin!`] and build the crate as a `cdylib`.
//!
//! Every callback runs under `catch_unwind`: a panic becomes an error for that request and
//! poisons the instance; it never unwinds into the host. Plugin `tracing` events are forwarded to
//! the host's log, tagged with the plugin name.
//!
//! The crate version is the ABI version, versioned separately from the host: a plugin built
//! against `1.x` loads into any host built against `1.y`. See `docs/writing-a-policy.md`.
//!
//! ## Versions
//! - **1.0**: root module, `PolicyObject { required_inputs, pick, explain }`, context and view.
//! - **1.1**: optional hooks [`Policy::on_dispatch`] and [`Policy::on_complete`]. Plugins built
//!   against 1.0 keep loading; hosts simply find no hooks in them.
//! - **1.2**: the [`KV_CAPACITY_BLOCKS`] extra column ([`Rows::kv_capacity_blocks`]).
//! - **1.3**: the indexed-blocks extra columns ([`KV_INDEXED_DEVICE_BLOCKS`] and its host and
//!   disk siblings; [`Rows::kv_indexed_blocks`]): what each row's cache holds now. Older plugins
//!   never look at them.
//! - **1.4**: the [`KV_INDEX_STATE`] extra column ([`Rows::kv_index_trust`], [`KvIndexState`]):
//!   whether each row's KV index is current, unknown, stale or lagging. Older plugins never
//!   look at it and see the overlap columns they always saw.
//! - **1.5**: the [`KV_RECENT_DEVICE_BLOCKS`] extra column ([`Rows::kv_recent_device_blocks`]):
//!   how much of each row's indexed device cache requests used or stored recently, so a policy
//!   can send a new prefix where it evicts the least live work ([`ties::RoomColumns::not_recent`]);
//!   and the [`EXPLAIN_TOKEN`] context extension, with which a policy explains the pick it just
//!   made instead of deciding again. Hosts before 1.5 send neither; a policy then decides again.

pub mod abi;
mod columns;
mod create;
pub mod export;
mod policy;
#[cfg(feature = "testing")]
pub mod testing;
pub mod ties;

pub use abi::{Inputs, RowId, API_VERSION};
pub use columns::Columns;
pub use create::{check, CreateContext, CreateError, ParamDoc, Parameters, PolicyType};
pub use policy::{
    AffinityTarget, Completion, Context, Dispatch, Explanation, IndexTrust, IndexedBlocks,
    KvIndexState, Load, Outcome, Overlap, PickError, Policy, Role, Rows, ViewError, EXPLAIN_TOKEN,
    KV_CAPACITY_BLOCKS, KV_INDEXED_DEVICE_BLOCKS, KV_INDEXED_DISK_BLOCKS, KV_INDEXED_HOST_BLOCKS,
    KV_INDEX_STATE, KV_LOAD_ONLY_SUFFIX, KV_RECENT_DEVICE_BLOCKS,
};

#[doc(hidden)]
pub mod __private {
    pub use abi_stable;
}
