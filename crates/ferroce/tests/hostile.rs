//! Hostile input against a live context: a real UDP socket on 127.0.0.1 and its engine thread,
//! attacked from the same host while a legitimate QP pair keeps working on it.
//!
//! The target context `T` holds regions of every kind of access, each inside a larger buffer
//! whose other bytes are a canary pattern (caller memory registered with `register_raw`), and
//! ferroce-allocated regions that must stay unchanged unless a valid request writes them. An
//! attacker then sends, paced so that the kernel drops nothing and every packet can be counted:
//! random datagrams; well-formed packets with a valid ICRC for unknown QPNs; valid-looking
//! requests to real QPs with guessed, stale and foreign-PD rkeys, out-of-bounds and overflowing
//! ranges, wrong PSNs, broken opcode sequences and misaligned atomics; packets from another
//! address; and, as root, packets forged with the legitimate peer's exact IP and port through a
//! raw socket. Valid forged requests serve as positive controls: they prove the attacker's
//! packets are well-formed and reach the responder, so "unchanged" means "refused".
//!
//! Checked afterwards: every canary and every region is byte-identical to a model holding only
//! the valid writes; every refusal is in its counter (exact counts where the attacker controls
//! them); each QP hit by an in-sequence bad request answered with the right NAK and went to ERR
//! while the others kept working; the legitimate pair completed verified WRITE/READ/FETCH_ADD
//! rounds during and after the attack, served by the target's engine thread alone (nobody polls
//! the target); and the process's resident memory stayed bounded.
//!
//! Reproduce a run with `HOSTILE_SEED=<n>` (the seed is printed).

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferroce::{
    device_by_name, gid_of, Access, CompletionQueue, Context, ContextCounters, ContextOptions,
    InitAttr, MemoryRegion, PathMtu, ProtectionDomain, QpCaps, QpInitAttr, QpState, QueuePair,
    RtrAttr, RtsAttr, SendOp, SendWr, WcStatus,
};
use ferroce_wire::aeth::{AethRepr, NakCode, Syndrome, CREDITS_INVALID};
use ferroce_wire::atomic_ack_eth::AtomicAckEthRepr;
use ferroce_wire::atomic_eth::AtomicEthRepr;
use ferroce_wire::bth::{BthRepr, DEFAULT_PKEY};
use ferroce_wire::frame::UdpFrameHeaders;
use ferroce_wire::reth::RethRepr;
use ferroce_wire::{icrc, ExtHeaders, Opcode, PacketRepr, Psn, RocePacket};

const LOCALHOST: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// The QPN the victims believe their peer has.
const FAKE_PEER_QPN: u32 = 0x00ab_cdef;
/// Most hostile datagrams in flight before the attacker waits for the target to count them.
const WINDOW: u64 = 96;
const T: Duration = Duration::from_secs(10);

// ---- helpers: randomness, memory, packets ------------------------------------------------

/// xorshift64*: reproducible from the printed seed, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn canary(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(131) as u8) ^ seed ^ ((i >> 7) as u8) | 1)
        .collect()
}

/// A page-aligned heap buffer the test owns; a slice of it is registered with `register_raw`.
struct RawBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

impl RawBuf {
    fn new(contents: &[u8]) -> RawBuf {
        let layout = Layout::from_size_align(contents.len(), 4096).unwrap();
        // SAFETY: the layout has a non-zero size.
        let p = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(p).expect("allocation");
        // SAFETY: `ptr` is a fresh allocation of `contents.len()` bytes, not aliased.
        unsafe { std::ptr::copy_nonoverlapping(contents.as_ptr(), p, contents.len()) };
        RawBuf { ptr, layout }
    }
    fn at(&self, offset: usize) -> NonNull<u8> {
        assert!(offset < self.layout.size());
        // SAFETY: in bounds of the allocation (checked above).
        unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(offset)) }
    }
    /// The whole buffer. Only called once no region over it is registered and the context
    /// that could write it is gone.
    fn snapshot(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.layout.size()];
        // SAFETY: the allocation is live and, per the caller's contract, no longer reachable
        // by ferroce, so nothing writes it concurrently.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), v.as_mut_ptr(), v.len());
        }
        v
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout; every region over it was dropped with
        // its context before (the buffers are declared before the contexts).
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

fn bth(opcode: Opcode, qpn: u32, psn: u32) -> BthRepr {
    BthRepr {
        opcode,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: DEFAULT_PKEY,
        fecn: false,
        becn: false,
        dest_qpn: qpn & 0x00ff_ffff,
        ack_req: true,
        psn: Psn::new(psn & 0x00ff_ffff),
    }
}

fn reth(va: u64, rkey: u32, len: u32) -> ExtHeaders {
    ExtHeaders {
        reth: Some(RethRepr {
            va,
            rkey,
            dma_len: len,
        }),
        ..Default::default()
    }
}

fn atomic_eth(va: u64, rkey: u32, swap_add: u64, compare: u64) -> ExtHeaders {
    ExtHeaders {
        atomic_eth: Some(AtomicEthRepr {
            va,
            rkey,
            swap_add,
            compare,
        }),
        ..Default::default()
    }
}

/// A RoCE v2 transport packet (BTH to ICRC) whose ICRC is right for a datagram `src` → `dst`,
/// computed as the engine checks it (IPv4 Identification 0).
fn packet(
    src: SocketAddr,
    dst: SocketAddr,
    b: BthRepr,
    ext: ExtHeaders,
    payload: &[u8],
) -> Vec<u8> {
    let repr = PacketRepr::new(b, ext, payload.len());
    let mut buf = vec![0u8; repr.buffer_len().unwrap()];
    repr.emit(&mut buf).unwrap();
    let h = repr.header_len().unwrap();
    buf[h..h + payload.len()].copy_from_slice(payload);
    seal(src, dst, &mut buf);
    buf
}

fn seal(src: SocketAddr, dst: SocketAddr, buf: &mut [u8]) {
    let mut h = UdpFrameHeaders::roce(src.ip(), src.port(), dst.ip());
    h.dst_port = dst.port();
    let hdrs = h.ip_udp_headers(buf.len()).unwrap();
    let n = buf.len();
    let crc = icrc::compute(hdrs.ip(), hdrs.udp(), &buf[..n - 4]).unwrap();
    RocePacket::new_unchecked(&mut buf[..]).set_icrc(crc);
}

/// Whether `p`, sent from `src` to `dst`, verifies for some IPv4 Identification (the receiver
/// cannot see the field, so it accepts any).
fn verifies_for_some_identification(
    src: SocketAddr,
    dst: SocketAddr,
    p: &RocePacket<&[u8]>,
) -> bool {
    let mut h = UdpFrameHeaders::roce(src.ip(), src.port(), dst.ip());
    h.dst_port = dst.port();
    let Ok(hdrs) = h.icrc_headers(p.as_bytes().len()) else {
        return false;
    };
    icrc::verify_any_ipv4_identification(hdrs.ip(), hdrs.udp(), p.covered(), p.icrc())
        .is_ok_and(|c| c.is_ok())
}

