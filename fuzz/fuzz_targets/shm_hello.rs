//! Fuzzes the shared-memory hello (`provider::shm::host::parse_hello`): the first message any
//! process on the host may send to a context's listener.
//!
//! Oracle: the spec, written out here — exactly 16 bytes, magic `FRSH`, version 2, three
//! reserved bytes zero, then the sender's QP and the QP it asks for as little-endian `u32`s —
//! decides every input, and `parse_hello` must agree with it. Then the input builds hellos of
//! its own: each parses to the QP numbers it was made with, and a change to any byte outside
//! the two QP numbers, or a byte added or taken away, is refused.
#![no_main]

use ferroce::fuzzing::{shm_hello, shm_parse_hello};
use ferroce_fuzz::Input;
use libfuzzer_sys::fuzz_target;

fn spec(msg: &[u8]) -> Option<(u32, u32)> {
    if msg.len() != 16 || msg[..4] != *b"FRSH" || msg[4] != 2 || msg[5..8] != [0, 0, 0] {
        return None;
    }
    let word = |at: usize| u32::from_le_bytes([msg[at], msg[at + 1], msg[at + 2], msg[at + 3]]);
    Some((word(12), word(8)))
}

fuzz_target!(|data: &[u8]| {
    assert_eq!(shm_parse_hello(data), spec(data), "hello {data:02x?}");
    let mut inp = Input::new(data);
    while !inp.is_empty() {
        let (from, to) = (inp.u32(), inp.u32());
        let h = shm_hello(from, to);
        assert_eq!(spec(&h), Some((to, from)), "hello() breaks the spec");
        assert_eq!(shm_parse_hello(&h), Some((to, from)), "round trip");
        let mut m = h.to_vec();
        let at = inp.below(16);
        let x = inp.u8().max(1);
        m[at] ^= x;
        let want = if at >= 8 {
            Some((
                u32::from_le_bytes(m[12..16].try_into().unwrap()),
                u32::from_le_bytes(m[8..12].try_into().unwrap()),
            ))
        } else {
            None
        };
        assert_eq!(shm_parse_hello(&m), want, "hello with byte {at} changed");
        m[at] ^= x;
        m.push(inp.u8());
        assert_eq!(shm_parse_hello(&m), None, "a 17-byte hello");
        assert_eq!(shm_parse_hello(&m[..15]), None, "a 15-byte hello");
    }
});
