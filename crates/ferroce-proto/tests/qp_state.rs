//! The QP state machine: allowed and refused transitions, attribute validation, and what each
//! state does with posted work.

use core::time::Duration;
use std::net::Ipv6Addr;

use ferroce_proto::sim::pair::Pair;
use ferroce_proto::{
    Access, InitAttr, PathMtu, PostError, QpCaps, QpError, QpState, QueuePair, RecvWr, RtrAttr,
    RtsAttr, SendOp, SendWr, WcOpcode, WcStatus,
};
use ferroce_wire::Psn;

fn rtr() -> RtrAttr {
    RtrAttr {
        path_mtu: PathMtu::Mtu1024,
        dest_qpn: 0x42,
        dest_gid: Ipv6Addr::LOCALHOST,
        rq_psn: Psn::new(0),
        max_dest_rd_atomic: 1,
        min_rnr_timer: 12,
    }
}

fn rts() -> RtsAttr {
    RtsAttr {
        sq_psn: Psn::new(0),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
    }
}

#[test]
fn the_normal_path_and_refused_shortcuts() {
    let mut qp = QueuePair::new(7, 1, QpCaps::default());
    assert_eq!(qp.state(), QpState::Reset);
    assert_eq!(
        qp.modify_to_rtr(&rtr()),
        Err(QpError::InvalidTransition {
            from: QpState::Reset,
            to: QpState::Rtr
        })
    );
    assert!(matches!(
        qp.modify_to_rts(&rts()),
        Err(QpError::InvalidTransition { .. })
    ));
    qp.modify_to_init(&InitAttr::default()).unwrap();
    assert!(matches!(
        qp.modify_to_rts(&rts()),
        Err(QpError::InvalidTransition { .. })
    ));
    qp.modify_to_rtr(&rtr()).unwrap();
    assert!(matches!(
        qp.modify_to_init(&InitAttr::default()),
        Err(QpError::InvalidTransition { .. })
    ));
    qp.modify_to_rts(&rts()).unwrap();
    assert_eq!(qp.state(), QpState::Rts);
    qp.modify_to_sqd().unwrap();
    assert_eq!(qp.state(), QpState::Sqd);
    qp.modify_sqd_to_rts().unwrap();
    qp.modify_to_error();
    assert_eq!(qp.state(), QpState::Error);
    assert!(matches!(
        qp.modify_sqd_to_rts(),
        Err(QpError::InvalidTransition { .. })
    ));
    qp.reset();
    assert_eq!(qp.state(), QpState::Reset);
    qp.modify_to_init(&InitAttr::default()).unwrap();
}

#[test]
fn attributes_out_of_range_are_typed_errors() {
    assert!(matches!(
        PathMtu::from_bytes(1000),
        Err(QpError::InvalidAttribute {
            name: "path_mtu",
            value: 1000
        })
    ));
    for ok in [256, 512, 1024, 2048, 4096] {
        assert_eq!(PathMtu::from_bytes(ok).unwrap().bytes(), ok);
    }
    let mut qp = QueuePair::new(7, 1, QpCaps::default());
    assert!(matches!(
        qp.modify_to_init(&InitAttr {
            port: 2,
            ..InitAttr::default()
        }),
        Err(QpError::InvalidAttribute {
            name: "port_num",
            ..
        })
    ));
    qp.modify_to_init(&InitAttr::default()).unwrap();
    let bad_rtr = [
        RtrAttr {
            dest_qpn: 1 << 24,
            ..rtr()
        },
        RtrAttr {
            min_rnr_timer: 32,
            ..rtr()
        },
        RtrAttr {
            max_dest_rd_atomic: 17,
            ..rtr()
        },
    ];
    for a in bad_rtr {
        assert!(
            matches!(qp.modify_to_rtr(&a), Err(QpError::InvalidAttribute { .. })),
            "{a:?}"
        );
        assert_eq!(
            qp.state(),
            QpState::Init,
            "a refused transition changes nothing"
        );
    }
    qp.modify_to_rtr(&rtr()).unwrap();
    let bad_rts = [
        RtsAttr {
            timeout: 32,
            ..rts()
        },
        RtsAttr {
            retry_cnt: 8,
            ..rts()
        },
        RtsAttr {
            rnr_retry: 8,
            ..rts()
        },
        RtsAttr {
            max_rd_atomic: 17,
            ..rts()
        },
    ];
    for a in bad_rts {
        assert!(
            matches!(qp.modify_to_rts(&a), Err(QpError::InvalidAttribute { .. })),
            "{a:?}"
        );
        assert_eq!(qp.state(), QpState::Rtr);
    }
    qp.modify_to_rts(&rts()).unwrap();
}

