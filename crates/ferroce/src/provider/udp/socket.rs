//! The UDP sockets of the provider: one per context to receive on (its RoCE address), one per
//! QP to send from (its own source port, for ECMP entropy), with the options RoCE v2 needs.

use std::net::{SocketAddr, UdpSocket};

use socket2::{Domain, Protocol, Socket, Type};

/// A UDP socket bound to `addr`, with buffers of `rcvbuf` bytes and (IPv4) DF set.
pub(super) fn bind(addr: SocketAddr, rcvbuf: usize) -> std::io::Result<UdpSocket> {
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
    s.bind(&addr.into())?;
    Ok(s.into())
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
    // SAFETY: passes a pointer to a live c_int and its size, as integer options expect.
    unsafe {
        libc::setsockopt(
            std::os::fd::AsRawFd::as_raw_fd(s),
            level,
            name,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}
