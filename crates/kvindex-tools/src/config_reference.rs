//! The configuration reference (docs/CONFIGURATION.md), generated from the code's own settings:
//! every key of `kvindex serve` and of `kvindex bridge`'s `[bridge]` table with its default
//! (from the settings' `Default`), its environment variable (the naming rule the loaders
//! apply), its command-line flag (from the CLI's own flag definitions) and what it does (the
//! doc comment of its field). A test holds the page equal to what this prints.

use clap::{Args, Command};
use kvindex::config::{Config, Flags};
use kvindex_bridge::{BridgeFlags, BridgeSettings};
use serde_json::Value;
use std::collections::HashMap;

/// The sources whose field doc comments describe the keys.
const DAEMON: &str = include_str!("../../../src/config/mod.rs");
const NATS: &str = include_str!("../../kvindex-client/src/nats.rs");
const BRIDGE: &str = include_str!("../../kvindex-bridge/src/config.rs");

/// Each field of `struct name` in `source`, in order, with its doc comment joined into one
/// paragraph.
fn field_docs(source: &str, name: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Some(start) = source.find(&format!("pub struct {name} {{")) else { return out };
    let mut doc = Vec::new();
    for line in source[start..].lines().skip(1) {
        let line = line.trim();
        if line == "}" {
            break;
        }
        if let Some(text) = line.strip_prefix("///") {
            doc.push(text.trim().to_string());
        } else if let Some(field) = line.strip_prefix("pub ").and_then(|l| l.split_once(':')).map(|(f, _)| f) {
            out.push((field.to_string(), doc.join(" ")));
            doc.clear();
        } else if !line.starts_with("#[") {
            doc.clear();
        }
    }
    out
}

/// The long flag of each key among `flags` (clap's argument ids are the fields' names).
fn flags_of(flags: Command) -> HashMap<String, String> {
    flags.get_arguments().filter_map(|a| Some((a.get_id().to_string(), format!("--{}", a.get_long()?)))).collect()
}

/// A default as the page shows it.
fn shown(v: &Value) -> String {
    match v {
        Value::Null => "none".into(),
        other => format!("`{other}`"),
    }
}

/// One table: a row per key of `docs` (the fields, in order) that `defaults` (a serialized
/// settings value) holds.
fn table(defaults: Value, docs: &[(String, String)], flags: &HashMap<String, String>, env: &str) -> String {
    let mut out = String::from("| key | default | variable | flag | what it does |\n|---|---|---|---|---|\n");
    for (key, doc) in docs {
        let Some(value) = defaults.get(key) else { continue };
        let flag = flags.get(key).map_or("-".to_string(), |f| format!("`{f}`"));
        let doc = doc.replace('|', "\\|");
        out += &format!("| `{key}` | {} | `{env}{}` | {flag} | {doc} |\n", shown(value), key.to_ascii_uppercase());
    }
    out
}

/// The page.
pub fn markdown() -> String {
    // The flattened NATS settings stand where their field is.
    let serve_docs: Vec<(String, String)> = field_docs(DAEMON, "Config")
        .into_iter()
        .flat_map(|(key, doc)| if key == "nats" { field_docs(NATS, "NatsSettings") } else { vec![(key, doc)] })
        .collect();
    let mut serve_flags = flags_of(Flags::augment_args(Command::new("serve")));
    serve_flags.extend(flags_of(kvindex::config::ConnectFlags::augment_args(Command::new("serve"))));
    let bridge_docs = field_docs(BRIDGE, "BridgeSettings");
    let bridge_flags = flags_of(BridgeFlags::augment_args(Command::new("bridge")));
    let serve = serde_json::to_value(Config::default()).unwrap_or_default();
    let bridge = serde_json::to_value(BridgeSettings::default()).unwrap_or_default();
    format!(
        "# Configuration reference\n\n\
         Every setting, generated from the code (`kvindex-tools config-reference > docs/CONFIGURATION.md`;\n\
         a test fails when this page and the code disagree).\n\n\
         Each layer overrides the one before: the default, the file (`--config FILE`, else\n\
         `config/kvindex.toml`), the `KVINDEX_*` environment, the flag. An unknown key in the file is\n\
         an error; an unknown `KVINDEX_*` variable is ignored. `kvindex config` prints each value's\n\
         source. Lists are written `[1, 2]`, in the environment too.\n\n\
         ## `kvindex serve`\n\n{}\n\
         ## `kvindex bridge`\n\n\
         The bridge reads the same file: the `nats_*` keys and `prefix` above (their variables and\n\
         `--nats-url`, `--prefix`), and the `[bridge]` table below, whose variables are\n\
         `KVINDEX_BRIDGE_*`.\n\n{}",
        table(serve, &serve_docs, &serve_flags, "KVINDEX_"),
        table(bridge, &bridge_docs, &bridge_flags, "KVINDEX_BRIDGE_"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_has_its_doc_and_the_flags_are_found() {
        let page = markdown();
        for row in page.lines().filter(|l| l.starts_with("| `")) {
            assert!(!row.ends_with("|  |"), "a key without a description: {row}");
        }
        let serve = serde_json::to_value(Config::default()).unwrap();
        let rows = page.split("## `kvindex bridge`").next().unwrap().lines().filter(|l| l.starts_with("| `")).count();
        assert_eq!(rows, serve.as_object().unwrap().len(), "every key of serve, once");
        assert!(page.contains("| `nats_url` | `\"nats://127.0.0.1:4222\"` | `KVINDEX_NATS_URL` | `--nats-url` |"), "{page}");
        assert!(page.contains("| `worker_name` | none | `KVINDEX_BRIDGE_WORKER_NAME` | `--worker-name` |"), "{page}");
    }
}
