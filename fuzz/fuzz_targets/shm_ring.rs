//! Fuzzes the shared-memory packet ring (`provider::shm::ring`) against a safe reference model.
//!
//! The ring's page is writable by the peer, so its producer and consumer must survive any value
//! in the head and tail words and any bytes in the data area. The target lays out, in one
//! vector of words, guard words, the head word, guard words, the tail word, guard words, the
//! data area and guard words; the input chooses the ring's size, its first positions (clean,
//! near 2^64, or anything) and data, then a script of pushes, pops, `room_for` calls, a new
//! producer taken from the page, and pokes: the peer overwriting the head, the tail or any data
//! word with anything (a nearby position, a wrap marker, a length, a raw value).
//!
//! The reference model reads the same memory with bounds-checked slices only. Before each step
//! it predicts the result and the whole memory after it; the step must match both exactly:
//! * every `Ok(Some(n))` returned exactly the `n` bytes the model parses from the record, and
//!   wrote nothing past `n` in the caller's buffer;
//! * an error comes exactly where the model says the ring is broken (a position that is
//!   misaligned, behind, too far ahead or would pass 2^64; a length over the ring's quarter, the
//!   caller's buffer or the span published), and `Ok(false)` exactly when there is no room;
//! * no byte outside what the step may write changes — the guard words around the ring above
//!   all (without AddressSanitizer an access out of bounds crashes nothing; this is what
//!   catches it);
//! * the consumer's private position is the model's after every step;
//! * while no poke has happened (and the ring started clean), the consumer gets back exactly
//!   the packets pushed, in order, and nothing fails.
#![no_main]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};

use ferroce::fuzzing::{Consumer, Producer, Ring, RingError};
use ferroce_fuzz::Input;
use libfuzzer_sys::fuzz_target;

/// Guard words on each side of every area.
const GUARD: usize = 4;
const HEAD: usize = GUARD;
const TAIL: usize = HEAD + 1 + GUARD;
const DATA: usize = TAIL + 1 + GUARD;
const WRAP: u32 = u32::MAX;
const HEADER: usize = 8;
const MAX_STEPS: usize = 400;

fn pad8(n: usize) -> usize {
    (n + 7) & !7
}

/// The value a guard word at `i` holds (never changes).
fn guard_value(i: usize) -> u64 {
    0xa5a5_5a5a_0000_0000 ^ (i as u64).wrapping_mul(0x9e37_79b9)
}

/// The shared memory: words the ring reaches through raw pointers, read here only through
/// atomics (single-threaded: the ring's plain accesses and these never overlap in time).
struct Mem {
    words: Vec<AtomicU64>,
    size: usize,
}

impl Mem {
    fn new(size: usize) -> Mem {
        let n = DATA + size / 8 + GUARD;
        let words = (0..n).map(|i| AtomicU64::new(guard_value(i))).collect();
        let m = Mem { words, size };
        m.set(HEAD, 0);
        m.set(TAIL, 0);
        for w in 0..size / 8 {
            m.set(DATA + w, 0);
        }
        m
    }

    fn word(&self, i: usize) -> u64 {
        self.words[i].load(Ordering::Relaxed)
    }

    fn set(&self, i: usize, v: u64) {
        self.words[i].store(v, Ordering::Relaxed)
    }

    /// Every byte, guards included.
    fn image(&self) -> Vec<u8> {
        self.words
            .iter()
            .flat_map(|w| w.load(Ordering::Relaxed).to_ne_bytes())
            .collect()
    }

    fn ring(&self) -> Ring {
        let base = self.words.as_ptr();
        // SAFETY: the three areas are inside `words`, which is never resized and outlives
        // every view (`Harness` declares `mem` last, so it is dropped after the ends made from
        // this view); they are 8-aligned (AtomicU64 is) and disjoint; AtomicU64 allows writes
        // through a pointer derived from a shared reference (it is an UnsafeCell); `size` is a
        // multiple of 8 and at least 64. The harness is single-threaded, so the ring's plain
        // accesses never race with the atomics here.
        unsafe {
            Ring::new(
                base.add(HEAD),
                base.add(TAIL),
                base.add(DATA) as *mut u8,
                self.size,
            )
        }
    }
}

/// Byte index in an image of data offset `off`.
fn data_at(off: usize) -> usize {
    DATA * 8 + off
}

fn img_u64(img: &[u8], word: usize) -> u64 {
    u64::from_ne_bytes(img[word * 8..word * 8 + 8].try_into().unwrap())
}

fn set_img_u64(img: &mut [u8], word: usize, v: u64) {
    img[word * 8..word * 8 + 8].copy_from_slice(&v.to_ne_bytes());
}

