//! docs/CONFIGURATION.md is what the code generates: every key, default, variable and flag.

#[test]
fn the_configuration_reference_is_the_code_s() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/CONFIGURATION.md");
    let page = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        page == kvindex_tools::config_reference::markdown(),
        "docs/CONFIGURATION.md is not what the code generates: run `cargo run -p kvindex-tools -- config-reference > docs/CONFIGURATION.md`"
    );
}
