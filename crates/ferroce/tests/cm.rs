//! Connection management over real TCP sockets on 127.0.0.1.
//!
//! Well-behaved peers are this module on both ends, in two threads. Misbehaving peers are raw
//! sockets writing bytes built here from the documented layout, independently of the module's
//! encoder, so these tests also pin the wire format.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use ferroce::cm::{
    self, CmError, Connection, EndpointInfo, EndpointProblem, Listener, MessageKind, Phase,
    RemoteRegion, MAX_ENDPOINTS, VERSION,
};
use ferroce_proto::PathMtu;
use ferroce_wire::Psn;

const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(10);
/// A generous upper bound: a timeout must fire, not fire precisely.
const BOUND: Duration = Duration::from_secs(5);

fn loopback() -> SocketAddr {
    (Ipv4Addr::LOCALHOST, 0).into()
}

fn ep(qpn: u32, psn: u32, mtu: PathMtu, region: Option<RemoteRegion>) -> EndpointInfo {
    EndpointInfo {
        qpn,
        psn: Psn::new(psn),
        gid: Ipv4Addr::new(192, 168, 7, 9).to_ipv6_mapped(),
        udp_port: 4791,
        mtu,
        max_rd_atomic: 8,
        region,
        acks_unasked: false,
        small_identifications: false,
        selective_repeat: false,
    }
}

/// Endpoint `i` of a side, every field distinct per index so misordering or mixing shows.
fn numbered(side: u32, i: u32) -> EndpointInfo {
    let mtus = [
        PathMtu::Mtu256,
        PathMtu::Mtu512,
        PathMtu::Mtu1024,
        PathMtu::Mtu2048,
        PathMtu::Mtu4096,
    ];
    EndpointInfo {
        qpn: (side << 16) | i,
        psn: Psn::new(0x00ff_ffff - i - side),
        gid: Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, side as u16, i as u16),
        udp_port: 10_000 + i as u16,
        mtu: mtus[i as usize % mtus.len()],
        max_rd_atomic: (i % 17) as u8,
        region: (i % 3 != 0).then_some(RemoteRegion {
            addr: 0x1000 * u64::from(i),
            rkey: 0xabc0_0000 | i,
            len: u64::from(i) * 4096 + 1,
        }),
        acks_unasked: i % 2 == 1,
        small_identifications: i % 4 < 2,
        selective_repeat: i % 3 == 1,
    }
}

/// Runs `accept_many` in a thread; returns the address to connect to.
fn spawn_acceptor(
    local: Vec<EndpointInfo>,
    timeout: Duration,
) -> (SocketAddr, JoinHandle<cm::Result<Connection>>) {
    let listener = Listener::bind(loopback()).unwrap();
    let addr = listener.local_addr();
    let handle = thread::spawn(move || listener.accept_many(&local, timeout));
    (addr, handle)
}

// ---- raw wire encoding, written from the documented layout ----

#[derive(Clone, Copy)]
struct RawRecord {
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
    port: u16,
    mtu: u16,
    max_rd_atomic: u8,
    flags: u8,
    reserved30: [u8; 2],
    addr: u64,
    len: u64,
    rkey: u32,
    reserved52: [u8; 4],
}

impl RawRecord {
    fn of(e: &EndpointInfo) -> RawRecord {
        let r = e.region.unwrap_or(RemoteRegion {
            addr: 0,
            rkey: 0,
            len: 0,
        });
        RawRecord {
            qpn: e.qpn,
            psn: e.psn.value(),
            gid: e.gid.octets(),
            port: e.udp_port,
            mtu: e.mtu.bytes() as u16,
            max_rd_atomic: e.max_rd_atomic,
            flags: u8::from(e.region.is_some())
                | (u8::from(e.acks_unasked) << 1)
                | (u8::from(e.small_identifications) << 2),
            reserved30: [0; 2],
            addr: r.addr,
            len: r.len,
            rkey: r.rkey,
            reserved52: [0; 4],
        }
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&self.qpn.to_be_bytes());
        b.extend_from_slice(&self.psn.to_be_bytes());
        b.extend_from_slice(&self.gid);
        b.extend_from_slice(&self.port.to_be_bytes());
        b.extend_from_slice(&self.mtu.to_be_bytes());
        b.push(self.max_rd_atomic);
        b.push(self.flags);
        b.extend_from_slice(&self.reserved30);
        b.extend_from_slice(&self.addr.to_be_bytes());
        b.extend_from_slice(&self.len.to_be_bytes());
        b.extend_from_slice(&self.rkey.to_be_bytes());
        b.extend_from_slice(&self.reserved52);
        assert_eq!(b.len(), 56);
        b
    }
}

