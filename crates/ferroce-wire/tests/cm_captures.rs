//! Golden vectors for connection management: the five CM MADs two Linux kernels exchanged in
//! `shared/captures/rping_rdmacm.pcap` (rping over rdma_cm between two rxe hosts) parse to the
//! values the kernel put there, and re-emit byte for byte.

use std::path::PathBuf;

use ferroce_wire::cm::{self, CmMad, CmMessage, MessageKind};
use ferroce_wire::frame;
use ferroce_wire::pcap::PcapReader;
use ferroce_wire::{Opcode, RocePacket, ROCE_V2_UDP_PORT};

/// The 256-byte MAD of every UD SEND to QP1 in the capture, in order.
fn cm_mads() -> Vec<Vec<u8>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/captures/rping_rdmacm.pcap");
    let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    for rec in PcapReader::new(&data).unwrap() {
        let rec = rec.unwrap();
        let Ok(udp) = frame::parse_ethernet(rec.data) else {
            continue;
        };
        if udp.dst_port != ROCE_V2_UDP_PORT {
            continue;
        }
        let p = RocePacket::new_checked(udp.payload).unwrap();
        if p.opcode() == Opcode::UD_SEND_ONLY && p.bth().dest_qpn() == 1 {
            out.push(p.payload().to_vec());
        }
    }
    out
}

fn gid(ip: [u8; 4]) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&ip);
    g
}

#[test]
fn the_kernels_connection_parses_to_its_values_and_reemits_exactly() {
    let mads = cm_mads();
    assert_eq!(mads.len(), 5, "REQ, REP, RTU, DREQ, DREP");
    let parsed: Vec<CmMad> = mads.iter().map(|m| CmMad::parse(m).unwrap()).collect();
    for (m, bytes) in parsed.iter().zip(&mads) {
        assert_eq!(
            m.transaction_id, 0x0000_0002_eb0c_ef20,
            "one transaction per connection"
        );
        assert_eq!(
            &m.to_bytes().unwrap()[..],
            &bytes[..256],
            "{m:?} re-emits exactly"
        );
    }

    let CmMessage::Req(req) = &parsed[0].message else {
        panic!("first is a REQ")
    };
    assert_eq!(req.local_comm_id, 0x20ef_0ceb);
    assert_eq!(
        req.service_id, 0x0000_0000_0106_1c06,
        "rdma_cm TCP port space, port 7174"
    );
    assert_eq!(req.local_ca_guid, 0x5054_00ff_fe77_0011);
    assert_eq!((req.local_qpn, req.starting_psn), (0x22, 0x90_176e));
    assert_eq!((req.responder_resources, req.initiator_depth), (1, 1));
    assert_eq!(
        (
            req.remote_cm_response_timeout,
            req.local_cm_response_timeout
        ),
        (20, 20)
    );
    assert_eq!(
        (req.transport_type, req.retry_count, req.rnr_retry_count),
        (0, 7, 7)
    );
    assert_eq!(
        (req.pkey, req.path_mtu, req.max_cm_retries),
        (0xffff, 3, 15)
    );
    assert!(!req.srq);
    let path = &req.primary_path;
    assert_eq!((path.local_lid, path.remote_lid), (0xffff, 0xffff));
    assert_eq!(path.local_gid, gid([192, 168, 77, 11]));
    assert_eq!(path.remote_gid, gid([192, 168, 77, 10]));
    assert_eq!(
        (path.flow_label, path.hop_limit, path.local_ack_timeout),
        (0x1d568, 64, 19)
    );
    assert_eq!(req.private_data.len(), cm::private_len::REQ);
    assert_eq!(
        &req.private_data[..4],
        &[0x00, 0x40, 0x92, 0x5e],
        "rdma_cm's IP header"
    );

    let CmMessage::Rep(rep) = &parsed[1].message else {
        panic!("second is a REP")
    };
    assert_eq!(
        (rep.local_comm_id, rep.remote_comm_id),
        (0x3b3f_3a1b, 0x20ef_0ceb)
    );
    assert_eq!((rep.local_qpn, rep.starting_psn), (0x22, 0x53_8beb));
    assert_eq!((rep.responder_resources, rep.initiator_depth), (1, 1));
    assert_eq!((rep.target_ack_delay, rep.rnr_retry_count), (15, 7));
    assert_eq!(rep.local_ca_guid, 0x5054_00ff_fe77_0010);

    let CmMessage::Rtu(rtu) = &parsed[2].message else {
        panic!("third is an RTU")
    };
    assert_eq!(
        (rtu.local_comm_id, rtu.remote_comm_id),
        (0x20ef_0ceb, 0x3b3f_3a1b)
    );
    let CmMessage::Dreq(dreq) = &parsed[3].message else {
        panic!("fourth is a DREQ")
    };
    assert_eq!(
        (dreq.local_comm_id, dreq.remote_comm_id, dreq.remote_qpn),
        (0x20ef_0ceb, 0x3b3f_3a1b, 0x22)
    );
    let CmMessage::Drep(drep) = &parsed[4].message else {
        panic!("fifth is a DREP")
    };
    assert_eq!(
        (drep.local_comm_id, drep.remote_comm_id),
        (0x3b3f_3a1b, 0x20ef_0ceb)
    );
}

