//! A seeded, deterministic network of RoCE endpoints in virtual time.
//!
//! [`Sim`] holds [`Node`]s (an IP address, a [`VecMemory`], queue pairs) joined by a network that
//! drops, reorders, duplicates, corrupts and delays datagrams, and can cut a link for a while.
//! Every datagram carries a real ICRC computed over the IP/UDP headers it would have, so a
//! corrupted one is caught exactly as a receiver on the wire catches it. Time advances from event
//! to event, so seconds of protocol time pass in microseconds, and the same seed replays the same
//! run bit for bit.
//!
//! [`scenario`] builds random workloads on top and checks the transport's promises against a
//! model.
//!
//! [`Link`]s add bottlenecks: a FIFO with a rate, a queue limit and ECN marking, shared by every
//! datagram that crosses it ([`Sim::add_link`]). A datagram meets the random fates first (as
//! `nftables` drops come before the qdisc on the test bed), then its link. [`bottleneck`] runs
//! many flows through one such link and reports goodput, fairness and queue delay. Without links
//! the simulator behaves exactly as it did before they existed, so old seeds replay unchanged.

pub mod bottleneck;
pub mod link;
pub mod pair;
pub mod rng;
pub mod scenario;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use core::time::Duration;
use ferroce_wire::frame::UdpFrameHeaders;
use ferroce_wire::{icrc, Opcode, PacketRepr, RocePacket};

use crate::completion::WorkCompletion;
use crate::memory::VecMemory;
use crate::qp::{QueuePair, MAX_HEADER_LEN};
use crate::time::Instant;
pub use link::{Link, LinkConfig, LinkStats, LinkVerdict, QueueDelay};
pub use rng::Rng;

/// What the network does to datagrams. Probabilities are per datagram.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NetConfig {
    /// Probability a datagram is lost.
    pub loss: f64,
    /// Probability a datagram is held back by up to `reorder_window` extra delay.
    pub reorder: f64,
    /// Probability a datagram is delivered twice.
    pub duplicate: f64,
    /// Probability one bit of a datagram is flipped.
    pub corrupt: f64,
    /// One-way delay of every datagram.
    pub latency: Duration,
    /// Largest extra delay of a reordered datagram.
    pub reorder_window: Duration,
}

impl NetConfig {
    /// A perfect network with the given latency.
    pub fn perfect(latency: Duration) -> NetConfig {
        NetConfig {
            loss: 0.0,
            reorder: 0.0,
            duplicate: 0.0,
            corrupt: 0.0,
            latency,
            reorder_window: latency * 4,
        }
    }
}

impl Default for NetConfig {
    fn default() -> NetConfig {
        NetConfig::perfect(Duration::from_micros(5))
    }
}

/// What happened to datagrams.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NetStats {
    /// Datagrams handed to the network.
    pub sent: u64,
    /// Lost at random.
    pub dropped: u64,
    /// Lost to a cut link.
    pub blackholed: u64,
    /// Delivered twice.
    pub duplicated: u64,
    /// Delivered with a flipped bit.
    pub corrupted: u64,
    /// Of those, flips in the BTH byte the ICRC leaves uncovered by design (FECN, BECN and
    /// reserved bits, which switches may rewrite): delivered, and harmless.
    pub corrupted_uncovered: u64,
    /// Delayed out of order.
    pub reordered: u64,
    /// Delivered.
    pub delivered: u64,
    /// Refused by the receiver for a bad ICRC.
    pub icrc_errors: u64,
    /// Delivered to a QP number nobody has.
    pub unknown_qp: u64,
    /// Tail-dropped by a full link queue (every link together; each [`Link`] counts its own).
    pub queue_drops: u64,
    /// Marked Congestion Experienced by a link.
    pub ce_marked: u64,
    /// Delivered with the Congestion Experienced mark.
    pub ce_delivered: u64,
}

/// What became of one datagram, for traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Sent and will arrive.
    Sent,
    /// Lost.
    Dropped,
    /// Lost to a cut link.
    Blackholed,
    /// Will arrive twice.
    Duplicated,
    /// Will arrive with a flipped bit.
    Corrupted,
    /// Will arrive late, possibly after later datagrams.
    Reordered,
}