fn raw_header(magic: &[u8; 4], version: u8, kind: u8, count: u16, len: u32) -> Vec<u8> {
    let mut h = magic.to_vec();
    h.push(version);
    h.push(kind);
    h.extend_from_slice(&count.to_be_bytes());
    h.extend_from_slice(&len.to_be_bytes());
    h
}

fn raw_endpoints(records: &[RawRecord]) -> Vec<u8> {
    let mut m = raw_header(
        b"FRCE",
        1,
        1,
        records.len() as u16,
        (records.len() * 56) as u32,
    );
    for r in records {
        m.extend(r.bytes());
    }
    m
}

/// Connects a raw socket to `listener`, sends `bytes`, then runs `accept` while the raw socket
/// stays open (the listen backlog completes the TCP handshake before `accept` is called).
fn accept_from_raw(
    local: &[EndpointInfo],
    bytes: &[u8],
    timeout: Duration,
) -> (CmError, TcpStream) {
    let listener = Listener::bind(loopback()).unwrap();
    let mut raw = TcpStream::connect(listener.local_addr()).unwrap();
    raw.write_all(bytes).unwrap();
    let err = listener
        .accept_many(local, timeout)
        .expect_err("accept must reject this peer");
    (err, raw)
}

/// A raw server: accepts one connection, reads the connector's ENDPOINTS message, writes
/// `reply`, then holds the connection until the connector closes it (so the connector never sees
/// a reset instead of the reply). Returns what the connector sent.
fn raw_server(reply: Vec<u8>) -> (SocketAddr, JoinHandle<Vec<u8>>) {
    let listener = TcpListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let handle = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(LONG)).unwrap();
        let mut header = [0u8; 12];
        s.read_exact(&mut header).unwrap();
        let len = u32::from_be_bytes(header[8..12].try_into().unwrap()) as usize;
        let mut body = vec![0u8; len];
        s.read_exact(&mut body).unwrap();
        s.write_all(&reply).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        let mut sent = header.to_vec();
        sent.extend(body);
        sent
    });
    (addr, handle)
}

// ---- successful exchanges ----

#[test]
fn single_endpoint_both_directions_with_and_without_region() {
    let server_ep = EndpointInfo {
        qpn: 0x00ff_ffff,
        psn: Psn::new(0x00ff_ffff),
        gid: "fe80::1:2:3:4".parse().unwrap(),
        udp_port: 50_000,
        mtu: PathMtu::Mtu4096,
        max_rd_atomic: 16,
        region: Some(RemoteRegion {
            addr: 0xffff_ffff_ffff_f000,
            rkey: 0xdead_beef,
            len: 0x1000,
        }),
        acks_unasked: true,
        small_identifications: true,
        selective_repeat: true,
    };
    let client_ep = EndpointInfo {
        qpn: 0x12,
        psn: Psn::new(0),
        gid: Ipv4Addr::LOCALHOST.to_ipv6_mapped(),
        udp_port: 4791,
        mtu: PathMtu::Mtu256,
        max_rd_atomic: 0,
        region: None,
        acks_unasked: false,
        small_identifications: false,
        selective_repeat: false,
    };
    let (addr, server) = spawn_acceptor(vec![server_ep], LONG);
    let client = cm::connect(addr, &client_ep, LONG).unwrap();
    let server = server.join().unwrap().unwrap();

    // The client learned everything about the server, field by field.
    let p = client.peer;
    assert_eq!(p.qpn, 0x00ff_ffff);
    assert_eq!(p.psn, Psn::new(0x00ff_ffff));
    assert_eq!(p.gid, "fe80::1:2:3:4".parse::<Ipv6Addr>().unwrap());
    assert_eq!(p.udp_port, 50_000);
    assert_eq!(p.mtu, PathMtu::Mtu4096);
    assert_eq!(p.max_rd_atomic, 16);
    assert_eq!(
        p.region,
        Some(RemoteRegion {
            addr: 0xffff_ffff_ffff_f000,
            rkey: 0xdead_beef,
            len: 0x1000
        })
    );
    assert!(p.acks_unasked);
    assert!(p.small_identifications);
    assert_eq!(client.peers, vec![server_ep]);
    assert_eq!(client.peer_addr, addr);

    // And the server everything about the client, including the absent region.
    let p = server.peer;
    assert_eq!(p.qpn, 0x12);
    assert_eq!(p.psn, Psn::new(0));
    assert_eq!(p.gid, Ipv4Addr::LOCALHOST.to_ipv6_mapped());
    assert_eq!(p.udp_port, 4791);
    assert_eq!(p.mtu, PathMtu::Mtu256);
    assert_eq!(p.max_rd_atomic, 0);
    assert_eq!(p.region, None);
    assert!(!p.acks_unasked);
    assert!(!p.small_identifications);
    assert_eq!(server.peers, vec![client_ep]);
    assert_eq!(server.peer_addr, client.local_addr().unwrap());
}

