//! The shared-memory provider between real processes (issue #5).
//!
//! Peers are separate processes made by re-executing this test binary on one of the `child_*`
//! tests (`--exact child_target --nocapture --test-threads=1`) with [`CHILD_ENV`] naming the
//! role and more variables carrying the parameters; without [`CHILD_ENV`] those tests return at
//! once, so a normal run only executes the scenarios. The parent always binds the `cm` listener
//! and hands its address to the child: which side opens the TCP connection has nothing to do
//! with which side is the RDMA target.
//!
//! What the scenarios prove:
//! - one-sided WRITE, READ and FETCH_ADD need no code in the target process at all: the target
//!   is stopped with SIGSTOP for 30,000 verified operations, and the parent reads the stopped
//!   process's memory through `/proc/PID/mem` to see every byte landed there; that holds from
//!   the first request after the peer reported RTS;
//! - two initiator processes hammering one counter lose and repeat no increment;
//! - a peer process that dies takes its QP to ERR with flushed completions within milliseconds,
//!   whether a SEND was waiting on it or WRITEs were streaming straight into its memory, and
//!   the survivor's other QPs carry on;
//! - every refused request (foreign protection domain, out of bounds, missing rights,
//!   misaligned atomic, atomics the QP does not serve, a stale key whose slot holds a new
//!   region, a local buffer without LOCAL_WRITE) gets the same status over shared memory as
//!   over UDP, leaves the initiator in ERR and does not touch a byte;
//! - completions of one send queue keep posting order when direct and packet-path requests mix.

use std::io::{BufRead, BufReader, Read};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::FileExt;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferroce::cm::{self, Listener, RemoteRegion};
use ferroce::{
    device_by_name, Access, CompletionQueue, ConnectOptions, Context, ContextOptions, MemoryRegion,
    ProtectionDomain, Provider, Psn, QpCaps, QpInitAttr, QpState, QueuePair, SendOp, SendWr,
    WcOpcode, WcStatus, WorkCompletion,
};

/// Names the role of a child process; absent in the parent.
const CHILD_ENV: &str = "FERROCE_SHM_CHILD";
/// The parent's `cm` listener, for the child to connect to.
const CM_ENV: &str = "FERROCE_SHM_CM";
/// Bytes of the target child's region.
const LEN_ENV: &str = "FERROCE_SHM_LEN";
/// The value the target child stores in its region's first word, or the counter's value the
/// initiator children start from.
const BASE_ENV: &str = "FERROCE_SHM_BASE";
/// FETCH_ADDs an initiator child does.
const ITERS_ENV: &str = "FERROCE_SHM_ITERS";
/// FETCH_ADDs all initiators do together (the range the originals must lie in).
const TOTAL_ENV: &str = "FERROCE_SHM_TOTAL";
/// Set for a target child that stops itself (SIGSTOP) right after its QP reached RTS, instead
/// of a second `cm` sync.
const STOP_AFTER_RTR_ENV: &str = "FERROCE_SHM_STOP_AFTER_RTR";
/// Set for a target child whose region is its own heap memory registered on a context that
/// adopts registered pages (`ContextOptions::adopt_registered_pages`), as the drop-in
/// libibverbs does, instead of a region ferroce allocates.
const RAW_ENV: &str = "FERROCE_SHM_RAW";
/// How an initiator child reports its figures on stdout.
const RESULT_TAG: &str = "FERROCE_SHM_RESULT";

/// Bound on any single exchange or completion: generous, a failure is a hang, not slowness.
const T: Duration = Duration::from_secs(20);

fn loopback() -> SocketAddr {
    (Ipv4Addr::LOCALHOST, 0).into()
}

struct Side {
    ctx: Context,
    pd: ProtectionDomain,
    cq: CompletionQueue,
}

/// A context on loopback (its own UDP port) with one protection domain and one CQ.
fn side(provider: Provider) -> Side {
    side_adopting(provider, false)
}

fn side_adopting(provider: Provider, adopt_registered_pages: bool) -> Side {
    let ctx = device_by_name("lo")
        .unwrap()
        .open(&ContextOptions {
            capture: None,
            provider,
            adopt_registered_pages,
            ..ContextOptions::with_port(0)
        })
        .unwrap();
    assert_eq!(ctx.provider(), provider);
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(1024, None).unwrap();
    Side { ctx, pd, cq }
}

fn new_qp(pd: &ProtectionDomain, cq: &CompletionQueue) -> QueuePair {
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        ..QpCaps::default()
    };
    pd.create_qp(&QpInitAttr::new(cq, caps)).unwrap()
}

/// A first PSN that differs per QP and is not 0, so PSN mix-ups show.
fn psn_of(qpn: u32) -> Psn {
    Psn::new(qpn.wrapping_mul(2_654_435_761).wrapping_add(77) & 0x00ff_ffff)
}

/// Two listeners on loopback and one child process per listener, running `test` in `role`
/// with `vars` and the listener's address to connect to.
fn two_peers(test: &str, role: &str, vars: &[(&str, String)]) -> ([Listener; 2], Vec<Peer>) {
    let listeners = [
        Listener::bind(loopback()).unwrap(),
        Listener::bind(loopback()).unwrap(),
    ];
    let peers = listeners
        .iter()
        .map(|l| {
            let mut all = vec![(CM_ENV, l.local_addr().to_string())];
            all.extend(vars.iter().cloned());
            Peer::spawn(test, role, &all)
        })
        .collect();
    (listeners, peers)
}

/// Binds a listener and spawns a `child_target` peer serving a region of `len` bytes at
/// `base` on it, with any `extra` settings.
fn spawn_target(len: usize, base: u64, extra: &[(&str, String)]) -> (Listener, Peer) {
    let listener = Listener::bind(loopback()).unwrap();
    let mut vars = vec![
        (CM_ENV, listener.local_addr().to_string()),
        (LEN_ENV, len.to_string()),
        (BASE_ENV, base.to_string()),
    ];
    vars.extend(extra.iter().cloned());
    let peer = Peer::spawn("child_target", "target", &vars);
    (listener, peer)
}

/// Accepts each listener's peer on the matching QP, offering `region`, and checks the QP went
/// over shared memory.
fn accept_each(
    qps: &[QueuePair],
    listeners: &[Listener],
    region: Option<RemoteRegion>,
) -> Vec<cm::Connection> {
    qps.iter()
        .zip(listeners)
        .map(|(qp, l)| {
            let local = qp.endpoint_info(psn_of(qp.qpn()), region);
            let mut conn = l.accept(&local, T).unwrap();
            qp.connect(&local, &conn.peer, &options()).unwrap();
            conn.sync(T).unwrap();
            assert_eq!(qp.provider(), Provider::Shm);
            conn
        })
        .collect()
}

fn region_of(mr: &MemoryRegion) -> RemoteRegion {
    RemoteRegion {
        addr: mr.addr(),
        rkey: mr.rkey(),
        len: mr.len() as u64,
    }
}

fn options() -> ConnectOptions {
    ConnectOptions {
        min_rnr_timer: 1,
        ..ConnectOptions::default()
    }
}

