//! A context's counters: what its packet path saw, and the transport counters of its QPs.

use std::sync::atomic::AtomicU64;

use ferroce_proto::Counters;

/// Counters of a context's packet path (per-QP transport counters are on each QP).
#[derive(Debug, Default)]
pub(crate) struct EngineCounters {
    pub rx_packets: AtomicU64,
    pub tx_packets: AtomicU64,
    pub rx_bytes: AtomicU64,
    pub tx_bytes: AtomicU64,
    pub icrc_errors: AtomicU64,
    pub icrc_ident_solved: AtomicU64,
    pub malformed: AtomicU64,
    pub unknown_qpn: AtomicU64,
    pub wrong_source: AtomicU64,
    pub send_errors: AtomicU64,
    /// Direct one-sided operations of QPs already destroyed (live QPs keep their own count).
    pub direct_ops: AtomicU64,
    pub ud_dropped: AtomicU64,
    pub shm_peer_violations: AtomicU64,
}

/// A snapshot of a context's counters: its packet path (every datagram the socket saw, and
/// every one refused before it reached a QP) and the transport counters of all its QPs summed,
/// including QPs already destroyed, so one value says everything the context counted.
///
/// The names are rdma-core's (rxe's) where one exists; [`ContextCounters::named`] lists them
/// all, as `ferroce perf --counters` prints them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ContextCounters {
    /// Packets received (every one, refused or not): UDP datagrams, and packets taken from
    /// shared-memory rings.
    pub rx_packets: u64,
    /// Packets sent: UDP datagrams, and packets put into a same-host peer's ring.
    pub tx_packets: u64,
    /// Bytes received (RoCE packets: UDP payload, or ring entries).
    pub rx_bytes: u64,
    /// Bytes sent (RoCE packets: UDP payload, or ring entries).
    pub tx_bytes: u64,
    /// Datagrams refused for a bad ICRC.
    pub icrc_errors: u64,
    /// Datagrams accepted whose ICRC verified only for a non-zero IPv4 Identification, solved
    /// from the ICRC (a UDP socket does not show the field): kernel rxe's packets, and the
    /// segments of a GSO send after the first. Checked by 16 bits of the ICRC, not 32.
    pub icrc_ident_solved: u64,
    /// Datagrams that are not RoCE v2 packets (too short, unknown opcode or version, headers or
    /// pad that do not fit).
    pub malformed: u64,
    /// Packets for a QP number this context does not have.
    pub unknown_qpn: u64,
    /// Packets for a connected QP from an address other than its peer's.
    pub wrong_source: u64,
    /// Send system calls that failed or sent only part of a batch (rxe's `send_err`, the
    /// name [`Self::named`] gives it).
    pub send_errors: u64,
    /// One-sided operations (WRITE, READ, atomics) the shared-memory provider did directly in
    /// a same-host peer's memory: no packet was made for them, so no other counter saw them.
    /// A [`crate::QpSender`]'s are counted once it is dropped.
    pub direct_ops: u64,
    /// Datagrams a UD QP dropped as IBTA says it must: Q_Key mismatch, no receive posted, QP
    /// not receiving.
    pub ud_dropped: u64,
    /// Same-host links ended because the peer broke the shared pages' rules (a ring position
    /// or record that cannot be true): the QP went to ERR, as for a peer gone.
    pub shm_peer_violations: u64,
    /// Same-host connections and hellos refused: a peer of another user (it is reached over
    /// UDP instead), a malformed or unexpected hello, a hello from a process other than the
    /// one listening at the QP's destination, too many connections waiting.
    pub shm_links_refused: u64,
    /// Lazy hand-backs no poll followed: a polling application got completions and then
    /// waited some other way, so the engine thread took progress back after a check-in (see
    /// [`crate::ContextOptions::hand_back_at_completion`]).
    pub hand_backs_missed: u64,
    /// The transport counters of every QP of the context, live and destroyed, summed.
    pub qps: Counters,
}

impl ContextCounters {
    /// Every counter as `(name, value)`: the packet path's, then the QPs' sum.
    pub fn named(&self) -> Vec<(&'static str, u64)> {
        // Destructured without `..`, so a new field cannot be forgotten here.
        let ContextCounters {
            rx_packets,
            tx_packets,
            rx_bytes,
            tx_bytes,
            icrc_errors,
            icrc_ident_solved,
            malformed,
            unknown_qpn,
            wrong_source,
            send_errors,
            direct_ops,
            ud_dropped,
            shm_peer_violations,
            shm_links_refused,
            hand_backs_missed,
            qps,
        } = *self;
        let mut v = vec![
            ("rx_packets", rx_packets),
            ("tx_packets", tx_packets),
            ("rx_bytes", rx_bytes),
            ("tx_bytes", tx_bytes),
            ("icrc_errors", icrc_errors),
            ("icrc_ident_solved", icrc_ident_solved),
            ("malformed", malformed),
            ("unknown_qpn", unknown_qpn),
            ("wrong_source", wrong_source),
            ("send_err", send_errors),
            ("shm_direct_ops", direct_ops),
            ("ud_dropped", ud_dropped),
            ("shm_peer_violations", shm_peer_violations),
            ("shm_links_refused", shm_links_refused),
            ("hand_backs_missed", hand_backs_missed),
        ];
        v.extend(qps.named());
        v
    }
}