#[test]
fn both_sides_with_regions_and_both_without() {
    for with_region in [true, false] {
        let region = |a| {
            with_region.then_some(RemoteRegion {
                addr: a,
                rkey: a as u32,
                len: 77,
            })
        };
        let a = ep(1, 100, PathMtu::Mtu1024, region(0x1000));
        let b = ep(2, 200, PathMtu::Mtu1024, region(0x2000));
        let (addr, server) = spawn_acceptor(vec![a], LONG);
        let client = cm::connect(addr, &b, LONG).unwrap();
        let server = server.join().unwrap().unwrap();
        assert_eq!(client.peer, a);
        assert_eq!(server.peer, b);
        assert_eq!(client.peer.region.is_some(), with_region);
    }
}

#[test]
fn connector_sends_the_documented_layout() {
    let mine = ep(
        0xabcdef,
        0x123456,
        PathMtu::Mtu2048,
        Some(RemoteRegion {
            addr: 0x0102_0304_0506_0708,
            rkey: 0x1122_3344,
            len: 0x1_0000_0000,
        }),
    );
    let theirs = ep(7, 8, PathMtu::Mtu512, None);
    let (addr, server) = raw_server(raw_endpoints(&[RawRecord::of(&theirs)]));
    let conn = cm::connect(addr, &mine, LONG).unwrap();
    assert_eq!(conn.peer, theirs);
    drop(conn);
    let sent = server.join().unwrap();
    assert_eq!(sent, raw_endpoints(&[RawRecord::of(&mine)]));
    // Spot-check a few offsets against the table in the module doc.
    assert_eq!(&sent[..6], b"FRCE\x01\x01");
    assert_eq!(&sent[12..16], &[0, 0xab, 0xcd, 0xef]);
    assert_eq!(&sent[12 + 26..12 + 30], &[0x08, 0x00, 8, 1]);
}

#[test]
fn sixty_four_endpoints_keep_their_order() {
    let server_eps: Vec<_> = (0..64).map(|i| numbered(1, i)).collect();
    let client_eps: Vec<_> = (0..64).map(|i| numbered(2, i)).collect();
    let (addr, server) = spawn_acceptor(server_eps.clone(), LONG);
    let client = cm::connect_many(addr, &client_eps, LONG).unwrap();
    let server = server.join().unwrap().unwrap();
    assert_eq!(client.peers, server_eps);
    assert_eq!(server.peers, client_eps);
    assert_eq!(client.peer, server_eps[0]);
    assert_eq!(server.peer, client_eps[0]);
}

#[test]
fn maximum_endpoint_count_goes_through() {
    let server_eps: Vec<_> = (0..MAX_ENDPOINTS as u32).map(|i| numbered(3, i)).collect();
    let client_eps: Vec<_> = (0..MAX_ENDPOINTS as u32).map(|i| numbered(4, i)).collect();
    let (addr, server) = spawn_acceptor(server_eps.clone(), LONG);
    let client = cm::connect_many(addr, &client_eps, LONG).unwrap();
    let server = server.join().unwrap().unwrap();
    assert_eq!(client.peers, server_eps);
    assert_eq!(server.peers, client_eps);
}

