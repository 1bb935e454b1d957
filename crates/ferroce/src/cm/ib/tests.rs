//! Two managers connected by a simulated QP1 link in virtual time: every connection step,
//! each loss recovered by a retry, every refusal, hostile MADs.

use std::time::{Duration, Instant};

use ferroce_wire::cm::{attr, rej_reason, CmMad, CmMessage, SidrRep};

use super::ip::{port_space, service_id};
use super::manager::*;

const A: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1];
const B: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2];

struct Pair {
    a: CmManager,
    b: CmManager,
    now: Instant,
    /// Attribute IDs to drop, once each, on their way (in order).
    drop_once: Vec<u16>,
    /// Every MAD delivered, as (from A, attribute ID).
    log: Vec<(bool, u16)>,
    events_a: Vec<CmEvent>,
    events_b: Vec<CmEvent>,
}

impl Pair {
    fn new() -> Pair {
        let mut b = CmManager::new(B, 2, 0x1000);
        b.listen(service_id(port_space::TCP, 7174)).unwrap();
        Pair {
            a: CmManager::new(A, 1, 0x5000),
            b,
            now: Instant::now(),
            drop_once: Vec::new(),
            log: Vec::new(),
            events_a: Vec::new(),
            events_b: Vec::new(),
        }
    }

    /// Delivers what is queued until both are quiet (no time passes).
    fn deliver(&mut self) {
        loop {
            let mut moved = false;
            for from_a in [true, false] {
                let (src, dst) = if from_a {
                    (&mut self.a, &mut self.b)
                } else {
                    (&mut self.b, &mut self.a)
                };
                while let Some(out) = src.poll_transmit() {
                    moved = true;
                    let attr = attribute_of(&out.mad);
                    if let Some(i) = self.drop_once.iter().position(|&d| d == attr) {
                        self.drop_once.remove(i);
                        continue;
                    }
                    assert_eq!(out.dest_gid, dst.local_gid());
                    self.log.push((from_a, attr));
                    dst.handle_mad(self.now, src.local_gid(), &out.mad);
                }
            }
            while let Some(e) = self.a.poll_event() {
                self.events_a.push(e);
            }
            while let Some(e) = self.b.poll_event() {
                self.events_b.push(e);
            }
            if !moved {
                return;
            }
        }
    }