/// `len` bytes that differ from one `seed` to the next and along the buffer.
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

/// The next completion (polled first, waited for only when none is there yet); checks it is
/// the successful completion of `wr_id` with `opcode` on `qp`.
fn expect_success(
    cq: &CompletionQueue,
    qp: &QueuePair,
    wr_id: u64,
    opcode: WcOpcode,
) -> WorkCompletion {
    let wc = match cq.poll_one().unwrap() {
        Some(wc) => wc,
        None => {
            let got = cq.wait(1, T).unwrap();
            assert_eq!(got.len(), 1, "no completion for wr {wr_id} within {T:?}");
            got[0]
        }
    };
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.qp_num),
        (wr_id, WcStatus::Success, opcode, qp.qpn()),
        "completion of wr {wr_id}"
    );
    wc
}

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child started without {name}"))
}

// ---- child processes -------------------------------------------------------------------------

/// A child process running one of the `child_*` tests; killed and reaped on drop whatever
/// happened (continued first, in case the test stopped it).
struct Peer {
    child: Child,
    /// Held open: the target child waits for its end.
    stdin: Option<ChildStdin>,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
    reaped: bool,
}

fn collect(r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        for line in BufReader::new(r).lines() {
            match line {
                Ok(l) => {
                    s.push_str(&l);
                    s.push('\n');
                }
                Err(_) => break,
            }
        }
        s
    })
}