#[test]
fn posting_in_each_state() {
    let mut qp = QueuePair::new(
        7,
        1,
        QpCaps {
            max_send_wr: 2,
            max_recv_wr: 2,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 4,
        },
    );
    let send = |id| SendWr::new(id, SendOp::Send, Vec::new());
    assert_eq!(
        qp.post_send(send(1)),
        Err(PostError::InvalidState(QpState::Reset))
    );
    assert_eq!(
        qp.post_recv(RecvWr {
            wr_id: 1,
            sgl: vec![]
        }),
        Err(PostError::InvalidState(QpState::Reset))
    );
    qp.modify_to_init(&InitAttr::default()).unwrap();
    assert_eq!(
        qp.post_send(send(1)),
        Err(PostError::InvalidState(QpState::Init))
    );
    qp.post_recv(RecvWr {
        wr_id: 1,
        sgl: vec![],
    })
    .unwrap();
    qp.modify_to_rtr(&rtr()).unwrap();
    assert_eq!(
        qp.post_send(send(1)),
        Err(PostError::InvalidState(QpState::Rtr))
    );
    qp.modify_to_rts(&rts()).unwrap();
    qp.post_send(send(1)).unwrap();
    qp.post_send(send(2)).unwrap();
    assert_eq!(qp.post_send(send(3)), Err(PostError::QueueFull(2)));
    // Caps are enforced.
    let sge = ferroce_proto::Sge {
        addr: 0,
        length: 1,
        lkey: 1,
    };
    assert!(matches!(
        qp.post_recv(RecvWr {
            wr_id: 9,
            sgl: vec![sge, sge]
        }),
        Err(PostError::TooManySge { .. })
    ));
    qp.modify_to_error();
    let _ = std::iter::from_fn(|| qp.poll_completion()).count();
    assert!(matches!(
        qp.post_send(SendWr::new(4, SendOp::Send, vec![]).inline(vec![0; 5])),
        Err(PostError::InlineNotAllowed { given: 5, max: 4 })
    ));
    let atomic = SendWr::new(
        5,
        SendOp::FetchAdd { add: 1 },
        vec![ferroce_proto::Sge { length: 4, ..sge }],
    );
    assert_eq!(qp.post_send(atomic), Err(PostError::BadAtomicBuffer));
    let huge = SendWr::new(
        6,
        SendOp::Write,
        vec![
            ferroce_proto::Sge {
                length: 1 << 31,
                ..sge
            },
            sge,
        ],
    );
    let mut qp2 = QueuePair::new(8, 1, QpCaps::default());
    qp2.modify_to_init(&InitAttr::default()).unwrap();
    qp2.modify_to_rtr(&rtr()).unwrap();
    qp2.modify_to_rts(&rts()).unwrap();
    assert_eq!(
        qp2.post_send(huge),
        Err(PostError::MessageTooLong((1 << 31) + 1))
    );
    let max = SendWr::new(
        6,
        SendOp::Write,
        vec![ferroce_proto::Sge {
            length: 1 << 31,
            ..sge
        }],
    );
    assert_eq!(
        qp2.post_send(max),
        Ok(()),
        "2^31 bytes is the largest message and is allowed"
    );
}

