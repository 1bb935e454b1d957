//! Fuzzes the connection exchange's messages (`ferroce::cm`): what a TCP peer sends before any
//! QP is connected.
//!
//! Two passes over each input:
//! * **decode** — the bytes as a received `ENDPOINTS` message and as a `READY` message, read as
//!   a connection reads its stream (a message cut short is `Closed`). Never a panic; the reader
//!   consumes no byte past the message; an accepted `ENDPOINTS` message holds 1 to
//!   `MAX_ENDPOINTS` endpoints that each pass `validate`, its header says exactly their count
//!   and length, and encoding them gives back exactly the bytes read (so nothing is accepted
//!   that the encoder cannot say: reserved bytes, unknown flags, a stray region). The same for
//!   `EndpointInfo::from_bytes` on the first 56 bytes.
//! * **round trip** — the input builds a list of endpoints, every field from it (QP numbers
//!   past 24 bits, multicast or unspecified GIDs, port 0, READ depths over 16 and regions that
//!   wrap included); the encoded list decodes to exactly the list when every endpoint passes
//!   `validate`, and otherwise fails with the first failing endpoint's index and problem.
#![no_main]

use std::net::{Ipv4Addr, Ipv6Addr};

use ferroce::cm::{CmError, EndpointInfo, MessageKind, RemoteRegion, ENDPOINT_LEN, HEADER_LEN};
use ferroce::fuzzing::{cm_encode_endpoints, cm_read_message};
use ferroce::{PathMtu, Psn};
use ferroce_fuzz::Input;
use libfuzzer_sys::fuzz_target;

const MTUS: [PathMtu; 5] = [
    PathMtu::Mtu256,
    PathMtu::Mtu512,
    PathMtu::Mtu1024,
    PathMtu::Mtu2048,
    PathMtu::Mtu4096,
];

fn decode_pass(data: &[u8]) {
    let (r, used) = cm_read_message(data, MessageKind::Endpoints);
    assert!(used <= data.len(), "read past the input");
    match r {
        Ok(list) => {
            assert!(
                (1..=ferroce::cm::MAX_ENDPOINTS).contains(&list.len()),
                "accepted {} endpoints",
                list.len()
            );
            assert_eq!(used, HEADER_LEN + list.len() * ENDPOINT_LEN, "bytes read");
            for e in &list {
                assert!(e.validate().is_ok(), "accepted an invalid endpoint {e:?}");
            }
            assert_eq!(
                cm_encode_endpoints(&list),
                &data[..used],
                "an accepted message is not what its endpoints encode to"
            );
        }
        Err(_) => {}
    }
    let (r, used) = cm_read_message(data, MessageKind::Ready);
    if let Ok(list) = r {
        assert!(list.is_empty(), "READY with endpoints");
        assert_eq!(used, HEADER_LEN);
        assert_eq!(
            &data[..HEADER_LEN],
            b"FRCE\x01\x02\0\0\0\0\0\0",
            "READY bytes"
        );
    }
    if let Some(rec) = data.get(..ENDPOINT_LEN) {
        if let Ok(e) = EndpointInfo::from_bytes(rec) {
            assert_eq!(
                e.to_bytes(),
                rec,
                "from_bytes accepted a non-canonical record"
            );
        }
    }
    if data.len() != ENDPOINT_LEN {
        assert!(
            EndpointInfo::from_bytes(data).is_err(),
            "a record of another length"
        );
    }
}

fn endpoint(inp: &mut Input<'_>) -> EndpointInfo {
    let qpn = match inp.below(4) {
        0 => inp.u32(),
        _ => inp.u32() & 0x00ff_ffff,
    };
    let gid = match inp.below(4) {
        0 => {
            let mut g = [0u8; 16];
            for b in &mut g {
                *b = inp.u8();
            }
            Ipv6Addr::from(g)
        }
        1 => Ipv6Addr::UNSPECIFIED,
        _ => Ipv4Addr::from(inp.u32()).to_ipv6_mapped(),
    };
    let region = match inp.below(3) {
        0 => None,
        1 => Some(RemoteRegion {
            addr: inp.u64(),
            rkey: inp.u32(),
            len: inp.u64(),
        }),
        _ => Some(RemoteRegion {
            addr: u64::from(inp.u32()) << 12,
            rkey: inp.u32(),
            len: u64::from(inp.u32()),
        }),
    };
    EndpointInfo {
        qpn,
        psn: Psn::new(inp.u32()),
        gid,
        udp_port: match inp.below(8) {
            0 => 0,
            _ => inp.u16(),
        },
        mtu: MTUS[inp.below(MTUS.len())],
        max_rd_atomic: match inp.below(4) {
            0 => inp.u8(),
            _ => inp.below(17) as u8,
        },
        region,
        acks_unasked: inp.u8() & 1 == 1,
        small_identifications: inp.u8() & 1 == 1,
        selective_repeat: inp.u8() & 1 == 1,
    }
}

fn round_trip_pass(data: &[u8]) {
    let mut inp = Input::new(data);
    let n = 1 + inp.below(8);
    let list: Vec<EndpointInfo> = (0..n).map(|_| endpoint(&mut inp)).collect();
    let bytes = cm_encode_endpoints(&list);
    assert_eq!(bytes.len(), HEADER_LEN + n * ENDPOINT_LEN, "encoded length");
    let (r, used) = cm_read_message(&bytes, MessageKind::Endpoints);
    let first_bad = list
        .iter()
        .enumerate()
        .find_map(|(i, e)| e.validate().err().map(|p| (i, p)));
    match (r, first_bad) {
        (Ok(got), None) => {
            assert_eq!(got, list, "decode(encode(x)) != x");
            assert_eq!(used, bytes.len());
        }
        (Err(CmError::InvalidPeerEndpoint { index, problem, .. }), Some((i, p))) => {
            assert_eq!(
                (index, problem),
                (i, p),
                "the decoder named another problem"
            );
        }
        (r, bad) => panic!("decode(encode({list:?})) = {r:?}, validate says {bad:?}"),
    }
    for e in &list {
        match (EndpointInfo::from_bytes(&e.to_bytes()), e.validate()) {
            (Ok(got), Ok(())) => assert_eq!(got, *e, "from_bytes(to_bytes(x)) != x"),
            (Err(p), Err(q)) => assert_eq!(p, q, "from_bytes named another problem"),
            (r, v) => panic!("from_bytes(to_bytes({e:?})) = {r:?}, validate says {v:?}"),
        }
    }
    // The same message cut anywhere is `Closed`, never a panic or a partial list.
    let cut = usize::from(inp.u16()) % bytes.len();
    assert!(
        matches!(
            cm_read_message(&bytes[..cut], MessageKind::Endpoints).0,
            Err(CmError::Closed { .. })
        ),
        "a message cut at {cut} of {} bytes",
        bytes.len()
    );
}

fuzz_target!(|data: &[u8]| {
    decode_pass(data);
    round_trip_pass(data);
});