/// The 4-byte word at data offset `off` (bounds-checked against the ring, not only the image).
fn data_u32(img: &[u8], size: usize, off: usize) -> u32 {
    assert!(off + 4 <= size, "model read past the ring");
    u32::from_ne_bytes(img[data_at(off)..data_at(off) + 4].try_into().unwrap())
}

fn set_data_u32(img: &mut [u8], size: usize, off: usize, v: u32) {
    assert!(off + 4 <= size, "model write past the ring");
    img[data_at(off)..data_at(off) + 4].copy_from_slice(&v.to_ne_bytes());
}

fn plausible(size: usize, behind: u64, ahead: u64) -> bool {
    (behind | ahead) % 8 == 0 && ahead >= behind && ahead - behind <= size as u64
}

/// What a push should do: its result, the producer's position after it, and the memory.
fn model_push(
    img: &[u8],
    size: usize,
    head: u64,
    pkt: &[u8],
) -> (Result<bool, RingError>, u64, Vec<u8>) {
    let mut out = img.to_vec();
    let tail = img_u64(img, TAIL);
    if !plausible(size, tail, head) {
        return (Err(RingError), head, out);
    }
    let used = (head - tail) as usize;
    let need = HEADER + pad8(pkt.len());
    let at = (head % size as u64) as usize;
    let to_end = size - at;
    let total = if to_end < need { to_end + need } else { need };
    if pkt.len() > size / 4 || size - used < total {
        return (Ok(false), head, out);
    }
    // A position that would pass 2^64 is a lie: a real ring never gets there.
    let Some(new_head) = head.checked_add(total as u64) else {
        return (Err(RingError), head, out);
    };
    let mut at = at;
    if to_end < need {
        set_data_u32(&mut out, size, at, WRAP);
        at = 0;
    }
    set_data_u32(&mut out, size, at, pkt.len() as u32);
    assert!(
        at + HEADER + pkt.len() <= size,
        "model record past the ring"
    );
    out[data_at(at + HEADER)..data_at(at + HEADER) + pkt.len()].copy_from_slice(pkt);
    set_img_u64(&mut out, HEAD, new_head);
    (Ok(true), new_head, out)
}

/// What a pop should do: its result (with the bytes), the consumer's position after it, and
/// the memory.
fn model_pop(
    img: &[u8],
    size: usize,
    tail: u64,
    out_len: usize,
) -> (Result<Option<Vec<u8>>, RingError>, u64, Vec<u8>) {
    let mut mem = img.to_vec();
    let head = img_u64(img, HEAD);
    if !plausible(size, tail, head) {
        return (Err(RingError), tail, mem);
    }
    if head == tail {
        return (Ok(None), tail, mem);
    }
    let mut t = tail;
    let mut at = (t % size as u64) as usize;
    let mut len = data_u32(img, size, at);
    if len == WRAP {
        match t.checked_add((size - at) as u64) {
            Some(n) if n <= head => t = n,
            _ => return (Err(RingError), tail, mem),
        }
        if t == head {
            set_img_u64(&mut mem, TAIL, t);
            return (Ok(None), t, mem);
        }
        at = 0;
        len = data_u32(img, size, 0);
    }
    let len = len as usize;
    let need = HEADER + pad8(len);
    if len > size / 4 || len > out_len || at + need > size || ((head - t) as usize) < need {
        // The wrap marker, if any, stays consumed: the caller ends the link on an error.
        return (Err(RingError), t, mem);
    }
    let bytes = img[data_at(at + HEADER)..data_at(at + HEADER) + len].to_vec();
    let t = t + need as u64;
    set_img_u64(&mut mem, TAIL, t);
    (Ok(Some(bytes)), t, mem)
}

struct Harness {
    size: usize,
    producer: Option<Producer>,
    /// The producer's private position, as the model follows it.
    head: u64,
    consumer: Consumer,
    /// The consumer's private position, as the model follows it.
    tail: u64,
    /// No lie so far: the consumer must get exactly what was pushed.
    honest: bool,
    sent: VecDeque<Vec<u8>>,
    seq: u32,
    /// Last, so that it is dropped after the ends pointing into it.
    mem: Mem,
}

impl Harness {
    fn check_mem(&self, want: &[u8], what: &str) {
        let now = self.mem.image();
        if now != want {
            let i = now.iter().zip(want).position(|(a, b)| a != b).unwrap();
            let word = i / 8;
            let place = match word {
                HEAD => "the head word".to_string(),
                TAIL => "the tail word".to_string(),
                w if (DATA..DATA + self.size / 8).contains(&w) => {
                    format!("data byte {}", i - DATA * 8)
                }
                _ => format!("GUARD word {word}, outside the ring"),
            };
            panic!(
                "{what}: {place} is {:#04x}, the model says {:#04x}",
                now[i], want[i]
            );
        }
        for i in (0..self.mem.words.len())
            .filter(|&i| i != HEAD && i != TAIL && !(DATA..DATA + self.size / 8).contains(&i))
        {
            assert_eq!(self.mem.word(i), guard_value(i), "{what}: guard word {i}");
        }
    }