#[test]
fn later_exchange_on_the_same_connection() {
    let (addr, server) = spawn_acceptor(vec![numbered(1, 0)], LONG);
    let mut client = cm::connect(addr, &numbered(2, 0), LONG).unwrap();
    let mut server = server.join().unwrap().unwrap();
    let server_round2: Vec<_> = (1..5).map(|i| numbered(1, i)).collect();
    let client_round2: Vec<_> = (1..5).map(|i| numbered(2, i)).collect();
    let s2 = server_round2.clone();
    let t = thread::spawn(move || {
        let got = server.exchange(&s2, LONG);
        (server, got)
    });
    let got = client.exchange(&client_round2, LONG).unwrap();
    let (server, server_got) = t.join().unwrap();
    assert_eq!(got, server_round2);
    assert_eq!(server_got.unwrap(), client_round2);
    // The handshake's results stay as they were.
    assert_eq!(client.peer, numbered(1, 0));
    assert_eq!(server.peers, vec![numbered(2, 0)]);
}

#[test]
fn agreed_mtu_is_the_smaller() {
    for (s, c) in [
        (PathMtu::Mtu4096, PathMtu::Mtu1024),
        (PathMtu::Mtu256, PathMtu::Mtu2048),
        (PathMtu::Mtu512, PathMtu::Mtu512),
    ] {
        let server_ep = ep(1, 1, s, None);
        let client_ep = ep(2, 2, c, None);
        let (addr, server) = spawn_acceptor(vec![server_ep], LONG);
        let client = cm::connect(addr, &client_ep, LONG).unwrap();
        let server = server.join().unwrap().unwrap();
        let want = if s.bytes() < c.bytes() { s } else { c };
        assert_eq!(client.mtu(&client_ep), want);
        assert_eq!(server.mtu(&server_ep), want);
    }
}

// ---- sync ----

#[test]
fn sync_waits_for_the_peer() {
    let (addr, server) = spawn_acceptor(vec![ep(1, 1, PathMtu::Mtu1024, None)], LONG);
    let mut client = cm::connect(addr, &ep(2, 2, PathMtu::Mtu1024, None), LONG).unwrap();
    let mut server = server.join().unwrap().unwrap();
    let late = Duration::from_millis(300);
    let t = thread::spawn(move || {
        thread::sleep(late);
        server.sync(LONG).unwrap();
        server.sync(LONG).unwrap();
        server
    });
    let start = Instant::now();
    client.sync(LONG).unwrap();
    let waited = start.elapsed();
    client.sync(LONG).unwrap();
    t.join().unwrap();
    assert!(
        waited >= late - Duration::from_millis(50),
        "sync returned after {waited:?}, before the peer synced"
    );
}

#[test]
fn sync_times_out_when_the_peer_never_syncs() {
    let (addr, server) = spawn_acceptor(vec![ep(1, 1, PathMtu::Mtu1024, None)], LONG);
    let mut client = cm::connect(addr, &ep(2, 2, PathMtu::Mtu1024, None), LONG).unwrap();
    let server = server.join().unwrap().unwrap(); // held open, silent
    let start = Instant::now();
    let err = client.sync(SHORT).unwrap_err();
    let elapsed = start.elapsed();
    assert!(
        matches!(err, CmError::Timeout { phase: Phase::Sync, timeout, .. } if timeout == SHORT),
        "{err:?}"
    );
    assert!(elapsed >= SHORT && elapsed < BOUND, "{elapsed:?}");
    assert_eq!(
        err.to_string(),
        format!("peer {addr} did not answer within 300ms while waiting for the ready signal")
    );
    drop(server);
}

#[test]
fn sync_reports_a_peer_that_closed() {
    let (addr, server) = spawn_acceptor(vec![ep(1, 1, PathMtu::Mtu1024, None)], LONG);
    let mut client = cm::connect(addr, &ep(2, 2, PathMtu::Mtu1024, None), LONG).unwrap();
    drop(server.join().unwrap().unwrap());
    let start = Instant::now();
    let err = client.sync(LONG).unwrap_err();
    assert!(
        matches!(err, CmError::Closed { phase: Phase::Sync, peer } if peer == addr),
        "{err:?}"
    );
    assert!(start.elapsed() < BOUND);
}

