//! Strangers at rank 0's door, over real sockets, while the ranks (threads, each with its own
//! ferroce context) join: garbage, a hello claiming 4 GiB, silence, a wrong world size, a rank
//! out of range, a duplicate rank, a wrong or missing job token, a flood of connections. The
//! job must still form, well within its timeout, and an allreduce must give the right sums;
//! rank 0's counters must say what it turned away.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ferroce::Provider;
use ferroce_coll::{CommOptions, Communicator, DataType, ReduceOp, RendezvousStats, Store};

/// The store's and the communicator's timeout: the tests must finish far inside it.
const T: Duration = Duration::from_secs(20);

fn options() -> CommOptions {
    CommOptions {
        timeout: T,
        slot_bytes: 4096,
        slots: 2,
        small_bytes: 2048,
        provider: Provider::Shm,
        device: Some("lo".into()),
    }
}

/// A hello as a rank sends it: magic, length of the rest, rank, world size, token.
fn hello(rank: u32, world: u32, token: &[u8]) -> Vec<u8> {
    let mut h = b"FRC2".to_vec();
    h.extend_from_slice(&(8 + token.len() as u32).to_be_bytes());
    h.extend_from_slice(&rank.to_be_bytes());
    h.extend_from_slice(&world.to_be_bytes());
    h.extend_from_slice(token);
    h
}

fn stranger(addr: SocketAddr, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    s.write_all(bytes).unwrap();
    s
}

/// Rank 0's answer to a stranger: `Some(text)`, or `None` if it closed without one.
fn answer(s: &mut TcpStream) -> Option<String> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut text = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut text).ok()?;
    Some(String::from_utf8_lossy(&text).into_owned())
}

/// Whether rank 0 closed the connection (rather than leaving it open): reads end, soon.
fn closed(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
        }
    }
}

/// Rank `rank`'s input: element `i` is `i % 5 + rank`.
fn input(rank: usize, elems: usize) -> Vec<u8> {
    (0..elems)
        .flat_map(|i| ((i % 5 + rank) as f32).to_ne_bytes())
        .collect()
}

/// Joins as rank `rank` of `n` (rank 0 serves `listener`), says so on `joined`, then
/// allreduces 1000 f32 and checks every sum; rank 0 returns its counters.
fn rank(
    rank: usize,
    n: usize,
    addr: SocketAddr,
    listener: Option<TcpListener>,
    token: Option<&'static [u8]>,
    joined: mpsc::Sender<usize>,
) -> std::thread::JoinHandle<RendezvousStats> {
    std::thread::spawn(move || {
        let store = match listener {
            Some(l) => Store::serve_with_token(l, n, T, token).unwrap(),
            None => Store::connect_with_token(addr, rank, n, T, token).unwrap(),
        };
        let stats = store.stats();
        joined.send(rank).unwrap();
        let mut comm = Communicator::with_store(store, addr, &options()).unwrap();
        let elems = 1000;
        let mut buf = input(rank, elems);
        comm.allreduce(&mut buf, DataType::F32, ReduceOp::Sum)
            .unwrap();
        let want: Vec<u8> = (0..elems)
            .flat_map(|i| ((0..n).map(|r| i % 5 + r).sum::<usize>() as f32).to_ne_bytes())
            .collect();
        assert!(buf == want, "rank {rank}: wrong sums");
        assert_eq!(comm.store().map(|s| s.stats()), Some(stats));
        stats
    })
}

fn listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

#[test]
fn strangers_at_the_door_neither_stall_nor_fail_the_job() {
    let started = Instant::now();
    let (l, addr) = listener();
    let (joined, joins) = mpsc::channel();
    let r0 = rank(0, 3, addr, Some(l), None, joined.clone());
    // Before any rank: one that says nothing and stays, one that stops half-way through a
    // hello, an HTTP probe, a hello claiming 4 GiB, and hellos with a token the job does not
    // have, another world size, and a rank outside the world.
    let mut silent = TcpStream::connect(addr).unwrap();
    let mut half = stranger(addr, &hello(2, 3, b"")[..10]);
    let mut http = stranger(addr, b"GET / HTTP/1.1\r\nHost: rank0\r\n\r\n");
    let mut huge = b"FRC2".to_vec();
    huge.extend_from_slice(&u32::MAX.to_be_bytes());
    huge.extend_from_slice(&[7u8; 1000]);
    let mut huge = stranger(addr, &huge);
    let mut token = stranger(addr, &hello(1, 3, b"a guess"));
    let mut world = stranger(addr, &hello(2, 9, b""));
    let mut range = stranger(addr, &hello(5, 3, b""));
    assert_eq!(
        answer(&mut token).as_deref(),
        Some("ERR the job token does not match")
    );
    assert!(answer(&mut world).is_some_and(|a| a.contains("9 ranks")));
    assert!(answer(&mut range).is_some_and(|a| a.contains("outside a world of 3")));
    assert!(closed(&mut http), "the HTTP probe was left open");
    assert!(closed(&mut huge), "the 4 GiB hello was left open");

    let r1 = rank(1, 3, addr, None, None, joined.clone());
    assert_eq!(joins.recv_timeout(T).unwrap(), 1);
    // Rank 1 is held by a live connection: a second claim to it is refused.
    let mut dup = stranger(addr, &hello(1, 3, b""));
    assert_eq!(
        answer(&mut dup).as_deref(),
        Some("ERR two processes claim rank 1")
    );
    let r2 = rank(2, 3, addr, None, None, joined);

    let stats = r0.join().unwrap();
    r1.join().unwrap();
    r2.join().unwrap();
    let took = started.elapsed();
    assert!(took < T / 4, "the job took {took:?} to form and allreduce");
    assert_eq!(
        stats,
        RendezvousStats {
            admitted: 2,
            garbage: 1,
            oversized: 1,
            bad_token: 1,
            wrong_world: 1,
            out_of_range: 1,
            duplicate: 1,
            replaced: 0,
            silent: 2,
            overflow: 0,
        }
    );
    assert_eq!(stats.ignored(), 8);
    // The silent ones were closed when the job formed, not left holding descriptors.
    assert!(closed(&mut silent) && closed(&mut half));
}