    fn new_producer(&mut self) {
        let img = self.mem.image();
        let (head, tail) = (img_u64(&img, HEAD), img_u64(&img, TAIL));
        let got = self.mem.ring().producer();
        self.check_mem(&img, "producer()");
        match got {
            Ok(p) => {
                assert!(
                    plausible(self.size, tail, head),
                    "producer() accepted head {head:#x} tail {tail:#x}"
                );
                self.producer = Some(p);
                self.head = head;
            }
            Err(RingError) => {
                assert!(
                    !plausible(self.size, tail, head),
                    "producer() refused head {head:#x} tail {tail:#x}"
                );
                assert!(!self.honest, "an honest ring refused a producer");
                self.producer = None;
            }
        }
    }

    /// Pushes a packet of `len` bytes; `None` without a producer.
    fn push(&mut self, len: usize) -> Option<Result<bool, RingError>> {
        let p = self.producer.as_mut()?;
        self.seq = self.seq.wrapping_add(1);
        let pkt: Vec<u8> = (0..len)
            .map(|i| (self.seq as u8).wrapping_mul(29) ^ (i as u8) ^ (i >> 8) as u8)
            .collect();
        let img = self.mem.image();
        let (want, head, mem) = model_push(&img, self.size, self.head, &pkt);
        let got = p.push(&pkt);
        assert_eq!(got, want, "push of {len} bytes at head {:#x}", self.head);
        self.check_mem(&mem, "push");
        self.head = head;
        if self.honest {
            assert!(got.is_ok(), "push failed on an honest ring");
            if got == Ok(true) {
                self.sent.push_back(pkt);
            }
        }
        Some(got)
    }

    fn room_then_push(&mut self, max_len: usize, len: usize) {
        let Some(p) = self.producer.as_ref() else {
            return;
        };
        let img = self.mem.image();
        let tail = img_u64(&img, TAIL);
        let want = if plausible(self.size, tail, self.head) {
            let used = (self.head - tail) as usize;
            Ok(((self.size - used) / (HEADER + pad8(max_len))).saturating_sub(1))
        } else {
            Err(RingError)
        };
        let got = p.room_for(max_len);
        assert_eq!(got, want, "room_for({max_len})");
        self.check_mem(&img, "room_for");
        if matches!(got, Ok(n) if n >= 1) && len <= max_len && len <= self.size / 4 {
            // (An error is the model's, checked in `push`: a head about to pass 2^64.)
            assert_ne!(
                self.push(len),
                Some(Ok(false)),
                "room_for said a record of {max_len} fits, a push of {len} found no room"
            );
        }
    }

    fn pop(&mut self, out_len: usize) {
        const SENTINEL: u8 = 0xee;
        let mut out = vec![SENTINEL; out_len + 64];
        let img = self.mem.image();
        let (want, tail, mem) = model_pop(&img, self.size, self.tail, out_len);
        let got = self.consumer.pop(&mut out[..out_len]);
        match (&got, &want) {
            (Ok(Some(n)), Ok(Some(bytes))) => {
                assert_eq!(*n, bytes.len(), "pop length at tail {:#x}", self.tail);
                assert_eq!(&out[..*n], &bytes[..], "pop bytes at tail {:#x}", self.tail);
                assert!(
                    out[*n..].iter().all(|&b| b == SENTINEL),
                    "pop wrote past the {n} bytes it returned"
                );
            }
            (Ok(None), Ok(None)) | (Err(RingError), Err(RingError)) => {
                assert!(
                    out.iter().all(|&b| b == SENTINEL),
                    "a pop that returned no packet wrote into the buffer"
                );
            }
            _ => panic!(
                "pop at tail {:#x} (head word {:#x}, buffer {out_len}): got {got:?}, the model \
                 says {:?}",
                self.tail,
                img_u64(&img, HEAD),
                want.as_ref().map(|o| o.as_ref().map(Vec::len))
            ),
        }
        self.check_mem(&mem, "pop");
        assert_eq!(self.consumer.tail(), tail, "consumer position after pop");
        self.tail = tail;
        if self.honest {
            match (&got, self.sent.front()) {
                (Ok(Some(n)), Some(p)) => {
                    assert_eq!(
                        &out[..*n],
                        &p[..],
                        "an honest ring reordered or changed a packet"
                    );
                    self.sent.pop_front();
                }
                (Ok(None), None) => {}
                (Err(RingError), Some(p)) if p.len() > out_len => {}
                _ => panic!(
                    "honest ring: pop gave {got:?} with {} packets queued (front {:?} bytes, \
                     buffer {out_len})",
                    self.sent.len(),
                    self.sent.front().map(Vec::len)
                ),
            }
        }
    }

