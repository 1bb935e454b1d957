//! A drop-in `librdmacm.so.1`: rdma_cm's connection setup, with the Linux kernel's rdma_cm on
//! the wire and between ferroce peers.
//!
//! Two ways to the passive side, chosen per connection ([`wire::Mode`], `FERROCE_RDMA_CM`):
//! - **IB CM on the wire** ([`wire`], over [`ferroce::cm::ib`]): REQ, REP, RTU, REJ, MRA,
//!   DREQ, DREP and SIDR as MADs to QP1, as the kernel's `ib_cm` and `rdma_cm` send them, so
//!   rxe, RDMA NICs and ferroce on another host connect in either role. A listener takes REQs
//!   this way always; `rdma_connect` goes this way toward another host when no ferroce peer
//!   answers the TCP exchange (or at once, `FERROCE_RDMA_CM=ib`). UD ids (the UDP port space)
//!   are resolved by SIDR this way only.
//! - **ferroce's TCP exchange** ([`tcp`]): the same messages over TCP to the rdma_cm port, for
//!   ferroce peers QP1 cannot reach: the processes of one host share its address and only the
//!   first (host slot 0) is QP1 to the world.
//!
//! Either way the events, their order and the channels are rdma_cm's. The REQ and REP carry
//! each side's ECE ([`ece`]), as the kernel's do, so two ferroce processes negotiate selective
//! repeat (`crate::qp`'s ECE) with no help from the program.
//!
//! The rest, one idea a file: [`verbs`](mod@verbs) (the libibverbs calls, found with `dlsym`),
//! [`devices`], [`addr`] (socket addresses and routes), [`addrinfo`], [`events`] (channels and
//! events), [`ids`], [`qp`] (an id's QP and its RTR/RTS), [`active`] (`rdma_connect`,
//! `rdma_disconnect`), [`passive`] (`rdma_listen`, `rdma_accept`, `rdma_reject`,
//! `rdma_get_request`), [`endpoint`] (`rdma_create_ep`).
//!
//! This code is linked into `librdmacm.so.1`, a library of its own (programs name its symbol
//! versions, `RDMACM_1.0`…), and reaches the verbs through `libibverbs.so.1`'s exported calls,
//! found with `dlsym`: the contexts, PDs and QPs it makes must be the ones the program's own
//! verbs calls see; QP1 comes from that library's `ferroce_gsi_*` calls.

use std::collections::VecDeque;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::abi::*;
use crate::{guard, set_errno};

pub(super) mod active;
mod addr;
mod addrinfo;
mod devices;
mod ece;
mod endpoint;
mod events;
mod ids;
mod passive;
mod qp;
mod rsocket;
mod tcp;
mod verbs;
mod wire;
use addr::*;
use addrinfo::*;
use devices::*;
pub use ece::Ece;
use ece::*;
use events::*;
use ids::*;
use passive::*;
use qp::*;
pub use tcp::Message;
use tcp::*;
use verbs::*;

/// The rest of librdmacm: SRQs on ids, multicast, the calls for a program's own QP
/// (`rdma_establish`, `rdma_init_qp_attr`) and rejecting for an ECE (`rdma_reject_ece`: the
/// REJ carries no reason). They fail as unsupported.
mod unsupported {

    // why: not built yet: an SRQ made on an id, multicast groups, and the calls for a QP the
    // program connects itself (`rdma_init_qp_attr`, `rdma_establish`, `rdma_notify`,
    // `rdma_reject_ece`)
    returns_minus_one!(
        rdma_create_srq,
        rdma_create_srq_ex,
        rdma_join_multicast,
        rdma_join_multicast_ex,
        rdma_leave_multicast,
        rdma_notify,
        rdma_establish,
        rdma_init_qp_attr,
        rdma_reject_ece,
    );

    // No SRQ is ever made on an id (its creation is unsupported).
    does_nothing!(rdma_destroy_srq);
}

/// Starts one of this library's helper threads with the asynchronous signals blocked (see
/// `ferroce::spawn_without_signals`: a signal for the program must reach the program's own
/// threads); otherwise as `std::thread::spawn`, which panics when no thread can be made.
pub(crate) fn spawn_helper<F, T>(f: F) -> std::thread::JoinHandle<T>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    ferroce::spawn_without_signals(std::thread::Builder::new(), f).expect("spawning a thread")
}

#[cfg(test)]
mod tests {
    use super::{Ece, Message};

