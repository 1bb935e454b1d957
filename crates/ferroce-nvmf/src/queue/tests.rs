//! A host driving a target's queues through capsules, with its memory behind keys: every
//! READ and WRITE the queue asks for is done on that memory, data checked byte for byte.

use std::collections::HashMap;
use std::sync::Arc;

use super::*;
use crate::command::{admin, io as opc};
use crate::controllers::{Subsystem, TargetConfig};
use crate::fabrics::{Connect, ConnectData, Property, CNTLID_DYNAMIC};
use crate::identify::cns;
use crate::namespace::{MemoryBacking, Namespace};

const NQN: &str = "nqn.2026-11.io.ferroce:q";

/// The host's registered buffers: key -> (address, bytes).
struct Host {
    mem: HashMap<u32, (u64, Vec<u8>)>,
    invalidated: Vec<u32>,
}

impl Host {
    fn new() -> Host {
        Host {
            mem: HashMap::new(),
            invalidated: Vec::new(),
        }
    }

    fn region(&mut self, key: u32, addr: u64, bytes: Vec<u8>) {
        self.mem.insert(key, (addr, bytes));
    }

    /// Sends `capsule`, does what the queue asks, returns the completions and whether the
    /// queue ended.
    fn send(
        &mut self,
        q: &mut TargetQueue,
        t: &mut Target,
        capsule: &[u8],
    ) -> (Vec<Completion>, bool) {
        let mut todo = q.on_capsule(Instant::now(), t, capsule);
        let mut done = Vec::new();
        let mut closed = false;
        while !todo.is_empty() {
            let mut next = Vec::new();
            for a in todo {
                match a {
                    Action::Read {
                        tag,
                        addr,
                        key,
                        len,
                    } => {
                        let data = self.mem.get(&key).and_then(|(base, b)| {
                            let at = addr.checked_sub(*base)? as usize;
                            b.get(at..at + len as usize).map(<[u8]>::to_vec)
                        });
                        next.extend(q.read_done(Instant::now(), t, tag, data.as_deref()));
                    }
                    Action::Write { addr, key, data } => {
                        let (base, b) = self.mem.get_mut(&key).expect("a granted key");
                        let at = (addr - *base) as usize;
                        b[at..at + data.len()].copy_from_slice(&data);
                    }
                    Action::Send { cqe, invalidate } => {
                        done.push(Completion::parse(&cqe).unwrap());
                        self.invalidated.extend(invalidate);
                    }
                    Action::Close => closed = true,
                }
            }
            todo = next;
        }
        (done, closed)
    }
}

fn target() -> Target {
    Target::new(
        TargetConfig {
            max_queue_entries: 128,
            max_io_queues: 2,
            in_capsule_data: 8192,
            mdts: 5,
            listen: ("10.0.0.1".into(), "4420".into(), false),
        },
        vec![Subsystem {
            nqn: NQN.into(),
            serial: "q".into(),
            namespaces: [(
                1,
                Arc::new(Namespace {
                    nsid: 1,
                    block_shift: 12,
                    backing: Box::new(MemoryBacking::new(64 << 12)),
                    nguid: [3; 16],
                }),
            )]
            .into_iter()
            .collect(),
        }],
    )
}

fn capsule(c: &Command, data: &[u8]) -> Vec<u8> {
    let mut b = c.encode().to_vec();
    b.extend_from_slice(data);
    b
}

fn keyed(key: u32, addr: u64, len: u32, invalidate: bool) -> Sgl {
    Sgl::Keyed {
        addr,
        len,
        key,
        invalidate,
    }
}

fn connect_capsule(qid: u16, cntlid: u16) -> Vec<u8> {
    let data = ConnectData {
        host_id: [1; 16],
        cntlid,
        subnqn: NQN.into(),
        hostnqn: "nqn.host".into(),
    }
    .encode()
    .unwrap();
    let c = Connect {
        recfmt: 0,
        qid,
        sqsize: 31,
        cattr: 0,
        kato: 0,
    }
    .command(
        1,
        Sgl::InCapsule {
            offset: 0,
            len: 1024,
        },
    )
    .unwrap();
    capsule(&c, &data)
}