    /// The peer writes a word of the ring's page.
    fn poke(&mut self, inp: &mut Input<'_>) {
        self.honest = false;
        let nwords = self.size / 8;
        let word = match inp.below(4) {
            0 => HEAD,
            1 => TAIL,
            _ => DATA + (usize::from(inp.u16()) % nwords),
        };
        let cur = self.mem.word(word);
        let value = match inp.below(8) {
            0 => inp.u64(),
            1 => cur.wrapping_add((i64::from(inp.u8() as i8) * 8) as u64),
            2 => self
                .tail
                .wrapping_add((i64::from(inp.u8() as i8) * 8) as u64),
            3 => self
                .head
                .wrapping_add((i64::from(inp.u8() as i8) * 8) as u64),
            // A record header: a wrap marker or a length in its low half, the rest kept.
            4 => (cur & !0xffff_ffff) | u64::from(WRAP),
            5 => (cur & !0xffff_ffff) | u64::from(inp.u16()) % (self.size as u64 + 16),
            6 => (cur & !0xffff_ffff) | u64::from(inp.u32()),
            _ => !cur,
        };
        self.mem.set(word, value);
    }
}

fn run(data: &[u8]) {
    let mut inp = Input::new(data);
    let size = 64 + 8 * inp.below(57);
    let mem = Mem::new(size);
    let mode = inp.below(4);
    let near_max = |inp: &mut Input<'_>| u64::MAX - 7 - 8 * u64::from(inp.u16());
    let (head, tail) = match mode {
        0 => (0, 0),
        1 => {
            let p = inp.u64() & !7;
            (p, p)
        }
        2 => {
            let p = near_max(&mut inp);
            (p, p)
        }
        _ => match inp.below(3) {
            0 => (inp.u64(), inp.u64()),
            1 => {
                let t = near_max(&mut inp);
                (t.wrapping_add(8 * u64::from(inp.u8())), t)
            }
            _ => {
                let t = inp.u64() & !7;
                (t.wrapping_add(u64::from(inp.u16())), t)
            }
        },
    };
    mem.set(HEAD, head);
    mem.set(TAIL, tail);
    if inp.u8() & 1 == 1 {
        for (w, chunk) in (0..size / 8).zip(inp.bytes(size).chunks(8)) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            mem.set(DATA + w, u64::from_ne_bytes(b));
        }
    }
    let consumer_tail = if mode == 3 && inp.u8() & 1 == 1 {
        inp.u64()
    } else {
        tail
    };
    let ring = mem.ring();
    let consumer = ring.consumer(consumer_tail);
    let mut h = Harness {
        size,
        producer: None,
        head: 0,
        consumer,
        tail: consumer_tail,
        honest: mode == 0 || (mode == 1 && tail < 1 << 63),
        sent: VecDeque::new(),
        seq: 0,
        mem,
    };
    h.new_producer();
    let max_packet = size / 4;
    for _ in 0..MAX_STEPS {
        if inp.is_empty() {
            break;
        }
        match inp.below(16) {
            0..=4 => {
                let len = match inp.below(8) {
                    0 => 0,
                    1 => max_packet,
                    2 => max_packet + 1 + inp.below(16),
                    3 => usize::from(inp.u16()),
                    _ => inp.below(max_packet + 1),
                };
                h.push(len);
            }
            5..=9 => {
                let out_len = match inp.below(6) {
                    0 => inp.below(max_packet + 1),
                    1 => usize::from(inp.u16()) % (2 * size),
                    _ => max_packet,
                };
                h.pop(out_len);
            }
            10 => {
                let max_len = inp.below(max_packet + 1);
                let len = inp.below(max_len + 1);
                h.room_then_push(max_len, len);
            }
            11 => h.new_producer(),
            _ => h.poke(&mut inp),
        }
    }
    // Drain what is left: an honest ring hands back every packet pushed.
    for _ in 0..size {
        if h.honest && h.sent.is_empty() {
            break;
        }
        h.pop(max_packet);
        if !h.honest {
            break;
        }
    }
    if h.honest {
        assert!(
            h.sent.is_empty(),
            "packets pushed on an honest ring were lost"
        );
    }
}

fuzz_target!(|data: &[u8]| run(data));
