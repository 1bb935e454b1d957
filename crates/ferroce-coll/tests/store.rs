//! The rendezvous between ranks as threads of this process over real TCP on loopback: every
//! world size from 1 to 5 exchanges cards over several rounds; the environment is read as
//! torchrun sets it; a wrong world size and a duplicate rank are refused (to the rank that
//! claimed it) without failing the job; a rank that never comes and a rank that leaves
//! mid-exchange are errors within the deadline, never a hang. Hostile connections are in
//! `rendezvous.rs`.

use std::net::{SocketAddr, TcpListener};
use std::time::{Duration, Instant};

use ferroce_coll::{RankInfo, Store, StoreError};

const T: Duration = Duration::from_secs(10);

fn listener() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

/// Card of `rank` in `round`: sizes differ per rank (0 bytes for rank 0 in round 1).
fn card(rank: usize, round: usize) -> Vec<u8> {
    (0..(rank * 37 + round * 5) % 300)
        .map(|i| (i * 7 + rank * 11 + round) as u8)
        .collect()
}

#[test]
fn every_world_size_exchanges_cards_in_rank_order() {
    for n in 1..=5usize {
        let (l, addr) = listener();
        let mut threads = Vec::new();
        for rank in 1..n {
            threads.push(std::thread::spawn(move || {
                let mut s = Store::connect(addr, rank, n, T).unwrap();
                (1..=3)
                    .map(|round| s.all_gather(&card(rank, round)).unwrap())
                    .collect::<Vec<_>>()
            }));
        }
        let mut s0 = Store::serve(l, n, T).unwrap();
        assert_eq!((s0.rank(), s0.world_size()), (0, n));
        let mine: Vec<_> = (1..=3)
            .map(|round| s0.all_gather(&card(0, round)).unwrap())
            .collect();
        let want: Vec<Vec<Vec<u8>>> = (1..=3)
            .map(|round| (0..n).map(|r| card(r, round)).collect())
            .collect();
        assert_eq!(mine, want, "rank 0 of {n}");
        for (i, t) in threads.into_iter().enumerate() {
            assert_eq!(t.join().unwrap(), want, "rank {} of {n}", i + 1);
        }
    }
}

#[test]
fn rank_info_reads_torchruns_environment() {
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    let info = RankInfo::from_vars(vars(&[
        ("RANK", "2"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("LOCAL_RANK", "0"),
    ]))
    .unwrap();
    assert_eq!(
        (info.rank, info.world_size, info.master, info.local_rank),
        (2, 4, "127.0.0.1:29500".parse().unwrap(), Some(0))
    );
    let err = |v: &'static [(&'static str, &'static str)]| {
        RankInfo::from_vars(vars(v)).unwrap_err().to_string()
    };
    assert!(err(&[("WORLD_SIZE", "4")]).contains("RANK is not set"));
    assert!(err(&[
        ("RANK", "4"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1")
    ])
    .contains("rank 4 of a world of 4"));
    assert!(err(&[
        ("RANK", "x"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1")
    ])
    .contains("RANK=\"x\""));
    assert!(err(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "4"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "99999")
    ])
    .contains("MASTER_PORT"));
}

#[test]
fn a_rank_with_another_world_size_is_refused_and_rank_0_says_so_at_its_deadline() {
    let (l, addr) = listener();
    let started = Instant::now();
    let other = std::thread::spawn(move || {
        let r = Store::connect(addr, 1, 3, T);
        (r, started.elapsed())
    });
    let r0 = Store::serve(l, 2, Duration::from_secs(1));
    assert!(
        matches!(&r0, Err(StoreError::Timeout(_, m)) if m.contains("1 with another world size")),
        "{r0:?}"
    );
    let (r1, took) = other.join().unwrap();
    assert!(
        matches!(&r1, Err(StoreError::Refused(m)) if m.contains("3 ranks")),
        "{r1:?}"
    );
    // Refused at once, not at rank 0's deadline.
    assert!(took < Duration::from_millis(900), "{took:?}");
}

#[test]
fn of_two_processes_claiming_one_rank_the_second_is_refused_and_the_job_forms() {
    let (l, addr) = listener();
    let r0 = std::thread::spawn(move || {
        let mut s = Store::serve(l, 3, T).unwrap();
        let cards = s.all_gather(b"zero").unwrap();
        (cards, s.stats())
    });
    let mut first = std::thread::spawn(move || Store::connect(addr, 1, 3, T))
        .join()
        .unwrap()
        .unwrap();
    // Rank 1 is held by a live connection now: a second claim is refused, the first stays.
    let second = Store::connect(addr, 1, 3, T);
    assert!(
        matches!(&second, Err(StoreError::Refused(m)) if m.contains("claim rank 1")),
        "{second:?}"
    );
    let two = std::thread::spawn(move || {
        let mut s = Store::connect(addr, 2, 3, T).unwrap();
        s.all_gather(b"two").unwrap()
    });
    let want: Vec<Vec<u8>> = vec![b"zero".to_vec(), b"one".to_vec(), b"two".to_vec()];
    assert_eq!(first.all_gather(b"one").unwrap(), want);
    assert_eq!(two.join().unwrap(), want);
    let (cards, stats) = r0.join().unwrap();
    assert_eq!(cards, want);
    assert_eq!(
        (stats.duplicate, stats.admitted, stats.ignored()),
        (1, 2, 1),
        "{stats:?}"
    );
}

#[test]
fn a_rank_that_never_comes_is_a_timeout_naming_it() {
    let (l, addr) = listener();
    let one = std::thread::spawn(move || Store::connect(addr, 1, 3, Duration::from_secs(2)));
    let started = Instant::now();
    let r0 = Store::serve(l, 3, Duration::from_millis(500));
    assert!(
        matches!(&r0, Err(StoreError::Timeout(_, what)) if what.contains("[2]")),
        "{r0:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(one.join());
}

#[test]
fn a_rank_that_leaves_mid_exchange_fails_the_others() {
    let (l, addr) = listener();
    let leaver = std::thread::spawn(move || {
        let mut s = Store::connect(addr, 1, 3, T).unwrap();
        s.all_gather(b"first").unwrap();
        // Leaves before the second exchange.
        drop(s);
    });
    let stayer = std::thread::spawn(move || {
        let mut s = Store::connect(addr, 2, 3, T).unwrap();
        s.all_gather(b"first").unwrap();
        s.all_gather(b"second")
    });
    let mut s0 = Store::serve(l, 3, T).unwrap();
    s0.all_gather(b"first").unwrap();
    leaver.join().unwrap();
    let started = Instant::now();
    let r0 = s0.all_gather(b"second");
    assert!(matches!(r0, Err(StoreError::RankGone(1))), "{r0:?}");
    let r2 = stayer.join().unwrap();
    assert!(
        matches!(&r2, Err(StoreError::Aborted(why)) if why.contains("rank 1 left")),
        "{r2:?}"
    );
    assert!(
        started.elapsed() < T / 2,
        "the failure took the whole deadline"
    );
}
