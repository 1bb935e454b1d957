//! How much of the ICRC a packet over UDP is checked by, against live contexts on 127.0.0.1.
//!
//! A UDP socket does not show the IPv4 Identification the ICRC covers, so the receive path
//! solves for it: a packet that verifies only for a solved Identification is checked by 16 bits
//! of its ICRC. ferroce's senders use Identifications below `SENT_IDENTIFICATION_LIMIT` (64), so
//! a QP whose peer is known to be ferroce (the connection exchange says so) believes only those
//! (26 bits); a strict context believes none (32 bits) and sends without GSO, so two strict
//! contexts still move bulk data.
//!
//! The attacker is a plain UDP socket on the peer's IP that forges in-sequence SENDs, each with
//! an ICRC sealed for a chosen Identification (a valid packet as far as any receiver can tell).
//! An accepted one is proven by its receive completion and bytes, a refused one by
//! `icrc_errors` and the absence of a completion.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::thread;
use std::time::{Duration, Instant};

use ferroce::cm::{self, EndpointInfo, Listener};
use ferroce::{
    device_by_name, gid_of, Access, CompletionQueue, ConnectOptions, Context, ContextCounters,
    ContextOptions, InitAttr, MemoryRegion, PathMtu, ProtectionDomain, Provider, QpCaps,
    QpInitAttr, QueuePair, RecvWr, RtrAttr, RtsAttr, SendOp, SendWr, WcOpcode, WcStatus,
    SENT_IDENTIFICATION_LIMIT,
};
use ferroce_wire::bth::{BthRepr, DEFAULT_PKEY};
use ferroce_wire::frame::UdpFrameHeaders;
use ferroce_wire::{icrc, ExtHeaders, Opcode, PacketRepr, Psn, RocePacket};

const T: Duration = Duration::from_secs(10);
/// How long a refused packet is given to show up as a completion anyway.
const QUIET: Duration = Duration::from_millis(200);
/// The QPN the target believes its forged peer has.
const FAKE_PEER_QPN: u32 = 0x00ab_cdef;
/// The first PSN the forged peer sends.
const PEER_PSN: u32 = 0x100;

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
}

fn open(strict: bool) -> Side {
    let ctx = device_by_name("lo")
        .unwrap()
        .open(&ContextOptions {
            capture: None,
            // The packet path is what is checked.
            provider: Provider::Udp,
            icrc_strict: strict,
            ..ContextOptions::with_port(0)
        })
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256, None).unwrap();
    Side { ctx, pd, cq }
}

fn create_qp(s: &Side) -> QueuePair {
    s.pd.create_qp(&QpInitAttr::new(&s.cq, QpCaps::default()))
        .unwrap()
}

fn counter(c: &ContextCounters, name: &str) -> u64 {
    c.named()
        .into_iter()
        .find(|(n, _)| *n == name)
        .unwrap_or_else(|| panic!("no counter {name}"))
        .1
}

/// An RC SEND_ONLY of `payload` to `qpn` at `psn`, from `src` to `dst`, its ICRC sealed for IPv4
/// Identification `ident`.
fn forged_send(
    src: SocketAddr,
    dst: SocketAddr,
    qpn: u32,
    psn: u32,
    payload: &[u8],
    ident: u16,
) -> Vec<u8> {
    let b = BthRepr {
        opcode: Opcode::RC_SEND_ONLY,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: DEFAULT_PKEY,
        fecn: false,
        becn: false,
        dest_qpn: qpn,
        ack_req: true,
        psn: Psn::new(psn),
    };
    let repr = PacketRepr::new(b, ExtHeaders::default(), payload.len());
    let mut buf = vec![0u8; repr.buffer_len().unwrap()];
    repr.emit(&mut buf).unwrap();
    let h = repr.header_len().unwrap();
    buf[h..h + payload.len()].copy_from_slice(payload);
    let mut f = UdpFrameHeaders::roce(src.ip(), src.port(), dst.ip());
    f.dst_port = dst.port();
    f.ident = ident;
    let n = buf.len();
    let hdrs = f.icrc_headers(n).unwrap();
    let crc = icrc::compute(hdrs.ip(), hdrs.udp(), &buf[..n - 4]).unwrap();
    RocePacket::new_unchecked(&mut buf[..]).set_icrc(crc);
    // The packet is what the test says it is: for Identification 0 it verifies only if that
    // is the one it was sealed for, and the receiver can solve for the one it was.
    f.ident = 0;
    let hdrs = f.icrc_headers(n).unwrap();
    let p = RocePacket::new_checked(&buf[..]).unwrap();
    let solved = icrc::solve_ipv4_identification(hdrs.ip(), hdrs.udp(), p.covered(), p.icrc());
    assert_eq!(solved.unwrap(), Some(ident));
    buf
}

