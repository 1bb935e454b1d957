//! `rsetsockopt`, `rgetsockopt` and `rfcntl`: the options librdmacm's rsockets take, with its
//! meanings (buffer sizes double as socket buffers do; `SOL_RDMA` sizes the queues before a
//! connection; options that have no meaning over a reliable connection are accepted).

use super::stream::*;
use super::*;

/// `SOL_RDMA` of `<rdma/rsocket.h>` and its options.
const SOL_RDMA: c_int = 0x10000;
const RDMA_SQSIZE: c_int = 0;
const RDMA_RQSIZE: c_int = 1;
const RDMA_INLINE: c_int = 2;
const RDMA_IOMAPSIZE: c_int = 3;

/// An `int` option's value, if `optval` holds one.
///
/// # Safety
/// `optval` points to `optlen` readable bytes.
unsafe fn int_of(optval: *const c_void, optlen: libc::socklen_t) -> Option<c_int> {
    if optval.is_null() || (optlen as usize) < std::mem::size_of::<c_int>() {
        return None;
    }
    // SAFETY: the caller's contract; an unaligned read of an int.
    Some(unsafe { std::ptr::read_unaligned(optval.cast::<c_int>()) })
}

fn set_flag(opts: &mut u64, name: c_int, on: bool) {
    let bit = 1u64 << (name as u32 & 63);
    if on {
        *opts |= bit;
    } else {
        *opts &= !bit;
    }
}

fn flag(opts: u64, name: c_int) -> c_int {
    c_int::from(opts & (1u64 << (name as u32 & 63)) != 0)
}

/// Sets the socket's id's int option `name` (of `RDMA_OPTION_ID`) to `val`; its result is not
/// the socket's.
fn set_id_option(g: &Stream, name: u32, val: c_int) {
    let mut v = val;
    // SAFETY: our live id and an int option, read from a local during the call.
    unsafe {
        rdma_set_option(
            g.cm_id,
            RDMA_OPTION_ID as c_int,
            name as c_int,
            (&mut v as *mut c_int).cast(),
            std::mem::size_of::<c_int>(),
        )
    };
}

/// `rsetsockopt`.
#[no_mangle]
pub(super) unsafe extern "C" fn rsetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *const c_void,
    optlen: libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        let mut g = sock.lock();
        // SAFETY: the program's option value.
        let Some(val) = (unsafe { int_of(optval, optlen) }) else {
            if level == libc::SOL_SOCKET && optname == libc::SO_LINGER {
                return 0;
            }
            return fail(libc::EINVAL);
        };
        match (level, optname) {
            (libc::SOL_SOCKET, libc::SO_REUSEADDR) => {
                // Its refusal (an id already bound) changes nothing for a socket, as librdmacm
                // ignores it too.
                set_id_option(&g, RDMA_OPTION_ID_REUSEADDR, val);
                set_flag(&mut g.so_opts, optname, val != 0);
            }
            (libc::SOL_SOCKET, libc::SO_RCVBUF) => {
                if g.bufs.is_none() {
                    g.rbuf_size = (val.max(0) as u32).saturating_mul(2).max(SNDLOWAT * 2);
                }
            }
            (libc::SOL_SOCKET, libc::SO_SNDBUF) => {
                if g.bufs.is_none() {
                    g.sbuf_size = (val.max(0) as u32).saturating_mul(2).max(SNDLOWAT * 2);
                }
            }
            (libc::SOL_SOCKET, libc::SO_LINGER) => {
                // Inverted, so the default (0) is "on", as librdmacm keeps it.
                set_flag(&mut g.so_opts, optname, val == 0);
            }
            (libc::SOL_SOCKET, libc::SO_KEEPALIVE | libc::SO_OOBINLINE) => {
                // No keepalive messages are sent (the RC QP itself fails when the peer is
                // gone); the option is remembered.
                set_flag(&mut g.so_opts, optname, val != 0);
            }
            (libc::IPPROTO_TCP, libc::TCP_KEEPCNT | libc::TCP_KEEPINTVL | libc::TCP_MAXSEG) => {}
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => {
                if val <= 0 {
                    return fail(libc::EINVAL);
                }
                g.keepalive_time = val as u32;
            }
            (libc::IPPROTO_TCP, libc::TCP_NODELAY) => set_flag(&mut g.tcp_opts, optname, val != 0),
            (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => {
                // Passed on to the id, as librdmacm does: a listener bound to `::` then takes
                // IPv6 requests only.
                set_id_option(&g, RDMA_OPTION_ID_AFONLY, val);
                set_flag(&mut g.ipv6_opts, optname, val != 0)
            }
            (SOL_RDMA, _) if g.state >= ST_OPENING => return fail(libc::EINVAL),
            (SOL_RDMA, RDMA_SQSIZE) => g.sq_size = val.clamp(0, 0xFFFE) as u16,
            (SOL_RDMA, RDMA_RQSIZE) => g.rq_size = val.clamp(0, 0xFFFE) as u16,
            (SOL_RDMA, RDMA_INLINE) => g.sq_inline = val.clamp(0, 0xFFFE) as u16,
            (SOL_RDMA, RDMA_IOMAPSIZE) => g.target_iomap_size = val.clamp(0, 255) as u16,
            // What the kernel says of an option it does not know (librdmacm says ENOTSUP,
            // which programs such as iperf3 take for a failure rather than "not here": it
            // asks every TCP socket for TCP_CONGESTION and gives up on anything else).
            _ => return fail(libc::ENOPROTOOPT),
        }
        0
    })
}