#[test]
fn sync_against_exchange_is_an_unexpected_message() {
    // The connector calls exchange (it speaks first, so its ENDPOINTS goes out) while the
    // acceptor calls sync (its READY goes out at once): each receives the other kind.
    let (addr, server) = spawn_acceptor(vec![ep(1, 1, PathMtu::Mtu1024, None)], LONG);
    let mut client = cm::connect(addr, &ep(2, 2, PathMtu::Mtu1024, None), LONG).unwrap();
    let mut server = server.join().unwrap().unwrap();
    let t = thread::spawn(move || server.sync(LONG));
    let err = client
        .exchange(&[ep(3, 3, PathMtu::Mtu1024, None)], LONG)
        .unwrap_err();
    assert!(
        matches!(
            err,
            CmError::UnexpectedMessage {
                got: 2,
                expected: MessageKind::Endpoints,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("peer {addr} sent a message of kind 2 (READY), expected ENDPOINTS")
    );
    let server_err = t.join().unwrap().unwrap_err();
    assert!(
        matches!(
            server_err,
            CmError::UnexpectedMessage {
                got: 1,
                expected: MessageKind::Ready,
                ..
            }
        ),
        "{server_err:?}"
    );
}

// ---- silent, slow and vanishing peers ----

#[test]
fn silent_connector_times_out() {
    let start = Instant::now();
    let (err, _raw) = accept_from_raw(&[ep(1, 1, PathMtu::Mtu1024, None)], &[], SHORT);
    let elapsed = start.elapsed();
    assert!(
        matches!(err, CmError::Timeout { phase: Phase::Exchange, timeout, .. } if timeout == SHORT),
        "{err:?}"
    );
    assert!(elapsed >= SHORT && elapsed < BOUND, "{elapsed:?}");
}

#[test]
fn silent_acceptor_times_out() {
    // Accepts (via the backlog), reads nothing, answers nothing.
    let listener = TcpListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let start = Instant::now();
    let err = cm::connect(addr, &ep(1, 1, PathMtu::Mtu1024, None), SHORT).unwrap_err();
    let elapsed = start.elapsed();
    assert!(
        matches!(err, CmError::Timeout { phase: Phase::Exchange, peer, .. } if peer == addr),
        "{err:?}"
    );
    assert!(elapsed >= SHORT && elapsed < BOUND, "{elapsed:?}");
    assert_eq!(
        err.to_string(),
        format!("peer {addr} did not answer within 300ms while exchanging endpoint parameters")
    );
}

#[test]
fn accept_with_no_peer_times_out() {
    let listener = Listener::bind(loopback()).unwrap();
    let start = Instant::now();
    let err = listener
        .accept(&ep(1, 1, PathMtu::Mtu1024, None), SHORT)
        .unwrap_err();
    let elapsed = start.elapsed();
    assert!(
        matches!(err, CmError::AcceptTimeout { local, timeout } if local == listener.local_addr() && timeout == SHORT),
        "{err:?}"
    );
    assert!(elapsed >= SHORT && elapsed < BOUND, "{elapsed:?}");
}

#[test]
fn trickling_peer_is_bounded_by_the_whole_timeout() {
    // A valid message, one byte every 50 ms: 68 bytes would take 3.4 s. The timeout bounds the
    // whole message, not each read, so accept must give up after about 300 ms.
    let listener = Listener::bind(loopback()).unwrap();
    let addr = listener.local_addr();
    let msg = raw_endpoints(&[RawRecord::of(&ep(5, 5, PathMtu::Mtu1024, None))]);
    let trickler = thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_nodelay(true).unwrap();
        for b in msg {
            if s.write_all(&[b]).is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
    });
    let start = Instant::now();
    let err = listener
        .accept(&ep(1, 1, PathMtu::Mtu1024, None), SHORT)
        .unwrap_err();
    let elapsed = start.elapsed();
    assert!(matches!(err, CmError::Timeout { .. }), "{err:?}");
    assert!(
        elapsed >= SHORT && elapsed < Duration::from_secs(2),
        "{elapsed:?}"
    );
    trickler.join().unwrap();
}

#[test]
fn truncated_message_then_close_is_reported_at_once() {
    let good = raw_endpoints(&[
        RawRecord::of(&ep(5, 5, PathMtu::Mtu1024, None)),
        RawRecord::of(&ep(6, 6, PathMtu::Mtu1024, None)),
    ]);
    // Cut inside the header, and inside the second record.
    for cut in [7, 12 + 56 + 20] {
        let listener = Listener::bind(loopback()).unwrap();
        let mut raw = TcpStream::connect(listener.local_addr()).unwrap();
        raw.write_all(&good[..cut]).unwrap();
        drop(raw);
        let start = Instant::now();
        let local = [
            ep(1, 1, PathMtu::Mtu1024, None),
            ep(2, 2, PathMtu::Mtu1024, None),
        ];
        let err = listener.accept_many(&local, LONG).unwrap_err();
        assert!(
            matches!(
                err,
                CmError::Closed {
                    phase: Phase::Exchange,
                    ..
                }
            ),
            "cut at {cut}: {err:?}"
        );
        // Reported on the close, not after the 10 s timeout.
        assert!(start.elapsed() < BOUND);
    }
}

#[test]
fn acceptor_closing_without_answer_is_reported() {
    let listener = TcpListener::bind(loopback()).unwrap();
    let addr = listener.local_addr().unwrap();
    let t = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 68];
        s.read_exact(&mut buf).unwrap();
        // Closes without answering.
    });
    let err = cm::connect(addr, &ep(1, 1, PathMtu::Mtu1024, None), LONG).unwrap_err();
    t.join().unwrap();
    assert!(
        matches!(err, CmError::Closed { phase: Phase::Exchange, peer } if peer == addr),
        "{err:?}"
    );
}

