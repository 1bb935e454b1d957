//! Fuzzes every parser a received frame meets: Ethernet/IP/UDP, the transport packet view and
//! repr, the ICRC, and the decoder. Input is a whole Ethernet frame (the seed corpus holds every
//! RoCE v2 frame of the golden captures); a second pass treats the same bytes as a bare UDP
//! payload, as the UDP provider sees it; a third as a CM MAD (a UD payload to QP1), which
//! re-emits to bytes that parse to the same message.
#![no_main]

use ferroce_wire::cm::CmMad;
use ferroce_wire::decode::decode_frame;
use ferroce_wire::frame::UdpFrameHeaders;
use ferroce_wire::{frame, icrc, PacketRepr, RocePacket};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = decode_frame(data);
    if let Ok(mad) = CmMad::parse(data) {
        let bytes = mad.to_bytes().expect("a parsed CM MAD emits");
        assert_eq!(CmMad::parse(&bytes).expect("an emitted CM MAD parses"), mad);
    }
    if let Ok(udp) = frame::parse_ethernet(data) {
        let _ = RocePacket::new_checked(udp.payload);
    }
    if let Ok(view) = RocePacket::new_checked(data) {
        let repr = PacketRepr::parse(&view).expect("a checked packet parses");
        // What parses re-emits to the same bytes, but for reserved bits, which emit clears.
        let mut out = vec![0u8; repr.buffer_len().expect("known opcode")];
        assert_eq!(
            repr.emit(&mut out).expect("a parsed packet emits"),
            data.len()
        );
        let h = UdpFrameHeaders::roce("10.0.0.1".parse().unwrap(), 1, "10.0.0.2".parse().unwrap());
        let ip_udp = h.ip_udp_headers(data.len()).unwrap();
        let _ = icrc::compute(ip_udp.ip(), ip_udp.udp(), view.covered());
        let _ = view.payload();
    }
});
