//! Hostile same-host peers against the shared-memory provider, as real processes (issue #28).
//!
//! The attackers are other processes made by re-executing this test binary on one of the
//! `child_*` tests with [`CHILD_ENV`] naming the role; they speak the shared-memory hello
//! protocol by hand (raw `SOCK_SEQPACKET`, `SCM_RIGHTS`, memfds), as a hostile program would,
//! and know the page layouts only as this file spells them out.
//!
//! What the scenarios prove:
//! - a hello forged by another process (well-formed, with sealed memfds of the right sizes and
//!   stamps, naming the victim's QP and its real peer's QP number) links nothing: the victim's
//!   QP links with its real peer, whose memory takes the WRITEs, and the forger's ring gets no
//!   byte; malformed hellos (garbage, unsealed memfds, regular files, no descriptors) and a
//!   connection that says nothing are refused and counted, and nothing changes when they go;
//! - a linked peer that lies in the shared pages (the victim's inbound ring's producer position,
//!   or its own ring's consumer position) ends only its own links: each QP it lied to goes to
//!   ERR with its work flushed, the violations are counted, the victim process lives on and its
//!   other QPs keep working; and the memfds the victim handed it cannot be truncated (sealed);
//! - a flood of well-formed hellos parked for QPs that do not exist fills the victim's bound:
//!   the next hello is refused, yet the QP pair whose one hello was refused still works in both
//!   directions (the linked side sends through the ring, the other over UDP): a refusal costs
//!   the shortcut, never the QPs;
//! - a peer of another uid (`nobody`) never links: both sides use UDP, data verified, and the
//!   victim counts the refusal.

use std::io::{BufRead, BufReader, Write};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use ferroce::cm::{EndpointInfo, Listener, RemoteRegion};
use ferroce::{
    device_by_name, Access, CompletionQueue, ConnectOptions, Context, ContextOptions, MemoryRegion,
    ProtectionDomain, Provider, Psn, QpCaps, QpInitAttr, QpState, QueuePair, RecvWr, SendOp,
    SendWr, WcStatus,
};

/// Names the role of a child process; absent in the parent.
const CHILD_ENV: &str = "FERROCE_HOSTILE_CHILD";
/// The victim context's RoCE address (`IP:PORT`).
const VICTIM_ENV: &str = "FERROCE_HOSTILE_VICTIM";
/// The victim's QP number the forged hellos name.
const VICTIM_QPN_ENV: &str = "FERROCE_HOSTILE_VICTIM_QPN";
/// The QP number of the victim's real peer, which the forged hello claims to be.
const PEER_QPN_ENV: &str = "FERROCE_HOSTILE_PEER_QPN";
/// The `cm` listener of the parent, for the child of another uid.
const CM_ENV: &str = "FERROCE_HOSTILE_CM";

/// Bound on any single wait: a failure is a hang, not slowness.
const T: Duration = Duration::from_secs(20);

// ---- the shared pages' layout, as a hostile program would copy it ----------------------------

const TABLE_MAGIC: &[u8; 8] = b"FRCESHT2";
const TABLE_LEN: usize = 4096 + (1 << 16) * 64;
const PAGE_MAGIC: &[u8; 8] = b"FRCESHQ1";
const PAGE_LEN: usize = 4096 + (1 << 20);
/// Byte offsets of a QP page's ring positions and its state word.
const P_HEAD: usize = 64;
const P_TAIL: usize = 128;
const P_STATE: usize = 8;
const P_ACCESS: usize = 12;

fn hello(from: u32, to: u32) -> [u8; 16] {
    let mut h = [0u8; 16];
    h[0..4].copy_from_slice(b"FRSH");
    h[4] = 2;
    h[8..12].copy_from_slice(&from.to_le_bytes());
    h[12..16].copy_from_slice(&to.to_le_bytes());
    h
}

fn abstract_name(addr: SocketAddr) -> Vec<u8> {
    format!("\0ferroce-shm/{}/{}", addr.ip(), addr.port()).into_bytes()
}

fn sockaddr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_un to fill in.
    let mut a: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    a.sun_family = libc::AF_UNIX as libc::sa_family_t;
    for (d, s) in a.sun_path.iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + name.len();
    (a, len as libc::socklen_t)
}

fn seqpacket() -> OwnedFd {
    // SAFETY: plain socket(2), checked.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0);
    // SAFETY: a fresh descriptor.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn connect_to(addr: SocketAddr) -> OwnedFd {
    let s = seqpacket();
    let (a, len) = sockaddr(&abstract_name(addr));
    // SAFETY: `a` is a live sockaddr_un of `len` bytes.
    let r = unsafe { libc::connect(s.as_raw_fd(), (&a as *const libc::sockaddr_un).cast(), len) };
    assert_eq!(r, 0, "connect: {}", std::io::Error::last_os_error());
    s
}

