//! Every operation at the sizes around the path MTU and beyond, on a lossless network: the bytes
//! arrive intact and the completions say what happened.

use core::time::Duration;

use ferroce_proto::sim::pair::{default_rts, Pair, Region};
use ferroce_proto::sim::{NetConfig, Rng};
use ferroce_proto::{Access, PathMtu, SendOp, SendWr, WcOpcode, WcStatus};

const MTU: usize = 1024;
const SIZES: [usize; 6] = [0, 1, MTU - 1, MTU, MTU + 1, 1 << 20];
const LIMIT: Duration = Duration::from_secs(5);

fn pair() -> Pair {
    Pair::new(
        7,
        NetConfig::perfect(Duration::from_micros(5)),
        PathMtu::Mtu1024,
        default_rts(),
        0xabcd,
        0x77,
    )
}

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    Rng::new(seed).fill(&mut v);
    v
}

/// A's source buffer filled with random bytes, and B's zeroed target.
fn setup(p: &mut Pair, len: usize, target_access: Access) -> (Region, Region, Vec<u8>) {
    let src = p.register(0, len.max(1), Access::LOCAL_WRITE);
    let dst = p.register(1, len.max(1), target_access);
    let data = random_bytes(len as u64, len);
    p.bytes_mut(src)[..len].copy_from_slice(&data);
    (src, dst, data)
}

fn sgl(r: Region, len: usize) -> Vec<ferroce_proto::Sge> {
    if len == 0 {
        Vec::new()
    } else {
        vec![r.sge(0, len)]
    }
}

#[test]
fn send_and_send_with_immediate_at_every_size() {
    for len in SIZES {
        for imm in [None, Some(0xfeed_0000 | len as u32)] {
            let mut p = pair();
            let (src, dst, data) = setup(&mut p, len, Access::LOCAL_WRITE);
            p.post_recv(1, 42, sgl(dst, len.max(1))).unwrap();
            let op = imm.map_or(SendOp::Send, SendOp::SendWithImm);
            p.post_send(0, SendWr::new(1, op, sgl(src, len))).unwrap();
            let a = p.wait_completions(0, 1, LIMIT);
            let b = p.wait_completions(1, 1, LIMIT);
            assert_eq!(a.len(), 1, "len {len}");
            assert_eq!(
                (a[0].wr_id, a[0].status, a[0].opcode),
                (1, WcStatus::Success, WcOpcode::Send)
            );
            assert_eq!(b.len(), 1);
            assert_eq!(
                (b[0].wr_id, b[0].status, b[0].opcode),
                (42, WcStatus::Success, WcOpcode::Recv)
            );
            assert_eq!(b[0].byte_len as usize, len);
            assert_eq!(b[0].imm_data, imm);
            assert_eq!(&p.bytes(dst)[..len], &data[..], "len {len}");
        }
    }
}

#[test]
fn send_with_invalidate_revokes_the_key() {
    let mut p = pair();
    let (src, dst, data) = setup(&mut p, 100, Access::LOCAL_WRITE);
    let victim = p.register(1, 64, Access::ALL);
    p.post_recv(1, 5, vec![dst.sge(0, 100)]).unwrap();
    p.post_send(
        0,
        SendWr::new(
            1,
            SendOp::SendWithInvalidate(victim.rkey),
            vec![src.sge(0, 100)],
        ),
    )
    .unwrap();
    let b = p.wait_completions(1, 1, LIMIT);
    assert_eq!(b[0].status, WcStatus::Success);
    assert_eq!(b[0].invalidated_rkey, Some(victim.rkey));
    assert_eq!(&p.bytes(dst)[..100], &data[..]);
    // The key no longer opens the region: a WRITE through it is refused.
    p.post_send(
        0,
        SendWr::new(2, SendOp::Write, vec![src.sge(0, 8)]).remote(victim.addr(0), victim.rkey),
    )
    .unwrap();
    let a = p.wait_completions(0, 2, LIMIT);
    assert_eq!(a[1].status, WcStatus::RemoteAccessError);
}

