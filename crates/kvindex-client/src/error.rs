//! What can go wrong between an engine or router and kvindex.

/// An error of the publisher or the lookup client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No kvindex subscribes to the lookup subject: none is running on this NATS under this
    /// prefix, or every replica is rebuilding and has left the queue group.
    #[error("no kvindex answers on {subject} (none running under this prefix, or none ready)")]
    NoKvindex {
        /// The subject asked.
        subject: String,
    },
    /// kvindex did not answer within the client's timeout.
    #[error("kvindex did not answer on {subject} within {timeout_ms} ms")]
    Timeout {
        /// The subject asked.
        subject: String,
        /// The timeout that ran out.
        timeout_ms: u64,
    },
    /// kvindex refused the request and said why.
    #[error("kvindex refused the lookup: {0}")]
    Rejected(String),
    /// The answer was not a lookup answer (another service on the subject, or a version skew).
    #[error("undecodable answer from kvindex: {0}")]
    BadAnswer(String),
    /// NATS itself failed: not connected, a subscription refused (permissions), a flush.
    #[error("NATS: {0}")]
    Nats(String),
}