fn send_fds(sock: RawFd, bytes: &[u8], fds: &[RawFd]) {
    let r = try_send_fds(sock, bytes, fds);
    assert_eq!(r.as_ref().ok(), Some(&bytes.len()), "sendmsg: {r:?}");
}

/// One message and its descriptors; what `sendmsg` said.
fn try_send_fds(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<usize> {
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: all-zero is a valid msghdr before its fields are set.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !fds.is_empty() {
        let payload = std::mem::size_of_val(fds) as u32;
        msg.msg_control = cbuf.as_mut_ptr().cast();
        // SAFETY: pure size computations; the control buffer (64 bytes) holds one header with
        // up to 4 descriptors.
        unsafe {
            msg.msg_controllen = libc::CMSG_SPACE(payload) as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(payload) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        }
    }
    // SAFETY: `msg` describes live buffers.
    let n = unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// One message and its descriptors (blocking).
fn recv_fds(sock: RawFd) -> (Vec<u8>, Vec<OwnedFd>) {
    let mut buf = [0u8; 64];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 16];
    // SAFETY: all-zero is a valid msghdr before its fields are set.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    // SAFETY: `msg` describes live buffers.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    assert!(n >= 0, "recvmsg: {}", std::io::Error::last_os_error());
    let mut fds = Vec::new();
    // SAFETY: the kernel wrote well-formed headers within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_type == libc::SCM_RIGHTS {
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    let fd = libc::CMSG_DATA(c).cast::<RawFd>().add(i).read_unaligned();
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    (buf[..n as usize].to_vec(), fds)
}

/// A memfd of `len` bytes stamped with `magic`, sealed against resizing if `seal`.
fn memfd(len: usize, magic: &[u8; 8], seal: bool) -> OwnedFd {
    // SAFETY: a literal C string; checked.
    let fd = unsafe { libc::memfd_create(c"attacker".as_ptr(), libc::MFD_ALLOW_SEALING) };
    assert!(fd >= 0);
    // SAFETY: fresh descriptor.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: plain syscalls on our descriptor.
    unsafe {
        assert_eq!(libc::ftruncate(fd.as_raw_fd(), len as libc::off_t), 0);
        assert_eq!(libc::pwrite(fd.as_raw_fd(), magic.as_ptr().cast(), 8, 0), 8);
        if seal {
            let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
            assert_eq!(libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals), 0);
        }
    }
    fd
}

/// A writable shared mapping of `len` bytes of `fd`.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(fd: RawFd, len: usize) -> Mapping {
        // SAFETY: a fresh shared mapping; checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Mapping { ptr: p.cast(), len }
    }

    fn word(&self, at: usize) -> &std::sync::atomic::AtomicU64 {
        assert!(at % 8 == 0 && at + 8 <= self.len);
        // SAFETY: inside the mapping, aligned, shared memory accessed atomically.
        unsafe { std::sync::atomic::AtomicU64::from_ptr(self.ptr.add(at).cast()) }
    }

    fn word32(&self, at: usize) -> &std::sync::atomic::AtomicU32 {
        assert!(at % 4 == 0 && at + 4 <= self.len);
        // SAFETY: as for `word`.
        unsafe { std::sync::atomic::AtomicU32::from_ptr(self.ptr.add(at).cast()) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: exactly the mapping made in `new`.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// `(seals, ftruncate's errno)` for a descriptor handed over by the victim.
fn seals_and_truncate(fd: RawFd) -> (i32, i32) {
    // SAFETY: plain fcntl/ftruncate on a descriptor we hold.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    // SAFETY: as above.
    let r = unsafe { libc::ftruncate(fd, 4096) };
    let errno = if r == 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
    };
    (seals, errno)
}

// ---- the victim's side ---------------------------------------------------------------------

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
}

fn side(provider: Provider) -> Side {
    let ctx = device_by_name("lo")
        .unwrap()
        .open(&ContextOptions {
            capture: None,
            provider,
            ..ContextOptions::with_port(0)
        })
        .unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024, None).unwrap();
    Side { ctx, pd, cq }
}

fn new_qp(s: &Side) -> QueuePair {
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        ..QpCaps::default()
    };
    s.pd.create_qp(&QpInitAttr::new(&s.cq, caps)).unwrap()
}