impl Peer {
    fn spawn(test: &str, role: &str, vars: &[(&str, String)]) -> Peer {
        let exe = std::env::current_exe().unwrap();
        let mut cmd = Command::new(exe);
        cmd.args(["--exact", test, "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in vars {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().map(collect);
        let stderr = child.stderr.take().map(collect);
        Peer {
            child,
            stdin,
            stdout,
            stderr,
            reaped: false,
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child, which is not reaped yet (so its pid is not reused).
        let r = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(
            r,
            0,
            "kill({}, {sig}): {}",
            self.pid(),
            std::io::Error::last_os_error()
        );
    }

    /// Waits up to `limit` for the child to exit; returns its status and its stdout and
    /// stderr. Kills it (and fails) if it does not exit in time.
    fn wait(&mut self, limit: Duration) -> (ExitStatus, String, String) {
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                break Some(st);
            }
            if Instant::now() >= deadline {
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let timed_out = status.is_none();
        let status = match status {
            Some(st) => st,
            None => {
                self.signal(libc::SIGKILL);
                self.child.wait().unwrap()
            }
        };
        self.reaped = true;
        self.stdin = None;
        let out = self
            .stdout
            .take()
            .map(|h| h.join().unwrap())
            .unwrap_or_default();
        let err = self
            .stderr
            .take()
            .map(|h| h.join().unwrap())
            .unwrap_or_default();
        assert!(
            !timed_out,
            "child {} did not exit within {limit:?}\nstdout:\n{out}\nstderr:\n{err}",
            self.pid()
        );
        (status, out, err)
    }

    /// SIGKILLs the child and reaps it; checks it died of that signal.
    fn kill(&mut self) {
        self.signal(libc::SIGCONT);
        self.signal(libc::SIGKILL);
        let (status, out, err) = self.wait(T);
        assert_eq!(
            status.signal(),
            Some(libc::SIGKILL),
            "child ended otherwise: {status:?}\nstdout:\n{out}\nstderr:\n{err}"
        );
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if !self.reaped {
            // SAFETY: kill(2) on our own child, not reaped yet.
            unsafe {
                libc::kill(self.pid(), libc::SIGCONT);
                libc::kill(self.pid(), libc::SIGKILL);
            }
            let _ = self.child.wait();
        }
    }
}

/// The scheduler state letter of every thread of `pid` (`T` = stopped).
fn thread_states(pid: i32) -> Vec<(String, char)> {
    let mut v = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let entry = entry.unwrap();
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap();
        // "tid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ')'.
        let after = &stat[stat.rfind(')').unwrap() + 1..];
        let state = after.trim_start().chars().next().unwrap();
        v.push((entry.file_name().to_string_lossy().into_owned(), state));
    }
    v
}

fn all_stopped(pid: i32) -> bool {
    let s = thread_states(pid);
    !s.is_empty() && s.iter().all(|&(_, c)| c == 'T')
}

/// Sends SIGSTOP and waits until every thread of the child (the engine thread too) is stopped.
fn stop(peer: &Peer) {
    peer.signal(libc::SIGSTOP);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !all_stopped(peer.pid()) {
        assert!(
            Instant::now() < deadline,
            "child not stopped: {:?}",
            thread_states(peer.pid())
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Reads another process's memory, independently of ferroce.
fn read_process_memory(pid: i32, addr: u64, len: usize) -> Vec<u8> {
    let f = std::fs::File::open(format!("/proc/{pid}/mem")).unwrap();
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, addr).unwrap();
    buf
}

/// The target role: a region with every remote right whose first word holds [`BASE_ENV`],
/// advertised on one QP connected to the parent; then no ferroce call at all until the parent
/// kills the process (or closes stdin).
#[test]
fn child_target() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("target") {
        return;
    }
    let cm_addr: SocketAddr = env(CM_ENV).parse().unwrap();
    let len: usize = env(LEN_ENV).parse().unwrap();
    let base: u64 = env(BASE_ENV).parse().unwrap();
    let raw = std::env::var_os(RAW_ENV).is_some();
    let s = side_adopting(Provider::Shm, raw);
    let rights = Access::LOCAL_WRITE
        .with(Access::REMOTE_WRITE)
        .with(Access::REMOTE_READ)
        .with(Access::REMOTE_ATOMIC);
    let mr = if raw {
        let layout = std::alloc::Layout::from_size_align(len, 4096).unwrap();
        // SAFETY: a non-zero size. The memory is never freed: the process ends with it.
        let p = std::ptr::NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).unwrap();
        // SAFETY: `len` bytes of memory that lives as long as the process, reached only
        // through the region.
        unsafe { s.pd.register_raw(p, len, rights) }.unwrap()
    } else {
        s.pd.alloc_mr(len, rights).unwrap()
    };
    mr.write_u64(0, base).unwrap();
    let qp = new_qp(&s.pd, &s.cq);
    let local = qp.endpoint_info(psn_of(qp.qpn()), Some(region_of(&mr)));
    let mut conn = cm::connect(cm_addr, &local, T).unwrap();
    let stop_after_rtr = std::env::var_os(STOP_AFTER_RTR_ENV).is_some();
    if stop_after_rtr {
        // The parent's QP reaches RTR first, so that this QP's hello arrives while the
        // parent's is already out.
        conn.sync(T).unwrap();
    }
    qp.connect(&local, &conn.peer, &options()).unwrap();
    if stop_after_rtr {
        // SAFETY: raise(3) with a valid signal number; the process continues when the parent
        // sends SIGCONT (or dies of its SIGKILL).
        unsafe { libc::raise(libc::SIGSTOP) };
    } else {
        conn.sync(T).unwrap();
    }
    // No receive is ever posted: a SEND to this QP waits on RNR for as long as it lives.
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop((qp, mr, s));
}

/// The initiator role: [`ITERS_ENV`] FETCH_ADDs of 1 on the parent's first word, one at a time,
/// checking each completion and that the originals it sees strictly increase; prints
/// [`RESULT_TAG`] with the count, sum and sum of squares of the originals (less the base) and
/// the loop's duration.
#[test]
fn child_initiator() {
    if std::env::var(CHILD_ENV).as_deref() != Ok("initiator") {
        return;
    }
    let cm_addr: SocketAddr = env(CM_ENV).parse().unwrap();
    let iters: u64 = env(ITERS_ENV).parse().unwrap();
    let total: u64 = env(TOTAL_ENV).parse().unwrap();
    let base: u64 = env(BASE_ENV).parse().unwrap();
    let s = side(Provider::Shm);
    let result = s.pd.alloc_mr(8, Access::LOCAL_WRITE).unwrap();
    let sge = result.sge(0, 8).unwrap();
    let qp = new_qp(&s.pd, &s.cq);
    let local = qp.endpoint_info(psn_of(qp.qpn()), None);
    let mut conn = cm::connect(cm_addr, &local, T).unwrap();
    qp.connect(&local, &conn.peer, &options()).unwrap();
    conn.sync(T).unwrap();
    assert_eq!(qp.provider(), Provider::Shm);
    let remote = conn.peer.region.expect("the parent advertised no region");
    // The start signal: both initiators begin together.
    conn.sync(T).unwrap();
    let start = Instant::now();
    let (mut sum, mut sum_sq) = (0u128, 0u128);
    let mut prev: Option<u64> = None;
    for i in 0..iters {
        qp.post_send(
            SendWr::new(i, SendOp::FetchAdd { add: 1 }, vec![sge]).remote(remote.addr, remote.rkey),
        )
        .unwrap();
        let mut spins = 0u32;
        let wc = loop {
            if let Some(wc) = s.cq.poll_one().unwrap() {
                break wc;
            }
            spins += 1;
            if spins % 4096 == 0 {
                assert!(
                    start.elapsed() < Duration::from_secs(120),
                    "FETCH_ADD {i} never completed"
                );
            }
        };
        assert!(
            wc.wr_id == i && wc.status == WcStatus::Success && wc.opcode == WcOpcode::FetchAdd,
            "completion of FETCH_ADD {i}: {wc:?}"
        );
        let old = result.read_u64(0).unwrap();
        assert!(
            old >= base && old - base < total && !matches!(prev, Some(p) if old <= p),
            "FETCH_ADD {i} returned {old:#x} after {prev:x?} (base {base:#x})"
        );
        prev = Some(old);
        let v = u128::from(old - base);
        sum += v;
        sum_sq += v * v;
    }
    let ns = start.elapsed().as_nanos();
    println!("{RESULT_TAG} count={iters} sum={sum} sum_sq={sum_sq} ns={ns}");
}

// ---- scenarios -------------------------------------------------------------------------------

/// 10,000 each of WRITE, READ and FETCH_ADD into a process that is stopped the whole time.
#[test]
fn one_sided_operations_reach_a_stopped_target() {
    into_a_stopped_target(false);
}

/// The same into heap memory the stopped process registered itself, on a context that adopts
/// registered pages (as the drop-in libibverbs does): its pages now map a memfd.
#[test]
fn one_sided_operations_reach_adopted_heap_memory_of_a_stopped_target() {
    into_a_stopped_target(true);
}

fn into_a_stopped_target(raw: bool) {
    const ITERS: u64 = 10_000;
    /// Slots of an odd size, so that writes start and end at every alignment and cross pages.
    const SLOT: usize = 4100;
    const SLOTS: usize = 16;
    // Whole pages for heap memory, whose partial pages would take the packet path.
    let len = if raw {
        (8 + SLOTS * SLOT).next_multiple_of(4096)
    } else {
        8 + SLOTS * SLOT
    };
    const BASE: u64 = 0x5eed_0000_0000_0000;
    let extra = if raw {
        vec![(RAW_ENV, "1".to_string())]
    } else {
        vec![]
    };
    let (listener, mut target) = spawn_target(len, BASE, &extra);
    let s = side(Provider::Shm);
    let qp = new_qp(&s.pd, &s.cq);
    let local = qp.endpoint_info(psn_of(qp.qpn()), None);
    let mut conn = listener.accept(&local, T).unwrap();
    let remote = conn.peer.region.expect("the target advertised no region");
    assert_eq!(remote.len, len as u64);
    if raw {
        let maps = std::fs::read_to_string(format!("/proc/{}/maps", target.pid())).unwrap();
        let line = maps
            .lines()
            .find(|l| {
                let (a, _) = l.split_once('-').unwrap();
                u64::from_str_radix(a, 16).unwrap() == remote.addr
            })
            .unwrap_or_else(|| panic!("no mapping starts at the region:\n{maps}"));
        assert!(line.contains("ferroce-adopted"), "not adopted: {line}");
    }
    qp.connect(&local, &conn.peer, &options()).unwrap();
    conn.sync(T).unwrap();
    assert_eq!(qp.provider(), Provider::Shm);

    stop(&target);
    let src = s.pd.alloc_mr(SLOT, Access::LOCAL_WRITE).unwrap();
    let dst = s.pd.alloc_mr(SLOT, Access::LOCAL_WRITE).unwrap();
    let result = s.pd.alloc_mr(8, Access::LOCAL_WRITE).unwrap();
    // What the target's region must hold: updated with every WRITE and FETCH_ADD.
    let mut model = vec![0u8; len];
    model[..8].copy_from_slice(&BASE.to_ne_bytes());
    let started = Instant::now();
    for i in 0..ITERS {
        let at = 8 + (i as usize % SLOTS) * SLOT;
        let len = 1 + (i as usize * 131) % SLOT;
        let data = pattern(i, len);
        let addr = remote.addr + at as u64;

        src.write(0, &data).unwrap();
        qp.post_send(
            SendWr::new(3 * i, SendOp::Write, vec![src.sge(0, len).unwrap()])
                .remote(addr, remote.rkey),
        )
        .unwrap();
        expect_success(&s.cq, &qp, 3 * i, WcOpcode::RdmaWrite);
        model[at..at + len].copy_from_slice(&data);

        // Every byte of the destination differs from what the READ must bring.
        let inverse: Vec<u8> = data.iter().map(|b| !b).collect();
        dst.write(0, &inverse).unwrap();
        qp.post_send(
            SendWr::new(3 * i + 1, SendOp::Read, vec![dst.sge(0, len).unwrap()])
                .remote(addr, remote.rkey),
        )
        .unwrap();
        let wc = expect_success(&s.cq, &qp, 3 * i + 1, WcOpcode::RdmaRead);
        assert_eq!(wc.byte_len as usize, len);
        assert!(
            dst.to_vec(0, len).unwrap() == data,
            "READ {i} brought other bytes than WRITE {i} put"
        );

        result.write_u64(0, u64::MAX).unwrap();
        qp.post_send(
            SendWr::new(
                3 * i + 2,
                SendOp::FetchAdd { add: 1 },
                vec![result.sge(0, 8).unwrap()],
            )
            .remote(remote.addr, remote.rkey),
        )
        .unwrap();
        let wc = expect_success(&s.cq, &qp, 3 * i + 2, WcOpcode::FetchAdd);
        assert_eq!(wc.byte_len, 8);
        assert_eq!(
            result.read_u64(0).unwrap(),
            BASE + i,
            "original of FETCH_ADD {i}"
        );
    }
    let took = started.elapsed();
    model[..8].copy_from_slice(&(BASE + ITERS).to_ne_bytes());
    assert!(
        all_stopped(target.pid()),
        "the target ran meanwhile: {:?}",
        thread_states(target.pid())
    );
    // The bytes are in the stopped process's own memory, at the address it advertised.
    let seen = read_process_memory(target.pid(), remote.addr, len);
    let first_diff = seen.iter().zip(&model).position(|(a, b)| a != b);
    assert_eq!(
        first_diff, None,
        "the target's memory differs from the model"
    );
    assert!(all_stopped(target.pid()));
    println!(
        "{} WRITE + READ + FETCH_ADD into a stopped process: {took:?} ({:.2} us per operation)",
        ITERS,
        took.as_secs_f64() * 1e6 / (3 * ITERS) as f64
    );
    target.kill();
}

/// The receive queue of the UDP socket bound to `port` on loopback (bytes waiting), from
/// `/proc/net/udp`: where a packet that should have gone through shared memory shows up.
fn udp_rx_queue(port: u16) -> Option<u64> {
    let table = std::fs::read_to_string("/proc/net/udp").ok()?;
    let local = format!("0100007F:{port:04X}");
    table.lines().skip(1).find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.get(1) == Some(&local.as_str()))
            .then(|| u64::from_str_radix(f.get(4)?.split(':').nth(1)?, 16).ok())
            .flatten()
    })
}