/// One line of a trace.
#[derive(Debug, Clone, PartialEq)]
pub enum TraceEvent {
    /// A packet left `from` for `to`.
    Packet {
        /// When.
        at: Instant,
        /// Sending node.
        from: usize,
        /// Receiving node.
        to: usize,
        /// Opcode.
        opcode: Opcode,
        /// PSN.
        psn: u32,
        /// A short description of the extension headers (AETH syndrome, MSN).
        detail: String,
        /// What the network did with it.
        fate: Fate,
    },
    /// A corrupted packet was refused on arrival.
    IcrcDrop {
        /// When.
        at: Instant,
        /// Receiving node.
        node: usize,
    },
    /// A completion was produced.
    Completion {
        /// When.
        at: Instant,
        /// Node.
        node: usize,
        /// The completion.
        wc: WorkCompletion,
    },
}

/// One endpoint: an address, its memory and its queue pairs.
#[derive(Debug)]
pub struct Node {
    /// IPv4 address.
    pub ip: Ipv4Addr,
    /// Registered memory.
    pub mem: VecMemory,
    /// Queue pairs by number.
    pub qps: BTreeMap<u32, QueuePair>,
    /// Completions produced, in order.
    pub completions: Vec<WorkCompletion>,
}

impl Node {
    /// The node's GID (IPv4-mapped IPv6).
    pub fn gid(&self) -> Ipv6Addr {
        self.ip.to_ipv6_mapped()
    }
}

#[derive(Debug)]
struct Datagram {
    from: usize,
    to: usize,
    src_port: u16,
    bytes: Vec<u8>,
    /// ECN-capable transport: the IP header's ECN field is ECT(0), so a link may mark it.
    ect: bool,
    /// Marked Congestion Experienced on the way.
    ce: bool,
}

/// Where a [`Link`] sits: which datagrams cross it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum LinkAt {
    /// Datagrams from node `from` to node `to`.
    Between {
        /// Sending node.
        from: usize,
        /// Receiving node.
        to: usize,
    },
    /// Every datagram into the node that no [`LinkAt::Between`] link takes: the port an incast
    /// converges on.
    Into(usize),
}

/// The UDP source port of a QP: RoCE v2 spreads QPs over source ports for ECMP entropy.
pub fn udp_src_port(qpn: u32) -> u16 {
    0xc000 | ((qpn ^ (qpn >> 14)) & 0x3fff) as u16
}

/// A simulated network of nodes.
#[derive(Debug)]
pub struct Sim {
    /// Virtual time.
    pub now: Instant,
    /// The nodes.
    pub nodes: Vec<Node>,
    /// The network's behaviour; may be changed between steps.
    pub net: NetConfig,
    /// Counters of the network.
    pub stats: NetStats,
    /// When set, every packet and completion is recorded.
    pub trace: Option<Vec<TraceEvent>>,
    rng: Rng,
    queue: BinaryHeap<Reverse<(Instant, u64)>>,
    in_flight: BTreeMap<u64, Datagram>,
    seq: u64,
    /// Cut links: (from, to) → until.
    cuts: BTreeMap<(usize, usize), Instant>,
    buf: Vec<u8>,
    /// Bottlenecks. While empty, the simulator runs exactly as before links existed.
    links: BTreeMap<LinkAt, Link>,
    /// Nodes whose every QP sends ECT datagrams.
    ect_nodes: BTreeSet<usize>,
    /// Single QPs (node, QPN) that send ECT datagrams.
    ect_qps: BTreeSet<(usize, u32)>,
    /// The round-robin pump's list of QPs, kept to reuse its allocation.
    rr: Vec<(usize, u32)>,
}

impl Sim {
    /// An empty network with the given seed.
    pub fn new(seed: u64, net: NetConfig) -> Sim {
        Sim {
            now: Instant::ZERO,
            nodes: Vec::new(),
            net,
            stats: NetStats::default(),
            trace: None,
            rng: Rng::new(seed),
            queue: BinaryHeap::new(),
            in_flight: BTreeMap::new(),
            seq: 0,
            cuts: BTreeMap::new(),
            buf: vec![0; 4096 + MAX_HEADER_LEN],
            links: BTreeMap::new(),
            ect_nodes: BTreeSet::new(),
            ect_qps: BTreeSet::new(),
            rr: Vec::new(),
        }
    }