fn all_rights() -> Access {
    Access::LOCAL_WRITE
        .with(Access::REMOTE_WRITE)
        .with(Access::REMOTE_READ)
        .with(Access::REMOTE_ATOMIC)
}

fn region_of(mr: &MemoryRegion) -> RemoteRegion {
    RemoteRegion {
        addr: mr.addr(),
        rkey: mr.rkey(),
        len: mr.len() as u64,
    }
}

fn psn(n: u32) -> Psn {
    Psn::new(n.wrapping_mul(2_654_435_761) & 0x00ff_ffff)
}

fn opts() -> ConnectOptions {
    ConnectOptions {
        access: all_rights(),
        ..ConnectOptions::default()
    }
}

/// `len` bytes that differ per `seed`.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// Waits for `cq`'s next completion and returns its `(wr_id, status)`.
fn next_wc(cq: &CompletionQueue) -> (u64, WcStatus) {
    let got = cq.wait(1, T).unwrap();
    assert_eq!(got.len(), 1, "no completion within {T:?}");
    (got[0].wr_id, got[0].status)
}

/// The first `len` bytes of `mr`.
fn read_all(mr: &MemoryRegion, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    mr.read(0, &mut v).unwrap();
    v
}

/// WRITEs a fresh pattern from `src` into `dst`'s region through `qp` and checks every byte
/// landed; returns the direct operations the context counted for it.
fn verified_write(s: &Side, qp: &QueuePair, src: &MemoryRegion, dst: &MemoryRegion, seed: u64) {
    let len = src.len().min(dst.len());
    let data = pattern(seed, len);
    src.write(0, &data).unwrap();
    qp.post_send(
        SendWr::new(seed, SendOp::Write, vec![src.sge(0, len).unwrap()])
            .remote(dst.addr(), dst.rkey()),
    )
    .unwrap();
    assert_eq!(next_wc(&s.cq), (seed, WcStatus::Success));
    assert_eq!(read_all(dst, len), data, "WRITE {seed}");
}

/// A child process of this test binary running `role`, with line-wise stdout.
struct Attacker {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
}