    /// Lets time pass to the next timeout of either side, then delivers.
    fn advance(&mut self) {
        let next = [self.a.poll_timeout(), self.b.poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        self.now = next.expect("a timer is due");
        self.a.handle_timeout(self.now);
        self.b.handle_timeout(self.now);
        self.deliver();
    }

    fn connect(&mut self) -> ConnId {
        let params = ConnectParams {
            dest_gid: B,
            local_gid: None,
            service_id: service_id(port_space::TCP, 7174),
            qpn: 0x22,
            starting_psn: 0x1234,
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            path_mtu: 3,
            transport_type: 0,
            srq: false,
            ece: (0x15b3, 0x8),
            private_data: b"hello".to_vec(),
        };
        let id = self.a.connect(self.now, params).unwrap();
        self.deliver();
        id
    }

    /// B's pending request, accepted.
    fn accept(&mut self) -> ConnId {
        let Some(CmEvent::Request {
            conn,
            req,
            ece_options,
            from_gid,
        }) = self.events_b.pop()
        else {
            panic!("B has a request: {:?}", self.events_b)
        };
        assert_eq!(from_gid, A);
        assert_eq!((req.local_qpn, req.starting_psn), (0x22, 0x1234));
        assert_eq!(&req.private_data[..5], b"hello");
        assert_eq!((req.vendor_id, ece_options), (0x15b3, 0x8));
        let p = AcceptParams {
            qpn: 0x33,
            starting_psn: 0x5678,
            responder_resources: 1,
            initiator_depth: 1,
            rnr_retry_count: 7,
            private_data: b"welcome".to_vec(),
            ..Default::default()
        };
        self.b.accept(self.now, conn, p).unwrap();
        self.deliver();
        conn
    }

    /// A's reply, answered with the RTU.
    fn ready(&mut self, conn_a: ConnId) {
        let Some(CmEvent::Reply { conn, rep, .. }) = self.events_a.pop() else {
            panic!("A has a reply: {:?}", self.events_a)
        };
        assert_eq!(conn, conn_a);
        assert_eq!((rep.local_qpn, rep.starting_psn), (0x33, 0x5678));
        assert_eq!(&rep.private_data[..7], b"welcome");
        self.a.ready_to_use(conn, &[]).unwrap();
        self.deliver();
    }
}

#[test]
fn a_connection_is_made_and_ended_in_five_messages() {
    let mut p = Pair::new();
    let a = p.connect();
    let b = p.accept();
    p.ready(a);
    assert_eq!(p.events_b, vec![CmEvent::Established { conn: b }]);
    assert!(p.a.is_established(a) && p.b.is_established(b));
    p.events_b.clear();
    p.a.disconnect(p.now, a, &[]).unwrap();
    p.deliver();
    assert_eq!(p.events_a, vec![CmEvent::Disconnected { conn: a }]);
    assert_eq!(p.events_b, vec![CmEvent::Disconnected { conn: b }]);
    let order: Vec<u16> = p.log.iter().map(|l| l.1).collect();
    assert_eq!(
        order,
        [attr::REQ, attr::REP, attr::RTU, attr::DREQ, attr::DREP]
    );
    // Time-wait ends: nothing is left.
    p.advance();
    assert_eq!((p.a.connections(), p.b.connections()), (0, 0));
    assert_eq!(p.a.poll_timeout(), None);
}

#[test]
fn a_lost_req_rep_and_rtu_are_each_recovered_by_a_retry() {
    let mut p = Pair::new();
    p.drop_once = vec![attr::REQ, attr::REP, attr::RTU];
    let start = p.now;
    let a = p.connect();
    assert!(p.events_b.is_empty(), "the REQ was lost");
    p.advance();
    let b = p.accept();
    assert!(p.events_a.is_empty(), "the REP was lost");
    p.advance();
    p.ready(a);
    assert!(p.events_b.is_empty(), "the RTU was lost");
    // B sends its REP again; A, established, answers with the RTU again.
    p.advance();
    assert_eq!(p.events_b, vec![CmEvent::Established { conn: b }]);
    assert!(
        p.now - start < Duration::from_secs(3),
        "{:?}",
        p.now - start
    );
}

#[test]
fn a_lost_dreq_and_drep_are_recovered_and_a_silent_peer_is_disconnected_anyway() {
    let mut p = Pair::new();
    let a = p.connect();
    let b = p.accept();
    p.ready(a);
    p.events_b.clear();
    p.drop_once = vec![attr::DREQ, attr::DREP];
    p.a.disconnect(p.now, a, &[]).unwrap();
    p.deliver();
    p.advance(); // DREQ again; B answers (B disconnected), the DREP is lost
    assert_eq!(p.events_b, vec![CmEvent::Disconnected { conn: b }]);
    p.advance(); // DREQ again; B in time-wait answers again
    assert_eq!(p.events_a, vec![CmEvent::Disconnected { conn: a }]);

    // A peer that never answers: the DREQ's retries run out and A disconnects alone.
    let mut p = Pair::new();
    let a = p.connect();
    p.accept();
    p.ready(a);
    p.drop_once = vec![attr::DREQ; usize::from(MAX_CM_RETRIES) + 1];
    p.a.disconnect(p.now, a, &[]).unwrap();
    p.deliver();
    while p.events_a.is_empty() {
        p.advance();
    }
    assert_eq!(p.events_a, vec![CmEvent::Disconnected { conn: a }]);
}

#[test]
fn a_req_nobody_answers_is_unreachable_after_every_retry() {
    let mut p = Pair::new();
    p.drop_once = vec![attr::REQ; usize::from(MAX_CM_RETRIES) + 1];
    let start = p.now;
    let a = p.connect();
    while p.events_a.is_empty() {
        p.advance();
    }
    assert_eq!(p.events_a, vec![CmEvent::Unreachable { conn: a }]);
    let waited = p.now - start;
    let expected = cm_time(RESPONSE_TIMEOUT) * (u32::from(MAX_CM_RETRIES) + 1);
    assert_eq!(waited, expected);
    assert_eq!(p.a.connections(), 0);
}

#[test]
fn a_slow_accept_gets_an_mra_which_holds_the_active_side() {
    let mut p = Pair::new();
    let a = p.connect();
    // B's application takes its time: A's REQ comes again, B answers with an MRA.
    p.advance();
    assert!(p.log.contains(&(false, attr::MRA)), "{:?}", p.log);
    // The MRA's 2^24 × 4 µs hold A well past its retries.
    for _ in 0..MAX_CM_RETRIES + 2 {
        if p.a
            .poll_timeout()
            .is_some_and(|t| t - p.now > Duration::from_secs(60))
        {
            break;
        }
        p.advance();
    }
    assert!(p.events_a.is_empty(), "{:?}", p.events_a);
    p.accept();
    p.ready(a);
    assert!(p.a.is_established(a));
}

#[test]
fn refusals_carry_their_reason() {
    let mut p = Pair::new();
    p.b.unlisten(service_id(port_space::TCP, 7174));
    let a = p.connect();
    let Some(CmEvent::Rejected { conn, reason, .. }) = p.events_a.pop() else {
        panic!()
    };
    assert_eq!((conn, reason), (a, rej_reason::INVALID_SERVICE_ID));

    let mut p = Pair::new();
    let a = p.connect();
    let Some(CmEvent::Request { conn, .. }) = p.events_b.pop() else {
        panic!()
    };
    p.b.reject(conn, rej_reason::CONSUMER_DEFINED, b"no thanks")
        .unwrap();
    p.deliver();
    let Some(CmEvent::Rejected {
        conn,
        reason,
        private_data,
    }) = p.events_a.pop()
    else {
        panic!()
    };
    assert_eq!((conn, reason), (a, rej_reason::CONSUMER_DEFINED));
    assert_eq!(&private_data[..9], b"no thanks");
    assert_eq!((p.a.connections(), p.b.connections()), (0, 0));
    assert!(p.b.accept(p.now, conn, AcceptParams::default()).is_err());
    assert!(matches!(
        p.b.listen(service_id(port_space::TCP, 7174)),
        Err(CommandError::Busy(_))
    ));
}

#[test]
fn a_req_given_up_reaches_the_passive_side_as_a_rejection_by_guid() {
    let mut p = Pair::new();
    let a = p.connect();
    let Some(CmEvent::Request { conn: b, .. }) = p.events_b.pop() else {
        panic!("B has the request")
    };
    // A gives up before any REP: its REJ says "timeout" with its CA GUID as the ARI and names
    // only its own communication ID (it never learned B's), as the kernel's does.
    p.a.disconnect(p.now, a, &[]).unwrap();
    let out = p.a.poll_transmit().unwrap();
    let CmMessage::Rej(rej) = CmMad::parse(&out.mad).unwrap().message else {
        panic!("a REJ")
    };
    assert_eq!(
        (rej.reason, rej.remote_comm_id, rej.local_comm_id),
        (rej_reason::TIMEOUT, 0, a)
    );
    assert_eq!(rej.ari, 1u64.to_be_bytes(), "A's CA GUID");
    p.b.handle_mad(p.now, A, &out.mad);
    p.deliver();
    let Some(CmEvent::Rejected { conn, reason, .. }) = p.events_b.pop() else {
        panic!("B hears it: {:?}", p.events_b)
    };
    assert_eq!((conn, reason), (b, rej_reason::TIMEOUT));
    assert_eq!(p.b.connections(), 0);
    // Abandoning after the REP (or as the passive side) is the consumer's rejection.
    let mut p = Pair::new();
    p.connect();
    let b = p.accept();
    p.b.disconnect(p.now, b, &[]).unwrap();
    let out = p.b.poll_transmit().unwrap();
    let CmMessage::Rej(rej) = CmMad::parse(&out.mad).unwrap().message else {
        panic!("a REJ")
    };
    assert_eq!(rej.reason, rej_reason::CONSUMER_DEFINED);
}

#[test]
fn a_request_nobody_answers_is_dropped_after_the_accept_wait() {
    let mut m = CmManager::new(B, 2, 7);
    m.listen(service_id(port_space::TCP, 1)).unwrap();
    let start = Instant::now();
    let req = CmMad {
        transaction_id: 1,
        attribute_modifier: 0,
        message: CmMessage::Req(ferroce_wire::cm::Req {
            local_comm_id: 9,
            service_id: service_id(port_space::TCP, 1),
            ..Default::default()
        }),
    };
    m.handle_mad(start, A, &req.to_bytes().unwrap());
    let Some(CmEvent::Request { conn, .. }) = m.poll_event() else {
        panic!()
    };
    assert_eq!(m.poll_timeout(), Some(start + ACCEPT_WAIT));
    m.handle_timeout(start + ACCEPT_WAIT);
    assert_eq!(m.poll_event(), Some(CmEvent::Unreachable { conn }));
    assert_eq!(m.connections(), 0);
    assert!(m
        .accept(start + ACCEPT_WAIT, conn, AcceptParams::default())
        .is_err());
}

#[test]
fn services_resolve_by_sidr() {
    let mut p = Pair::new();
    let sid = service_id(port_space::UDP, 9000);
    p.b.listen(sid).unwrap();
    let r = p.a.resolve_service(p.now, B, sid, vec![1, 2, 3]).unwrap();
    p.deliver();
    let Some(CmEvent::ServiceRequest {
        request,
        transaction_id,
        from_gid,
        req,
    }) = p.events_b.pop()
    else {
        panic!()
    };
    assert_eq!((request, from_gid, req.service_id), (r, A, sid));
    // A duplicate of the request (A's retry) is not reported again while it waits.
    p.advance();
    assert!(p.events_b.is_empty(), "{:?}", p.events_b);
    let answer = SidrRep {
        request_id: request,
        qpn: 0x44,
        qkey: 0x1111_2222,
        service_id: sid,
        ..Default::default()
    };
    p.b.answer_service(p.now, A, transaction_id, answer)
        .unwrap();
    p.deliver();
    let Some(CmEvent::ServiceReply {
        request,
        rep: Some(rep),
    }) = p.events_a.pop()
    else {
        panic!()
    };
    assert_eq!(
        (request, rep.status, rep.qpn, rep.qkey),
        (r, 0, 0x44, 0x1111_2222)
    );
    // No one listens: status 1 at once.
    let r =
        p.a.resolve_service(p.now, B, service_id(port_space::UDP, 1), vec![])
            .unwrap();
    p.deliver();
    let Some(CmEvent::ServiceReply {
        request,
        rep: Some(rep),
    }) = p.events_a.pop()
    else {
        panic!()
    };
    assert_eq!((request, rep.status), (r, 1));
}

#[test]
fn hostile_mads_are_counted_or_answered_never_trusted() {
    let mut m = CmManager::new(B, 2, 7);
    m.listen(service_id(port_space::TCP, 1)).unwrap();
    let now = Instant::now();
    m.handle_mad(now, A, &[0u8; 10]);
    m.handle_mad(now, A, &[0xffu8; 256]);
    assert_eq!(m.malformed, 2);
    // A REP for a connection never made is rejected (invalid communication ID).
    let rep = CmMad {
        transaction_id: 9,
        attribute_modifier: 0,
        message: CmMessage::Rep(ferroce_wire::cm::Rep {
            local_comm_id: 5,
            remote_comm_id: 77,
            ..Default::default()
        }),
    };
    m.handle_mad(now, A, &rep.to_bytes().unwrap());
    let out = m.poll_transmit().unwrap();
    let CmMessage::Rej(rej) = CmMad::parse(&out.mad).unwrap().message else {
        panic!()
    };
    assert_eq!(
        (rej.reason, rej.remote_comm_id),
        (rej_reason::INVALID_COMM_ID, 5)
    );
    // RTU, DREP, REJ and MRA for nothing are ignored; a DREQ for nothing gets its DREP.
    for message in [
        CmMessage::Rtu(Default::default()),
        CmMessage::Drep(Default::default()),
        CmMessage::Dreq(Default::default()),
    ] {
        let mad = CmMad {
            transaction_id: 1,
            attribute_modifier: 0,
            message,
        };
        m.handle_mad(now, A, &mad.to_bytes().unwrap());
    }
    let out = m.poll_transmit().unwrap();
    assert_eq!(attribute_of(&out.mad), attr::DREP);
    assert!(m.poll_transmit().is_none() && m.poll_event().is_none());
    // A flood of REQs is capped: the ones past MAX_PENDING are refused for resources.
    for i in 0..MAX_PENDING as u32 + 3 {
        let req = CmMad {
            transaction_id: u64::from(i),
            attribute_modifier: 0,
            message: CmMessage::Req(ferroce_wire::cm::Req {
                local_comm_id: i + 1,
                service_id: service_id(port_space::TCP, 1),
                ..Default::default()
            }),
        };
        m.handle_mad(now, A, &req.to_bytes().unwrap());
    }
    assert_eq!(m.connections(), MAX_PENDING);
    let mut refused = 0;
    while let Some(out) = m.poll_transmit() {
        if let CmMessage::Rej(r) = CmMad::parse(&out.mad).unwrap().message {
            assert_eq!(r.reason, rej_reason::NO_RESOURCES);
            refused += 1;
        }
    }
    assert_eq!(refused, 3);
}

/// One end of an in-memory QP1 link: what `send` writes the other end's `recv` reads; the first
/// `drop_first` MADs sent are lost.
struct MemPort {
    me: [u8; 16],
    tx: std::sync::Mutex<std::sync::mpsc::Sender<([u8; 16], Vec<u8>)>>,
    rx: std::sync::Mutex<std::sync::mpsc::Receiver<([u8; 16], Vec<u8>)>>,
    drop_first: std::sync::atomic::AtomicUsize,
}

impl super::agent::MadPort for MemPort {
    fn send(&self, _dest: [u8; 16], mad: &[u8; ferroce_wire::mad::MAD_LEN]) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.drop_first.load(Relaxed) > 0 {
            self.drop_first.fetch_sub(1, Relaxed);
            return Ok(());
        }
        let _ = self.tx.lock().unwrap().send((self.me, mad.to_vec()));
        Ok(())
    }