#[test]
fn connect_to_a_closed_port_is_refused() {
    let addr = {
        let l = TcpListener::bind(loopback()).unwrap();
        l.local_addr().unwrap()
    };
    let err = cm::connect(addr, &ep(1, 1, PathMtu::Mtu1024, None), LONG).unwrap_err();
    assert!(
        matches!(err, CmError::Refused { addr: a } if a == addr),
        "{err:?}"
    );
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}

// ---- validation of what the peer sends ----

#[test]
fn garbage_is_bad_magic_on_both_sides() {
    let (err, _raw) = accept_from_raw(
        &[ep(1, 1, PathMtu::Mtu1024, None)],
        b"GET / HTTP/1.1\r\n\r\n",
        LONG,
    );
    assert!(
        matches!(err, CmError::BadMagic { got, .. } if got == *b"GET "),
        "{err:?}"
    );

    let (addr, server) = raw_server(b"SSH-2.0-OpenSSH_9.6\r\n".to_vec());
    let err = cm::connect(addr, &ep(1, 1, PathMtu::Mtu1024, None), LONG).unwrap_err();
    server.join().unwrap();
    assert!(
        matches!(err, CmError::BadMagic { got, .. } if got == *b"SSH-"),
        "{err:?}"
    );
    assert!(
        err.to_string().contains("does not speak ferroce CM"),
        "{err}"
    );
}

