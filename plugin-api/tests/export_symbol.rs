//! The export macro spells out the symbol `#[export_root_module]` would emit, so plugin crates need
//! no direct `abi_stable` dependency. Pin it to the name abi_stable looks up.

#[test]
fn export_macro_uses_abi_stable_root_module_symbol() {
    let source = include_str!("../src/export.rs");
    let expected = format!(
        "#[unsafe(export_name = \"{}\")]",
        plugin_api::__private::abi_stable::library::ROOT_MODULE_LOADER_NAME
    );
    assert!(
        source.contains(&expected),
        "export_plugin! must export `{expected}`"
    );
}
