//! `ferroce decode` as a user runs it: against Wireshark's InfiniBand dissector on the golden
//! captures, on corrupted and malformed captures, and on bad arguments.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ferroce_wire::frame;
use ferroce_wire::pcap::{PcapReader, PcapWriter};
use serde_json::Value;

const CAPTURES: &[&str] = &[
    "atomic_lat_fetch_add.pcap",
    "imm_send_write.pcap",
    "rc_pingpong_4096.pcap",
    "read_lat_8192_mtu1024.pcap",
    "rnr_nak_send_imm.pcap",
    "rping_rdmacm.pcap",
    "send_lat_8192_mtu1024.pcap",
    "ud_pingpong_512.pcap",
    "write_bw_8192_loss5_nak.pcap",
    "write_lat_8192_mtu1024.pcap",
];

fn captures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/captures")
}

fn ferroce(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferroce"))
        .args(args)
        .output()
        .expect("run ferroce")
}

fn json_lines(out: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad JSON line {l:?}: {e}")))
        .collect()
}

/// (opcode, dest QPN, PSN, ICRC) per frame number, as tshark decodes the RoCE v2 packets.
fn tshark_fields(path: &Path) -> BTreeMap<u64, (u64, u64, u64, u64)> {
    let out = Command::new("tshark")
        .args(["-n", "-r"])
        .arg(path)
        .args([
            "-Y",
            "udp.dstport == 4791",
            "-T",
            "fields",
            "-E",
            "separator=,",
        ])
        .args([
            "-e",
            "frame.number",
            "-e",
            "infiniband.bth.opcode",
            "-e",
            "infiniband.bth.destqp",
        ])
        .args(["-e", "infiniband.bth.psn", "-e", "infiniband.invariant.crc"])
        .output()
        .expect("tshark must be installed (scripts/test.sh installs it)");
    assert!(
        out.status.success(),
        "tshark failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let num = |s: &str| -> u64 {
        let s = s.trim();
        match s.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).unwrap(),
            None => s.parse().unwrap_or_else(|_| panic!("tshark field {s:?}")),
        }
    };
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            assert_eq!(f.len(), 5, "tshark line {l:?}");
            (num(f[0]), (num(f[1]), num(f[2]), num(f[3]), num(f[4])))
        })
        .collect()
}

#[test]
fn agrees_with_tshark_on_every_capture() {
    for name in CAPTURES {
        let path = captures_dir().join(name);
        let out = ferroce(&["decode", "--json", path.to_str().unwrap()]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let ours: BTreeMap<u64, (u64, u64, u64, u64)> = json_lines(&out)
            .into_iter()
            .filter(|v| v.get("skipped").is_none())
            .map(|v| {
                assert_eq!(v["icrc_ok"], Value::Bool(true), "{name}: {v}");
                let n = |k: &str| {
                    v[k].as_u64()
                        .unwrap_or_else(|| panic!("{name}: no {k} in {v}"))
                };
                (
                    n("index"),
                    (n("opcode"), n("dest_qpn"), n("psn"), n("icrc")),
                )
            })
            .collect();
        let theirs = tshark_fields(&path);
        assert!(!theirs.is_empty(), "{name}: tshark saw no RoCE packets");
        assert_eq!(ours, theirs, "{name}: ferroce and tshark disagree");
    }
}

#[test]
fn text_output_lists_every_roce_packet_and_exits_zero() {
    let path = captures_dir().join("read_lat_8192_mtu1024.pcap");
    let out = ferroce(&["decode", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0));
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.iter().filter(|l| l.contains("icrc=ok")).count(), 180);
    let first_read = lines
        .iter()
        .find(|l| l.contains("RC_RDMA_READ_REQUEST"))
        .unwrap();
    assert!(
        first_read.contains("qpn=0x000019 psn=7016496 ack_req=1"),
        "{first_read}"
    );
    assert!(
        first_read.contains("va=0x0000559a06fd8000 rkey=0x00000a88 dma_len=8192"),
        "{first_read}"
    );
    assert!(lines
        .last()
        .unwrap()
        .starts_with("180 RoCE v2 packets, 29 skipped, 0 malformed, 0 bad ICRC"));
}

