//! Classic pcap files (the libpcap format tcpdump writes), read from and written to byte
//! streams. pcapng is not read; tools convert with `editcap -F pcap`.

use std::io::{self, Write};

use crate::{Result, WireError};

/// Link type of Ethernet frames.
pub const LINKTYPE_ETHERNET: u32 = 1;
const MAGIC_MICROS: u32 = 0xa1b2_c3d4;
const MAGIC_NANOS: u32 = 0xa1b2_3c4d;
const FILE_HEADER_LEN: usize = 24;
const RECORD_HEADER_LEN: usize = 16;

/// One captured packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PcapRecord<'a> {
    /// Capture time, nanoseconds since the Unix epoch.
    pub timestamp_ns: u64,
    /// Length of the packet on the wire (may exceed `data.len()` if the capture was cut).
    pub orig_len: u32,
    /// The captured bytes.
    pub data: &'a [u8],
}

/// Reads the records of a pcap file held in memory.
#[derive(Debug, Clone)]
pub struct PcapReader<'a> {
    data: &'a [u8],
    pos: usize,
    big_endian: bool,
    nanos: bool,
    linktype: u32,
}

impl<'a> PcapReader<'a> {
    /// Reads the file header.
    pub fn new(data: &'a [u8]) -> Result<PcapReader<'a>> {
        if data.len() < FILE_HEADER_LEN {
            return Err(WireError::Pcap("shorter than a pcap file header"));
        }
        let le = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
        let be = u32::from_be_bytes([data[0], data[1], data[2], data[3]]);
        let (big_endian, nanos) = match (le, be) {
            (MAGIC_MICROS, _) => (false, false),
            (MAGIC_NANOS, _) => (false, true),
            (_, MAGIC_MICROS) => (true, false),
            (_, MAGIC_NANOS) => (true, true),
            _ => return Err(WireError::Pcap("not a classic pcap file (bad magic)")),
        };
        let mut r = PcapReader {
            data,
            pos: FILE_HEADER_LEN,
            big_endian,
            nanos,
            linktype: 0,
        };
        r.linktype = r.u32_at(20);
        Ok(r)
    }

    /// The link type of every record (1 = Ethernet).
    pub fn linktype(&self) -> u32 {
        self.linktype
    }

    fn u32_at(&self, at: usize) -> u32 {
        let b = [
            self.data[at],
            self.data[at + 1],
            self.data[at + 2],
            self.data[at + 3],
        ];
        if self.big_endian {
            u32::from_be_bytes(b)
        } else {
            u32::from_le_bytes(b)
        }
    }
}

impl<'a> Iterator for PcapReader<'a> {
    type Item = Result<PcapRecord<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.pos >= self.data.len() {
            return None;
        }
        if self.data.len() - self.pos < RECORD_HEADER_LEN {
            self.pos = self.data.len();
            return Some(Err(WireError::Pcap("truncated record header")));
        }
        let secs = u64::from(self.u32_at(self.pos));
        let frac = u64::from(self.u32_at(self.pos + 4));
        let incl = self.u32_at(self.pos + 8) as usize;
        let orig_len = self.u32_at(self.pos + 12);
        let start = self.pos + RECORD_HEADER_LEN;
        if self.data.len() - start < incl {
            self.pos = self.data.len();
            return Some(Err(WireError::Pcap("truncated record")));
        }
        self.pos = start + incl;
        let timestamp_ns = secs * 1_000_000_000 + if self.nanos { frac } else { frac * 1_000 };
        Some(Ok(PcapRecord {
            timestamp_ns,
            orig_len,
            data: &self.data[start..start + incl],
        }))
    }
}

/// Writes a pcap file (nanosecond timestamps, Ethernet link type) to any byte sink.
#[derive(Debug)]
pub struct PcapWriter<W: Write> {
    out: W,
}

impl<W: Write> PcapWriter<W> {
    /// Writes the file header.
    pub fn new(mut out: W) -> io::Result<PcapWriter<W>> {
        let mut h = [0u8; FILE_HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC_NANOS.to_le_bytes());
        h[4..6].copy_from_slice(&2u16.to_le_bytes());
        h[6..8].copy_from_slice(&4u16.to_le_bytes());
        h[16..20].copy_from_slice(&65_535u32.to_le_bytes());
        h[20..24].copy_from_slice(&LINKTYPE_ETHERNET.to_le_bytes());
        out.write_all(&h)?;
        Ok(PcapWriter { out })
    }

    /// Appends one frame.
    pub fn write_record(&mut self, timestamp_ns: u64, frame: &[u8]) -> io::Result<()> {
        let len = u32::try_from(frame.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame over 4 GiB"))?;
        let mut h = [0u8; RECORD_HEADER_LEN];
        h[0..4].copy_from_slice(&((timestamp_ns / 1_000_000_000) as u32).to_le_bytes());
        h[4..8].copy_from_slice(&((timestamp_ns % 1_000_000_000) as u32).to_le_bytes());
        h[8..12].copy_from_slice(&len.to_le_bytes());
        h[12..16].copy_from_slice(&len.to_le_bytes());
        self.out.write_all(&h)?;
        self.out.write_all(frame)
    }

    /// Flushes the sink.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// Flushes and returns the sink.
    pub fn finish(mut self) -> io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_then_read() {
        let mut w = PcapWriter::new(Vec::new()).unwrap();
        w.write_record(1_500_000_000_123_456_789, &[1, 2, 3])
            .unwrap();
        w.write_record(1_500_000_001_000_000_000, &[]).unwrap();
        let bytes = w.finish().unwrap();
        let r = PcapReader::new(&bytes).unwrap();
        assert_eq!(r.linktype(), LINKTYPE_ETHERNET);
        let recs: Vec<_> = r.collect::<Result<_>>().unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[0].timestamp_ns, 1_500_000_000_123_456_789);
        assert_eq!(recs[0].data, &[1, 2, 3]);
        assert!(recs[1].data.is_empty());
    }

    #[test]
    fn truncated_files_are_errors() {
        assert!(PcapReader::new(&[0xd4, 0xc3]).is_err());
        let mut w = PcapWriter::new(Vec::new()).unwrap();
        w.write_record(0, &[7; 10]).unwrap();
        let bytes = w.finish().unwrap();
        let cut = &bytes[..bytes.len() - 1];
        let mut r = PcapReader::new(cut).unwrap();
        assert!(matches!(r.next(), Some(Err(WireError::Pcap(_)))));
        assert!(r.next().is_none());
    }
}
