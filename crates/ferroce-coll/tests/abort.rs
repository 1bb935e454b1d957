//! Aborting a communicator from another thread (what torch's `ProcessGroup.abort()` asks): the
//! call under way ends at once with `Aborted`, not at its timeout, and the peer's calls fail
//! at once too, told by the aborted rank.

use std::time::{Duration, Instant};

use ferroce::Provider;
use ferroce_coll::{CollError, DataType, ReduceOp};

mod common;
use common::{options, with_ranks};

#[test]
fn an_abort_ends_the_call_under_way_and_fails_the_peers() {
    for provider in [Provider::Shm, Provider::Udp] {
        let results = with_ranks(
            2,
            move |_| options(provider, Duration::from_secs(20)),
            move |mut comm| -> Result<Duration, String> {
                let mut v = vec![1u8; 64];
                if comm.rank() == 0 {
                    let handle = comm.abort_handle();
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_millis(200));
                        handle.abort();
                    });
                    // Rank 1 joins only after 1 s: this all_reduce waits, until the abort.
                    let start = Instant::now();
                    return match comm.allreduce(&mut v, DataType::U8, ReduceOp::Sum) {
                        Err(CollError::Aborted) => Ok(start.elapsed()),
                        other => Err(format!("rank 0: {other:?}")),
                    };
                }
                std::thread::sleep(Duration::from_secs(1));
                // Rank 0's message of the aborted call may be here already, which completes
                // this rank's first all_reduce (with rank 0's bytes); the next meets the abort.
                let start = Instant::now();
                for _ in 0..2 {
                    match comm.allreduce(&mut v, DataType::U8, ReduceOp::Sum) {
                        Ok(()) => continue,
                        Err(CollError::PeerFailed { rank: 0 })
                        | Err(CollError::Transfer { rank: 0, .. }) => return Ok(start.elapsed()),
                        Err(e) => return Err(format!("rank 1: {e}")),
                    }
                }
                Err("rank 1: two all_reduces with an aborted peer succeeded".into())
            },
        );
        for (rank, r) in results.into_iter().enumerate() {
            let took = r.unwrap_or_else(|e| panic!("{provider:?}: {e}"));
            // Far from the 20 s timeout: 0.2 s after the start on rank 0, at once on rank 1.
            assert!(
                took < Duration::from_secs(5),
                "{provider:?} rank {rank}: {took:?}"
            );
        }
    }
}

/// An abort while a receive is in flight (its peer never sends, and the waiting is between
/// calls of `progress`, as torch's worker does it): the next `progress` fails with `Aborted`
/// and leaves nothing in flight, and the peer is told at once.
#[test]
fn an_abort_ends_the_operations_in_flight() {
    let results = with_ranks(
        2,
        |_| options(Provider::Udp, Duration::from_secs(20)),
        |mut comm| -> Result<Duration, String> {
            let start = Instant::now();
            if comm.rank() == 0 {
                let mut into = vec![0u8; 64];
                // SAFETY: `into` outlives the receive, which the abort ends.
                let t = unsafe { comm.start_recv(into.as_mut_ptr(), 64, 1, 0) }
                    .map_err(|e| e.to_string())?;
                let handle = comm.abort_handle();
                loop {
                    if start.elapsed() > Duration::from_millis(200) {
                        handle.abort();
                    }
                    std::thread::sleep(Duration::from_millis(1));
                    match comm.progress(Duration::ZERO, 8) {
                        Ok(p) if p.completed.contains(&t) => return Err("completed".into()),
                        Ok(_) => continue,
                        Err(CollError::Aborted) => break,
                        Err(e) => return Err(format!("rank 0: {e}")),
                    }
                }
                if comm.in_flight() != 0 {
                    return Err("the receive is still in flight after the abort".into());
                }
                return Ok(start.elapsed());
            }
            std::thread::sleep(Duration::from_secs(1));
            let start = Instant::now();
            let mut v = vec![0u8; 64];
            match comm.recv(&mut v, 0) {
                Err(CollError::PeerFailed { rank: 0 })
                | Err(CollError::Transfer { rank: 0, .. }) => Ok(start.elapsed()),
                other => Err(format!("rank 1: {other:?}")),
            }
        },
    );
    for (rank, r) in results.into_iter().enumerate() {
        let took = r.unwrap();
        assert!(took < Duration::from_secs(5), "rank {rank}: {took:?}");
    }
}
