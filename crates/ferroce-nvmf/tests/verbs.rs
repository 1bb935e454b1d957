//! The target and the host on ferroce's verbs, in one process over loopback: two contexts, the
//! target's queue threads and the host's controllers, connected by the queues' TCP exchange.
//! Bytes are checked through keyed READs and WRITEs; an out-of-range LBA, a bad key and a host
//! that vanishes each get what the specification names, and the target keeps serving the
//! others.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroce::{Context, ContextOptions};
use ferroce_nvmf::cm::CmRejectStatus;
use ferroce_nvmf::command::{io, Command};
use ferroce_nvmf::completion::Status;
use ferroce_nvmf::controllers::{Subsystem, Target, TargetConfig};
use ferroce_nvmf::namespace::{MemoryBacking, Namespace};
use ferroce_nvmf::rdma::exchange::ExchangeError;
use ferroce_nvmf::rdma::initiator::{Controller, HostCm, HostError, HostOptions, Queue};
use ferroce_nvmf::rdma::target::{Counters, QueueLimits, Server};
use ferroce_nvmf::sgl::Sgl;

const NQN: &str = "nqn.2026-11.io.ferroce:verbs-test";
const BLOCKS: u64 = 2048;

fn context() -> Arc<Context> {
    let dev = ferroce::devices()
        .unwrap()
        .into_iter()
        .find_map(|d| {
            let i = d
                .gids()
                .iter()
                .position(|g| g.ip == std::net::IpAddr::from(Ipv4Addr::LOCALHOST))?;
            Some((d, i))
        })
        .expect("a ferroce device on 127.0.0.1");
    Arc::new(
        dev.0
            .open(&ContextOptions {
                gid_index: dev.1,
                host_slot: true,
                ..ContextOptions::default()
            })
            .unwrap(),
    )
}

/// A target serving one 1 MiB namespace in memory; its address and counters.
fn start_target() -> (
    SocketAddr,
    Arc<Counters>,
    Arc<std::sync::atomic::AtomicBool>,
) {
    let config = TargetConfig {
        max_queue_entries: 64,
        max_io_queues: 4,
        in_capsule_data: 4096,
        mdts: 4,
        listen: ("127.0.0.1".into(), "4420".into(), false),
    };
    let subsystem = Subsystem {
        nqn: NQN.into(),
        serial: "verbs-test".into(),
        namespaces: [(
            1,
            Arc::new(Namespace {
                nsid: 1,
                block_shift: 9,
                backing: Box::new(MemoryBacking::new(BLOCKS as usize * 512)),
                nguid: [7; 16],
            }),
        )]
        .into_iter()
        .collect(),
    };
    let server = Server::new(
        context(),
        Target::new(config, vec![subsystem]),
        QueueLimits {
            max_transfer: 4096 << 4,
            in_capsule: 4096,
            bounce_bytes: 1 << 20,
            max_queue_entries: 64,
            max_queues: 8,
        },
    );
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (counters, stop) = (server.counters(), server.stop_flag());
    std::thread::spawn(move || server.serve_tcp(listener).unwrap());
    (addr, counters, stop)
}

/// Host `n`'s options for subsystem `subnqn`.
fn options(n: u8, subnqn: &str) -> HostOptions {
    HostOptions {
        hostnqn: format!("nqn.2026-11.io.ferroce:host{n}"),
        host_id: [n; 16],
        subnqn: subnqn.into(),
        io_queue_entries: 16,
        max_transfer: 65536,
        timeout: Duration::from_secs(10),
        cm: HostCm::Tcp,
        keep_alive_timeout: Duration::ZERO,
    }
}

fn host(addr: SocketAddr, n: u8) -> (Controller, Queue) {
    let mut ctrl = Controller::connect(context(), addr, options(n, NQN)).unwrap();
    assert_eq!(ctrl.namespace.blocks, BLOCKS);
    assert_eq!(ctrl.namespace.block_size, 512);
    assert_eq!(ctrl.max_transfer, Some(65536));
    let q = ctrl.io_queue(1, 65536).unwrap();
    (ctrl, q)
}