/// Regression (issue #5): a QP at RTS whose peer is at RTS too (its hello sent) must do
/// one-sided operations itself, even when its own engine has not looked at the peer's hello
/// yet. Here the application polled its CQ just before (which keeps the engine thread out of
/// the way for a few milliseconds), the peer reached RTS, stopped itself, and the WRITE is
/// posted at once: it must complete without the stopped peer's help.
#[test]
fn write_right_after_the_peer_reached_rts_needs_no_peer_code() {
    const LEN: usize = 4096;
    let (listener, mut target) = spawn_target(LEN, 0, &[(STOP_AFTER_RTR_ENV, "1".to_string())]);
    let s = side(Provider::Shm);
    let qp = new_qp(&s.pd, &s.cq);
    let src = s.pd.alloc_mr(LEN, Access::LOCAL_WRITE).unwrap();
    let data = pattern(3, LEN);
    src.write(0, &data).unwrap();
    let local = qp.endpoint_info(psn_of(qp.qpn()), None);
    let mut conn = listener.accept(&local, T).unwrap();
    let remote = conn.peer.region.unwrap();
    qp.connect(&local, &conn.peer, &options()).unwrap();
    assert_eq!(s.cq.poll_one().unwrap(), None);
    conn.sync(T).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !all_stopped(target.pid()) {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            thread_states(target.pid())
        );
        std::hint::spin_loop();
    }
    assert_eq!(qp.provider(), Provider::Shm);
    let sent_before = s.ctx.counters().tx_packets;
    qp.post_send(
        SendWr::new(1, SendOp::Write, vec![src.sge(0, LEN).unwrap()])
            .remote(remote.addr, remote.rkey),
    )
    .unwrap();
    let wcs = s.cq.wait(1, T).unwrap();
    let status = wcs.first().map(|w| w.status);
    assert_eq!(
        status,
        Some(WcStatus::Success),
        "WRITE to a stopped peer right after connecting: the initiator sent {} packets (the \
         direct path sends none); the stopped peer's UDP socket holds {:?} bytes",
        s.ctx.counters().tx_packets - sent_before,
        udp_rx_queue(conn.peer.udp_port)
    );
    assert!(read_process_memory(target.pid(), remote.addr, LEN) == data);
    target.kill();
}

/// Two initiator processes, 1,000,000 FETCH_ADDs each on one counter of the parent's.
#[test]
fn two_initiator_processes_share_one_counter() {
    const ITERS: u64 = 1_000_000;
    const TOTAL: u64 = 2 * ITERS;
    const BASE: u64 = 0x0123_4567_0000_0000;
    let s = side(Provider::Shm);
    let counter = s.pd.alloc_mr(4096, Access::ALL).unwrap();
    counter.write_u64(0, BASE).unwrap();
    let (listeners, mut peers) = two_peers(
        "child_initiator",
        "initiator",
        &[
            (ITERS_ENV, ITERS.to_string()),
            (TOTAL_ENV, TOTAL.to_string()),
            (BASE_ENV, BASE.to_string()),
        ],
    );
    let qps: Vec<QueuePair> = (0..2).map(|_| new_qp(&s.pd, &s.cq)).collect();
    let mut conns = accept_each(&qps, &listeners, Some(region_of(&counter)));
    let started = Instant::now();
    for c in &mut conns {
        c.sync(T).unwrap();
    }
    let mut reports = Vec::new();
    for p in &mut peers {
        let (status, out, err) = p.wait(Duration::from_secs(120));
        assert!(
            status.success(),
            "initiator failed: {status:?}\nstdout:\n{out}\nstderr:\n{err}"
        );
        let line = out
            .lines()
            .find_map(|l| l.find(RESULT_TAG).map(|at| &l[at..]))
            .unwrap_or_else(|| panic!("no result line\nstdout:\n{out}\nstderr:\n{err}"))
            .to_string();
        let field = |name: &str| -> u128 {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(name)?.strip_prefix('='))
                .unwrap_or_else(|| panic!("no {name} in {line:?}"))
                .parse()
                .unwrap()
        };
        reports.push((field("count"), field("sum"), field("sum_sq"), field("ns")));
    }
    let took = started.elapsed();
    assert_eq!(counter.read_u64(0).unwrap(), BASE + TOTAL);
    // Each child saw strictly increasing originals in 0..TOTAL (checked there); together they
    // must have seen every value once: the sums of 0..TOTAL and of its squares.
    let n = u128::from(TOTAL);
    let count: u128 = reports.iter().map(|r| r.0).sum();
    let sum: u128 = reports.iter().map(|r| r.1).sum();
    let sum_sq: u128 = reports.iter().map(|r| r.2).sum();
    assert_eq!(count, n);
    assert_eq!(
        sum,
        n * (n - 1) / 2,
        "some originals were seen twice, others never"
    );
    assert_eq!(
        sum_sq,
        (n - 1) * n * (2 * n - 1) / 6,
        "some originals were seen twice, others never"
    );
    let rates: Vec<String> = reports
        .iter()
        .map(|r| format!("{:.0} ns/op", r.3 as f64 / r.0 as f64))
        .collect();
    println!(
        "{TOTAL} FETCH_ADDs from two processes on one counter: {took:?} wall ({:.2} Mop/s), per initiator loop {}",
        TOTAL as f64 / took.as_secs_f64() / 1e6,
        rates.join(", ")
    );
}

