//! Waiting the way perftest waits: on a flag in memory (a WRITE landing needs no call into
//! ferroce), or on the CQ, with the clock read only every so often.

use std::time::Instant;

use ferroce::{WcOpcode, WorkCompletion};

use super::*;

/// The last (up to) 8 bytes of a message in the send area, whose last byte is the flag of a
/// WRITE latency test. Setting the flag stores the whole word, built in a register: the post
/// that follows reads the message, and a load that takes a word from a smaller store still in
/// the store buffer has to wait for that store to reach the cache (a store-forwarding stall, a
/// few nanoseconds each turn of an 8 B shared-memory ping-pong). The same holds for a word put
/// together in memory from a byte store, so the word is shifted, never written byte by byte.
pub(super) struct FlagWord {
    pub(super) off: usize,
    pub(super) len: usize,
    /// The bytes, little-endian: byte `i` of the message's tail is bits `8i..8i + 8`.
    pub(super) word: u64,
}

impl FlagWord {
    /// The word ending the `len`-byte message at `off`, as the buffer holds it now.
    pub(super) fn new(s: &Session, off: usize, len: usize) -> Res<FlagWord> {
        let n = len.min(8);
        let mut bytes = [0u8; 8];
        s.buf
            .read(off + len - n, &mut bytes[..n])
            .map_err(|e| e.to_string())?;
        Ok(FlagWord {
            off: off + len - n,
            len: n,
            word: u64::from_le_bytes(bytes),
        })
    }

    #[inline(always)]
    pub(super) fn set(&mut self, s: &Session, flag: u8) -> Res<()> {
        let shift = 8 * (self.len - 1);
        self.word = self.word & !(0xff << shift) | u64::from(flag) << shift;
        let bytes = self.word.to_le_bytes();
        let done = if self.len == 8 {
            s.buf.write(self.off, &bytes)
        } else {
            s.buf.write(self.off, &bytes[..self.len])
        };
        done.map_err(|e| e.to_string())
    }
}

/// How many times `wait_flag` reads the flag byte between two CQ polls. A WRITE arriving as
/// packets needs the engine, which a CQ poll drives inline; a same-host peer's WRITE lands in
/// memory with no call here, and a poll in the way only delays seeing it, so then the CQ is
/// polled only now and then (for an error completion, and the clock).
pub(super) fn flag_looks(s: &Session) -> usize {
    if s.wait_like_perftest {
        return LOOKS_WITHOUT_POLLS;
    }
    match s.qps[0].provider() {
        ferroce::Provider::Shm => FLAG_LOOKS_PER_POLL_SHM,
        _ => 1,
    }
}

/// Polls until the byte at `off` is `flag`: looks at it `looks` times between two CQ polls.
/// Inlined, so that what follows a wait (the next post) comes straight after the look that
/// ends it.
#[inline(always)]
pub(super) fn wait_flag(
    s: &Session,
    off: usize,
    flag: u8,
    looks: usize,
    deadline: Instant,
) -> Res<()> {
    let mut b = [0u8];
    let mut polls = 0u64;
    if looks == LOOKS_WITHOUT_POLLS {
        // perftest's way: memory only (the clock now and then, for the deadline).
        loop {
            for _ in 0..1 << 16 {
                s.buf.read(off, &mut b).map_err(|e| e.to_string())?;
                if b[0] == flag {
                    return Ok(());
                }
                std::hint::spin_loop();
            }
            if Instant::now() > deadline {
                return Err("the peer stopped answering".into());
            }
        }
    }
    loop {
        for _ in 0..looks {
            s.buf.read(off, &mut b).map_err(|e| e.to_string())?;
            if b[0] == flag {
                return Ok(());
            }
            // Between looks at memory another core writes, a pause keeps the look from
            // costing the writer (without it an 8 B shared-memory WRITE ping-pong here takes
            // 4x as long). Between CQ polls, each a system call, it would only add ~25 ns.
            if looks > 1 {
                std::hint::spin_loop();
            }
        }
        poll_while_waiting(s, &mut polls, deadline)?;
    }
}

/// `wait_flag`'s CQ poll (for an error completion) and deadline, out of line: the loop that
/// looks at the flag stays a few instructions, and the code after it follows it closely.
#[inline(never)]
pub(super) fn poll_while_waiting(s: &Session, polls: &mut u64, deadline: Instant) -> Res<()> {
    if let Some(wc) = s.cq.poll_one().map_err(|e| e.to_string())? {
        check_wc(&wc)?;
    }
    *polls += 1;
    if *polls % POLLS_PER_CLOCK_READ == 0 && Instant::now() > deadline {
        return Err("the peer stopped answering".into());
    }
    Ok(())
}

/// `flag_looks` for `--wait-like-perftest`: no CQ poll at all while waiting.
pub(super) const LOOKS_WITHOUT_POLLS: usize = usize::MAX;

/// How many CQ polls `wait_flag` makes between two looks at the clock (for its deadline).
pub(super) const POLLS_PER_CLOCK_READ: u64 = 16;

/// Polls until a receive completion arrives.
pub(super) fn wait_recv(s: &Session, deadline: Instant) -> Res<WorkCompletion> {
    loop {
        if let Some(wc) = s.cq.poll_one().map_err(|e| e.to_string())? {
            check_wc(&wc)?;
            if wc.opcode == WcOpcode::Recv {
                return Ok(wc);
            }
        } else if Instant::now() > deadline {
            return Err("the peer stopped answering".into());
        } else {
            idle_wait(s, deadline)?;
        }
    }
}

pub(super) fn wait_send(s: &Session, deadline: Instant) -> Res<WorkCompletion> {
    loop {
        if let Some(wc) = s.cq.poll_one().map_err(|e| e.to_string())? {
            check_wc(&wc)?;
            if wc.opcode != WcOpcode::Recv {
                return Ok(wc);
            }
        } else if Instant::now() > deadline {
            return Err("the peer stopped answering".into());
        } else {
            idle_wait(s, deadline)?;
        }
    }
}

pub(super) fn verify_bytes(s: &Session, off: usize, expected: &[u8], what: &str) -> Res<()> {
    let got = s
        .buf
        .to_vec(off, expected.len())
        .map_err(|e| e.to_string())?;
    match got.iter().zip(expected).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!(
            "verification failed: {what}: byte {i} is {:#04x}, expected {:#04x}",
            got[i], expected[i]
        )),
    }
}

/// How often `wait_flag` reads the flag byte between two CQ polls over shared memory.
pub(super) const FLAG_LOOKS_PER_POLL_SHM: usize = 256;

pub(super) fn flag_of(i: u64) -> u8 {
    (i % 250) as u8 + 1
}

/// The longest one sleep on a completion event lasts: the callers check their deadlines
/// (and the end of a timed round) between two.
const EVENT_WAIT_MAX: Duration = Duration::from_millis(10);

/// After a poll that found the CQ empty: with `--events`, sleeps until its next completion
/// (or `until`, or [`EVENT_WAIT_MAX`]); without, returns at once (the caller busy-polls).
pub(super) fn idle_wait(s: &Session, until: Instant) -> Res<()> {
    let Some(channel) = &s.channel else {
        return Ok(());
    };
    s.cq.req_notify(false).map_err(|e| e.to_string())?;
    // A completion that came before the CQ was armed raises no event.
    if !s.cq.is_empty() {
        return Ok(());
    }
    let left = until.saturating_duration_since(Instant::now());
    s.event_waits.set(s.event_waits.get() + 1);
    channel
        .get_event(Some(left.min(EVENT_WAIT_MAX)))
        .map_err(|e| e.to_string())?;
    Ok(())
}