    fn recv(&self, timeout: Duration) -> std::io::Result<Option<([u8; 16], Vec<u8>)>> {
        Ok(self.rx.lock().unwrap().recv_timeout(timeout).ok())
    }
}

/// Two ends of an in-memory QP1 link between A and B; A's first `a_drops` MADs are lost.
fn mem_link(a_drops: usize) -> (MemPort, MemPort) {
    use std::sync::mpsc::channel;
    let (to_b, from_a) = channel();
    let (to_a, from_b) = channel();
    let port = |me, tx, rx, drop_first| MemPort {
        me,
        tx: std::sync::Mutex::new(tx),
        rx: std::sync::Mutex::new(rx),
        drop_first: std::sync::atomic::AtomicUsize::new(drop_first),
    };
    (port(A, to_b, from_b, a_drops), port(B, to_a, from_a, 0))
}

/// A sink that forwards every event to the receiver it returns.
fn event_channel() -> (super::agent::EventSink, std::sync::mpsc::Receiver<CmEvent>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let sink: super::agent::EventSink = Box::new(move |e| {
        let _ = tx.send(e);
    });
    (sink, rx)
}

/// A's REQ to B's service 1.
fn params_to_b() -> ConnectParams {
    ConnectParams {
        dest_gid: B,
        local_gid: None,
        service_id: service_id(port_space::TCP, 1),
        qpn: 0x22,
        starting_psn: 1,
        responder_resources: 1,
        initiator_depth: 1,
        retry_count: 7,
        rnr_retry_count: 7,
        path_mtu: 3,
        transport_type: 0,
        srq: false,
        ece: (0, 0),
        private_data: Vec::new(),
    }
}