#[test]
fn write_at_every_size() {
    for len in SIZES {
        let mut p = pair();
        let (src, dst, data) = setup(&mut p, len, Access::REMOTE_WRITE);
        p.post_send(
            0,
            SendWr::new(9, SendOp::Write, sgl(src, len)).remote(dst.addr(0), dst.rkey),
        )
        .unwrap();
        let a = p.wait_completions(0, 1, LIMIT);
        assert_eq!(
            (a[0].wr_id, a[0].status, a[0].opcode),
            (9, WcStatus::Success, WcOpcode::RdmaWrite)
        );
        assert_eq!(&p.bytes(dst)[..len], &data[..], "len {len}");
        assert!(
            p.take_completions(1).is_empty(),
            "a WRITE leaves no trace at the target's CQ"
        );
    }
}

#[test]
fn write_with_immediate_consumes_a_receive() {
    for len in SIZES {
        let mut p = pair();
        let (src, dst, data) = setup(&mut p, len, Access::REMOTE_WRITE);
        p.post_recv(1, 77, Vec::new()).unwrap();
        let wr = SendWr::new(3, SendOp::WriteWithImm(0x1234_5678), sgl(src, len))
            .remote(dst.addr(0), dst.rkey);
        p.post_send(0, wr).unwrap();
        let a = p.wait_completions(0, 1, LIMIT);
        let b = p.wait_completions(1, 1, LIMIT);
        assert_eq!(
            (a[0].status, a[0].opcode),
            (WcStatus::Success, WcOpcode::RdmaWrite)
        );
        assert_eq!(
            (b[0].wr_id, b[0].status, b[0].opcode),
            (77, WcStatus::Success, WcOpcode::RecvRdmaWithImm)
        );
        assert_eq!(b[0].imm_data, Some(0x1234_5678));
        assert_eq!(b[0].byte_len as usize, len);
        assert_eq!(&p.bytes(dst)[..len], &data[..], "len {len}");
    }
}

#[test]
fn read_at_every_size() {
    for len in SIZES {
        let mut p = pair();
        let local = p.register(0, len.max(1), Access::LOCAL_WRITE);
        let remote = p.register(1, len.max(1), Access::REMOTE_READ);
        let data = random_bytes(len as u64 + 1, len);
        p.bytes_mut(remote)[..len].copy_from_slice(&data);
        p.post_send(
            0,
            SendWr::new(4, SendOp::Read, sgl(local, len)).remote(remote.addr(0), remote.rkey),
        )
        .unwrap();
        let a = p.wait_completions(0, 1, LIMIT);
        assert_eq!(
            (a[0].wr_id, a[0].status, a[0].opcode),
            (4, WcStatus::Success, WcOpcode::RdmaRead)
        );
        assert_eq!(&p.bytes(local)[..len], &data[..], "len {len}");
    }
}

#[test]
fn read_scatters_into_several_buffers() {
    let mut p = pair();
    let local = p.register(0, 4000, Access::LOCAL_WRITE);
    let remote = p.register(1, 3000, Access::REMOTE_READ);
    let data = random_bytes(3, 3000);
    p.bytes_mut(remote).copy_from_slice(&data);
    // Three pieces with gaps between them in the local region.
    let sgl = vec![
        local.sge(0, 1000),
        local.sge(1500, 1500),
        local.sge(3500, 500),
    ];
    p.post_send(
        0,
        SendWr::new(1, SendOp::Read, sgl).remote(remote.addr(0), remote.rkey),
    )
    .unwrap();
    assert_eq!(p.wait_completions(0, 1, LIMIT)[0].status, WcStatus::Success);
    let l = p.bytes(local);
    assert_eq!(&l[..1000], &data[..1000]);
    assert_eq!(&l[1500..3000], &data[1000..2500]);
    assert_eq!(&l[3500..4000], &data[2500..]);
    assert!(l[1000..1500].iter().all(|&b| b == 0), "gaps untouched");
}