/// A peer process killed while a SEND waits on it: the QP to it fails fast, the QP to another
/// live process keeps working.
#[test]
fn killed_peer_fails_its_qp_and_spares_the_others() {
    const LEN: usize = 8192;
    let (listeners, mut peers) = two_peers(
        "child_target",
        "target",
        &[(LEN_ENV, LEN.to_string()), (BASE_ENV, "0".to_string())],
    );
    let s = side(Provider::Shm);
    let cqs = [
        s.ctx.create_cq(64, None).unwrap(),
        s.ctx.create_cq(64, None).unwrap(),
    ];
    let qps: Vec<QueuePair> = cqs.iter().map(|cq| new_qp(&s.pd, cq)).collect();
    let conns = accept_each(&qps, &listeners, None);
    let remotes: Vec<RemoteRegion> = conns.iter().map(|c| c.peer.region.unwrap()).collect();
    let (doomed, survivor) = (&qps[0], &qps[1]);
    let buf = s.pd.alloc_mr(LEN, Access::LOCAL_WRITE).unwrap();
    buf.write(0, &pattern(1, 64)).unwrap();
    // A SEND the target never takes (it posted no receive), and a WRITE queued behind it.
    doomed
        .post_send(SendWr::new(1, SendOp::Send, vec![buf.sge(0, 64).unwrap()]))
        .unwrap();
    doomed
        .post_send(
            SendWr::new(2, SendOp::Write, vec![buf.sge(0, 64).unwrap()])
                .remote(remotes[0].addr, remotes[0].rkey),
        )
        .unwrap();
    // Wait until the target has answered "receiver not ready" a few times: the SEND is under
    // way, not lost.
    let deadline = Instant::now() + T;
    while doomed.counters().rcvd_rnr_err < 3 {
        assert!(
            Instant::now() < deadline,
            "no RNR NAK: {:?}",
            doomed.counters()
        );
        assert_eq!(
            cqs[0].poll_one().unwrap(),
            None,
            "the SEND completed without a receive"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(doomed.state(), QpState::Rts);

    let killed = Instant::now();
    peers[0].kill();
    // Nothing here calls into ferroce meanwhile (`len` and `state` only look): the engine
    // thread notices the death on its own and delivers the flushed completions.
    let deadline = killed + Duration::from_secs(5);
    while cqs[0].len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let took = killed.elapsed();
    assert_eq!(doomed.state(), QpState::Error, "{took:?} after the kill");
    let wcs = cqs[0].wait(2, T).unwrap();
    let got: Vec<(u64, WcStatus)> = wcs.iter().map(|w| (w.wr_id, w.status)).collect();
    assert_eq!(
        got,
        vec![
            (1, WcStatus::WorkRequestFlushed),
            (2, WcStatus::WorkRequestFlushed)
        ],
        "completions {took:?} after the peer was killed"
    );
    assert!(
        took < Duration::from_secs(5),
        "the QP noticed the dead peer only after {took:?}"
    );
    println!("QP to a killed process flushed {took:?} after the kill");

    // The other QP of the same context, to the live process, is untouched.
    assert_eq!(survivor.state(), QpState::Rts);
    let r = remotes[1];
    let data = pattern(2, LEN);
    buf.write(0, &data).unwrap();
    survivor
        .post_send(
            SendWr::new(10, SendOp::Write, vec![buf.sge(0, LEN).unwrap()]).remote(r.addr, r.rkey),
        )
        .unwrap();
    expect_success(&cqs[1], survivor, 10, WcOpcode::RdmaWrite);
    buf.fill(0, LEN, 0).unwrap();
    survivor
        .post_send(
            SendWr::new(11, SendOp::Read, vec![buf.sge(0, LEN).unwrap()]).remote(r.addr, r.rkey),
        )
        .unwrap();
    expect_success(&cqs[1], survivor, 11, WcOpcode::RdmaRead);
    assert!(
        buf.to_vec(0, LEN).unwrap() == data,
        "READ after the death brought other bytes"
    );
    assert!(read_process_memory(peers[1].pid(), r.addr, LEN) == data);
    assert_eq!(survivor.state(), QpState::Rts);
    peers[1].kill();
}

/// A peer process killed while the parent streams WRITEs done directly in its memory (nothing
/// outstanding on the packet path): the stream ends in error completions within seconds, and
/// the QP is in ERR.
#[test]
fn killed_peer_ends_a_stream_of_direct_writes() {
    const LEN: usize = 4096;
    let (listener, mut target) = spawn_target(LEN, 0, &[]);
    let s = side(Provider::Shm);
    let qp = new_qp(&s.pd, &s.cq);
    let local = qp.endpoint_info(psn_of(qp.qpn()), None);
    let mut conn = listener.accept(&local, T).unwrap();
    let remote = conn.peer.region.unwrap();
    qp.connect(&local, &conn.peer, &options()).unwrap();
    conn.sync(T).unwrap();
    let src = s.pd.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    let sge = src.sge(0, 64).unwrap();
    let write = |i: u64| {
        qp.post_send(SendWr::new(i, SendOp::Write, vec![sge]).remote(remote.addr, remote.rkey))
            .unwrap();
        match s.cq.poll_one().unwrap() {
            Some(wc) => wc,
            None => s.cq.wait(1, T).unwrap()[0],
        }
    };
    for i in 0..1000 {
        let wc = write(i);
        assert_eq!((wc.wr_id, wc.status), (i, WcStatus::Success));
    }
    let mut i = 1000;
    let pid = target.pid();
    // SAFETY: kill(2) on our own child, not reaped yet (`target` reaps it below).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let killed = Instant::now();
    let failed = loop {
        let wc = write(i);
        assert_eq!(wc.wr_id, i);
        if wc.status != WcStatus::Success {
            break wc;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "{i} WRITEs still succeed {:?} after the peer was killed",
            killed.elapsed()
        );
        i += 1;
    };
    let took = killed.elapsed();
    assert_eq!(failed.status, WcStatus::WorkRequestFlushed);
    assert_eq!(qp.state(), QpState::Error);
    println!(
        "stream of direct WRITEs to a killed process: failed {took:?} after the kill, {} WRITEs after it succeeded",
        i - 1000
    );
    let (status, _, _) = target.wait(T);
    assert_eq!(status.signal(), Some(libc::SIGKILL));
}

// ---- QpSender --------------------------------------------------------------------------------

/// Waits until `len` bytes of `mr` at `off` are `want` (an unsignaled request completes nowhere
/// to be seen; its bytes are the evidence).
fn wait_bytes(mr: &MemoryRegion, off: usize, want: &[u8]) {
    let deadline = Instant::now() + T;
    while mr.to_vec(off, want.len()).unwrap() != want {
        assert!(
            Instant::now() < deadline,
            "the bytes at {off} never arrived"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// A `QpSender` posts what its QP posts: every one-sided operation lands (bytes and atomic
/// results checked), signaled ones complete in posting order with their fields, an unsignaled
/// one leaves nothing in the CQ. Over UDP it posts through the QP. After the QP is reset and
/// connected to another peer, the old peer hanging up leaves the new link alone, and the same
/// sender reaches the new peer's memory, not the mappings it kept of the old one's (both
/// regions have the same rkey, so a stale cache would pass the key check).
#[test]
fn a_sender_posts_what_its_qp_posts() {
    for provider in [Provider::Shm, Provider::Udp] {
        let (a, b) = (side(provider), side(provider));
        let (qa, qb) = fresh_pair(&a, &b, Access::ALL);
        let local = a.pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        let remote = b.pd.alloc_mr(4096, Access::ALL).unwrap();
        let (written, to_read) = (pattern(3, 256), pattern(4, 256));
        local.write(0, &written).unwrap();
        remote.write(2048, &to_read).unwrap();
        remote.write_u64(1024, 40).unwrap();
        let at = |off: u64| remote.addr() + off;
        let mut tx = qa.sender();
        assert_eq!(tx.qp().qpn(), qa.qpn());

        let unsignaled = SendWr::new(1, SendOp::Write, vec![local.sge(0, 256).unwrap()])
            .remote(at(0), remote.rkey())
            .flags(ferroce::SendFlags::default());
        tx.post_send(&unsignaled).unwrap();
        wait_bytes(&remote, 0, &written);
        tx.post_send(
            SendWr::new(2, SendOp::Write, vec![local.sge(0, 64).unwrap()])
                .remote(at(512), remote.rkey()),
        )
        .unwrap();
        let wc = expect_success(&a.cq, &qa, 2, WcOpcode::RdmaWrite);
        assert_eq!(wc.byte_len, 64, "{provider}");
        assert_eq!(remote.to_vec(512, 64).unwrap(), written[..64], "{provider}");
        tx.post_send(
            SendWr::new(3, SendOp::Read, vec![local.sge(1024, 256).unwrap()])
                .remote(at(2048), remote.rkey()),
        )
        .unwrap();
        let wc = expect_success(&a.cq, &qa, 3, WcOpcode::RdmaRead);
        assert_eq!(wc.byte_len, 256, "{provider}");
        assert_eq!(local.to_vec(1024, 256).unwrap(), to_read, "{provider}");
        tx.post_send(
            SendWr::new(
                4,
                SendOp::FetchAdd { add: 2 },
                vec![local.sge(3000, 8).unwrap()],
            )
            .remote(at(1024), remote.rkey()),
        )
        .unwrap();
        expect_success(&a.cq, &qa, 4, WcOpcode::FetchAdd);
        let swap = SendOp::CompareSwap {
            compare: 42,
            swap: 7,
        };
        tx.post_send(
            SendWr::new(5, swap, vec![local.sge(3008, 8).unwrap()]).remote(at(1024), remote.rkey()),
        )
        .unwrap();
        expect_success(&a.cq, &qa, 5, WcOpcode::CompareSwap);
        assert_eq!(
            (local.read_u64(3000).unwrap(), local.read_u64(3008).unwrap()),
            (40, 42),
            "{provider}: the originals FETCH_ADD and COMPARE_SWAP returned"
        );
        assert_eq!(remote.read_u64(1024).unwrap(), 7, "{provider}");
        assert!(
            a.cq.poll_one().unwrap().is_none(),
            "{provider}: a stray completion"
        );
        if provider != Provider::Shm {
            continue;
        }

        // Reset, then connect to a peer in a third context.
        qa.reset();
        let c = side(provider);
        let qc = new_qp(&c.pd, &c.cq);
        let other = c.pd.alloc_mr(4096, Access::ALL).unwrap();
        assert_eq!(
            other.rkey(),
            remote.rkey(),
            "setup: the new peer's region should have the old one's key"
        );
        let la = qa.endpoint_info(psn_of(qa.qpn()), None);
        let lc = qc.endpoint_info(psn_of(qc.qpn()), None);
        qc.connect(&lc, &la, &options()).unwrap();
        qa.connect(&la, &lc, &options()).unwrap();
        assert_eq!(qa.provider(), Provider::Shm);
        // The old peer sees the reset as its peer going away and hangs up its own hello
        // connection: that says nothing about the QP's new link, which must stay up.
        let deadline = Instant::now() + T;
        while qb.state() != QpState::Error {
            assert!(
                Instant::now() < deadline,
                "the old peer never noticed the reset"
            );
            b.ctx.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
        for _ in 0..50 {
            a.ctx.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            qa.state(),
            QpState::Rts,
            "the old peer's hang-up broke the new link"
        );
        let before = remote.to_vec(0, 4096).unwrap();
        tx.post_send(
            SendWr::new(6, SendOp::Write, vec![local.sge(0, 256).unwrap()])
                .remote(other.addr(), other.rkey()),
        )
        .unwrap();
        expect_success(&a.cq, &qa, 6, WcOpcode::RdmaWrite);
        assert_eq!(other.to_vec(0, 256).unwrap(), written);
        assert_eq!(
            remote.to_vec(0, 4096).unwrap(),
            before,
            "the sender wrote into the old peer's memory"
        );
    }
}

/// What a primed `QpSender` does with a request whose regions changed under it: the same WRITE
/// three times (the second makes its shortcut), then the change, then the WRITE again. Returns
/// the last WRITE's status; checks it touched no byte of the target's current region.
fn after_a_change(change: &str, poster: Poster) -> WcStatus {
    let (a, b) = (side(Provider::Shm), side(Provider::Shm));
    let (qa, _qb) = fresh_pair(&a, &b, Access::ALL);
    let mut local = Some(a.pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap());
    let mut remote = Some(b.pd.alloc_mr(4096, Access::ALL).unwrap());
    let src = local.as_ref().unwrap();
    src.write(0, &pattern(9, 64)).unwrap();
    let (lkey, laddr) = (src.lkey(), src.addr());
    let (rkey, raddr) = (
        remote.as_ref().unwrap().rkey(),
        remote.as_ref().unwrap().addr(),
    );
    let wr = |id: u64| {
        SendWr::new(
            id,
            SendOp::Write,
            vec![ferroce::Sge {
                addr: laddr,
                length: 64,
                lkey,
            }],
        )
        .remote(raddr, rkey)
    };
    let mut sender = qa.sender();
    let mut post = |wr: SendWr| match poster {
        Poster::Qp => qa.post_send(wr),
        Poster::Sender => sender.post_send(wr),
    };
    for id in 0..3 {
        post(wr(id)).unwrap();
        expect_success(&a.cq, &qa, id, WcOpcode::RdmaWrite);
    }
    let canary = pattern(0xca4a, 4096);
    let current = match change {
        "remote region re-registered" => {
            drop(remote.take());
            let again = b.pd.alloc_mr(4096, Access::ALL).unwrap();
            assert_eq!(
                again.rkey() >> 8,
                rkey >> 8,
                "setup: the slot was not reused"
            );
            again
        }
        "local region deregistered" => {
            drop(local.take());
            remote.take().unwrap()
        }
        other => panic!("no change {other}"),
    };
    current.write(0, &canary).unwrap();
    post(wr(3)).unwrap();
    let wcs = a.cq.wait(1, T).unwrap();
    assert_eq!(wcs.len(), 1, "{change}: no completion");
    assert_eq!(wcs[0].wr_id, 3);
    assert!(
        current.to_vec(0, 4096).unwrap() == canary,
        "{change}: the WRITE touched the target's region"
    );
    wcs[0].status
}

/// A `QpSender` that remembers the regions of its last WRITE re-checks them: a peer region
/// deregistered (its key's slot now holds another region) or a local region deregistered gets
/// the status the QP itself gives, not a write through the remembered mappings.
#[test]
fn a_sender_rechecks_what_it_remembers() {
    for change in ["remote region re-registered", "local region deregistered"] {
        let through_qp = after_a_change(change, Poster::Qp);
        assert_ne!(through_qp, WcStatus::Success, "{change}");
        assert_eq!(
            after_a_change(change, Poster::Sender),
            through_qp,
            "{change}"
        );
    }
}

// ---- refused requests ------------------------------------------------------------------------

/// A refused request and what to check it did not touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Violation {
    /// WRITE with the rkey of a region in another protection domain of the target.
    ForeignDomain,
    /// WRITE ending one byte past the region.
    PastEnd,
    /// WRITE to a region without REMOTE_WRITE.
    NoRemoteWrite,
    /// READ from a region without REMOTE_READ.
    NoRemoteRead,
    /// FETCH_ADD on an address that is not 8-aligned.
    MisalignedAtomic,
    /// FETCH_ADD through a target QP created without REMOTE_ATOMIC.
    QpWithoutAtomic,
    /// WRITE with the rkey of a region the target deregistered after this QP wrote to it (so
    /// the initiator has it mapped), aimed into a region the target registered since.
    StaleKey,
    /// READ into a local region without LOCAL_WRITE: the initiator's own fault.
    LocalReadOnly,
}

const VIOLATIONS: [Violation; 8] = [
    Violation::ForeignDomain,
    Violation::PastEnd,
    Violation::NoRemoteWrite,
    Violation::NoRemoteRead,
    Violation::MisalignedAtomic,
    Violation::QpWithoutAtomic,
    Violation::StaleKey,
    Violation::LocalReadOnly,
];

/// What a refused request led to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Outcome {
    status: WcStatus,
    initiator: QpState,
    target: QpState,
}

/// Connects a fresh QP pair between two contexts of this process; the target QP serves `access`.
fn fresh_pair(a: &Side, b: &Side, access: Access) -> (QueuePair, QueuePair) {
    let (qa, qb) = (new_qp(&a.pd, &a.cq), new_qp(&b.pd, &b.cq));
    let la = qa.endpoint_info(psn_of(qa.qpn()), None);
    let lb = qb.endpoint_info(psn_of(qb.qpn()), None);
    qb.connect(
        &lb,
        &la,
        &ConnectOptions {
            access,
            ..options()
        },
    )
    .unwrap();
    qa.connect(&la, &lb, &options()).unwrap();
    (qa, qb)
}

const RLEN: usize = 3 * 4096;

/// How a test posts its send requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Poster {
    /// `QueuePair::post_send`.
    Qp,
    /// A `QpSender` of the QP (the shared-memory fast path without the QP's lock).
    Sender,
}

/// Runs `v` on a fresh QP pair from `a` to `b`, after a successful WRITE on the same QP that
/// proves the pair works; checks the target's bytes and the initiator's result buffer did not
/// change. Every request is posted the way `poster` says.
fn violate(a: &Side, b: &Side, v: Violation, poster: Poster) -> Outcome {
    let provider = a.ctx.provider();
    let all = Access::ALL;
    let qp_access = match v {
        Violation::QpWithoutAtomic => Access::REMOTE_READ.with(Access::REMOTE_WRITE),
        _ => all,
    };
    let (qa, qb) = fresh_pair(a, b, qp_access);
    assert_eq!((qa.provider(), qb.provider()), (provider, provider));
    let mut sender = qa.sender();
    let mut post = |wr: SendWr| match poster {
        Poster::Qp => qa.post_send(wr),
        Poster::Sender => sender.post_send(wr),
    };
    let other_pd = b.ctx.alloc_pd().unwrap();
    let rights = match v {
        Violation::NoRemoteWrite => Access::LOCAL_WRITE
            .with(Access::REMOTE_READ)
            .with(Access::REMOTE_ATOMIC),
        Violation::NoRemoteRead => Access::LOCAL_WRITE
            .with(Access::REMOTE_WRITE)
            .with(Access::REMOTE_ATOMIC),
        _ => all,
    };
    let local_rights = match v {
        Violation::LocalReadOnly => Access::NONE,
        _ => Access::LOCAL_WRITE,
    };
    let local = a.pd.alloc_mr(RLEN, local_rights).unwrap();
    let payload = pattern(7, RLEN);
    local.write(0, &payload).unwrap();
    let mut stale = None;
    if v == Violation::StaleKey {
        let old = b.pd.alloc_mr(RLEN, all).unwrap();
        post(
            SendWr::new(0, SendOp::Write, vec![local.sge(0, 64).unwrap()])
                .remote(old.addr() + 4096, old.rkey()),
        )
        .unwrap();
        expect_success(&a.cq, &qa, 0, WcOpcode::RdmaWrite);
        assert_eq!(old.to_vec(4096, 64).unwrap(), payload[..64]);
        stale = Some((old.addr(), old.rkey()));
    }
    let target = match v {
        Violation::ForeignDomain => other_pd.alloc_mr(RLEN, all).unwrap(),
        _ => b.pd.alloc_mr(RLEN, rights).unwrap(),
    };
    let control = b.pd.alloc_mr(64, all).unwrap();
    let canary = pattern(0xca4a, RLEN);
    target.write(0, &canary).unwrap();

    post(
        SendWr::new(1, SendOp::Write, vec![local.sge(0, 64).unwrap()])
            .remote(control.addr(), control.rkey()),
    )
    .unwrap();
    expect_success(&a.cq, &qa, 1, WcOpcode::RdmaWrite);
    assert_eq!(control.to_vec(0, 64).unwrap(), payload[..64]);

    let mid = target.addr() + 4096;
    let wr = match v {
        Violation::ForeignDomain | Violation::NoRemoteWrite => {
            SendWr::new(2, SendOp::Write, vec![local.sge(0, 64).unwrap()])
                .remote(mid, target.rkey())
        }
        Violation::PastEnd => SendWr::new(2, SendOp::Write, vec![local.sge(0, 64).unwrap()])
            .remote(target.addr() + RLEN as u64 - 63, target.rkey()),
        Violation::NoRemoteRead => {
            SendWr::new(2, SendOp::Read, vec![local.sge(0, 64).unwrap()]).remote(mid, target.rkey())
        }
        Violation::MisalignedAtomic => SendWr::new(
            2,
            SendOp::FetchAdd { add: 1 },
            vec![local.sge(0, 8).unwrap()],
        )
        .remote(mid + 4, target.rkey()),
        Violation::QpWithoutAtomic => SendWr::new(
            2,
            SendOp::FetchAdd { add: 1 },
            vec![local.sge(0, 8).unwrap()],
        )
        .remote(mid, target.rkey()),
        Violation::StaleKey => {
            let (addr, rkey) = stale.unwrap();
            // The old region's number is reused, only its key's generation differs.
            assert_eq!(
                rkey >> 8,
                target.rkey() >> 8,
                "{provider}: setup: the new region did not take the old one's slot"
            );
            assert_ne!(rkey, target.rkey());
            SendWr::new(2, SendOp::Write, vec![local.sge(0, 64).unwrap()]).remote(addr + 4096, rkey)
        }
        Violation::LocalReadOnly => {
            SendWr::new(2, SendOp::Read, vec![local.sge(0, 64).unwrap()]).remote(mid, target.rkey())
        }
    };
    post(wr).unwrap();
    let wcs = a.cq.wait(1, T).unwrap();
    assert_eq!(wcs.len(), 1, "{provider}: {v:?} never completed");
    let wc = wcs[0];
    assert_eq!((wc.wr_id, wc.qp_num), (2, qa.qpn()), "{provider}: {v:?}");
    let remote_fault = v != Violation::LocalReadOnly;
    if remote_fault {
        assert!(
            matches!(
                wc.status,
                WcStatus::RemoteAccessError | WcStatus::RemoteInvalidRequestError
            ),
            "{provider}: {v:?} completed with {:?}",
            wc.status
        );
        // The target's responder refused it: its QP leaves RTS too, as soon as it has
        // answered.
        let deadline = Instant::now() + T;
        while qb.state() == QpState::Rts && Instant::now() < deadline {
            b.ctx.progress();
            std::thread::sleep(Duration::from_millis(1));
        }
    } else {
        assert_eq!(
            wc.status,
            WcStatus::LocalProtectionError,
            "{provider}: {v:?}"
        );
    }
    assert!(
        target.to_vec(0, RLEN).unwrap() == canary,
        "{provider}: {v:?} changed the target's bytes"
    );
    assert!(
        local.to_vec(0, RLEN).unwrap() == payload,
        "{provider}: {v:?} wrote into the initiator's buffer"
    );
    assert_eq!(control.to_vec(0, 64).unwrap(), payload[..64]);
    let outcome = Outcome {
        status: wc.status,
        initiator: qa.state(),
        target: qb.state(),
    };
    assert_eq!(outcome.initiator, QpState::Error, "{provider}: {v:?}");
    assert!(
        a.cq.poll_one().unwrap().is_none(),
        "{provider}: {v:?}: a stray completion"
    );
    outcome
}

/// Every refused request gets the same status over shared memory as over UDP, posted through
/// the QP or through a `QpSender` (whose fast path checks the same things without the lock).
#[test]
fn refused_requests_fail_alike_over_shm_and_udp() {
    let udp = (side(Provider::Udp), side(Provider::Udp));
    let shm = (side(Provider::Shm), side(Provider::Shm));
    let mut report = Vec::new();
    for v in VIOLATIONS {
        let over_udp = violate(&udp.0, &udp.1, v, Poster::Qp);
        let over_shm = violate(&shm.0, &shm.1, v, Poster::Qp);
        assert_eq!(over_shm, over_udp, "{v:?}: shm differs from udp");
        let through_sender = violate(&shm.0, &shm.1, v, Poster::Sender);
        assert_eq!(
            through_sender, over_udp,
            "{v:?}: shm through a QpSender differs from udp"
        );
        report.push(format!("{v:?}: {over_udp:?}"));
    }
    println!("{}", report.join("; "));
}

/// Completions of one send queue leave in posting order even when operations done directly in
/// the peer's memory follow operations that took the packet path: a direct operation may only
/// complete once every earlier request's completion is out (IBTA: an RC send queue completes in
/// order). Every other WRITE goes to a region the target registered from its own memory (not a
/// memfd, so the packet path), the rest to a memfd region (direct whenever the queue is idle);
/// one thread posts as fast as the queue takes them, another polls.
#[test]
fn completions_keep_posting_order_when_direct_and_packet_operations_mix() {
    posting_order_holds(Poster::Qp);
}

/// The same through a `QpSender`: its lock-free fast path may only run while the QP it reads as
/// idle (nothing under way, no completion waiting) is published so by every lock holder.
#[test]
fn completions_keep_posting_order_through_a_sender() {
    posting_order_holds(Poster::Sender);
}

fn posting_order_holds(poster: Poster) {
    const OPS: u64 = 20_000;
    let (a, b) = (side(Provider::Shm), side(Provider::Shm));
    let cq = a.ctx.create_cq(1 << 17, None).unwrap();
    let qa = new_qp(&a.pd, &cq);
    let qb = new_qp(&b.pd, &b.cq);
    let la = qa.endpoint_info(psn_of(qa.qpn()), None);
    let lb = qb.endpoint_info(psn_of(qb.qpn()), None);
    qb.connect(&lb, &la, &options()).unwrap();
    qa.connect(&la, &lb, &options()).unwrap();
    let direct = b.pd.alloc_mr(4096, Access::ALL).unwrap();
    let mut backing = vec![0u8; 4096];
    let ptr = std::ptr::NonNull::new(backing.as_mut_ptr()).unwrap();
    // SAFETY: `backing` is neither read nor written nor freed until `raw` is dropped below, and
    // stays 4096 bytes long meanwhile.
    let raw = unsafe { b.pd.register_raw(ptr, 4096, Access::ALL) }.unwrap();
    let src = a.pd.alloc_mr(64, Access::LOCAL_WRITE).unwrap();
    let sge = src.sge(0, 64).unwrap();
    let inversions = std::thread::scope(|scope| {
        let poller = scope.spawn(|| {
            // (position in the CQ, wr_id found there) wherever they differ.
            let mut next = 0u64;
            let mut inversions = Vec::new();
            let mut buf = vec![ferroce::empty_wc(); 64];
            let deadline = Instant::now() + Duration::from_secs(30);
            while next < OPS && Instant::now() < deadline {
                let n = cq.poll(&mut buf).unwrap();
                for wc in &buf[..n] {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                    if wc.wr_id != next && inversions.len() < 8 {
                        inversions.push((next, wc.wr_id));
                    }
                    next += 1;
                }
            }
            assert_eq!(next, OPS, "completions missing");
            inversions
        });
        let mut sender = qa.sender();
        for i in 0..OPS {
            let (addr, rkey) = if i % 2 == 0 {
                (raw.addr(), raw.rkey())
            } else {
                (direct.addr(), direct.rkey())
            };
            loop {
                let wr = SendWr::new(i, SendOp::Write, vec![sge]).remote(addr, rkey);
                let posted = match poster {
                    Poster::Qp => qa.post_send(wr),
                    Poster::Sender => sender.post_send(wr),
                };
                match posted {
                    Ok(()) => break,
                    Err(ferroce::Error::Post(ferroce::PostError::QueueFull(_))) => {
                        std::hint::spin_loop()
                    }
                    Err(e) => panic!("posting {i}: {e}"),
                }
            }
        }
        poller.join().unwrap()
    });
    drop(raw);
    drop(backing);
    assert_eq!(
        inversions,
        Vec::<(u64, u64)>::new(),
        "(position, wr_id) where the send queue's completions left out of posting order"
    );
}
