//! Completion events under threads, called as a C program calls them: the library's exported
//! `ibv_*` functions and the `ctx->ops` calls the inline ones of `<infiniband/verbs.h>` make.
//!
//! rdma-core's contract (`ibv_get_cq_event(3)`): every event `ibv_get_cq_event` returns is
//! acknowledged once with `ibv_ack_cq_events`, which may run on any thread while others poll,
//! arm and take events; `ibv_destroy_cq` waits until every event handed out for the CQ was
//! acknowledged, so a CQ an event named stays valid until its acknowledgement.
//!
//! Under ThreadSanitizer (the installed nightly toolchain; no `-Zbuild-std`, so std itself is
//! not instrumented):
//! ```text
//! RUSTFLAGS="-Zsanitizer=thread -Cunsafe-allow-abi-mismatch=sanitizer" \
//!   CARGO_TARGET_DIR=target-tsan cargo +nightly test --target x86_64-unknown-linux-gnu \
//!   -p ferroce-ibverbs --test cq_events -- --test-threads=1
//! ```
//! TSan then cannot see the ordering std's `Mutex`, `Condvar`, `Arc` (a fence), thread join and
//! `mpsc` give, and reports every access they order (the tests still pass under it). Read its
//! reports by their two sites: one whose accesses are both under the same std lock, or ordered
//! by a join or an `Arc`'s last drop, is that blind spot. Before the fix it also reported, with
//! nothing between them, `ibv_destroy_cq` freeing the CQ against a getter reading it.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use ferroce_ibverbs::abi::*;

mod common;

// The library's exports, linked from the crate's rlib as a program links them from the .so.
extern "C" {
    fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd;
    fn ibv_reg_mr(pd: *mut ibv_pd, addr: *mut libc::c_void, len: usize, access: i32)
        -> *mut ibv_mr;
    fn ibv_query_gid(ctx: *mut ibv_context, port: u8, index: i32, gid: *mut ibv_gid) -> i32;
    fn ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel;
    fn ibv_create_cq(
        ctx: *mut ibv_context,
        cqe: i32,
        cq_context: *mut libc::c_void,
        channel: *mut ibv_comp_channel,
        comp_vector: i32,
    ) -> *mut ibv_cq;
    fn ibv_destroy_cq(cq: *mut ibv_cq) -> i32;
    fn ibv_get_cq_event(
        channel: *mut ibv_comp_channel,
        cq: *mut *mut ibv_cq,
        cq_context: *mut *mut libc::c_void,
    ) -> i32;
    fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: libc::c_uint);
    fn ibv_create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp;
    fn ibv_modify_qp(qp: *mut ibv_qp, attr: *mut ibv_qp_attr, mask: i32) -> i32;
    fn ibv_destroy_qp(qp: *mut ibv_qp) -> i32;
}

/// A pointer handed between the test's threads, as a C program hands them around.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct P<T>(*mut T);
// SAFETY: the library's objects are for use from any thread (rdma-core's are); the test only
// passes the addresses around and uses them through the C calls.
unsafe impl<T> Send for P<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for P<T> {}

impl<T> P<T> {
    /// The pointer (a method, so a closure captures the whole `P`, which is `Send`).
    fn get(self) -> *mut T {
        self.0
    }
}

/// One opened context with a protection domain, a registered buffer and its GID.
struct Dev {
    ctx: P<ibv_context>,
    pd: P<ibv_pd>,
    mr: P<ibv_mr>,
    buf: P<u8>,
    gid: [u8; 16],
}

const BUF_LEN: usize = 1 << 16;

/// The context the tests share (contexts take host slots, which are few).
fn dev() -> &'static Dev {
    static DEV: OnceLock<Dev> = OnceLock::new();
    DEV.get_or_init(|| unsafe {
        let ctx = common::open_loopback_context();
        let pd = ibv_alloc_pd(ctx);
        assert!(!pd.is_null());
        let buf = common::map_buffer(BUF_LEN);
        let mr = ibv_reg_mr(
            pd,
            buf,
            BUF_LEN,
            (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) as i32,
        );
        assert!(
            !mr.is_null(),
            "ibv_reg_mr: {}",
            std::io::Error::last_os_error()
        );
        let mut gid = ibv_gid { raw: [0; 16] };
        assert_eq!(ibv_query_gid(ctx, 1, 0, &mut gid), 0);
        Dev {
            ctx: P(ctx),
            pd: P(pd),
            mr: P(mr),
            buf: P(buf.cast()),
            gid: gid.raw,
        }
    })
}