#[test]
fn atomics_return_the_original_and_update_the_target() {
    let mut p = pair();
    let result = p.register(0, 16, Access::LOCAL_WRITE);
    let word = p.register(1, 16, Access::REMOTE_ATOMIC);
    p.bytes_mut(word)[8..16].copy_from_slice(&40u64.to_ne_bytes());
    let wr = |id, op| SendWr::new(id, op, vec![result.sge(0, 8)]).remote(word.addr(8), word.rkey);
    p.post_send(0, wr(1, SendOp::FetchAdd { add: 2 })).unwrap();
    let a = p.wait_completions(0, 1, LIMIT);
    assert_eq!(
        (a[0].status, a[0].opcode),
        (WcStatus::Success, WcOpcode::FetchAdd)
    );
    assert_eq!(
        u64::from_ne_bytes(p.bytes(result)[..8].try_into().unwrap()),
        40
    );
    // A CAS that matches swaps; one that does not leaves the value and reports what it found.
    p.post_send(
        0,
        wr(
            2,
            SendOp::CompareSwap {
                compare: 42,
                swap: 1000,
            },
        ),
    )
    .unwrap();
    assert_eq!(
        p.wait_completions(0, 1, LIMIT)[0].opcode,
        WcOpcode::CompareSwap
    );
    assert_eq!(
        u64::from_ne_bytes(p.bytes(result)[..8].try_into().unwrap()),
        42
    );
    p.post_send(
        0,
        wr(
            3,
            SendOp::CompareSwap {
                compare: 42,
                swap: 7,
            },
        ),
    )
    .unwrap();
    assert_eq!(p.wait_completions(0, 1, LIMIT)[0].status, WcStatus::Success);
    assert_eq!(
        u64::from_ne_bytes(p.bytes(result)[..8].try_into().unwrap()),
        1000
    );
    assert_eq!(
        u64::from_ne_bytes(p.bytes(word)[8..16].try_into().unwrap()),
        1000
    );
}

#[test]
fn inline_data_and_gather_lists_are_sent_as_one_message() {
    let mut p = pair();
    let dst = p.register(1, 64, Access::LOCAL_WRITE);
    p.post_recv(1, 1, vec![dst.sge(0, 64)]).unwrap();
    p.post_send(
        0,
        SendWr::new(1, SendOp::Send, Vec::new()).inline(b"inline hello".to_vec()),
    )
    .unwrap();
    assert_eq!(p.wait_completions(1, 1, LIMIT)[0].byte_len, 12);
    assert_eq!(&p.bytes(dst)[..12], b"inline hello");

    let src = p.register(0, 30, Access::NONE);
    p.bytes_mut(src)
        .copy_from_slice(b"0123456789abcdefghijklmnopqrst");
    p.post_recv(1, 2, vec![dst.sge(0, 64)]).unwrap();
    p.post_send(
        0,
        SendWr::new(2, SendOp::Send, vec![src.sge(20, 10), src.sge(0, 5)]),
    )
    .unwrap();
    assert_eq!(p.wait_completions(1, 1, LIMIT)[0].byte_len, 15);
    assert_eq!(&p.bytes(dst)[..15], b"klmnopqrst01234");
}

#[test]
fn unsignaled_requests_complete_silently_and_in_order() {
    let mut p = pair();
    let (src, dst, _) = setup(&mut p, 64, Access::REMOTE_WRITE);
    for id in 0..5u64 {
        let mut wr =
            SendWr::new(id, SendOp::Write, vec![src.sge(0, 64)]).remote(dst.addr(0), dst.rkey);
        wr.flags.signaled = id == 4;
        p.post_send(0, wr).unwrap();
    }
    let a = p.wait_completions(0, 1, LIMIT);
    assert!(p.run(LIMIT));
    assert_eq!(a.len(), 1);
    assert_eq!(a[0].wr_id, 4);
    assert_eq!(
        p.qp(0).send_queue_len(),
        0,
        "the unsignaled ones were retired too"
    );
}

#[test]
fn completions_follow_posting_order_across_operations() {
    let mut p = pair();
    let local = p.register(0, 1 << 16, Access::LOCAL_WRITE);
    let remote = p.register(1, 1 << 16, Access::ALL);
    let ops = [
        SendOp::Read,
        SendOp::Write,
        SendOp::FetchAdd { add: 1 },
        SendOp::Read,
        SendOp::Write,
        SendOp::CompareSwap {
            compare: 1,
            swap: 2,
        },
    ];
    for (i, op) in ops.iter().enumerate() {
        let len = if op.is_atomic() { 8 } else { 5000 };
        let wr = SendWr::new(i as u64, *op, vec![local.sge(i * 8192, len)])
            .remote(remote.addr(8 * 1024 * 4), remote.rkey);
        p.post_send(0, wr).unwrap();
    }
    let a = p.wait_completions(0, ops.len(), LIMIT);
    let ids: Vec<u64> = a.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, (0..ops.len() as u64).collect::<Vec<_>>());
    assert!(a.iter().all(|w| w.status == WcStatus::Success), "{a:?}");
}

