//! A router asking a running `kvindex serve` which workers hold a request's prefix, through
//! `LookupClient`, and picking one.
//!
//! ```sh
//! cargo run --release -- serve &          # against NATS on 127.0.0.1:4222
//! cargo run --example router -- nats://127.0.0.1:4222 kv
//! ```

use kvindex_client::{ClientError, LookupClient, Query};
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let prefix = args.next().unwrap_or_else(|| "kv".into());
    let nats = async_nats::connect(&url).await?;
    let lookups = LookupClient::new(nats, &prefix).with_timeout(Duration::from_millis(200));

    // The request's tokens, as the router sees them; kvindex hashes them the way publishers do.
    let tokens: Vec<u32> = (0..4096).collect();
    let query = Query::tokens(&tokens, 16);
    match lookups.lookup(&query).await {
        Ok(answer) => {
            for m in &answer.matches {
                let note = if m.stale { " (stale: its depth may be out of date)" } else { "" };
                println!("worker {} rank {}: {} blocks{note}", m.worker_id, m.dp_rank, m.blocks);
            }
            for w in &answer.stale_workers {
                println!(
                    "worker {} rank {} is resynchronising: it may hold blocks kvindex has not seen yet",
                    w.worker_id, w.dp_rank
                );
            }
            match answer.best() {
                Some(best) => {
                    println!("route to worker {} rank {} ({} blocks cached)", best.worker_id, best.dp_rank, best.blocks)
                }
                None => println!("no up-to-date worker holds the first block: route by load alone"),
            }
        }
        Err(e @ (ClientError::NoKvindex { .. } | ClientError::Timeout { .. })) => println!("{e}: route by load alone"),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}
