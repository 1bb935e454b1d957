//! A model of the header and credit words (`comm/mod.rs`'s "Memory ordering") under loom, which
//! runs a sender and a receiver thread through every interleaving and every value the memory
//! model lets a load see, and fails on a data race on the slots' bytes. The sender copies a
//! message into a slot (two plain words, a message's first and last bytes) and stores the
//! slot's header word; the receiver polls the header, reads the slot, and stores its consumed
//! count into the credit word, which the sender polls before it writes a slot again. Two slots
//! and three messages, so a slot is reused. With release stores and acquire loads (what the
//! communicator does) no interleaving races or sees a torn message; with relaxed ones loom
//! finds the race.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p ferroce-coll --test loom_words --release`
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicU64, Ordering};
use loom::sync::Arc;

const SLOTS: u64 = 2;
const MESSAGES: u64 = 3;

struct Peer {
    /// Each slot's bytes: a message's first and last word.
    slots: [(UnsafeCell<u64>, UnsafeCell<u64>); SLOTS as usize],
    /// A header word per slot: `index + 1` of the message in it.
    headers: [AtomicU64; SLOTS as usize],
    /// Messages the receiver consumed.
    credit: AtomicU64,
}

/// The model with the header word's store and load orderings, then the credit word's.
fn model(header: (Ordering, Ordering), credit: (Ordering, Ordering)) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(3);
    builder.check(move || {
        let peer = Arc::new(Peer {
            slots: [
                (UnsafeCell::new(0), UnsafeCell::new(0)),
                (UnsafeCell::new(0), UnsafeCell::new(0)),
            ],
            headers: [AtomicU64::new(0), AtomicU64::new(0)],
            credit: AtomicU64::new(0),
        });
        let sender = {
            let peer = peer.clone();
            loom::thread::spawn(move || {
                for i in 0..MESSAGES {
                    // `credit_available`: at most SLOTS messages unconsumed.
                    while i - peer.credit.load(credit.1) >= SLOTS {
                        loom::thread::yield_now();
                    }
                    let slot = &peer.slots[(i % SLOTS) as usize];
                    // SAFETY: that no read of the slot is concurrent with these writes is
                    // the property under test: loom tracks every access to the cells and
                    // fails the model on a concurrent one, before the raw pointer is used.
                    slot.0.with_mut(|p| unsafe { *p = 100 + i });
                    slot.1.with_mut(|p| unsafe { *p = 200 + i });
                    peer.headers[(i % SLOTS) as usize].store(i + 1, header.0);
                }
            })
        };
        for i in 0..MESSAGES {
            // `next_arrival`: the slot's header says message `i` is in it.
            while peer.headers[(i % SLOTS) as usize].load(header.1) != i + 1 {
                loom::thread::yield_now();
            }
            let slot = &peer.slots[(i % SLOTS) as usize];
            // SAFETY: as for the sender's writes: loom fails the model on a write concurrent
            // with these reads.
            let first = slot.0.with(|p| unsafe { *p });
            let last = slot.1.with(|p| unsafe { *p });
            assert_eq!((first, last), (100 + i, 200 + i), "message {i} torn");
            // `send_credit`: the slot is free.
            peer.credit.store(i + 1, credit.0);
        }
        sender.join().unwrap();
    });
}

const ORDERED: (Ordering, Ordering) = (Ordering::Release, Ordering::Acquire);
const RELAXED: (Ordering, Ordering) = (Ordering::Relaxed, Ordering::Relaxed);

#[test]
fn release_stores_and_acquire_loads_order_the_slots() {
    model(ORDERED, ORDERED);
}

/// The receiver could read a slot before the sender's copy into it is visible.
#[test]
#[should_panic(expected = "Causality violation")]
fn a_relaxed_header_word_races_on_the_slot() {
    model(RELAXED, ORDERED);
}

/// The sender could write a slot again while the receiver still reads it.
#[test]
#[should_panic(expected = "Causality violation")]
fn a_relaxed_credit_word_races_on_the_slot() {
    model(ORDERED, RELAXED);
}