/// A packet the target sent to the attacker.
#[derive(Debug)]
struct Answer {
    opcode: Opcode,
    qpn: u32,
    psn: u32,
    syndrome: Option<Syndrome>,
    original: Option<u64>,
    payload: Vec<u8>,
}

fn drain(s: &UdpSocket) -> usize {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 9000];
    let mut n = 0;
    while s.recv_from(&mut buf).is_ok() {
        n += 1;
    }
    s.set_nonblocking(false).unwrap();
    n
}

/// The next packet on `s`, checked to be a well-formed RoCE v2 packet with a valid ICRC.
fn answer(s: &UdpSocket, timeout: Duration) -> Option<Answer> {
    s.set_read_timeout(Some(timeout)).unwrap();
    let mut buf = [0u8; 9000];
    let (n, from) = s.recv_from(&mut buf).ok()?;
    let bytes = &buf[..n];
    let pkt = RocePacket::new_checked(bytes).expect("the target sends well-formed packets");
    let mut h = UdpFrameHeaders::roce(from.ip(), from.port(), s.local_addr().unwrap().ip());
    h.dst_port = s.local_addr().unwrap().port();
    let hdrs = h.ip_udp_headers(n).unwrap();
    assert!(
        icrc::verify(hdrs.ip(), hdrs.udp(), pkt.covered(), pkt.icrc()).unwrap(),
        "the target's ICRC is valid"
    );
    let repr = PacketRepr::parse(&pkt).unwrap();
    Some(Answer {
        opcode: repr.bth.opcode,
        qpn: repr.bth.dest_qpn,
        psn: repr.bth.psn.value(),
        syndrome: repr.ext.aeth.map(|a: AethRepr| a.syndrome),
        original: repr
            .ext
            .atomic_ack_eth
            .map(|a: AtomicAckEthRepr| a.original),
        payload: pkt.payload().to_vec(),
    })
}

fn vm_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .collect()
}

fn engine_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("comm")).ok())
        .filter(|c| c.starts_with("ferroce-engine"))
        .count()
}

fn named(c: &ContextCounters) -> HashMap<&'static str, u64> {
    c.named().into_iter().collect()
}

/// How much counter `name` grew from `a` to `b`.
fn delta(a: &ContextCounters, b: &ContextCounters, name: &str) -> u64 {
    named(b)[name] - named(a)[name]
}

/// Sends `pkts` from `sock` to `dst`, never more than [`WINDOW`] ahead of what `seen` (a
/// counter of the target that each of these packets bumps once) has counted, so the socket
/// buffer never overflows and every packet is accounted for.
fn paced(
    what: &str,
    pkts: impl IntoIterator<Item = Vec<u8>>,
    send: impl Fn(&[u8]),
    seen: impl Fn() -> u64,
) -> u64 {
    let base = seen();
    let mut sent = 0u64;
    for p in pkts {
        if sent % 16 == 0 {
            let t0 = Instant::now();
            while sent - (seen() - base).min(sent) > WINDOW {
                assert!(
                    t0.elapsed() < T,
                    "{what}: the target stopped counting ({} of {sent})",
                    seen() - base
                );
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        send(&p);
        sent += 1;
    }
    let t0 = Instant::now();
    while seen() - base < sent {
        assert!(
            t0.elapsed() < T,
            "{what}: {} of {sent} counted",
            seen() - base
        );
        std::thread::sleep(Duration::from_micros(100));
    }
    sent
}

fn udp_send(s: &UdpSocket, dst: SocketAddr) -> impl Fn(&[u8]) + '_ {
    move |p| {
        s.send_to(p, dst).unwrap();
    }
}

/// A raw IPv4 socket with `IP_HDRINCL` (implied by `IPPROTO_RAW`), or `None` without the
/// privilege.
fn raw_socket() -> Option<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked before use.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Sends `roce` in a UDP datagram from `src` to `dst`, with IPv4 and UDP headers of our own
/// making (the kernel fills in the IP checksum and, as it is 0, the Identification).
fn raw_send(fd: &OwnedFd, src: SocketAddrV4, dst: SocketAddrV4, roce: &[u8]) {
    let mut h = UdpFrameHeaders::roce(IpAddr::V4(*src.ip()), src.port(), IpAddr::V4(*dst.ip()));
    h.dst_port = dst.port();
    let hdrs = h.ip_udp_headers(roce.len()).unwrap();
    let mut dgram = hdrs.as_bytes().to_vec();
    dgram.extend_from_slice(roce);
    // SAFETY: plain old data; zero is valid and the fields that matter are set.
    let mut sin: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sin.sin_family = libc::AF_INET as libc::sa_family_t;
    sin.sin_addr.s_addr = u32::from(*dst.ip()).to_be();
    // SAFETY: `dgram` and `sin` are live for the call and their lengths are given.
    let n = unsafe {
        libc::sendto(
            fd.as_raw_fd(),
            dgram.as_ptr().cast(),
            dgram.len(),
            0,
            (&sin as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        )
    };
    assert_eq!(n, dgram.len() as isize, "raw send");
}

// ---- the scene ----------------------------------------------------------------------------

fn open() -> Context {
    device_by_name("lo")
        .unwrap()
        .open(&ContextOptions {
            capture: None,
            // The packet path is what is attacked here: the legitimate peers use it too.
            provider: ferroce::Provider::Udp,
            ..ContextOptions::with_port(0)
        })
        .unwrap()
}

fn create_qp(pd: &ProtectionDomain, cq: &CompletionQueue) -> QueuePair {
    pd.create_qp(&QpInitAttr::new(cq, QpCaps::default()))
        .unwrap()
}

/// Brings `q` to RTS, talking to QPN `peer_qpn` at `peer` and expecting PSN `rq_psn` first.
fn bring_up(q: &QueuePair, peer: SocketAddr, peer_qpn: u32, rq_psn: u32, sq_psn: u32) {
    q.modify_to_init(&InitAttr::default()).unwrap();
    q.modify_to_rtr_with_port(
        &RtrAttr {
            path_mtu: PathMtu::Mtu1024,
            dest_qpn: peer_qpn,
            dest_gid: gid_of(peer.ip()),
            rq_psn: Psn::new(rq_psn),
            max_dest_rd_atomic: 4,
            min_rnr_timer: 1,
        },
        peer.port(),
    )
    .unwrap();
    q.modify_to_rts(&RtsAttr {
        sq_psn: Psn::new(sq_psn),
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 4,
    })
    .unwrap();
}

fn wait_state(q: &QueuePair, want: QpState) -> QpState {
    let t0 = Instant::now();
    while q.state() != want && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_micros(200));
    }
    q.state()
}