impl Attacker {
    fn spawn(role: &str, vars: &[(&str, String)], uid: Option<u32>) -> Attacker {
        let exe = std::env::current_exe().unwrap();
        let test = format!("child_{role}");
        let mut cmd = Command::new(&exe);
        cmd.args(["--exact", &test, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        for (k, v) in vars {
            cmd.env(k, v);
        }
        if let Some(uid) = uid {
            cmd.uid(uid).gid(uid);
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        Attacker {
            child,
            stdin,
            stdout,
        }
    }

    /// The value after `tag ` on the next line that has it (other lines are the test
    /// harness's own).
    fn expect(&mut self, tag: &str) -> String {
        let mut line = String::new();
        loop {
            line.clear();
            let n = self.stdout.read_line(&mut line).unwrap();
            assert!(n > 0, "the child ended before saying {tag}");
            // The harness may have printed "test child_x ... " on the same line first.
            let key = format!("{tag} ");
            if let Some(at) = line.find(&key) {
                return line[at + key.len()..].trim_end().to_string();
            }
        }
    }

    fn say(&mut self, line: &str) {
        let w = self.stdin.as_mut().unwrap();
        writeln!(w, "{line}").unwrap();
        w.flush().unwrap();
    }

    /// Closes its stdin (its signal to finish) and waits for it to exit successfully.
    fn finish(mut self) {
        drop(self.stdin.take());
        let st = self.child.wait().unwrap();
        assert!(st.success(), "the child failed: {st:?}");
    }
}

impl Drop for Attacker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

fn is_child(role: &str) -> bool {
    std::env::var(CHILD_ENV).as_deref() == Ok(role)
}

/// Blocks until stdin closes (the parent's signal).
fn wait_for_parent() {
    let mut s = String::new();
    while std::io::stdin()
        .read_line(&mut s)
        .map(|n| n > 0)
        .unwrap_or(false)
    {
        s.clear();
    }
}

/// Connects `a` and `b` (both in this process) to each other.
fn connect_pair(a: &QueuePair, b: &QueuePair, region_a: Option<RemoteRegion>) {
    let ia = a.endpoint_info(psn(a.qpn()), region_a);
    let ib = b.endpoint_info(psn(b.qpn()), None);
    a.connect(&ia, &ib, &opts()).unwrap();
    b.connect(&ib, &ia, &opts()).unwrap();
}

// ---- scenario 1: forged and malformed hellos -----------------------------------------------

#[test]
fn forged_and_malformed_hellos_from_another_process_link_nothing() {
    let victim = side(Provider::Shm);
    let peer = side(Provider::Shm);
    let qv = new_qp(&victim);
    let qp = new_qp(&peer);
    let src = victim.pd.alloc_mr(8192, Access::LOCAL_WRITE).unwrap();
    let dst = peer.pd.alloc_mr(8192, all_rights()).unwrap();
    let mut attacker = Attacker::spawn(
        "forger",
        &[
            (VICTIM_ENV, victim.ctx.local_addr().to_string()),
            (VICTIM_QPN_ENV, qv.qpn().to_string()),
            (PEER_QPN_ENV, qp.qpn().to_string()),
        ],
        None,
    );
    // The forged hellos are in the victim's listener before its QP reaches RTR, where they
    // would be taken if anything but the sender's identity decided.
    assert_eq!(attacker.expect("SENT"), "before");
    connect_pair(&qv, &qp, None);
    // Forged again, now that the QP is linking and then linked.
    attacker.say("again");
    assert_eq!(attacker.expect("SENT"), "after");
    for seed in 1..=20 {
        verified_write(&victim, &qv, &src, &dst, seed);
    }
    let c = victim.ctx.counters();
    assert!(
        c.direct_ops >= 19,
        "the WRITEs went straight into the real peer's memory: {c:?}"
    );
    // SEND/RECV goes through the real peer's ring.
    let rbuf = peer.pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    qp.post_recv(RecvWr {
        wr_id: 7,
        sgl: vec![rbuf.sge(0, 4096).unwrap()],
    })
    .unwrap();
    let msg = pattern(99, 3000);
    src.write(0, &msg).unwrap();
    qv.post_send(SendWr::new(
        8,
        SendOp::Send,
        vec![src.sge(0, 3000).unwrap()],
    ))
    .unwrap();
    assert_eq!(next_wc(&victim.cq), (8, WcStatus::Success));
    assert_eq!(next_wc(&peer.cq), (7, WcStatus::Success));
    assert_eq!(read_all(&rbuf, 3000), msg);
    // Garbage, unsealed memfds, regular files, a hello without descriptors, one with three,
    // and (after 2 s) the connection that said nothing: each refused and counted, while the
    // victim keeps working.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seed = 100;
    while victim.ctx.counters().shm_links_refused < 6 {
        assert!(
            Instant::now() < deadline,
            "refusals counted: {:?}",
            victim.ctx.counters()
        );
        seed += 1;
        verified_write(&victim, &qv, &src, &dst, seed);
        std::thread::sleep(Duration::from_millis(20));
    }
    // The forger's rings never saw a byte, and it goes away without touching the link.
    drop(attacker.stdin.take());
    assert_eq!(attacker.expect("RING"), "0 0");
    attacker.finish();
    std::thread::sleep(Duration::from_millis(50));
    verified_write(&victim, &qv, &src, &dst, 1000);
    assert_eq!(qv.state(), QpState::Rts);
    assert_eq!(victim.ctx.counters().shm_peer_violations, 0);
}

/// The forger: hellos to the victim's listener claiming to be its peer, before and after the
/// victim links, plus every malformed kind; reports whether its own rings got anything.
#[test]
fn child_forger() {
    if !is_child("forger") {
        return;
    }
    let victim: SocketAddr = env(VICTIM_ENV).parse().unwrap();
    let victim_qpn: u32 = env(VICTIM_QPN_ENV).parse().unwrap();
    let peer_qpn: u32 = env(PEER_QPN_ENV).parse().unwrap();
    let table = memfd(TABLE_LEN, TABLE_MAGIC, true);
    let pages: Vec<OwnedFd> = (0..2).map(|_| memfd(PAGE_LEN, PAGE_MAGIC, true)).collect();
    let views: Vec<Mapping> = pages
        .iter()
        .map(|p| Mapping::new(p.as_raw_fd(), PAGE_LEN))
        .collect();
    for v in &views {
        // A page that says "serving, every right", to lure one-sided operations.
        v.word32(P_STATE)
            .store(3, std::sync::atomic::Ordering::Release);
        v.word32(P_ACCESS)
            .store(0xff, std::sync::atomic::Ordering::Release);
    }
    let mut held = Vec::new();
    let forge = |page: &OwnedFd| {
        let s = connect_to(victim);
        send_fds(
            s.as_raw_fd(),
            &hello(peer_qpn, victim_qpn),
            &[table.as_raw_fd(), page.as_raw_fd()],
        );
        s
    };
    held.push(forge(&pages[0]));
    // Malformed: garbage; unsealed memfds; regular files; no descriptors; three descriptors.
    let s = connect_to(victim);
    send_fds(s.as_raw_fd(), b"\xde\xad\xbe\xef garbage hello!", &[]);
    held.push(s);
    let unsealed = [
        memfd(TABLE_LEN, TABLE_MAGIC, false),
        memfd(PAGE_LEN, PAGE_MAGIC, false),
    ];
    let s = connect_to(victim);
    let h = hello(peer_qpn + 1, victim_qpn);
    send_fds(
        s.as_raw_fd(),
        &h,
        &[unsealed[0].as_raw_fd(), unsealed[1].as_raw_fd()],
    );
    held.push(s);
    let file = std::fs::File::open(std::env::current_exe().unwrap()).unwrap();
    let s = connect_to(victim);
    send_fds(s.as_raw_fd(), &h, &[file.as_raw_fd(), file.as_raw_fd()]);
    held.push(s);
    let s = connect_to(victim);
    send_fds(s.as_raw_fd(), &h, &[]);
    held.push(s);
    let s = connect_to(victim);
    let three = [table.as_raw_fd(), pages[1].as_raw_fd(), table.as_raw_fd()];
    send_fds(s.as_raw_fd(), &h, &three);
    held.push(s);
    // Silent: connects and says nothing.
    held.push(connect_to(victim));
    println!("SENT before");
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    held.push(forge(&pages[1]));
    println!("SENT after");
    wait_for_parent();
    let heads: Vec<String> = views
        .iter()
        .map(|v| {
            v.word(P_HEAD)
                .load(std::sync::atomic::Ordering::Acquire)
                .to_string()
        })
        .collect();
    println!("RING {}", heads.join(" "));
}

// ---- scenario 2: a linked peer that lies ---------------------------------------------------

#[test]
fn a_peer_that_lies_in_the_shared_pages_fails_only_what_it_reaches() {
    let victim = side(Provider::Shm);
    let good = side(Provider::Shm);
    let mut liar = Attacker::spawn(
        "liar",
        &[(VICTIM_ENV, victim.ctx.local_addr().to_string())],
        None,
    );
    let liar_addr: SocketAddr = liar.expect("ADDR").parse().unwrap();
    // Two QPs to the liar (fake QP numbers 0x100 and 0x101 on its side), and a pair that
    // has nothing to do with it.
    let qa = new_qp(&victim);
    let qb = new_qp(&victim);
    let qv = new_qp(&victim);
    let qg = new_qp(&good);
    let rbuf = victim.pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    for (q, fake) in [(&qa, 0x100u32), (&qb, 0x101)] {
        let local = q.endpoint_info(psn(q.qpn()), None);
        let peer = EndpointInfo {
            qpn: fake,
            udp_port: liar_addr.port(),
            ..local
        };
        // The liar never acknowledges anything: qb's SEND that proves its link (below) is
        // retransmitted every ~1 s (timeout 18) rather than every 67 ms, so however long the
        // liar takes to see it, it is not failed by its retries before the lie fails it.
        let o = ConnectOptions {
            timeout: 18,
            ..opts()
        };
        q.connect(&local, &peer, &o).unwrap();
        liar.say(&q.qpn().to_string());
    }
    qa.post_recv(RecvWr {
        wr_id: 1,
        sgl: vec![rbuf.sge(0, 4096).unwrap()],
    })
    .unwrap();
    let src = victim.pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let dst = good.pd.alloc_mr(4096, all_rights()).unwrap();
    connect_pair(&qv, &qg, None);
    verified_write(&victim, &qv, &src, &dst, 1);
    // What the liar found about the memfds the victim handed it: sealed against shrinking
    // and growing, and ftruncate refused with EPERM.
    let sealed = liar.expect("SEALS");
    let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    for pair in sealed.split(' ') {
        let (seals, errno) = pair.split_once('/').unwrap();
        let seals: i32 = seals.parse().unwrap();
        assert_eq!(seals & need, need, "seals of a victim memfd: {sealed}");
        assert_eq!(errno, libc::EPERM.to_string(), "ftruncate: {sealed}");
    }
    assert_eq!(liar.expect("LINKED"), "2");
    // The liar lies only once qb is linked, which it sees from its side: a packet of qb's in
    // its ring. That its hellos went out says nothing of that: the victim's engine reads them
    // on its own schedule, and `provider()` says `Shm` from the moment a QP's *own* hello went
    // out, linked or not, so waiting for it was no wait. Under load the lie then came before
    // the victim read qb's hello: a hello whose ring positions disagree, refused as any unfit
    // hello is (`shm_links_refused`, not a violation), so qb never linked and sent over UDP to
    // the liar's UDP port (the destination the application named), which never answers: the
    // SEND failed with TransportRetryExceeded instead of being flushed.
    qb.post_send(SendWr::new(2, SendOp::Send, vec![src.sge(0, 64).unwrap()]))
        .unwrap();
    liar.say("lie");
    assert_eq!(liar.expect("LIED"), "head tail");
    // qb: the liar's ring's consumer position is a lie; the next look at the ring (for this
    // SEND's packet at the latest) ends the link: both SENDs are flushed.
    qb.post_send(SendWr::new(3, SendOp::Send, vec![src.sge(0, 64).unwrap()]))
        .unwrap();
    // qa: its own inbound ring's producer position is a lie; the engine drains the ring, sees
    // it, and ends the link: the posted RECV is flushed. The two QPs fail independently, so
    // their completions come in either order; each QP's in its own posting order.
    let wcs: Vec<(u64, WcStatus)> = (0..3).map(|_| next_wc(&victim.cq)).collect();
    let flushed = WcStatus::WorkRequestFlushed;
    let qb_wcs: Vec<_> = wcs.iter().filter(|w| w.0 != 1).copied().collect();
    assert!(wcs.contains(&(1, flushed)), "{wcs:?}");
    assert_eq!(qb_wcs, [(2, flushed), (3, flushed)], "{wcs:?}");
    assert_eq!(qa.state(), QpState::Error);
    assert_eq!(qb.state(), QpState::Error);
    assert_eq!(victim.ctx.counters().shm_peer_violations, 2);
    // The rest of the process carries on.
    for seed in 2..20 {
        verified_write(&victim, &qv, &src, &dst, seed);
    }
    assert_eq!(qv.state(), QpState::Rts);
    liar.finish();
}

/// The liar: the named peer of two victim QPs. It takes their hellos, checks what it may do to
/// the memfds they carried, links them with hellos of its own, waits until the second QP's
/// packets come through its ring (that QP is linked), then lies: the producer position of the
/// first QP's inbound ring, and the consumer position of its own ring for the second.
#[test]
fn child_liar() {
    if !is_child("liar") {
        return;
    }
    let victim: SocketAddr = env(VICTIM_ENV).parse().unwrap();
    // A UDP port of its own names it, as a context's would.
    let udp = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let me = udp.local_addr().unwrap();
    let listener = seqpacket();
    let (a, len) = sockaddr(&abstract_name(me));
    // SAFETY: `a` is a live sockaddr_un of `len` bytes; plain bind/listen.
    unsafe {
        assert_eq!(
            libc::bind(
                listener.as_raw_fd(),
                (&a as *const libc::sockaddr_un).cast(),
                len
            ),
            0
        );
        assert_eq!(libc::listen(listener.as_raw_fd(), 16), 0);
    }
    println!("ADDR {me}");
    let mut lines = std::io::stdin().lines();
    let victim_qpns: Vec<u32> = (0..2)
        .map(|_| lines.next().unwrap().unwrap().parse().unwrap())
        .collect();
    // The victim's hellos, one connection per QP.
    let mut accepted = Vec::new();
    let mut seals = Vec::new();
    let mut victim_pages = std::collections::HashMap::new();
    for _ in 0..2 {
        // SAFETY: accept on our listener; checked.
        let fd = unsafe {
            libc::accept(
                listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
        assert!(fd >= 0);
        // SAFETY: a fresh descriptor.
        let conn = unsafe { OwnedFd::from_raw_fd(fd) };
        let (msg, fds) = recv_fds(conn.as_raw_fd());
        assert_eq!(msg.len(), 16);
        assert_eq!(fds.len(), 2);
        let from = u32::from_le_bytes(msg[8..12].try_into().unwrap());
        for f in &fds {
            let (s, e) = seals_and_truncate(f.as_raw_fd());
            seals.push(format!("{s}/{e}"));
        }
        victim_pages.insert(from, Mapping::new(fds[1].as_raw_fd(), PAGE_LEN));
        accepted.push(conn);
    }
    println!("SEALS {}", seals.join(" "));
    // Link both with hellos of our own (well-formed, sealed).
    let table = memfd(TABLE_LEN, TABLE_MAGIC, true);
    let mut own_pages = Vec::new();
    let mut conns = Vec::new();
    for (i, &q) in victim_qpns.iter().enumerate() {
        let page = memfd(PAGE_LEN, PAGE_MAGIC, true);
        let s = connect_to(victim);
        send_fds(
            s.as_raw_fd(),
            &hello(0x100 + i as u32, q),
            &[table.as_raw_fd(), page.as_raw_fd()],
        );
        own_pages.push(Mapping::new(page.as_raw_fd(), PAGE_LEN));
        conns.push(s);
    }
    println!("LINKED 2");
    assert_eq!(lines.next().unwrap().unwrap(), "lie");
    // Not before the victim's second QP is linked: a packet of it in our ring says so (before
    // that, its hello may still be unread, and a lie in the page it carried would only have it
    // refused, the QP staying on UDP: a test of something else).
    let deadline = Instant::now() + T;
    while own_pages[1]
        .word(P_HEAD)
        .load(std::sync::atomic::Ordering::Acquire)
        == 0
    {
        assert!(Instant::now() < deadline, "no packet in the ring");
        std::thread::sleep(Duration::from_millis(1));
    }
    let order = std::sync::atomic::Ordering::Release;
    // The first QP's inbound ring (in the victim's page): a misaligned producer position.
    victim_pages[&victim_qpns[0]].word(P_HEAD).store(13, order);
    // Our own ring for the second QP: a consumer position far beyond anything produced.
    own_pages[1].word(P_TAIL).store(1 << 40, order);
    println!("LIED head tail");
    // `lines` holds stdin's lock.
    drop(lines);
    wait_for_parent();
    drop(udp);
}

// ---- scenario 3: a flood of parked hellos ------------------------------------------------

/// Raises this process's descriptor limit to what the scenario needs (the victim holds every
/// waiting connection and its descriptors).
fn raise_fd_limit(want: u64) {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain getrlimit/setrlimit on a live struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut l), 0);
        l.rlim_cur = l.rlim_cur.max(want.min(l.rlim_max));
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &l), 0);
    }
}

