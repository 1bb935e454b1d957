//! Fuzzes the rendezvous' readers (`ferroce_coll::store`): what a stranger at rank 0's port, or
//! a rank 0 that lies, sends.
//!
//! The first byte picks one of three readers:
//! * **rank 0's hello step** — the rest of the input is a connection's bytes, arriving in
//!   pieces of sizes the input chooses, each followed by "would block", then the end of the
//!   stream or silence. The verdict must be the spec's (magic `FRC2` checked on every byte as
//!   it comes; a big-endian length over `MAX_HELLO` is oversized, under 8 garbage; a whole hello
//!   gives rank, world size and token; an end before that is garbage, silence is waiting), the
//!   buffer must always be a prefix of the stream no longer than the hello, and nothing past the
//!   hello is read off the connection.
//! * **the message reader** — a length-prefixed message with a limit the input chooses: the
//!   result is the spec's, and no allocation is larger than 64 KiB or twice what arrived (a
//!   length that lies costs no memory), checked with a counting allocator.
//! * **a rank's table reader** — the input is rank 0's table, and also builds a table of its own
//!   (cards of lengths it chooses): parsing matches a bounds-checked reference parser, and a
//!   built table parses to exactly its cards.
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{ErrorKind, Read};
use std::sync::atomic::{AtomicUsize, Ordering};

use ferroce_coll::fuzzing::{hello, hello_step, parse_table, read_msg, HelloStep};
use ferroce_coll::store::{RendezvousStats, StoreError, MAX_CARD, MAX_HELLO, MAX_TABLE};
use ferroce_fuzz::Input;
use libfuzzer_sys::fuzz_target;

/// The system allocator, remembering the largest single request since [`reset_peak`].
struct Counting;

static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every call forwards to `System` with the caller's own arguments; the counter is a
// relaxed maximum that no allocation depends on.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        PEAK.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with `layout` (every allocation goes through it).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        PEAK.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        PEAK.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: as for `dealloc`; `new_size` is the caller's, under `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const MAGIC: &[u8; 4] = b"FRC2";

/// A connection's bytes: arrivals of given sizes, each then "would block"; after the last, the
/// end of the stream (`eof`) or "would block" for ever.
struct Conn<'a> {
    stream: &'a [u8],
    /// Where each arrival ends in `stream`, ascending.
    arrivals: Vec<usize>,
    /// Arrivals made available so far.
    arrived: usize,
    /// Bytes read off the connection.
    pos: usize,
    eof: bool,
}

impl Conn<'_> {
    fn available(&self) -> usize {
        if self.arrived == 0 {
            0
        } else {
            self.arrivals[self.arrived - 1]
        }
    }
}

impl Read for Conn<'_> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        let end = self.available();
        if self.pos < end {
            let n = out.len().min(end - self.pos);
            out[..n].copy_from_slice(&self.stream[self.pos..self.pos + n]);
            self.pos += n;
            return Ok(n);
        }
        if self.arrived == self.arrivals.len() && self.eof {
            return Ok(0);
        }
        Err(ErrorKind::WouldBlock.into())
    }
}

fn one(f: fn(&mut RendezvousStats) -> &mut u64) -> HelloStep {
    let mut s = RendezvousStats::default();
    *f(&mut s) += 1;
    HelloStep::Drop(s)
}

/// The verdict the spec gives on the whole stream `s`, all of it arrived: the verdict, and how
/// many bytes it takes to reach it.
fn spec_hello(s: &[u8], eof: bool) -> (HelloStep, usize) {
    let waiting = if eof {
        one(|s| &mut s.garbage)
    } else {
        HelloStep::Wait
    };
    if let Some(i) = (0..4.min(s.len())).find(|&i| s[i] != MAGIC[i]) {
        return (one(|s| &mut s.garbage), i + 1);
    }
    if s.len() < 8 {
        return (waiting, s.len());
    }
    let len = u32::from_be_bytes([s[4], s[5], s[6], s[7]]) as usize;
    if len > MAX_HELLO {
        return (one(|s| &mut s.oversized), 8);
    }
    if len < 8 {
        return (one(|s| &mut s.garbage), 8);
    }
    match s.get(..8 + len) {
        Some(h) => {
            let w = |at: usize| u32::from_be_bytes([h[at], h[at + 1], h[at + 2], h[at + 3]]);
            let v = HelloStep::Hello(w(8) as usize, w(12) as usize, h[16..].to_vec());
            (v, 8 + len)
        }
        None => (waiting, s.len()),
    }
}

