//! Two nodes and one connected QP pair: the harness most transport tests start from (after
//! quinn-proto's `Pair`).

use core::time::Duration;

use ferroce_wire::Psn;

use super::{NetConfig, Sim};
use crate::attr::{InitAttr, PathMtu, QpCaps, RtrAttr, RtsAttr};
use crate::completion::WorkCompletion;
use crate::memory::{Access, Memory, Sge};
use crate::qp::QueuePair;
use crate::time::Instant;
use crate::wr::{RecvWr, SendWr};
use crate::{PostError, QpState};

/// A registered region in a [`Pair`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    /// Node the region lives on.
    pub node: usize,
    /// Index in the node's memory.
    pub index: usize,
    /// Virtual address of its first byte.
    pub base: u64,
    /// Length.
    pub len: usize,
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
}

impl Region {
    /// An SGE over `len` bytes from `offset`.
    pub fn sge(&self, offset: usize, len: usize) -> Sge {
        Sge {
            addr: self.base + offset as u64,
            length: len as u32,
            lkey: self.lkey,
        }
    }
    /// The address of byte `offset`.
    pub fn addr(&self, offset: usize) -> u64 {
        self.base + offset as u64
    }
}

/// Node A (index 0) and node B (index 1), with QP `qpn[0]` on A connected to `qpn[1]` on B.
#[derive(Debug)]
pub struct Pair {
    /// The simulator.
    pub sim: Sim,
    /// QP numbers on A and B.
    pub qpn: [u32; 2],
    next_base: [u64; 2],
}

/// Default attributes: ACK timeout 4.2 ms, 7 retries, infinite RNR retries, 4 READ/atomics.
pub fn default_rts() -> RtsAttr {
    RtsAttr {
        sq_psn: Psn::new(0),
        timeout: 10,
        retry_cnt: 7,
        rnr_retry: 7,
        max_rd_atomic: 4,
    }
}

/// Default receive attributes towards QP `peer` at the loopback GID, expecting PSN `rq_psn`
/// first: MTU 1024, 4 READ/atomic resources for the peer, the shortest RNR NAK timer.
pub fn default_rtr(peer: u32, rq_psn: Psn) -> RtrAttr {
    RtrAttr {
        path_mtu: PathMtu::Mtu1024,
        dest_qpn: peer,
        dest_gid: std::net::Ipv6Addr::LOCALHOST,
        rq_psn,
        max_dest_rd_atomic: 4,
        min_rnr_timer: 1,
    }
}

/// Every packet `q` has to send at `now`, in order (for tests that carry packets by hand).
pub fn transmit_all(q: &mut QueuePair, now: Instant, mem: &mut dyn Memory) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 4096 + crate::qp::MAX_HEADER_LEN];
    while let Some(n) = q.poll_transmit(now, mem, &mut buf) {
        out.push(buf[..n].to_vec());
    }
    out
}

/// A new QP `qpn` in protection domain 1, taken through INIT and `rtr` to RTS with `rts`.
pub fn connected_qp(qpn: u32, caps: QpCaps, rtr: &RtrAttr, rts: &RtsAttr) -> QueuePair {
    let mut qp = QueuePair::new(qpn, 1, caps);
    qp.modify_to_init(&InitAttr::default())
        .expect("RESET->INIT");
    qp.modify_to_rtr(rtr).expect("INIT->RTR");
    qp.modify_to_rts(rts).expect("RTR->RTS");
    qp
}

impl Pair {
    /// A connected pair over `net` with the given path MTU, RTS attributes and first PSNs.
    pub fn new(
        seed: u64,
        net: NetConfig,
        mtu: PathMtu,
        rts: RtsAttr,
        psn_a: u32,
        psn_b: u32,
    ) -> Pair {
        let mut sim = Sim::new(seed, net);
        let a = sim.add_node();
        let b = sim.add_node();
        let (qa, qb) = super::scenario::connect_pair(
            &mut sim,
            a,
            b,
            mtu,
            rts,
            Psn::new(psn_a),
            Psn::new(psn_b),
        );
        Pair {
            sim,
            qpn: [qa, qb],
            next_base: [0x1_0000_0000, 0x1_0000_0000],
        }
    }

    /// A pair on a perfect network with 5 µs latency, MTU 1024 and default attributes.
    pub fn lossless() -> Pair {
        Pair::new(
            1,
            NetConfig::perfect(Duration::from_micros(5)),
            PathMtu::Mtu1024,
            default_rts(),
            100,
            5000,
        )
    }

    /// Registers `len` bytes on `node` with `access`.
    pub fn register(&mut self, node: usize, len: usize, access: Access) -> Region {
        let base = self.next_base[node];
        self.next_base[node] += (len as u64 + 0x1_0000) & !0xfff;
        let index = self.sim.nodes[node].mem.register(1, base, len, access);
        let r = self.sim.nodes[node].mem.region(index);
        Region {
            node,
            index,
            base,
            len,
            lkey: r.lkey,
            rkey: r.rkey,
        }
    }

    /// The bytes of a region.
    pub fn bytes(&self, r: Region) -> &[u8] {
        &self.sim.nodes[r.node].mem.region(r.index).bytes
    }

    /// The bytes of a region, writable (as the application's CPU).
    pub fn bytes_mut(&mut self, r: Region) -> &mut [u8] {
        &mut self.sim.nodes[r.node].mem.region_mut(r.index).bytes
    }

    /// The QP on `node`.
    pub fn qp(&mut self, node: usize) -> &mut QueuePair {
        let qpn = self.qpn[node];
        self.sim.nodes[node]
            .qps
            .get_mut(&qpn)
            .expect("the pair's QP")
    }

    /// The state of the QP on `node`.
    pub fn state(&mut self, node: usize) -> QpState {
        self.qp(node).state()
    }

    /// Posts a send request on `node`'s QP.
    pub fn post_send(&mut self, node: usize, wr: SendWr) -> Result<(), PostError> {
        self.qp(node).post_send(wr)
    }

    /// Posts a receive request on `node`'s QP.
    pub fn post_recv(&mut self, node: usize, wr_id: u64, sgl: Vec<Sge>) -> Result<(), PostError> {
        self.qp(node).post_recv(RecvWr { wr_id, sgl })
    }

    /// Runs until the network is idle or `limit` of virtual time has passed; returns whether it
    /// went idle.
    pub fn run(&mut self, limit: Duration) -> bool {
        let deadline = self.sim.now + limit;
        self.sim.run_until_idle(deadline)
    }

    /// Runs until `node` has `n` completions (or `limit` passes); returns them all, taken.
    pub fn wait_completions(
        &mut self,
        node: usize,
        n: usize,
        limit: Duration,
    ) -> Vec<WorkCompletion> {
        let deadline = self.sim.now + limit;
        self.sim
            .run_while(deadline, |s| s.nodes[node].completions.len() < n);
        std::mem::take(&mut self.sim.nodes[node].completions)
    }

    /// Completions of `node` so far, taken.
    pub fn take_completions(&mut self, node: usize) -> Vec<WorkCompletion> {
        std::mem::take(&mut self.sim.nodes[node].completions)
    }

    /// Virtual time now.
    pub fn now(&self) -> Instant {
        self.sim.now
    }
}
