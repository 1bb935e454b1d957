//! Failures the fuzz targets in `fuzz/` found, each replayed as a plain test with the packets
//! of the crashing input (the input file is named in each test's doc).

use ferroce_proto::qp::MAX_HEADER_LEN;
use ferroce_proto::{
    Access, InitAttr, Instant, PathMtu, QpCaps, QueuePair, RtrAttr, RtsAttr, VecMemory,
};
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
