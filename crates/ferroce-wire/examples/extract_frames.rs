//! Writes one file per distinct kind of RoCE v2 frame (opcode, AETH syndrome, payload length)
//! found in pcap files: the fuzzers' seed corpus.
//!
//! `cargo run -p ferroce-wire --example extract_frames -- OUT_DIR FILE.pcap...`

use std::collections::BTreeSet;

use ferroce_wire::frame;
use ferroce_wire::pcap::PcapReader;
use ferroce_wire::{RocePacket, ROCE_V2_UDP_PORT};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = args
        .next()
        .ok_or("usage: extract_frames OUT_DIR FILE.pcap...")?;
    std::fs::create_dir_all(&out)?;
    let mut seen = BTreeSet::new();
    for file in args {
        let data = std::fs::read(&file)?;
        for rec in PcapReader::new(&data)? {
            let rec = rec?;
            let Ok(udp) = frame::parse_ethernet(rec.data) else {
                continue;
            };
            if udp.dst_port != ROCE_V2_UDP_PORT {
                continue;
            }
            let Ok(p) = RocePacket::new_checked(udp.payload) else {
                continue;
            };
            let syndrome = p.aeth().map(|a| a.syndrome_byte());
            let key = (p.opcode().0, syndrome, p.payload_len());
            if seen.insert(key) {
                let name = format!("{out}/{:02x}-{:?}-{}", key.0, key.1, key.2);
                std::fs::write(name, rec.data)?;
            }
        }
    }
    println!("{} seeds in {out}", seen.len());
    Ok(())
}