fn create_cq(ch: *mut ibv_comp_channel, tag: usize) -> *mut ibv_cq {
    // SAFETY: the shared context; `tag` is only carried as the CQ's context.
    let cq = unsafe { ibv_create_cq(dev().ctx.get(), 4096, tag as *mut libc::c_void, ch, 0) };
    assert!(
        !cq.is_null(),
        "ibv_create_cq: {}",
        std::io::Error::last_os_error()
    );
    cq
}

fn create_qp(send_cq: *mut ibv_cq, recv_cq: *mut ibv_cq) -> *mut ibv_qp {
    let mut init = ibv_qp_init_attr {
        send_cq,
        recv_cq,
        cap: ibv_qp_cap {
            max_send_wr: 256,
            max_recv_wr: 256,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 64,
        },
        qp_type: IBV_QPT_RC,
        ..Default::default()
    };
    // SAFETY: a PD and CQs of the shared context.
    let qp = unsafe { ibv_create_qp(dev().pd.get(), &mut init) };
    assert!(
        !qp.is_null(),
        "ibv_create_qp: {}",
        std::io::Error::last_os_error()
    );
    qp
}

/// Takes `qp` to RTS, connected to `peer_qpn` on this same context.
fn connect(qp: *mut ibv_qp, peer_qpn: u32) {
    let mut a = ibv_qp_attr {
        qp_state: IBV_QPS_INIT,
        pkey_index: 0,
        port_num: 1,
        qp_access_flags: IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
        ..Default::default()
    };
    let init = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    // SAFETY: a live QP and attributes on the stack.
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, init as i32) }, 0);
    let mut a = ibv_qp_attr {
        qp_state: IBV_QPS_RTR,
        path_mtu: IBV_MTU_1024,
        dest_qp_num: peer_qpn,
        rq_psn: 0,
        max_dest_rd_atomic: 1,
        min_rnr_timer: 1,
        ..Default::default()
    };
    a.ah_attr.is_global = 1;
    a.ah_attr.port_num = 1;
    a.ah_attr.grh.dgid.raw = dev().gid;
    a.ah_attr.grh.sgid_index = 0;
    a.ah_attr.grh.hop_limit = 64;
    let rtr = IBV_QP_STATE
        | IBV_QP_AV
        | IBV_QP_PATH_MTU
        | IBV_QP_DEST_QPN
        | IBV_QP_RQ_PSN
        | IBV_QP_MAX_DEST_RD_ATOMIC
        | IBV_QP_MIN_RNR_TIMER;
    // SAFETY: as above.
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, rtr as i32) }, 0);
    let mut a = ibv_qp_attr {
        qp_state: IBV_QPS_RTS,
        sq_psn: 0,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 1,
        ..Default::default()
    };
    let rts = IBV_QP_STATE
        | IBV_QP_SQ_PSN
        | IBV_QP_TIMEOUT
        | IBV_QP_RETRY_CNT
        | IBV_QP_RNR_RETRY
        | IBV_QP_MAX_QP_RD_ATOMIC;
    // SAFETY: as above.
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, rts as i32) }, 0);
}

/// Two RC QPs of the shared context connected to each other.
fn qp_pair(
    a_send: *mut ibv_cq,
    a_recv: *mut ibv_cq,
    b_send: *mut ibv_cq,
    b_recv: *mut ibv_cq,
) -> (*mut ibv_qp, *mut ibv_qp) {
    let a = create_qp(a_send, a_recv);
    let b = create_qp(b_send, b_recv);
    // SAFETY: both just created.
    let (qa, qb) = unsafe { ((*a).qp_num, (*b).qp_num) };
    connect(a, qb);
    connect(b, qa);
    (a, b)
}

