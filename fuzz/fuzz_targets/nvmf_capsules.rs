//! Fuzzes an NVMe-oF target's queues (`ferroce-nvmf`): the command capsules a host SENDs and
//! the data its RDMA READs bring back.
//!
//! An admin queue is connected and its controller enabled, and an I/O queue connected, as a
//! Linux host does; then the input chooses, step after step, a capsule for either queue (the
//! command's fields from the input, any opcode, Fabrics type, data pointer and in-capsule
//! data) or the answer to a READ the target asked for (the data, cut short, or a failure).
//! Invariants: never a panic; every response answers a command the host sent and not yet
//! answered, on the queue it was sent on; no RDMA WRITE is longer than the keyed buffer its
//! command described; a queue the target closed is not used again.
#![no_main]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroce_fuzz::Input;
use ferroce_nvmf::command::Command;
use ferroce_nvmf::completion::Completion;
use ferroce_nvmf::fabrics::{Connect, ConnectData, Property, CNTLID_DYNAMIC};
use ferroce_nvmf::namespace::{MemoryBacking, Namespace};
use ferroce_nvmf::queue::{Action, TargetQueue};
use ferroce_nvmf::sgl::Sgl;
use ferroce_nvmf::controllers::{Subsystem, Target, TargetConfig};
use libfuzzer_sys::fuzz_target;

const NQN: &str = "nqn.2026-11.io.ferroce:fuzz";

struct Queue {
    q: TargetQueue,
    /// Commands sent and not answered: cid -> the keyed buffer's length (0 for none).
    open: HashMap<u16, u32>,
    /// READs asked for and not answered: tag -> length.
    reads: HashMap<u16, u32>,
    closed: bool,
}

fn target() -> Target {
    Target::new(
        TargetConfig {
            max_queue_entries: 32,
            max_io_queues: 2,
            in_capsule_data: 4096,
            mdts: 3,
            listen: ("10.0.0.1".into(), "4420".into(), false),
        },
        vec![Subsystem {
            nqn: NQN.into(),
            serial: "fuzz".into(),
            namespaces: [(
                1,
                Arc::new(Namespace {
                    nsid: 1,
                    block_shift: 9,
                    backing: Box::new(MemoryBacking::new(64 * 512)),
                    nguid: [0; 16],
                }),
            )]
            .into_iter()
            .collect(),
        }],
    )
}

fn check(queue: &mut Queue, qid: u16, actions: Vec<Action>) {
    let mut writes = 0usize;
    for a in actions {
        assert!(!queue.closed, "an action after the queue closed");
        match a {
            Action::Read { tag, len, .. } => {
                assert!(len > 0, "a READ of nothing");
                assert!(queue.reads.insert(tag, len).is_none(), "two READs of one tag");
            }
            Action::Write { data, .. } => writes += data.len(),
            Action::Send { cqe, .. } => {
                let c = Completion::parse(&cqe).unwrap();
                let len = queue
                    .open
                    .remove(&c.cid)
                    .unwrap_or_else(|| panic!("a response to command {} not outstanding", c.cid));
                assert!(c.sq_id == qid || c.sq_id == 0, "a response naming queue {}", c.sq_id);
                assert!(writes <= len as usize, "{writes} bytes written into a {len}-byte buffer");
                writes = 0;
            }
            Action::Close => queue.closed = true,
        }
    }
}

fn capsule(c: &Command, data: &[u8]) -> Vec<u8> {
    let mut b = c.encode().to_vec();
    b.extend_from_slice(data);
    b
}

fn connect(t: &mut Target, now: Instant, qid: u16, cntlid: u16) -> (TargetQueue, Completion) {
    let mut q = TargetQueue::new(32, 4096);
    let data = ConnectData {
        host_id: [1; 16],
        cntlid,
        subnqn: NQN.into(),
        hostnqn: "nqn.fuzz-host".into(),
    }
    .encode()
    .unwrap();
    let c = Connect { recfmt: 0, qid, sqsize: 31, cattr: 0, kato: 0 }
        .command(0xFFF0, Sgl::InCapsule { offset: 0, len: 1024 })
        .unwrap();
    let a = q.on_capsule(now, t, &capsule(&c, &data));
    let Some(Action::Send { cqe, .. }) = a.last() else { panic!("no answer to Connect: {a:?}") };
    (q, Completion::parse(cqe).unwrap())
}

