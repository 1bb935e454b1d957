//! The UDP sockets of the provider: one per context to receive on (its RoCE address), one per
//! QP to send from (its own source port, for ECMP entropy), with the options RoCE v2 needs.
//!
//! # ECN
//! Every packet leaves with the TOS byte the socket was bound with, normally ECT(0) (0x02): the
//! ECN field tells switches on the path that the sender reacts to congestion marks, so a
//! switch with a long queue marks the packet Congestion Experienced (0x03) instead of dropping
//! it. Linux keeps a datagram socket's ECN bits as set (only TCP masks them) and every GSO
//! segment inherits them. The ICRC masks the whole TOS byte, so a mark made on the path leaves
//! it valid.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};

use socket2::{Domain, Protocol, Socket, Type};

/// A UDP socket bound to `addr`, with buffers of `rcvbuf` bytes, (IPv4) DF set, and every
/// datagram leaving with the TOS byte (IPv6: traffic class) `tos` (0: the kernel's default).
pub(super) fn bind(addr: SocketAddr, rcvbuf: usize, tos: u8) -> std::io::Result<UdpSocket> {
    let s = Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP))?;
    // Large buffers absorb bursts of a whole send window; the privileged "force" variant is
    // tried first, the ordinary one (capped by net.core.rmem_max) after.
    if !set_int_opt(
        &s,
        libc::SOL_SOCKET,
        libc::SO_RCVBUFFORCE,
        rcvbuf as libc::c_int,
    ) {
        let _ = s.set_recv_buffer_size(rcvbuf);
    }
    if !set_int_opt(
        &s,
        libc::SOL_SOCKET,
        libc::SO_SNDBUFFORCE,
        rcvbuf as libc::c_int,
    ) {
        let _ = s.set_send_buffer_size(rcvbuf);
    }
    if addr.is_ipv4() {
        // DF set, as RoCE v2 requires; Linux then sends Identification 0 from an unconnected
        // socket, which is what the ICRC is computed over on both ends.
        set_pmtudisc_do(&s);
    }
    if tos != 0 {
        let tos = libc::c_int::from(tos);
        // An IPv6 socket sends IPv4 datagrams to IPv4-mapped addresses with the IPv4 option's
        // TOS: both are set. A kernel that refuses leaves packets Not-ECT, which costs the
        // marks, not the traffic.
        set_int_opt(&s, libc::IPPROTO_IP, libc::IP_TOS, tos);
        if addr.is_ipv6() {
            set_int_opt(&s, libc::IPPROTO_IPV6, libc::IPV6_TCLASS, tos);
        }
    }
    s.bind(&addr.into())?;
    Ok(s.into())
}

/// Asks the kernel to hand over the TOS byte (IPv4) or traffic class (IPv6) of every datagram
/// the socket `fd` (of family IPv6 if `ipv6`) receives as a control message; returns whether
/// it agreed. An IPv6 socket is asked for both: it receives IPv4 datagrams from IPv4-mapped
/// sources with the IPv4 option's TOS.
pub(super) fn receive_tos(fd: RawFd, ipv6: bool) -> bool {
    let v4 = super::sys::set_int(fd, libc::IPPROTO_IP, libc::IP_RECVTOS, 1);
    let v6 = ipv6 && super::sys::set_int(fd, libc::IPPROTO_IPV6, libc::IPV6_RECVTCLASS, 1);
    v4 || v6
}

fn set_pmtudisc_do(s: &Socket) {
    set_int_opt(
        s,
        libc::IPPROTO_IP,
        libc::IP_MTU_DISCOVER,
        libc::IP_PMTUDISC_DO,
    );
}

/// Sets an integer socket option; returns whether the kernel accepted it.
fn set_int_opt(s: &Socket, level: libc::c_int, name: libc::c_int, v: libc::c_int) -> bool {
    super::sys::set_int(s.as_raw_fd(), level, name, v)
}
