//! Fuzzes the drop-in librdmacm's connection messages (REQ, REP, REJ, RTU, DREQ over TCP, in
//! `ferroce-ibverbs`' `rdmacm`): what the other end of an rdma_cm connection sends.
//!
//! * **decode** — the input as a stream: `Message::read` never panics, and what it accepts is
//!   exactly what its encoding says, byte for byte over the bytes it consumed (but for the top
//!   byte of the QP number and PSN, which the reader drops: they are 24-bit), and it consumes
//!   nothing past the message.
//! * **round trip** — the input builds a message (every kind, private data of 0 to 255 bytes,
//!   24-bit QP numbers and PSNs, a REQ or REP with or without an ECE): reading its encoding
//!   gives it back, and every cut of the encoding is an error.
#![no_main]

use ferroce_fuzz::Input;
use ferroce_ibverbs::fuzzing::{Ece, Message};
use libfuzzer_sys::fuzz_target;

fn decode_pass(data: &[u8]) {
    let mut rest = data;
    let Ok(m) = Message::read(&mut rest) else {
        return;
    };
    let used = data.len() - rest.len();
    let mut want = data[..used].to_vec();
    if matches!(m, Message::Connect { .. }) {
        // QP number at 5..9, PSN at 9..13: the reader keeps their low 24 bits.
        want[5] = 0;
        want[9] = 0;
    }
    assert_eq!(
        m.encode(),
        want,
        "an accepted message is not its encoding: {m:?}"
    );
}

fn build(inp: &mut Input<'_>) -> Message {
    let private = |inp: &mut Input<'_>| {
        let n = inp.u8();
        (0..n).map(|i| i ^ n).collect::<Vec<u8>>()
    };
    match inp.below(5) {
        0 | 1 => {
            let reply = inp.u8() & 1 == 1;
            let qpn = inp.u32() & 0x00ff_ffff;
            let psn = inp.u32() & 0x00ff_ffff;
            let mut gid = [0u8; 16];
            for b in &mut gid {
                *b = inp.u8();
            }
            Message::Connect {
                reply,
                qpn,
                psn,
                gid,
                mtu: inp.u8(),
                responder_resources: inp.u8(),
                initiator_depth: inp.u8(),
                retry_count: inp.u8(),
                rnr_retry_count: inp.u8(),
                private: private(inp),
                ece: (inp.u8() & 1 == 1).then(|| Ece {
                    vendor_id: inp.u32(),
                    options: inp.u32(),
                }),
            }
        }
        2 => Message::Reject {
            private: private(inp),
        },
        3 => Message::ReadyToUse,
        _ => Message::Disconnect,
    }
}

fuzz_target!(|data: &[u8]| {
    decode_pass(data);
    let mut inp = Input::new(data);
    let m = build(&mut inp);
    let b = m.encode();
    let mut r = &b[..];
    assert_eq!(
        Message::read(&mut r).ok(),
        Some(m.clone()),
        "decode(encode(x)) != x"
    );
    assert!(
        r.is_empty(),
        "the reader left {} bytes of its message",
        r.len()
    );
    let cut = usize::from(inp.u16()) % b.len();
    assert!(
        Message::read(&mut &b[..cut]).is_err(),
        "{m:?} cut at {cut} of {} bytes was accepted",
        b.len()
    );
});
