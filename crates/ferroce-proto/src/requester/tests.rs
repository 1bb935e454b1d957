//! The requester's own state, reached from inside the crate: cases the public API reaches
//! only through long and fragile sequences.

use ferroce_wire::aeth::Syndrome;
use ferroce_wire::{Psn, RocePacket};

use crate::cc::{CcConfig, Controller};
use crate::sim::ack_packet;
use crate::sim::pair::{connected_qp, default_rtr, default_rts};
use crate::{Access, Instant, QpCaps, QueuePair, RtsAttr, SendOp, SendWr, Sge, VecMemory};

const A: u32 = 0x41;
const B: u32 = 0x42;
const PSN0: u32 = 300;
const BASE: u64 = 0x10_0000;

fn drain(q: &mut QueuePair, mem: &mut VecMemory, now: Instant) -> Vec<(u32, bool)> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 4096];
    while let Some(n) = q.poll_transmit(now, mem, &mut buf) {
        let p = RocePacket::new_checked(&buf[..n]).unwrap();
        out.push((p.bth().psn().value(), p.bth().ack_req()));
    }
    out
}

/// The window shrinks below what was sent after the last packet that asked for an ACK (two
/// delay cuts within that packet's round trip can do it): when its ACK comes, nothing in
/// flight asked and the window holds every new packet back. One new packet goes past the
/// window, asking, instead of the sender waiting for its retransmission timer (a copy of an
/// old one would count as a duplicate at the peer); its ACK lets the rest go.
#[test]
fn a_window_shrunk_behind_an_unasked_tail_sends_one_new_packet_past_it_asking() {
    let rts = RtsAttr {
        sq_psn: Psn::new(PSN0),
        ..default_rts()
    };
    let mut a = connected_qp(A, QpCaps::default(), &default_rtr(B, Psn::new(PSN0)), &rts);
    // A window of at most 8 packets: an ACK asked every 4.
    a.req.cc = Some(Controller::new(CcConfig::default(), 8));
    let mut mem = VecMemory::new();
    let len = 64 * 1024;
    let r = mem.register(1, BASE, len, Access::ALL.with(Access::LOCAL_WRITE));
    let sge = Sge {
        addr: BASE,
        length: len as u32,
        lkey: mem.region(r).lkey,
    };
    a.post_send(SendWr::new(1, SendOp::Write, vec![sge]).remote(BASE, 0x77))
        .unwrap();
    let t = Instant::from_nanos(1_000);
    let ok = Syndrome::Ack { credits: 31 };
    let sent = drain(&mut a, &mut mem, t);
    let asked = |s: &[(u32, bool)]| {
        s.iter()
            .filter(|p| p.1)
            .map(|p| p.0 - PSN0)
            .collect::<Vec<_>>()
    };
    assert_eq!(sent.len(), 8);
    assert_eq!(asked(&sent), vec![3, 7]);
    // An ACK of two opens two slots: the second new packet fills the window but does not ask,
    // as PSN0 + 7's answer is on its way.
    a.handle_packet(t, &mut mem, &ack_packet(A, Psn::new(PSN0 + 1), ok))
        .unwrap();
    let sent = drain(&mut a, &mut mem, t);
    assert_eq!(sent, vec![(PSN0 + 8, false), (PSN0 + 9, false)]);
    // The window falls to one packet; then PSN0 + 7 is answered: nothing in flight asked.
    a.req.cc = Some(Controller::new(CcConfig::default(), 1));
    a.handle_packet(t, &mut mem, &ack_packet(A, Psn::new(PSN0 + 7), ok))
        .unwrap();
    let probe = drain(&mut a, &mut mem, t);
    assert_eq!(
        probe,
        vec![(PSN0 + 10, true)],
        "one new packet past the window, asking"
    );
    // Its answer covers the tail and lets the next packet go, asking as it fills the window.
    a.handle_packet(t, &mut mem, &ack_packet(A, Psn::new(PSN0 + 10), ok))
        .unwrap();
    assert_eq!(drain(&mut a, &mut mem, t), vec![(PSN0 + 11, true)]);
}
