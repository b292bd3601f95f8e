//! The demo's Python router: a fleet of its own whose lookups go through kvindex's Python
//! client (`clients/python/examples/ask.py`, a process of its own), as a router written in
//! Python asks; its engines publish like the others.

use anyhow::{ensure, Context, Result};
use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_core::hash::LocalHash;
use std::collections::HashMap;
use std::path::Path;
use std::process::Stdio;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

/// Worker ids of the Python fleet: its worker `w` is `PYTHON_BASE + w`.
pub const PYTHON_BASE: u64 = 3_000_000;

/// The fleet's router process and its engines' publishers.
pub struct PythonRouter {
    /// The Python process, killed with the router.
    _child: Child,
    /// Requests to it, one JSON line each.
    stdin: ChildStdin,
    /// Its answers, one JSON line each.
    stdout: Lines<BufReader<ChildStdout>>,
    /// The fleet's worker ids: a lookup names them.
    ids: Vec<u64>,
    /// Its engines' publishers, by worker.
    pub publishers: Vec<Publisher>,
    /// Lookups that got no answer.
    pub errors: u64,
}

impl PythonRouter {
    /// `workers` engines publishing on `prefix`; `python` runs the client (installed by
    /// `scripts/python-client`) against the NATS at `url`.
    pub async fn start(nats: &async_nats::Client, url: &str, prefix: &str, workers: u64, python: &Path) -> Result<Self> {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../clients/python/examples/ask.py");
        let mut child = Command::new(python)
            .arg(script)
            .args([url, prefix])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting the Python router with {}", python.display()))?;
        let stdin = child.stdin.take().context("its stdin")?;
        let mut stdout = BufReader::new(child.stdout.take().context("its stdout")?).lines();
        let line = stdout.next_line().await?.unwrap_or_default();
        ensure!(line == "ready", "the Python router said {line:?}, not ready");
        let ids: Vec<u64> = (PYTHON_BASE..PYTHON_BASE + workers).collect();
        let mut publishers = Vec::with_capacity(ids.len());
        for &id in &ids {
            publishers.push(Publisher::start(nats.clone(), PublisherConfig::new(prefix, id, 0)).await?);
        }
        Ok(PythonRouter { _child: child, stdin, stdout, ids, publishers, errors: 0 })
    }

    /// The fleet's depths for `hashes`, in blocks (no answer: none).
    pub async fn depths(&mut self, hashes: &[LocalHash]) -> HashMap<usize, u64> {
        let asked = self.ask(hashes).await;
        crate::fleet::depths_or_none(asked, &mut self.errors, "the Python router")
    }

    async fn ask(&mut self, hashes: &[LocalHash]) -> Result<HashMap<usize, u64>> {
        let line = serde_json::json!({ "block_hashes": hashes.iter().map(|h| h.0).collect::<Vec<_>>(), "workers": self.ids });
        self.stdin.write_all(format!("{line}\n").as_bytes()).await?;
        let answer = self.stdout.next_line().await?.context("the Python router exited")?;
        let answer: Option<HashMap<String, u64>> = serde_json::from_str(&answer).context("reading its answer")?;
        let answer = answer.context("kvindex did not answer it")?;
        let mut depths = HashMap::new();
        for (worker, blocks) in answer {
            if let Some(w) =
                worker.parse::<u64>().ok().and_then(|id| id.checked_sub(PYTHON_BASE)).filter(|&w| w < self.ids.len() as u64)
            {
                depths.insert(w as usize, blocks);
            }
        }
        Ok(depths)
    }
}