#[test]
fn fence_makes_a_write_wait_for_an_earlier_read() {
    // Unfenced, the responder may read the READ's data after a later WRITE landed (IBTA allows
    // it); fenced, the WRITE does not start until the READ has completed.
    let mut p = pair();
    let local = p.register(0, 2 * 4096, Access::LOCAL_WRITE);
    let remote = p.register(1, 4096, Access::ALL);
    p.bytes_mut(remote).fill(1);
    p.bytes_mut(local)[4096..].fill(2);
    p.post_send(
        0,
        SendWr::new(1, SendOp::Read, vec![local.sge(0, 4096)]).remote(remote.addr(0), remote.rkey),
    )
    .unwrap();
    let mut w = SendWr::new(2, SendOp::Write, vec![local.sge(4096, 4096)])
        .remote(remote.addr(0), remote.rkey);
    w.flags.fence = true;
    p.post_send(0, w).unwrap();
    let a = p.wait_completions(0, 2, LIMIT);
    assert!(a.iter().all(|w| w.status == WcStatus::Success));
    assert!(
        p.bytes(local)[..4096].iter().all(|&b| b == 1),
        "the READ saw the data from before the WRITE"
    );
    assert!(p.bytes(remote).iter().all(|&b| b == 2));
}

#[test]
fn solicited_flag_reaches_the_receive_completion() {
    let mut p = pair();
    let (src, dst, _) = setup(&mut p, 16, Access::LOCAL_WRITE);
    for (id, solicited) in [(1, false), (2, true)] {
        p.post_recv(1, id, vec![dst.sge(0, 16)]).unwrap();
        let mut w = SendWr::new(id, SendOp::Send, vec![src.sge(0, 16)]);
        w.flags.solicited = solicited;
        p.post_send(0, w).unwrap();
    }
    let b = p.wait_completions(1, 2, LIMIT);
    assert_eq!((b[0].solicited, b[1].solicited), (false, true));
}

#[test]
fn initiator_depth_limits_outstanding_reads() {
    use ferroce_proto::sim::TraceEvent;
    let rts = ferroce_proto::RtsAttr {
        max_rd_atomic: 1,
        ..default_rts()
    };
    let mut p = Pair::new(
        1,
        NetConfig::perfect(Duration::from_micros(5)),
        PathMtu::Mtu1024,
        rts,
        1,
        2,
    );
    p.sim.trace = Some(Vec::new());
    let local = p.register(0, 3 * 64, Access::LOCAL_WRITE);
    let remote = p.register(1, 64, Access::REMOTE_READ);
    for i in 0..3 {
        let wr = SendWr::new(i, SendOp::Read, vec![local.sge(i as usize * 64, 64)])
            .remote(remote.addr(0), remote.rkey);
        p.post_send(0, wr).unwrap();
    }
    assert_eq!(p.wait_completions(0, 3, LIMIT).len(), 3);
    // Requests and responses strictly alternate: never two READs in flight.
    let kinds: Vec<&str> = p
        .sim
        .trace
        .as_ref()
        .unwrap()
        .iter()
        .filter_map(|e| match e {
            TraceEvent::Packet { opcode, .. } => Some(opcode.name()),
            _ => None,
        })
        .collect();
    assert_eq!(
        kinds,
        ["RC_RDMA_READ_REQUEST", "RC_RDMA_READ_RESPONSE_ONLY"].repeat(3),
        "with max_rd_atomic 1 each READ waits for the previous answer"
    );
}