/// Runs one I/O to its completion.
fn one(q: &mut Queue, ns: &Controller, write: bool, slba: u64, blocks: u32) -> Status {
    let cid = q.submit_io(write, &ns.namespace, slba, blocks, 0).unwrap();
    completion_of(q, cid)
}

fn completion_of(q: &mut Queue, cid: u16) -> Status {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        if let Some((c, _)) = q
            .reap(Duration::from_millis(100))
            .unwrap()
            .into_iter()
            .next()
        {
            assert_eq!(c.cid, cid, "the only command in flight");
            return c.status;
        }
    }
    panic!("no response");
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

#[test]
fn bytes_travel_both_ways_and_errors_get_their_status() {
    let (addr, counters, stop) = start_target();
    let (ctrl_a, mut a) = host(addr, 1);
    let (ctrl_b, mut b) = host(addr, 2);
    // Written by one host through RDMA READ, read by the other through RDMA WRITE.
    for (i, (slba, blocks)) in [(0u64, 1u32), (7, 8), (100, 128), (BLOCKS - 3, 3)]
        .into_iter()
        .enumerate()
    {
        let data = pattern(i as u8 + 1, blocks as usize * 512);
        a.fill(0, &data).unwrap();
        assert_eq!(one(&mut a, &ctrl_a, true, slba, blocks), Status::SUCCESS);
        b.fill(0, &vec![0xEE; data.len()]).unwrap();
        assert_eq!(one(&mut b, &ctrl_b, false, slba, blocks), Status::SUCCESS);
        assert_eq!(
            b.slot_bytes(0, data.len()).unwrap(),
            data,
            "{slba}+{blocks}"
        );
    }
    // Past the namespace's end: LBA Out of Range, and the queue goes on.
    assert_eq!(
        one(&mut a, &ctrl_a, false, BLOCKS - 1, 2),
        Status::LBA_OUT_OF_RANGE
    );
    assert_eq!(one(&mut a, &ctrl_a, false, 0, 1), Status::SUCCESS);
    // A Write whose key grants nothing: the target's READ fails, the QP is in error, the queue
    // ends (no response can follow); the other host's queue is untouched.
    let mut bad = Command::new(
        io::WRITE,
        0,
        1,
        Sgl::Keyed {
            addr: 0x1000,
            len: 512,
            key: 0xdead_beef,
            invalidate: false,
        },
    )
    .unwrap();
    bad.cdw[0] = 5;
    a.submit(bad, 0).unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let failed = loop {
        match a.reap(Duration::from_millis(100)) {
            Err(HostError::Protocol(e)) => break e,
            Ok(got) => assert!(got.is_empty(), "a response to a bad key: {got:?}"),
            Err(e) => panic!("{e}"),
        }
        assert!(Instant::now() < deadline, "the bad key's queue did not end");
    };
    assert!(failed.contains("transport failed"), "{failed}");
    let data = pattern(99, 4096);
    b.fill(0, &data).unwrap();
    assert_eq!(one(&mut b, &ctrl_b, true, 40, 8), Status::SUCCESS);
    assert_eq!(one(&mut b, &ctrl_b, false, 40, 8), Status::SUCCESS);
    assert_eq!(b.slot_bytes(0, 4096).unwrap(), data);
    let deadline = Instant::now() + Duration::from_secs(10);
    while counters.transport_errors.load(Ordering::Relaxed) == 0 {
        assert!(Instant::now() < deadline, "{}", counters.summary());
        std::thread::sleep(Duration::from_millis(10));
    }
    // A host that vanishes: its queues end with their connections, and a new host still
    // connects and reads what the first wrote.
    let opened = counters.queues_opened.load(Ordering::Relaxed);
    assert_eq!(opened, 4);
    drop((a, ctrl_a));
    drop((b, ctrl_b));
    let (ctrl_c, mut c) = host(addr, 3);
    assert_eq!(one(&mut c, &ctrl_c, false, 40, 8), Status::SUCCESS);
    assert_eq!(c.slot_bytes(0, 4096).unwrap(), data);
    drop((c, ctrl_c));
    let deadline = Instant::now() + Duration::from_secs(10);
    while counters.queues_closed.load(Ordering::Relaxed) < 6 {
        assert!(
            Instant::now() < deadline,
            "queues left open: {}",
            counters.summary()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Release);
}

#[test]
fn queues_the_target_cannot_take_are_refused_with_their_status() {
    let (addr, counters, stop) = start_target();
    // An unknown subsystem: Connect fails with Invalid Parameters (the queue is up, its
    // controller is not).
    let r = Controller::connect(context(), addr, options(9, "nqn.2026-11.io.ferroce:nobody"));
    match r {
        Err(HostError::Status { what, status }) => {
            assert_eq!(what, "Connect");
            assert_eq!(status, Status::CONNECT_INVALID_PARAMETERS);
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("connected to a subsystem nobody serves"),
    }
    // A queue larger than the target takes: refused at the exchange, before any QP work.
    let (_ctrl, _q) = host(addr, 4);
    let refused = counters.queues_refused.load(Ordering::Relaxed);
    let too_deep = Controller::connect(context(), addr, options(5, NQN)).and_then(|mut c| {
        c.set_io_queue_entries(200);
        c.io_queue(1, 4096)
    });
    assert!(
        matches!(too_deep, Err(HostError::Exchange(_))),
        "{:?}",
        too_deep.err()
    );
    assert_eq!(counters.queues_refused.load(Ordering::Relaxed), refused + 1);
    // As many queues as the target allows (8: this host's two and three more hosts'), then
    // the next is refused with "no resources" before anything is made for it.
    let more: Vec<_> = (10..13).map(|n| host(addr, n)).collect();
    let full = Controller::connect(context(), addr, options(13, NQN));
    assert!(
        matches!(
            full,
            Err(HostError::Exchange(ExchangeError::Rejected(
                CmRejectStatus::NoResources
            )))
        ),
        "{:?}",
        full.err()
    );
    drop(more);
    stop.store(true, Ordering::Release);
}

/// A host that goes silent (its process alive, its transport answering, but no command sent
/// for longer than the keep-alive timeout it asked for): the target ends its controller and
/// both its queues, its next command fails, and another host connects and is served.
#[test]
fn a_silent_host_loses_its_controller_after_its_keep_alive_timeout() {
    let (addr, counters, stop) = start_target();
    let opts = HostOptions {
        keep_alive_timeout: Duration::from_secs(1),
        ..options(20, NQN)
    };
    let mut ctrl = Controller::connect(context(), addr, opts).unwrap();
    let mut q = ctrl.io_queue(1, 65536).unwrap();
    // Within the timeout, a Keep Alive and I/O keep it.
    ctrl.keep_alive().unwrap();
    assert_eq!(one(&mut q, &ctrl, false, 0, 8), Status::SUCCESS);
    assert_eq!(counters.keep_alive_expired.load(Ordering::Relaxed), 0);
    // Then silence: the controller and both queues end.
    let deadline = Instant::now() + Duration::from_secs(10);
    while counters.queues_closed.load(Ordering::Relaxed) < 2 {
        assert!(
            Instant::now() < deadline,
            "still open: {}",
            counters.summary()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(counters.keep_alive_expired.load(Ordering::Relaxed), 1);
    assert_eq!(counters.queues_opened.load(Ordering::Relaxed), 2);
    assert!(
        ctrl.keep_alive().is_err(),
        "a Keep Alive to an ended controller"
    );
    let (ctrl_b, mut b) = host(addr, 21);
    let data = pattern(7, 4096);
    b.fill(0, &data).unwrap();
    assert_eq!(one(&mut b, &ctrl_b, true, 16, 8), Status::SUCCESS);
    assert_eq!(one(&mut b, &ctrl_b, false, 16, 8), Status::SUCCESS);
    assert_eq!(b.slot_bytes(0, 4096).unwrap(), data);
    stop.store(true, Ordering::Release);
}