/// `rgetsockopt`.
#[no_mangle]
pub(super) unsafe extern "C" fn rgetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: *mut libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        if optval.is_null() || optlen.is_null() {
            return fail(libc::EFAULT);
        }
        let mut g = sock.lock();
        if (level, optname) == (libc::IPPROTO_TCP, libc::TCP_INFO) {
            // SAFETY: the program's buffer, `*optlen` bytes.
            unsafe { write_tcp_info(&g, optval, optlen) };
            return 0;
        }
        let v: c_int = match (level, optname) {
            (libc::SOL_SOCKET, libc::SO_REUSEADDR | libc::SO_KEEPALIVE | libc::SO_OOBINLINE) => {
                flag(g.so_opts, optname)
            }
            (libc::SOL_SOCKET, libc::SO_RCVBUF) => g.rbuf_size as c_int,
            (libc::SOL_SOCKET, libc::SO_SNDBUF) => g.sbuf_size as c_int,
            (libc::SOL_SOCKET, libc::SO_ERROR) => std::mem::take(&mut g.err),
            (libc::SOL_SOCKET, libc::SO_LINGER) => {
                // SAFETY: the program's buffer, `*optlen` bytes.
                unsafe {
                    if (*optlen as usize) < std::mem::size_of::<libc::linger>() {
                        return fail(libc::EINVAL);
                    }
                    let l = libc::linger {
                        l_onoff: 1 - flag(g.so_opts, optname),
                        l_linger: 0,
                    };
                    std::ptr::write_unaligned(optval.cast::<libc::linger>(), l);
                    *optlen = std::mem::size_of::<libc::linger>() as libc::socklen_t;
                }
                return 0;
            }
            (libc::IPPROTO_TCP, libc::TCP_KEEPCNT | libc::TCP_KEEPINTVL) => 1,
            (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE) => g.keepalive_time as c_int,
            (libc::IPPROTO_TCP, libc::TCP_NODELAY) => flag(g.tcp_opts, optname),
            (libc::IPPROTO_TCP, libc::TCP_MAXSEG) => TCP_INFO_MSS as c_int,
            (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY) => flag(g.ipv6_opts, optname),
            (SOL_RDMA, RDMA_SQSIZE) => c_int::from(g.sq_size),
            (SOL_RDMA, RDMA_RQSIZE) => c_int::from(g.rq_size),
            (SOL_RDMA, RDMA_INLINE) => c_int::from(g.sq_inline),
            (SOL_RDMA, RDMA_IOMAPSIZE) => c_int::from(g.target_iomap_size),
            // As for `rsetsockopt`.
            _ => return fail(libc::ENOPROTOOPT),
        };
        // SAFETY: the program's buffer, `*optlen` bytes.
        unsafe {
            if (*optlen as usize) < std::mem::size_of::<c_int>() {
                return fail(libc::EINVAL);
            }
            std::ptr::write_unaligned(optval.cast::<c_int>(), v);
            *optlen = std::mem::size_of::<c_int>() as libc::socklen_t;
        }
        0
    })
}

