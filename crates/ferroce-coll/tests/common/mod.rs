//! Ranks as threads of one process, each with its own ferroce context, over the real
//! rendezvous, with slots small enough that small sizes take every path.

#![allow(dead_code)] // each test file uses its part

use std::net::TcpListener;
use std::time::Duration;

use ferroce::Provider;
use ferroce_coll::{CommOptions, Communicator, Store};

/// A slot of 4 KiB and small messages up to 2 KiB, so that small sizes already take every
/// path: recursive doubling, ring, several slices per chunk, credits running out (2 slots).
pub const SLOT: usize = 4096;

/// Options for a test communicator: small slots (two of them), on `lo`.
pub fn options(provider: Provider, timeout: Duration) -> CommOptions {
    CommOptions {
        timeout,
        slot_bytes: SLOT,
        slots: 2,
        small_bytes: SLOT / 2,
        provider,
        device: Some("lo".into()),
    }
}

/// Runs `body` on `n` ranks (threads), rank `r` with `opts(r)`; returns their results.
pub fn with_ranks<R: Send + 'static>(
    n: usize,
    opts: impl Fn(usize) -> CommOptions,
    body: impl Fn(Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let master = listener.local_addr().unwrap();
    let mut listener = Some(listener);
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let (body, opts) = (body.clone(), opts(rank));
            let l = if rank == 0 { listener.take() } else { None };
            std::thread::spawn(move || {
                let store = match l {
                    Some(l) => Store::serve(l, n, opts.timeout).unwrap(),
                    None => Store::connect(master, rank, n, opts.timeout).unwrap(),
                };
                let comm = Communicator::with_store(store, master, &opts).unwrap();
                body(comm)
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}