fn next_event(r: &std::sync::mpsc::Receiver<CmEvent>) -> CmEvent {
    r.recv_timeout(Duration::from_secs(10)).expect("an event")
}

/// A's agent and B's (listening on service 1, held if `hold_b`), over an in-memory link on
/// which A's first `a_drops` MADs are lost; each with the receiver of its events.
fn two_agents(
    a_drops: usize,
    hold_b: bool,
) -> (
    super::agent::CmAgent,
    std::sync::mpsc::Receiver<CmEvent>,
    super::agent::CmAgent,
    std::sync::mpsc::Receiver<CmEvent>,
) {
    use super::agent::CmAgent;
    let (port_a, port_b) = mem_link(a_drops);
    let (sink_a, seen_a) = event_channel();
    let (sink_b, seen_b) = event_channel();
    let a = CmAgent::start(CmManager::new(A, 1, 0x5000), Box::new(port_a), sink_a).unwrap();
    let mut mb = CmManager::new(B, 2, 0x1000);
    mb.listen(service_id(port_space::TCP, 1)).unwrap();
    let start = if hold_b {
        CmAgent::start_held
    } else {
        CmAgent::start
    };
    let b = start(mb, Box::new(port_b), sink_b).unwrap();
    (a, seen_a, b, seen_b)
}

