//! Sends and receives started together (`start_send`, `start_recv`, `progress`) between ranks
//! that are threads of this process, over shared memory and over UDP: exchanges that blocking
//! calls cannot finish (each rank receives first, or sends many times its slots), in order per
//! peer, meeting blocking calls on the other side, and a collective after them. Every byte is
//! checked.

use std::collections::BTreeSet;
use std::time::Duration;

use ferroce::Provider;
use ferroce_coll::{CollError, Communicator, Ticket};

mod common;
use common::{options, with_ranks, SLOT};

/// Bytes of stream `seed`, `len` long.
fn pattern(seed: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 31 + seed * 7 + 1) as u8).collect()
}

/// Progresses until every ticket of `want` was reported; fails on a ticket reported twice or
/// not started.
fn complete(comm: &mut Communicator, want: &[Ticket]) -> Result<(), String> {
    let mut left: BTreeSet<Ticket> = want.iter().copied().collect();
    while !left.is_empty() {
        for t in comm
            .progress(Duration::from_millis(5), 3)
            .map_err(|e| e.to_string())?
            .completed
        {
            if !left.remove(&t) {
                return Err(format!("ticket {t} reported but not awaited (or twice)"));
            }
        }
    }
    if comm.in_flight() != 0 {
        return Err(format!("{} still in flight", comm.in_flight()));
    }
    Ok(())
}

/// Two ranks each start a receive of 20 slots' worth and then a send of as much to the
/// other: with blocking calls each would wait in its receive (or, sends first, with both
/// peers' slots full) for ever. Started, both finish, every byte in place.
#[test]
fn receives_started_before_sends_both_ways_finish() {
    for provider in [Provider::Shm, Provider::Udp] {
        let results = with_ranks(
            2,
            move |_| options(provider, Duration::from_secs(10)),
            move |mut comm| -> Result<(), String> {
                let (me, peer) = (comm.rank(), 1 - comm.rank());
                let len = 20 * SLOT + 123;
                let out = pattern(me, len);
                let mut into = vec![0u8; len];
                // SAFETY: both buffers outlive the operations, which `complete` finishes.
                let (r, s) = unsafe {
                    let r = comm.start_recv(into.as_mut_ptr(), len, peer, 0);
                    let s = comm.start_send(out.as_ptr(), len, peer, 0);
                    (r.map_err(|e| e.to_string())?, s.map_err(|e| e.to_string())?)
                };
                complete(&mut comm, &[r, s])?;
                if into != pattern(peer, len) {
                    return Err(format!("rank {me}: the bytes from {peer} differ"));
                }
                Ok(())
            },
        );
        for r in results {
            r.unwrap_or_else(|e| panic!("{provider:?}: {e}"));
        }
    }
}

