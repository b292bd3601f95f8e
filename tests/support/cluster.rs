//! A three-node NATS cluster on loopback whose nodes partition a sharded deployment's
//! subjects (prefix `t`) as `config/nats/shards.conf` shows: each node its own `nats-server`
//! process with its own ports, which a test can kill, restart, or give another partition count.

use super::{free_port, NatsProcess};
use std::path::PathBuf;
use std::time::Duration;

pub struct NatsCluster {
    /// The running nodes (`None`: killed).
    pub nodes: Vec<Option<NatsProcess>>,
    /// Each node's client port.
    pub ports: Vec<u16>,
    /// Each node's route port.
    routes: Vec<u16>,
    /// Where the nodes' configuration files are.
    dir: PathBuf,
    /// The partition count the nodes map subjects to.
    pub shards: u32,
}

impl NatsCluster {
    pub fn start(shards: u32) -> NatsCluster {
        let dir = std::env::temp_dir().join(format!("kvindex-cluster-{}-{}", std::process::id(), free_port()));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let routes: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let mut c = NatsCluster { nodes: Vec::new(), ports, routes, dir, shards };
        c.nodes = (0..3).map(|i| Some(c.launch(i))).collect();
        c
    }

    /// Every node's URL, comma-separated: what a client connects to.
    pub fn urls(&self) -> String {
        self.ports.iter().map(|p| format!("nats://127.0.0.1:{p}")).collect::<Vec<_>>().join(",")
    }

    /// Node `i`'s URL.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.ports[i])
    }

    fn launch(&self, i: usize) -> NatsProcess {
        let peers: Vec<String> = (0..3).filter(|&j| j != i).map(|j| format!("nats://127.0.0.1:{}", self.routes[j])).collect();
        let s = self.shards;
        let conf = format!(
            "server_name: n{i}\ncluster {{\n  name: kvshards\n  listen: 127.0.0.1:{}\n  routes: [{}]\n}}\nmappings = {{\n  \"t.events.*\": \"t.events.{{{{wildcard(1)}}}}.{{{{partition({s},1)}}}}\"\n  \"t.routed.*\": \"t.routed.{{{{wildcard(1)}}}}.{{{{partition({s},1)}}}}\"\n}}\n",
            self.routes[i],
            peers.join(", ")
        );
        let path = self.dir.join(format!("n{i}.conf"));
        std::fs::write(&path, conf).expect("node configuration written");
        NatsProcess::start_with(self.ports[i], &["-c", path.to_str().expect("a UTF-8 path")], &[]).expect("a cluster node starts")
    }

    /// SIGKILL of node `i`.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i] = None;
    }

    /// Node `i` again, on its ports.
    pub fn restart(&mut self, i: usize) {
        self.nodes[i] = None;
        self.nodes[i] = Some(self.launch(i));
    }

    /// Every node again, one at a time, mapping subjects to `shards` partitions.
    pub fn remap(&mut self, shards: u32) {
        self.shards = shards;
        for i in 0..3 {
            self.restart(i);
        }
    }

    /// Waits until a message published on every node reaches a subscriber on every other.
    pub async fn formed(&self) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        'again: loop {
            assert!(tokio::time::Instant::now() < deadline, "the NATS cluster did not form");
            tokio::time::sleep(Duration::from_millis(100)).await;
            for i in 0..3 {
                let Ok(sub_client) = async_nats::connect(self.url(i)).await else { continue 'again };
                let subject = format!("formed.{i}");
                let Ok(mut sub) = sub_client.subscribe(subject.clone()).await else { continue 'again };
                let _ = sub_client.flush().await;
                for j in (0..3).filter(|&j| j != i) {
                    let Ok(pub_client) = async_nats::connect(self.url(j)).await else { continue 'again };
                    let _ = pub_client.publish(subject.clone(), "x".into()).await;
                    let _ = pub_client.flush().await;
                    use futures::StreamExt;
                    if tokio::time::timeout(Duration::from_millis(500), sub.next()).await.ok().flatten().is_none() {
                        continue 'again;
                    }
                }
            }
            return;
        }
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
