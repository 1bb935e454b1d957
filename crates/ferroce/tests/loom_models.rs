//! Models of the same-host provider's lock-free protocols under loom, which runs their threads
//! through every interleaving (and every value the memory model lets each atomic load see) and
//! fails on a data race on plain memory ("Causality violation") or on a failed assertion.
//!
//! The real code works on raw shared memory (`AtomicU64::from_ptr` over a mapping, volatile and
//! plain copies), which loom cannot track, so each model is a transcription of one function,
//! line by line, with the shared words as loom atomics and the plain bytes as
//! `loom::cell::UnsafeCell` words (loom reports any access to them that no release/acquire pair
//! orders against a write). Each model's comment names the source lines it transcribes; keep
//! them in step when those change. Each model also runs with one ordering weakened
//! (`#[should_panic]` tests): loom must find the race or the torn read, which shows the model
//! can fail.
//!
//! - [`ring`]: `provider/shm/ring.rs`, `Producer::push` and `Consumer::pop`.
//! - [`seqlock`]: `provider/shm/pages.rs`, `KeyTable::write_slot`/`publish`/`withdraw` and
//!   `KeyTable::lookup`.
//! - [`flag`]: `verbs/mr.rs`, `MemoryRegion::write` then `read` used as data-then-flag, with a
//!   release fence after `write`'s copy and an acquire fence before `read`'s. (ferroce-coll's
//!   header and credit words have their own model: `crates/ferroce-coll/tests/loom_words.rs`.)
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p ferroce --test loom_models --release -- --nocapture`
//! (each passing model prints how many interleavings it explored).
#![cfg(loom)]

use std::sync::atomic::AtomicUsize as StdCounter;

use loom::sync::atomic::Ordering::{self, Acquire, Relaxed, Release};

/// Runs `f` under loom and prints how many executions it took. `preemptions` bounds how often
/// a thread may be switched out while it could go on (`None`: every interleaving); the
/// weakened variants run under the same bound as the model they weaken, so a bound that hid
/// the bug would show as their failure.
fn explore(name: &str, preemptions: Option<usize>, f: impl Fn() + Sync + Send + 'static) {
    // A counter of this call's own (tests run in parallel), outside loom's view.
    let runs = std::sync::Arc::new(StdCounter::new(0));
    let counted = runs.clone();
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = preemptions;
    builder.check(move || {
        counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        f();
    });
    println!(
        "loom model {name}: {} interleavings, all passed",
        runs.load(std::sync::atomic::Ordering::Relaxed)
    );
}

/// The ring's and the flag's models are small enough for every interleaving (48,654 for the
/// ring); the seqlock's are not (unbounded, it ran past 10 minutes), so it runs with at most 4
/// preemptions (172,426 interleavings, about 10 s), under which each weakened variant fails.
const RING_PREEMPTIONS: Option<usize> = None;
const SEQLOCK_PREEMPTIONS: Option<usize> = Some(4);
const FLAG_PREEMPTIONS: Option<usize> = None;

/// The packet ring: `crates/ferroce/src/provider/shm/ring.rs`, `Ring::plausible` (lines 86-90),
/// `Producer::tail` (117-125), `Producer::need` (132-141), `Producer::push` (151-180) and
/// `Consumer::pop` (192-236), as of commit 560e1f0. Differences, none of which touches an
/// ordering: the ring's bytes are 8-byte words (`UnsafeCell<u64>`), so a record's 4-byte length
/// is its header word and a payload copy writes whole words (padding included); the shared
/// positions are loom atomics instead of `&*self.head`; the orderings are parameters
/// ([`RingOrders`]), [`RingOrders::SOURCE`] being the source's.
///
/// Scenario: a 40-byte ring (records of up to 10 bytes), one producer thread pushing three
/// packets (8, 5 and 8 bytes; the third needs a wrap marker at 32 and reuses bytes 0..16 of the
/// first record) and retrying while full, one consumer popping them and checking every byte.
mod ring {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::AtomicU64;
    use loom::sync::Arc;

    const WRAP: u32 = u32::MAX;
    const HEADER: usize = 8;

    /// The orderings of the four accesses to the shared positions.
    #[derive(Clone, Copy)]
    pub(super) struct RingOrders {
        /// `Producer::tail`'s load of the consumer's position.
        pub(super) producer_loads_tail: Ordering,
        /// `push`'s store of the new head.
        pub(super) producer_stores_head: Ordering,
        /// `pop`'s load of the producer's position.
        pub(super) consumer_loads_head: Ordering,
        /// `pop`'s stores of the new tail.
        pub(super) consumer_stores_tail: Ordering,
    }

    impl RingOrders {
        pub(super) const SOURCE: RingOrders = RingOrders {
            producer_loads_tail: Acquire,
            producer_stores_head: Release,
            consumer_loads_head: Acquire,
            consumer_stores_tail: Release,
        };
    }

    #[derive(Debug, PartialEq)]
    struct RingError;

    struct Shared {
        head: AtomicU64,
        tail: AtomicU64,
        data: Vec<UnsafeCell<u64>>,
    }

    #[derive(Clone)]
    struct Ring {
        shared: Arc<Shared>,
        size: usize,
        orders: RingOrders,
    }

    fn pad8(n: usize) -> usize {
        (n + 7) & !7
    }

    impl Ring {
        fn head(&self) -> &AtomicU64 {
            &self.shared.head
        }
        fn tail(&self) -> &AtomicU64 {
            &self.shared.tail
        }
        fn write_word(&self, at: usize, v: u64) {
            assert!(
                at % 8 == 0 && at < self.size,
                "write outside the ring at {at}"
            );
            // SAFETY: loom checks every access to the cell; a write concurrent with another
            // access fails the model before the pointer is used.
            self.shared.data[at / 8].with_mut(|p| unsafe { *p = v });
        }
        fn read_word(&self, at: usize) -> u64 {
            assert!(
                at % 8 == 0 && at < self.size,
                "read outside the ring at {at}"
            );
            // SAFETY: as in `write_word`.
            self.shared.data[at / 8].with(|p| unsafe { *p })
        }
        fn max_packet(&self) -> usize {
            self.size / 4
        }
        fn plausible(&self, behind: u64, ahead: u64) -> bool {
            (behind | ahead) % 8 == 0 && ahead >= behind && ahead - behind <= self.size as u64
        }
    }

    struct Producer {
        ring: Ring,
        head: u64,
    }

    impl Producer {
        fn tail(&self) -> Result<u64, RingError> {
            let tail = self.ring.tail().load(self.ring.orders.producer_loads_tail);
            if self.ring.plausible(tail, self.head) {
                Ok(tail)
            } else {
                Err(RingError)
            }
        }

        fn need(&self, len: usize) -> usize {
            let need = HEADER + pad8(len);
            let to_end = self.ring.size - (self.head as usize) % self.ring.size;
            if to_end < need {
                to_end + need
            } else {
                need
            }
        }

        fn push(&mut self, pkt: &[u8]) -> Result<bool, RingError> {
            let used = (self.head - self.tail()?) as usize;
            if pkt.len() > self.ring.max_packet() || self.ring.size - used < self.need(pkt.len()) {
                return Ok(false);
            }
            let size = self.ring.size;
            let mut at = (self.head as usize) % size;
            let need = HEADER + pad8(pkt.len());
            if size - at < need {
                self.ring.write_word(at, u64::from(WRAP));
                self.head += (size - at) as u64;
                at = 0;
            }
            self.ring.write_word(at, pkt.len() as u64);
            // `copy_nonoverlapping(pkt, data + at + HEADER, len)`, a word at a time.
            for (i, chunk) in pkt.chunks(8).enumerate() {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                self.ring
                    .write_word(at + HEADER + 8 * i, u64::from_le_bytes(word));
            }
            self.head += need as u64;
            self.ring
                .head()
                .store(self.head, self.ring.orders.producer_stores_head);
            Ok(true)
        }
    }

    struct Consumer {
        ring: Ring,
        tail: u64,
    }

    impl Consumer {
        fn pop(&mut self, out: &mut [u8]) -> Result<Option<usize>, RingError> {
            let orders = self.ring.orders;
            let size = self.ring.size;
            let head = self.ring.head().load(orders.consumer_loads_head);
            if !self.ring.plausible(self.tail, head) {
                return Err(RingError);
            }
            if head == self.tail {
                return Ok(None);
            }
            let mut tail = self.tail;
            let mut at = (tail as usize) % size;
            let mut len = self.ring.read_word(at) as u32;
            if len == WRAP {
                tail += (size - at) as u64;
                if tail > head {
                    return Err(RingError);
                }
                self.tail = tail;
                if tail == head {
                    self.ring.tail().store(tail, orders.consumer_stores_tail);
                    return Ok(None);
                }
                at = 0;
                len = self.ring.read_word(0) as u32;
            }
            let len = len as usize;
            let need = HEADER + pad8(len);
            if len > self.ring.max_packet()
                || len > out.len()
                || at + need > size
                || ((head - tail) as usize) < need
            {
                return Err(RingError);
            }
            // `copy_nonoverlapping(data + at + HEADER, out, len)`, a word at a time.
            for i in 0..pad8(len) / 8 {
                let word = self.ring.read_word(at + HEADER + 8 * i).to_le_bytes();
                let n = (len - 8 * i).min(8);
                out[8 * i..8 * i + n].copy_from_slice(&word[..n]);
            }
            self.tail = tail + need as u64;
            self.ring
                .tail()
                .store(self.tail, orders.consumer_stores_tail);
            Ok(Some(len))
        }
    }

    /// One execution of the scenario (see the module doc).
    pub(super) fn scenario(orders: RingOrders) {
        const SIZE: usize = 40;
        let packets: [&[u8]; 3] = [&[1; 8], &[2, 3, 4, 5, 6], &[7; 8]];
        let ring = Ring {
            shared: Arc::new(Shared {
                head: AtomicU64::new(0),
                tail: AtomicU64::new(0),
                data: (0..SIZE / 8).map(|_| UnsafeCell::new(0)).collect(),
            }),
            size: SIZE,
            orders,
        };
        // `Ring::producer`: starts from the page's head (0 here).
        let mut producer = Producer {
            ring: ring.clone(),
            head: 0,
        };
        let pusher = loom::thread::spawn(move || {
            for pkt in packets {
                while !producer.push(pkt).expect("an honest consumer never lies") {
                    loom::thread::yield_now();
                }
            }
        });
        let mut consumer = Consumer { ring, tail: 0 };
        let mut out = [0u8; 16];
        for pkt in packets {
            let n = loop {
                match consumer
                    .pop(&mut out)
                    .expect("an honest producer never lies")
                {
                    Some(n) => break n,
                    None => loom::thread::yield_now(),
                }
            };
            assert_eq!(&out[..n], pkt, "a packet came out changed");
        }
        pusher.join().unwrap();
    }
}

#[test]
fn ring_push_and_pop_race_on_no_byte() {
    explore("ring", RING_PREEMPTIONS, || {
        ring::scenario(ring::RingOrders::SOURCE)
    });
}

/// The consumer could read a record's bytes before the producer's writes of them are visible.
#[test]
#[should_panic(expected = "Causality violation")]
fn ring_with_a_relaxed_head_store_races() {
    explore(
        "ring_with_a_relaxed_head_store_races",
        RING_PREEMPTIONS,
        || {
            ring::scenario(ring::RingOrders {
                producer_stores_head: Relaxed,
                ..ring::RingOrders::SOURCE
            })
        },
    );
}

/// As above, from the consumer's side.
#[test]
#[should_panic(expected = "Causality violation")]
fn ring_with_a_relaxed_head_load_races() {
    explore(
        "ring_with_a_relaxed_head_load_races",
        RING_PREEMPTIONS,
        || {
            ring::scenario(ring::RingOrders {
                consumer_loads_head: Relaxed,
                ..ring::RingOrders::SOURCE
            })
        },
    );
}

/// The producer could overwrite the first record (the third packet reuses its bytes) while the
/// consumer still reads it.
#[test]
#[should_panic(expected = "Causality violation")]
fn ring_with_a_relaxed_tail_store_races() {
    explore(
        "ring_with_a_relaxed_tail_store_races",
        RING_PREEMPTIONS,
        || {
            ring::scenario(ring::RingOrders {
                consumer_stores_tail: Relaxed,
                ..ring::RingOrders::SOURCE
            })
        },
    );
}

/// As above, from the producer's side.
#[test]
#[should_panic(expected = "Causality violation")]
fn ring_with_a_relaxed_tail_load_races() {
    explore(
        "ring_with_a_relaxed_tail_load_races",
        RING_PREEMPTIONS,
        || {
            ring::scenario(ring::RingOrders {
                producer_loads_tail: Relaxed,
                ..ring::RingOrders::SOURCE
            })
        },
    );
}

/// The key table's seqlock: `crates/ferroce/src/provider/shm/pages.rs`, `KeyTable::publish`
/// (lines 139-158), `KeyTable::withdraw` (162-166), `KeyTable::write_slot` (170-182) and
/// `KeyTable::lookup` (202-230), as of commit 560e1f0. Differences: a slot has three of its
/// eight fields (key, addr, len; the other five are stored and loaded exactly as addr and len,
/// Relaxed); `lookup` tries 3 times instead of 1000 (fewer tries only make `None` likelier,
/// which the check accepts) and its `spin_loop` is loom's yield; the orderings and fences are
/// parameters ([`SeqOrders`]), [`SeqOrders::SOURCE`] being the source's.
///
/// Scenario: the slot starts at rest holding region A under key K (sequence 2); a writer
/// thread publishes region B under K (sequence 4) and then withdraws K (sequence 6) while a
/// reader looks K up twice. What `lookup` returns must be a state the slot was at rest in,
/// with that state's sequence number: (A, 2), (B, 4), or nothing. A torn read (fields of two
/// publishes, or B's fields under sequence 6, which `seq_at_rest`'s cache would then trust)
/// fails the model.
mod seqlock {
    use super::*;
    use loom::sync::atomic::{fence, AtomicU64};
    use loom::sync::Arc;

    /// `write_slot`'s and `lookup`'s orderings; a `None` fence is left out.
    #[derive(Clone, Copy)]
    pub(super) struct SeqOrders {
        /// `write_slot`'s fence after the odd sequence number.
        pub(super) writer_fence: Option<Ordering>,
        /// `write_slot`'s final (even) store.
        pub(super) writer_final_store: Ordering,
        /// `lookup`'s first load of the sequence number.
        pub(super) reader_first_load: Ordering,
        /// `lookup`'s fence before the re-check.
        pub(super) reader_fence: Option<Ordering>,
    }

    impl SeqOrders {
        pub(super) const SOURCE: SeqOrders = SeqOrders {
            writer_fence: Some(Release),
            writer_final_store: Release,
            reader_first_load: Acquire,
            reader_fence: Some(Acquire),
        };
    }

    const K: u32 = 0x0101;
    const A: Region = Region {
        key: K,
        addr: 0x1000,
        len: 100,
    };
    const B: Region = Region {
        key: K,
        addr: 0x2000,
        len: 200,
    };

    #[derive(Debug, Clone, Copy, PartialEq)]
    struct Region {
        key: u32,
        addr: u64,
        len: u64,
    }

    struct Slot {
        seq: AtomicU64,
        key: AtomicU64,
        addr: AtomicU64,
        len: AtomicU64,
    }

    struct KeyTable {
        slot: Slot,
        orders: SeqOrders,
    }

    impl KeyTable {
        fn publish(&self, r: &Region) {
            self.write_slot(|s| {
                s.key.store(u64::from(r.key), Relaxed);
                s.addr.store(r.addr, Relaxed);
                s.len.store(r.len, Relaxed);
            });
        }

        fn withdraw(&self) {
            self.write_slot(|s| s.key.store(0, Relaxed));
        }

        fn write_slot(&self, fill: impl FnOnce(&Slot)) {
            let seq = &self.slot.seq;
            let start = seq.load(Relaxed) | 1;
            seq.store(start, Relaxed);
            if let Some(o) = self.orders.writer_fence {
                fence(o);
            }
            fill(&self.slot);
            seq.store(start + 1, self.orders.writer_final_store);
        }

        fn lookup(&self, key: u32) -> Option<(Region, u64)> {
            let s = &self.slot;
            for _ in 0..3 {
                let before = s.seq.load(self.orders.reader_first_load);
                if before & 1 == 1 {
                    loom::hint::spin_loop();
                    continue;
                }
                let r = Region {
                    key: s.key.load(Relaxed) as u32,
                    addr: s.addr.load(Relaxed),
                    len: s.len.load(Relaxed),
                };
                if let Some(o) = self.orders.reader_fence {
                    fence(o);
                }
                if s.seq.load(Relaxed) == before {
                    return (r.key == key).then_some((r, before));
                }
            }
            None
        }
    }

    /// One execution of the scenario (see the module doc).
    pub(super) fn scenario(orders: SeqOrders) {
        let table = Arc::new(KeyTable {
            slot: Slot {
                seq: AtomicU64::new(2),
                key: AtomicU64::new(u64::from(A.key)),
                addr: AtomicU64::new(A.addr),
                len: AtomicU64::new(A.len),
            },
            orders,
        });
        let writer = {
            let table = table.clone();
            loom::thread::spawn(move || {
                table.publish(&B);
                table.withdraw();
            })
        };
        for _ in 0..2 {
            if let Some(got) = table.lookup(K) {
                assert!(
                    got == (A, 2) || got == (B, 4),
                    "lookup returned a torn slot: {got:?}"
                );
            }
        }
        writer.join().unwrap();
    }
}

#[test]
fn seqlock_lookup_never_returns_a_torn_slot() {
    explore("seqlock", SEQLOCK_PREEMPTIONS, || {
        seqlock::scenario(seqlock::SeqOrders::SOURCE)
    });
}

/// Without the fence a reader can see a field of B and still the sequence number before it.
#[test]
#[should_panic(expected = "torn slot")]
fn seqlock_without_the_readers_fence_tears() {
    explore(
        "seqlock_without_the_readers_fence_tears",
        SEQLOCK_PREEMPTIONS,
        || {
            seqlock::scenario(seqlock::SeqOrders {
                reader_fence: None,
                ..seqlock::SeqOrders::SOURCE
            })
        },
    );
}

/// Without the fence the odd sequence number need not be visible before the fields change.
#[test]
#[should_panic(expected = "torn slot")]
fn seqlock_without_the_writers_fence_tears() {
    explore(
        "seqlock_without_the_writers_fence_tears",
        SEQLOCK_PREEMPTIONS,
        || {
            seqlock::scenario(seqlock::SeqOrders {
                writer_fence: None,
                ..seqlock::SeqOrders::SOURCE
            })
        },
    );
}

/// A reader can see the new even sequence number and old fields.
#[test]
#[should_panic(expected = "torn slot")]
fn seqlock_with_a_relaxed_final_store_tears() {
    explore(
        "seqlock_with_a_relaxed_final_store_tears",
        SEQLOCK_PREEMPTIONS,
        || {
            seqlock::scenario(seqlock::SeqOrders {
                writer_final_store: Relaxed,
                ..seqlock::SeqOrders::SOURCE
            })
        },
    );
}

/// Data, then a flag, through `MemoryRegion::write` and `MemoryRegion::read`
/// (`crates/ferroce/src/verbs/mr.rs`, `read` and `write`): `write` starts with
/// `fence(Release)` before its copy and `read` ends with `fence(Acquire)` after its copy
/// (before issue #28 both had `compiler_fence`s only, which order nothing between threads:
/// [`flag_with_compiler_fences_only_races`] shows the race that left). Writing data then a flag
/// with two `write`s puts the flag's release fence between them; polling the flag with `read`s
/// and then reading the data puts the flag `read`'s acquire fence between the flag's load and
/// the data's. That is the protocol of perftest's latency loops and of any poller in the
/// writer's process. A direct WRITE (`shm::direct::move_one_sided`) fences as `write` does.
///
/// The data is two words of plain memory (`UnsafeCell`); the flag is an aligned 8-byte word,
/// which `copy_bytes` moves with one load or store: the model makes it a relaxed atomic (as
/// plain memory, loom would report the poller's reads of it racing with its write, which is
/// the point of a flag; the hardware gives an aligned word one access).
mod flag {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::atomic::{fence, AtomicU64};
    use loom::sync::Arc;

    struct Region {
        data: [UnsafeCell<u64>; 2],
        flag: AtomicU64,
        /// The fences `write` and `read` make (`None`: a compiler fence, nothing at run time).
        fences: Option<(Ordering, Ordering)>,
    }

    impl Region {
        /// `MemoryRegion::write` of the data: the fence, then the copy.
        fn write_data(&self, v: [u64; 2]) {
            if let Some((release, _)) = self.fences {
                fence(release);
            }
            for (cell, v) in self.data.iter().zip(v) {
                // SAFETY: loom checks every access to the cell and fails the model on a
                // concurrent one before the pointer is used.
                cell.with_mut(|p| unsafe { *p = v });
            }
        }

        /// `MemoryRegion::write` of the flag: the fence, then the store.
        fn write_flag(&self, v: u64) {
            if let Some((release, _)) = self.fences {
                fence(release);
            }
            self.flag.store(v, Relaxed);
        }

        /// `MemoryRegion::read` of the flag: the load, then the fence.
        fn read_flag(&self) -> u64 {
            let v = self.flag.load(Relaxed);
            if let Some((_, acquire)) = self.fences {
                fence(acquire);
            }
            v
        }

        /// `MemoryRegion::read` of the data: the copy, then the fence.
        fn read_data(&self) -> [u64; 2] {
            // SAFETY: as in `write_data`.
            let v = [0, 1].map(|i| self.data[i].with(|p| unsafe { *p }));
            if let Some((_, acquire)) = self.fences {
                fence(acquire);
            }
            v
        }
    }

    /// A writer stores the data then the flag; a poller waits for the flag and reads the data.
    pub(super) fn scenario(fences: Option<(Ordering, Ordering)>) {
        let region = Arc::new(Region {
            data: [UnsafeCell::new(0), UnsafeCell::new(0)],
            flag: AtomicU64::new(0),
            fences,
        });
        let writer = {
            let region = region.clone();
            loom::thread::spawn(move || {
                region.write_data([11, 22]);
                region.write_flag(1);
            })
        };
        while region.read_flag() != 1 {
            loom::thread::yield_now();
        }
        assert_eq!(
            region.read_data(),
            [11, 22],
            "the flag came before its data"
        );
        writer.join().unwrap();
    }
}

#[test]
fn flag_after_data_orders_the_data() {
    explore("flag", FLAG_PREEMPTIONS, || {
        flag::scenario(Some((Release, Acquire)))
    });
}

/// Compiler fences only (the code before issue #28): the poller can see the flag and read the
/// data racing with its write.
#[test]
#[should_panic(expected = "Causality violation")]
fn flag_with_compiler_fences_only_races() {
    explore(
        "flag_with_compiler_fences_only_races",
        FLAG_PREEMPTIONS,
        || flag::scenario(None),
    );
}
