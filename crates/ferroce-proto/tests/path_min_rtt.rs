//! `QueuePair::set_path_min_rtt`: a QP measures queueing against the smaller of its own
//! smallest round trip and the path's (what other QPs to the same peer saw). A QP that started
//! into a full queue has only queued round trips of its own: told the path's base, it reads the
//! queueing and backs off as the others do; left alone it takes the queue for the path.

use core::time::Duration;

use ferroce_proto::sim::pair::{connected_qp, default_rtr, default_rts};
use ferroce_proto::{
    Access, Instant, QpCaps, QueuePair, RtsAttr, SendFlags, SendOp, SendWr, Sge, VecMemory,
    WcStatus,
};
use ferroce_wire::Psn;

const BASE: u64 = 0x20_0000;
const T0: Instant = Instant::from_nanos(1_000);

fn node(qpn: u32, peer: u32) -> (QueuePair, VecMemory) {
    let qp = connected_qp(
        qpn,
        QpCaps::default(),
        &default_rtr(peer, Psn::new(100)),
        &RtsAttr {
            sq_psn: Psn::new(100),
            ..default_rts()
        },
    );
    let mut mem = VecMemory::new();
    mem.register(1, BASE, 65_536, Access::ALL.with(Access::LOCAL_WRITE));
    (qp, mem)
}

/// One signaled 1 KiB WRITE from a fresh QP whose answer comes back `rtt` later, after
/// `path_min` (if any) was told to the requester; its window afterwards.
fn window_after_one_round_trip(rtt: Duration, path_min: Option<Duration>) -> f64 {
    let (mut a, mut am) = node(0x21, 0x22);
    let (mut b, mut bm) = node(0x22, 0x21);
    a.set_path_min_rtt(path_min);
    am.region_mut(0).bytes[..1024].fill(0x5a);
    let sge = Sge {
        addr: BASE,
        length: 1024,
        lkey: am.region(0).lkey,
    };
    let wr = SendWr::new(1, SendOp::Write, vec![sge])
        .remote(BASE, bm.region(0).rkey)
        .flags(SendFlags {
            signaled: true,
            ..SendFlags::default()
        });
    a.post_send(wr).unwrap();
    let mut buf = vec![0u8; 4096];
    let n = a.poll_transmit(T0, &mut am, &mut buf).unwrap();
    let start = a.congestion_window().unwrap();
    b.handle_packet(T0, &mut bm, &buf[..n]).unwrap();
    let n = b.poll_transmit(T0, &mut bm, &mut buf).unwrap();
    a.handle_packet(T0 + rtt, &mut am, &buf[..n]).unwrap();
    let wc = a.poll_completion().unwrap();
    assert_eq!((wc.wr_id, wc.status), (1, WcStatus::Success));
    assert_eq!(&bm.region(0).bytes[..1024], &[0x5a; 1024][..]);
    assert_eq!(start, ferroce_proto::cc::INITIAL_WINDOW);
    a.congestion_window().unwrap()
}

#[test]
fn a_queued_first_round_trip_is_taken_for_the_path_unless_the_path_is_known() {
    let queued = Duration::from_micros(1_000);
    // Alone, the first sample is the QP's base: no queueing, and the window grows.
    let alone = window_after_one_round_trip(queued, None);
    assert!(alone > ferroce_proto::cc::INITIAL_WINDOW, "{alone}");
    // Told that the path's round trip is 50 µs, it reads 950 µs of queue and shrinks.
    let told = window_after_one_round_trip(queued, Some(Duration::from_micros(50)));
    assert!(told < ferroce_proto::cc::INITIAL_WINDOW, "{told}");
    // A path figure above the QP's own changes nothing: the smaller one counts.
    let higher = window_after_one_round_trip(queued, Some(Duration::from_micros(5_000)));
    assert_eq!(higher, alone);
    // `min_rtt` has nothing to report before a sample.
    let (q, _) = node(0x23, 0x24);
    assert_eq!(q.min_rtt(), None);
}
