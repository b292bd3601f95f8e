//! Routers' lookups: one queue subscriber per core, each answering in turn.

use super::State;
use async_nats::Client;
use futures::StreamExt;
use kvindex_client::protocol::{LookupRequest, LookupResponse, MatchEntry};
use kvindex_core::index::{KvIndex, MatchOptions};
use std::sync::Arc;
use std::time::Instant;

/// Answers the lookups of one queue subscriber until told to stop; then takes no new ones.
/// The answer in progress is finished before the task returns.
pub(super) async fn serve_lookups<I: KvIndex>(
    client: Client,
    mut lookups: async_nats::Subscriber,
    state: Arc<State>,
    index: Arc<I>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            msg = lookups.next() => match msg {
                Some(msg) => answer(&client, &state, &*index, msg).await,
                None => break,
            },
        }
    }
    let _ = lookups.unsubscribe().await;
}

/// Answers one lookup request; an undecodable request gets an `error` reply.
async fn answer<I: KvIndex>(client: &Client, state: &State, index: &I, msg: async_nats::Message) {
    let start = Instant::now();
    let (resp, ok) = match LookupRequest::decode(&msg.payload) {
        Ok(req) => {
            let query = req.local_hashes();
            let opts = MatchOptions { workers: req.workers, max_blocks: req.max_blocks.map(|m| m as usize) };
            let matches = index
                .find_matches(&query, &opts)
                .into_iter()
                .map(|m| MatchEntry {
                    worker_id: m.worker.worker_id,
                    dp_rank: m.worker.dp_rank,
                    blocks: m.blocks,
                    stale: state.stale.contains_key(&m.worker),
                })
                .collect();
            (LookupResponse::Matches { matches }, true)
        }
        Err(error) => {
            state.log.warn("bad_lookup", || format!("lookup request rejected: {error}"));
            (LookupResponse::Error { error }, false)
        }
    };
    if let Some(reply) = msg.reply {
        if let Err(e) = client.publish(reply, resp.encode().into()).await {
            state.log.warn("reply_failed", || format!("could not send a lookup reply: {e}"));
        }
    }
    let hot = &state.metrics.hot;
    let (count, duration) =
        if ok { (&hot.lookups_ok, &hot.lookup_duration_ok) } else { (&hot.lookups_error, &hot.lookup_duration_error) };
    count.inc();
    duration.observe(start.elapsed().as_secs_f64());
}
