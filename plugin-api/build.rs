//! Keeps the ABI identity of this crate's types at `plugin-api` although the package is published
//! as `kvroute-plugin-api`.
//!
//! abi_stable records `env!("CARGO_PKG_NAME")` in the layout of every `StableAbi` type (through
//! `make_item_info!`) and refuses a plugin whose types come from a differently named package
//! ("mismatched package"). Every plugin built so far (plugin-api 1.0.0 and 1.1.0, before the
//! rename) says `plugin-api`, so this crate must keep saying it: the ABI identity is this
//! constant, not the registry name. Changing it is an ABI break for every 1.x plugin;
//! `router-host/tests/abi_evolution.rs` loads a plugin built against the frozen 1.0.0 sources and
//! fails if it differs.
const ABI_PACKAGE_NAME: &str = "plugin-api";

fn main() {
    println!("cargo::rustc-env=CARGO_PKG_NAME={ABI_PACKAGE_NAME}");
    println!("cargo::rerun-if-changed=build.rs");
}