    /// Adds a node with address 10.0.0.(n+1); returns its index.
    pub fn add_node(&mut self) -> usize {
        let i = self.nodes.len();
        self.nodes.push(Node {
            ip: Ipv4Addr::new(10, 0, 0, (i + 1) as u8),
            mem: VecMemory::new(),
            qps: BTreeMap::new(),
            completions: Vec::new(),
        });
        i
    }

    /// Drops every datagram from `from` to `to` until `until`.
    pub fn cut_link(&mut self, from: usize, to: usize, until: Instant) {
        self.cuts.insert((from, to), until);
    }

    /// Puts a bottleneck link at `at` (replacing one already there). Datagrams sent from now on
    /// that cross it queue there; from then on [`Sim::step`] also lets QPs transmit in turns,
    /// one packet each, so that no QP's place in the node list decides its share of the queue.
    pub fn add_link(&mut self, at: LinkAt, cfg: LinkConfig) {
        self.links.insert(at, Link::new(cfg));
    }

    /// The link at `at`, if any.
    pub fn link(&self, at: LinkAt) -> Option<&Link> {
        self.links.get(&at)
    }

    /// Every link, in [`LinkAt`] order.
    pub fn links(&self) -> impl Iterator<Item = (LinkAt, &Link)> {
        self.links.iter().map(|(&at, l)| (at, l))
    }

    /// Checks every link's invariants ([`Link::check`]); the error names the link.
    pub fn check_links(&self) -> Result<(), String> {
        for (at, l) in &self.links {
            l.check().map_err(|e| format!("link {at:?}: {e}"))?;
        }
        Ok(())
    }

    /// Makes the datagrams of `node`'s QPs ECN-capable (ECT), or only those of QP `qpn` there.
    /// A stand-in until a QP says itself whether it speaks ECN.
    pub fn set_ect(&mut self, node: usize, qpn: Option<u32>, on: bool) {
        match (qpn, on) {
            (None, true) => self.ect_nodes.insert(node),
            (None, false) => self.ect_nodes.remove(&node),
            (Some(q), true) => self.ect_qps.insert((node, q)),
            (Some(q), false) => self.ect_qps.remove(&(node, q)),
        };
    }

    /// Whether QP `qpn` on `node` sends ECT datagrams.
    // Whether a QP's datagrams leave ECN-capable is its provider's choice (the UDP provider's
    // `ContextOptions::ecn`), not the transport's: here a per-node or per-QP setting.
    fn ect(&self, node: usize, qpn: u32) -> bool {
        self.ect_nodes.contains(&node) || self.ect_qps.contains(&(node, qpn))
    }

    /// The link a datagram from `from` to `to` crosses: a directed one first, else the one
    /// into `to`.
    fn link_for(&mut self, from: usize, to: usize) -> Option<&mut Link> {
        if self.links.is_empty() {
            return None;
        }
        let at = if self.links.contains_key(&LinkAt::Between { from, to }) {
            LinkAt::Between { from, to }
        } else {
            LinkAt::Into(to)
        };
        self.links.get_mut(&at)
    }

    fn node_by_gid(&self, gid: Ipv6Addr) -> Option<usize> {
        let v4 = gid.to_ipv4_mapped()?;
        self.nodes.iter().position(|n| n.ip == v4)
    }

    fn headers(&self, from: usize, to: usize, src_port: u16) -> UdpFrameHeaders {
        UdpFrameHeaders::roce(
            IpAddr::V4(self.nodes[from].ip),
            src_port,
            IpAddr::V4(self.nodes[to].ip),
        )
    }

    /// Lets every QP transmit everything it has, and collects completions.
    fn pump(&mut self) {
        if self.links.is_empty() {
            self.pump_in_node_order();
        } else {
            self.pump_round_robin();
        }
    }

    /// Node by node, each QP until it has nothing left: the order every seed from before links
    /// depends on.
    fn pump_in_node_order(&mut self) {
        for from in 0..self.nodes.len() {
            let qpns: Vec<u32> = self.nodes[from].qps.keys().copied().collect();
            for qpn in qpns {
                while self.transmit_one(from, qpn) {}
            }
            self.collect_completions(from);
        }
    }

