//! Ring allreduce of f32 sums between `N` ranks that are threads of this process (each with its
//! own ferroce context: shared memory between them), beside memcpy measured in the same run:
//! `cargo run --release -p ferroce-coll --example allreduce_speed [ranks] [MiB]`.
//! Prints the time per allreduce and nccl-tests' bus bandwidth (algbw · 2(n-1)/n, 1e9 B/s).

use std::net::TcpListener;
use std::time::{Duration, Instant};

use ferroce_coll::{CommOptions, Communicator, DataType, ReduceOp, Store};

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let mib: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(64);
    let bytes = mib << 20;
    let opts = CommOptions {
        device: Some("lo".into()),
        timeout: Duration::from_secs(60),
        ..CommOptions::default()
    };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let master = listener.local_addr().unwrap();
    let mut listener = Some(listener);
    let iters: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(5);
    let threads: Vec<_> = (0..n)
        .map(|rank| {
            let l = if rank == 0 { listener.take() } else { None };
            let opts = opts.clone();
            std::thread::spawn(move || {
                let store = match l {
                    Some(l) => Store::serve(l, n, opts.timeout).unwrap(),
                    None => Store::connect(master, rank, n, opts.timeout).unwrap(),
                };
                let mut comm = Communicator::with_store(store, master, &opts).unwrap();
                let mut buf: Vec<u8> = (0..bytes / 4)
                    .flat_map(|i| (i as f32).to_ne_bytes())
                    .collect();
                comm.allreduce(&mut buf, DataType::F32, ReduceOp::Sum)
                    .unwrap();
                comm.barrier().unwrap();
                let t = Instant::now();
                for i in 0..iters {
                    if let Err(e) = comm.allreduce(&mut buf, DataType::F32, ReduceOp::Sum) {
                        panic!("rank {rank} iteration {i}: {e}");
                    }
                }
                t.elapsed().as_secs_f64() / iters as f64
            })
        })
        .collect();
    let time = threads
        .into_iter()
        .map(|t| t.join().unwrap())
        .fold(0.0, f64::max);
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let t = Instant::now();
    for _ in 0..iters {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst);
    }
    let copy = t.elapsed().as_secs_f64() / iters as f64;
    let algbw = bytes as f64 / time / 1e9;
    let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
    println!(
        "{n} ranks, {mib} MiB f32 sum: {:.1} ms, algbw {algbw:.2} GB/s, busbw {busbw:.2} GB/s; \
         memcpy of {mib} MiB {:.2} GB/s in the same run",
        time * 1e3,
        bytes as f64 / copy / 1e9
    );
}