/// An admin queue connected and enabled, and one I/O queue: (admin, io, cntlid).
fn bring_up(t: &mut Target, host: &mut Host) -> (TargetQueue, TargetQueue, u16) {
    let mut aq = TargetQueue::new(32, 8192);
    let (c, closed) = host.send(&mut aq, t, &connect_capsule(0, CNTLID_DYNAMIC));
    assert!(!closed && c[0].status.is_success(), "{c:?}");
    let cntlid = c[0].result as u16;
    let cc = Property {
        offset: crate::properties::CC,
        eight_bytes: false,
        value: 4 << 20 | 6 << 16 | 1,
    }
    .command(2, true)
    .unwrap();
    let (c, _) = host.send(&mut aq, t, &capsule(&cc, &[]));
    assert!(c[0].status.is_success());
    let mut q = Command::new(
        admin::SET_FEATURES,
        3,
        0,
        Sgl::InCapsule { offset: 0, len: 0 },
    )
    .unwrap();
    q.cdw[0] = 0x07;
    q.cdw[1] = 1 | 1 << 16;
    assert!(host.send(&mut aq, t, &capsule(&q, &[])).0[0]
        .status
        .is_success());
    let mut ioq = TargetQueue::new(32, 8192);
    let (c, _) = host.send(&mut ioq, t, &connect_capsule(1, cntlid));
    assert!(c[0].status.is_success(), "{c:?}");
    (aq, ioq, cntlid)
}

fn rw(opcode: u8, cid: u16, slba: u64, blocks: u32, sgl: Sgl) -> Command {
    let mut c = Command::new(opcode, cid, 1, sgl).unwrap();
    c.cdw[0] = slba as u32;
    c.cdw[1] = (slba >> 32) as u32;
    c.cdw[2] = blocks - 1;
    c
}

#[test]
fn writes_by_rdma_read_and_reads_by_rdma_write_move_the_bytes() {
    let mut t = target();
    let mut host = Host::new();
    let (mut aq, mut ioq, cntlid) = bring_up(&mut t, &mut host);
    // Identify Controller into a keyed buffer, with Invalidate asked.
    host.region(0x10, 0x1000, vec![0; 4096]);
    let mut id = Command::new(admin::IDENTIFY, 4, 0, keyed(0x10, 0x1000, 4096, true)).unwrap();
    id.cdw[0] = u32::from(cns::CONTROLLER);
    let (c, _) = host.send(&mut aq, &mut t, &capsule(&id, &[]));
    assert!(c[0].status.is_success());
    assert_eq!(host.invalidated, vec![0x10]);
    assert_eq!(
        u16::from_le_bytes([host.mem[&0x10].1[78], host.mem[&0x10].1[79]]),
        cntlid
    );
    // 8 KiB written from the host's buffer (RDMA READ by the target), read back into another.
    let data: Vec<u8> = (0..8192u32).map(|i| (i * 31 % 253) as u8).collect();
    host.region(0x20, 0x20000, data.clone());
    host.region(0x30, 0x30000, vec![0; 8192]);
    let (c, closed) = host.send(
        &mut ioq,
        &mut t,
        &capsule(
            &rw(opc::WRITE, 9, 5, 2, keyed(0x20, 0x20000, 8192, false)),
            &[],
        ),
    );
    assert!(!closed && c[0].status.is_success(), "{c:?}");
    assert_eq!((c[0].cid, c[0].sq_id), (9, 1));
    let (c, _) = host.send(
        &mut ioq,
        &mut t,
        &capsule(
            &rw(opc::READ, 10, 5, 2, keyed(0x30, 0x30000, 8192, false)),
            &[],
        ),
    );
    assert!(c[0].status.is_success());
    assert_eq!(host.mem[&0x30].1, data);
    // In-capsule data for a write of one block.
    let block = vec![0x5Au8; 4096];
    let (c, _) = host.send(
        &mut ioq,
        &mut t,
        &capsule(
            &rw(
                opc::WRITE,
                11,
                0,
                1,
                Sgl::InCapsule {
                    offset: 0,
                    len: 4096,
                },
            ),
            &block,
        ),
    );
    assert!(c[0].status.is_success());
}