    /// One packet from each QP in turn until none has any: with a shared queue, draining one
    /// QP first would hand it the queue's room before the others arrive.
    fn pump_round_robin(&mut self) {
        let mut turn = std::mem::take(&mut self.rr);
        turn.clear();
        for (i, n) in self.nodes.iter().enumerate() {
            turn.extend(n.qps.keys().map(|&q| (i, q)));
        }
        while !turn.is_empty() {
            // A QP that has nothing now has nothing until time moves or a packet arrives.
            turn.retain(|&(from, qpn)| self.transmit_one(from, qpn));
        }
        self.rr = turn;
        for node in 0..self.nodes.len() {
            self.collect_completions(node);
        }
    }

    /// Lets QP `qpn` on `from` transmit one packet; returns whether it had one.
    fn transmit_one(&mut self, from: usize, qpn: u32) -> bool {
        let node = &mut self.nodes[from];
        let Some(qp) = node.qps.get_mut(&qpn) else {
            return false;
        };
        let Some(n) = qp.poll_transmit(self.now, &mut node.mem, &mut self.buf) else {
            return false;
        };
        let gid = qp.dest_gid();
        let Some(to) = self.node_by_gid(gid) else {
            return true;
        };
        let mut bytes = self.buf[..n].to_vec();
        let src_port = udp_src_port(qpn);
        let h = self
            .headers(from, to, src_port)
            .ip_udp_headers(n)
            .expect("packet fits UDP");
        let crc = icrc::compute(h.ip(), h.udp(), &bytes[..n - 4]).expect("valid headers");
        RocePacket::new_unchecked(&mut bytes[..]).set_icrc(crc);
        let ect = self.ect(from, qpn);
        self.send(Datagram {
            from,
            to,
            src_port,
            bytes,
            ect,
            ce: false,
        });
        true
    }

    fn collect_completions(&mut self, node: usize) {
        let n = &mut self.nodes[node];
        for qp in n.qps.values_mut() {
            while let Some(wc) = qp.poll_completion() {
                if let Some(t) = self.trace.as_mut() {
                    t.push(TraceEvent::Completion {
                        at: self.now,
                        node,
                        wc,
                    });
                }
                n.completions.push(wc);
            }
        }
    }

    fn schedule(&mut self, delay: Duration, d: Datagram) {
        self.schedule_at(self.now + delay, d);
    }

    fn schedule_at(&mut self, at: Instant, d: Datagram) {
        self.seq += 1;
        self.queue.push(Reverse((at, self.seq)));
        self.in_flight.insert(self.seq, d);
    }

