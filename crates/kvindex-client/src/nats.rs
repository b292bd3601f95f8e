//! How to reach NATS: servers, credentials and TLS, under the keys kvindex's configuration
//! file and `KVINDEX_*` variables use, so the daemon, the bridge and an engine or router share
//! one definition.

use crate::error::ClientError;
use async_nats::{Client, ConnectOptions, ServerAddr};
use serde::{Deserialize, Serialize};

/// Where NATS is and how to prove who we are. Every field has a default.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NatsSettings {
    /// NATS server(s), comma-separated (every member of a NATS cluster).
    pub nats_url: String,
    /// NATS credentials file (`.creds`).
    pub nats_creds: Option<String>,
    /// NATS user (with `nats_password`).
    pub nats_user: Option<String>,
    /// NATS password (with `nats_user`).
    pub nats_password: Option<String>,
    /// NATS token.
    pub nats_token: Option<String>,
    /// CA certificate (PEM) to verify the NATS server.
    pub nats_tls_ca: Option<String>,
    /// Client certificate (PEM) for mutual TLS (with `nats_tls_key`).
    pub nats_tls_cert: Option<String>,
    /// Client key (PEM) for mutual TLS (with `nats_tls_cert`).
    pub nats_tls_key: Option<String>,
    /// Require TLS.
    pub nats_require_tls: bool,
}

impl Default for NatsSettings {
    fn default() -> Self {
        NatsSettings {
            nats_url: "nats://127.0.0.1:4222".into(),
            nats_creds: None,
            nats_user: None,
            nats_password: None,
            nats_token: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
            nats_require_tls: false,
        }
    }
}

impl NatsSettings {
    /// The servers of `nats_url`, comma-separated (the members of a NATS cluster, say): the
    /// client connects to any of them and moves to another when it loses its own.
    pub fn servers(&self) -> Result<Vec<ServerAddr>, String> {
        let servers = self
            .nats_url
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| s.parse::<ServerAddr>().map_err(|e| format!("{s:?}: {e}")))
            .collect::<Result<Vec<_>, _>>()?;
        if servers.is_empty() {
            return Err("no server given".into());
        }
        Ok(servers)
    }

    /// Checks the settings; the error names the key at fault.
    pub fn validate(&self) -> Result<(), String> {
        if let Err(why) = self.servers() {
            return Err(format!("nats_url: {why}"));
        }
        if self.nats_tls_cert.is_some() != self.nats_tls_key.is_some() {
            return Err("nats_tls_cert: nats_tls_cert and nats_tls_key go together".into());
        }
        Ok(())
    }

    /// Connection options named `name` (as the server's monitoring shows it): reconnecting
    /// for ever, from the first attempt on, with these credentials and TLS.
    pub async fn options(&self, name: &str) -> Result<ConnectOptions, ClientError> {
        let mut opts = ConnectOptions::new().name(name).retry_on_initial_connect().max_reconnects(None);
        if let Some(creds) = &self.nats_creds {
            opts =
                opts.credentials_file(creds).await.map_err(|e| ClientError::Nats(format!("reading nats_creds {creds}: {e}")))?;
        }
        if let (Some(user), Some(password)) = (&self.nats_user, &self.nats_password) {
            opts = opts.user_and_password(user.clone(), password.clone());
        }
        if let Some(token) = &self.nats_token {
            opts = opts.token(token.clone());
        }
        if let Some(ca) = &self.nats_tls_ca {
            opts = opts.add_root_certificates(ca.into());
        }
        if let (Some(cert), Some(key)) = (&self.nats_tls_cert, &self.nats_tls_key) {
            opts = opts.add_client_certificate(cert.into(), key.into());
        }
        Ok(opts.require_tls(self.nats_require_tls))
    }

    /// Connects with `opts` (from [`NatsSettings::options`]) to these servers.
    pub async fn connect_with(&self, opts: ConnectOptions) -> Result<Client, ClientError> {
        let servers = self.servers().map_err(|e| ClientError::Nats(format!("nats_url: {e}")))?;
        opts.connect(servers).await.map_err(|e| ClientError::Nats(format!("connecting to NATS at {}: {e}", self.nats_url)))
    }

    /// A connection named `name`, with these servers, credentials and TLS.
    pub async fn connect(&self, name: &str) -> Result<Client, ClientError> {
        self.connect_with(self.options(name).await?).await
    }
}

/// Waits until the server has processed everything `client` sent before this call (its
/// subscriptions included): a request on `probe`, a subject the client may publish on and
/// nobody subscribes to, is answered "no responders" only after them. `Client::flush` is not
/// enough: it returns once the bytes are written, not read.
pub async fn round_trip(client: &Client, probe: String, timeout: std::time::Duration) -> Result<(), ClientError> {
    use async_nats::RequestErrorKind;
    let asked = async_nats::Request::new().timeout(Some(timeout));
    match client.send_request(probe, asked).await {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == RequestErrorKind::NoResponders => Ok(()),
        Err(e) => Err(ClientError::Nats(format!("round trip to the server: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nats_url_lists_the_servers_of_a_cluster() {
        let with = |url: &str| NatsSettings { nats_url: url.into(), ..NatsSettings::default() };
        let servers = with("nats://10.0.0.1:4222, nats://10.0.0.2:4222,nats://10.0.0.3:4223").servers().unwrap();
        let ports: Vec<u16> = servers.iter().map(|s| s.port()).collect();
        assert_eq!(ports, vec![4222, 4222, 4223]);
        assert_eq!(servers[1].host(), "10.0.0.2");
        assert!(with(" , ").validate().unwrap_err().contains("nats_url"));
        assert!(with("nats://a:4222,nats://b:notaport").validate().unwrap_err().contains("notaport"));
        let half_tls = NatsSettings { nats_tls_cert: Some("c.pem".into()), ..NatsSettings::default() };
        assert!(half_tls.validate().unwrap_err().contains("nats_tls_key"));
    }
}
