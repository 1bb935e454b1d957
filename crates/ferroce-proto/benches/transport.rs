//! The transport's own CPU cost: messages per second through two queue pairs wired back to back
//! in memory. No sockets, no syscalls, no ICRC (that is the wire layer's, benchmarked there):
//! what is measured is segmentation, PSN and window bookkeeping, the responder's checks and
//! copies, ACK generation and completion.
//!
//! `cargo bench -p ferroce-proto --bench transport`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use ferroce_proto::sim::pair::{connected_qp, default_rtr, default_rts};
use ferroce_proto::{
    Access, Instant, PathMtu, QpCaps, QueuePair, RecvWr, RtrAttr, RtsAttr, SendOp, SendWr, Sge,
    VecMemory,
};
use ferroce_wire::Psn;

struct Wire {
    a: QueuePair,
    b: QueuePair,
    mem_a: VecMemory,
    mem_b: VecMemory,
    buf: Vec<u8>,
    src_lkey: u32,
    dst_rkey: u32,
    recv_lkey: u32,
}

fn qp(qpn: u32, peer: u32, mtu: PathMtu) -> QueuePair {
    let caps = QpCaps {
        max_send_wr: 8192,
        max_recv_wr: 8192,
        ..QpCaps::default()
    };
    let rtr = RtrAttr {
        path_mtu: mtu,
        max_dest_rd_atomic: 16,
        ..default_rtr(peer, Psn::new(0))
    };
    let rts = RtsAttr {
        timeout: 14,
        max_rd_atomic: 16,
        ..default_rts()
    };
    let mut qp = connected_qp(qpn, caps, &rtr, &rts);
    // Time stands still here (the CPU cost is what is measured): a pacer would hold every
    // packet after the first quantum until a moment that never comes.
    qp.set_congestion_control(ferroce_proto::CcConfig {
        algorithm: ferroce_proto::CcAlgorithm::Off,
        target_delay: ferroce_proto::cc::DEFAULT_TARGET_DELAY,
    });
    qp
}

impl Wire {
    fn new(mtu: PathMtu, len: usize) -> Wire {
        let mut mem_a = VecMemory::new();
        let mut mem_b = VecMemory::new();
        let src = mem_a.register(1, 0x1000, len.max(8), Access::ALL);
        let dst = mem_b.register(1, 0x1000, len.max(8), Access::ALL);
        let recv = mem_b.register(1, 0x100_0000, len.max(8), Access::ALL);
        Wire {
            a: qp(1, 2, mtu),
            b: qp(2, 1, mtu),
            src_lkey: mem_a.region(src).lkey,
            dst_rkey: mem_b.region(dst).rkey,
            recv_lkey: mem_b.region(recv).lkey,
            mem_a,
            mem_b,
            buf: vec![0; 4096 + 64],
        }
    }

    /// Moves packets both ways until neither side has anything to send.
    fn pump(&mut self) {
        let now = Instant::ZERO;
        loop {
            let mut moved = false;
            while let Some(n) = self.a.poll_transmit(now, &mut self.mem_a, &mut self.buf) {
                self.b
                    .handle_packet(now, &mut self.mem_b, &self.buf[..n])
                    .unwrap();
                moved = true;
            }
            while let Some(n) = self.b.poll_transmit(now, &mut self.mem_b, &mut self.buf) {
                self.a
                    .handle_packet(now, &mut self.mem_a, &self.buf[..n])
                    .unwrap();
                moved = true;
            }
            if !moved {
                break;
            }
        }
    }

    fn batch(&mut self, op: SendOp, len: usize, count: u64) {
        for i in 0..count {
            if op == SendOp::Send {
                let sge = Sge {
                    addr: 0x100_0000,
                    length: len as u32,
                    lkey: self.recv_lkey,
                };
                self.b
                    .post_recv(RecvWr {
                        wr_id: i,
                        sgl: vec![sge],
                    })
                    .unwrap();
            }
            let sge = Sge {
                addr: 0x1000,
                length: len as u32,
                lkey: self.src_lkey,
            };
            self.a
                .post_send(SendWr::new(i, op, vec![sge]).remote(0x1000, self.dst_rkey))
                .unwrap();
        }
        self.pump();
        let mut done = 0;
        while let Some(wc) = self.a.poll_completion() {
            assert!(wc.status == ferroce_proto::WcStatus::Success);
            done += 1;
        }
        while self.b.poll_completion().is_some() {}
        assert_eq!(done, count);
    }
}

impl Wire {
    /// One round of an 8 B WRITE ping-pong as `ferroce perf write_lat` makes it: `a` WRITEs
    /// unsignaled into `b`, `b` WRITEs back; each packet goes straight to the other side, and
    /// so does the ACK of a run of unasked requests now and then. What one round costs is the
    /// transport's share of two one-way latencies.
    fn write_pingpong(&mut self, wr: &SendWr) {
        self.a.post_send_copy(wr).unwrap();
        self.pump();
        self.b.post_send_copy(wr).unwrap();
        self.pump();
    }
}

fn bench(c: &mut Criterion) {
    const BATCH: u64 = 256;
    let mut g = c.benchmark_group("transport");
    g.throughput(Throughput::Elements(BATCH));
    let mut w = Wire::new(PathMtu::Mtu1024, 8);
    g.bench_function("send_8B", |b| b.iter(|| w.batch(SendOp::Send, 8, BATCH)));
    // Both sides use the same addresses and keys (their regions are registered alike).
    let mut w = Wire::new(PathMtu::Mtu1024, 8);
    w.a.set_peer_acks_unasked(true);
    w.b.set_peer_acks_unasked(true);
    let wr = SendWr::new(
        0,
        SendOp::Write,
        vec![Sge {
            addr: 0x1000,
            length: 8,
            lkey: w.src_lkey,
        }],
    )
    .remote(0x1000, w.dst_rkey);
    g.throughput(Throughput::Elements(1));
    g.bench_function("write_8B_pingpong_round", |b| {
        b.iter(|| w.write_pingpong(&wr))
    });
    let mut w = Wire::new(PathMtu::Mtu4096, 64 * 1024);
    g.throughput(Throughput::Elements(16));
    g.bench_function("write_64KiB_mtu4096", |b| {
        b.iter(|| w.batch(SendOp::Write, 64 * 1024, 16))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