#[test]
fn every_message_round_trips_and_oversized_fields_are_refused() {
    let messages = vec![
        CmMessage::Mra(cm::Mra {
            local_comm_id: 1,
            remote_comm_id: 2,
            message_mraed: MessageKind::Rep,
            service_timeout: 17,
            private_data: vec![7; cm::private_len::MRA],
        }),
        CmMessage::Rej(cm::Rej {
            local_comm_id: 3,
            remote_comm_id: 0,
            message_rejected: MessageKind::Req,
            reason: cm::rej_reason::CONSUMER_DEFINED,
            ari: vec![1, 2, 3],
            private_data: vec![9; cm::private_len::REJ],
        }),
        CmMessage::Rep(cm::Rep {
            local_comm_id: 5,
            remote_comm_id: 6,
            local_qpn: 0xab_cdef,
            vendor_id: 0x12_3456,
            starting_psn: 0xff_ffff,
            responder_resources: 16,
            initiator_depth: 16,
            rnr_retry_count: 7,
            srq: true,
            local_ca_guid: u64::MAX,
            private_data: vec![0x5a; cm::private_len::REP],
            ..Default::default()
        }),
        CmMessage::SidrReq(cm::SidrReq {
            request_id: 7,
            pkey: 0xffff,
            service_id: 0x0000_0000_0111_1234,
            private_data: vec![1; cm::private_len::SIDR_REQ],
        }),
        CmMessage::SidrRep(cm::SidrRep {
            request_id: 7,
            status: 0,
            vendor_id: 0xab_cdef,
            qpn: 0x12_3456,
            service_id: 0x0000_0000_0111_1234,
            qkey: 0x1234_5678,
            additional_info: vec![4; 5],
            private_data: vec![2; cm::private_len::SIDR_REP],
        }),
    ];
    for message in messages {
        let mad = CmMad {
            transaction_id: 42,
            attribute_modifier: 0,
            message,
        };
        let bytes = mad.to_bytes().unwrap();
        assert_eq!(CmMad::parse(&bytes).unwrap(), mad);
    }
    let too_long = CmMad {
        transaction_id: 1,
        attribute_modifier: 0,
        message: CmMessage::Rtu(cm::CommIds {
            local_comm_id: 1,
            remote_comm_id: 2,
            private_data: vec![0; cm::private_len::RTU + 1],
        }),
    };
    assert!(too_long.to_bytes().is_err());
}

#[test]
fn hostile_mads_are_errors_not_panics() {
    let good = cm_mads().remove(0);
    assert!(CmMad::parse(&good[..255]).is_err(), "short");
    for (at, value) in [(0, 2u8), (1, 0x01), (2, 1), (3, 0x81), (17, 0x99)] {
        let mut bad = good.clone();
        bad[at] = value;
        assert!(CmMad::parse(&bad).is_err(), "byte {at} = {value:#x}");
    }
    // A REJ whose ARI length says more than the field holds reads only the field.
    let mut rej = vec![0u8; 256];
    rej[..4].copy_from_slice(&[1, 7, 2, 3]);
    rej[17] = 0x12;
    rej[24 + 9] = 0xfe;
    let CmMessage::Rej(r) = CmMad::parse(&rej).unwrap().message else {
        panic!()
    };
    assert_eq!(r.ari.len(), 72);
}
