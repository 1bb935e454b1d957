//! Failures the fuzz targets in `fuzz/` found, each replayed as a plain test with the packets
//! of the crashing input (the input file is named in each test's doc).

use ferroce_proto::qp::MAX_HEADER_LEN;
use ferroce_proto::{
    Access, InitAttr, Instant, PathMtu, QpCaps, QpState, QueuePair, RecvWr, RtrAttr, RtsAttr,
    SendOp, SendWr, Sge, VecMemory, WcStatus,
};
use ferroce_wire::aeth::{AethRepr, Syndrome};
use ferroce_wire::bth::{BthRepr, DEFAULT_PKEY};
use ferroce_wire::reth::RethRepr;
use ferroce_wire::{ExtHeaders, Opcode, PacketRepr, Psn, RocePacket};

const QPN: u32 = 0x12;
const PEER: u32 = 0x345;

/// A QP in RTS expecting PSN 0 from its peer, with one 8 KiB remotely readable region whose
/// byte `i` is `i as u8`.
fn responder(mtu: PathMtu) -> (QueuePair, VecMemory, u64, u32) {
    let mut mem = VecMemory::new();
    let base = 0x1_0000_0000;
    let i = mem.register(1, base, 8192, Access::REMOTE_READ);
    for (k, b) in mem.region_mut(i).bytes.iter_mut().enumerate() {
        *b = k as u8;
    }
    let rkey = mem.region(i).rkey;
    let mut qp = QueuePair::new(QPN, 1, QpCaps::default());
    qp.modify_to_init(&InitAttr::default()).unwrap();
    qp.modify_to_rtr(&RtrAttr {
        path_mtu: mtu,
        dest_qpn: PEER,
        dest_gid: "::ffff:10.0.0.2".parse().unwrap(),
        rq_psn: Psn::new(0),
        max_dest_rd_atomic: 4,
        min_rnr_timer: 1,
    })
    .unwrap();
    qp.modify_to_rts(&RtsAttr {
        sq_psn: Psn::new(0),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
    })
    .unwrap();
    (qp, mem, base, rkey)
}

fn read_request(psn: u32, reth: RethRepr) -> Vec<u8> {
    let bth = BthRepr {
        opcode: Opcode::RC_RDMA_READ_REQUEST,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: DEFAULT_PKEY,
        fecn: false,
        becn: false,
        dest_qpn: QPN,
        ack_req: true,
        psn: Psn::new(psn),
    };
    let ext = ExtHeaders {
        reth: Some(reth),
        ..Default::default()
    };
    let repr = PacketRepr::new(bth, ext, 0);
    let mut buf = vec![0; repr.buffer_len().unwrap()];
    repr.emit(&mut buf).unwrap();
    buf
}

/// PSNs of `packets`.
fn psns(packets: &[(Opcode, u32, Vec<u8>)]) -> Vec<u32> {
    packets.iter().map(|(_, p, _)| *p).collect()
}

/// Every packet the QP has to send: (opcode, PSN, payload).
fn drain(qp: &mut QueuePair, mem: &mut VecMemory) -> Vec<(Opcode, u32, Vec<u8>)> {
    let mut buf = vec![0; 4096 + MAX_HEADER_LEN];
    let mut out = Vec::new();
    while let Some(n) = qp.poll_transmit(Instant::ZERO, mem, &mut buf) {
        let p = RocePacket::new_checked(&buf[..n]).unwrap();
        out.push((p.opcode(), p.bth().psn().value(), p.payload().to_vec()));
    }
    out
}

