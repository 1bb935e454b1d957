//! Property tests: emit then parse is the identity for every opcode and header combination, and
//! no byte string, however broken, makes a parser panic.

use ferroce_wire::aeth::{AethRepr, Syndrome};
use ferroce_wire::atomic_ack_eth::AtomicAckEthRepr;
use ferroce_wire::atomic_eth::AtomicEthRepr;
use ferroce_wire::bth::BthRepr;
use ferroce_wire::decode::{decode_frame, Decoded};
use ferroce_wire::deth::DethRepr;
use ferroce_wire::frame::{self, UdpFrameHeaders};
use ferroce_wire::icrc::{self, IcrcCheck};
use ferroce_wire::ieth::IethRepr;
use ferroce_wire::immdt::ImmDtRepr;
use ferroce_wire::opcode::{HeaderSet, ALL_OPCODES};
use ferroce_wire::packet::pad_for;
use ferroce_wire::{ExtHeaders, PacketRepr, Psn, RocePacket};
use proptest::prelude::*;

fn bth_for(op: ferroce_wire::Opcode) -> impl Strategy<Value = BthRepr> {
    (
        any::<bool>(),
        any::<bool>(),
        any::<u16>(),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_flat_map(move |(se, m, pkey, fecn, becn)| {
            (0u32..1 << 24, any::<bool>(), 0u32..1 << 24).prop_map(move |(qpn, ack, psn)| BthRepr {
                opcode: op,
                solicited: se,
                migreq: m,
                pad_count: 0,
                pkey,
                fecn,
                becn,
                dest_qpn: qpn,
                ack_req: ack,
                psn: Psn::new(psn),
            })
        })
}

fn ext_for(set: HeaderSet) -> impl Strategy<Value = ExtHeaders> {
    let opt = move |h: HeaderSet| set.contains(h);
    (
        (any::<u32>(), 0u32..1 << 24),
        (any::<u64>(), any::<u32>(), any::<u32>()),
        (any::<u64>(), any::<u32>(), any::<u64>(), any::<u64>()),
        (0u8..0x80, 0u32..1 << 24),
        (any::<u64>(), any::<u32>(), any::<u32>()),
    )
        .prop_map(move |(d, r, a, k, (orig, imm, inv))| ExtHeaders {
            deth: opt(HeaderSet::DETH).then_some(DethRepr {
                qkey: d.0,
                src_qpn: d.1,
            }),
            reth: opt(HeaderSet::RETH).then_some(ferroce_wire::reth::RethRepr {
                va: r.0,
                rkey: r.1,
                dma_len: r.2,
            }),
            atomic_eth: opt(HeaderSet::ATOMIC_ETH).then_some(AtomicEthRepr {
                va: a.0,
                rkey: a.1,
                swap_add: a.2,
                compare: a.3,
            }),
            aeth: opt(HeaderSet::AETH).then_some(AethRepr {
                syndrome: Syndrome::from_byte(k.0),
                msn: k.1,
            }),
            atomic_ack_eth: opt(HeaderSet::ATOMIC_ACK_ETH)
                .then_some(AtomicAckEthRepr { original: orig }),
            immdt: opt(HeaderSet::IMMDT).then_some(ImmDtRepr { value: imm }),
            ieth: opt(HeaderSet::IETH).then_some(IethRepr { rkey: inv }),
        })
}

/// Any valid packet: an opcode from the table, its headers, a payload if it carries one.
fn packet() -> impl Strategy<Value = (PacketRepr, Vec<u8>)> {
    proptest::sample::select(ALL_OPCODES).prop_flat_map(|op| {
        let info = op.info().unwrap();
        let max_payload = if info.has_payload { 300 } else { 0 };
        (
            bth_for(op),
            ext_for(info.headers),
            proptest::collection::vec(any::<u8>(), 0..=max_payload),
        )
            .prop_map(|(bth, ext, payload)| (PacketRepr::new(bth, ext, payload.len()), payload))
    })
}

fn headers_v4() -> UdpFrameHeaders {
    UdpFrameHeaders::roce(
        "192.168.77.10".parse().unwrap(),
        49_153,
        "192.168.77.11".parse().unwrap(),
    )
}

fn build(repr: &PacketRepr, payload: &[u8], hdrs: &UdpFrameHeaders) -> Vec<u8> {
    let mut buf = vec![0u8; repr.buffer_len().unwrap()];
    repr.emit(&mut buf).unwrap();
    let mut p = RocePacket::new_checked(&mut buf[..]).unwrap();
    p.payload_mut().copy_from_slice(payload);
    let ip_udp = hdrs.ip_udp_headers(buf.len()).unwrap();
    let crc = icrc::compute(
        ip_udp.ip(),
        ip_udp.udp(),
        RocePacket::new_unchecked(&buf[..]).covered(),
    )
    .unwrap();
    RocePacket::new_unchecked(&mut buf[..]).set_icrc(crc);
    buf
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn parse_emit_is_identity((repr, payload) in packet()) {
        let bytes = build(&repr, &payload, &headers_v4());
        let view = RocePacket::new_checked(&bytes[..]).unwrap();
        prop_assert_eq!(PacketRepr::parse(&view).unwrap(), repr);
        prop_assert_eq!(view.payload(), &payload[..]);
        prop_assert_eq!(view.bth().pad_count(), pad_for(payload.len()));
        prop_assert_eq!(bytes.len() % 4, 0);
    }

    #[test]
    fn frames_decode_with_good_icrc_v4_and_v6((repr, payload) in packet(), v6 in any::<bool>()) {
        let hdrs = if v6 {
            UdpFrameHeaders::roce("fd00::a".parse().unwrap(), 50_000, "fd00::b".parse().unwrap())
        } else {
            headers_v4()
        };
        let pkt = build(&repr, &payload, &hdrs);
        let mut f = Vec::new();
        hdrs.write_frame(&pkt, &mut f).unwrap();
        match decode_frame(&f) {
            Decoded::Roce(s) => {
                prop_assert!(s.icrc_ok);
                prop_assert_eq!(s.repr, repr);
            }
            other => prop_assert!(false, "{:?}", other),
        }
    }

    #[test]
    fn one_flipped_bit_is_caught((repr, payload) in packet(), bit in any::<prop::sample::Index>()) {
        let hdrs = headers_v4();
        let mut pkt = build(&repr, &payload, &hdrs);
        let ip_udp = hdrs.ip_udp_headers(pkt.len()).unwrap();
        let at = bit.index(pkt.len() * 8);
        // Flipping a bit of resv8a (byte 4 of the BTH) is invisible to the ICRC by design.
        prop_assume!(at / 8 != 4);
        pkt[at / 8] ^= 1 << (at % 8);
        if let Ok(view) = RocePacket::new_checked(&pkt[..]) {
            prop_assert!(!icrc::verify(ip_udp.ip(), ip_udp.udp(), view.covered(), view.icrc()).unwrap());
        }
    }

    #[test]
    fn the_identification_sent_solves_from_any_assumed_one(
        (repr, payload) in packet(),
        sent in any::<u16>(),
        assumed in prop_oneof![Just(0u16), any::<u16>()],
    ) {
        let sender = UdpFrameHeaders { ident: sent, ..headers_v4() };
        let pkt = build(&repr, &payload, &sender);
        let seen = UdpFrameHeaders { ident: assumed, ..headers_v4() }
            .ip_udp_headers(pkt.len())
            .unwrap();
        let view = RocePacket::new_checked(&pkt[..]).unwrap();
        let (ip, udp, covered, crc) = (seen.ip(), seen.udp(), view.covered(), view.icrc());
        prop_assert_eq!(icrc::solve_ipv4_identification(ip, udp, covered, crc).unwrap(), Some(sent));
        let expected = if sent == assumed {
            IcrcCheck::Verified
        } else {
            IcrcCheck::VerifiedWithIdentification(sent)
        };
        prop_assert_eq!(icrc::verify_any_ipv4_identification(ip, udp, covered, crc).unwrap(), expected);
    }

    #[test]
    fn a_solved_identification_always_verifies(
        (repr, payload) in packet(),
        sent in any::<u16>(),
        assume_sent in any::<bool>(),
        bits in proptest::collection::vec(any::<prop::sample::Index>(), 1..=3),
    ) {
        let sender = UdpFrameHeaders { ident: sent, ..headers_v4() };
        let mut pkt = build(&repr, &payload, &sender);
        let assumed = if assume_sent { sent } else { 0 };
        let receiver = UdpFrameHeaders { ident: assumed, ..headers_v4() };
        let seen = receiver.ip_udp_headers(pkt.len()).unwrap();
        let ats: Vec<usize> = bits.iter().map(|b| b.index(pkt.len() * 8)).collect();
        // resv8a (byte 4 of the BTH) is masked: a flip there is no corruption.
        prop_assume!(ats.iter().all(|at| at / 8 != 4));
        for at in &ats {
            pkt[at / 8] ^= 1 << (at % 8);
        }
        if let Ok(view) = RocePacket::new_checked(&pkt[..]) {
            let solved = icrc::solve_ipv4_identification(
                seen.ip(), seen.udp(), view.covered(), view.icrc()).unwrap();
            if let Some(id) = solved {
                // Whatever the corruption, the solver names only an Identification with which
                // the ICRC really verifies.
                let with_id = UdpFrameHeaders { ident: id, ..receiver }
                    .ip_udp_headers(pkt.len())
                    .unwrap();
                prop_assert_eq!(
                    icrc::compute(with_id.ip(), with_id.udp(), view.covered()).unwrap(),
                    view.icrc()
                );
            }
            // And a single flipped bit is never explained by any (see the icrc module docs).
            if ats.len() == 1 {
                prop_assert_eq!(solved, None);
            }
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(view) = RocePacket::new_checked(&bytes[..]) {
            let repr = PacketRepr::parse(&view).unwrap();
            // What parses re-emits to the same length.
            prop_assert_eq!(repr.buffer_len().unwrap(), bytes.len());
            let _ = view.payload();
        }
        let _ = frame::parse_ethernet(&bytes);
        let _ = decode_frame(&bytes);
    }

    #[test]
    fn truncated_and_mutated_packets_never_panic(
        (repr, payload) in packet(),
        cut in any::<prop::sample::Index>(),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
    ) {
        let hdrs = headers_v4();
        let mut f = Vec::new();
        hdrs.write_frame(&build(&repr, &payload, &hdrs), &mut f).unwrap();
        for (at, x) in flips {
            let i = at.index(f.len());
            f[i] ^= x;
        }
        let cut = cut.index(f.len() + 1);
        let _ = decode_frame(&f[..cut]);
        let _ = decode_frame(&f);
    }
}
