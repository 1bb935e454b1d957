//! `ferroce decode FILE.pcap [--json]`.

use std::io::{self, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use ferroce_wire::decode::{decode_frame_ports, Decoded, RoceSummary};
use ferroce_wire::icrc;
use ferroce_wire::pcap::{PcapReader, LINKTYPE_ETHERNET};
use serde_json::{json, Map, Value};

/// Arguments of `ferroce decode`.
#[derive(Debug, Args)]
pub struct DecodeArgs {
    /// A classic pcap file of Ethernet frames (tcpdump -w).
    file: PathBuf,
    /// Print one JSON object per packet instead of text lines.
    #[arg(long)]
    json: bool,
    /// UDP ports that carry RoCE v2, at either end (default 4791; repeat for more).
    #[arg(long = "udp-port", default_values_t = [ferroce_wire::ROCE_V2_UDP_PORT])]
    udp_ports: Vec<u16>,
}

#[derive(Default)]
struct Tally {
    roce: usize,
    skipped: usize,
    malformed: usize,
    bad_icrc: usize,
}

/// Runs the command: exit 0 if every RoCE packet is well formed with a good ICRC, else 1.
pub fn run(args: &DecodeArgs) -> Result<ExitCode, String> {
    let data = std::fs::read(&args.file).map_err(|e| format!("{}: {e}", args.file.display()))?;
    let reader = PcapReader::new(&data).map_err(|e| format!("{}: {e}", args.file.display()))?;
    if reader.linktype() != LINKTYPE_ETHERNET {
        return Err(format!(
            "{}: link type {} is not Ethernet (1)",
            args.file.display(),
            reader.linktype()
        ));
    }
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let mut tally = Tally::default();
    for (i, rec) in reader.enumerate() {
        let index = i + 1;
        let rec = rec.map_err(|e| format!("{}: record {index}: {e}", args.file.display()))?;
        let decoded = decode_frame_ports(rec.data, &args.udp_ports);
        match &decoded {
            Decoded::Skipped => tally.skipped += 1,
            Decoded::Roce(s) => {
                tally.roce += 1;
                if !s.icrc_ok {
                    tally.bad_icrc += 1;
                }
            }
            Decoded::Malformed { .. } => {
                tally.roce += 1;
                tally.malformed += 1;
            }
        }
        let written = if args.json {
            writeln!(out, "{}", to_json(index, &decoded))
        } else {
            match &decoded {
                Decoded::Skipped => Ok(()),
                Decoded::Roce(s) => writeln!(out, "{index:6} {s}"),
                Decoded::Malformed { src, dst, reason } => {
                    writeln!(out, "{index:6} {src} -> {dst} MALFORMED: {reason}")
                }
            }
        };
        if let Err(e) = written {
            // A closed pipe (`| head`) is not an error of ours.
            return if e.kind() == io::ErrorKind::BrokenPipe {
                Ok(ExitCode::SUCCESS)
            } else {
                Err(e.to_string())
            };
        }
    }
    if !args.json {
        let _ = writeln!(
            out,
            "{} RoCE v2 packets, {} skipped, {} malformed, {} bad ICRC",
            tally.roce, tally.skipped, tally.malformed, tally.bad_icrc
        );
    }
    let _ = out.flush();
    Ok(if tally.malformed + tally.bad_icrc > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    })
}

fn to_json(index: usize, d: &Decoded) -> Value {
    match d {
        Decoded::Skipped => json!({ "index": index, "skipped": true }),
        Decoded::Malformed { src, dst, reason } => json!({
            "index": index, "src": src.to_string(), "dst": dst.to_string(),
            "malformed": true, "error": reason.to_string(),
        }),
        Decoded::Roce(s) => roce_json(index, s),
    }
}

fn roce_json(index: usize, s: &RoceSummary) -> Value {
    let r = &s.repr;
    let mut m = Map::new();
    m.insert("index".into(), json!(index));
    m.insert("src".into(), json!(s.src.to_string()));
    m.insert("dst".into(), json!(s.dst.to_string()));
    m.insert("src_port".into(), json!(s.src_port));
    m.insert("opcode".into(), json!(r.bth.opcode.0));
    m.insert("opcode_name".into(), json!(r.bth.opcode.name()));
    m.insert("dest_qpn".into(), json!(r.bth.dest_qpn));
    m.insert("psn".into(), json!(r.bth.psn.value()));
    m.insert("ack_req".into(), json!(r.bth.ack_req));
    m.insert("solicited".into(), json!(r.bth.solicited));
    m.insert("pad_count".into(), json!(r.bth.pad_count));
    m.insert("pkey".into(), json!(r.bth.pkey));
    // Congestion notification: a CNP carries BECN.
    m.insert("fecn".into(), json!(r.bth.fecn));
    m.insert("becn".into(), json!(r.bth.becn));
    let e = &r.ext;
    if let Some(h) = e.deth {
        m.insert(
            "deth".into(),
            json!({ "qkey": h.qkey, "src_qpn": h.src_qpn }),
        );
    }
    if let Some(h) = e.reth {
        m.insert(
            "reth".into(),
            json!({ "va": h.va, "rkey": h.rkey, "dma_len": h.dma_len }),
        );
    }
    if let Some(h) = e.atomic_eth {
        m.insert(
            "atomic_eth".into(),
            json!({ "va": h.va, "rkey": h.rkey, "swap_add": h.swap_add, "compare": h.compare }),
        );
    }
    if let Some(h) = e.aeth {
        m.insert(
            "aeth".into(),
            json!({ "syndrome": h.syndrome.to_byte(), "kind": h.syndrome.to_string(), "msn": h.msn }),
        );
    }
    if let Some(h) = e.atomic_ack_eth {
        m.insert("atomic_ack_eth".into(), json!({ "original": h.original }));
    }
    if let Some(h) = e.immdt {
        m.insert("immdt".into(), json!(h.value));
    }
    if let Some(h) = e.ieth {
        m.insert("ieth".into(), json!({ "rkey": h.rkey }));
    }
    m.insert("payload_len".into(), json!(r.payload_len));
    m.insert("icrc".into(), json!(icrc::wireshark_display(s.icrc)));
    m.insert("icrc_ok".into(), json!(s.icrc_ok));
    Value::Object(m)
}
