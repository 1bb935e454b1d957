//! Seeded runs of a host queue against a target queue, with the fabric in between: random
//! reads and writes of 1 to 8 blocks at up to 16 in flight, the target's RDMA READs of write
//! data answered in random order (as a network would), every read checked byte for byte
//! against a model of the namespace, and every command answered exactly once.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use ferroce_nvmf::command::{io, Command};
use ferroce_nvmf::completion::Status;
use ferroce_nvmf::controllers::{Subsystem, Target, TargetConfig};
use ferroce_nvmf::fabrics::{Connect, ConnectData, Property, CNTLID_DYNAMIC};
use ferroce_nvmf::host::HostQueue;
use ferroce_nvmf::namespace::{MemoryBacking, Namespace};
use ferroce_nvmf::queue::{Action, TargetQueue};
use ferroce_nvmf::sgl::Sgl;

const NQN: &str = "nqn.2026-11.io.ferroce:sim";
const BLOCK: usize = 512;
const BLOCKS: u64 = 256;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// What the host remembers of a command in flight.
struct Op {
    write: bool,
    slba: u64,
    blocks: u64,
    key: u32,
}

fn target() -> Target {
    Target::new(
        TargetConfig {
            max_queue_entries: 64,
            max_io_queues: 1,
            in_capsule_data: 4096,
            mdts: 5,
            listen: ("10.0.0.1".into(), "4420".into(), false),
        },
        vec![Subsystem {
            nqn: NQN.into(),
            serial: "sim".into(),
            namespaces: [(
                1,
                Arc::new(Namespace {
                    nsid: 1,
                    block_shift: 9,
                    backing: Box::new(MemoryBacking::new(BLOCKS as usize * BLOCK)),
                    nguid: [0; 16],
                }),
            )]
            .into_iter()
            .collect(),
        }],
    )
}

/// Connects an admin queue (enabled) and one I/O queue; returns the I/O queue's two ends.
fn connect(t: &mut Target) -> (HostQueue<Option<Op>>, TargetQueue) {
    let now = Instant::now();
    let data = |cntlid| {
        ConnectData {
            host_id: [5; 16],
            cntlid,
            subnqn: NQN.into(),
            hostnqn: "nqn.sim-host".into(),
        }
        .encode()
        .unwrap()
    };
    let conn = |qid| {
        Connect {
            recfmt: 0,
            qid,
            sqsize: 31,
            cattr: 0,
            kato: 0,
        }
        .command(
            0,
            Sgl::InCapsule {
                offset: 0,
                len: 1024,
            },
        )
        .unwrap()
    };
    let answer = |actions: Vec<Action>| -> [u8; 16] {
        match actions.as_slice() {
            [Action::Send { cqe, .. }] => *cqe,
            other => panic!("{other:?}"),
        }
    };
    let mut host_admin: HostQueue<Option<Op>> = HostQueue::new(0, 32);
    let mut admin = TargetQueue::new(32, 4096);
    let (_, cap) = host_admin
        .submit(conn(0), &data(CNTLID_DYNAMIC), None)
        .unwrap();
    let (c, _) = host_admin
        .on_response(&answer(admin.on_capsule(now, t, &cap)))
        .unwrap();
    assert!(c.status.is_success());
    let cntlid = c.result as u16;
    let cc = Property {
        offset: 0x14,
        eight_bytes: false,
        value: 4 << 20 | 6 << 16 | 1,
    }
    .command(0, true)
    .unwrap();
    let (_, cap) = host_admin.submit(cc, &[], None).unwrap();
    let (c, _) = host_admin
        .on_response(&answer(admin.on_capsule(now, t, &cap)))
        .unwrap();
    assert!(c.status.is_success());
    let mut host_io: HostQueue<Option<Op>> = HostQueue::new(1, 32);
    let mut tq = TargetQueue::new(32, 4096);
    let (_, cap) = host_io.submit(conn(1), &data(cntlid), None).unwrap();
    let (c, _) = host_io
        .on_response(&answer(tq.on_capsule(now, t, &cap)))
        .unwrap();
    assert!(c.status.is_success(), "{c:?}");
    (host_io, tq)
}

/// The host's side of a run: its queue, buffers and model, and what the network holds.
struct World {
    host: HostQueue<Option<Op>>,
    /// The namespace as the completed writes left it.
    model: Vec<u8>,
    /// The host's buffers, by key.
    buffers: HashMap<u32, Vec<u8>>,
    /// RDMA READs the target asked for and the network has not answered yet.
    reads: Vec<(u16, u32, u32)>,
    /// Blocks of the commands in flight, by key.
    inflight: HashMap<u32, (u64, u64)>,
    answered: u32,
    out_of_range: u32,
}