#[test]
fn duplicated_atomics_execute_once_and_replay_the_saved_original() {
    // Every packet is delivered twice: each FETCH_ADD and CAS arrives twice at the responder.
    let net = NetConfig {
        duplicate: 1.0,
        ..NetConfig::perfect(Duration::from_micros(5))
    };
    let mut p = Pair::new(3, net, PathMtu::Mtu1024, default_rts(), 1, 2);
    let results = p.register(0, 8 * 20, Access::LOCAL_WRITE);
    let word = p.register(1, 16, Access::REMOTE_ATOMIC);
    for i in 0..10u64 {
        let wr = SendWr::new(
            i,
            SendOp::FetchAdd { add: 5 },
            vec![results.sge(i as usize * 8, 8)],
        );
        p.post_send(0, wr.remote(word.addr(0), word.rkey)).unwrap();
    }
    for i in 0..10u64 {
        let op = SendOp::CompareSwap {
            compare: i,
            swap: i + 1,
        };
        let wr = SendWr::new(10 + i, op, vec![results.sge(80 + i as usize * 8, 8)])
            .remote(word.addr(8), word.rkey);
        p.post_send(0, wr).unwrap();
    }
    let a = p.wait_completions(0, 20, LIMIT);
    assert!(a.iter().all(|w| w.status == WcStatus::Success), "{a:?}");
    assert!(p.run(LIMIT), "the late copies drain");
    let c = *p.qp(1).counters();
    assert!(
        c.duplicate_request >= 20,
        "the duplicates did arrive: {c:?} {:?}",
        p.sim.stats
    );
    let word_bytes = p.bytes(word).to_vec();
    assert_eq!(
        u64::from_ne_bytes(word_bytes[..8].try_into().unwrap()),
        50,
        "ten adds of 5, once each"
    );
    assert_eq!(
        u64::from_ne_bytes(word_bytes[8..].try_into().unwrap()),
        10,
        "ten CAS steps, once each"
    );
    let r = p.bytes(results);
    for i in 0..10usize {
        assert_eq!(
            u64::from_ne_bytes(r[i * 8..i * 8 + 8].try_into().unwrap()),
            5 * i as u64
        );
        assert_eq!(
            u64::from_ne_bytes(r[80 + i * 8..88 + i * 8].try_into().unwrap()),
            i as u64
        );
    }
}

/// Requests posted by reference are copied into the scatter/gather lists of requests that
/// already retired. A recycled list must carry exactly the new request's entries: posting
/// three-, one- and two-piece WRITEs in turn (each reusing a list a longer or shorter one
/// left) gathers each request's own pieces, byte for byte, and nothing of an earlier one.
#[test]
fn requests_posted_by_reference_gather_exactly_their_own_pieces() {
    let mut p = pair();
    let src = p.register(0, 96, Access::LOCAL_WRITE);
    let dst = p.register(1, 96, Access::ALL);
    let data = random_bytes(9, 96);
    p.bytes_mut(src).copy_from_slice(&data);
    let pieces: [&[(usize, usize)]; 4] = [
        &[(0, 8), (40, 8), (80, 16)],
        &[(16, 4)],
        &[(64, 8), (8, 24)],
        &[(0, 96)],
    ];
    for (round, list) in pieces.iter().cycle().take(12).enumerate() {
        p.bytes_mut(dst).fill(0);
        let len: usize = list.iter().map(|&(_, n)| n).sum();
        let wr = SendWr::new(
            round as u64,
            SendOp::Write,
            list.iter().map(|&(off, n)| src.sge(off, n)).collect(),
        )
        .remote(dst.base, dst.rkey);
        p.qp(0).post_send_copy(&wr).unwrap();
        let wc = p.wait_completions(0, 1, LIMIT);
        assert_eq!(
            wc.iter()
                .map(|w| (w.wr_id, w.status, w.byte_len as usize))
                .collect::<Vec<_>>(),
            [(round as u64, WcStatus::Success, len)],
            "round {round}"
        );
        let expected: Vec<u8> = list
            .iter()
            .flat_map(|&(off, n)| data[off..off + n].iter().copied())
            .collect();
        assert_eq!(&p.bytes(dst)[..len], &expected[..], "round {round}");
        assert!(
            p.bytes(dst)[len..].iter().all(|&b| b == 0),
            "round {round}: bytes past the request's length were written"
        );
    }
}
