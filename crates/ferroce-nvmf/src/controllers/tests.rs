//! A Linux host's bring-up of a controller, step by step, and the refusals on the way.

use super::*;
use crate::fabrics::CONNECT_DATA_LEN;
use crate::namespace::MemoryBacking;
use crate::sgl::Sgl;

const NQN: &str = "nqn.2026-11.io.ferroce:test";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:0000";

fn target() -> Target {
    let ns = Namespace {
        nsid: 1,
        block_shift: 9,
        backing: Box::new(MemoryBacking::new(1 << 20)),
        nguid: [9; 16],
    };
    Target::new(
        TargetConfig {
            max_queue_entries: 128,
            max_io_queues: 4,
            in_capsule_data: 8192,
            mdts: 5,
            listen: ("10.0.0.1".into(), "4420".into(), false),
        },
        vec![Subsystem {
            nqn: NQN.into(),
            serial: "s1".into(),
            namespaces: [(1, Arc::new(ns))].into_iter().collect(),
        }],
    )
}

fn connect(qid: u16, sqsize: u16, kato: u32) -> Command {
    Connect {
        recfmt: 0,
        qid,
        sqsize,
        cattr: 0,
        kato,
    }
    .command(
        1,
        Sgl::InCapsule {
            offset: 0,
            len: CONNECT_DATA_LEN as u32,
        },
    )
    .unwrap()
}

fn data(cntlid: u16, subnqn: &str, host_id: u8) -> Vec<u8> {
    ConnectData {
        host_id: [host_id; 16],
        cntlid,
        subnqn: subnqn.into(),
        hostnqn: HOSTNQN.into(),
    }
    .encode()
    .unwrap()
}

fn cmd(opcode: u8, nsid: u32, cdw10: u32, cdw11: u32) -> Command {
    let mut c = Command::new(
        opcode,
        5,
        nsid,
        Sgl::Keyed {
            addr: 0,
            len: 4096,
            key: 1,
            invalidate: false,
        },
    )
    .unwrap();
    c.cdw[0] = cdw10;
    c.cdw[1] = cdw11;
    c
}

fn respond(o: Outcome) -> Response {
    match o {
        Outcome::Respond(r) => r,
        Outcome::Held => panic!("held"),
    }
}

fn enable(t: &mut Target, now: Instant, cntlid: u16) {
    let set = Property {
        offset: crate::properties::CC,
        eight_bytes: false,
        value: 4 << 20 | 6 << 16 | 1,
    }
    .command(2, true)
    .unwrap();
    assert!(respond(t.admin(now, cntlid, &set, 0, &[]))
        .status
        .is_success());
}

#[test]
fn a_host_brings_up_a_controller_and_its_io_queues() {
    let mut t = target();
    let now = Instant::now();
    let (admin_q, r) = t
        .connect(now, &connect(0, 31, 15_000), &data(CNTLID_DYNAMIC, NQN, 1))
        .unwrap();
    let cntlid = r.result as u16;
    assert_eq!(admin_q.cntlid, cntlid);
    assert_eq!(admin_q.sq_entries, 32);
    // Before enabling, only properties answer.
    let ident = cmd(admin::IDENTIFY, 0, u32::from(cns::CONTROLLER), 0);
    assert_eq!(
        respond(t.admin(now, cntlid, &ident, 4096, &[])).status,
        Status::COMMAND_SEQUENCE_ERROR
    );
    let cap = Property {
        offset: crate::properties::CAP,
        eight_bytes: true,
        value: 0,
    }
    .command(3, false)
    .unwrap();
    assert_eq!(
        respond(t.admin(now, cntlid, &cap, 0, &[])).result & 0xFFFF,
        127
    );
    // An I/O queue before the controller is enabled is out of sequence.
    assert_eq!(
        t.connect(now, &connect(1, 127, 0), &data(cntlid, NQN, 1))
            .err()
            .unwrap()
            .status,
        Status::COMMAND_SEQUENCE_ERROR
    );
    enable(&mut t, now, cntlid);
    let page = respond(t.admin(now, cntlid, &ident, 4096, &[]));
    assert!(page.status.is_success());
    assert_eq!(crate::le::u16_at(&page.data, 78), cntlid);
    assert_eq!(&page.data[768..768 + NQN.len()], NQN.as_bytes());
    // Number of queues: the host asks for 8, gets the target's 4 (0's based 3).
    let q = cmd(admin::SET_FEATURES, 0, 0x07, 7 | 7 << 16);
    assert_eq!(
        respond(t.admin(now, cntlid, &q, 0, &[])).result,
        3 | 3 << 16
    );
    let ns = cmd(admin::IDENTIFY, 1, u32::from(cns::NAMESPACE), 0);
    let page = respond(t.admin(now, cntlid, &ns, 4096, &[]));
    assert_eq!(crate::le::u64_at(&page.data, 0), 2048);
    let (io_q, _) = t
        .connect(now, &connect(2, 127, 0), &data(cntlid, NQN, 1))
        .unwrap();
    assert_eq!(io_q.qid, 2);
    assert!(io_q.subsystem.unwrap().namespace(1).is_some());
    // A queue past the allocated count (the command's QID, byte 42), another host's ID (the
    // data's byte 0), an unknown controller (the data's CNTLID, byte 16): each named in the
    // result as IATTR (bit 16: in the data) and offset.
    for (qid, d, result) in [
        (5, data(cntlid, NQN, 1), 42),
        (1, data(cntlid, NQN, 2), 1 << 16),
        (1, data(cntlid + 1, NQN, 1), 1 << 16 | 16),
    ] {
        let r = t.connect(now, &connect(qid, 127, 0), &d).err().unwrap();
        assert_eq!(
            (r.status, r.result),
            (Status::CONNECT_INVALID_PARAMETERS, result)
        );
    }
}