/// Three sends of different lengths to one peer arrive in the order they started, each into
/// the receive started in that order; a blocking receive meets a started send, and a blocking
/// send a started receive; an empty send and receive complete at once; and a collective after
/// operations still in flight runs once they are done, which it finishes first.
#[test]
fn started_operations_keep_their_order_and_meet_blocking_calls() {
    for provider in [Provider::Shm, Provider::Udp] {
        let results = with_ranks(
            3,
            move |_| options(provider, Duration::from_secs(10)),
            move |mut comm| -> Result<Vec<Vec<u8>>, String> {
                let e = |e: CollError| e.to_string();
                let lens = [5 * SLOT, 17, 3 * SLOT + 1];
                let mut got = Vec::new();
                match comm.rank() {
                    0 => {
                        let outs: Vec<Vec<u8>> = lens
                            .iter()
                            .enumerate()
                            .map(|(i, &l)| pattern(i, l))
                            .collect();
                        let mut tickets = Vec::new();
                        for o in &outs {
                            // SAFETY: `outs` outlives the sends, finished below.
                            tickets.push(
                                unsafe { comm.start_send(o.as_ptr(), o.len(), 1, 0) }.map_err(e)?,
                            );
                        }
                        // SAFETY: an empty send reads nothing.
                        let empty =
                            unsafe { comm.start_send(std::ptr::null(), 0, 2, 0) }.map_err(e)?;
                        tickets.push(empty);
                        // A blocking receive from rank 2 while the sends to 1 are in flight:
                        // it finishes them first.
                        let mut from2 = vec![0u8; 2 * SLOT];
                        comm.recv(&mut from2, 2).map_err(e)?;
                        got.push(from2);
                        complete(&mut comm, &tickets)?;
                    }
                    1 => {
                        let mut intos: Vec<Vec<u8>> = lens.iter().map(|&l| vec![0u8; l]).collect();
                        let mut tickets = Vec::new();
                        // The first two started, the third a blocking receive.
                        for into in &mut intos[..2] {
                            // SAFETY: `intos` outlives the receives, finished below.
                            tickets.push(
                                unsafe { comm.start_recv(into.as_mut_ptr(), into.len(), 0, 0) }
                                    .map_err(e)?,
                            );
                        }
                        complete(&mut comm, &tickets)?;
                        comm.recv(&mut intos[2], 0).map_err(e)?;
                        got.extend(intos);
                    }
                    _ => {
                        // SAFETY: an empty receive writes nothing.
                        let empty =
                            unsafe { comm.start_recv(std::ptr::null_mut(), 0, 0, 0) }.map_err(e)?;
                        let out = pattern(9, 2 * SLOT);
                        // SAFETY: `out` outlives the send, which the allreduce finishes.
                        let s =
                            unsafe { comm.start_send(out.as_ptr(), out.len(), 0, 0) }.map_err(e)?;
                        // Before the allreduce, the send in flight goes out: rank 0's blocking
                        // receive takes it.
                        let mut v = vec![6u8; 8];
                        comm.allreduce(
                            &mut v,
                            ferroce_coll::DataType::U8,
                            ferroce_coll::ReduceOp::Sum,
                        )
                        .map_err(e)?;
                        got.push(v);
                        complete(&mut comm, &[empty, s])?;
                        // A started receive meets rank 1's blocking send.
                        let mut into = vec![0u8; 2 * SLOT + 5];
                        // SAFETY: `into` outlives the receive, finished below.
                        let r = unsafe { comm.start_recv(into.as_mut_ptr(), into.len(), 1, 0) }
                            .map_err(e)?;
                        complete(&mut comm, &[r])?;
                        got.push(into);
                    }
                }
                if comm.rank() != 2 {
                    let mut v = vec![comm.rank() as u8 * 2 + 2; 8];
                    comm.allreduce(
                        &mut v,
                        ferroce_coll::DataType::U8,
                        ferroce_coll::ReduceOp::Sum,
                    )
                    .map_err(e)?;
                    got.push(v);
                }
                if comm.rank() == 1 {
                    comm.send(&pattern(8, 2 * SLOT + 5), 2).map_err(e)?;
                }
                Ok(got)
            },
        );
        let r0 = results[0]
            .as_ref()
            .unwrap_or_else(|e| panic!("{provider:?}: {e}"));
        assert_eq!(r0[0], pattern(9, 2 * SLOT), "{provider:?}");
        let r1 = results[1]
            .as_ref()
            .unwrap_or_else(|e| panic!("{provider:?}: {e}"));
        for (i, &l) in [5 * SLOT, 17, 3 * SLOT + 1].iter().enumerate() {
            assert_eq!(r1[i], pattern(i, l), "{provider:?}: message {i}");
        }
        let r2 = results[2]
            .as_ref()
            .unwrap_or_else(|e| panic!("{provider:?}: {e}"));
        assert_eq!(
            r2[1],
            pattern(8, 2 * SLOT + 5),
            "{provider:?}: a blocking send"
        );
        for r in [r0, r1, &r2[..1].to_vec()] {
            assert_eq!(r.last(), Some(&vec![12u8; 8]), "{provider:?}: 2 + 4 + 6");
        }
    }
}

/// A receive whose send never comes fails `progress` with a timeout, naming the peer; the
/// communicator is then broken, and nothing it had in flight is reported.
#[test]
fn a_receive_without_its_send_times_out() {
    let results = with_ranks(
        2,
        |_| options(Provider::Shm, Duration::from_millis(300)),
        |mut comm| -> Result<(), String> {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_secs(1));
                return Ok(());
            }
            let mut into = vec![0u8; 64];
            // SAFETY: `into` outlives the receive (the communicator breaks before it returns).
            let t = unsafe { comm.start_recv(into.as_mut_ptr(), 64, 1, 0) }
                .map_err(|e| e.to_string())?;
            loop {
                match comm.progress(Duration::from_millis(50), 8) {
                    Ok(p) if p.completed.contains(&t) => {
                        return Err("completed without a send".into())
                    }
                    Ok(_) => continue,
                    Err(CollError::Timeout { rank: 1, .. }) => break,
                    Err(e) => return Err(format!("not a timeout: {e}")),
                }
            }
            if comm.in_flight() != 0 {
                return Err("operations left in flight after the failure".into());
            }
            match comm.progress(Duration::ZERO, 8) {
                Err(CollError::Broken(_)) => Ok(()),
                other => Err(format!("after the failure: {other:?}")),
            }
        },
    );
    for r in results {
        r.unwrap();
    }
}

