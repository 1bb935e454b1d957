//! Per-QP counters, named as Linux rxe's hardware counters name them (`rdma statistic`), so the
//! figures read the same as rdma-core's tools print for rxe. Where rxe has no counter for an
//! event, the name is mlx5's (`/sys/class/infiniband/*/ports/*/hw_counters`) when it has one,
//! else one in the same style.
//!
//! Every way the transport refuses or drops a packet bumps exactly one counter here (or, for
//! what never reaches a QP, one of the provider's context counters), so a packet never vanishes
//! unseen.

/// Declares the counter struct once and derives its name table and arithmetic from the same
/// list, so a new counter cannot be left out of [`Counters::named`] or [`Counters::add`].
macro_rules! counters {
    ($(#[$sm:meta])* pub struct $name:ident { $($(#[$m:meta])* $field:ident,)* }) => {
        $(#[$sm])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
        pub struct $name {
            $($(#[$m])* pub $field: u64,)*
        }

        impl $name {
            /// The counters' names, in declaration order.
            pub const NAMES: &'static [&'static str] = &[$(stringify!($field)),*];

            /// Every counter as `(name, value)`, in declaration order.
            pub fn named(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($field), self.$field)),*]
            }

            /// Adds every counter of `other` into `self` (to total several QPs).
            pub fn add(&mut self, other: &$name) {
                $(self.$field = self.$field.wrapping_add(other.$field);)*
            }
        }
    };
}