/// A CNP as ferroce's transport makes it (a QP answering a request that arrived marked
/// Congestion Experienced), framed as the UDP provider sends it (ECT(0), ICRC sealed), beside
/// the marked request and the ACK: tshark and `ferroce decode` agree on every field, find
/// nothing malformed, and tshark reads each frame's ECN field.
#[test]
fn a_cnp_decodes_in_tshark_and_ferroce() {
    use ferroce_proto::sim::pair::{connected_qp, default_rtr, default_rts};
    use ferroce_proto::{Access, Instant, QpCaps, SendOp, SendWr, Sge, VecMemory};
    use ferroce_wire::icrc;
    use ferroce_wire::{Psn, RocePacket};

    let mk = |qpn: u32, peer: u32| {
        let qp = connected_qp(
            qpn,
            QpCaps::default(),
            &default_rtr(peer, Psn::new(0)),
            &default_rts(),
        );
        let mut mem = VecMemory::new();
        mem.register(1, 0x1000, 4096, Access::ALL.with(Access::LOCAL_WRITE));
        (qp, mem)
    };
    let ((mut a, mut amem), (mut b, mut bmem)) = (mk(0x11, 0x12), mk(0x12, 0x11));
    let sge = Sge {
        addr: 0x1000,
        length: 64,
        lkey: amem.region(0).lkey,
    };
    let rkey = bmem.region(0).rkey;
    a.post_send(SendWr::new(1, SendOp::Write, vec![sge]).remote(0x1000, rkey))
        .unwrap();
    let now = Instant::from_nanos(0);
    let mut buf = vec![0u8; 4096];
    let n = a.poll_transmit(now, &mut amem, &mut buf).unwrap();
    let request = buf[..n].to_vec();
    b.handle_packet_ecn(now, &mut bmem, &request, true).unwrap();
    let mut answers = Vec::new();
    while let Some(n) = b.poll_transmit(now, &mut bmem, &mut buf) {
        answers.push(buf[..n].to_vec());
    }
    assert_eq!(answers.len(), 2, "a CNP and an ACK");
    let (ip_a, ip_b) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
    let mut w = PcapWriter::new(Vec::new()).unwrap();
    // (from, to, TOS, packet): the request left ECT(0) and a switch marked it CE.
    let frames = [
        (ip_a, ip_b, 0x03, request),
        (ip_b, ip_a, 0x02, answers[0].clone()),
        (ip_b, ip_a, 0x02, answers[1].clone()),
    ];
    for (i, (src, dst, tos, mut pkt)) in frames.into_iter().enumerate() {
        let mut h = frame::UdpFrameHeaders::roce(src, 49152, dst);
        h.tos = tos;
        let hdrs = h.icrc_headers(pkt.len()).unwrap();
        let n = pkt.len();
        let crc = icrc::compute(hdrs.ip(), hdrs.udp(), &pkt[..n - 4]).unwrap();
        RocePacket::new_unchecked(&mut pkt[..]).set_icrc(crc);
        let mut f = Vec::new();
        h.write_frame(&pkt, &mut f).unwrap();
        w.write_record(i as u64 * 1000, &f).unwrap();
    }
    let dir = std::env::temp_dir().join(format!("ferroce-decode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("cnp.pcap");
    std::fs::write(&path, w.finish().unwrap()).unwrap();

    let out = ferroce(&["decode", "--json", path.to_str().unwrap()]);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ours = json_lines(&out);
    assert_eq!(ours.len(), 3);
    assert!(
        ours.iter().all(|v| v["icrc_ok"] == Value::Bool(true)),
        "{ours:?}"
    );
    let cnp = &ours[1];
    assert_eq!(cnp["opcode"], 0x81, "{cnp}");
    assert_eq!(cnp["opcode_name"], "CNP", "{cnp}");
    assert_eq!(cnp["dest_qpn"], 0x11, "{cnp}");
    assert_eq!(cnp["psn"], 0, "{cnp}");
    assert_eq!(cnp["becn"], true, "{cnp}");
    assert_eq!(ours[2]["becn"], false);
    // tshark 4.0 knows no CNP: it decodes the BTH (its byte 4, FECN and BECN, as
    // `infiniband.reserved`) and shows the reserved block and the ICRC as vendor data.
    let t = Command::new("tshark")
        .args(["-n", "-r"])
        .arg(&path)
        .args(["-T", "fields", "-E", "separator=,"])
        .args(["-e", "ip.dsfield.ecn", "-e", "infiniband.bth.opcode"])
        .args(["-e", "infiniband.bth.destqp", "-e", "infiniband.bth.psn"])
        .args([
            "-e",
            "infiniband.reserved",
            "-e",
            "infiniband.invariant.crc",
        ])
        .args(["-e", "infiniband.vendor", "-e", "_ws.malformed"])
        .output()
        .expect("tshark must be installed (scripts/test.sh installs it)");
    assert!(t.status.success(), "{}", String::from_utf8_lossy(&t.stderr));
    let text = String::from_utf8_lossy(&t.stdout);
    let lines: Vec<&str> = text.lines().collect();
    let icrc = |v: &Value| format!("0x{:08x}", v["icrc"].as_u64().unwrap());
    let cnp_icrc = format!("{:08x}", ours[1]["icrc"].as_u64().unwrap());
    assert_eq!(
        lines,
        [
            format!("3,10,0x000012,0,00,{},,", icrc(&ours[0])),
            // The vendor data twice: its first word as the item's own value, then all of it.
            format!("2,129,0x000011,0,40,,00000000,00000000000000000000000000000000{cnp_icrc},"),
            format!("2,17,0x000011,0,00,{},,", icrc(&ours[2])),
        ],
        "ECN, opcode, dest QP, PSN, FECN/BECN byte, ICRC, vendor data, malformed"
    );
}

/// Writes a copy of a capture with `mutate` applied to the UDP payload of RoCE frame `nth`.
fn mutated_copy(name: &str, nth: usize, mutate: impl Fn(&mut Vec<u8>, usize, usize)) -> PathBuf {
    let data = std::fs::read(captures_dir().join(name)).unwrap();
    let mut w = PcapWriter::new(Vec::new()).unwrap();
    let mut seen = 0;
    for rec in PcapReader::new(&data).unwrap() {
        let rec = rec.unwrap();
        let mut bytes = rec.data.to_vec();
        if let Ok(udp) = frame::parse_ethernet(rec.data) {
            if udp.dst_port == 4791 {
                seen += 1;
                if seen == nth {
                    let off = udp.payload.as_ptr() as usize - rec.data.as_ptr() as usize;
                    mutate(&mut bytes, off, udp.payload.len());
                }
            }
        }
        w.write_record(rec.timestamp_ns, &bytes).unwrap();
    }
    let dir = std::env::temp_dir().join(format!("ferroce-decode-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{nth}-{name}"));
    std::fs::write(&path, w.finish().unwrap()).unwrap();
    path
}

#[test]
fn flipped_bit_is_reported_bad_and_exits_one() {
    let path = mutated_copy("imm_send_write.pcap", 3, |b, off, len| {
        b[off + len / 2] ^= 0x10
    });
    let out = ferroce(&["decode", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    let bad: Vec<&str> = text.lines().filter(|l| l.ends_with("icrc=BAD")).collect();
    assert_eq!(bad.len(), 1, "{text}");
    assert!(bad[0].contains("RC_SEND_FIRST"), "{}", bad[0]);
    let v = json_lines(&ferroce(&["decode", "--json", path.to_str().unwrap()]));
    assert_eq!(
        v.iter()
            .filter(|v| v["icrc_ok"] == Value::Bool(false))
            .count(),
        1
    );
}

#[test]
fn malformed_packet_gets_its_reason_and_exits_one() {
    // Give the first packet (SEND_ONLY_WITH_IMMEDIATE) a reserved opcode.
    let path = mutated_copy("imm_send_write.pcap", 1, |b, off, _| b[off] = 0x15);
    let out = ferroce(&["decode", path.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("MALFORMED: unsupported opcode 0x15"),
        "{text}"
    );
    let v = json_lines(&ferroce(&["decode", "--json", path.to_str().unwrap()]));
    let m: Vec<_> = v.iter().filter(|v| v.get("malformed").is_some()).collect();
    assert_eq!(m.len(), 1);
    assert_eq!(m[0]["error"], "unsupported opcode 0x15");
}

#[test]
fn bad_arguments_give_one_line_and_nonzero_exit() {
    let out = ferroce(&["decode", "/nonexistent/x.pcap"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.starts_with("ferroce: /nonexistent/x.pcap"), "{err}");

    let not_pcap = std::env::temp_dir().join(format!("ferroce-notpcap-{}", std::process::id()));
    std::fs::write(&not_pcap, b"this is not a capture file at all").unwrap();
    let out = ferroce(&["decode", not_pcap.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bad magic"));

    let out = ferroce(&["decode"]);
    assert_eq!(out.status.code(), Some(2));
    let out = ferroce(&["frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
}