/// `TCP_INFO`, as the kernel answers it (the first `*optlen` bytes of a `struct tcp_info`, and
/// `*optlen` set to what was written): the connection's state and segment size; the counters
/// of TCP's own machinery (round-trip time, window, retransmissions) are 0, as nothing here
/// measures them. Programs such as iperf3 ask for it every interval and report an error each
/// time it fails (librdmacm fails it).
///
/// # Safety
/// `optval` points to `*optlen` writable bytes.
unsafe fn write_tcp_info(g: &Stream, optval: *mut c_void, optlen: *mut libc::socklen_t) {
    // SAFETY: a plain C struct of integers, for which all-zero is a value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    // The kernel's TCP states (`include/net/tcp_states.h`).
    const TCP_ESTABLISHED: u8 = 1;
    const TCP_CLOSE: u8 = 7;
    const TCP_LISTEN: u8 = 10;
    const TCP_SYN_SENT: u8 = 2;
    info.tcpi_state = if g.state & ST_CONNECTED != 0 {
        TCP_ESTABLISHED
    } else if g.state == ST_LISTENING {
        TCP_LISTEN
    } else if g.state & ST_OPENING != 0 {
        TCP_SYN_SENT
    } else {
        TCP_CLOSE
    };
    info.tcpi_snd_mss = TCP_INFO_MSS;
    info.tcpi_rcv_mss = TCP_INFO_MSS;
    // SAFETY: the caller's contract; at most the struct's size is copied.
    unsafe {
        let n = (*optlen as usize).min(std::mem::size_of::<libc::tcp_info>());
        std::ptr::copy_nonoverlapping(
            (&info as *const libc::tcp_info).cast::<u8>(),
            optval.cast::<u8>(),
            n,
        );
        *optlen = n as libc::socklen_t;
    }
}

/// The segment size `TCP_MAXSEG` and `TCP_INFO` report.
const TCP_INFO_MSS: u32 = 2048;

/// `rfcntl(socket, cmd, ...)`: `F_GETFL`, and `F_SETFL` (its `O_NONBLOCK`).
///
/// C-variadic in the header. Defined here with the one `int`-or-pointer argument the two
/// commands take, which the x86-64 and AArch64 Linux calling conventions pass exactly as a
/// third fixed argument (in `rdx`/`x2`); `F_GETFL` passes none, and the register's value is
/// then not read.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[no_mangle]
pub(super) extern "C" fn rfcntl(socket: c_int, cmd: c_int, arg: libc::c_long) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        let mut g = sock.lock();
        match cmd {
            libc::F_GETFL => g.fd_flags,
            libc::F_SETFL => {
                let flags = arg as c_int;
                // The id's channel blocks as the socket does while it connects (librdmacm's
                // `rs_set_nonblocking`); the CQ's channel never blocks here (waits poll it).
                if g.state < ST_CONNECTED {
                    set_id_nonblocking(&g, flags & libc::O_NONBLOCK != 0);
                }
                g.fd_flags = flags;
                0
            }
            _ => fail(libc::EOPNOTSUPP),
        }
    })
}