/// The forged peer: a socket on the loopback address, the next PSN it sends, and the receive
/// buffer the target has posted for it.
struct Forger {
    sock: UdpSocket,
    psn: u32,
    rbuf: Option<MemoryRegion>,
}

impl Forger {
    fn new() -> Forger {
        Forger {
            sock: UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap(),
            psn: PEER_PSN,
            rbuf: None,
        }
    }

    fn addr(&self) -> SocketAddr {
        self.sock.local_addr().unwrap()
    }

    /// Sends the next SEND to `q` on `target`, sealed for `ident`; returns whether `target`
    /// accepted it (a receive completion with the bytes, counted as solved unless `ident` is 0)
    /// or refused it as an ICRC error (and nothing else: no completion). A refused PSN is sent
    /// again next time, into the receive still posted.
    fn send(&mut self, target: &Side, q: &QueuePair, ident: u16) -> bool {
        let c0 = target.ctx.counters();
        let payload = format!("psn {} ident {ident}", self.psn).into_bytes();
        if self.rbuf.is_none() {
            let rbuf = target.pd.alloc_mr(256, Access::LOCAL_WRITE).unwrap();
            q.post_recv(RecvWr {
                wr_id: u64::from(self.psn),
                sgl: vec![rbuf.sge(0, 256).unwrap()],
            })
            .unwrap();
            self.rbuf = Some(rbuf);
        }
        let dst = target.ctx.local_addr();
        let p = forged_send(self.addr(), dst, q.qpn(), self.psn, &payload, ident);
        self.sock.send_to(&p, dst).unwrap();
        // Wait for the verdict: a completion, or the datagram counted as an ICRC error (the
        // engine counts it before it would hand it over, so either shows a decision made).
        let errors =
            || counter(&target.ctx.counters(), "icrc_errors") - counter(&c0, "icrc_errors");
        let t0 = Instant::now();
        let mut wc = Vec::new();
        while wc.is_empty() && errors() == 0 {
            assert!(
                t0.elapsed() < T,
                "the target neither took nor refused the datagram"
            );
            wc = target.cq.wait(1, Duration::from_millis(1)).unwrap();
        }
        let errors = errors();
        if errors == 1 {
            // Refused: and nothing comes of it later either.
            wc = target.cq.wait(1, QUIET).unwrap();
        }
        let c1 = target.ctx.counters();
        let solved = counter(&c1, "icrc_ident_solved") - counter(&c0, "icrc_ident_solved");
        if errors == 1 {
            assert_eq!(solved, 0, "a refused packet is not counted as solved");
            assert!(wc.is_empty(), "a refused packet completed: {wc:?}");
            false
        } else {
            assert_eq!(errors, 0);
            assert_eq!(
                solved,
                u64::from(ident != 0),
                "solved for Identification {ident}"
            );
            assert_eq!(wc.len(), 1, "an accepted SEND completes");
            assert_eq!(
                (wc[0].status, wc[0].opcode, wc[0].wr_id),
                (WcStatus::Success, WcOpcode::Recv, u64::from(self.psn))
            );
            let rbuf = self.rbuf.take().unwrap();
            assert_eq!(rbuf.to_vec(0, payload.len()).unwrap(), payload);
            self.psn += 1;
            true
        }
    }
}

/// Sends SENDs sealed for each Identification in turn to a fresh QP of `target` that `setup`
/// brings up; returns which were accepted.
fn verdicts(
    target: &Side,
    idents: &[u16],
    setup: impl Fn(&QueuePair, SocketAddr, u32),
) -> Vec<(u16, bool)> {
    let q = create_qp(target);
    let mut f = Forger::new();
    setup(&q, f.addr(), f.psn);
    idents
        .iter()
        .map(|&id| (id, f.send(target, &q, id)))
        .collect()
}

