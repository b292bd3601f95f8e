//! What a deployment uses, kept honest: every kvindex command line of docker-compose.yml, the
//! Dockerfile and the Kubernetes manifests (deploy/kubernetes) parses with the CLI; every metric
//! the dashboards and alerts name is exported; promtool accepts the Prometheus config and the
//! alert rules and passes their unit tests; and a real Prometheus, scraping a daemon fed by a
//! mock engine and a router, evaluates every panel's query without error and with data. The
//! image and the stack themselves are built and run by scripts/test-deploy, the manifests
//! rendered and validated by scripts/check-kubernetes.

mod support;

use kvindex_client::publisher::{Publisher, PublisherConfig};
use kvindex_client::{LookupClient, Query};
use kvindex_core::hash::{BlockHash, LocalHash, StoredBlock};
use kvindex_tools::deploy::compose_commands;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::{http_get, Daemon, NatsServer};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// A tool of the Prometheus distribution, found on the PATH or where scripts/install-prometheus
/// puts it.
fn prometheus_tool(name: &str) -> PathBuf {
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    let dirs = std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default();
    dirs.into_iter()
        .chain([PathBuf::from("/usr/bin"), home.join(".local/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{name} not found: run scripts/install-prometheus (scripts/test does)"))
}

#[test]
fn every_kvindex_command_line_of_the_deployment_parses() {
    let compose = read("docker-compose.yml");
    let mut lines = compose_commands(&compose, "kvindex:latest");
    let services: Vec<&str> = lines.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(
        services,
        ["kvindex", "bridge", "kvindex-shard-0", "kvindex-shard-1", "kvindex-shard-2"],
        "kvindex services of docker-compose.yml"
    );
    // The Dockerfile's healthcheck and default command.
    let dockerfile = read("Dockerfile");
    for directive in ["HEALTHCHECK", "CMD"] {
        // The daemon's stage is the last one: its directives come last.
        let line = dockerfile.lines().rfind(|l| l.starts_with(directive)).unwrap_or_else(|| panic!("no {directive}"));
        let json = &line[line.find('[').expect("exec form")..];
        let mut args: Vec<String> = serde_json::from_str(json).expect("exec form is a JSON list");
        if args.first().map(String::as_str) == Some("kvindex") {
            args.remove(0);
        }
        lines.push((format!("Dockerfile {directive}"), args));
    }
    for (what, args) in &lines {
        let out = Command::new(env!("CARGO_BIN_EXE_kvindex")).args(args).arg("--check-args").output().expect("runs kvindex");
        assert!(
            out.status.success(),
            "{what}: `kvindex {}` does not parse: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // And a typo would be caught.
    let out = Command::new(env!("CARGO_BIN_EXE_kvindex")).args(["serve", "--nats-ulr", "x", "--check-args"]).output().unwrap();
    assert!(!out.status.success());
}

/// Every target name of the workspace whose manifests `cargo metadata` reads at `manifest`.
fn target_names(manifest: &Path) -> Vec<String> {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--no-deps", "--offline", "--format-version", "1", "--manifest-path"])
        .arg(manifest)
        .output()
        .expect("runs cargo metadata");
    assert!(out.status.success(), "cargo metadata of {}: {}", manifest.display(), String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let mut names: Vec<String> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .flat_map(|p| p["targets"].as_array().expect("targets").iter())
        .map(|t| format!("{} {}", t["kind"][0].as_str().unwrap_or("?"), t["name"].as_str().unwrap_or("?")))
        .collect();
    names.sort();
    names
}

/// The Dockerfile's dependency layer builds a skeleton of the workspace: its own shell step,
/// run here outside Docker, gives every target the manifests declare (benches included) a
/// stand-in, so cargo accepts the skeleton's manifests and sees the same targets.
#[test]
fn the_dockerfiles_skeleton_has_every_target_of_the_manifests() {
    let dockerfile = read("Dockerfile");
    let start = dockerfile.find("RUN mkdir /skeleton").expect("the skeleton step");
    let mut step = String::new();
    for line in dockerfile[start..].lines() {
        step.push_str(line.trim_end_matches('\\'));
        step.push(' ');
        if !line.ends_with('\\') {
            break;
        }
    }
    let root = repo("");
    let root = root.to_str().expect("UTF-8").trim_end_matches('/');
    let scratch = std::env::temp_dir().join(format!("kvindex-skeleton-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch).expect("a scratch dir");
    let skeleton = scratch.join("skeleton");
    let script = step
        .trim_start_matches("RUN ")
        .replace("/skeleton", skeleton.to_str().expect("UTF-8"))
        .replace("/tmp/metadata.json", scratch.join("metadata.json").to_str().expect("UTF-8"))
        .replace("/build/", &format!("{root}/"));
    let out = Command::new("sh").arg("-c").arg(&script).current_dir(root).output().expect("runs sh");
    assert!(out.status.success(), "the Dockerfile's skeleton step failed: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(
        target_names(&skeleton.join("Cargo.toml")),
        target_names(&repo("Cargo.toml")),
        "the skeleton's targets are the workspace's"
    );
    assert!(skeleton.join("crates/kvindex-bridge/benches/decode.rs").is_file(), "the bridge bench has its stand-in");
    let _ = std::fs::remove_dir_all(&scratch);
}

/// The value after `flag` in a command line.
fn flag_value<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).map(String::as_str)
}

/// The shipped NATS configuration for shards maps subjects exactly as the daemons and the
/// client expect (`kvindex_client::shards::mappings`), and compose's shards cover each shard
/// of that count once, on the server that carries the mapping.
#[test]
fn the_shards_nats_config_and_the_compose_profile_agree_with_the_code() {
    let conf = read("config/nats/shards.conf");
    let lines: Vec<(String, String)> = conf
        .lines()
        .filter_map(|l| {
            let (from, to) = l.trim().split_once(": ")?;
            let unquote = |s: &str| s.trim().strip_prefix('"')?.strip_suffix('"').map(str::to_string);
            Some((unquote(from)?, unquote(to)?))
        })
        .collect();
    let shards = 3;
    assert_eq!(lines, kvindex_client::shards::mappings("kv", shards).to_vec(), "config/nats/shards.conf's mappings");

    let compose = read("docker-compose.yml");
    let mut seen = Vec::new();
    for (service, args) in compose_commands(&compose, "kvindex:latest") {
        if args.first().map(String::as_str) != Some("serve") || flag_value(&args, "--shards").is_none() {
            continue;
        }
        assert_eq!(flag_value(&args, "--shards"), Some("3"), "{service}: the shard count of config/nats/shards.conf");
        assert_eq!(flag_value(&args, "--nats-url"), Some("nats://nats-sharded:4222"), "{service}: the mapping server");
        seen.push(flag_value(&args, "--shard").expect("--shard").parse::<u32>().expect("a shard number"));
    }
    seen.sort();
    assert_eq!(seen, (0..shards).collect::<Vec<_>>(), "compose runs each shard once");
    assert!(compose.contains("./config/nats/shards.conf:/etc/nats/shards.conf:ro"), "nats-sharded mounts the mapping");
}

/// The `args:` flow lists of the containers that run the kvindex image in the Kubernetes
/// manifests under `dir`, with the file each comes from.
fn kubernetes_kvindex_args(dir: &Path) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = Vec::new();
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        for entry in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("reading {}: {e}", d.display())) {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml") {
                files.push(path);
            }
        }
    }
    files.sort();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let mut in_kvindex = false;
        for line in text.lines() {
            let l = line.trim_start().trim_start_matches("- ").trim();
            if let Some(image) = l.strip_prefix("image:") {
                let image = image.trim();
                in_kvindex = image == "kvindex" || image.starts_with("kvindex:");
            } else if let Some(args) = l.strip_prefix("args:").filter(|_| in_kvindex) {
                let args: Vec<String> = serde_json::from_str(args.trim())
                    .unwrap_or_else(|e| panic!("{}: kvindex's args are not a flow list: {e}", file.display()));
                out.push((file.strip_prefix(dir).unwrap().display().to_string(), args));
                in_kvindex = false;
            }
        }
    }
    out
}

