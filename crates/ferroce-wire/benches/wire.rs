//! Parse + ICRC verify and emit + ICRC compute of RDMA WRITE packets, beside plain CRC-32 over
//! the same bytes (the floor: the ICRC cannot be cheaper than one CRC pass). For a packet sent
//! with an IPv4 Identification the receiver does not see (as rxe sends them): the ICRC check
//! that solves for it (`icrc_solve`) beside a plain check with the right Identification known
//! (`icrc_verify`); the difference is the cost of the solving.
//!
//! `cargo bench -p ferroce-wire` prints time per packet and bytes per second for each.

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use ferroce_wire::bth::BthRepr;
use ferroce_wire::frame::UdpFrameHeaders;
use ferroce_wire::reth::RethRepr;
use ferroce_wire::{icrc, ExtHeaders, Opcode, PacketRepr, Psn, RocePacket};

fn write_first(payload_len: usize) -> PacketRepr {
    let bth = BthRepr {
        opcode: Opcode::RC_RDMA_WRITE_FIRST,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: 0xffff,
        fecn: false,
        becn: false,
        dest_qpn: 0x16,
        ack_req: false,
        psn: Psn::new(1_540_294),
    };
    let ext = ExtHeaders {
        reth: Some(RethRepr {
            va: 0x55de_8a35_d000,
            rkey: 0x7cd,
            dma_len: 8192,
        }),
        ..Default::default()
    };
    PacketRepr::new(bth, ext, payload_len)
}

fn bench(c: &mut Criterion) {
    let hdrs = UdpFrameHeaders::roce(
        "192.168.77.11".parse().unwrap(),
        49_152,
        "192.168.77.10".parse().unwrap(),
    );
    let payload_byte = |i: usize| (i * 31 + 7) as u8;
    let mut group = c.benchmark_group("write_packet");
    for size in [1024usize, 4096] {
        let repr = write_first(size);
        let len = repr.buffer_len().unwrap();
        let ip_udp = hdrs.ip_udp_headers(len).unwrap();
        let mut pkt = vec![0u8; len];
        repr.emit(&mut pkt).unwrap();
        for (i, b) in RocePacket::new_unchecked(&mut pkt[..])
            .payload_mut()
            .iter_mut()
            .enumerate()
        {
            *b = payload_byte(i);
        }
        let crc = icrc::compute(
            ip_udp.ip(),
            ip_udp.udp(),
            RocePacket::new_unchecked(&pkt[..]).covered(),
        )
        .unwrap();
        RocePacket::new_unchecked(&mut pkt[..]).set_icrc(crc);
        group.throughput(Throughput::Bytes(len as u64));

        group.bench_with_input(BenchmarkId::new("parse+verify", size), &pkt, |b, pkt| {
            b.iter(|| {
                let view = RocePacket::new_checked(black_box(&pkt[..])).unwrap();
                let repr = PacketRepr::parse(&view).unwrap();
                let ok =
                    icrc::verify(ip_udp.ip(), ip_udp.udp(), view.covered(), view.icrc()).unwrap();
                assert!(ok);
                black_box(repr)
            })
        });

        let payload: Vec<u8> = (0..size).map(payload_byte).collect();
        let mut out = vec![0u8; len];
        group.bench_with_input(BenchmarkId::new("emit+compute", size), &repr, |b, repr| {
            b.iter(|| {
                let n = repr.emit(black_box(&mut out)).unwrap();
                let mut p = RocePacket::new_unchecked(&mut out[..n]);
                p.payload_mut().copy_from_slice(&payload);
                let crc = icrc::compute(ip_udp.ip(), ip_udp.udp(), p.covered()).unwrap();
                p.set_icrc(crc);
                black_box(n)
            })
        });

        group.bench_with_input(BenchmarkId::new("crc32_floor", size), &pkt, |b, pkt| {
            b.iter(|| black_box(crc32fast::hash(black_box(&pkt[..]))))
        });

        // The same packet as rxe would send it, with a per-packet Identification; the receiver
        // assumes 0.
        let sent_id = 0x9c41;
        let sent = UdpFrameHeaders {
            ident: sent_id,
            ..hdrs
        }
        .ip_udp_headers(len)
        .unwrap();
        let mut rxe_pkt = pkt.clone();
        let crc = icrc::compute(
            sent.ip(),
            sent.udp(),
            RocePacket::new_unchecked(&rxe_pkt[..]).covered(),
        )
        .unwrap();
        RocePacket::new_unchecked(&mut rxe_pkt[..]).set_icrc(crc);
        let view = RocePacket::new_checked(&rxe_pkt[..]).unwrap();

        group.bench_with_input(BenchmarkId::new("icrc_verify", size), &view, |b, view| {
            b.iter(|| {
                let ok = icrc::verify(
                    black_box(sent.ip()),
                    sent.udp(),
                    black_box(view.covered()),
                    view.icrc(),
                )
                .unwrap();
                assert!(ok);
            })
        });

        group.bench_with_input(BenchmarkId::new("icrc_solve", size), &view, |b, view| {
            b.iter(|| {
                let id = icrc::solve_ipv4_identification(
                    black_box(ip_udp.ip()),
                    ip_udp.udp(),
                    black_box(view.covered()),
                    view.icrc(),
                )
                .unwrap();
                assert_eq!(id, Some(sent_id));
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
