//! Ranks as separate processes started the way torchrun starts them: this test binary re-runs
//! itself (`--exact child_rank`) with `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set,
//! each child joins with `Communicator::from_env`, runs allreduces and checks every element.

use std::net::TcpListener;
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