    /// Sends `d` on its way: across its link if it has one (queued there, then `extra` late
    /// after the link's latency), else after `latency + extra`. Returns a note for the trace
    /// when a link dropped or marked it.
    fn forward(&mut self, mut d: Datagram, latency: Duration, extra: Duration) -> &'static str {
        let now = self.now;
        let (len, ect) = (d.bytes.len(), d.ect);
        let Some(link) = self.link_for(d.from, d.to) else {
            self.schedule(latency + extra, d);
            return "";
        };
        let after = link.config().latency + extra;
        match link.enqueue(now, len, ect) {
            LinkVerdict::TailDropped => {
                self.stats.queue_drops += 1;
                "link:queue-drop"
            }
            LinkVerdict::Queued { departs, ce } => {
                self.stats.ce_marked += u64::from(ce);
                d.ce |= ce;
                self.schedule_at(departs + after, d);
                if ce {
                    "link:CE"
                } else {
                    ""
                }
            }
        }
    }

    fn send(&mut self, mut d: Datagram) {
        self.stats.sent += 1;
        let net = self.net;
        let cut = self
            .cuts
            .get(&(d.from, d.to))
            .is_some_and(|&until| self.now < until);
        let fate = if cut {
            self.stats.blackholed += 1;
            Fate::Blackholed
        } else if self.rng.chance(net.loss) {
            self.stats.dropped += 1;
            Fate::Dropped
        } else if self.rng.chance(net.duplicate) {
            self.stats.duplicated += 1;
            Fate::Duplicated
        } else if self.rng.chance(net.corrupt) {
            self.stats.corrupted += 1;
            let bit = self.rng.below(d.bytes.len() as u64 * 8);
            d.bytes[(bit / 8) as usize] ^= 1 << (bit % 8);
            if bit / 8 == 4 {
                self.stats.corrupted_uncovered += 1;
            }
            Fate::Corrupted
        } else if self.rng.chance(net.reorder) {
            self.stats.reordered += 1;
            Fate::Reordered
        } else {
            Fate::Sent
        };
        // Without links, nothing below draws from the RNG or records differently than it did
        // before links existed: the trace line only moved after the scheduling.
        let described = self.trace.is_some().then(|| describe(&d.bytes));
        let (from, to) = (d.from, d.to);
        let note = match fate {
            Fate::Dropped | Fate::Blackholed => "",
            Fate::Duplicated => {
                let copy = Datagram {
                    from: d.from,
                    to: d.to,
                    src_port: d.src_port,
                    bytes: d.bytes.clone(),
                    ect: d.ect,
                    ce: false,
                };
                let extra = self.jitter();
                let copy_note = self.forward(copy, net.latency, extra);
                let note = self.forward(d, net.latency, Duration::ZERO);
                match (note, copy_note) {
                    (n, "") => n,
                    ("", "link:queue-drop") => "copy link:queue-drop",
                    ("", _) => "copy link:CE",
                    (n, _) => n,
                }
            }
            Fate::Reordered => {
                let extra = self.jitter();
                self.forward(d, net.latency, extra)
            }
            Fate::Sent | Fate::Corrupted => self.forward(d, net.latency, Duration::ZERO),
        };
        if let (Some(t), Some((opcode, psn, mut detail))) = (self.trace.as_mut(), described) {
            if !note.is_empty() {
                if !detail.is_empty() {
                    detail.push(' ');
                }
                detail.push_str(note);
            }
            t.push(TraceEvent::Packet {
                at: self.now,
                from,
                to,
                opcode,
                psn,
                detail,
                fate,
            });
        }
    }

    fn jitter(&mut self) -> Duration {
        let w = self.net.reorder_window.as_nanos() as u64;
        Duration::from_nanos(self.rng.below(w.max(1)))
    }

    fn deliver(&mut self, d: Datagram) {
        let len = d.bytes.len();
        let h = self
            .headers(d.from, d.to, d.src_port)
            .ip_udp_headers(len)
            .expect("fits");
        let ok = match RocePacket::new_checked(&d.bytes[..]) {
            Ok(p) => icrc::verify(h.ip(), h.udp(), p.covered(), p.icrc()).unwrap_or(false),
            Err(_) => false,
        };
        if !ok {
            self.stats.icrc_errors += 1;
            if let Some(t) = self.trace.as_mut() {
                t.push(TraceEvent::IcrcDrop {
                    at: self.now,
                    node: d.to,
                });
            }
            return;
        }
        let qpn = RocePacket::new_unchecked(&d.bytes[..]).bth().dest_qpn();
        let node = &mut self.nodes[d.to];
        match node.qps.get_mut(&qpn) {
            Some(qp) => {
                self.stats.delivered += 1;
                self.stats.ce_delivered += u64::from(d.ce);
                // The one place a packet reaches a QP, with the mark a link may have set.
                // A packet that passed its ICRC but does not parse is counted by the QP's drop.
                let _ = qp.handle_packet_ecn(self.now, &mut node.mem, &d.bytes, d.ce);
            }
            None => self.stats.unknown_qp += 1,
        }
    }

    /// The next time anything happens: a delivery or a QP timer.
    pub fn next_event(&self) -> Option<Instant> {
        let net = self.queue.peek().map(|Reverse((t, _))| *t);
        let timers = self
            .nodes
            .iter()
            .flat_map(|n| n.qps.values())
            .filter_map(QueuePair::next_timeout)
            .min();
        match (net, timers) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Transmits what is ready, then advances to the next event and handles it. Returns `false`
    /// when nothing is left to happen.
    pub fn step(&mut self) -> bool {
        self.step_to(None)
    }

    /// Like [`Sim::step`], but time stops at `limit` when nothing happens before it: for a
    /// driver that has work of its own to do then (post requests at a given time). A `limit`
    /// not after now is no limit. Returns `false` when nothing is left to happen and `limit`
    /// has been reached.
    pub fn step_until(&mut self, limit: Instant) -> bool {
        self.step_to(Some(limit))
    }

    fn step_to(&mut self, limit: Option<Instant>) -> bool {
        self.pump();
        let limit = limit.filter(|&l| l > self.now);
        let t = match (self.next_event(), limit) {
            (None, None) => return false,
            (Some(t), None) => t,
            (None, Some(l)) => l,
            (Some(t), Some(l)) => t.min(l),
        };
        self.now = self.now.max(t);
        let now = self.now;
        for link in self.links.values_mut() {
            link.advance(now);
        }
        while let Some(Reverse((at, seq))) = self.queue.peek().copied() {
            if at > self.now {
                break;
            }
            self.queue.pop();
            if let Some(d) = self.in_flight.remove(&seq) {
                self.deliver(d);
            }
        }
        for node in &mut self.nodes {
            for qp in node.qps.values_mut() {
                if qp.next_timeout().is_some_and(|t| t <= now) {
                    qp.handle_timeout(now);
                }
            }
        }
        self.pump();
        true
    }

    /// Steps until nothing is left to happen or `deadline` (virtual time) passes. Returns
    /// `true` if the network went idle.
    pub fn run_until_idle(&mut self, deadline: Instant) -> bool {
        while self.now <= deadline {
            if !self.step() {
                return true;
            }
        }
        false
    }

    /// Steps while `busy` holds, up to `deadline`. Returns `true` if `busy` became false.
    pub fn run_while(&mut self, deadline: Instant, mut busy: impl FnMut(&Sim) -> bool) -> bool {
        while busy(self) {
            if self.now > deadline || !self.step() {
                return !busy(self);
            }
        }
        true
    }
}