// The inline calls of <infiniband/verbs.h>: through the context's operations.
fn poll_cq(cq: *mut ibv_cq, wc: &mut [ibv_wc]) -> i32 {
    // SAFETY: a live CQ; its context's ops table is the library's.
    unsafe { ((*(*cq).context).ops.poll_cq.unwrap())(cq, wc.len() as i32, wc.as_mut_ptr()) }
}

fn req_notify_cq(cq: *mut ibv_cq) -> i32 {
    // SAFETY: as above.
    unsafe { ((*(*cq).context).ops.req_notify_cq.unwrap())(cq, 0) }
}

fn post_send(qp: *mut ibv_qp, wr: &mut ibv_send_wr) -> i32 {
    let mut bad = std::ptr::null_mut();
    // SAFETY: a live QP; the request and its gather list live across the call (inline data is
    // copied before it returns).
    unsafe { ((*(*qp).context).ops.post_send.unwrap())(qp, wr, &mut bad) }
}

fn post_recv(qp: *mut ibv_qp, wr: &mut ibv_recv_wr) -> i32 {
    let mut bad = std::ptr::null_mut();
    // SAFETY: as above.
    unsafe { ((*(*qp).context).ops.post_recv.unwrap())(qp, wr, &mut bad) }
}

/// A comp channel whose descriptor is non-blocking, so a getter can look at a stop flag.
fn channel() -> *mut ibv_comp_channel {
    // SAFETY: the shared context.
    let ch = unsafe { ibv_create_comp_channel(dev().ctx.get()) };
    assert!(!ch.is_null());
    // SAFETY: the channel's own descriptor.
    unsafe {
        let fd = (*ch).fd;
        let fl = libc::fcntl(fd, libc::F_GETFL);
        assert_eq!(libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK), 0);
    }
    ch
}

/// The next event on `ch` within a few milliseconds: `(cq, its cq_context)`.
fn next_event(ch: *mut ibv_comp_channel) -> Option<(*mut ibv_cq, usize)> {
    // SAFETY: a live channel.
    let mut p = libc::pollfd {
        fd: unsafe { (*ch).fd },
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one pollfd on the stack.
    unsafe { libc::poll(&mut p, 1, 5) };
    let mut cq = std::ptr::null_mut();
    let mut context = std::ptr::null_mut();
    // SAFETY: a live channel; the outputs are on the stack.
    let rc = unsafe { ibv_get_cq_event(ch, &mut cq, &mut context) };
    if rc != 0 {
        let e = std::io::Error::last_os_error().raw_os_error();
        assert_eq!(e, Some(libc::EAGAIN), "ibv_get_cq_event failed otherwise");
        return None;
    }
    assert!(!cq.is_null());
    // SAFETY: the event names a live CQ until it is acknowledged.
    assert_eq!(
        unsafe { (*cq).cq_context },
        context,
        "the event's context is its CQ's"
    );
    Some((cq, context as usize))
}

/// Runs `f` on a thread and waits at most `limit` for its result (a destroy that never
/// returns fails the test instead of hanging it).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit)
        .expect("the call did not return in time")
}

/// Messages the stress test sends; its queues are at most `DEPTH` deep.
const SLOTS: usize = 128;
const DEPTH: u64 = 64;