impl World {
    /// Does what the target asked: READs wait for the network, WRITEs land in the host's
    /// buffers, responses complete their commands (checked against the model).
    fn handle(&mut self, actions: Vec<Action>) {
        for a in actions {
            match a {
                Action::Read { tag, key, len, .. } => self.reads.push((tag, key, len)),
                Action::Write { key, data, addr } => {
                    self.buffers.get_mut(&key).expect("a live key")[addr as usize..][..data.len()]
                        .copy_from_slice(&data);
                }
                Action::Send { cqe, invalidate } => {
                    let (c, op) = self
                        .host
                        .on_response(&cqe)
                        .expect("a response to a command in flight");
                    let op = op.expect("an I/O command");
                    assert_eq!(invalidate.is_some(), invalidate == Some(op.key));
                    self.answered += 1;
                    self.inflight.remove(&op.key);
                    let end = op.slba + op.blocks;
                    if end > BLOCKS {
                        assert_eq!(c.status, Status::LBA_OUT_OF_RANGE);
                        self.out_of_range += 1;
                        continue;
                    }
                    assert!(c.status.is_success(), "{c:?}");
                    let range = op.slba as usize * BLOCK..end as usize * BLOCK;
                    let buf = self.buffers.remove(&op.key).unwrap();
                    if op.write {
                        self.model[range].copy_from_slice(&buf);
                    } else {
                        assert!(
                            buf == self.model[range],
                            "a read differs from what was written"
                        );
                    }
                }
                Action::Close => panic!("the queue ended"),
            }
        }
    }

    /// Whether `blocks` from `slba` overlap a command in flight.
    fn busy(&self, slba: u64, blocks: u64) -> bool {
        self.inflight
            .values()
            .any(|&(s, n)| slba < s + n && s < slba + blocks)
    }
}

fn run(seed: u64) {
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut t = target();
    let (host, mut tq) = connect(&mut t);
    let mut w = World {
        host,
        model: vec![0u8; BLOCKS as usize * BLOCK],
        buffers: HashMap::new(),
        reads: Vec::new(),
        inflight: HashMap::new(),
        answered: 0,
        out_of_range: 0,
    };
    let mut next_key = 1u32;
    let mut issued = 0u32;
    let now = Instant::now();
    let total = 300;
    let qd = 1 + rng.below(16) as usize;
    while w.answered < total {
        // Submit while there is room (never two commands on overlapping blocks in flight:
        // NVMe orders nothing between them).
        while issued < total && w.host.outstanding() < qd && w.host.can_submit() {
            let write = rng.below(2) == 0;
            let blocks = 1 + rng.below(8);
            let wild = rng.below(20) == 0;
            let slba = if wild {
                BLOCKS - rng.below(4)
            } else {
                rng.below(BLOCKS - blocks + 1)
            };
            if !wild && w.busy(slba, blocks) {
                continue;
            }
            let key = next_key;
            next_key += 1;
            let len = (blocks as usize * BLOCK) as u32;
            let buf = if write {
                (0..len).map(|_| rng.next() as u8).collect()
            } else {
                vec![0u8; len as usize]
            };
            w.buffers.insert(key, buf);
            let mut cmd = Command::new(
                if write { io::WRITE } else { io::READ },
                0,
                1,
                Sgl::Keyed {
                    addr: 0,
                    len,
                    key,
                    invalidate: rng.below(2) == 0,
                },
            )
            .unwrap();
            cmd.cdw[0] = slba as u32;
            cmd.cdw[1] = (slba >> 32) as u32;
            cmd.cdw[2] = blocks as u32 - 1;
            let op = Op {
                write,
                slba,
                blocks,
                key,
            };
            let (_, cap) = w.host.submit(cmd, &[], Some(op)).unwrap();
            if !wild {
                w.inflight.insert(key, (slba, blocks));
            }
            issued += 1;
            let actions = tq.on_capsule(now, &mut t, &cap);
            w.handle(actions);
        }
        // The network answers one pending READ, chosen at random.
        if !w.reads.is_empty() {
            let at = rng.below(w.reads.len() as u64) as usize;
            let (tag, key, len) = w.reads.swap_remove(at);
            let data = w.buffers[&key][..len as usize].to_vec();
            let actions = tq.read_done(now, &mut t, tag, Some(&data));
            w.handle(actions);
        }
    }
    assert_eq!(w.host.outstanding(), 0, "seed {seed}");
    assert!(w.out_of_range > 0, "seed {seed}: no wild LBA tried");
}

#[test]
fn seeded_reads_and_writes_agree_with_the_model() {
    for seed in 0..24 {
        run(seed);
    }
}