#[test]
fn a_flood_of_parked_hellos_costs_the_shortcut_not_the_qps() {
    raise_fd_limit(4096);
    let victim = side(Provider::Shm);
    let peer = side(Provider::Shm);
    let qv = new_qp(&victim);
    let qp = new_qp(&peer);
    let mut parker = Attacker::spawn(
        "parker",
        &[(VICTIM_ENV, victim.ctx.local_addr().to_string())],
        None,
    );
    assert_eq!(parker.expect("PARKED"), "300");
    // The victim's engine takes them (and refuses those past the bound).
    let deadline = Instant::now() + T;
    while victim.ctx.counters().shm_links_refused < 300 - 256 {
        assert!(Instant::now() < deadline, "{:?}", victim.ctx.counters());
        std::thread::sleep(Duration::from_millis(10));
    }
    let refused = victim.ctx.counters().shm_links_refused;
    // The peer reaches RTR first: its hello finds the victim's listener full and is refused.
    // The victim then links from its side only, and the peer links from the victim's hello: the
    // peer sends through the victim's ring, the victim over UDP.
    let src_v = victim.pd.alloc_mr(65536, all_rights()).unwrap();
    let src_p = peer.pd.alloc_mr(65536, all_rights()).unwrap();
    connect_pair(&qp, &qv, None);
    for seed in 1..=10 {
        verified_write(&victim, &qv, &src_v, &src_p, seed);
        verified_write(&peer, &qp, &src_p, &src_v, seed + 100);
    }
    let rbuf = victim.pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    qv.post_recv(RecvWr {
        wr_id: 77,
        sgl: vec![rbuf.sge(0, 4096).unwrap()],
    })
    .unwrap();
    let msg = pattern(5, 4000);
    src_p.write(0, &msg).unwrap();
    qp.post_send(SendWr::new(
        78,
        SendOp::Send,
        vec![src_p.sge(0, 4000).unwrap()],
    ))
    .unwrap();
    assert_eq!(next_wc(&peer.cq), (78, WcStatus::Success));
    assert_eq!(next_wc(&victim.cq), (77, WcStatus::Success));
    assert_eq!(read_all(&rbuf, 4000), msg);
    assert!(
        peer.ctx.counters().direct_ops >= 10,
        "the peer linked: {:?}",
        peer.ctx.counters()
    );
    assert_eq!(qv.state(), QpState::Rts);
    assert_eq!(qp.state(), QpState::Rts);
    assert!(
        victim.ctx.counters().shm_links_refused > refused,
        "the peer's hello was refused too: {:?}",
        victim.ctx.counters()
    );
    parker.finish();
}