/// B accepts `conn_b` with QPN 0x33.
fn accept_as_b(b: &super::agent::CmAgent, conn_b: ConnId) {
    b.command(|m, now| {
        m.accept(
            now,
            conn_b,
            AcceptParams {
                qpn: 0x33,
                ..Default::default()
            },
        )
    })
    .unwrap();
}

#[test]
fn agent_threads_drive_a_connection_and_its_retries() {
    // A's first MAD (its REQ) is lost: A's thread must send it again on its own.
    let (a, seen_a, b, seen_b) = two_agents(1, false);
    let started = Instant::now();
    let conn_a = a.command(|m, now| m.connect(now, params_to_b())).unwrap();
    let CmEvent::Request { conn: conn_b, .. } = next_event(&seen_b) else {
        panic!("a request")
    };
    assert!(
        started.elapsed() >= cm_time(RESPONSE_TIMEOUT),
        "the REQ came again, after its wait"
    );
    accept_as_b(&b, conn_b);
    let CmEvent::Reply { conn, rep, .. } = next_event(&seen_a) else {
        panic!("a reply")
    };
    assert_eq!((conn, rep.local_qpn), (conn_a, 0x33));
    a.command(|m, _| m.ready_to_use(conn_a, &[])).unwrap();
    assert_eq!(next_event(&seen_b), CmEvent::Established { conn: conn_b });
    a.command(|m, now| m.disconnect(now, conn_a, &[])).unwrap();
    assert_eq!(next_event(&seen_b), CmEvent::Disconnected { conn: conn_b });
    assert_eq!(next_event(&seen_a), CmEvent::Disconnected { conn: conn_a });
}

