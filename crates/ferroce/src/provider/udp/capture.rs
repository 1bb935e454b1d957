//! `FERROCE_PCAP=FILE`: every packet the context sends or receives, written as an Ethernet/IP/UDP
//! frame to a pcap file that Wireshark and `ferroce decode` read.
//!
//! The frames carry the real addresses and ports; the IPv4 header is the one Linux puts on a
//! datagram from an unconnected socket with DF set (Identification 0, or its place in a GSO
//! send), which is also what the ICRC was computed over, so every ICRC in the file verifies.
//! The TOS byte is the one packets leave with (ECT(0) unless `ContextOptions::ecn` says
//! otherwise) and, for a received packet, the one it arrived with where the read took it (see
//! the provider's "ECN marks"; 0 where it did not).

use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use std::sync::Mutex;

use ferroce_wire::frame::UdpFrameHeaders;
use ferroce_wire::pcap::PcapWriter;

use crate::error::{Error, Result};

#[derive(Debug)]
pub(crate) struct Capture {
    out: Mutex<(PcapWriter<BufWriter<File>>, Vec<u8>)>,
}

impl Capture {
    pub(crate) fn create(path: &Path) -> Result<Capture> {
        let f = File::create(path)
            .map_err(|e| Error::io(format!("creating capture {}", path.display()), e))?;
        let w = PcapWriter::new(BufWriter::with_capacity(1 << 20, f))
            .map_err(|e| Error::io(format!("writing capture {}", path.display()), e))?;
        Ok(Capture {
            out: Mutex::new((w, Vec::with_capacity(9000))),
        })
    }

    /// Records one datagram with the headers `h` describes (addresses, ports, the IPv4
    /// Identification it left with).
    pub(crate) fn record(&self, h: &UdpFrameHeaders, payload: &[u8]) {
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let mut g = self.out.lock().unwrap_or_else(|e| e.into_inner());
        let (w, frame) = &mut *g;
        frame.clear();
        if h.write_frame(payload, frame).is_ok() {
            // A capture that cannot be written must not stop the traffic it records.
            let _ = w.write_record(ts, frame);
        }
    }

    pub(crate) fn flush(&self) {
        let mut g = self.out.lock().unwrap_or_else(|e| e.into_inner());
        let _ = g.0.flush();
    }
}