/// The parker: 300 connections, each with a well-formed hello (sealed memfds of the right
/// sizes) for a QP the victim does not have, held open.
#[test]
fn child_parker() {
    if !is_child("parker") {
        return;
    }
    raise_fd_limit(4096);
    let victim: SocketAddr = env(VICTIM_ENV).parse().unwrap();
    let table = memfd(TABLE_LEN, TABLE_MAGIC, true);
    let page = memfd(PAGE_LEN, PAGE_MAGIC, true);
    let held: Vec<OwnedFd> = (0..300u32)
        .map(|i| {
            let s = connect_to(victim);
            let h = hello(0x4000 + i, 0x00de_ad00 + i);
            // Past the victim's bound its engine may refuse (close) a connection before its
            // hello goes: that is the refusal under test, not a failure of the flood.
            match try_send_fds(s.as_raw_fd(), &h, &[table.as_raw_fd(), page.as_raw_fd()]) {
                Ok(n) => assert_eq!(n, h.len()),
                Err(e) => assert!(
                    matches!(e.raw_os_error(), Some(libc::EPIPE | libc::ECONNRESET)),
                    "hello {i}: {e}"
                ),
            }
            s
        })
        .collect();
    println!("PARKED {}", held.len());
    wait_for_parent();
}

// ---- scenario 4: another uid ---------------------------------------------------------------

