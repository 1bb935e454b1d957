//! Golden vectors: every RoCE v2 packet Linux Soft-RoCE put on the wire in `shared/captures/`
//! must parse, pass its ICRC check, and re-emit byte for byte from its parsed form; a flipped bit
//! anywhere in the packet must be caught. A receiver that sees no IPv4 Identification (it
//! assumes 0) must recover the one rxe sent from the ICRC, and still catch the flipped bits.

use std::path::PathBuf;

use ferroce_wire::frame::{self, UdpFrame, UdpFrameHeaders};
use ferroce_wire::icrc::{self, IcrcCheck};
use ferroce_wire::pcap::{PcapReader, LINKTYPE_ETHERNET};
use ferroce_wire::{PacketRepr, RocePacket, ROCE_V2_UDP_PORT};

fn captures_dir() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    // crates/ferroce-wire -> the repository -> its sibling `shared/`.
    manifest.join("../../../shared/captures")
}

/// Every RoCE v2 datagram of one capture, as (frame index, frame bytes).
fn roce_frames(name: &str) -> Vec<(usize, Vec<u8>)> {
    let path = captures_dir().join(name);
    let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let reader = PcapReader::new(&data).unwrap();
    assert_eq!(reader.linktype(), LINKTYPE_ETHERNET);
    let mut out = Vec::new();
    for (i, rec) in reader.enumerate() {
        let rec = rec.unwrap();
        if let Ok(udp) = frame::parse_ethernet(rec.data) {
            if udp.dst_port == ROCE_V2_UDP_PORT {
                out.push((i + 1, rec.data.to_vec()));
            }
        }
    }
    out
}

fn verify_icrc(udp: &UdpFrame<'_>) -> bool {
    let p = RocePacket::new_checked(udp.payload).unwrap();
    icrc::verify(udp.ip_header, udp.udp_header, p.covered(), p.icrc()).unwrap()
}

/// The frame's IPv4 header with the Identification zeroed: what a UDP-socket receiver assumes.
fn ip_header_seen(udp: &UdpFrame<'_>) -> Vec<u8> {
    let mut ip = udp.ip_header.to_vec();
    ip[4..6].fill(0);
    ip
}

/// The ICRC check with any IPv4 Identification, from the header a UDP-socket receiver assumes.
fn check_any_identification(udp: &UdpFrame<'_>) -> IcrcCheck {
    let p = RocePacket::new_checked(udp.payload).unwrap();
    let ip = ip_header_seen(udp);
    icrc::verify_any_ipv4_identification(&ip, udp.udp_header, p.covered(), p.icrc()).unwrap()
}

/// Parses, verifies and re-emits every RoCE packet of a capture; returns how many there were.
fn check_capture(name: &str, expected_packets: usize) {
    let frames = roce_frames(name);
    assert_eq!(frames.len(), expected_packets, "{name}: RoCE packet count");
    for (index, bytes) in &frames {
        let udp = frame::parse_ethernet(bytes).unwrap();
        let pkt = RocePacket::new_checked(udp.payload)
            .unwrap_or_else(|e| panic!("{name} frame {index}: {e}"));
        assert!(
            verify_icrc(&udp),
            "{name} frame {index}: ICRC does not verify"
        );
        let repr = PacketRepr::parse(&pkt).unwrap();

        // Re-emit from the parsed form into a fresh buffer: headers and pad from the repr, the
        // payload copied, the ICRC computed anew from headers rebuilt from the parsed fields.
        let mut out = vec![0x5a; repr.buffer_len().unwrap()];
        let n = repr.emit(&mut out).unwrap();
        assert_eq!(n, udp.payload.len(), "{name} frame {index}: length");
        let mut re = RocePacket::new_unchecked(&mut out[..]);
        re.payload_mut().copy_from_slice(pkt.payload());
        let ip = udp.ip_header;
        let headers = UdpFrameHeaders {
            src_mac: bytes[6..12].try_into().unwrap(),
            dst_mac: bytes[0..6].try_into().unwrap(),
            src: udp.src,
            dst: udp.dst,
            src_port: udp.src_port,
            dst_port: udp.dst_port,
            ident: u16::from_be_bytes([ip[4], ip[5]]),
            dont_fragment: ip[6] & 0x40 != 0,
            ttl: ip[8],
            tos: ip[1],
        };
        let hdrs = headers.ip_udp_headers(n).unwrap();
        let crc = icrc::compute(hdrs.ip(), hdrs.udp(), re.covered()).unwrap();
        re.set_icrc(crc);
        assert_eq!(
            &out[..],
            udp.payload,
            "{name} frame {index}: re-emitted bytes differ"
        );

        // The whole frame, rebuilt, is identical too (rxe leaves the UDP checksum 0).
        let mut whole = Vec::new();
        headers.write_frame(&out, &mut whole).unwrap();
        assert_eq!(
            &whole[..],
            &bytes[..whole.len()],
            "{name} frame {index}: frame differs"
        );
    }
}