counters! {
    /// Counters of one queue pair.
    pub struct Counters {
        /// Packets transmitted (`sent_pkts`).
        sent_pkts,
        /// Packets received and accepted by the QP (`rcvd_pkts`).
        rcvd_pkts,
        /// Payload bytes transmitted (`sent_bytes`).
        sent_bytes,
        /// Payload bytes received (`rcvd_bytes`).
        rcvd_bytes,
        /// Request packets sent again, by go-back-N or one by one (`retransmits`).
        retransmits,
        /// Of those, packets sent again alone because a selective-repeat peer reported them
        /// missing (tail-loss probes are counted apart).
        sr_retransmits,
        /// Fast retransmission timeouts (from the measured RTT) that resent from the oldest
        /// unacknowledged PSN without spending the retry budget.
        rto_fired,
        /// Of those, timeouts found spurious (the original's acknowledgement came after it),
        /// whose window cut was undone.
        spurious_rto,
        /// Request packets that arrived after a gap and were kept until it was filled
        /// (selective repeat).
        ooo_held,
        /// Request packets that arrived after a gap and could not be kept (beyond the reorder
        /// buffer's reach, or a copy already kept).
        ooo_dropped,
        /// Selective acknowledgements sent: what is kept after a gap (see [`crate::sack`]).
        sacks_sent,
        /// Selective acknowledgements received and acted on.
        sacks_rcvd,
        /// Tail-loss probes: the newest packet sent again when no acknowledgement came for
        /// two round trips, so a loss at the end of a burst is reported by a SACK rather than
        /// found by the retransmission timeout.
        tail_loss_probes,
        /// Requests received with a PSN already seen (`duplicate_request`).
        duplicate_request,
        /// Requests received ahead of the expected PSN (`out_of_seq_request`).
        out_of_seq_request,
        /// PSN-sequence-error NAKs sent.
        send_seq_nak,
        /// PSN-sequence-error NAKs received (`rcvd_seq_err`).
        rcvd_seq_err,
        /// Responses that skipped a READ or atomic answer, taken as a NAK
        /// (`implied_nak_seq_err`, mlx5's name).
        implied_nak_seq_err,
        /// RNR NAKs sent (`send_rnr_err`).
        send_rnr_err,
        /// RNR NAKs received (`rcvd_rnr_err`).
        rcvd_rnr_err,
        /// Local ACK timeouts that led to a retry (`completer_retry_err`).
        completer_retry_err,
        /// Transport retry counter exhausted (`retry_exceeded_err`).
        retry_exceeded_err,
        /// RNR retry counter exhausted (`retry_rnr_exceeded_err`).
        retry_rnr_exceeded_err,
        /// Requests refused for a bad R_Key, bounds or rights (remote access error NAKs sent).
        rkey_violations,
        /// Invalid-request NAKs sent (bad opcode sequence, length, alignment, resources).
        send_invalid_request,
        /// Remote-operational-error NAKs sent (a receive buffer that could not be written).
        send_remote_op_err,
        /// Remote-access-error NAKs received (`req_remote_access_errors`, mlx5's name).
        req_remote_access_errors,
        /// Invalid-request NAKs received (`req_remote_invalid_request`, mlx5's name).
        req_remote_invalid_request,
        /// Remote-operational-error NAKs received (`remote_op_err`, bnxt_re's name).
        remote_op_err,
        /// Responses received for PSNs no longer outstanding, or that do not fit the request.
        duplicate_response,
        /// Packets dropped because the QP's state does not take them, or because they belong
        /// to a transport other than RC.
        dropped_bad_state,
        /// ACK packets sent.
        acks_sent,
        /// SEND work requests completed (`rdma_sends`).
        rdma_sends,
        /// Receive work requests completed successfully (`rdma_recvs`).
        rdma_recvs,
        /// Packets that arrived marked Congestion Experienced in the IP header's ECN field
        /// (`np_ecn_marked_roce_packets`, mlx5's name): a queue on the path was long.
        np_ecn_marked_roce_packets,
        /// CNPs sent to the peer in answer to marked packets, at most one per
        /// [`crate::dcqcn::MIN_TIME_BETWEEN_CNPS`] (`np_cnp_sent`, mlx5's name).
        np_cnp_sent,
        /// CNPs received that cut the QP's sending rate (`rp_cnp_handled`, mlx5's name).
        rp_cnp_handled,
        /// CNPs received while the QP was not sending (not in RTS or SQD), and so ignored
        /// (`rp_cnp_ignored`, mlx5's name).
        rp_cnp_ignored,
        /// UC request packets dropped because a packet of their message was missing: those
        /// after a gap until the next message starts, and the rest of a message the responder
        /// refused (see [`crate::uc`]).
        uc_dropped_packets,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field set to its position (1-based), written out in full so that a new field
    /// must be added here too.
    fn numbered() -> Counters {
        Counters {
            sent_pkts: 1,
            rcvd_pkts: 2,
            sent_bytes: 3,
            rcvd_bytes: 4,
            retransmits: 5,
            sr_retransmits: 6,
            rto_fired: 7,
            spurious_rto: 8,
            ooo_held: 9,
            ooo_dropped: 10,
            sacks_sent: 11,
            sacks_rcvd: 12,
            tail_loss_probes: 13,
            duplicate_request: 14,
            out_of_seq_request: 15,
            send_seq_nak: 16,
            rcvd_seq_err: 17,
            implied_nak_seq_err: 18,
            send_rnr_err: 19,
            rcvd_rnr_err: 20,
            completer_retry_err: 21,
            retry_exceeded_err: 22,
            retry_rnr_exceeded_err: 23,
            rkey_violations: 24,
            send_invalid_request: 25,
            send_remote_op_err: 26,
            req_remote_access_errors: 27,
            req_remote_invalid_request: 28,
            remote_op_err: 29,
            duplicate_response: 30,
            dropped_bad_state: 31,
            acks_sent: 32,
            rdma_sends: 33,
            rdma_recvs: 34,
            np_ecn_marked_roce_packets: 35,
            np_cnp_sent: 36,
            rp_cnp_handled: 37,
            rp_cnp_ignored: 38,
            uc_dropped_packets: 39,
        }
    }

    #[test]
    fn named_lists_every_field_in_order_under_its_own_name() {
        let named = numbered().named();
        assert_eq!(named.len(), Counters::NAMES.len());
        for (i, &(name, v)) in named.iter().enumerate() {
            assert_eq!(v, i as u64 + 1, "{name}");
            assert_eq!(name, Counters::NAMES[i]);
        }
        assert_eq!(named[0], ("sent_pkts", 1));
        assert!(named.contains(&("rkey_violations", numbered().rkey_violations)));
        let mut names = Counters::NAMES.to_vec();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Counters::NAMES.len(), "duplicate counter name");
    }

    #[test]
    fn add_sums_every_field() {
        let mut a = numbered();
        a.add(&numbered());
        for (i, &(name, v)) in a.named().iter().enumerate() {
            assert_eq!(v, 2 * (i as u64 + 1), "{name}");
        }
        let mut z = Counters::default();
        z.add(&Counters::default());
        assert_eq!(z, Counters::default());
    }
}