/// Brings `q` to RTS towards `peer` (first PSN `psn`) without any exchange, as a program
/// written for libibverbs (or one talking to rxe) does: nothing says what the peer is.
fn plain(q: &QueuePair, peer: SocketAddr, psn: u32) {
    q.modify_to_init(&InitAttr::default()).unwrap();
    q.modify_to_rtr_with_port(
        &RtrAttr {
            path_mtu: PathMtu::Mtu1024,
            dest_qpn: FAKE_PEER_QPN,
            dest_gid: gid_of(peer.ip()),
            rq_psn: Psn::new(psn),
            max_dest_rd_atomic: 4,
            min_rnr_timer: 1,
        },
        peer.port(),
    )
    .unwrap();
    q.modify_to_rts(&RtsAttr {
        sq_psn: Psn::new(0),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 4,
    })
    .unwrap();
}

/// Connects `q` to the forged peer as [`QueuePair::connect`] does with what a ferroce peer
/// says in the connection exchange (its endpoint is built as ferroce builds its own).
fn ferroce_peer(q: &QueuePair, peer: SocketAddr, psn: u32) {
    let local = q.endpoint_info(Psn::new(0), None);
    let remote = EndpointInfo {
        qpn: FAKE_PEER_QPN,
        psn: Psn::new(psn),
        udp_port: peer.port(),
        gid: gid_of(peer.ip()),
        ..local
    };
    assert!(remote.small_identifications, "ferroce's endpoints say so");
    q.connect(&local, &remote, &ConnectOptions::default())
        .unwrap();
}

const LIMIT: u16 = SENT_IDENTIFICATION_LIMIT;

#[test]
fn the_limit_is_what_ferroce_senders_keep_to() {
    // 64 segments per GSO send, numbered from 0: the bound the receive rule is built on.
    assert_eq!(LIMIT, 64);
}

#[test]
fn a_ferroce_peer_is_believed_only_below_the_limit() {
    let t = open(false);
    let got = verdicts(&t, &[1000, 5, LIMIT, LIMIT - 1, 0xffff, 1, 0], ferroce_peer);
    assert_eq!(
        got,
        [
            (1000, false),
            (5, true),
            (LIMIT, false),
            (LIMIT - 1, true),
            (0xffff, false),
            (1, true),
            (0, true),
        ]
    );
}

#[test]
fn an_unknown_peer_keeps_the_sixteen_bit_rule() {
    // rxe numbers every packet: a QP brought up without the exchange believes any solution.
    let t = open(false);
    let got = verdicts(&t, &[1000, 5, LIMIT, 0xffff, 0], plain);
    assert_eq!(
        got,
        [
            (1000, true),
            (5, true),
            (LIMIT, true),
            (0xffff, true),
            (0, true)
        ]
    );
}

#[test]
fn the_setting_is_per_qp_and_reset_forgets_it() {
    let t = open(false);
    let q = create_qp(&t);
    let mut f = Forger::new();
    // Set by hand on a plain QP, it takes effect.
    plain(&q, f.addr(), f.psn);
    q.set_peer_small_identifications(true);
    assert!(
        !f.send(&t, &q, 1000),
        "refused once the peer is said to be ferroce"
    );
    // Reset forgets it (and the posted receive): the next peer may be rxe.
    q.reset();
    f.rbuf = None;
    plain(&q, f.addr(), f.psn);
    assert!(f.send(&t, &q, 1000), "believed again after a reset");
    // Another QP of the same context, connected to a ferroce peer, refuses it meanwhile.
    let other = create_qp(&t);
    let mut g = Forger::new();
    ferroce_peer(&other, g.addr(), g.psn);
    assert!(!g.send(&t, &other, 1000));
    assert!(f.send(&t, &q, 2000), "the plain QP still believes it");
    assert!(
        g.send(&t, &other, 2),
        "and the other one what is below the limit"
    );
}

#[test]
fn a_strict_context_believes_no_solved_identification() {
    let t = open(true);
    for setup in [plain as fn(&QueuePair, SocketAddr, u32), ferroce_peer] {
        let got = verdicts(&t, &[1000, 5, 1, 0], setup);
        assert_eq!(got, [(1000, false), (5, false), (1, false), (0, true)]);
    }
}