#[test]
fn threads_post_poll_arm_take_and_acknowledge_events_and_every_count_adds_up() {
    let d = dev();
    let ch = P(channel());
    // Three CQs on one channel: QP A sends on CQ 0, both receive on CQ 1, B sends on CQ 2.
    let cqs: Vec<P<ibv_cq>> = (0..3).map(|i| P(create_cq(ch.get(), i))).collect();
    let (a, b) = qp_pair(cqs[0].0, cqs[1].0, cqs[2].0, cqs[1].0);
    let (a, b) = (P(a), P(b));
    for cq in &cqs {
        assert_eq!(req_notify_cq(cq.get()), 0);
    }

    let stop = Arc::new(AtomicBool::new(false));
    let posted = Arc::new(AtomicU64::new(0));
    let sends_done = Arc::new(AtomicU64::new(0));
    let recvs_done = Arc::new(AtomicU64::new(0));
    // Each message's send and receive completion, seen once each.
    const MAX_MSGS: usize = 1 << 20;
    let seen: Arc<Vec<AtomicU8>> = Arc::new((0..MAX_MSGS).map(|_| AtomicU8::new(0)).collect());
    let gets: Arc<Vec<AtomicU64>> = Arc::new((0..3).map(|_| AtomicU64::new(0)).collect());
    let acks: Arc<Vec<AtomicU64>> = Arc::new((0..3).map(|_| AtomicU64::new(0)).collect());

    // What every thread that polls does with a completion.
    let consume = {
        let (seen, sends_done, recvs_done) = (seen.clone(), sends_done.clone(), recvs_done.clone());
        let buf = d.buf;
        move |cq_tag: usize, w: &ibv_wc| {
            assert_eq!(w.status, IBV_WC_SUCCESS, "completion {} failed", w.wr_id);
            let i = w.wr_id as usize;
            assert!(i < MAX_MSGS);
            if w.opcode == IBV_WC_RECV {
                assert_eq!(cq_tag, 1, "a receive on CQ {cq_tag}");
                assert_eq!(w.byte_len, 8);
                // SAFETY: slot i % SLOTS is not reposted before this receive is marked seen.
                let got = unsafe {
                    std::ptr::read_volatile(buf.get().add((i % SLOTS) * 8).cast::<u64>())
                };
                assert_eq!(got, i as u64, "message {i} carried {got}");
                // Release: the read above happens before the poster reuses the slot.
                assert_eq!(
                    seen[i].fetch_or(2, Ordering::AcqRel) & 2,
                    0,
                    "receive {i} twice"
                );
                recvs_done.fetch_add(1, Ordering::Release);
            } else {
                assert_eq!(cq_tag, 0, "A's send completion on CQ {cq_tag}");
                assert_eq!(w.opcode, IBV_WC_SEND);
                assert_eq!(
                    seen[i].fetch_or(1, Ordering::Relaxed) & 1,
                    0,
                    "send {i} twice"
                );
                sends_done.fetch_add(1, Ordering::Release);
            }
        }
    };
    let drain = {
        let consume = consume.clone();
        move |cq: P<ibv_cq>, tag: usize| {
            let mut wc = [ibv_wc::default(); 8];
            loop {
                let n = poll_cq(cq.get(), &mut wc);
                assert!(n >= 0, "poll_cq: {n}");
                for w in &wc[..n as usize] {
                    consume(tag, w);
                }
                if n < wc.len() as i32 {
                    return;
                }
            }
        }
    };

    let deadline = Instant::now() + Duration::from_millis(2500);
    let mut threads = Vec::new();
    // The poster: a receive at B, then an inline SEND from A carrying the message's number.
    {
        let (posted, recvs_done, sends_done, stop, seen) = (
            posted.clone(),
            recvs_done.clone(),
            sends_done.clone(),
            stop.clone(),
            seen.clone(),
        );
        let (lkey, buf) = unsafe { ((*d.mr.get()).lkey, d.buf) };
        threads.push(std::thread::spawn(move || {
            let mut i = 0u64;
            while Instant::now() < deadline && (i as usize) < MAX_MSGS {
                // A slot is reused once the receive that last used it was checked (pollers
                // finish out of order, so a count of receives done would not say that).
                let slot_free = (i as usize) < SLOTS
                    || seen[i as usize - SLOTS].load(Ordering::Acquire) & 2 != 0;
                if !slot_free
                    || i - recvs_done.load(Ordering::Acquire) >= DEPTH
                    || i - sends_done.load(Ordering::Acquire) >= DEPTH
                {
                    std::thread::yield_now();
                    continue;
                }
                let slot = (i as usize) % SLOTS;
                let mut sge = ibv_sge {
                    addr: buf.get() as u64 + (slot * 8) as u64,
                    length: 8,
                    lkey,
                };
                let mut rwr = ibv_recv_wr {
                    wr_id: i,
                    next: std::ptr::null_mut(),
                    sg_list: &mut sge,
                    num_sge: 1,
                };
                assert_eq!(post_recv(b.get(), &mut rwr), 0);
                let payload = i;
                let mut ssge = ibv_sge {
                    addr: &payload as *const u64 as u64,
                    length: 8,
                    lkey: 0,
                };
                let mut swr = ibv_send_wr {
                    wr_id: i,
                    sg_list: &mut ssge,
                    num_sge: 1,
                    opcode: IBV_WR_SEND,
                    send_flags: IBV_SEND_SIGNALED | IBV_SEND_INLINE,
                    ..Default::default()
                };
                assert_eq!(post_send(a.get(), &mut swr), 0);
                i += 1;
                posted.store(i, Ordering::Release);
            }
            stop.store(true, Ordering::Release);
        }));
    }
    // Two pollers per CQ, re-arming now and then (while events are being taken and acked).
    for (tag, &cq) in cqs.iter().enumerate() {
        for _ in 0..2 {
            let (drain, stop) = (drain.clone(), stop.clone());
            threads.push(std::thread::spawn(move || {
                let mut k = 0u32;
                while !stop.load(Ordering::Acquire) {
                    drain(cq, tag);
                    k += 1;
                    if k % 64 == 0 {
                        assert_eq!(req_notify_cq(cq.get()), 0);
                    }
                    std::thread::yield_now();
                }
            }));
        }
    }
    // The acknowledger: acks what the getters took, in batches of 1 to 4 per CQ.
    let (ack_tx, ack_rx) = mpsc::channel::<(P<ibv_cq>, usize)>();
    let acker = {
        let acks = acks.clone();
        std::thread::spawn(move || {
            let mut owed: HashMap<usize, (P<ibv_cq>, u32)> = HashMap::new();
            let mut k = 0u32;
            loop {
                let msg = ack_rx.recv_timeout(Duration::from_millis(2));
                let closed = matches!(msg, Err(mpsc::RecvTimeoutError::Disconnected));
                if let Ok((cq, tag)) = msg {
                    owed.entry(tag).or_insert((cq, 0)).1 += 1;
                }
                k = k.wrapping_add(1);
                for (&tag, (cq, n)) in owed.iter_mut() {
                    if *n > 0 && (closed || *n > k % 4) {
                        acks[tag].fetch_add(u64::from(*n), Ordering::Relaxed);
                        // SAFETY: the CQ has `n` events outstanding, so it is alive.
                        unsafe { ibv_ack_cq_events(cq.get(), *n) };
                        *n = 0;
                    }
                }
                if closed {
                    return;
                }
            }
        })
    };
    // Two getters on the one channel: each event goes to one of them; it re-arms the CQ, drains
    // it and hands the acknowledgement to the acker.
    let getters: Vec<_> = (0..2)
        .map(|_| {
            let (drain, stop, gets, tx) =
                (drain.clone(), stop.clone(), gets.clone(), ack_tx.clone());
            let (posted, sends_done, recvs_done) =
                (posted.clone(), sends_done.clone(), recvs_done.clone());
            std::thread::spawn(move || loop {
                let done = stop.load(Ordering::Acquire)
                    && sends_done.load(Ordering::Acquire) == posted.load(Ordering::Acquire)
                    && recvs_done.load(Ordering::Acquire) == posted.load(Ordering::Acquire);
                let Some((cq, tag)) = next_event(ch.get()) else {
                    if done {
                        return;
                    }
                    continue;
                };
                assert!(tag < 3, "an event with context {tag}");
                gets[tag].fetch_add(1, Ordering::Relaxed);
                assert_eq!(req_notify_cq(cq), 0);
                drain(P(cq), tag);
                tx.send((P(cq), tag)).unwrap();
            })
        })
        .collect();
    drop(ack_tx);
    for t in threads {
        t.join().expect("a posting or polling thread failed");
    }
    // The pollers have stopped: drain what is left, which the getters also do as events come.
    let until = Instant::now() + Duration::from_secs(3);
    while (sends_done.load(Ordering::Acquire) < posted.load(Ordering::Acquire)
        || recvs_done.load(Ordering::Acquire) < posted.load(Ordering::Acquire))
        && Instant::now() < until
    {
        for (tag, &cq) in cqs.iter().enumerate() {
            drain(cq, tag);
        }
    }
    for g in getters {
        g.join().expect("a getter failed");
    }
    acker.join().expect("the acknowledger failed");

    let n = posted.load(Ordering::Acquire);
    assert!(n >= 1000, "only {n} messages in the time");
    assert_eq!(sends_done.load(Ordering::Acquire), n, "send completions");
    assert_eq!(recvs_done.load(Ordering::Acquire), n, "receive completions");
    for (i, s) in seen.iter().enumerate().take(n as usize) {
        assert_eq!(s.load(Ordering::Relaxed), 3, "message {i}");
    }
    let got: Vec<u64> = gets.iter().map(|g| g.load(Ordering::Relaxed)).collect();
    let acked: Vec<u64> = acks.iter().map(|g| g.load(Ordering::Relaxed)).collect();
    assert_eq!(got, acked, "every event acknowledged once");
    assert!(got[0] > 0 && got[1] > 0, "events on CQs 0 and 1: {got:?}");
    eprintln!("{n} messages; events taken and acknowledged per CQ: {got:?}");

    // Every event is acknowledged, so the destroys return at once.
    // SAFETY: the QPs and CQs are the test's, idle now, destroyed once.
    unsafe {
        assert_eq!(ibv_destroy_qp(a.get()), 0);
        assert_eq!(ibv_destroy_qp(b.get()), 0);
    }
    for cq in cqs {
        // SAFETY: as above.
        assert_eq!(
            within(Duration::from_secs(2), move || unsafe {
                ibv_destroy_cq(cq.get())
            }),
            0
        );
    }
}