#[test]
fn connects_to_unknown_subsystems_or_oversized_queues_are_refused() {
    let mut t = target();
    let now = Instant::now();
    // Each refusal names its parameter: the data's SUBNQN (byte 256), the command's SQSIZE
    // (byte 44) twice, the data's CNTLID (byte 16; an admin queue's must be dynamic).
    for (c, d, result) in [
        (
            connect(0, 31, 0),
            data(CNTLID_DYNAMIC, "nqn.other", 1),
            1 << 16 | 256,
        ),
        (connect(0, 128, 0), data(CNTLID_DYNAMIC, NQN, 1), 44),
        (connect(0, 0, 0), data(CNTLID_DYNAMIC, NQN, 1), 44),
        (connect(0, 31, 0), data(7, NQN, 1), 1 << 16 | 16),
    ] {
        let r = t.connect(now, &c, &d).err().unwrap();
        assert_eq!(
            (r.status, r.result),
            (Status::CONNECT_INVALID_PARAMETERS, result)
        );
    }
    assert!(t.connect(now, &connect(0, 31, 0), &[0u8; 100]).is_err());
    assert!(t.controllers().is_empty());
}

#[test]
fn keep_alive_holds_a_controller_and_its_absence_ends_it() {
    let mut t = target();
    let t0 = Instant::now();
    let (_, r) = t
        .connect(t0, &connect(0, 31, 2_000), &data(CNTLID_DYNAMIC, NQN, 1))
        .unwrap();
    let cntlid = r.result as u16;
    enable(&mut t, t0, cntlid);
    let ka = cmd(admin::KEEP_ALIVE, 0, 0, 0);
    let t1 = t0 + Duration::from_millis(1_500);
    assert!(respond(t.admin(t1, cntlid, &ka, 0, &[]))
        .status
        .is_success());
    assert!(t.expired(t1 + Duration::from_millis(1_900)).is_empty());
    assert_eq!(t.expired(t1 + Duration::from_millis(2_100)), vec![cntlid]);
    // Traffic-based keep alive: any command of the controller restarts the timer (Identify
    // says so in CTRATT bit 6).
    let t2 = t1 + Duration::from_millis(1_800);
    t.traffic(cntlid, t2);
    assert!(t.expired(t2 + Duration::from_millis(1_900)).is_empty());
    assert_eq!(t.expired(t2 + Duration::from_millis(2_100)), vec![cntlid]);
    t.traffic(0x7777, t2); // No such controller: nothing happens.
                           // Held event requests, up to the limit, come back when the controller ends.
    let aer = cmd(admin::ASYNC_EVENT_REQUEST, 0, 0, 0);
    for _ in 0..AER_LIMIT {
        assert_eq!(t.admin(t1, cntlid, &aer, 0, &[]), Outcome::Held);
    }
    assert_eq!(
        respond(t.admin(t1, cntlid, &aer, 0, &[])).status,
        AER_LIMIT_EXCEEDED
    );
    assert_eq!(t.remove(cntlid), vec![5; AER_LIMIT]);
    assert!(t.controllers().is_empty());
}

#[test]
fn the_discovery_controller_lists_the_subsystems() {
    let mut t = target();
    let now = Instant::now();
    let (b, r) = t
        .connect(
            now,
            &connect(0, 31, 0),
            &data(CNTLID_DYNAMIC, discovery::DISCOVERY_NQN, 1),
        )
        .unwrap();
    assert!(b.subsystem.is_none());
    let cntlid = r.result as u16;
    enable(&mut t, now, cntlid);
    // nvme-cli reads the header first (numd 0's based: 255 dwords = 1024 bytes), then all.
    let log = cmd(
        admin::GET_LOG_PAGE,
        0,
        u32::from(discovery::LID) | 255 << 16,
        0,
    );
    let head = respond(t.admin(now, cntlid, &log, 1024, &[]));
    assert_eq!(crate::le::u64_at(&head.data, 8), 1);
    let all = cmd(
        admin::GET_LOG_PAGE,
        0,
        u32::from(discovery::LID) | 511 << 16,
        0,
    );
    let page = respond(t.admin(now, cntlid, &all, 2048, &[]));
    assert_eq!(
        &page.data[1024 + 256..1024 + 256 + NQN.len()],
        NQN.as_bytes()
    );
    // A discovery controller has no namespaces.
    let ns = cmd(admin::IDENTIFY, 1, u32::from(cns::NAMESPACE), 0);
    assert_eq!(
        respond(t.admin(now, cntlid, &ns, 4096, &[])).status,
        Status::INVALID_FIELD
    );
    // An I/O queue cannot join a discovery controller.
    assert!(t
        .connect(
            now,
            &connect(1, 31, 0),
            &data(cntlid, discovery::DISCOVERY_NQN, 1)
        )
        .is_err());
}
