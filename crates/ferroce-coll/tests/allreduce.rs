//! Allreduce and barrier between ranks that are threads of this process, each with its own
//! ferroce context (shared memory between them, or UDP), over the real rendezvous: every type
//! and operator at sizes 0, 1, odd and larger than a segment, 1 to 5 ranks, each element
//! checked on every rank; a rank that leaves makes the others fail within the deadline.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use ferroce::Provider;
use ferroce_coll::{reduce_into, CommOptions, Communicator, DataType, ReduceOp, Store};

fn options(provider: Provider, segment_bytes: usize, timeout: Duration) -> CommOptions {
    CommOptions {
        timeout,
        segment_bytes,
        provider,
        device: Some("lo".into()),
    }
}

/// Runs `body` on `n` ranks (threads), each with a communicator; returns their results.
fn with_ranks<R: Send + 'static>(
    n: usize,
    opts: CommOptions,
    body: impl Fn(Communicator) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let master = listener.local_addr().unwrap();
    let mut listener = Some(listener);
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let (body, opts) = (body.clone(), opts.clone());
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

/// Rank `rank`'s input: small values, so that sums and products of up to 5 ranks are exact in
/// every type (the ring adds in another order than a plain loop would).
fn input(t: DataType, rank: usize, elems: usize) -> Vec<u8> {
    let mut v = vec![0u8; elems * t.size()];
    for (i, e) in v.chunks_mut(t.size()).enumerate() {
        let x = ((i * 7 + rank * 3) % 4 + 1) as u8;
        match t {
            DataType::I32 => e.copy_from_slice(&i32::from(x).to_ne_bytes()),
            DataType::I64 => e.copy_from_slice(&i64::from(x).to_ne_bytes()),
            DataType::U8 => e[0] = x,
            DataType::F32 => e.copy_from_slice(&f32::from(x).to_ne_bytes()),
            DataType::F64 => e.copy_from_slice(&f64::from(x).to_ne_bytes()),
            DataType::F16 => e.copy_from_slice(&half::f16::from(x).to_ne_bytes()),
            DataType::Bf16 => e.copy_from_slice(&half::bf16::from(x).to_ne_bytes()),
        }
    }
    v
}

fn expected(t: DataType, op: ReduceOp, n: usize, elems: usize) -> Vec<u8> {
    let mut acc = input(t, 0, elems);
    for r in 1..n {
        reduce_into(&mut acc, &input(t, r, elems), t, op).unwrap();
    }
    if op == ReduceOp::Avg {
        ferroce_coll::finish_avg(&mut acc, t, n).unwrap();
    }
    acc
}

fn every_type_operator_and_size(provider: Provider) {
    for n in 1..=5usize {
        let results = with_ranks(
            n,
            options(provider, 4096, Duration::from_secs(20)),
            move |mut comm| {
                let mut bad = Vec::new();
                for t in DataType::ALL {
                    for op in ReduceOp::ALL {
                        // 0, 1, odd, and more than one 4 KiB segment of every type.
                        for elems in [0usize, 1, 13, 4099] {
                            let mut buf = input(t, comm.rank(), elems);
                            comm.allreduce(&mut buf, t, op).unwrap();
                            if buf != expected(t, op, comm.size(), elems) {
                                bad.push(format!("{t} {op} {elems}"));
                            }
                        }
                    }
                }
                comm.barrier().unwrap();
                bad
            },
        );
        for (rank, bad) in results.iter().enumerate() {
            assert!(bad.is_empty(), "{n} ranks, rank {rank}: wrong {bad:?}");
        }
    }
}

#[test]
fn every_type_operator_and_size_over_shared_memory() {
    every_type_operator_and_size(Provider::Shm);
}

#[test]
fn every_type_operator_and_size_over_udp() {
    every_type_operator_and_size(Provider::Udp);
}