/// One signaled RDMA WRITE from `qp` into the shared buffer; returns once its completion was
/// polled from `cq` (the completion raised the CQ's event, if armed, before it was queued).
fn write_and_complete(qp: *mut ibv_qp, cq: *mut ibv_cq) {
    let d = dev();
    let v = 7u64;
    let mut sge = ibv_sge {
        addr: &v as *const u64 as u64,
        length: 8,
        lkey: 0,
    };
    let mut wr = ibv_send_wr {
        wr_id: 99,
        sg_list: &mut sge,
        num_sge: 1,
        opcode: IBV_WR_RDMA_WRITE,
        send_flags: IBV_SEND_SIGNALED | IBV_SEND_INLINE,
        ..Default::default()
    };
    // SAFETY: the shared MR.
    wr.wr.rdma = unsafe {
        ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: d.buf.get() as u64 + (BUF_LEN - 8) as u64,
            rkey: (*d.mr.get()).rkey,
        }
    };
    assert_eq!(post_send(qp, &mut wr), 0);
    let until = Instant::now() + Duration::from_secs(3);
    let mut wc = [ibv_wc::default()];
    loop {
        let n = poll_cq(cq, &mut wc);
        if n == 1 {
            assert_eq!(wc[0].status, IBV_WC_SUCCESS);
            assert_eq!(wc[0].wr_id, 99);
            return;
        }
        assert_eq!(n, 0);
        assert!(Instant::now() < until, "the WRITE did not complete");
    }
}

