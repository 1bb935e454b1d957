//! A lock for data held for short moments by a few threads of one process: a queue pair's
//! transport state, taken by every post and by the engine.
//!
//! Why not `std::sync::Mutex`: its release is an atomic exchange (it must learn whether a
//! sleeper waits), a second locked instruction per critical section. Over shared memory a
//! one-sided post is a few dozen nanoseconds of work, and those two locked instructions were a
//! third of it (`cargo run --release -p ferroce --example post_cost`). Here the release is a
//! plain store; a thread that finds the lock taken spins a little, then yields its CPU until the
//! holder is done, so a holder preempted on a busy machine gets the CPU back. Holders never
//! block while holding it (no I/O, no other lock that may wait long), which is what makes
//! spinning acceptable. There is no poisoning: a panic while holding it releases it, and the
//! data stays as consistent as the panicking code left it (as callers of the std mutex here
//! already assumed, taking its data out of any poison error).

use std::cell::UnsafeCell;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};

/// How many times a waiter re-reads the lock before it starts yielding its CPU.
const SPINS_BEFORE_YIELD: u32 = 64;

/// A mutual-exclusion lock whose waiters spin, then yield (see the module doc).
pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock hands out access to `value` to one thread at a time (the guard exists only
// while `locked` was won by that thread), so sharing the lock shares `T` only by moving access
// between threads, which `T: Send` permits.
unsafe impl<T: Send> Sync for SpinLock<T> {}
// SAFETY: moving the lock moves the `T` it owns.
unsafe impl<T: Send> Send for SpinLock<T> {}

impl<T> SpinLock<T> {
    /// A lock around `value`, not held.
    pub(crate) fn new(value: T) -> SpinLock<T> {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    /// Takes the lock, waiting for the holder if there is one.
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        if self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        SpinGuard {
            lock: self,
            access: PhantomData,
        }
    }

    #[cold]
    fn lock_contended(&self) {
        let mut spins = 0u32;
        loop {
            // Wait reading, not writing: a locked instruction per spin would pull the line away
            // from the holder over and over.
            while self.locked.load(Ordering::Relaxed) {
                if spins < SPINS_BEFORE_YIELD {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
            if self
                .locked
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return;
            }
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for SpinLock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Reading the value would need the lock; say only whether it is held.
        f.debug_struct("SpinLock")
            .field("locked", &self.locked.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// Access to a [`SpinLock`]'s value; dropping it releases the lock.
///
/// Which threads may hold or share a guard is decided by its fields, with no `unsafe impl`:
/// - `lock` alone is `Send` and `Sync` for any `T: Send` (the lock's own impls), and would give
///   the guard those too. That is too much for `Sync`: a `&SpinGuard` shared with other threads
///   hands each of them a `&T` at once through [`Deref`], so for `T: Send + !Sync` (a `Cell`, a
///   `RefCell`) two threads could mutate the same value through shared references without
///   synchronisation — a data race in safe code.
/// - `access` says what the guard really is, exclusive access to the value: `&mut T` is `Sync`
///   only for `T: Sync` and `Send` only for `T: Send`. So a guard is `Sync` iff `T: Send + Sync`
///   (std's `MutexGuard` asks `T: Sync`), and `Send` iff `T: Send`. Sending a guard is sound
///   here, unlike std's: releasing is a plain atomic store, which any thread may do, and moving
///   the guard moves the exclusive access, which `T: Send` permits.
pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
    access: PhantomData<&'a mut T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: this guard exists only while its thread holds the lock, so no other reference
        // to the value is live.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn threads_adding_under_the_lock_lose_no_update() {
        // A non-atomic read-modify-write under the lock: without mutual exclusion, increments
        // from the four threads would overwrite each other and the total would fall short.
        let lock = Arc::new(SpinLock::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let lock = Arc::clone(&lock);
                std::thread::spawn(move || {
                    for _ in 0..50_000 {
                        let mut g = lock.lock();
                        let v = *g;
                        std::hint::black_box(&v);
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*lock.lock(), 200_000);
    }

    /// Compiles only while `T` is not `Sync`: with a second, `Sync`-only impl in play, naming
    /// the method is ambiguous and the build fails (the usual stable-Rust negative check).
    trait AmbiguousIfSync<A> {
        fn not_sync() {}
    }
    impl<T: ?Sized> AmbiguousIfSync<()> for T {}
    impl<T: ?Sized + Sync> AmbiguousIfSync<u8> for T {}

    fn is_send<T: Send>() {}
    fn is_sync<T: Sync>() {}

    #[test]
    fn a_guard_is_shared_between_threads_only_when_its_value_may_be() {
        // A guard's `Deref` gives every thread that shares `&guard` a `&T`: for a `Cell` that
        // would be unsynchronised mutation from two threads. Before the guard's `access`
        // marker this line did not compile (the guard was `Sync` for any `T: Send`).
        let _ = <SpinGuard<'static, std::cell::Cell<u64>> as AmbiguousIfSync<_>>::not_sync;
        // What stays allowed: sharing a guard of a `Sync` value, and handing a guard (exclusive
        // access) to another thread for a `Send` one.
        is_sync::<SpinGuard<'static, u64>>();
        is_send::<SpinGuard<'static, std::cell::Cell<u64>>>();
    }

    #[test]
    fn a_panic_while_holding_releases_the_lock() {
        let lock = Arc::new(SpinLock::new(vec![1u8]));
        let l2 = Arc::clone(&lock);
        let r = std::thread::spawn(move || {
            let mut g = l2.lock();
            g.push(2);
            panic!("holder fails");
        })
        .join();
        assert!(r.is_err());
        assert_eq!(*lock.lock(), vec![1, 2]);
    }
}