/// Flips one bit in the payload (or the last header byte when there is none) and one in the BTH
/// of every packet: the ICRC must catch each.
fn check_corruption_caught(name: &str) {
    for (index, bytes) in roce_frames(name) {
        let udp_off = {
            let udp = frame::parse_ethernet(&bytes).unwrap();
            udp.payload.as_ptr() as usize - bytes.as_ptr() as usize
        };
        let (hdr_len, len) = {
            let udp = frame::parse_ethernet(&bytes).unwrap();
            let p = RocePacket::new_checked(udp.payload).unwrap();
            (p.header_len(), udp.payload.len())
        };
        // A payload bit, or the last extension-header bit for packets without payload.
        let body_bit = if len > hdr_len + 4 {
            udp_off + hdr_len + (len - hdr_len - 4) / 2
        } else {
            udp_off + hdr_len - 1
        };
        // A BTH bit that changes neither the opcode nor the pad (so the packet still parses):
        // the low bit of the PSN.
        let bth_bit = udp_off + 11;
        for at in [body_bit, bth_bit] {
            let mut bad = bytes.clone();
            bad[at] ^= 0x01;
            let udp = frame::parse_ethernet(&bad).unwrap();
            assert!(
                !verify_icrc(&udp),
                "{name} frame {index}: flipped bit at {at} not caught"
            );
            assert_eq!(
                check_any_identification(&udp),
                IcrcCheck::Bad,
                "{name} frame {index}: flipped bit at {at} explained by an Identification"
            );
        }
    }
}

/// Zeroes the IPv4 Identification of every RoCE packet of a capture and solves it back from the
/// ICRC; returns how many packets there were and how many of them rxe sent with an
/// Identification other than 0.
fn check_identification_solved(name: &str) -> (usize, usize) {
    let frames = roce_frames(name);
    let mut nonzero = 0;
    for (index, bytes) in &frames {
        let udp = frame::parse_ethernet(bytes).unwrap();
        let sent = u16::from_be_bytes([udp.ip_header[4], udp.ip_header[5]]);
        let p = RocePacket::new_checked(udp.payload).unwrap();
        let ip = ip_header_seen(&udp);
        assert_eq!(
            icrc::solve_ipv4_identification(&ip, udp.udp_header, p.covered(), p.icrc()).unwrap(),
            Some(sent),
            "{name} frame {index}"
        );
        let expected = if sent == 0 {
            IcrcCheck::Verified
        } else {
            nonzero += 1;
            IcrcCheck::VerifiedWithIdentification(sent)
        };
        assert_eq!(
            check_any_identification(&udp),
            expected,
            "{name} frame {index}"
        );
    }
    (frames.len(), nonzero)
}

macro_rules! capture_tests {
    ($($test:ident: $file:expr, $count:expr;)*) => {
        $(
            #[test]
            fn $test() {
                check_capture($file, $count);
                check_corruption_caught($file);
            }
        )*

        /// Every capture with its RoCE packet count.
        const CAPTURES: &[(&str, usize)] = &[$(($file, $count)),*];
    };
}

/// rxe numbers the IPv4 Identification of every packet it sends; each must come back from the
/// ICRC alone.
#[test]
fn every_rxe_identification_solves_from_zero() {
    let (mut packets, mut nonzero) = (0, 0);
    for &(name, count) in CAPTURES {
        let (n, nz) = check_identification_solved(name);
        assert_eq!(n, count, "{name}: RoCE packet count");
        packets += n;
        nonzero += nz;
    }
    assert_eq!(packets, 2637);
    // None of them had Identification 0, so not one verifies without the solver.
    assert_eq!(nonzero, 2637);
}

// Packet counts are those the capture summaries (`*.txt`) list.
capture_tests! {
    atomic_lat_fetch_add: "atomic_lat_fetch_add.pcap", 200;
    imm_send_write: "imm_send_write.pcap", 14;
    rc_pingpong_4096: "rc_pingpong_4096.pcap", 50;
    read_lat_8192_mtu1024: "read_lat_8192_mtu1024.pcap", 180;
    rnr_nak_send_imm: "rnr_nak_send_imm.pcap", 16;
    rping_rdmacm: "rping_rdmacm.pcap", 65;
    send_lat_8192_mtu1024: "send_lat_8192_mtu1024.pcap", 360;
    ud_pingpong_512: "ud_pingpong_512.pcap", 10;
    write_bw_8192_loss5_nak: "write_bw_8192_loss5_nak.pcap", 1376;
    write_lat_8192_mtu1024: "write_lat_8192_mtu1024.pcap", 366;
}
