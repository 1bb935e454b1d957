//! How fast the reduction kernels fold one buffer into another, beside `memcpy` of the same
//! bytes measured in the same run (the bound a reduction that reads two buffers and writes one
//! is held to): `cargo run --release -p ferroce-coll --example reduce_speed [MiB]`.
//!
//! Prints GB/s of destination bytes per second (1e9 B/s), and the ratio to memcpy's.

use std::time::Instant;

use ferroce_coll::{reduce_into, DataType, ReduceOp};

fn best_of<F: FnMut()>(mut f: F, reps: usize) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(64);
    let len = mib << 20;
    let src = vec![1u8; len];
    let mut dst = vec![2u8; len];
    let reps = 7;
    let copy = best_of(
        || {
            dst.copy_from_slice(&src);
            std::hint::black_box(&mut dst);
        },
        reps,
    );
    let gbs = |t: f64| len as f64 / t / 1e9;
    println!("{mib} MiB buffers, best of {reps}");
    println!("{:<10}{:<6}{:>10}{:>12}", "type", "op", "GB/s", "vs memcpy");
    println!("{:<10}{:<6}{:>10.2}{:>11.2}x", "memcpy", "", gbs(copy), 1.0);
    for t in DataType::ALL {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let secs = best_of(
                || {
                    reduce_into(&mut dst, &src, t, op).unwrap();
                    std::hint::black_box(&mut dst);
                },
                reps,
            );
            println!(
                "{:<10}{:<6}{:>10.2}{:>11.2}x",
                t.name(),
                op.name(),
                gbs(secs),
                copy / secs
            );
        }
    }
}