#[test]
fn every_kvindex_command_line_of_the_kubernetes_manifests_parses() {
    let lines = kubernetes_kvindex_args(&repo("deploy/kubernetes"));
    let found: Vec<(&str, &str)> = lines.iter().map(|(f, a)| (f.as_str(), a[0].as_str())).collect();
    assert_eq!(
        found,
        [("base/deployment.yaml", "serve"), ("engine-example/statefulset.yaml", "bridge")],
        "kvindex containers of deploy/kubernetes"
    );
    for (file, args) in &lines {
        let out = Command::new(env!("CARGO_BIN_EXE_kvindex")).args(args).arg("--check-args").output().expect("runs kvindex");
        assert!(
            out.status.success(),
            "{file}: `kvindex {}` does not parse: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The sidecar's identity comes from the environment the manifest sets, under the names
    // the bridge reads: the pod's name, and its IP in the engine's URL.
    let sts = read("deploy/kubernetes/engine-example/statefulset.yaml");
    assert!(sts.contains("- name: KVINDEX_BRIDGE_WORKER_NAME"), "the bridge is named by KVINDEX_BRIDGE_WORKER_NAME");
    assert!(sts.contains("fieldPath: metadata.name"), "after its pod");
    assert!(sts.contains("- name: KVINDEX_BRIDGE_ENGINE_URL"), "with the engine's URL");
}

/// Every `kvindex_*` metric name in `text`, histogram series reduced to the histogram.
fn metric_names(text: &str) -> Vec<String> {
    let mut names: Vec<String> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|t| t.starts_with("kvindex_") && t.len() > "kvindex_".len())
        .map(|t| {
            let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| t.strip_suffix(s)).unwrap_or(t);
            base.to_string()
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

fn dashboard_queries() -> Vec<String> {
    let dash: serde_json::Value = serde_json::from_str(&read("dashboards/kvindex.json")).expect("dashboard is JSON");
    let mut exprs = Vec::new();
    for panel in dash["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            exprs.push(target["expr"].as_str().expect("expr").to_string());
        }
    }
    exprs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboards_and_alerts_name_is_exported() {
    let nats = NatsServer::start();
    let daemon = Daemon::start(&nats.url(), |_| {}).await;
    let exported = daemon.metrics().await;
    let named: Vec<String> = metric_names(&dashboard_queries().join("\n"))
        .into_iter()
        .chain(metric_names(&read("config/prometheus/alerts.yml")))
        .collect();
    assert!(named.len() >= 20, "{named:?}");
    for name in &named {
        assert!(exported.contains(&format!("# TYPE {name} ")), "{name} is used by a dashboard or alert but not exported");
    }
    daemon.stop().await.unwrap();
}

#[test]
fn promtool_accepts_the_config_and_the_alert_rules_pass_their_tests() {
    let promtool = prometheus_tool("promtool");
    let dir = repo("config/prometheus");
    for args in
        [&["check", "config", "prometheus.yml"][..], &["check", "rules", "alerts.yml"], &["test", "rules", "alerts_test.yml"]]
    {
        let out = Command::new(&promtool).args(args).current_dir(&dir).output().expect("runs promtool");
        assert!(
            out.status.success(),
            "promtool {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A Prometheus child on a free port, killed on drop.
struct Prometheus {
    child: Child,
    addr: String,
    _dir: PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self._dir);
    }
}

impl Prometheus {
    fn start(target: &str) -> Prometheus {
        let dir = std::env::temp_dir().join(format!("kvindex-prometheus-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nrule_files:\n  - {}\nscrape_configs:\n  - job_name: kvindex\n    static_configs:\n      - targets: [\"{target}\"]\n",
            repo("config/prometheus/alerts.yml").display()
        );
        std::fs::write(dir.join("prometheus.yml"), config).unwrap();
        let addr = format!("127.0.0.1:{}", support::free_port());
        let child = Command::new(prometheus_tool("prometheus"))
            .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("prometheus starts");
        Prometheus { child, addr, _dir: dir }
    }

    /// The result of an instant query, or the error Prometheus gave.
    async fn query(&self, expr: &str) -> Result<Vec<serde_json::Value>, String> {
        let encoded: String = expr
            .bytes()
            .map(
                |b| if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) { (b as char).to_string() } else { format!("%{b:02X}") },
            )
            .collect();
        let (code, body) =
            http_get(&self.addr, &format!("/api/v1/query?query={encoded}")).await.ok_or("prometheus does not answer")?;
        let v: serde_json::Value = serde_json::from_str(&body).map_err(|e| format!("{code}: {e}: {body}"))?;
        if v["status"] != "success" {
            return Err(format!("{code}: {body}"));
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_evaluates_every_panel_with_data() {
    let nats = NatsServer::start();
    let daemon = Daemon::start(&nats.url(), |_| {}).await;
    let prometheus = Prometheus::start(&daemon.cfg.metrics_addr);

    // A mock engine stores and evicts chains, and a router asks, for as long as the test runs.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let publisher = Publisher::start(client.clone(), PublisherConfig::new(&daemon.cfg.prefix, 1, 0)).await.unwrap();
    let router = LookupClient::new(client, &daemon.cfg.prefix);
    let load = tokio::spawn(async move {
        for i in 0u64.. {
            let blocks: Vec<StoredBlock> = (0..8).map(|j| StoredBlock::new(i * 100 + j, 7 + j)).collect();
            publisher.stored(None, &blocks);
            if i > 4 {
                let old: Vec<BlockHash> = (0..8).map(|j| BlockHash((i - 4) * 100 + j)).collect();
                publisher.removed(&old);
            }
            let locals: Vec<LocalHash> = (0..8).map(|j| LocalHash(7 + j)).collect();
            let _ = router.lookup(&Query::hashes(&locals)).await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });

    // Rates need two scrapes within the window; each query is polled until it has data.
    let window = "15s";
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut failures = Vec::new();
    for expr in dashboard_queries() {
        let q = expr.replace("$__rate_interval", window).replace("$instance", ".*");
        // Asked at least once, however long the queries before took.
        let last = loop {
            let got = prometheus.query(&q).await;
            if matches!(&got, Ok(r) if !r.is_empty()) || Instant::now() > deadline {
                break got;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        match last {
            Ok(r) if !r.is_empty() => {}
            Ok(_) => failures.push(format!("no data: {q}")),
            Err(e) => failures.push(format!("error: {q}: {e}")),
        }
    }
    // The alert rules evaluate without error against the real daemon's series.
    let (_, rules) = http_get(&prometheus.addr, "/api/v1/rules").await.expect("rules answer");
    let rules: serde_json::Value = serde_json::from_str(&rules).unwrap();
    let mut evaluated = 0;
    for group in rules["data"]["groups"].as_array().expect("rule groups") {
        for rule in group["rules"].as_array().expect("rules") {
            evaluated += 1;
            if rule["health"] != "ok" {
                failures.push(format!("rule {} is {}: {}", rule["name"], rule["health"], rule["lastError"]));
            }
        }
    }
    let written = read("config/prometheus/alerts.yml").matches("- alert:").count();
    assert_eq!(evaluated, written, "every alert rule is loaded");
    load.abort();
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    daemon.stop().await.unwrap();
}