#[test]
fn a_held_agent_keeps_a_request_that_came_first_until_released() {
    let (a, seen_a, b, seen_b) = two_agents(0, true);
    let conn_a = a.command(|m, now| m.connect(now, params_to_b())).unwrap();
    // B's manager takes the REQ while held...
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.command(|m, _| m.connections()) == 0 {
        assert!(Instant::now() < deadline, "B never took the REQ");
        std::thread::sleep(Duration::from_millis(5));
    }
    // ...and keeps its event back, however long its owner takes to be ready.
    assert!(seen_b.recv_timeout(Duration::from_millis(200)).is_err());
    b.release();
    let released = Instant::now();
    let CmEvent::Request { conn: conn_b, .. } = next_event(&seen_b) else {
        panic!("the request, once released")
    };
    assert!(
        released.elapsed() < cm_time(RESPONSE_TIMEOUT),
        "the held event goes out within the thread's next wait once released"
    );
    accept_as_b(&b, conn_b);
    let CmEvent::Reply { conn, .. } = next_event(&seen_a) else {
        panic!("a reply")
    };
    assert_eq!(conn, conn_a);
}

#[test]
fn an_agent_dropped_by_its_own_callback_lets_the_callback_finish() {
    use super::agent::CmAgent;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let (port_a, port_b) = mem_link(0);
    let (sink_a, _seen_a) = event_channel();
    let a = CmAgent::start(CmManager::new(A, 1, 0x5000), Box::new(port_a), sink_a).unwrap();
    // B's owner lives only in B's callback, as a listener whose last reference the callback
    // holds while the listener is dropped elsewhere.
    let slot: Arc<Mutex<Option<CmAgent>>> = Arc::new(Mutex::new(None));
    let finished = Arc::new(AtomicBool::new(false));
    let (owner, done) = (slot.clone(), finished.clone());
    let mut mb = CmManager::new(B, 2, 0x1000);
    mb.listen(service_id(port_space::TCP, 1)).unwrap();
    let b = CmAgent::start_held(
        mb,
        Box::new(port_b),
        Box::new(move |_| {
            let agent = owner.lock().unwrap().take();
            drop(agent);
            done.store(true, Ordering::Release);
        }),
    )
    .unwrap();
    slot.lock().unwrap().get_or_insert(b).release();
    a.command(|m, now| m.connect(now, params_to_b())).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !finished.load(Ordering::Acquire) {
        assert!(Instant::now() < deadline, "the callback never finished");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(slot.lock().unwrap().is_none());
}