/// What `FERROCE_ICRC_STRICT` asks for, as documented: on when set to anything but empty or 0.
fn env_asks_strict() -> bool {
    std::env::var("FERROCE_ICRC_STRICT").is_ok_and(|v| !v.is_empty() && v != "0")
}

#[test]
fn default_options_follow_the_environment() {
    // Run as is, and by the test below in a child process with the variable set and the
    // answer it expects in ICRC_STRENGTH_WANT.
    let want = std::env::var("ICRC_STRENGTH_WANT").map_or_else(|_| env_asks_strict(), |v| v == "1");
    assert_eq!(ContextOptions::default().icrc_strict, want);
    if want {
        // A default-opened context is strict indeed.
        let ctx = device_by_name("lo")
            .unwrap()
            .open(&ContextOptions {
                provider: Provider::Udp,
                ..ContextOptions::with_port(0)
            })
            .unwrap();
        let s = Side {
            pd: ctx.alloc_pd().unwrap(),
            cq: ctx.create_cq(16, None).unwrap(),
            ctx,
        };
        assert_eq!(verdicts(&s, &[5, 0], plain), [(5, false), (0, true)]);
    }
}

#[test]
fn the_environment_turns_strict_on() {
    // Each value in a child process of this test binary: the environment is the process's.
    for (value, strict) in [("1", true), ("yes", true), ("0", false), ("", false)] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "default_options_follow_the_environment",
                "--nocapture",
            ])
            .env("FERROCE_ICRC_STRICT", value)
            .env("ICRC_STRENGTH_WANT", if strict { "1" } else { "0" })
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && text.contains("1 passed"),
            "FERROCE_ICRC_STRICT={value:?}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

// ---- bulk transfers between real contexts ----------------------------------------------------

/// Two contexts whose QPs connect through a real connection exchange over TCP.
fn connected_pair(strict_a: bool, strict_b: bool) -> (Side, Side, QueuePair, QueuePair) {
    let (a, b) = (open(strict_a), open(strict_b));
    let (qa, qb) = (create_qp(&a), create_qp(&b));
    let la = qa.endpoint_info(Psn::new(0x10), None);
    let lb = qb.endpoint_info(Psn::new(0x20), None);
    let listener = Listener::bind((Ipv4Addr::LOCALHOST, 0).into()).unwrap();
    let addr = listener.local_addr();
    let server = thread::spawn(move || listener.accept(&lb, T).unwrap());
    let ca = cm::connect(addr, &la, T).unwrap();
    let cb = server.join().unwrap();
    assert!(ca.peer.small_identifications && cb.peer.small_identifications);
    qa.connect(&la, &ca.peer, &ConnectOptions::default())
        .unwrap();
    qb.connect(&lb, &cb.peer, &ConnectOptions::default())
        .unwrap();
    (a, b, qa, qb)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect()
}

fn mr(s: &Side, len: usize) -> MemoryRegion {
    s.pd.alloc_mr(len, Access::ALL).unwrap()
}

/// WRITEs `data` A → B, READs it back, and checks every byte; returns how long it took.
fn write_and_read_back(a: &Side, b: &Side, qa: &QueuePair, data: &[u8]) -> Duration {
    let t0 = Instant::now();
    let len = data.len();
    let (src, dst, back) = (mr(a, len), mr(b, len), mr(a, len));
    src.write(0, data).unwrap();
    qa.post_send(
        SendWr::new(1, SendOp::Write, vec![src.sge(0, len).unwrap()])
            .remote(dst.addr(), dst.rkey()),
    )
    .unwrap();
    let wc = a.cq.wait(1, T).unwrap();
    assert_eq!(wc.len(), 1, "WRITE completed");
    assert_eq!(
        (wc[0].status, wc[0].opcode),
        (WcStatus::Success, WcOpcode::RdmaWrite)
    );
    assert!(dst.to_vec(0, len).unwrap() == data, "WRITE: bytes differ");
    qa.post_send(
        SendWr::new(2, SendOp::Read, vec![back.sge(0, len).unwrap()])
            .remote(dst.addr(), dst.rkey()),
    )
    .unwrap();
    let wc = a.cq.wait(1, T).unwrap();
    assert_eq!(wc.len(), 1, "READ completed");
    assert_eq!(
        (wc[0].status, wc[0].opcode),
        (WcStatus::Success, WcOpcode::RdmaRead)
    );
    assert!(back.to_vec(0, len).unwrap() == data, "READ: bytes differ");
    t0.elapsed()
}