/// The legitimate pair's work, run by L while the attack goes on: verified WRITE, READ back
/// and FETCH_ADD rounds into T's `target` region through `ll`. Returns the rounds done.
#[allow(clippy::too_many_arguments)]
fn legit_traffic(
    seed: u64,
    ll: &QueuePair,
    cq: &CompletionQueue,
    src: &MemoryRegion,
    dst: &MemoryRegion,
    target_addr: u64,
    target_rkey: u32,
    stop: &AtomicBool,
    rounds: &AtomicU64,
) -> u64 {
    let mut rng = Rng(seed ^ 0x5eed);
    let t_start = Instant::now();
    let mut adds = 0u64;
    let counter_at = target_addr + 65_536 - 8;
    let one = |wr: SendWr, what: &str| {
        ll.post_send(wr).unwrap();
        let wc = cq.wait(1, T).unwrap();
        assert_eq!(wc.len(), 1, "legit {what}: no completion (traffic stalled)");
        assert_eq!(
            wc[0].status,
            WcStatus::Success,
            "legit {what} at {:?}: {:?}",
            t_start.elapsed(),
            ll.counters()
        );
    };
    while !stop.load(Ordering::Acquire) {
        let len = 1 + rng.below(6000) as usize;
        let off = rng.below(32_768);
        let data = rng.bytes(len);
        src.write(0, &data).unwrap();
        one(
            SendWr::new(1, SendOp::Write, vec![src.sge(0, len).unwrap()])
                .remote(target_addr + off, target_rkey),
            "WRITE",
        );
        one(
            SendWr::new(2, SendOp::Read, vec![dst.sge(0, len).unwrap()])
                .remote(target_addr + off, target_rkey),
            "READ",
        );
        assert!(
            dst.to_vec(0, len).unwrap() == data,
            "legit READ returned other bytes than the WRITE put there"
        );
        one(
            SendWr::new(
                3,
                SendOp::FetchAdd { add: 1 },
                vec![dst.sge(8192, 8).unwrap()],
            )
            .remote(counter_at, target_rkey),
            "FETCH_ADD",
        );
        assert_eq!(dst.read_u64(8192).unwrap(), adds, "FETCH_ADD original");
        adds += 1;
        rounds.fetch_add(1, Ordering::Release);
    }
    adds
}

/// Sets the flag when dropped (also while unwinding).
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// One in-sequence bad request to a fresh victim QP, and the NAK the IBTA requires for it.
struct BadRequest {
    name: &'static str,
    opcode: Opcode,
    ext: ExtHeaders,
    payload: usize,
    nak: NakCode,
}