#[test]
fn with_a_job_token_strangers_cannot_take_a_rank() {
    const TOKEN: &[u8] = b"correct horse battery staple";
    let started = Instant::now();
    let (l, addr) = listener();
    let (joined, joins) = mpsc::channel();
    let r0 = rank(0, 3, addr, Some(l), Some(TOKEN), joined.clone());
    // Well-formed claims to both free ranks, before the ranks come: without the token each
    // would have taken its rank and shut the real one out.
    let mut none = stranger(addr, &hello(1, 3, b""));
    let mut wrong = stranger(addr, &hello(2, 3, b"correct horse battery stapler"));
    let mut near = stranger(addr, &hello(2, 3, b"correct horse battery stapla"));
    for s in [&mut none, &mut wrong, &mut near] {
        assert_eq!(
            answer(s).as_deref(),
            Some("ERR the job token does not match")
        );
    }
    let r1 = rank(1, 3, addr, None, Some(TOKEN), joined.clone());
    let r2 = rank(2, 3, addr, None, Some(TOKEN), joined);
    let mut seen: Vec<usize> = (0..3).map(|_| joins.recv_timeout(T).unwrap()).collect();
    seen.sort_unstable();
    assert_eq!(seen, [0, 1, 2]);
    let stats = r0.join().unwrap();
    r1.join().unwrap();
    r2.join().unwrap();
    assert!(started.elapsed() < T / 4, "{:?}", started.elapsed());
    assert_eq!(
        (stats.bad_token, stats.admitted, stats.ignored()),
        (3, 2, 3)
    );
}

#[test]
fn a_rank_without_the_token_is_refused_at_once() {
    let (l, addr) = listener();
    let r0 = std::thread::spawn(move || Store::serve_with_token(l, 2, T, Some(b"secret")));
    let started = Instant::now();
    let r1 = Store::connect_with_token(addr, 1, 2, T, None);
    assert!(
        matches!(&r1, Err(ferroce_coll::StoreError::Refused(m)) if m.contains("token")),
        "{r1:?}"
    );
    assert!(started.elapsed() < T / 10);
    let r1 = Store::connect_with_token(addr, 1, 2, T, Some(b"secret")).unwrap();
    let s0 = r0.join().unwrap().unwrap();
    assert_eq!((s0.stats().bad_token, s0.stats().admitted), (1, 1));
    drop(r1);
}

#[test]
fn a_rank_whose_first_connection_broke_takes_its_rank_again() {
    let (l, addr) = listener();
    let r0 = std::thread::spawn(move || {
        let mut s = Store::serve_with_token(l, 3, T, None).unwrap();
        (s.all_gather(b"zero").unwrap(), s.stats())
    });
    // Rank 1's first connection is admitted, then breaks (before rank 1 could use it).
    let mut first = stranger(addr, &hello(1, 3, b""));
    assert_eq!(answer(&mut first).as_deref(), Some("OK"));
    drop(first);
    std::thread::sleep(Duration::from_millis(100));
    // Rank 2 comes only once rank 1's retry is admitted (rank 0 stores an admitted connection
    // in the step that answers it OK). Were rank 2 first, rank 0 would find every slot
    // filled, drop the broken one as dead, and rank 1's retry would fill an empty slot, not
    // replace it: the count this test checks would depend on which thread ran first.
    let (admitted, admission) = mpsc::channel();
    let r1 = std::thread::spawn(move || {
        let mut s = Store::connect_with_token(addr, 1, 3, T, None).unwrap();
        admitted.send(()).unwrap();
        s.all_gather(b"one").unwrap()
    });
    admission.recv_timeout(T).expect("rank 1's retry admitted");
    let r2 = std::thread::spawn(move || {
        let mut s = Store::connect_with_token(addr, 2, 3, T, None).unwrap();
        s.all_gather(b"two").unwrap()
    });
    let want = vec![b"zero".to_vec(), b"one".to_vec(), b"two".to_vec()];
    let (cards, stats) = r0.join().unwrap();
    assert_eq!(cards, want);
    assert_eq!(r1.join().unwrap(), want);
    assert_eq!(r2.join().unwrap(), want);
    assert_eq!((stats.replaced, stats.admitted, stats.ignored()), (1, 3, 0));
}

#[test]
fn a_flood_of_silent_connections_does_not_keep_the_ranks_out() {
    let started = Instant::now();
    let (l, addr) = listener();
    let (joined, _joins) = mpsc::channel();
    let r0 = rank(0, 2, addr, Some(l), None, joined.clone());
    // More than rank 0 keeps waiting at once: the oldest are closed to make room.
    let flood: Vec<TcpStream> = (0..200)
        .map(|_| TcpStream::connect(addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let r1 = rank(1, 2, addr, None, None, joined);
    let stats = r0.join().unwrap();
    r1.join().unwrap();
    assert!(started.elapsed() < T / 4, "{:?}", started.elapsed());
    assert_eq!(stats.admitted, 1);
    assert_eq!(stats.silent + stats.overflow, 200, "{stats:?}");
    assert!(stats.overflow >= 200 - ferroce_coll::store::MAX_PENDING as u64);
    drop(flood);
}