const MIB: usize = 1 << 20;

#[test]
fn ferroce_peers_exchange_bulk_data_with_gso_numbered_segments() {
    // The control for the strict test below: without strict mode, a bulk WRITE/READ leaves in
    // GSO sends whose segments carry Identifications 1..63, which the receivers solve for and
    // (their peers being ferroce) believe; none is refused.
    let (a, b, qa, _qb) = connected_pair(false, false);
    let t = write_and_read_back(&a, &b, &qa, &pattern(1, MIB));
    let (ca, cb) = (a.ctx.counters(), b.ctx.counters());
    println!(
        "1 MiB WRITE + READ, plain: {t:?}; solved {} + {}",
        counter(&cb, "icrc_ident_solved"),
        counter(&ca, "icrc_ident_solved")
    );
    assert!(
        counter(&cb, "icrc_ident_solved") > 0,
        "B took numbered WRITE segments"
    );
    assert!(
        counter(&ca, "icrc_ident_solved") > 0,
        "A took numbered READ responses"
    );
    assert_eq!(counter(&ca, "icrc_errors") + counter(&cb, "icrc_errors"), 0);
}

#[test]
fn strict_contexts_exchange_bulk_data_at_full_strength() {
    let (a, b, qa, _qb) = connected_pair(true, true);
    let t = write_and_read_back(&a, &b, &qa, &pattern(2, MIB));
    println!("1 MiB WRITE + READ, both strict: {t:?}");
    for (name, s) in [("A", &a), ("B", &b)] {
        let c = s.ctx.counters();
        // Every packet verified for Identification 0: nothing solved, nothing refused.
        assert_eq!(counter(&c, "icrc_ident_solved"), 0, "{name}");
        assert_eq!(counter(&c, "icrc_errors"), 0, "{name}");
        assert!(counter(&c, "rx_packets") > 0, "{name}");
    }
}

#[test]
fn a_strict_receiver_refuses_a_plain_ferroce_senders_gso_segments() {
    // What strict mode costs: B is strict, A is not, so A's WRITE leaves in GSO sends whose
    // segments after the first B refuses. The WRITE crawls on retransmissions (each round
    // gets one more packet through), so only the refusals are checked, not its completion.
    // Selective repeat (negotiated between these two) resends the refused packets one by one,
    // outside GSO, so it lets the WRITE through with fewer refusals: look for fewer.
    let (a, b, qa, _qb) = connected_pair(false, true);
    let len = MIB;
    let (src, dst) = (mr(&a, len), mr(&b, len));
    src.write(0, &pattern(3, len)).unwrap();
    qa.post_send(
        SendWr::new(1, SendOp::Write, vec![src.sge(0, len).unwrap()])
            .remote(dst.addr(), dst.rkey()),
    )
    .unwrap();
    let t0 = Instant::now();
    while counter(&b.ctx.counters(), "icrc_errors") < 40 {
        assert!(
            t0.elapsed() < T,
            "B refused too little: {:?}",
            b.ctx.counters()
        );
        thread::sleep(Duration::from_millis(1));
    }
    let done = a.cq.wait(1, Duration::from_millis(500)).unwrap();
    let c = b.ctx.counters();
    println!(
        "strict B, plain A: {} refused, WRITE done within 0.5 s: {}",
        counter(&c, "icrc_errors"),
        !done.is_empty()
    );
    assert_eq!(
        counter(&c, "icrc_ident_solved"),
        0,
        "B believed a solved Identification"
    );
    // Whether the WRITE completed is not the point: with selective repeat the refused
    // packets come again one at a time, outside GSO, and get through.
    let _ = done;
    // A, not strict, takes B's packets (all with Identification 0) as they are.
    assert_eq!(counter(&a.ctx.counters(), "icrc_errors"), 0);
}