#[test]
fn bad_requests_get_their_status_and_the_queue_serves_on() {
    let mut t = target();
    let mut host = Host::new();
    let (_aq, mut ioq, _) = bring_up(&mut t, &mut host);
    ioq.set_max_transfer(8192);
    host.region(0x40, 0x40000, vec![0; 8192]);
    let cases: Vec<(Vec<u8>, Status)> = vec![
        // Beyond the MDTS either way: refused before any data moves (the host's buffer is
        // smaller still, so an RDMA READ or WRITE of it would have broken the queue).
        (
            capsule(
                &rw(opc::READ, 7, 0, 3, keyed(0x40, 0x40000, 12288, false)),
                &[],
            ),
            Status::INVALID_FIELD,
        ),
        (
            capsule(
                &rw(opc::WRITE, 8, 0, 3, keyed(0x40, 0x40000, 12288, false)),
                &[],
            ),
            Status::INVALID_FIELD,
        ),
        // Past the namespace's 64 blocks.
        (
            capsule(
                &rw(opc::READ, 1, 63, 2, keyed(0x40, 0x40000, 8192, false)),
                &[],
            ),
            Status::LBA_OUT_OF_RANGE,
        ),
        // A buffer smaller than the blocks.
        (
            capsule(
                &rw(opc::READ, 2, 0, 2, keyed(0x40, 0x40000, 4096, false)),
                &[],
            ),
            Status::SGL_LENGTH_INVALID,
        ),
        // In-capsule data promised but not sent, and at an offset.
        (
            capsule(
                &rw(
                    opc::WRITE,
                    3,
                    0,
                    1,
                    Sgl::InCapsule {
                        offset: 0,
                        len: 4096,
                    },
                ),
                &[0; 100],
            ),
            Status::SGL_LENGTH_INVALID,
        ),
        (
            capsule(
                &rw(
                    opc::WRITE,
                    4,
                    0,
                    1,
                    Sgl::InCapsule {
                        offset: 16,
                        len: 4096,
                    },
                ),
                &[0; 4112],
            ),
            Status::SGL_OFFSET_INVALID,
        ),
        // A namespace that does not exist.
        (
            {
                let mut c = rw(opc::READ, 5, 0, 1, keyed(0x40, 0x40000, 4096, false));
                c.nsid = 9;
                capsule(&c, &[])
            },
            Status::INVALID_NAMESPACE,
        ),
    ];
    for (cap, want) in cases {
        let (c, closed) = host.send(&mut ioq, &mut t, &cap);
        assert!(!closed);
        assert_eq!(c[0].status, want);
    }
    // A bad key: the target's READ fails, which breaks the queue pair: the queue ends.
    let (c, closed) = host.send(
        &mut ioq,
        &mut t,
        &capsule(&rw(opc::WRITE, 6, 0, 1, keyed(0x99, 0, 4096, false)), &[]),
    );
    assert!(c.is_empty() && closed);
    // A capsule too short to hold a command ends it too.
    let mut q = TargetQueue::new(8, 0);
    assert_eq!(
        q.on_capsule(Instant::now(), &mut t, &[0u8; 20]),
        vec![Action::Close]
    );
}

#[test]
fn only_connect_opens_a_queue() {
    let mut t = target();
    let mut host = Host::new();
    let mut q = TargetQueue::new(32, 8192);
    host.region(0x50, 0x50000, vec![0; 4096]);
    let (c, _) = host.send(
        &mut q,
        &mut t,
        &capsule(
            &rw(opc::READ, 1, 0, 1, keyed(0x50, 0x50000, 4096, false)),
            &[],
        ),
    );
    assert_eq!(c[0].status, Status::COMMAND_SEQUENCE_ERROR);
    assert!(q.binding().is_none());
}