/// `fuzz/artifacts/responder/crash-b7bdde15a8d98b5f2f5649bbc083adf94eb0faf0`: a READ of 4549
/// bytes at MTU 256 takes PSNs 0..=17; a duplicate at PSN 14 carrying the original's whole
/// RETH was served in full from PSN 14, so the responder sent READ responses for PSNs 18..=31,
/// which belong to the requests after the READ. Such a duplicate is now dropped, while the
/// duplicate a requester's retry really sends (the RETH moved on by 14 MTUs) is answered with
/// exactly PSNs 14..=17 and the original bytes.
#[test]
fn duplicate_read_larger_than_its_remainder_is_dropped() {
    let (mut qp, mut mem, base, rkey) = responder(PathMtu::Mtu256);
    let va = base + 0xaf7;
    let reth = RethRepr {
        va,
        rkey,
        dma_len: 4549,
    };
    qp.handle_packet(Instant::ZERO, &mut mem, &read_request(0, reth))
        .unwrap();
    let first = drain(&mut qp, &mut mem);
    assert_eq!(first.len(), 18);
    assert_eq!(qp.expected_psn(), Psn::new(18));

    // The crashing duplicate: PSN 14, the whole original range.
    qp.handle_packet(Instant::ZERO, &mut mem, &read_request(14, reth))
        .unwrap();
    assert_eq!(
        drain(&mut qp, &mut mem),
        vec![],
        "oversized duplicate answered"
    );
    // Larger than the original, or starting before it: dropped too.
    for bad in [
        RethRepr {
            dma_len: 4550,
            ..reth
        },
        RethRepr {
            va: va - 1,
            dma_len: 10,
            ..reth
        },
    ] {
        qp.handle_packet(Instant::ZERO, &mut mem, &read_request(0, bad))
            .unwrap();
        assert_eq!(psns(&drain(&mut qp, &mut mem)), vec![], "{bad:?} answered");
    }

    // The retry a requester sends after losing responses 14..=17.
    let retry = RethRepr {
        va: va + 14 * 256,
        rkey,
        dma_len: 4549 - 14 * 256,
    };
    qp.handle_packet(Instant::ZERO, &mut mem, &read_request(14, retry))
        .unwrap();
    let again = drain(&mut qp, &mut mem);
    assert_eq!(psns(&again), vec![14, 15, 16, 17]);
    assert_eq!(again[0].0, Opcode::RC_RDMA_READ_RESPONSE_FIRST);
    assert_eq!(again[3].0, Opcode::RC_RDMA_READ_RESPONSE_LAST);
    let bytes: Vec<u8> = again.iter().flat_map(|(_, _, d)| d.clone()).collect();
    let expect: Vec<u8> = (0xaf7 + 14 * 256..0xaf7 + 4549).map(|k| k as u8).collect();
    assert_eq!(bytes, expect);
    assert_eq!(qp.state(), ferroce_proto::QpState::Rts);
}

/// A request or response from the peer.
fn packet(opcode: Opcode, psn: u32, ext: ExtHeaders, payload: &[u8]) -> Vec<u8> {
    let bth = BthRepr {
        opcode,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: DEFAULT_PKEY,
        fecn: false,
        becn: false,
        dest_qpn: QPN,
        ack_req: true,
        psn: Psn::new(psn),
    };
    let repr = PacketRepr::new(bth, ext, payload.len());
    let mut buf = vec![0; repr.buffer_len().unwrap()];
    repr.emit(&mut buf).unwrap();
    RocePacket::new_unchecked(&mut buf[..])
        .payload_mut()
        .copy_from_slice(payload);
    buf
}

/// A READ response packet at `psn` carrying `payload`, with the AETH its position needs.
fn read_response(opcode: Opcode, psn: u32, payload: &[u8]) -> Vec<u8> {
    let with_aeth = opcode != Opcode::RC_RDMA_READ_RESPONSE_MIDDLE;
    let ext = ExtHeaders {
        aeth: with_aeth.then_some(AethRepr {
            syndrome: Syndrome::Ack { credits: 31 },
            msn: 1,
        }),
        ..Default::default()
    };
    packet(opcode, psn, ext, payload)
}

