//! `kvindex serve` as a real process, for fault tests: it can be killed with SIGKILL,
//! restarted, stopped with SIGTERM; its log goes to a file shown when a test fails.

use super::{free_port, http_get, metric_value};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub struct DaemonProcess {
    child: Option<Child>,
    pub metrics_addr: String,
    pub inspect_addr: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    pub log: PathBuf,
}

impl DaemonProcess {
    /// Starts `kvindex serve --nats-url URL --prefix t` with `extra_args` and `KVINDEX_*`
    /// settings from `env` (e.g. `("RESYNC_INTERVAL", "1")`).
    pub fn start(nats_url: &str, extra_args: &[&str], env: &[(&str, &str)]) -> Self {
        let metrics_addr = format!("127.0.0.1:{}", free_port());
        let inspect_addr = format!("127.0.0.1:{}", free_port());
        let mut args: Vec<String> = [
            "serve",
            "--nats-url",
            nats_url,
            "--prefix",
            "t",
            "--metrics-addr",
            &metrics_addr,
            "--inspect-addr",
            &inspect_addr,
            "--apply-threads",
            "2",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra_args.iter().map(|s| s.to_string()));
        let env = env.iter().map(|(k, v)| (format!("KVINDEX_{k}"), v.to_string())).collect();
        let log = std::env::temp_dir().join(format!(
            "kvindex-test-{}-{}.log",
            std::process::id(),
            metrics_addr.replace([':', '.'], "-")
        ));
        let mut d = DaemonProcess { child: None, metrics_addr, inspect_addr, args, env, log };
        d.launch();
        d
    }

    /// Another process may take a port between our choosing it and the daemon binding it:
    /// then the daemon exits at once, and is started again on fresh ports.
    fn relaunch_if_port_taken(&mut self) -> bool {
        let exited = self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(Some(_))));
        if !exited || !self.log_text().contains("Address already in use") {
            return false;
        }
        let (metrics, inspect) = (format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
        for a in self.args.iter_mut() {
            if *a == self.metrics_addr {
                *a = metrics.clone();
            } else if *a == self.inspect_addr {
                *a = inspect.clone();
            }
        }
        (self.metrics_addr, self.inspect_addr) = (metrics, inspect);
        let _ = std::fs::write(&self.log, "");
        self.launch();
        true
    }

    fn launch(&mut self) {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_kvindex"))
            .args(&self.args)
            .envs(self.env.iter().cloned())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .expect("kvindex starts");
        self.child = Some(child);
    }

    /// Waits until `/readyz` answers 200; returns how long that took from now.
    pub async fn wait_ready(&mut self, secs: u64) -> Duration {
        let start = Instant::now();
        while http_get(&self.metrics_addr, "/readyz").await.map(|r| r.0) != Some(200) {
            if self.relaunch_if_port_taken() {
                continue;
            }
            assert!(start.elapsed() < Duration::from_secs(secs), "kvindex not ready in {secs} s; log:\n{}", self.log_text());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        start.elapsed()
    }

    /// SIGKILL: no shutdown of any kind.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A new process with the same settings.
    pub fn restart(&mut self) {
        self.kill9();
        self.launch();
    }

    /// SIGTERM, then waits for the exit (at most 10 s).
    pub fn terminate(&mut self) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        let _ = Command::new("kill").args(["-TERM", &c.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(Some(status)) = c.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Still running (never exited on its own).
    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub async fn metric(&self, sample: &str) -> f64 {
        let text = http_get(&self.metrics_addr, "/metrics").await.map(|r| r.1).unwrap_or_default();
        metric_value(&text, sample)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        self.kill9();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}
