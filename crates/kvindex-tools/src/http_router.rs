//! The demo's HTTP router: a fleet of its own whose router asks kvindex's query API
//! (`POST /query` with the prompt's token ids, as Dynamo's standalone indexer documents it) as
//! a router written against that API would, reading `scores` in tokens. Its engines hash the
//! same tokens into their blocks, as engines do, and publish like the others.

use crate::trace::{block_tokens, chain_hashes, request_blocks, TraceRequest};
use anyhow::{Context, Result};
use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_core::hash::local_hashes;
use std::collections::HashMap;

/// Worker ids of the HTTP fleet: its worker `w` is `HTTP_BASE + w`.
pub const HTTP_BASE: u64 = 2_000_000;

/// A trace request as the HTTP fleet sees it: token ids, and the blocks its engines make of them.
pub struct Prompt {
    /// The request's blocks' tokens ([`block_tokens`]).
    pub tokens: Vec<u32>,
    /// Each block's local hash, from its tokens (kvindex's hashing, as the engines' publishers hash).
    pub locals: Vec<u64>,
    /// The engine's block hashes (a chain over the locals).
    pub engine: Vec<u64>,
}

impl Prompt {
    pub fn of(req: &TraceRequest, factor: u64, block_size: u64) -> Prompt {
        let tokens = block_tokens(request_blocks(req, factor), block_size);
        let locals: Vec<u64> = local_hashes(&tokens, block_size as usize, None, None).iter().map(|h| h.0).collect();
        let engine = chain_hashes(&locals);
        Prompt { tokens, locals, engine }
    }
}

/// The fleet's router and its engines' publishers.
pub struct HttpRouter {
    /// kvindex's query API (`query_addr`).
    addr: String,
    /// Tokens per block: `scores` count tokens.
    block_size: u64,
    /// The fleet's worker ids: a query names them, as a router names the workers it routes to.
    ids: Vec<u64>,
    /// Its engines' publishers, by worker.
    pub publishers: Vec<Publisher>,
    /// Queries that got no answer.
    pub errors: u64,
}

impl HttpRouter {
    /// `workers` engines publishing on `prefix`, asked about at `addr`.
    pub async fn start(nats: &async_nats::Client, prefix: &str, workers: u64, addr: String, block_size: u64) -> Result<Self> {
        let ids: Vec<u64> = (HTTP_BASE..HTTP_BASE + workers).collect();
        let mut publishers = Vec::with_capacity(ids.len());
        for &id in &ids {
            publishers.push(Publisher::start(nats.clone(), PublisherConfig::new(prefix, id, 0)).await?);
        }
        Ok(HttpRouter { addr, block_size: block_size.max(1), ids, publishers, errors: 0 })
    }

    /// The fleet's depths for a prompt's `tokens`, in blocks (no answer: none).
    pub async fn depths(&mut self, tokens: &[u32]) -> HashMap<usize, u64> {
        let asked = self.ask(tokens).await;
        crate::fleet::depths_or_none(asked, &mut self.errors, "the query API")
    }

    async fn ask(&self, tokens: &[u32]) -> Result<HashMap<usize, u64>> {
        let body = serde_json::json!({ "token_ids": tokens, "model_name": "default" });
        let (code, text) = kvindex::cli::http::request(&self.addr, "POST", "/query", None, Some(&body.to_string()))
            .await
            .context("no answer from the query API")?;
        anyhow::ensure!(code == 200, "the query API answered {code}: {text}");
        let answer: serde_json::Value = serde_json::from_str(&text).context("reading the query API's answer")?;
        let mut depths = HashMap::new();
        for (worker, ranks) in answer["scores"].as_object().into_iter().flatten() {
            let (Ok(id), Some(tokens)) = (worker.parse::<u64>(), ranks["0"].as_u64()) else { continue };
            if let Some(w) = id.checked_sub(HTTP_BASE).filter(|&w| w < self.ids.len() as u64) {
                depths.insert(w as usize, tokens / self.block_size);
            }
        }
        Ok(depths)
    }
}