/// `fuzz/fuzz_targets/responder.rs` with input `ff 00 aa 00 7f c7 c7 c7 c7 09 00 aa 00 00 00 00 00
/// ff 5a ff 5a ff 1a 9a 5a`: a READ of 4096 bytes accepted at MTU 4096 takes one PSN; the MTU then
/// dropped to 256 and the answer was cut at 256, sixteen packets with PSNs that belong to the
/// requests after the READ. `set_path_mtu` changes new messages only: the answer keeps the MTU
/// the READ was accepted under, and the next READ is cut at the new one.
#[test]
fn read_accepted_before_an_mtu_change_is_answered_at_its_mtu() {
    let (mut qp, mut mem, base, rkey) = responder(PathMtu::Mtu4096);
    let reth = RethRepr {
        va: base,
        rkey,
        dma_len: 4096,
    };
    qp.handle_packet(Instant::ZERO, &mut mem, &read_request(0, reth))
        .unwrap();
    assert_eq!(qp.expected_psn(), Psn::new(1));
    qp.set_path_mtu(PathMtu::Mtu256).unwrap();
    let out = drain(&mut qp, &mut mem);
    assert_eq!(psns(&out), vec![0]);
    assert_eq!(out[0].0, Opcode::RC_RDMA_READ_RESPONSE_ONLY);
    let want: Vec<u8> = (0..4096).map(|k| k as u8).collect();
    assert_eq!(out[0].2, want);

    let next = RethRepr {
        va: base + 4096,
        rkey,
        dma_len: 512,
    };
    qp.handle_packet(Instant::ZERO, &mut mem, &read_request(1, next))
        .unwrap();
    let out = drain(&mut qp, &mut mem);
    assert_eq!(psns(&out), vec![1, 2]);
    assert_eq!(out[1].2.len(), 256);
    assert_eq!(qp.expected_psn(), Psn::new(3));
}

/// The responder's half of the same contract for a message coming in: a SEND whose first packet
/// came at MTU 1024 is taken to its end at 1024 after the MTU drops to 256 (it used to be
/// refused as an invalid request, and the QP went to ERR).
#[test]
fn send_under_way_keeps_its_mtu_across_an_mtu_change() {
    let (mut qp, mut mem, _, _) = responder(PathMtu::Mtu1024);
    let rbase = 0x2_0000_0000;
    let r = mem.register(1, rbase, 4096, Access::LOCAL_WRITE);
    let lkey = mem.region(r).lkey;
    qp.post_recv(RecvWr {
        wr_id: 7,
        sgl: vec![Sge {
            addr: rbase,
            length: 4096,
            lkey,
        }],
    })
    .unwrap();
    let msg: Vec<u8> = (0..2148u32).map(|k| (k * 7) as u8).collect();
    let none = ExtHeaders::default();
    let first = packet(Opcode::RC_SEND_FIRST, 0, none, &msg[..1024]);
    qp.handle_packet(Instant::ZERO, &mut mem, &first).unwrap();
    qp.set_path_mtu(PathMtu::Mtu256).unwrap();
    for (op, psn, part) in [
        (Opcode::RC_SEND_MIDDLE, 1, &msg[1024..2048]),
        (Opcode::RC_SEND_LAST, 2, &msg[2048..]),
    ] {
        qp.handle_packet(Instant::ZERO, &mut mem, &packet(op, psn, none, part))
            .unwrap();
    }
    assert_eq!(qp.state(), QpState::Rts);
    let wc = qp.poll_completion().expect("the receive completes");
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (7, WcStatus::Success, 2148)
    );
    assert_eq!(&mem.region(r).bytes[..2148], &msg[..]);
}

/// A QP in RTS sending from PSN 0 at `mtu`, with an 8 KiB source region (byte `i` is
/// `i * 3`) and a 16 KiB destination region; returns (QP, memory, source, destination) where
/// each region is (base, lkey).
fn requester(mtu: PathMtu) -> (QueuePair, VecMemory, (u64, u32), (u64, u32)) {
    let mut mem = VecMemory::new();
    let s = mem.register(1, 0x3_0000_0000, 8192, Access::NONE);
    for (k, b) in mem.region_mut(s).bytes.iter_mut().enumerate() {
        *b = (k * 3) as u8;
    }
    let d = mem.register(1, 0x4_0000_0000, 16384, Access::LOCAL_WRITE);
    let src = (0x3_0000_0000, mem.region(s).lkey);
    let dst = (0x4_0000_0000, mem.region(d).lkey);
    let mut qp = QueuePair::new(QPN, 1, QpCaps::default());
    qp.modify_to_init(&InitAttr::default()).unwrap();
    qp.modify_to_rtr(&RtrAttr {
        path_mtu: mtu,
        dest_qpn: PEER,
        dest_gid: "::ffff:10.0.0.2".parse().unwrap(),
        rq_psn: Psn::new(0),
        max_dest_rd_atomic: 4,
        min_rnr_timer: 1,
    })
    .unwrap();
    qp.modify_to_rts(&RtsAttr {
        sq_psn: Psn::new(0),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 4,
    })
    .unwrap();
    // Whole messages leave at once here: no congestion window in the way.
    qp.set_congestion_control(ferroce_proto::CcConfig {
        algorithm: ferroce_proto::CcAlgorithm::Off,
        ..Default::default()
    });
    (qp, mem, src, dst)
}