/// 8 MiB of f32 over 3 ranks in 1 MiB segments: every element checked.
#[test]
fn a_large_allreduce_in_segments() {
    let elems = (8 << 20) / 4 + 3;
    let results = with_ranks(
        3,
        options(Provider::Auto, 1 << 20, Duration::from_secs(20)),
        move |mut comm| {
            let mut buf = input(DataType::F32, comm.rank(), elems);
            comm.allreduce(&mut buf, DataType::F32, ReduceOp::Sum)
                .unwrap();
            buf == expected(DataType::F32, ReduceOp::Sum, 3, elems)
        },
    );
    assert_eq!(results, [true, true, true]);
}

/// A rank that leaves before the allreduce: the others fail within the deadline, not hang.
#[test]
fn a_rank_that_leaves_fails_the_others_within_the_deadline() {
    let timeout = Duration::from_secs(3);
    let results = with_ranks(
        3,
        options(Provider::Auto, 4096, timeout),
        move |mut comm| {
            if comm.rank() == 2 {
                drop(comm);
                return Ok(Duration::ZERO);
            }
            let started = Instant::now();
            let mut buf = input(DataType::F32, comm.rank(), 1000);
            comm.allreduce(&mut buf, DataType::F32, ReduceOp::Sum)
                .map(|_| started.elapsed())
                .map_err(|e| (e.to_string(), started.elapsed()))
        },
    );
    for (rank, r) in results.iter().enumerate().take(2) {
        match r {
            Err((_, took)) => assert!(*took < timeout * 3, "rank {rank} took {took:?}"),
            Ok(_) => panic!("rank {rank}'s allreduce succeeded without rank 2"),
        }
    }
}

/// Allgather and reduce-scatter, interleaved with allreduces (they share the regions), every
/// block size from 0 to several segments, 1 to 4 ranks, both providers.
#[test]
fn allgather_and_reduce_scatter_interleaved_with_allreduce() {
    for provider in [Provider::Shm, Provider::Udp] {
        for n in 1..=4usize {
            let results = with_ranks(
                n,
                options(provider, 4096, Duration::from_secs(20)),
                move |mut comm| {
                    let (rank, n) = (comm.rank(), comm.size());
                    let mut bad = Vec::new();
                    for elems in [0usize, 1, 5, 3001] {
                        let t = DataType::F32;
                        // allgather: block i is rank i's input.
                        let mine = input(t, rank, elems);
                        let mut all = vec![0u8; mine.len() * n];
                        comm.allgather(&mine, &mut all).unwrap();
                        let want: Vec<u8> = (0..n).flat_map(|r| input(t, r, elems)).collect();
                        if all != want {
                            bad.push(format!("allgather {elems}"));
                        }
                        // An allreduce between, on the same regions.
                        let mut buf = input(t, rank, elems);
                        comm.allreduce(&mut buf, t, ReduceOp::Sum).unwrap();
                        if buf != expected(t, ReduceOp::Sum, n, elems) {
                            bad.push(format!("allreduce {elems}"));
                        }
                        // reduce_scatter: rank r's input is n blocks; it keeps block r of the sum.
                        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg] {
                            let inp: Vec<u8> =
                                (0..n).flat_map(|b| input(t, rank * 7 + b, elems)).collect();
                            let mut out = vec![0u8; elems * t.size()];
                            comm.reduce_scatter(&inp, &mut out, t, op).unwrap();
                            let mut acc = input(t, rank, elems);
                            for r in 0..n {
                                let part = input(t, r * 7 + rank, elems);
                                if r == 0 {
                                    acc = part;
                                } else {
                                    reduce_into(&mut acc, &part, t, op).unwrap();
                                }
                            }
                            if op == ReduceOp::Avg {
                                ferroce_coll::finish_avg(&mut acc, t, n).unwrap();
                            }
                            if out != acc {
                                bad.push(format!("reduce_scatter {op} {elems}"));
                            }
                        }
                    }
                    // Sizes that do not fit are refused.
                    let mut out = vec![0u8; 3];
                    if n > 1 && comm.allgather(&[1, 2], &mut out).is_ok() {
                        bad.push("allgather accepted a wrong output size".into());
                    }
                    comm.barrier().unwrap();
                    bad
                },
            );
            for (rank, bad) in results.iter().enumerate() {
                assert!(
                    bad.is_empty(),
                    "{provider:?} {n} ranks, rank {rank}: wrong {bad:?}"
                );
            }
        }
    }
}
