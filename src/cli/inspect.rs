//! `kvindex workers`, `kvindex lookup` and `kvindex dump`: the inspect API from a shell.

use super::http::request;
use anyhow::{bail, Context, Result};
use kvindex_client::protocol::{LookupRequest, LookupResponse};
use serde_json::Value;
use std::io::Write;

/// Where the inspect API is, and its token.
pub struct Api {
    /// `host:port` of `inspect_addr`.
    pub addr: String,
    /// The bearer token, if the daemon has one.
    pub token: Option<String>,
}

impl Api {
    /// The JSON answer to `method path` (with a JSON `body`), or the daemon's `error`.
    async fn call(&self, method: &str, path: &str, body: Option<&str>) -> Result<Value> {
        let Some((code, text)) = request(&self.addr, method, path, self.token.as_deref(), body).await else {
            bail!("cannot reach the inspect API at {}; is inspect_addr set?", self.addr);
        };
        let json: Result<Value, _> = serde_json::from_str(&text);
        match (code, json) {
            (200, Ok(v)) => Ok(v),
            (200, Err(e)) => Err(e).context("reading the inspect API's answer"),
            (code, v) => {
                let why = v.ok().and_then(|v| v["error"].as_str().map(str::to_string)).unwrap_or_default();
                bail!("the inspect API answered {code}: {why}")
            }
        }
    }

    /// `GET /v1/workers`, every page.
    pub async fn workers(&self) -> Result<Vec<Value>> {
        let mut all = Vec::new();
        let mut offset = Some(0);
        let mut expired = Vec::new();
        while let Some(o) = offset {
            let page = self.call("GET", &format!("/v1/workers?offset={o}"), None).await?;
            all.extend(page["workers"].as_array().cloned().unwrap_or_default());
            if o == 0 {
                expired = page["expired"].as_array().cloned().unwrap_or_default();
            }
            offset = page["next"].as_u64().map(|n| n as usize);
        }
        all.push(serde_json::json!({ "expired": expired }));
        Ok(all)
    }

    /// `GET /v1/workers/{id}/{rank}/blocks`, every page, as replay stream lines.
    pub async fn dump(&self, worker: u64, rank: u32, out: &mut dyn Write) -> Result<usize> {
        let mut offset = Some(0);
        let mut n = 0;
        while let Some(o) = offset {
            let page = self.call("GET", &format!("/v1/workers/{worker}/{rank}/blocks?offset={o}"), None).await?;
            for op in page["ops"].as_array().into_iter().flatten() {
                writeln!(out, "{op}")?;
                n += 1;
            }
            offset = page["next"].as_u64().map(|n| n as usize);
        }
        Ok(n)
    }

    /// `POST /v1/lookup`.
    pub async fn lookup(&self, req: &LookupRequest) -> Result<LookupResponse> {
        let body = serde_json::to_string(req)?;
        let v = self.call("POST", "/v1/lookup", Some(&body)).await?;
        serde_json::from_value(v).context("reading the lookup answer")
    }
}

/// Token ids from a file: whitespace- or comma-separated integers, or a JSON array of them.
pub fn read_tokens(path: &std::path::Path) -> Result<Vec<u32>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    if let Ok(v) = serde_json::from_str::<Vec<u32>>(&text) {
        return Ok(v);
    }
    text.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|t| !t.is_empty())
        .map(|t| t.parse::<u32>().with_context(|| format!("{}: {t:?} is not a token id", path.display())))
        .collect()
}

/// The workers as a table, then the workers dropped lately.
pub fn workers_table(all: &[Value]) -> String {
    let mut s = format!(
        "{:>20} {:>5} {:>20} {:>10} {:>8} {:>8} {:>9} {:>20} {:>12} {:>10} {:>7}  {}\n",
        "worker", "rank", "name", "device", "host", "disk", "predicted", "epoch", "next event", "heard ms", "queued", "stale"
    );
    let mut expired = &Vec::new();
    for w in all {
        if let Some(e) = w["expired"].as_array() {
            expired = e;
            continue;
        }
        let stale = match &w["stale"] {
            Value::Null => "-".to_string(),
            st => format!(
                "{} for {} ms, {} resync requests",
                st["reason"].as_str().unwrap_or("?"),
                st["since_ms"],
                st["resync_requests"]
            ),
        };
        s += &format!(
            "{:>20} {:>5} {:>20} {:>10} {:>8} {:>8} {:>9} {:>20} {:>12} {:>10} {:>7}  {}\n",
            // As strings: a JSON value's Display ignores the column widths.
            w["worker_id"].to_string(),
            w["dp_rank"].to_string(),
            w["name"].as_str().unwrap_or("-"),
            w["blocks"]["device"].to_string(),
            w["blocks"]["host"].to_string(),
            w["blocks"]["disk"].to_string(),
            w["blocks"]["predicted"].to_string(),
            w["epoch"].to_string(),
            w["next_event_id"].as_u64().map_or("-".into(), |n| n.to_string()),
            w["last_heard_ms"].to_string(),
            w["queued"].to_string(),
            stale
        );
    }
    if !expired.is_empty() {
        s += "\ndropped for silence past worker_ttl, the newest first:\n";
        for e in expired {
            s += &format!("{:>20} {:>5}  {} ms ago\n", e["worker_id"].to_string(), e["dp_rank"].to_string(), e["ago_ms"]);
        }
    }
    s
}

/// A lookup answer as a table.
pub fn answer_table(resp: &LookupResponse) -> String {
    match resp {
        LookupResponse::Error { error } => format!("error: {error}\n"),
        LookupResponse::Matches { matches, groups, stale_workers, names, .. } => {
            let mut s = format!("{:>20} {:>5} {:>8} {:>6}  {}\n", "worker", "rank", "blocks", "stale", "name");
            let grouped: Vec<_> = groups.iter().flat_map(kvindex_client::protocol::MatchGroup::entries).collect();
            let matches = if matches.is_empty() { &grouped } else { matches };
            let name = |id: u64| names.iter().find(|n| n.worker_id == id).map_or("-", |n| n.info.name.as_str());
            for m in matches {
                let stale = if m.stale { "yes" } else { "" };
                s += &format!("{:>20} {:>5} {:>8} {:>6}  {}\n", m.worker_id, m.dp_rank, m.blocks, stale, name(m.worker_id));
            }
            if matches.is_empty() {
                s += "no worker holds the first block\n";
            }
            for w in stale_workers {
                s += &format!("stale, matching nothing: {} rank {}\n", w.worker_id, w.dp_rank);
            }
            s
        }
    }
}
