//! Which request packets ask for an acknowledgement (AckReq) when the sender is window-limited
//! and its peer answers packet by packet. Linux rxe acknowledges exactly the packets that ask;
//! a sender that asked on every packet at its window's end fell into a pattern where each ACK
//! opened one slot and the packet filling it asked again: an ACK per data packet, which halved
//! what an rxe host in an emulated guest could read from ferroce's NVMe-oF target.

use ferroce_proto::requester::{ACK_REQ_INTERVAL, MAX_UNACKED_PSNS};
use ferroce_proto::sim::ack_packet;
use ferroce_proto::sim::pair::{connected_qp, default_rtr, default_rts};
use ferroce_proto::{
    Access, CcAlgorithm, CcConfig, Instant, QpCaps, QueuePair, RtsAttr, SendOp, SendWr, Sge,
    VecMemory, WcStatus,
};
use ferroce_wire::aeth::Syndrome;
use ferroce_wire::{Psn, RocePacket};

const A_QPN: u32 = 0x31;
const B_QPN: u32 = 0x32;
const PSN0: u32 = 700;
const BASE: u64 = 0x40_0000;
/// MTU 1024 (the pair's default): one packet per KiB.
const MTU: usize = 1024;

fn qp(qpn: u32, peer: u32) -> QueuePair {
    let rts = RtsAttr {
        sq_psn: Psn::new(PSN0),
        ..default_rts()
    };
    let mut q = connected_qp(
        qpn,
        QpCaps::default(),
        &default_rtr(peer, Psn::new(PSN0)),
        &rts,
    );
    // The fixed window of `MAX_UNACKED_PSNS`: what slides here is the window, not a
    // controller's idea of it.
    q.set_congestion_control(CcConfig {
        algorithm: CcAlgorithm::Off,
        ..Default::default()
    });
    q
}

fn asks(p: &[u8]) -> bool {
    RocePacket::new_checked(p).unwrap().bth().ack_req()
}

fn psn(p: &[u8]) -> u32 {
    RocePacket::new_checked(p).unwrap().bth().psn().value()
}

fn drain(q: &mut QueuePair, mem: &mut VecMemory, now: Instant) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 4096];
    while let Some(n) = q.poll_transmit(now, mem, &mut buf) {
        out.push(buf[..n].to_vec());
    }
    out
}

/// A WRITE half again as long as the window, acknowledged one PSN at a time (as a peer does
/// when every packet asks): the packets each ACK lets out ask about once per
/// `ACK_REQ_INTERVAL`, not each one, every byte lands, and the WRITE completes.
#[test]
fn a_window_sliding_by_one_asks_once_per_interval_not_per_packet() {
    let pkts = MAX_UNACKED_PSNS as usize * 3 / 2;
    let len = pkts * MTU;
    let mut a = qp(A_QPN, B_QPN);
    let mut b = qp(B_QPN, A_QPN);
    let mut ma = VecMemory::new();
    let mut mb = VecMemory::new();
    let src = ma.register(1, BASE, len, Access::ALL.with(Access::LOCAL_WRITE));
    let dst = mb.register(1, BASE, len, Access::ALL.with(Access::LOCAL_WRITE));
    let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 4093) as u8).collect();
    ma.region_mut(src).bytes.copy_from_slice(&data);
    let sge = Sge {
        addr: BASE,
        length: len as u32,
        lkey: ma.region(src).lkey,
    };
    a.post_send(SendWr::new(9, SendOp::Write, vec![sge]).remote(BASE, mb.region(dst).rkey))
        .unwrap();
    let t = Instant::from_nanos(1_000);
    let first = drain(&mut a, &mut ma, t);
    assert_eq!(
        first.len(),
        MAX_UNACKED_PSNS as usize,
        "a full window leaves"
    );
    let mut to_b = first;
    let mut later = Vec::new();
    let ok = Syndrome::Ack { credits: 31 };
    for k in 0..pkts as u32 {
        for p in to_b.drain(..) {
            b.handle_packet(t, &mut mb, &p).unwrap();
        }
        // B's own (coalesced) ACKs are dropped: A hears one ACK per PSN instead.
        drop(drain(&mut b, &mut mb, t));
        a.handle_packet(t, &mut ma, &ack_packet(A_QPN, Psn::new(PSN0 + k), ok))
            .unwrap();
        let out = drain(&mut a, &mut ma, t);
        assert!(out.len() <= 1, "one ACKed PSN opens one slot");
        later.extend(out.iter().cloned());
        to_b = out;
    }
    assert_eq!(later.len(), pkts - MAX_UNACKED_PSNS as usize);
    let asked: Vec<u32> = later.iter().filter(|p| asks(p)).map(|p| psn(p)).collect();
    let most = later.len() / ACK_REQ_INTERVAL as usize + 2;
    assert!(
        asked.len() <= most,
        "{} of {} packets sent as the window slid asked (at most {most} expected): {asked:?}",
        asked.len(),
        later.len()
    );
    assert!(
        asks(later.last().unwrap()),
        "the message's last packet asks"
    );
    // No run of packets longer than the interval goes without asking: the window can always
    // be opened by an answer that is sure to come.
    let mut gap = 0;
    for p in &later {
        gap = if asks(p) { 0 } else { gap + 1 };
        assert!(
            gap < ACK_REQ_INTERVAL as usize,
            "a run of {gap} unasked packets"
        );
    }
    let wc = a.poll_completion().expect("the WRITE completes");
    assert_eq!((wc.wr_id, wc.status), (9, WcStatus::Success));
    assert!(mb.region(dst).bytes == data, "every byte landed in order");
}
