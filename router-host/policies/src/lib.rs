//! # router-policies
//!
//! Worker-selection policies as the router runs them: the loader that maps plugin shared objects
//! and checks their ABI ([`loader`]), the policies built in ([`builtin`]), the catalog of policy
//! types ([`catalog`]), each configured instance with every call into it contained
//! ([`instance`]), the watchdog that takes a hung instance out of service ([`watchdog`]), the log
//! sink plugins write to ([`plugin_log`]), and the configured set of instances the routing core
//! calls through its `Selector` trait ([`policy_set`]); and [`host`], the routing core built from a
//! configuration and its policies.
//!
//! No async runtime, no network: a policy call is a plain function call on the caller's thread.

pub mod builtin;
pub mod catalog;
pub mod host;
pub mod instance;
pub mod loader;
pub mod plugin_log;
pub mod policy_set;
pub mod watchdog;