/// `fuzz/fuzz_targets/requester.rs` (with its MTU-change step allowed mid-request) with input
/// base64 `ARD/YGBgYGB1dQAAPZh1AAAAtT2YtQ==`: a READ of 8193 bytes started at MTU 4096 (three
/// PSNs); after the MTU dropped to 1024 the requester took three 1024-byte responses as the
/// whole answer and completed the READ successfully with 5121 bytes never written. Responses
/// are now held to the MTU the READ started with.
#[test]
fn read_started_before_an_mtu_change_takes_responses_at_its_mtu() {
    let (mut qp, mut mem, _, (dst, dkey)) = requester(PathMtu::Mtu4096);
    qp.post_send(
        SendWr::new(
            1,
            SendOp::Read,
            vec![Sge {
                addr: dst,
                length: 8193,
                lkey: dkey,
            }],
        )
        .remote(0x9000, 0x55),
    )
    .unwrap();
    assert_eq!(psns(&drain(&mut qp, &mut mem)), vec![0]);
    qp.set_path_mtu(PathMtu::Mtu1024).unwrap();
    let fill = |psn: u32, n: usize| -> Vec<u8> { (0..n).map(|i| (i as u8) ^ psn as u8).collect() };
    use Opcode as O;
    // Cut at the new MTU: not what this READ asked for.
    for (op, psn) in [
        (O::RC_RDMA_READ_RESPONSE_FIRST, 0),
        (O::RC_RDMA_READ_RESPONSE_MIDDLE, 1),
        (O::RC_RDMA_READ_RESPONSE_LAST, 2),
    ] {
        let p = read_response(op, psn, &fill(psn, 1024));
        qp.handle_packet(Instant::ZERO, &mut mem, &p).unwrap();
    }
    assert!(
        qp.poll_completion().is_none(),
        "completed on 3 KiB of 8 KiB"
    );
    for (op, psn, n) in [
        (O::RC_RDMA_READ_RESPONSE_FIRST, 0, 4096),
        (O::RC_RDMA_READ_RESPONSE_MIDDLE, 1, 4096),
        (O::RC_RDMA_READ_RESPONSE_LAST, 2, 1),
    ] {
        let p = read_response(op, psn, &fill(psn, n));
        qp.handle_packet(Instant::ZERO, &mut mem, &p).unwrap();
    }
    let wc = qp.poll_completion().expect("the READ completes");
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (1, WcStatus::Success, 8193)
    );
    let want: Vec<u8> = [fill(0, 4096), fill(1, 4096), fill(2, 1)].concat();
    assert_eq!(&mem.region(1).bytes[..8193], &want[..]);
}

/// Found with the same target: a WRITE of 4879 bytes started at MTU 256 (20 PSNs) was resent,
/// after the MTU rose to 1024 and its ACK timed out, cut at 1024: five packets, the last one a
/// WRITE_LAST at PSN 4 of a message the responder expects to end at PSN 19. It is resent at 256.
#[test]
fn write_started_before_an_mtu_change_is_resent_at_its_mtu() {
    let (mut qp, mut mem, (src, skey), _) = requester(PathMtu::Mtu256);
    let sge = Sge {
        addr: src,
        length: 4879,
        lkey: skey,
    };
    qp.post_send(SendWr::new(1, SendOp::Write, vec![sge]).remote(0x9000, 0x55))
        .unwrap();
    let first = drain(&mut qp, &mut mem);
    assert_eq!(psns(&first), (0..20).collect::<Vec<_>>());
    qp.set_path_mtu(PathMtu::Mtu1024).unwrap();
    let late = qp.next_timeout().expect("the ACK timer runs");
    qp.handle_timeout(late);
    let again = drain(&mut qp, &mut mem);
    assert_eq!(psns(&again), psns(&first), "resent at its own MTU");
    assert_eq!(again, first, "the same packets, byte for byte");
    assert_eq!(again[19].0, Opcode::RC_RDMA_WRITE_LAST);
    assert_eq!(again[19].2.len(), 4879 - 19 * 256);
}