#[test]
fn hostile_traffic_is_refused_counted_and_survived() {
    let seed = std::env::var("HOSTILE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x0bad_f00d_u64);
    println!("HOSTILE_SEED={seed}");
    let mut rng = Rng(seed | 1);

    // Caller memory: three 16 KiB page-aligned buffers, canary bytes everywhere. A slice in the
    // middle of each is registered; the rest must never change.
    const RAW: usize = 16_384;
    let (rw_off, rw_len) = (4096 + 100, 5000);
    let (ro_off, ro_len) = (4096 + 8, 4000);
    let (none_off, none_len) = (2048, 8192);
    let raw_init = [canary(0x11, RAW), canary(0x22, RAW), canary(0x33, RAW)];
    let raw = [
        RawBuf::new(&raw_init[0]),
        RawBuf::new(&raw_init[1]),
        RawBuf::new(&raw_init[2]),
    ];
    // What the model says each byte of the read-write slice ends as.
    let mut rw_model = raw_init[0].clone();

    let t = open();
    let l = open();
    let (tpd, lpd) = (t.alloc_pd().unwrap(), l.alloc_pd().unwrap());
    let other_pd = t.alloc_pd().unwrap();
    let (tcq, lcq) = (
        t.create_cq(4096, None).unwrap(),
        l.create_cq(4096, None).unwrap(),
    );
    let taddr = t.local_addr();
    let ans = UdpSocket::bind((LOCALHOST, 0)).unwrap();
    let att = UdpSocket::bind((LOCALHOST, 0)).unwrap();
    let ans_addr = ans.local_addr().unwrap();
    let att_addr = att.local_addr().unwrap();

    // SAFETY (all three): each slice lies inside its live RawBuf, which outlives the context
    // (declared before it, freed after it is dropped); the test touches the buffers only
    // through the regions while they are registered, and reads them whole only after.
    let raw_rw = unsafe {
        tpd.register_raw(
            raw[0].at(rw_off),
            rw_len,
            Access::LOCAL_WRITE
                .with(Access::REMOTE_WRITE)
                .with(Access::REMOTE_READ),
        )
    }
    .unwrap();
    let raw_ro =
        unsafe { tpd.register_raw(raw[1].at(ro_off), ro_len, Access::REMOTE_READ) }.unwrap();
    let raw_none =
        unsafe { tpd.register_raw(raw[2].at(none_off), none_len, Access::LOCAL_WRITE) }.unwrap();
    // ferroce-allocated regions.
    let mr_ro = tpd.alloc_mr(8192, Access::REMOTE_READ).unwrap();
    let ro_pattern = canary(0x44, 8192);
    mr_ro.write(0, &ro_pattern).unwrap();
    let mr_atomic = tpd
        .alloc_mr(4096, Access::LOCAL_WRITE.with(Access::REMOTE_ATOMIC))
        .unwrap();
    let mr_foreign = other_pd.alloc_mr(4096, Access::ALL).unwrap();
    let stale = tpd.alloc_mr(4096, Access::ALL).unwrap();
    let (stale_addr, stale_rkey) = (stale.addr(), stale.rkey());
    drop(stale);
    let mr_new = tpd.alloc_mr(4096, Access::ALL).unwrap();
    assert_ne!(mr_new.rkey(), stale_rkey, "a reused slot gets a new key");
    let legit_target = tpd.alloc_mr(65_536, Access::ALL).unwrap();
    let keys = [
        raw_rw.rkey(),
        raw_ro.rkey(),
        raw_none.rkey(),
        mr_ro.rkey(),
        mr_atomic.rkey(),
        mr_foreign.rkey(),
        mr_new.rkey(),
        legit_target.rkey(),
        stale_rkey,
    ];
    let guessed = loop {
        let k = rng.next() as u32;
        if !keys.contains(&k) {
            break k;
        }
    };

    // The legitimate pair: ll on L drives WRITE/READ/FETCH_ADD into T through lt. lt2 on T is
    // connected to ll2 on L and idle: forged answers aimed at its requester must be dropped.
    let (lt, ll) = (create_qp(&tpd, &tcq), create_qp(&lpd, &lcq));
    bring_up(&lt, l.local_addr(), ll.qpn(), 0x10_0000, 0x20_0000);
    bring_up(&ll, taddr, lt.qpn(), 0x20_0000, 0x10_0000);
    let (lt2, ll2) = (create_qp(&tpd, &tcq), create_qp(&lpd, &lcq));
    bring_up(&lt2, l.local_addr(), ll2.qpn(), 0x30_0000, 0x40_0000);
    bring_up(&ll2, taddr, lt2.qpn(), 0x40_0000, 0x30_0000);
    let lsrc = lpd.alloc_mr(8192, Access::LOCAL_WRITE).unwrap();
    let ldst = lpd.alloc_mr(8192 + 8, Access::LOCAL_WRITE).unwrap();

    // V0: a victim that is abused but never given a fatal request; it must stay in RTS.
    let v0 = create_qp(&tpd, &tcq);
    let p0: u32 = 0x00ff_fff0; // the PSNs wrap past 2^24 during the test
    bring_up(&v0, ans_addr, FAKE_PEER_QPN, p0, 0);

    let stop = AtomicBool::new(false);
    let rounds = AtomicU64::new(0);
    let c0 = t.counters();
    // A new thread names itself once it runs: give both engines a moment.
    let t0 = Instant::now();
    while engine_threads() < 2 && t0.elapsed() < T {
        std::thread::sleep(Duration::from_millis(1));
    }
    let threads_before = engine_threads();
    assert_eq!(
        threads_before,
        2,
        "one engine thread per context: {:?}",
        thread_names()
    );

    std::thread::scope(|scope| {
        let legit = scope.spawn(|| {
            legit_traffic(
                seed,
                &ll,
                &lcq,
                &lsrc,
                &ldst,
                legit_target.addr(),
                legit_target.rkey(),
                &stop,
                &rounds,
            )
        });
        // Should this thread panic, the legitimate traffic must stop too, or the scope would
        // wait for it forever.
        let _stop = StopOnDrop(&stop);
        // Let the legitimate traffic get going, then take the memory baseline.
        let t0 = Instant::now();
        while rounds.load(Ordering::Acquire) < 20 {
            assert!(t0.elapsed() < T, "legit traffic does not start");
            std::thread::sleep(Duration::from_millis(1));
        }
        let rss_before = vm_rss_kib();
        let mut hostile = 0u64;
        let mut epsn = p0;
        let t_attack = Instant::now();
        let phase = |name: &str| println!("{:>8.3?} {name}", t_attack.elapsed());
        let send_ans = |p: &[u8]| {
            ans.send_to(p, taddr).unwrap();
        };

        // ---- positive controls on V0: valid forged requests do land, exactly ----------------
        let d1 = rng.bytes(100);
        send_ans(&packet(
            ans_addr,
            taddr,
            bth(Opcode::RC_RDMA_WRITE_ONLY, v0.qpn(), epsn),
            reth(raw_rw.addr() + 10, raw_rw.rkey(), 100),
            &d1,
        ));
        rw_model[rw_off + 10..rw_off + 110].copy_from_slice(&d1);
        let a = answer(&ans, T).expect("ACK of a valid WRITE");
        assert_eq!(
            (a.opcode, a.qpn, a.psn, a.syndrome),
            (
                Opcode::RC_ACKNOWLEDGE,
                FAKE_PEER_QPN,
                epsn,
                Some(Syndrome::Ack {
                    credits: CREDITS_INVALID
                })
            )
        );
        epsn += 1;
        send_ans(&packet(
            ans_addr,
            taddr,
            bth(Opcode::RC_FETCH_ADD, v0.qpn(), epsn),
            atomic_eth(mr_atomic.addr() + 8, mr_atomic.rkey(), 0x1234, 0),
            &[],
        ));
        let a = answer(&ans, T).expect("atomic ACK");
        assert_eq!(
            (a.opcode, a.psn & 0xff_ffff, a.original),
            (Opcode::RC_ATOMIC_ACKNOWLEDGE, epsn & 0xff_ffff, Some(0))
        );
        let fetch_add_psn = epsn;
        epsn += 1;
        send_ans(&packet(
            ans_addr,
            taddr,
            bth(Opcode::RC_COMPARE_SWAP, v0.qpn(), epsn),
            atomic_eth(mr_atomic.addr() + 16, mr_atomic.rkey(), 0xdead, 0),
            &[],
        ));
        assert_eq!(answer(&ans, T).expect("atomic ACK").original, Some(0));
        epsn += 1;
        let read_psn = epsn;
        send_ans(&packet(
            ans_addr,
            taddr,
            bth(Opcode::RC_RDMA_READ_REQUEST, v0.qpn(), epsn),
            reth(mr_ro.addr() + 5, mr_ro.rkey(), 2000),
            &[],
        ));
        let (r1, r2) = (answer(&ans, T).unwrap(), answer(&ans, T).unwrap());
        assert_eq!(
            (r1.opcode, r2.opcode),
            (
                Opcode::RC_RDMA_READ_RESPONSE_FIRST,
                Opcode::RC_RDMA_READ_RESPONSE_LAST
            )
        );
        assert_eq!([r1.payload, r2.payload].concat(), ro_pattern[5..2005]);
        epsn += 2;
        hostile += 4;

        phase("ahead");
        // ---- V0: PSNs far ahead never execute; one sequence-error NAK -----------------------
        let d2 = rng.bytes(64);
        let ahead = (0..2000).map(|_| {
            let k = 1 + rng.below(0x7f_ffff) as u32;
            packet(
                ans_addr,
                taddr,
                bth(Opcode::RC_RDMA_WRITE_ONLY, v0.qpn(), epsn.wrapping_add(k)),
                reth(raw_rw.addr() + 200, raw_rw.rkey(), 64),
                &d2,
            )
        });
        hostile += paced("ahead", ahead, send_ans, || {
            v0.counters().out_of_seq_request
        });
        let a = answer(&ans, T).expect("PSN sequence error NAK");
        assert_eq!(
            (a.psn, a.syndrome),
            (
                epsn & 0xff_ffff,
                Some(Syndrome::Nak(NakCode::PsnSequenceError))
            )
        );
        assert!(
            answer(&ans, Duration::from_millis(50)).is_none(),
            "one NAK until the expected PSN arrives"
        );

        phase("behind");
        // ---- V0: duplicates never execute again ----------------------------------------------
        let d3 = rng.bytes(100);
        let behind = (0..2000).map(|i| {
            let k = if i == 0 {
                epsn - p0 // exactly the positive WRITE's PSN
            } else {
                1 + rng.below(0x80_0000) as u32
            };
            packet(
                ans_addr,
                taddr,
                bth(Opcode::RC_RDMA_WRITE_ONLY, v0.qpn(), epsn.wrapping_sub(k)),
                reth(raw_rw.addr() + 10, raw_rw.rkey(), 100),
                &d3,
            )
        });
        hostile += paced("behind", behind, send_ans, || {
            v0.counters().duplicate_request
        });
        drain(&ans);
        // A replayed FETCH_ADD is answered from the responder's memory, not executed again.
        send_ans(&packet(
            ans_addr,
            taddr,
            bth(Opcode::RC_FETCH_ADD, v0.qpn(), fetch_add_psn),
            atomic_eth(mr_atomic.addr() + 8, mr_atomic.rkey(), 0x1234, 0),
            &[],
        ));
        let a = answer(&ans, T).expect("replayed atomic ACK");
        assert_eq!(
            (a.opcode, a.original),
            (Opcode::RC_ATOMIC_ACKNOWLEDGE, Some(0))
        );
        // A duplicate READ reaching outside the original is dropped; a part of it is served.
        send_ans(&packet(
            ans_addr,
            taddr,
            bth(Opcode::RC_RDMA_READ_REQUEST, v0.qpn(), read_psn),
            reth(mr_ro.addr() + 7000, mr_ro.rkey(), 1000),
            &[],
        ));
        send_ans(&packet(
            ans_addr,
            taddr,
            bth(Opcode::RC_RDMA_READ_REQUEST, v0.qpn(), read_psn + 1),
            reth(mr_ro.addr() + 5 + 1024, mr_ro.rkey(), 976),
            &[],
        ));
        let a = answer(&ans, T).expect("the duplicate READ's valid part");
        assert_eq!(
            (a.opcode, a.psn, a.payload.as_slice()),
            (
                Opcode::RC_RDMA_READ_RESPONSE_ONLY,
                (read_psn + 1) & 0xff_ffff,
                &ro_pattern[1029..2005]
            ),
            "only the subset is answered"
        );
        assert!(answer(&ans, Duration::from_millis(50)).is_none());
        hostile += 3;
        // The expected PSN arrives: accepted, and the NAK state clears.
        let d4 = rng.bytes(40);
        send_ans(&packet(
            ans_addr,
            taddr,
            bth(Opcode::RC_RDMA_WRITE_ONLY, v0.qpn(), epsn),
            reth(raw_rw.addr() + 300, raw_rw.rkey(), 40),
            &d4,
        ));
        rw_model[rw_off + 300..rw_off + 340].copy_from_slice(&d4);
        let a = answer(&ans, T).expect("ACK");
        assert_eq!(
            (a.opcode, a.psn),
            (Opcode::RC_ACKNOWLEDGE, epsn & 0xff_ffff)
        );
        epsn += 1;
        // A SEND with no receive posted: RNR NAK, nothing consumed, QP alive.
        send_ans(&packet(
            ans_addr,
            taddr,
            bth(Opcode::RC_SEND_ONLY, v0.qpn(), epsn),
            ExtHeaders::default(),
            b"no buffer",
        ));
        let a = answer(&ans, T).expect("RNR NAK");
        assert!(matches!(a.syndrome, Some(Syndrome::RnrNak { .. })), "{a:?}");
        hostile += 1;
        assert_eq!(v0.state(), QpState::Rts);

        phase("fatal victims");
        // ---- fatal victims: one in-sequence bad request each -------------------------------
        let write = Opcode::RC_RDMA_WRITE_ONLY;
        let read = Opcode::RC_RDMA_READ_REQUEST;
        let rw_end = raw_rw.addr() + rw_len as u64;
        let ra = NakCode::RemoteAccessError;
        let ir = NakCode::InvalidRequest;
        let bad = |name, opcode, ext, payload, nak| BadRequest {
            name,
            opcode,
            ext,
            payload,
            nak,
        };
        let cases = vec![
            bad(
                "WRITE, guessed rkey",
                write,
                reth(raw_rw.addr(), guessed, 16),
                16,
                ra,
            ),
            bad(
                "WRITE, stale rkey, old address",
                write,
                reth(stale_addr, stale_rkey, 16),
                16,
                ra,
            ),
            bad(
                "WRITE, stale rkey, reused slot",
                write,
                reth(mr_new.addr(), stale_rkey, 16),
                16,
                ra,
            ),
            bad(
                "WRITE, rkey of another PD",
                write,
                reth(mr_foreign.addr(), mr_foreign.rkey(), 16),
                16,
                ra,
            ),
            bad(
                "WRITE, one byte before",
                write,
                reth(raw_rw.addr() - 1, raw_rw.rkey(), 16),
                16,
                ra,
            ),
            bad(
                "WRITE, straddling the end",
                write,
                reth(rw_end - 8, raw_rw.rkey(), 16),
                16,
                ra,
            ),
            bad(
                "WRITE, just past the end",
                write,
                reth(rw_end, raw_rw.rkey(), 1),
                1,
                ra,
            ),
            bad(
                "WRITE, read-only region",
                write,
                reth(mr_ro.addr(), mr_ro.rkey(), 16),
                16,
                ra,
            ),
            bad(
                "WRITE, read-only caller memory",
                write,
                reth(raw_ro.addr(), raw_ro.rkey(), 16),
                16,
                ra,
            ),
            bad(
                "WRITE, region without remote rights",
                write,
                reth(raw_none.addr(), raw_none.rkey(), 16),
                16,
                ra,
            ),
            bad(
                "WRITE_FIRST, va + len wraps",
                Opcode::RC_RDMA_WRITE_FIRST,
                reth(u64::MAX - 2047, raw_rw.rkey(), 4096),
                1024,
                ra,
            ),
            bad(
                "WRITE_FIRST, length over 2^31",
                Opcode::RC_RDMA_WRITE_FIRST,
                reth(raw_rw.addr(), raw_rw.rkey(), u32::MAX),
                1024,
                ir,
            ),
            bad(
                "WRITE, payload shorter than the RETH says",
                write,
                reth(raw_rw.addr(), raw_rw.rkey(), 64),
                16,
                ir,
            ),
            bad(
                "WRITE_ONLY, payload over the MTU",
                write,
                reth(raw_rw.addr(), raw_rw.rkey(), 2048),
                2048,
                ir,
            ),
            bad(
                "WRITE_MIDDLE without FIRST",
                Opcode::RC_RDMA_WRITE_MIDDLE,
                ExtHeaders::default(),
                1024,
                ir,
            ),
            bad(
                "WRITE_LAST without FIRST",
                Opcode::RC_RDMA_WRITE_LAST,
                ExtHeaders::default(),
                8,
                ir,
            ),
            bad(
                "SEND_MIDDLE without FIRST",
                Opcode::RC_SEND_MIDDLE,
                ExtHeaders::default(),
                1024,
                ir,
            ),
            bad(
                "READ, guessed rkey",
                read,
                reth(raw_rw.addr(), guessed, 16),
                0,
                ra,
            ),
            bad(
                "READ, stale rkey",
                read,
                reth(stale_addr, stale_rkey, 16),
                0,
                ra,
            ),
            bad(
                "READ, region without remote read",
                read,
                reth(raw_none.addr(), raw_none.rkey(), 16),
                0,
                ra,
            ),
            bad(
                "READ, va + len wraps",
                read,
                reth(u64::MAX - 15, raw_rw.rkey(), 32),
                0,
                ra,
            ),
            bad(
                "READ, 2^31 bytes",
                read,
                reth(raw_rw.addr(), raw_rw.rkey(), 1 << 31),
                0,
                ra,
            ),
            bad(
                "READ, length over 2^31",
                read,
                reth(raw_rw.addr(), raw_rw.rkey(), (1 << 31) + 1),
                0,
                ir,
            ),
            bad(
                "FETCH_ADD, misaligned",
                Opcode::RC_FETCH_ADD,
                atomic_eth(mr_atomic.addr() + 4, mr_atomic.rkey(), 1, 0),
                0,
                ir,
            ),
            bad(
                "FETCH_ADD, guessed rkey",
                Opcode::RC_FETCH_ADD,
                atomic_eth(mr_atomic.addr(), guessed, 1, 0),
                0,
                ra,
            ),
            bad(
                "FETCH_ADD, past the end",
                Opcode::RC_FETCH_ADD,
                atomic_eth(mr_atomic.addr() + 4096, mr_atomic.rkey(), 1, 0),
                0,
                ra,
            ),
            bad(
                "COMPARE_SWAP, region without atomic rights",
                Opcode::RC_COMPARE_SWAP,
                atomic_eth((raw_rw.addr() + 7) & !7, raw_rw.rkey(), 1, 0),
                0,
                ra,
            ),
            bad(
                "COMPARE_SWAP, stale rkey",
                Opcode::RC_COMPARE_SWAP,
                atomic_eth(stale_addr, stale_rkey, 1, 0),
                0,
                ra,
            ),
        ];
        let mut victims = Vec::new();
        let (mut n_ra, mut n_ir) = (0u64, 0u64);
        for (i, case) in cases.iter().enumerate() {
            let v = create_qp(&tpd, &tcq);
            let psn = 0x1000 * (i as u32 + 1);
            bring_up(&v, ans_addr, FAKE_PEER_QPN, psn, 0);
            drain(&ans);
            let payload = rng.bytes(case.payload);
            send_ans(&packet(
                ans_addr,
                taddr,
                bth(case.opcode, v.qpn(), psn),
                case.ext,
                &payload,
            ));
            let a = answer(&ans, T).unwrap_or_else(|| panic!("{}: no answer", case.name));
            assert_eq!(
                (a.opcode, a.qpn, a.psn, a.syndrome),
                (
                    Opcode::RC_ACKNOWLEDGE,
                    FAKE_PEER_QPN,
                    psn,
                    Some(Syndrome::Nak(case.nak))
                ),
                "{}",
                case.name
            );
            assert_eq!(
                wait_state(&v, QpState::Error),
                QpState::Error,
                "{}",
                case.name
            );
            let c = v.counters();
            match case.nak {
                NakCode::RemoteAccessError => {
                    n_ra += 1;
                    assert_eq!(
                        (c.rkey_violations, c.send_invalid_request),
                        (1, 0),
                        "{}",
                        case.name
                    );
                }
                _ => {
                    n_ir += 1;
                    assert_eq!(
                        (c.rkey_violations, c.send_invalid_request),
                        (0, 1),
                        "{}",
                        case.name
                    );
                }
            }
            // In ERR, even a valid request is dropped (and counted), never executed.
            send_ans(&packet(
                ans_addr,
                taddr,
                bth(write, v.qpn(), psn + 1),
                reth(raw_rw.addr() + 1000, raw_rw.rkey(), 8),
                b"in ERR!!",
            ));
            let t0 = Instant::now();
            while v.counters().dropped_bad_state == 0 {
                assert!(t0.elapsed() < T, "{}: packet in ERR not counted", case.name);
                std::thread::sleep(Duration::from_micros(200));
            }
            hostile += 2;
            victims.push(v);
        }
        println!(
            "{} in-sequence bad requests: each NAKed ({n_ra} remote access, {n_ir} invalid request), each QP in ERR",
            cases.len()
        );
        // Half the victims are destroyed: their counters stay in the context's view, and
        // packets for their QPNs now count as unknown.
        let dead_qpns: Vec<u32> = victims
            .drain(..victims.len() / 2)
            .map(|v| v.qpn())
            .collect();

        phase("random");
        // ---- (a) random datagrams, and valid requests with a broken ICRC --------------------
        let live_qpns = [v0.qpn(), lt.qpn(), lt2.qpn()];
        // What the engine must make of each: not a RoCE v2 packet (malformed), or one whose
        // ICRC is wrong. A random ICRC verifies with odds of 2^-32 for Identification 0, but
        // with odds of 2^-16 for *some* Identification (the receiver solves for the one field
        // a UDP socket does not show, see the UDP provider's docs): over the ~15,000 random
        // RoCE-shaped packets below, one in four runs would have one. Such a packet is a valid
        // packet as far as any receiver can tell, not junk, so it is left out (and counted).
        let mut want_malformed = 0u64;
        let mut plausible_skipped = 0u64;
        let mut classify = |b: Vec<u8>| -> Option<Vec<u8>> {
            match RocePacket::new_checked(&b[..]) {
                Err(_) => want_malformed += 1,
                Ok(p) if verifies_for_some_identification(att_addr, taddr, &p) => {
                    plausible_skipped += 1;
                    return None;
                }
                Ok(_) => {}
            }
            Some(b)
        };
        let random = (0..55_000).map(|i| {
            // Always some empty ones: they used to go uncounted.
            let len = if i % 1000 == 1 {
                0
            } else {
                rng.below(9001) as usize
            };
            let mut b = rng.bytes(len);
            if i % 4 == 0 && len >= 16 {
                // A plausible BTH for a live QP: it gets as far as the ICRC check.
                let op = ferroce_wire::opcode::ALL_OPCODES
                    [rng.below(ferroce_wire::opcode::ALL_OPCODES.len() as u64) as usize];
                let qpn = live_qpns[rng.below(3) as usize];
                b[0] = op.0;
                b[1] &= 0xf0; // header version 0
                b[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
            }
            classify(b)
        });
        let random = random.flatten();
        let junk_seen = || {
            let c = t.counters();
            c.malformed + c.icrc_errors
        };
        let n_random = paced("random", random, udp_send(&att, taddr), junk_seen);
        let mut bad_icrc = Vec::new();
        for i in 0..2000u32 {
            let mut p = packet(
                att_addr,
                taddr,
                bth(Opcode::RC_RDMA_WRITE_ONLY, v0.qpn(), epsn),
                reth(raw_rw.addr() + 400, raw_rw.rkey(), 32),
                &[0xee; 32],
            );
            // Any single flipped bit, ICRC included, except in the BTH byte the ICRC masks
            // (FECN, BECN and reserved bits, which switches may change).
            let at = match (i as usize) % p.len() {
                4 => 5,
                at => at,
            };
            p[at] ^= 1 << (i % 8);
            // No Identification explains a single flipped bit: every one must be refused.
            bad_icrc.push(classify(p).expect("a single-bit error passed the ICRC check"));
        }
        println!("random RoCE-shaped packets left out as verifying for some Identification: {plausible_skipped}");
        let n_bad_icrc = paced("bad ICRC", bad_icrc, udp_send(&att, taddr), junk_seen);
        hostile += n_random + n_bad_icrc;

        phase("unknown qpn");
        // ---- (b) valid packets for QPNs the target does not have ---------------------------
        let rc_ops: Vec<Opcode> = ferroce_wire::opcode::ALL_OPCODES
            .iter()
            .copied()
            .filter(|o| o.0 < 0x20)
            .collect();
        let unknown = (0..20_000).map(|i| {
            let qpn = if i % 10 == 0 {
                dead_qpns[i % dead_qpns.len()]
            } else {
                loop {
                    let q = rng.below(1 << 24) as u32;
                    if !live_qpns.contains(&q) && victims.iter().all(|v| v.qpn() != q) {
                        break q;
                    }
                }
            };
            let op = rc_ops[rng.below(rc_ops.len() as u64) as usize];
            let info = op.info().unwrap();
            let h = info.headers;
            let ext = ExtHeaders {
                reth: h
                    .contains(ferroce_wire::opcode::HeaderSet::RETH)
                    .then_some(RethRepr {
                        va: raw_rw.addr(),
                        rkey: raw_rw.rkey(),
                        dma_len: 8,
                    }),
                aeth: h
                    .contains(ferroce_wire::opcode::HeaderSet::AETH)
                    .then_some(AethRepr {
                        syndrome: Syndrome::Ack {
                            credits: CREDITS_INVALID,
                        },
                        msn: 1,
                    }),
                atomic_eth: h
                    .contains(ferroce_wire::opcode::HeaderSet::ATOMIC_ETH)
                    .then_some(AtomicEthRepr {
                        va: mr_atomic.addr(),
                        rkey: mr_atomic.rkey(),
                        swap_add: 1,
                        compare: 0,
                    }),
                atomic_ack_eth: h
                    .contains(ferroce_wire::opcode::HeaderSet::ATOMIC_ACK_ETH)
                    .then_some(AtomicAckEthRepr { original: 7 }),
                immdt: h
                    .contains(ferroce_wire::opcode::HeaderSet::IMMDT)
                    .then_some(ferroce_wire::immdt::ImmDtRepr { value: 1 }),
                ieth: h.contains(ferroce_wire::opcode::HeaderSet::IETH).then_some(
                    ferroce_wire::ieth::IethRepr {
                        rkey: raw_rw.rkey(),
                    },
                ),
                deth: None,
            };
            let payload = if info.has_payload { 8 } else { 0 };
            packet(
                att_addr,
                taddr,
                bth(op, qpn, rng.next() as u32),
                ext,
                &[0xcc; 8][..payload],
            )
        });
        let n_unknown = paced("unknown QPN", unknown, udp_send(&att, taddr), || {
            t.counters().unknown_qpn
        });
        hostile += n_unknown;

        // Forged answers to lt2's requester, which has nothing outstanding.
        let answers = (0..2000).map(|i| {
            let psn = rng.next() as u32;
            match i % 3 {
                0 => packet(
                    att_addr,
                    taddr,
                    bth(Opcode::RC_ACKNOWLEDGE, lt2.qpn(), psn),
                    ExtHeaders {
                        aeth: Some(AethRepr {
                            syndrome: Syndrome::Nak(NakCode::RemoteAccessError),
                            msn: 0,
                        }),
                        ..Default::default()
                    },
                    &[],
                ),
                1 => packet(
                    att_addr,
                    taddr,
                    bth(Opcode::RC_RDMA_READ_RESPONSE_ONLY, lt2.qpn(), psn),
                    ExtHeaders {
                        aeth: Some(AethRepr {
                            syndrome: Syndrome::Ack {
                                credits: CREDITS_INVALID,
                            },
                            msn: 0,
                        }),
                        ..Default::default()
                    },
                    &[0x77; 64],
                ),
                _ => packet(
                    att_addr,
                    taddr,
                    bth(Opcode::RC_ATOMIC_ACKNOWLEDGE, lt2.qpn(), psn),
                    ExtHeaders {
                        aeth: Some(AethRepr {
                            syndrome: Syndrome::Ack {
                                credits: CREDITS_INVALID,
                            },
                            msn: 0,
                        }),
                        atomic_ack_eth: Some(AtomicAckEthRepr { original: 1 }),
                        ..Default::default()
                    },
                    &[],
                ),
            }
        });
        hostile += paced("forged answers", answers, udp_send(&att, taddr), || {
            lt2.counters().duplicate_response
        });
        assert_eq!(lt2.state(), QpState::Rts);

        // A different port on the peer's address is not refused, by design: RoCE v2 senders
        // choose the UDP source port per QP (for ECMP) and ferroce's peers each send from
        // their own; rxe does not check it either. Such packets (all of `att`'s above, whose
        // port is nobody's peer port) met the transport's checks instead.
        phase("wrong source");
        // ---- (d) another source address: refused before any QP sees it ---------------------
        let other = UdpSocket::bind((Ipv4Addr::new(127, 0, 0, 2), 0)).unwrap();
        let other_addr = other.local_addr().unwrap();
        let spoofed = (0..10_000).map(|i| {
            if i % 2 == 0 {
                // In sequence and valid for V0: only the source is wrong.
                packet(
                    other_addr,
                    taddr,
                    bth(Opcode::RC_RDMA_WRITE_ONLY, v0.qpn(), epsn),
                    reth(raw_rw.addr() + 600, raw_rw.rkey(), 16),
                    &[0xab; 16],
                )
            } else {
                packet(
                    other_addr,
                    taddr,
                    bth(Opcode::RC_FETCH_ADD, lt.qpn(), rng.next() as u32),
                    atomic_eth(
                        legit_target.addr() + 65_528,
                        legit_target.rkey(),
                        1 << 40,
                        0,
                    ),
                    &[],
                )
            }
        });
        let n_wrong_source = paced("wrong source", spoofed, udp_send(&other, taddr), || {
            t.counters().wrong_source
        });
        hostile += n_wrong_source;

        phase("raw forged");
        // ---- (d) the legitimate peer's exact IP and port, forged through a raw socket -------
        let n_forged = match raw_socket() {
            None => {
                // Without root this part is left out, except under CI (which runs as root).
                let _ = ferroce_test_support::require(
                    false,
                    "hostile: packets forged with the peer's exact IP:port",
                    "a raw socket (root)",
                    "run scripts/test.sh as root, as CI does",
                );
                0
            }
            Some(fd) => {
                let src = SocketAddrV4::new(LOCALHOST, ll.udp_src_port());
                let dst = SocketAddrV4::new(LOCALHOST, taddr.port());
                let forged = (0..10_000).map(|i| {
                    // Far from lt's expected PSN (which the legit traffic moves by a few
                    // thousand at most): out of sequence or duplicate, never executed.
                    let base = ll.next_send_psn().value();
                    let off = 0x10_0000 + rng.below(0x60_0000) as u32;
                    let psn = if i % 2 == 0 {
                        base.wrapping_add(off)
                    } else {
                        base.wrapping_sub(off)
                    };
                    let q = lt.qpn();
                    let (op, ext, payload): (Opcode, ExtHeaders, &[u8]) = match i % 4 {
                        0 => (
                            Opcode::RC_RDMA_WRITE_ONLY,
                            reth(legit_target.addr() + 65_528, legit_target.rkey(), 8),
                            &[0xff; 8],
                        ),
                        1 => (
                            Opcode::RC_FETCH_ADD,
                            atomic_eth(
                                legit_target.addr() + 65_528,
                                legit_target.rkey(),
                                1 << 32,
                                0,
                            ),
                            &[],
                        ),
                        2 => (read, reth(legit_target.addr(), guessed, 4096), &[]),
                        _ => (
                            Opcode::RC_RDMA_WRITE_MIDDLE,
                            ExtHeaders::default(),
                            &[0xfe; 1024],
                        ),
                    };
                    packet(SocketAddr::V4(src), taddr, bth(op, q, psn), ext, payload)
                });
                let n = paced(
                    "forged peer",
                    forged,
                    |p| raw_send(&fd, src, dst, p),
                    || {
                        let c = lt.counters();
                        c.out_of_seq_request + c.duplicate_request
                    },
                );
                println!(
                    "{n} packets forged with the peer's exact address {src} to QP 0x{:x}",
                    lt.qpn()
                );
                n
            }
        };
        hostile += n_forged;
        let rss_after = vm_rss_kib();

        phase("done");
        // ---- V0 still works after all of it --------------------------------------------------
        drain(&ans);
        let d5 = rng.bytes(24);
        send_ans(&packet(
            ans_addr,
            taddr,
            bth(Opcode::RC_RDMA_WRITE_ONLY, v0.qpn(), epsn),
            reth(raw_rw.addr() + 500, raw_rw.rkey(), 24),
            &d5,
        ));
        rw_model[rw_off + 500..rw_off + 524].copy_from_slice(&d5);
        let a = answer(&ans, T).expect("V0 answers after the attack");
        assert_eq!(
            (a.opcode, a.psn, a.syndrome.map(|s| s.is_ack())),
            (Opcode::RC_ACKNOWLEDGE, epsn & 0xff_ffff, Some(true))
        );

        // ---- the legitimate pair keeps completing, served by T's engine thread alone --------
        let at_end = rounds.load(Ordering::Acquire);
        let t0 = Instant::now();
        while rounds.load(Ordering::Acquire) < at_end + 50 {
            assert!(t0.elapsed() < T, "legit traffic stalled after the attack");
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Ordering::Release);
        let adds = legit.join().expect("legit traffic thread");
        assert_eq!(
            legit_target.read_u64(65_528).unwrap(),
            adds,
            "every legit FETCH_ADD counted once, no forged one"
        );
        assert_eq!(engine_threads(), threads_before, "an engine thread died");

        // ---- memory ---------------------------------------------------------------------------
        let growth = rss_after.saturating_sub(rss_before);
        println!(
            "{hostile} hostile packets; VmRSS {rss_before} KiB before, {rss_after} KiB after (+{growth} KiB); {adds} legit rounds"
        );
        assert!(hostile >= 100_000, "{hostile} hostile packets");
        assert!(growth < 32 * 1024, "VmRSS grew by {growth} KiB");

        // ---- counters -------------------------------------------------------------------------
        let c1 = t.counters();
        let d = |name| delta(&c0, &c1, name);
        println!(
            "counters: malformed {} icrc_errors {} unknown_qpn {} wrong_source {} rkey_violations {} send_invalid_request {} out_of_seq_request {} duplicate_request {} duplicate_response {} dropped_bad_state {}",
            d("malformed"),
            d("icrc_errors"),
            d("unknown_qpn"),
            d("wrong_source"),
            d("rkey_violations"),
            d("send_invalid_request"),
            d("out_of_seq_request"),
            d("duplicate_request"),
            d("duplicate_response"),
            d("dropped_bad_state")
        );
        assert_eq!(d("malformed"), want_malformed);
        assert_eq!(d("icrc_errors"), n_random + n_bad_icrc - want_malformed);
        assert_eq!(d("unknown_qpn"), n_unknown);
        assert_eq!(d("wrong_source"), n_wrong_source);
        // The context's view sums every QP, destroyed victims included.
        assert_eq!(d("rkey_violations"), n_ra);
        assert_eq!(d("send_invalid_request"), n_ir);
        assert!(d("dropped_bad_state") >= cases.len() as u64);
        assert!(d("duplicate_response") >= 2000);
        let v = v0.counters();
        assert_eq!(v.out_of_seq_request, 2000);
        assert_eq!(v.send_seq_nak, 1);
        assert_eq!(v.duplicate_request, 2000 + 3);
        assert_eq!(v.send_rnr_err, 1);
        assert_eq!((v.rkey_violations, v.send_invalid_request), (0, 0));
        assert_eq!(v0.state(), QpState::Rts);
        let c = lt.counters();
        assert!(c.out_of_seq_request + c.duplicate_request >= n_forged);
        assert_eq!((c.rkey_violations, c.send_invalid_request), (0, 0));
        assert_eq!((lt.state(), ll.state()), (QpState::Rts, QpState::Rts));
    });

    // ---- memory: canaries and regions, compared byte for byte --------------------------------
    let ro_now = mr_ro.to_vec(0, 8192).unwrap();
    let atomic_now = mr_atomic.to_vec(0, 4096).unwrap();
    let new_now = mr_new.to_vec(0, 4096).unwrap();
    let foreign_now = mr_foreign.to_vec(0, 4096).unwrap();
    drop((
        raw_rw,
        raw_ro,
        raw_none,
        mr_ro,
        mr_atomic,
        mr_foreign,
        mr_new,
        legit_target,
    ));
    drop((
        lt, ll, lt2, ll2, v0, lsrc, ldst, tcq, lcq, tpd, lpd, other_pd,
    ));
    drop((t, l));
    assert_eq!(ro_now, ro_pattern, "read-only region changed");
    let mut atomic_model = vec![0u8; 4096];
    atomic_model[8..16].copy_from_slice(&0x1234u64.to_ne_bytes());
    atomic_model[16..24].copy_from_slice(&0xdeadu64.to_ne_bytes());
    assert_eq!(
        atomic_now, atomic_model,
        "atomic region: only the two valid atomics"
    );
    assert!(
        new_now.iter().all(|&b| b == 0),
        "the region in the stale key's slot changed"
    );
    assert!(
        foreign_now.iter().all(|&b| b == 0),
        "another PD's region changed"
    );
    let first_diff = |got: &[u8], want: &[u8]| got.iter().zip(want).position(|(a, b)| a != b);
    let got = raw[0].snapshot();
    assert_eq!(
        first_diff(&got, &rw_model),
        None,
        "read-write caller memory or its canary"
    );
    assert_eq!(
        first_diff(&raw[1].snapshot(), &raw_init[1]),
        None,
        "read-only caller memory"
    );
    assert_eq!(
        first_diff(&raw[2].snapshot(), &raw_init[2]),
        None,
        "caller memory without remote rights"
    );
}
