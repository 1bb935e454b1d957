//! Per-QP counters, named as Linux rxe's hardware counters name them (`rdma statistic`), so the
//! figures read the same as rdma-core's tools print for rxe.

/// Counters of one queue pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// Packets transmitted (`sent_pkts`).
    pub sent_pkts: u64,
    /// Packets received and accepted by the QP (`rcvd_pkts`).
    pub rcvd_pkts: u64,
    /// Payload bytes transmitted.
    pub sent_bytes: u64,
    /// Payload bytes received.
    pub rcvd_bytes: u64,
    /// Request packets sent again by go-back-N (`retransmits`).
    pub retransmits: u64,
    /// Requests received with a PSN already seen (`duplicate_request`).
    pub duplicate_request: u64,
    /// Requests received ahead of the expected PSN (`out_of_seq_request`).
    pub out_of_seq_request: u64,
    /// PSN-sequence-error NAKs sent.
    pub send_seq_nak: u64,
    /// PSN-sequence-error NAKs received (`rcvd_seq_err`).
    pub rcvd_seq_err: u64,
    /// RNR NAKs sent (`send_rnr_err`).
    pub send_rnr_err: u64,
    /// RNR NAKs received (`rcvd_rnr_err`).
    pub rcvd_rnr_err: u64,
    /// Local ACK timeouts that led to a retry (`completer_retry_err`).
    pub completer_retry_err: u64,
    /// Transport retry counter exhausted (`retry_exceeded_err`).
    pub retry_exceeded_err: u64,
    /// RNR retry counter exhausted (`retry_rnr_exceeded_err`).
    pub retry_rnr_exceeded_err: u64,
    /// Requests refused for a bad R_Key, bounds or rights (remote access error NAKs sent).
    pub rkey_violations: u64,
    /// Invalid-request NAKs sent.
    pub send_invalid_request: u64,
    /// Responses received for PSNs no longer outstanding, or that do not fit the request.
    pub duplicate_response: u64,
    /// Packets dropped because the QP's state does not take them.
    pub dropped_bad_state: u64,
    /// ACK packets sent.
    pub acks_sent: u64,
}
