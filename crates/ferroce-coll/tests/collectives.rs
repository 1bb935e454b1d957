//! Every collective between ranks that are threads of this process, each with its own ferroce
//! context, over the real rendezvous: every operation, type and operator at sizes 0, 1, odd,
//! a slot less one element, a slot and one element, and several slots, on 1 to 5 ranks, over
//! shared memory, over UDP, and mixed in one communicator; every element checked on every
//! rank. Then 64 MiB, mismatched calls, a rank that leaves, and split communicators.

use std::time::{Duration, Instant};

use ferroce::Provider;
use ferroce_coll::{reduce_into, CollError, CommOptions, Communicator, DataType, ReduceOp};

mod common;
use common::{options, with_ranks, SLOT};

/// Element `i` of input stream `seed`: small values, so that sums and products of up to 5
/// ranks are exact in every type whatever order the algorithm adds them in.
fn input(t: DataType, seed: usize, elems: usize) -> Vec<u8> {
    let mut v = vec![0u8; elems * t.size()];
    for (i, e) in v.chunks_mut(t.size()).enumerate() {
        let x = ((i * 7 + seed * 3) % 4 + 1) as u8;
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

/// The reduction of streams `seeds` with `op`.
fn reduced(t: DataType, op: ReduceOp, seeds: impl Iterator<Item = usize>, elems: usize) -> Vec<u8> {
    let mut acc: Option<Vec<u8>> = None;
    let mut n = 0;
    for s in seeds {
        n += 1;
        let v = input(t, s, elems);
        match &mut acc {
            None => acc = Some(v),
            Some(a) => reduce_into(a, &v, t, op).unwrap(),
        }
    }
    let mut acc = acc.unwrap_or_default();
    if op == ReduceOp::Avg {
        ferroce_coll::finish_avg(&mut acc, t, n).unwrap();
    }
    acc
}

/// Element counts: 0, 1, odd, a slot less one element, a slot and one, several slots.
fn sizes(t: DataType) -> [usize; 6] {
    let slot = SLOT / t.size();
    [0, 1, 13, slot - 1, slot + 1, 5 * slot + 7]
}

/// Runs every collective on `comm` and returns what came out wrong.
fn every_collective(comm: &mut Communicator) -> Vec<String> {
    let (rank, n) = (comm.rank(), comm.size());
    let mut bad = Vec::new();
    let mut check = |ok: bool, what: String| {
        if !ok {
            bad.push(what)
        }
    };
    for t in DataType::ALL {
        for elems in sizes(t) {
            for op in ReduceOp::ALL {
                let want = reduced(t, op, 0..n, elems);
                // allreduce, in place and out of place.
                let mut buf = input(t, rank, elems);
                comm.allreduce(&mut buf, t, op).unwrap();
                check(buf == want, format!("allreduce {t} {op} {elems}"));
                let mut out = vec![0u8; buf.len()];
                comm.allreduce_into(&input(t, rank, elems), &mut out, t, op)
                    .unwrap();
                check(out == want, format!("allreduce_into {t} {op} {elems}"));
                // reduce to a root that moves with the size.
                let root = elems % n;
                let mut out = vec![0xeeu8; buf.len()];
                comm.reduce(&input(t, rank, elems), &mut out, t, op, root)
                    .unwrap();
                if rank == root {
                    check(out == want, format!("reduce {t} {op} {elems} root {root}"));
                } else {
                    check(
                        out.iter().all(|&b| b == 0xee),
                        format!("reduce {t} {op} {elems}: a non-root's output was written"),
                    );
                }
                // reduce_scatter: rank r's block b is stream r·7 + b; it keeps block `rank`.
                let inp: Vec<u8> = (0..n).flat_map(|b| input(t, rank * 7 + b, elems)).collect();
                let mut out = vec![0u8; elems * t.size()];
                comm.reduce_scatter(&inp, &mut out, t, op).unwrap();
                let want = reduced(t, op, (0..n).map(|r| r * 7 + rank), elems);
                check(out == want, format!("reduce_scatter {t} {op} {elems}"));
            }
        }
    }
    for elems in sizes(DataType::U8) {
        let t = DataType::U8;
        // allgather: block i is rank i's input.
        let mine = input(t, rank, elems);
        let mut all = vec![0u8; mine.len() * n];
        comm.allgather(&mine, &mut all).unwrap();
        let want: Vec<u8> = (0..n).flat_map(|r| input(t, r, elems)).collect();
        check(all == want, format!("allgather {elems}"));
        // broadcast from every root, in place and out of place.
        for root in 0..n {
            let mut buf = if rank == root {
                input(t, 100 + root, elems)
            } else {
                vec![0u8; elems]
            };
            comm.broadcast(&mut buf, root).unwrap();
            check(
                buf == input(t, 100 + root, elems),
                format!("broadcast {elems} root {root}"),
            );
            let mut out = vec![0u8; elems];
            comm.broadcast_into(&input(t, 200 + root, elems), &mut out, root)
                .unwrap();
            check(
                out == input(t, 200 + root, elems),
                format!("broadcast_into {elems} root {root}"),
            );
        }
        // alltoall: rank r's block j is stream 10·r + j; block i of the output is rank i's
        // block `rank`.
        let inp: Vec<u8> = (0..n)
            .flat_map(|j| input(t, 10 * rank + j, elems))
            .collect();
        let mut out = vec![0u8; inp.len()];
        comm.alltoall(&inp, &mut out).unwrap();
        let want: Vec<u8> = (0..n)
            .flat_map(|i| input(t, 10 * i + rank, elems))
            .collect();
        check(out == want, format!("alltoall {elems}"));
        // Point to point round the ring: send right, receive from the left, at once.
        if n > 1 {
            let (right, left) = ((rank + 1) % n, (rank + n - 1) % n);
            let mut got = vec![0u8; elems];
            comm.sendrecv(&input(t, 300 + rank, elems), right, &mut got, left)
                .unwrap();
            check(
                got == input(t, 300 + left, elems),
                format!("sendrecv {elems}"),
            );
            // And one way: even ranks send to the next odd one.
            if rank % 2 == 0 && rank + 1 < n {
                comm.send(&input(t, 400 + rank, elems), rank + 1).unwrap();
            } else if rank % 2 == 1 {
                let mut got = vec![0u8; elems];
                comm.recv(&mut got, rank - 1).unwrap();
                check(
                    got == input(t, 400 + rank - 1, elems),
                    format!("send/recv {elems}"),
                );
            }
        }
    }
    comm.barrier().unwrap();
    bad
}

fn every_collective_on(provider: impl Fn(usize) -> Provider + Clone) {
    for n in 1..=5usize {
        let p = provider.clone();
        let results = with_ranks(
            n,
            move |r| options(p(r), Duration::from_secs(20)),
            |mut comm| every_collective(&mut comm),
        );
        for (rank, bad) in results.iter().enumerate() {
            assert!(bad.is_empty(), "{n} ranks, rank {rank}: wrong {bad:?}");
        }
    }
}

#[test]
fn every_collective_type_operator_and_size_over_shared_memory() {
    every_collective_on(|_| Provider::Shm);
}

#[test]
fn every_collective_type_operator_and_size_over_udp() {
    every_collective_on(|_| Provider::Udp);
}

/// Odd ranks speak only UDP, so one communicator has shared-memory pairs (even–even) and UDP
/// pairs (any pair with an odd rank).
#[test]
fn every_collective_with_shared_memory_and_udp_mixed_in_one_communicator() {
    let results = with_ranks(
        5,
        |r| {
            options(
                if r % 2 == 1 {
                    Provider::Udp
                } else {
                    Provider::Auto
                },
                Duration::from_secs(20),
            )
        },
        |mut comm| {
            let providers: Vec<_> = (0..comm.size()).map(|p| comm.provider_to(p)).collect();
            (providers, every_collective(&mut comm))
        },
    );
    for (rank, (providers, bad)) in results.iter().enumerate() {
        for (p, got) in providers.iter().enumerate() {
            let shared = if rank % 2 == 0 && p % 2 == 0 {
                Provider::Shm
            } else {
                Provider::Udp
            };
            let want = (p != rank).then_some(shared);
            assert_eq!(*got, want, "rank {rank} to rank {p}");
        }
        assert!(bad.is_empty(), "rank {rank}: wrong {bad:?}");
    }
}

/// 64 MiB of f32 (and an odd element more), every element checked: 3 ranks over shared
/// memory, 2 over UDP.
#[test]
fn sixty_four_mib_allreduce() {
    let elems = (64 << 20) / 4 + 1;
    for (n, provider) in [(3, Provider::Shm), (2, Provider::Udp)] {
        let results = with_ranks(
            n,
            move |_| CommOptions {
                provider,
                device: Some("lo".into()),
                timeout: Duration::from_secs(60),
                ..CommOptions::default()
            },
            move |mut comm| {
                let mut buf = input(DataType::F32, comm.rank(), elems);
                comm.allreduce(&mut buf, DataType::F32, ReduceOp::Sum)
                    .unwrap();
                buf == reduced(DataType::F32, ReduceOp::Sum, 0..comm.size(), elems)
            },
        );
        assert!(results.iter().all(|&ok| ok), "{provider:?}: {results:?}");
    }
}

/// Ranks that call with different sizes, types or collectives fail with an error (the
/// mismatch where it is seen, the peer's abort elsewhere), never hang or mix data; the
/// communicator then refuses further calls.
#[test]
fn mismatched_calls_fail_on_every_rank() {
    for case in 0..3 {
        let results = with_ranks(
            3,
            |_| options(Provider::Auto, Duration::from_secs(10)),
            move |mut comm| {
                let started = Instant::now();
                let rank = comm.rank();
                let t = DataType::F32;
                let r = match (case, rank) {
                    // Another size on rank 1.
                    (0, 1) => comm.allreduce(&mut input(t, rank, 999), t, ReduceOp::Sum),
                    (0, _) => comm.allreduce(&mut input(t, rank, 1000), t, ReduceOp::Sum),
                    // Another type on rank 2.
                    (1, 2) => {
                        comm.allreduce(&mut input(t, rank, 1000), DataType::I32, ReduceOp::Sum)
                    }
                    (1, _) => comm.allreduce(&mut input(t, rank, 1000), t, ReduceOp::Sum),
                    // Another collective on rank 0.
                    (_, 0) => comm.broadcast(&mut input(t, rank, 1000), 0),
                    _ => comm.allreduce(&mut input(t, rank, 1000), t, ReduceOp::Sum),
                };
                let later = comm.barrier();
                let took = started.elapsed();
                (
                    r.map_err(|e| e.to_string()),
                    later.map_err(|e| e.to_string()),
                    took,
                )
            },
        );
        let mut mismatch_seen = false;
        for (rank, (r, later, took)) in results.iter().enumerate() {
            let later = later
                .as_ref()
                .expect_err("a call after a failed one succeeded");
            match r {
                Err(e) => {
                    mismatch_seen |= e.contains("different collective");
                    assert!(
                        e.contains("different collective") || e.contains("aborted"),
                        "case {case} rank {rank}: {e}"
                    );
                    assert!(later.contains("broken"), "case {case} rank {rank}: {later}");
                }
                // A rank that only sends (a broadcast's root) cannot see how its peers took
                // the data; it learns of their failure at its next call.
                Ok(()) => assert!(
                    later.contains("aborted") || later.contains("broken"),
                    "case {case} rank {rank}: {later}"
                ),
            }
            assert!(
                *took < Duration::from_secs(5),
                "case {case} rank {rank} took {took:?}"
            );
        }
        assert!(mismatch_seen, "case {case}: no rank saw the mismatch");
    }
}

/// A rank that leaves before the allreduce: the others fail within the deadline, not hang.
#[test]
fn a_rank_that_leaves_fails_the_others_within_the_deadline() {
    let timeout = Duration::from_secs(3);
    for provider in [Provider::Shm, Provider::Udp] {
        let results = with_ranks(
            3,
            move |_| options(provider, timeout),
            move |mut comm| {
                if comm.rank() == 2 {
                    drop(comm);
                    return Ok(Duration::ZERO);
                }
                let started = Instant::now();
                let mut buf = input(DataType::F32, comm.rank(), 100_000);
                comm.allreduce(&mut buf, DataType::F32, ReduceOp::Sum)
                    .map(|_| started.elapsed())
                    .map_err(|e| (e.to_string(), started.elapsed()))
            },
        );
        for (rank, r) in results.iter().enumerate().take(2) {
            match r {
                Err((_, took)) => assert!(*took < timeout * 2, "rank {rank} took {took:?}"),
                Ok(_) => panic!("{provider:?}: rank {rank}'s allreduce succeeded without rank 2"),
            }
        }
    }
}

/// A receive from any rank takes the first send of its length, says whose it is, and leaves a
/// rank's message of another length (another call) for the receive that names it: rank 1 sends
/// 100 bytes and then 64, rank 2 sends 64 after a while, and rank 0 asks three times.
#[test]
fn a_receive_from_any_rank_takes_the_first_send_of_its_length() {
    for provider in [Provider::Shm, Provider::Udp] {
        let results = with_ranks(
            3,
            move |_| options(provider, Duration::from_secs(10)),
            move |mut comm| -> Result<Vec<(usize, Vec<u8>)>, String> {
                let e = |e: CollError| e.to_string();
                match comm.rank() {
                    0 => {
                        let mut got = Vec::new();
                        let mut a = vec![0u8; 64];
                        let from = comm.recv_any(&mut a).map_err(e)?;
                        got.push((from, a));
                        let mut long = vec![0u8; 100];
                        comm.recv(&mut long, 1).map_err(e)?;
                        got.push((1, long));
                        let mut b = vec![0u8; 64];
                        let from = comm.recv_any(&mut b).map_err(e)?;
                        got.push((from, b));
                        assert!(
                            comm.recv_any(&mut []).is_err(),
                            "an empty receive is refused"
                        );
                        Ok(got)
                    }
                    1 => {
                        comm.send(&[1u8; 100], 0).map_err(e)?;
                        comm.send(&[11u8; 64], 0).map_err(e)?;
                        Ok(Vec::new())
                    }
                    _ => {
                        std::thread::sleep(Duration::from_millis(200));
                        comm.send(&[22u8; 64], 0).map_err(e)?;
                        Ok(Vec::new())
                    }
                }
            },
        );
        let got = results[0].as_ref().expect("rank 0");
        // Rank 1's first message is 100 bytes: the first 64-byte receive waits for rank 2's.
        assert_eq!(got[0], (2, vec![22u8; 64]), "{provider:?}");
        assert_eq!(got[1], (1, vec![1u8; 100]), "{provider:?}");
        assert_eq!(got[2], (1, vec![11u8; 64]), "{provider:?}");
        for r in &results[1..] {
            assert!(r.is_ok(), "{provider:?}: {r:?}");
        }
    }
}

/// Five ranks split into even and odd communicators (ranked in reverse by key) and one rank
/// left out; each group's allreduce sums only its members, and the parent still works.
#[test]
fn split_communicators_reduce_within_their_group() {
    let results = with_ranks(
        5,
        |_| options(Provider::Auto, Duration::from_secs(20)),
        |mut comm| {
            let rank = comm.rank();
            let color = (rank != 4).then_some((rank % 2) as u32);
            let sub = comm.split(color, 10 - rank as u32).unwrap();
            let t = DataType::I32;
            let got = sub.map(|mut sub| {
                let members: Vec<usize> = (0..4).filter(|r| r % 2 == rank % 2).collect();
                let want_rank =
                    members.len() - 1 - members.iter().position(|&r| r == rank).unwrap();
                let mut buf = input(t, rank, 1000);
                sub.allreduce(&mut buf, t, ReduceOp::Sum).unwrap();
                let want = reduced(t, ReduceOp::Sum, members.into_iter(), 1000);
                (sub.rank() == want_rank, sub.size() == 2, buf == want)
            });
            let mut buf = input(t, rank, 1000);
            comm.allreduce(&mut buf, t, ReduceOp::Sum).unwrap();
            (got, buf == reduced(t, ReduceOp::Sum, 0..5, 1000))
        },
    );
    for (rank, (sub, parent_ok)) in results.iter().enumerate() {
        assert!(
            parent_ok,
            "rank {rank}: the parent's allreduce went wrong after the split"
        );
        match sub {
            None => assert_eq!(rank, 4),
            Some(checks) => assert_eq!(*checks, (true, true, true), "rank {rank}"),
        }
    }
}