/// Tags: receives take sends of their tag (in order per peer), and a receive from any rank
/// takes the first send of its tag, not an earlier one of another tag.
#[test]
fn tags_match_sends_to_their_receives() {
    for provider in [Provider::Shm, Provider::Udp] {
        let results = with_ranks(
            3,
            move |_| options(provider, Duration::from_secs(10)),
            move |mut comm| -> Result<Vec<(usize, Vec<u8>)>, String> {
                let e = |e: CollError| e.to_string();
                let mut got = Vec::new();
                match comm.rank() {
                    0 => {
                        // Rank 1's tag-3 send comes first; the receive of tag 4 waits for
                        // rank 2's.
                        std::thread::sleep(Duration::from_millis(200));
                        let mut a = vec![0u8; 64];
                        let from = comm.recv_any_tagged(&mut a, 4).map_err(e)?;
                        got.push((from, a));
                        let mut b = vec![0u8; 64];
                        let from = comm.recv_any_tagged(&mut b, 3).map_err(e)?;
                        got.push((from, b));
                        // Two tagged sends from rank 1, in order.
                        let (mut c, mut d) = (vec![0u8; 3 * SLOT], vec![0u8; 10]);
                        // SAFETY: `c` and `d` outlive the receives, finished below.
                        let t = unsafe {
                            [
                                comm.start_recv(c.as_mut_ptr(), c.len(), 1, 5).map_err(e)?,
                                comm.start_recv(d.as_mut_ptr(), d.len(), 1, 7).map_err(e)?,
                            ]
                        };
                        complete(&mut comm, &t)?;
                        got.push((1, c));
                        got.push((1, d));
                        Ok(got)
                    }
                    1 => {
                        let (a, c, d) = (pattern(3, 64), pattern(5, 3 * SLOT), pattern(7, 10));
                        // SAFETY: the buffers outlive the sends, finished below.
                        let t = unsafe {
                            [
                                comm.start_send(a.as_ptr(), a.len(), 0, 3).map_err(e)?,
                                comm.start_send(c.as_ptr(), c.len(), 0, 5).map_err(e)?,
                                comm.start_send(d.as_ptr(), d.len(), 0, 7).map_err(e)?,
                            ]
                        };
                        complete(&mut comm, &t)?;
                        Ok(got)
                    }
                    _ => {
                        std::thread::sleep(Duration::from_millis(100));
                        let a = pattern(4, 64);
                        // SAFETY: `a` outlives the send, finished below.
                        let t = unsafe { comm.start_send(a.as_ptr(), a.len(), 0, 4) }.map_err(e)?;
                        complete(&mut comm, &[t])?;
                        Ok(got)
                    }
                }
            },
        );
        let r0 = results[0]
            .as_ref()
            .unwrap_or_else(|e| panic!("{provider:?}: {e}"));
        assert_eq!(
            r0[0],
            (2, pattern(4, 64)),
            "{provider:?}: tag 4 from rank 2"
        );
        assert_eq!(
            r0[1],
            (1, pattern(3, 64)),
            "{provider:?}: tag 3 from rank 1"
        );
        assert_eq!(r0[2], (1, pattern(5, 3 * SLOT)), "{provider:?}: tag 5");
        assert_eq!(r0[3], (1, pattern(7, 10)), "{provider:?}: tag 7");
        for r in &results[1..] {
            r.as_ref().unwrap_or_else(|e| panic!("{provider:?}: {e}"));
        }
    }
}

/// A receive whose peer's next send has another tag (or length) fails with a mismatch naming
/// the peer, instead of taking bytes meant for another receive.
#[test]
fn a_receive_of_another_tag_is_a_mismatch() {
    let results = with_ranks(
        2,
        |_| options(Provider::Shm, Duration::from_secs(10)),
        |mut comm| -> Result<(), String> {
            let e = |e: CollError| e.to_string();
            if comm.rank() == 0 {
                let a = pattern(1, 16);
                // SAFETY: `a` outlives the send, finished below.
                let t = unsafe { comm.start_send(a.as_ptr(), 16, 1, 1) }.map_err(e)?;
                return complete(&mut comm, &[t]);
            }
            let mut into = vec![0u8; 16];
            // SAFETY: `into` outlives the receive (ended by the failure below).
            let t = unsafe { comm.start_recv(into.as_mut_ptr(), 16, 0, 2) }.map_err(e)?;
            match complete(&mut comm, &[t]) {
                Err(m) if m.contains("rank 0") && m.contains("tag") => {}
                other => return Err(format!("a tag-2 receive of a tag-1 send: {other:?}")),
            }
            if into != vec![0u8; 16] {
                return Err("the mismatched message was written".into());
            }
            Ok(())
        },
    );
    for r in results {
        r.unwrap();
    }
}