    /// A thread waiting for an event is woken for one that its destroyed id took away, and the
    /// program destroys the channel meanwhile (rping's client does both as it ends): the wait
    /// goes on blocking, as a read of the kernel's event file does, and never fails with a
    /// closed descriptor (rping then exits 255) or reads the freed channel.
    #[test]
    fn a_wait_outlives_its_channel_and_a_taken_event() {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        use std::time::Duration;

        let ch = super::rdma_create_event_channel();
        assert!(!ch.is_null());
        // SAFETY: our live channel.
        let queue = unsafe { super::channel_of(ch) }.unwrap().queue.clone();
        let returned = Arc::new(AtomicBool::new(false));
        let (flag, addr) = (returned.clone(), ch as usize);
        {
            // A count whose event is gone by the time the woken thread looks: the queue stays
            // locked until the program has destroyed the channel.
            let _q = queue.events.lock().unwrap();
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a local to the channel's eventfd.
            unsafe { libc::write(queue.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
            super::spawn_helper(move || {
                let mut ev = std::ptr::null_mut();
                // SAFETY: the channel is live when the call starts: it is destroyed only
                // once this call took the count, after it entered.
                let _ = unsafe { super::rdma_get_cm_event(addr as *mut _, &mut ev) };
                flag.store(true, Ordering::Release);
            });
            // The thread took the count (so it is inside the call, past its start) once the
            // eventfd no longer reads as ready.
            let mut fd = libc::pollfd {
                fd: queue.efd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd of ours.
            while unsafe { libc::poll(&mut fd, 1, 0) } > 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            // SAFETY: our channel, destroyed once.
            unsafe { super::rdma_destroy_event_channel(ch) };
        }
        drop(queue);
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !returned.load(Ordering::Acquire),
            "the wait ended once its channel was gone"
        );
    }

    #[test]
    fn messages_round_trip_and_refuse_junk() {
        let msgs = [
            Message::Connect {
                reply: false,
                qpn: 0x12_3456,
                psn: 0xab_cdef,
                gid: [7; 16],
                mtu: 5,
                responder_resources: 16,
                initiator_depth: 4,
                retry_count: 7,
                rnr_retry_count: 6,
                private: b"perftest".to_vec(),
                ece: None,
            },
            Message::Connect {
                reply: false,
                qpn: 0x12_3456,
                psn: 0xab_cdef,
                gid: [7; 16],
                mtu: 5,
                responder_resources: 16,
                initiator_depth: 4,
                retry_count: 7,
                rnr_retry_count: 6,
                private: b"perftest".to_vec(),
                ece: Some(Ece {
                    vendor_id: 0x4652_4345,
                    options: 1,
                }),
            },
            Message::Connect {
                reply: true,
                qpn: 9,
                psn: 8,
                gid: [1; 16],
                mtu: 1,
                responder_resources: 1,
                initiator_depth: 1,
                retry_count: 1,
                rnr_retry_count: 1,
                private: vec![0xaa; 255],
                ece: Some(Ece {
                    vendor_id: u32::MAX,
                    options: u32::MAX,
                }),
            },
            Message::Connect {
                reply: true,
                qpn: 1,
                psn: 2,
                gid: [0; 16],
                mtu: 3,
                responder_resources: 0,
                initiator_depth: 0,
                retry_count: 0,
                rnr_retry_count: 0,
                private: Vec::new(),
                ece: None,
            },
            Message::Reject {
                private: vec![1, 2, 3],
            },
            Message::ReadyToUse,
            Message::Disconnect,
        ];
        for m in msgs {
            let b = m.encode();
            assert_eq!(Message::read(&mut &b[..]).unwrap(), m);
            // Every truncation is an error, never a panic.
            for cut in 0..b.len() {
                assert!(Message::read(&mut &b[..cut]).is_err());
            }
        }
        assert!(Message::read(&mut &b"XXXX\x01"[..]).is_err());
        assert!(Message::read(&mut &b"FRCM\x09"[..]).is_err());
    }

    /// A REQ or REP without an ECE is byte for byte what builds before ECE send and read (kind
    /// 1 or 2); with one it is kind 6 or 7, the ECE after the private data.
    #[test]
    fn connect_messages_keep_the_format_before_ece() {
        let req = |ece| Message::Connect {
            reply: false,
            qpn: 0x01_0203,
            psn: 0x04_0506,
            gid: [9; 16],
            mtu: 3,
            responder_resources: 2,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            private: b"hi".to_vec(),
            ece,
        };
        let mut legacy = b"FRCM\x01\x00\x01\x02\x03\x00\x04\x05\x06".to_vec();
        legacy.extend_from_slice(&[9; 16]);
        legacy.extend_from_slice(&[3, 2, 1, 7, 7, 2, b'h', b'i']);
        assert_eq!(req(None).encode(), legacy);
        let with = req(Some(Ece {
            vendor_id: 0x4652_4345,
            options: 1,
        }))
        .encode();
        let mut want = legacy.clone();
        want[4] = 6;
        want.extend_from_slice(b"FRCE\x00\x00\x00\x01");
        assert_eq!(with, want);
        // A REP likewise: kind 2 without, 7 with.
        let mut rep = legacy.clone();
        rep[4] = 2;
        assert!(matches!(
            Message::read(&mut &rep[..]),
            Ok(Message::Connect {
                reply: true,
                ece: None,
                ..
            })
        ));
        rep[4] = 7;
        rep.extend_from_slice(&[0, 0, 0x15, 0xb3, 0, 0, 0, 3]);
        assert!(matches!(
            Message::read(&mut &rep[..]),
            Ok(Message::Connect {
                reply: true,
                ece: Some(Ece {
                    vendor_id: 0x15b3,
                    options: 3
                }),
                ..
            })
        ));
    }
}