#[test]
fn destroy_waits_until_every_event_taken_is_acknowledged() {
    let ch = P(channel());
    let cq = P(create_cq(ch.get(), 500));
    let (a, b) = qp_pair(cq.get(), cq.get(), cq.get(), cq.get());
    assert_eq!(req_notify_cq(cq.get()), 0);
    write_and_complete(a, cq.get());
    let until = Instant::now() + Duration::from_secs(3);
    let (got, tag) = loop {
        if let Some(e) = next_event(ch.get()) {
            break e;
        }
        assert!(Instant::now() < until, "no event");
    };
    assert_eq!((got, tag), (cq.get(), 500));
    // SAFETY: the test's QPs, idle.
    unsafe {
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
    }
    // The event is not acknowledged: the destroy must wait (rdma-core's rule), not free a CQ
    // the program may still use through the event.
    let done = Arc::new(AtomicBool::new(false));
    let destroyer = {
        let done = done.clone();
        std::thread::spawn(move || {
            // SAFETY: the test's CQ, destroyed once.
            let rc = unsafe { ibv_destroy_cq(cq.get()) };
            done.store(true, Ordering::Release);
            rc
        })
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !done.load(Ordering::Acquire),
        "ibv_destroy_cq returned with an event unacknowledged"
    );
    // The CQ is still whole: the program reads it through the event.
    // SAFETY: alive until the acknowledgement below.
    assert_eq!(unsafe { (*cq.get()).cq_context } as usize, 500);
    // SAFETY: the one event the CQ has outstanding.
    unsafe { ibv_ack_cq_events(cq.get(), 1) };
    let until = Instant::now() + Duration::from_secs(3);
    while !done.load(Ordering::Acquire) {
        assert!(
            Instant::now() < until,
            "ibv_destroy_cq still waits after the acknowledgement"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(destroyer.join().unwrap(), 0);
}

#[test]
fn getters_racing_destroy_only_see_live_cqs_and_destroy_returns_after_their_ack() {
    let ch = P(channel());
    // Per CQ tag: events taken, events acknowledged (counted before the call), and whether
    // the CQ's destroy has returned.
    #[derive(Default)]
    struct Book {
        taken: HashMap<usize, u64>,
        acked: HashMap<usize, u64>,
        destroyed: HashSet<usize>,
    }
    let book = Arc::new(Mutex::new(Book::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let delay = Arc::new(AtomicUsize::new(0));
    let getters: Vec<_> = (0..2)
        .map(|_| {
            let (book, stop, delay) = (book.clone(), stop.clone(), delay.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    let Some((cq, tag)) = next_event(ch.get()) else {
                        continue;
                    };
                    {
                        let mut b = book.lock().unwrap();
                        assert!(
                            !b.destroyed.contains(&tag),
                            "an event for destroyed CQ {tag}"
                        );
                        *b.taken.entry(tag).or_default() += 1;
                    }
                    // Hold the event a while (0 to 2 ms) before acknowledging: the destroy
                    // racing it must wait that long.
                    let us = delay.fetch_add(1, Ordering::Relaxed) % 5 * 500;
                    std::thread::sleep(Duration::from_micros(us as u64));
                    // SAFETY: the event keeps the CQ alive; the CQ is read as a program would.
                    assert_eq!(unsafe { (*cq).cq_context } as usize, tag);
                    *book.lock().unwrap().acked.entry(tag).or_default() += 1;
                    // SAFETY: the one event taken.
                    unsafe { ibv_ack_cq_events(cq, 1) };
                }
            })
        })
        .collect();
    let deadline = Instant::now() + Duration::from_millis(2000);
    let mut rounds = 0usize;
    while Instant::now() < deadline {
        let tag = 1000 + rounds;
        let cq = create_cq(ch.get(), tag);
        let (a, b) = qp_pair(cq, cq, cq, cq);
        assert_eq!(req_notify_cq(cq), 0);
        write_and_complete(a, cq);
        // Sometimes let a getter take the event first, sometimes race it.
        if rounds % 3 != 0 {
            std::thread::sleep(Duration::from_micros(200));
        }
        // SAFETY: the test's QPs and CQ, destroyed once.
        unsafe {
            assert_eq!(ibv_destroy_qp(a), 0);
            assert_eq!(ibv_destroy_qp(b), 0);
        }
        let c = P(cq);
        assert_eq!(
            within(Duration::from_secs(3), move || unsafe {
                ibv_destroy_cq(c.get())
            }),
            0
        );
        let mut bk = book.lock().unwrap();
        let taken = bk.taken.get(&tag).copied().unwrap_or(0);
        let acked = bk.acked.get(&tag).copied().unwrap_or(0);
        assert!(taken <= 1, "CQ {tag} fired once, taken {taken} times");
        assert_eq!(
            taken, acked,
            "CQ {tag}'s destroy returned before its event was acknowledged"
        );
        bk.destroyed.insert(tag);
        rounds += 1;
    }
    stop.store(true, Ordering::Release);
    for g in getters {
        g.join().expect("a getter failed");
    }
    let bk = book.lock().unwrap();
    let taken: u64 = bk.taken.values().sum();
    eprintln!("{rounds} CQs created and destroyed; {taken} events taken before the destroy");
    assert!(rounds >= 20, "only {rounds} rounds");
    assert!(
        taken > 0,
        "no getter ever took an event before its CQ's destroy"
    );
}
