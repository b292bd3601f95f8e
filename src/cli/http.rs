//! A plain HTTP/1.0 client for the daemon's own endpoints (`/readyz`, the inspect API): one
//! request per connection on loopback or a cluster network, no TLS, so the CLI needs no HTTP
//! client library. HTTP/1.0 makes the server close the connection after its answer, so the
//! body is what follows the head, to the end.

use std::time::Duration;

/// How long a request may take, connection to last byte.
const TIMEOUT: Duration = Duration::from_secs(5);

/// Sends `method path` with an optional JSON `body` and bearer `token` to `addr`: (status,
/// body), or `None` if nothing answers within 5 s.
pub async fn request(addr: &str, method: &str, path: &str, token: Option<&str>, body: Option<&str>) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let mut head = format!("{method} {path} HTTP/1.0\r\nHost: {addr}\r\n");
        if let Some(token) = token {
            head += &format!("Authorization: Bearer {token}\r\n");
        }
        if let Some(body) = body {
            head += &format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len());
        }
        head += "\r\n";
        stream.write_all(head.as_bytes()).await.ok()?;
        stream.write_all(body.unwrap_or_default().as_bytes()).await.ok()?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await.ok()?;
        let answer = String::from_utf8_lossy(&answer);
        let code = answer.split_whitespace().nth(1)?.parse().ok()?;
        let body = answer.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        Some((code, body))
    };
    tokio::time::timeout(TIMEOUT, exchange).await.ok().flatten()
}

/// GET `path` from `addr`: (status, body), or `None` if nothing answers within 5 s.
pub async fn get(addr: &str, path: &str) -> Option<(u16, String)> {
    request(addr, "GET", path, None, None).await
}