/// Opcode, PSN and a short description of a packet's answer headers, for traces.
fn describe(bytes: &[u8]) -> (Opcode, u32, String) {
    let Ok(p) = RocePacket::new_checked(bytes) else {
        return (Opcode(0xff), 0, "malformed".into());
    };
    let Ok(r) = PacketRepr::parse(&p) else {
        return (Opcode(0xff), 0, "malformed".into());
    };
    let mut detail = String::new();
    if let Some(a) = r.ext.aeth {
        detail = format!("{} msn={}", a.syndrome, a.msn);
    }
    if r.payload_len > 0 {
        if !detail.is_empty() {
            detail.push(' ');
        }
        detail.push_str(&format!("{}B", r.payload_len));
    }
    (r.bth.opcode, r.bth.psn.value(), detail)
}

/// An acknowledgement (ACK or NAK) for `dest_qpn`, built by hand as a responder would send it
/// (BTH + AETH, no ICRC): for tests that feed one QP the answers of a peer they script.
pub fn ack_packet(
    dest_qpn: u32,
    psn: ferroce_wire::Psn,
    syndrome: ferroce_wire::aeth::Syndrome,
) -> Vec<u8> {
    response_packet(Opcode::RC_ACKNOWLEDGE, dest_qpn, psn, syndrome, &[])
}

/// A SACK (see [`crate::sack`]) to `dest_qpn`: `psn` the last PSN received in order, then
/// `bitmap` as it stands (of any length, as a peer that lies may send it); ICRC left zero.
pub fn sack_packet(dest_qpn: u32, psn: ferroce_wire::Psn, bitmap: &[u8]) -> Vec<u8> {
    let ack = ferroce_wire::aeth::Syndrome::Ack {
        credits: ferroce_wire::aeth::CREDITS_INVALID,
    };
    response_packet(Opcode::FERROCE_SACK, dest_qpn, psn, ack, bitmap)
}

/// An `opcode` packet with an AETH of `syndrome` (MSN 0) and `payload`, in the default
/// partition; ICRC left zero.
fn response_packet(
    opcode: Opcode,
    dest_qpn: u32,
    psn: ferroce_wire::Psn,
    syndrome: ferroce_wire::aeth::Syndrome,
    payload: &[u8],
) -> Vec<u8> {
    let bth = ferroce_wire::bth::BthRepr {
        opcode,
        solicited: false,
        migreq: false,
        pad_count: 0,
        pkey: 0xffff,
        fecn: false,
        becn: false,
        dest_qpn,
        ack_req: false,
        psn,
    };
    let ext = ferroce_wire::ExtHeaders {
        aeth: Some(ferroce_wire::aeth::AethRepr { syndrome, msn: 0 }),
        ..Default::default()
    };
    let repr = PacketRepr::new(bth, ext, payload.len());
    let mut buf = vec![0u8; repr.buffer_len().unwrap_or(0)];
    // The headers always fit the buffer sized for them, and the payload follows them.
    if repr.emit(&mut buf).is_ok() {
        if let Ok(start) = repr.header_len() {
            buf[start..start + payload.len()].copy_from_slice(payload);
        }
    }
    buf
}