fuzz_target!(|data: &[u8]| {
    let mut input = Input::new(data);
    let mut t = target();
    let now = Instant::now();
    let (mut aq, c) = connect(&mut t, now, 0, CNTLID_DYNAMIC);
    let cntlid = c.result as u16;
    let cc = Property { offset: 0x14, eight_bytes: false, value: 4 << 20 | 6 << 16 | 1 }
        .command(0xFFF1, true)
        .unwrap();
    aq.on_capsule(now, &mut t, &capsule(&cc, &[]));
    let mut nq = Command::new(0x09, 0xFFF2, 0, Sgl::InCapsule { offset: 0, len: 0 }).unwrap();
    nq.cdw[0] = 0x07;
    nq.cdw[1] = 1 | 1 << 16;
    aq.on_capsule(now, &mut t, &capsule(&nq, &[]));
    let (ioq, c) = connect(&mut t, now, 1, cntlid);
    assert!(c.status.is_success(), "the I/O queue's Connect failed: {c:?}");
    let mut queues = [
        Queue { q: aq, open: HashMap::new(), reads: HashMap::new(), closed: false },
        Queue { q: ioq, open: HashMap::new(), reads: HashMap::new(), closed: false },
    ];
    let mut used_cids: [HashSet<u16>; 2] = [HashSet::new(), HashSet::new()];
    let mut steps = 0;
    while !input.is_empty() && steps < 64 {
        steps += 1;
        let which = input.below(2);
        let queue = &mut queues[which];
        if queue.closed {
            continue;
        }
        let later = now + Duration::from_millis(u64::from(input.u16()));
        if input.below(4) == 0 && !queue.reads.is_empty() {
            // Answer a pending READ: whole, cut short, or failed.
            let tags: Vec<u16> = queue.reads.keys().copied().collect();
            let tag = tags[input.below(tags.len().min(256))];
            let len = queue.reads.remove(&tag).unwrap();
            let data = match input.below(3) {
                0 => None,
                1 => Some(vec![input.u8(); input.below(256).min(len as usize)]),
                _ => Some(vec![input.u8(); len as usize]),
            };
            let a = queue.q.read_done(later, &mut t, tag, data.as_deref());
            check(queue, which as u16, a);
            continue;
        }
        // A capsule: a command of the input's choosing.
        let mut cmd_bytes = [0u8; 64];
        for b in cmd_bytes.iter_mut() {
            *b = input.u8();
        }
        // Often a plausible one: an opcode from the ones served, an SGL descriptor of a known
        // type, so the input reaches past the first checks.
        if input.below(2) == 0 {
            cmd_bytes[0] = [0x00, 0x01, 0x02, 0x08, 0x09, 0x06, 0x0A, 0x02, 0x18, 0x0C, 0x7F]
                [input.below(11)];
            cmd_bytes[1] = 0x40;
            cmd_bytes[39] = [0x01, 0x40, 0x4F][input.below(3)];
            cmd_bytes[4..8].copy_from_slice(&[1, 0, 0, 0]);
        }
        let cmd = Command::parse(&cmd_bytes).unwrap();
        // A command ID may repeat only once its command is answered (as a host keeps them).
        if queue.open.contains_key(&cmd.cid) || queue.reads.contains_key(&cmd.cid) {
            continue;
        }
        used_cids[which].insert(cmd.cid);
        let keyed_len = match cmd.sgl() {
            Ok(Sgl::Keyed { len, .. }) => len,
            _ => 0,
        };
        queue.open.insert(cmd.cid, keyed_len);
        let extra = input.below(256) * 16;
        let in_capsule = input.bytes(extra).to_vec();
        let cut = input.below(4) == 0;
        let mut cap = capsule(&cmd, &in_capsule);
        if cut {
            cap.truncate(input.below(64));
        }
        let a = queue.q.on_capsule(later, &mut t, &cap);
        if cut && cap.len() < 64 {
            assert_eq!(a, vec![Action::Close], "a capsule without its command");
            queue.closed = true;
            continue;
        }
        check(queue, which as u16, a);
    }
    // Keep-alive expiry and removal never panic, whatever the controller's state.
    for id in t.expired(now + Duration::from_secs(3600)) {
        t.remove(id);
    }
});