#[test]
fn a_peer_of_another_uid_never_links_and_still_works_over_udp() {
    if !ferroce_test_support::require_root(
        "a_peer_of_another_uid_never_links",
        "to run its peer as nobody",
    ) {
        return;
    }
    // The child runs as nobody: it needs a copy of this binary it may execute.
    let dir = std::env::temp_dir().join(format!("ferroce-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("exe");
    std::fs::copy(std::env::current_exe().unwrap(), &exe).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    let s = side(Provider::Auto);
    let qp = new_qp(&s);
    let mr = s.pd.alloc_mr(65536, all_rights()).unwrap();
    let listener = Listener::bind((Ipv4Addr::LOCALHOST, 0).into()).unwrap();
    let nobody = 65534;
    let mut cmd = Command::new(&exe);
    cmd.args([
        "--exact",
        "child_other_uid",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(CHILD_ENV, "other_uid")
    .env(CM_ENV, listener.local_addr().to_string())
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .uid(nobody)
    .gid(nobody);
    let mut child = cmd.spawn().unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let local = qp.endpoint_info(psn(qp.qpn()), Some(region_of(&mr)));
    let mut conn = listener.accept(&local, T).unwrap();
    qp.connect(&local, &conn.peer, &opts()).unwrap();
    conn.sync(T).unwrap();
    assert_eq!(
        qp.provider(),
        Provider::Udp,
        "a peer of another uid is not linked"
    );
    // The child WRITEs a pattern into our region and READs it back over UDP.
    conn.sync(T).unwrap();
    assert_eq!(read_all(&mr, 65536), pattern(5, 65536));
    let mut report = String::new();
    loop {
        report.clear();
        assert!(
            out.read_line(&mut report).unwrap() > 0,
            "the child ended early"
        );
        if report.contains("PROVIDER ") {
            break;
        }
    }
    assert!(report.trim_end().ends_with("PROVIDER Udp"), "{report}");
    assert!(
        s.ctx.counters().shm_links_refused >= 1,
        "{:?}",
        s.ctx.counters()
    );
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn child_other_uid() {
    if !is_child("other_uid") {
        return;
    }
    let cm: SocketAddr = env(CM_ENV).parse().unwrap();
    let s = side(Provider::Auto);
    let qp = new_qp(&s);
    let local = qp.endpoint_info(psn(qp.qpn()), None);
    let mut conn = ferroce::cm::connect(cm, &local, T).unwrap();
    qp.connect(&local, &conn.peer, &opts()).unwrap();
    conn.sync(T).unwrap();
    let region = conn.peer.region.unwrap();
    let src = s.pd.alloc_mr(65536, Access::LOCAL_WRITE).unwrap();
    let back = s.pd.alloc_mr(65536, Access::LOCAL_WRITE).unwrap();
    let data = pattern(5, 65536);
    src.write(0, &data).unwrap();
    qp.post_send(
        SendWr::new(1, SendOp::Write, vec![src.sge(0, 65536).unwrap()])
            .remote(region.addr, region.rkey),
    )
    .unwrap();
    assert_eq!(next_wc(&s.cq), (1, WcStatus::Success));
    qp.post_send(
        SendWr::new(2, SendOp::Read, vec![back.sge(0, 65536).unwrap()])
            .remote(region.addr, region.rkey),
    )
    .unwrap();
    assert_eq!(next_wc(&s.cq), (2, WcStatus::Success));
    assert_eq!(read_all(&back, 65536), data);
    conn.sync(T).unwrap();
    println!("PROVIDER {:?}", qp.provider());
    wait_for_parent();
}
