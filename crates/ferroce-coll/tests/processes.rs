//! Ranks as separate processes started the way torchrun starts them: this test binary re-runs
//! itself (`--exact child_rank`) with `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set,
//! each child joins with `Communicator::from_env`, runs allreduces and checks every element.
//! With `FERROCE_JOB_TOKEN` set, a stranger without it is turned away while the ranks join.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::Duration;

use ferroce_coll::{reduce_into, CommOptions, Communicator, DataType, ReduceOp};

/// Set in a child: the element count of its allreduces.
const ELEMS_ENV: &str = "FERROCE_COLL_TEST_ELEMS";

fn input(rank: usize, elems: usize) -> Vec<u8> {
    (0..elems)
        .flat_map(|i| (((i * 5 + rank * 3) % 7) as f32).to_ne_bytes())
        .collect()
}

/// One rank, when started by the test below (returns at once otherwise).
#[test]
fn child_rank() {
    let Ok(elems) = std::env::var(ELEMS_ENV) else {
        return;
    };
    let elems: usize = elems.parse().unwrap();
    let opts = CommOptions {
        timeout: Duration::from_secs(30),
        slot_bytes: 1 << 16,
        ..CommOptions::default()
    };
    let mut comm = Communicator::from_env(&opts).unwrap();
    let (rank, n) = (comm.rank(), comm.size());
    let mut want = input(0, elems);
    for r in 1..n {
        reduce_into(&mut want, &input(r, elems), DataType::F32, ReduceOp::Sum).unwrap();
    }
    for _ in 0..3 {
        let mut buf = input(rank, elems);
        comm.allreduce(&mut buf, DataType::F32, ReduceOp::Sum)
            .unwrap();
        assert!(buf == want, "rank {rank}: wrong sums");
    }
    comm.barrier().unwrap();
    if let Some(s) = comm.store().map(|s| s.stats()) {
        println!(
            "STATS bad_token={} silent={} admitted={}",
            s.bad_token, s.silent, s.admitted
        );
    }
    println!("RANK_DONE {rank}");
}

/// Starts `n` ranks on a port free a moment ago; their outputs, or `None` if rank 0 found the
/// port taken in between (then the caller tries another).
fn run_ranks(n: usize) -> Option<Vec<(bool, String)>> {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let children: Vec<_> = (0..n)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("LOCAL_RANK", rank.to_string())
                .env(ELEMS_ENV, "100003")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outs: Vec<(bool, String)> = children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            (out.status.success(), text)
        })
        .collect();
    let taken = !outs[0].0 && outs[0].1.contains("Address already in use");
    (!taken).then_some(outs)
}

#[test]
fn ranks_in_separate_processes_join_from_torchruns_environment() {
    for n in [2usize, 3] {
        let outs = (0..3)
            .find_map(|_| run_ranks(n))
            .expect("the master port was taken three times");
        for (rank, (ok, text)) in outs.iter().enumerate() {
            assert!(ok, "{n} ranks, rank {rank}:\n{text}");
            assert!(text.contains(&format!("RANK_DONE {rank}")), "{text}");
        }
    }
}

fn spawn_rank(rank: usize, n: usize, port: u16, token: &str) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", n.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("FERROCE_JOB_TOKEN", token)
        .env(ELEMS_ENV, "1003")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn output(c: std::process::Child) -> (bool, String) {
    let out = c.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn a_job_token_from_the_environment_keeps_strangers_out() {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let r0 = spawn_rank(0, 2, port, "job-7f3a");
    // Once rank 0 listens: a connection that says nothing, and a well-formed claim to rank 1
    // without the token (without a token in the job, it would have taken rank 1).
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let started = std::time::Instant::now();
    let silent = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(_) if started.elapsed() < Duration::from_secs(20) => {
                std::thread::sleep(Duration::from_millis(20))
            }
            Err(e) => panic!("rank 0 never listened: {e}"),
        }
    };
    let mut stranger = TcpStream::connect(addr).unwrap();
    let mut hello = b"FRC2".to_vec();
    for w in [8u32, 1, 2] {
        hello.extend_from_slice(&w.to_be_bytes());
    }
    stranger.write_all(&hello).unwrap();
    stranger
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut answer = Vec::new();
    stranger.read_to_end(&mut answer).unwrap();
    assert_eq!(&answer[4..], b"ERR the job token does not match");
    let r1 = spawn_rank(1, 2, port, "job-7f3a");
    let (o0, o1) = (output(r0), output(r1));
    assert!(o0.0 && o0.1.contains("RANK_DONE 0"), "{}", o0.1);
    assert!(o1.0 && o1.1.contains("RANK_DONE 1"), "{}", o1.1);
    assert!(
        o0.1.contains("STATS bad_token=1 silent=1 admitted=1"),
        "{}",
        o0.1
    );
    drop(silent);
}
