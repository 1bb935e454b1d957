//! Measures what one idle progress pass and one empty CQ poll cost (for tuning the engine).
use std::time::Instant;
fn main() {
    let lo = ferroce::device_by_name("lo").unwrap();
    let ctx = lo
        .open(&ferroce::ContextOptions {
            capture: None,
            ..ferroce::ContextOptions::with_port(0)
        })
        .unwrap();
    let cq = ctx.create_cq(16, None).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let _qp = pd
        .create_qp(&ferroce::QpInitAttr::new(&cq, Default::default()))
        .unwrap();
    let mr = pd.alloc_mr(64, ferroce::Access::ALL).unwrap();
    let n = 200_000;
    let t = Instant::now();
    for _ in 0..n {
        ctx.progress();
    }
    println!(
        "progress(): {:.0} ns",
        t.elapsed().as_nanos() as f64 / n as f64
    );
    let t = Instant::now();
    for _ in 0..n {
        let _ = cq.poll_one();
    }
    println!(
        "poll_one() empty: {:.0} ns",
        t.elapsed().as_nanos() as f64 / n as f64
    );
    let t = Instant::now();
    let mut b = [0u8];
    for _ in 0..n {
        mr.read(0, &mut b).unwrap();
    }
    println!(
        "mr.read 1 B: {:.0} ns",
        t.elapsed().as_nanos() as f64 / n as f64
    );
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 64];
    let t = Instant::now();
    for _ in 0..n {
        let _ = s.recv(&mut buf);
    }
    println!(
        "plain recv EAGAIN: {:.0} ns",
        t.elapsed().as_nanos() as f64 / n as f64
    );
}
