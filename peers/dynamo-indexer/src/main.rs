//! `dynamo-indexer --port P --block-size B --model M --threads T --workers ID=tcp://HOST:PORT,...`:
//! Dynamo's standalone indexer, started the way its `IndexerConfig` takes it, nothing added.

use anyhow::{bail, Context, Result};
use dynamo_kv_router::services::indexer::{run_server, IndexerConfig};

/// The value after `--name`, if given.
fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

#[tokio::main]
async fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(port) = arg(&args, "--port") else { bail!("--port is required") };
    let config = IndexerConfig {
        block_size: arg(&args, "--block-size").map(|b| b.parse()).transpose().context("--block-size")?,
        port: port.parse().context("--port")?,
        threads: arg(&args, "--threads").map_or(Ok(4), |t| t.parse()).context("--threads")?,
        workers: arg(&args, "--workers"),
        model_name: arg(&args, "--model").unwrap_or_else(|| "default".into()),
        routing_group: "default".into(),
        peers: None,
        access_log: None,
        trace_id_header: http::HeaderName::from_static("x-request-id"),
        access_log_local_time: false,
    };
    run_server(config).await
}