#[test]
fn unknown_version_is_reported_and_answered() {
    // A connector from the future: the acceptor fails, but first tells it which version it speaks.
    let mut future = raw_header(b"FRCE", 9, 1, 1, 56);
    future.extend([0u8; 56]);
    let mine = ep(0x42, 1, PathMtu::Mtu1024, None);
    let (err, mut raw) = accept_from_raw(&[mine], &future, LONG);
    assert!(
        matches!(
            err,
            CmError::Version {
                got: 9,
                supported: 1,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(VERSION, 1);
    let peer = raw.local_addr().unwrap();
    assert_eq!(
        err.to_string(),
        format!("peer {peer} speaks ferroce CM version 9, this is version 1")
    );
    raw.set_read_timeout(Some(LONG)).unwrap();
    let mut answer = [0u8; 68];
    raw.read_exact(&mut answer).unwrap();
    assert_eq!(answer.to_vec(), raw_endpoints(&[RawRecord::of(&mine)]));

    // An acceptor from the future.
    let mut reply = raw_header(b"FRCE", 2, 1, 1, 56);
    reply.extend([0u8; 56]);
    let (addr, server) = raw_server(reply);
    let err = cm::connect(addr, &ep(1, 1, PathMtu::Mtu1024, None), LONG).unwrap_err();
    server.join().unwrap();
    assert!(
        matches!(err, CmError::Version { got: 2, supported: 1, peer } if peer == addr),
        "{err:?}"
    );
}

#[test]
fn invalid_fields_are_named() {
    let good = RawRecord::of(&ep(5, 5, PathMtu::Mtu1024, None));
    type Case = (&'static str, fn(&mut RawRecord), EndpointProblem);
    let cases: [Case; 14] = [
        (
            "qpn",
            |r| r.qpn = 0x0100_0000,
            EndpointProblem::Qpn(0x0100_0000),
        ),
        (
            "qpn max",
            |r| r.qpn = u32::MAX,
            EndpointProblem::Qpn(u32::MAX),
        ),
        (
            "psn",
            |r| r.psn = 0x0100_0000,
            EndpointProblem::Psn(0x0100_0000),
        ),
        ("mtu 1000", |r| r.mtu = 1000, EndpointProblem::Mtu(1000)),
        ("mtu 0", |r| r.mtu = 0, EndpointProblem::Mtu(0)),
        ("mtu 8192", |r| r.mtu = 8192, EndpointProblem::Mtu(8192)),
        (
            "max_rd_atomic",
            |r| r.max_rd_atomic = 17,
            EndpointProblem::MaxRdAtomic(17),
        ),
        ("udp port", |r| r.port = 0, EndpointProblem::UdpPort),
        (
            "gid",
            |r| r.gid = [0; 16],
            EndpointProblem::Gid(Ipv6Addr::UNSPECIFIED),
        ),
        ("flags", |r| r.flags = 0x11, EndpointProblem::Flags(0x11)),
        (
            "reserved 31",
            |r| r.reserved30[1] = 1,
            EndpointProblem::Reserved(31),
        ),
        (
            "reserved 54",
            |r| r.reserved52[2] = 0xff,
            EndpointProblem::Reserved(54),
        ),
        ("stray region", |r| r.rkey = 9, EndpointProblem::StrayRegion),
        (
            "region wraps",
            |r| {
                r.flags = 1;
                r.addr = u64::MAX - 10;
                r.len = 12;
            },
            EndpointProblem::RegionWraps {
                addr: u64::MAX - 10,
                len: 12,
            },
        ),
    ];
    let local = [
        ep(1, 1, PathMtu::Mtu1024, None),
        ep(2, 2, PathMtu::Mtu1024, None),
    ];
    for (name, mutate, want) in cases {
        let mut bad = good;
        mutate(&mut bad);
        let (err, _raw) = accept_from_raw(&local, &raw_endpoints(&[good, bad]), LONG);
        assert!(
            matches!(err, CmError::InvalidPeerEndpoint { index: 1, problem, .. } if problem == want),
            "{name}: {err:?}"
        );
    }
}

#[test]
fn invalid_field_from_the_acceptor_is_named() {
    let mut bad = RawRecord::of(&ep(5, 5, PathMtu::Mtu1024, None));
    bad.qpn = 0x0100_0000;
    let (addr, server) = raw_server(raw_endpoints(&[bad]));
    let err = cm::connect(addr, &ep(1, 1, PathMtu::Mtu1024, None), LONG).unwrap_err();
    server.join().unwrap();
    assert!(
        matches!(
            err,
            CmError::InvalidPeerEndpoint {
                index: 0,
                problem: EndpointProblem::Qpn(0x0100_0000),
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!("peer {addr} sent an invalid endpoint #0: QP number 0x1000000, beyond 24 bits")
    );
}

#[test]
fn bad_headers_are_rejected() {
    let record = RawRecord::of(&ep(5, 5, PathMtu::Mtu1024, None)).bytes();
    let with_body = |mut h: Vec<u8>| {
        h.extend_from_slice(&record);
        h
    };
    let local = [ep(1, 1, PathMtu::Mtu1024, None)];

    let (err, _raw) = accept_from_raw(&local, &raw_header(b"FRCE", 1, 1, 0, 0), LONG);
    assert!(
        matches!(
            err,
            CmError::BadCount {
                got: 0,
                kind: MessageKind::Endpoints,
                ..
            }
        ),
        "{err:?}"
    );

    let (err, _raw) = accept_from_raw(&local, &raw_header(b"FRCE", 1, 1, 1025, 1025 * 56), LONG);
    assert!(
        matches!(err, CmError::BadCount { got: 1025, .. }),
        "{err:?}"
    );

    let (err, _raw) = accept_from_raw(&local, &with_body(raw_header(b"FRCE", 1, 1, 1, 57)), LONG);
    assert!(
        matches!(
            err,
            CmError::BadLength {
                got: 57,
                expected: 56,
                ..
            }
        ),
        "{err:?}"
    );

    // A length that would make a naive reader allocate 4 GiB.
    let (err, _raw) = accept_from_raw(&local, &raw_header(b"FRCE", 1, 1, 1, u32::MAX), LONG);
    assert!(
        matches!(err, CmError::BadLength { got: u32::MAX, .. }),
        "{err:?}"
    );

    let (err, _raw) = accept_from_raw(&local, &raw_header(b"FRCE", 1, 2, 0, 0), LONG);
    assert!(
        matches!(
            err,
            CmError::UnexpectedMessage {
                got: 2,
                expected: MessageKind::Endpoints,
                ..
            }
        ),
        "{err:?}"
    );

    let (err, _raw) = accept_from_raw(&local, &with_body(raw_header(b"FRCE", 1, 7, 1, 56)), LONG);
    assert!(
        matches!(err, CmError::UnexpectedMessage { got: 7, .. }),
        "{err:?}"
    );
}

#[test]
fn count_mismatch_fails_on_both_sides() {
    let server_eps: Vec<_> = (0..3).map(|i| numbered(1, i)).collect();
    let client_eps: Vec<_> = (0..2).map(|i| numbered(2, i)).collect();
    let (addr, server) = spawn_acceptor(server_eps, LONG);
    let client_err = cm::connect_many(addr, &client_eps, LONG).unwrap_err();
    let server_err = server.join().unwrap().unwrap_err();
    assert!(
        matches!(
            client_err,
            CmError::CountMismatch {
                local: 2,
                remote: 3,
                ..
            }
        ),
        "{client_err:?}"
    );
    assert!(
        matches!(
            server_err,
            CmError::CountMismatch {
                local: 3,
                remote: 2,
                ..
            }
        ),
        "{server_err:?}"
    );
}

// ---- validation of what the caller passes ----

#[test]
fn local_endpoints_are_checked_before_touching_the_network() {
    // The port is closed: reaching the network would give Refused instead.
    let closed = {
        let l = TcpListener::bind(loopback()).unwrap();
        l.local_addr().unwrap()
    };
    let mut bad = ep(1, 1, PathMtu::Mtu1024, None);
    bad.qpn = 0x0100_0000;
    let err = cm::connect_many(closed, &[ep(2, 2, PathMtu::Mtu1024, None), bad], LONG).unwrap_err();
    assert!(
        matches!(
            err,
            CmError::InvalidLocalEndpoint {
                index: 1,
                problem: EndpointProblem::Qpn(0x0100_0000)
            }
        ),
        "{err:?}"
    );

    let err = cm::connect_many(closed, &[], LONG).unwrap_err();
    assert!(matches!(err, CmError::LocalCount { count: 0 }), "{err:?}");

    let many = vec![ep(1, 1, PathMtu::Mtu1024, None); MAX_ENDPOINTS + 1];
    let err = cm::connect_many(closed, &many, LONG).unwrap_err();
    assert!(
        matches!(err, CmError::LocalCount { count: 1025 }),
        "{err:?}"
    );

    let listener = Listener::bind(loopback()).unwrap();
    let mut bad = ep(1, 1, PathMtu::Mtu1024, None);
    bad.udp_port = 0;
    let err = listener.accept(&bad, LONG).unwrap_err();
    assert!(
        matches!(
            err,
            CmError::InvalidLocalEndpoint {
                index: 0,
                problem: EndpointProblem::UdpPort
            }
        ),
        "{err:?}"
    );
}

#[test]
fn binding_a_busy_address_fails() {
    let first = Listener::bind(loopback()).unwrap();
    let err = Listener::bind(first.local_addr()).unwrap_err();
    assert!(
        matches!(err, CmError::Listen { addr, .. } if addr == first.local_addr()),
        "{err:?}"
    );
}