fn hello_pass(inp: &mut Input<'_>, rest: &[u8]) {
    // Often a real hello (with a token of a chosen length) then the input's bytes, so that the
    // fuzzer reaches the whole-hello verdict without guessing a length.
    let mut stream = Vec::new();
    if inp.u8() & 1 == 1 {
        let token: Vec<u8> = (0..inp.below(64)).map(|i| i as u8).collect();
        stream = hello(inp.u32(), inp.u32(), &token);
        if inp.u8() & 1 == 1 {
            let at = inp.below(stream.len());
            stream[at] ^= inp.u8();
        }
    }
    stream.extend_from_slice(rest);
    // Piece sizes from a seed (the header is short): 1 to `most` bytes each.
    let most = 1 + usize::from(inp.u16()) % 600;
    let mut seed = inp.u32() | 1;
    let mut arrivals = Vec::new();
    let mut at = 0;
    while at < stream.len() && arrivals.len() < 64 {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        at = (at + 1 + seed as usize % most).min(stream.len());
        arrivals.push(at);
    }
    if let Some(last) = arrivals.last_mut() {
        *last = stream.len();
    }
    let eof = inp.u8() & 1 == 1;
    let mut c = Conn {
        stream: &stream,
        arrivals,
        arrived: 0,
        pos: 0,
        eof,
    };
    let mut buf = Vec::new();
    let (want, decided_at) = spec_hello(&stream, eof);
    loop {
        let step = hello_step(&mut buf, &mut c);
        assert!(
            buf.len() <= 8 + MAX_HELLO,
            "the hello buffer grew to {}",
            buf.len()
        );
        assert_eq!(buf[..], stream[..buf.len()], "the buffer is not the stream");
        assert_eq!(c.pos, buf.len(), "bytes read but not kept");
        assert!(
            c.pos <= decided_at.max(8),
            "read {} bytes, past the {decided_at} that decide",
            c.pos
        );
        match step {
            HelloStep::Wait if c.arrived < c.arrivals.len() => c.arrived += 1,
            step => {
                // Every byte has arrived (or the verdict came before them).
                assert_eq!(step, want, "verdict on {} bytes", stream.len());
                break;
            }
        }
    }
}

fn msg_pass(inp: &mut Input<'_>, rest: &[u8]) {
    let max = match inp.below(5) {
        0 => MAX_CARD + 8,
        1 => MAX_TABLE,
        2 => 4096,
        _ => usize::from(inp.u16()),
    };
    let mut s = Vec::new();
    if inp.u8() & 1 == 1 {
        // A length that lies (or not), then the input's bytes.
        let len = match inp.below(4) {
            0 => inp.u32(),
            1 => MAX_TABLE as u32 + 1,
            _ => rest.len() as u32,
        };
        s.extend_from_slice(&len.to_be_bytes());
    }
    s.extend_from_slice(rest);
    PEAK.store(0, Ordering::Relaxed);
    let got = read_msg(&mut &s[..], max);
    let peak = PEAK.load(Ordering::Relaxed);
    let want: Result<&[u8], ErrorKind> = match s.get(..4) {
        None => Err(ErrorKind::UnexpectedEof),
        Some(l) => {
            let len = u32::from_be_bytes([l[0], l[1], l[2], l[3]]) as usize;
            if len > max {
                Err(ErrorKind::InvalidData)
            } else {
                s[4..].get(..len).ok_or(ErrorKind::UnexpectedEof)
            }
        }
    };
    match (&got, want) {
        (Ok(m), Ok(w)) => assert_eq!(&m[..], w, "message bytes"),
        (Err(e), Err(k)) => assert_eq!(e.kind(), k, "error {e}"),
        _ => panic!(
            "read_msg of {} bytes (max {max}): got {got:?}, spec {want:?}",
            s.len()
        ),
    }
    let bound = (64 << 10).max(2 * s.len() + 64);
    assert!(
        peak <= bound,
        "read_msg allocated {peak} bytes for a {}-byte stream",
        s.len()
    );
}

/// The reference table parser: bounds-checked, one card at a time.
fn spec_table(t: &[u8], round: &[u8; 8], n: usize) -> Result<Vec<Vec<u8>>, &'static str> {
    if t.len() >= 8 && t[..8] == [0xff; 8] {
        return Err("aborted");
    }
    if t.len() < 8 || t[..8] != round[..] {
        return Err("protocol");
    }
    let mut rest = &t[8..];
    let mut cards = Vec::new();
    for _ in 0..n {
        if rest.len() < 4 {
            return Err("protocol");
        }
        let len = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        rest = &rest[4..];
        if rest.len() < len {
            return Err("protocol");
        }
        cards.push(rest[..len].to_vec());
        rest = &rest[len..];
    }
    if !rest.is_empty() {
        return Err("protocol");
    }
    Ok(cards)
}

fn check_table(t: &[u8], round: &[u8; 8], n: usize) {
    let got = parse_table(t, round, n);
    match (&got, spec_table(t, round, n)) {
        (Ok(c), Ok(w)) => assert_eq!(*c, w, "cards"),
        (Err(StoreError::Aborted(_)), Err("aborted")) => {}
        (Err(StoreError::Protocol(_)), Err("protocol")) => {}
        (g, w) => panic!(
            "parse_table of {} bytes, n {n}: got {g:?}, spec {w:?}",
            t.len()
        ),
    }
}

fn table_pass(inp: &mut Input<'_>, rest: &[u8]) {
    let round = inp.u64().to_be_bytes();
    let n = inp.below(9);
    // The input's bytes, after the right round or not.
    let mut t = Vec::new();
    if inp.u8() & 1 == 1 {
        t.extend_from_slice(&round);
    }
    t.extend_from_slice(rest);
    check_table(&t, &round, n);
    // A table built as rank 0 builds it parses to its cards.
    let cards: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; inp.below(40)]).collect();
    let mut built = round.to_vec();
    for c in &cards {
        built.extend_from_slice(&(c.len() as u32).to_be_bytes());
        built.extend_from_slice(c);
    }
    if round != [0xff; 8] {
        assert_eq!(
            parse_table(&built, &round, n).ok(),
            Some(cards),
            "round trip"
        );
    }
    check_table(&built, &round, n);
}

fuzz_target!(|data: &[u8]| {
    // A header of choices (32 bytes), then the bytes a peer sends.
    let (head, rest) = data.split_at(data.len().min(32));
    let mut inp = Input::new(head);
    match inp.below(3) {
        0 => hello_pass(&mut inp, rest),
        1 => msg_pass(&mut inp, rest),
        _ => table_pass(&mut inp, rest),
    }
});