#[test]
fn error_flushes_everything_in_posting_order_and_later_posts_too() {
    let mut p = Pair::lossless();
    let dst = p.register(1, 64, Access::ALL);
    let src = p.register(0, 64, Access::ALL);
    // Receives on A that nobody will fill, sends that cannot finish (B's receive queue is empty
    // and the link is cut), then ERR.
    for id in 0..3 {
        p.post_recv(0, 100 + id, vec![src.sge(0, 64)]).unwrap();
    }
    p.sim
        .cut_link(0, 1, ferroce_proto::Instant::from_nanos(u64::MAX));
    for id in 0..3 {
        p.post_send(
            0,
            SendWr::new(id, SendOp::Write, vec![src.sge(0, 8)]).remote(dst.addr(0), dst.rkey),
        )
        .unwrap();
    }
    p.run(Duration::from_micros(50));
    p.qp(0).modify_to_error();
    p.post_send(0, SendWr::new(3, SendOp::Send, vec![]))
        .unwrap();
    p.post_recv(0, 103, vec![]).unwrap();
    let wcs = p.take_completions(0);
    let mut got: Vec<(u64, WcStatus, WcOpcode)> = Vec::new();
    let qp = p.qp(0);
    while let Some(w) = qp.poll_completion() {
        got.push((w.wr_id, w.status, w.opcode));
    }
    assert!(wcs.is_empty() || wcs.iter().all(|w| w.status == WcStatus::WorkRequestFlushed));
    let all: Vec<(u64, WcStatus, WcOpcode)> = wcs
        .iter()
        .map(|w| (w.wr_id, w.status, w.opcode))
        .chain(got)
        .collect();
    let flushed = WcStatus::WorkRequestFlushed;
    assert_eq!(
        all,
        vec![
            (0, flushed, WcOpcode::RdmaWrite),
            (1, flushed, WcOpcode::RdmaWrite),
            (2, flushed, WcOpcode::RdmaWrite),
            (100, flushed, WcOpcode::Recv),
            (101, flushed, WcOpcode::Recv),
            (102, flushed, WcOpcode::Recv),
            (3, flushed, WcOpcode::Send),
            (103, flushed, WcOpcode::Recv),
        ]
    );
}

#[test]
fn sqd_holds_new_requests_until_rts() {
    let mut p = Pair::lossless();
    let src = p.register(0, 64, Access::ALL);
    let dst = p.register(1, 64, Access::ALL);
    p.bytes_mut(src).fill(3);
    p.qp(0).modify_to_sqd().unwrap();
    p.post_send(
        0,
        SendWr::new(1, SendOp::Write, vec![src.sge(0, 64)]).remote(dst.addr(0), dst.rkey),
    )
    .unwrap();
    assert!(p.run(Duration::from_millis(100)));
    assert!(p.take_completions(0).is_empty(), "nothing starts in SQD");
    assert!(p.bytes(dst).iter().all(|&b| b == 0));
    p.qp(0).modify_sqd_to_rts().unwrap();
    let wcs = p.wait_completions(0, 1, Duration::from_secs(1));
    assert_eq!(wcs[0].status, WcStatus::Success);
    assert!(p.bytes(dst).iter().all(|&b| b == 3));
}

#[test]
fn packets_for_a_qp_in_reset_or_init_are_dropped_and_counted() {
    let mut p = Pair::lossless();
    let src = p.register(0, 64, Access::ALL);
    let dst = p.register(1, 64, Access::ALL);
    p.qp(1).reset();
    p.post_send(
        0,
        SendWr::new(1, SendOp::Write, vec![src.sge(0, 8)]).remote(dst.addr(0), dst.rkey),
    )
    .unwrap();
    p.run(Duration::from_millis(1));
    assert!(p.qp(1).counters().dropped_bad_state >= 1);
    assert!(p.bytes(dst).iter().all(|&b| b == 0));
}
