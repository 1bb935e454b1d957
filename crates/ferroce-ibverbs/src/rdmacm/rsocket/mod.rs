//! rsockets: sockets over RDMA (`<rdma/rsocket.h>`), for `rstream`, `riostream`, `rcopy` and
//! `librspreload.so`, on the wire as librdmacm's own (see `stream` for the protocol), so either
//! end may be rdma-core's over a kernel or NIC.
//!
//! An rsocket is a synchronous rdma_cm id (its own event channel) with an RC QP. Its number is
//! a real descriptor (a duplicate of that channel's), so `librspreload.so`'s table of its own
//! descriptors never collides with it, and it is numbered above every descriptor open when the
//! socket is made. librdmacm numbers a socket by its channel's descriptor, the lowest free one;
//! `librspreload.so` maps its `select` sets back by walking its own descriptors upwards and
//! taking the first whose rsocket number matches, so a socket numbered below the preload's
//! descriptor for it (a hole left by a closed descriptor) is reported under the wrong one and
//! its own never becomes readable: measured, 2 of 40 iperf3 runs between namespace hosts moved
//! nothing, the server never reading its stream. Each socket's state is under one lock;
//! a call that must wait (for data, credits, a connection) lets go of it while it polls the
//! descriptor its wait is on, so a sender and a receiver on two threads never block each other.
//!
//! Stream sockets only: `SOCK_DGRAM` rsockets (datagrams over UD QPs with librdmacm's own
//! header and a UDP side channel) are refused with `EOPNOTSUPP`, which `librspreload.so` takes
//! as "use the kernel's socket".

mod iomap;
mod options;
mod poll;
mod stream;

use std::collections::BTreeMap;

use super::*;
use stream::*;

/// Every rsocket, by number.
static SOCKETS: Mutex<BTreeMap<c_int, Arc<RSocket>>> = Mutex::new(BTreeMap::new());

/// One rsocket.
struct RSocket {
    s: Mutex<Stream>,
    /// The descriptor that is its number (see the module doc), closed with it.
    _number: Option<OwnedFd>,
}

fn lookup(fd: c_int) -> Option<Arc<RSocket>> {
    SOCKETS
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&fd)
        .cloned()
}

fn insert(s: Stream) -> c_int {
    // SAFETY: a live synchronous id: its own channel.
    let channel_fd = unsafe { (*(*s.cm_id).channel).fd };
    // Without a descriptor to spare, the channel's own number serves, as librdmacm's does.
    let number = number_above_open(channel_fd);
    let fd = number.as_ref().map_or(channel_fd, |n| n.as_raw_fd());
    SOCKETS.lock().unwrap_or_else(|e| e.into_inner()).insert(
        fd,
        Arc::new(RSocket {
            s: Mutex::new(s),
            _number: number,
        }),
    );
    fd
}

/// A duplicate of `fd` numbered above every descriptor this process has open now.
fn number_above_open(fd: c_int) -> Option<OwnedFd> {
    let highest = std::fs::read_dir("/proc/self/fd")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<c_int>().ok())
        .max()?;
    // SAFETY: F_DUPFD_CLOEXEC takes an int and makes a new descriptor, which we own.
    let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, highest.saturating_add(1)) };
    // SAFETY: a descriptor just made, owned by nothing else.
    (n >= 0).then(|| unsafe { OwnedFd::from_raw_fd(n) })
}

thread_local! {
    /// The sockets whose lock this thread holds (see [`RSocket::lock`]).
    static HELD: std::cell::RefCell<Vec<usize>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A socket's lock, held by this thread (and recorded as held until dropped).
struct Held<'a> {
    g: std::sync::MutexGuard<'a, Stream>,
    key: usize,
}

impl std::ops::Deref for Held<'_> {
    type Target = Stream;
    fn deref(&self) -> &Stream {
        &self.g
    }
}

impl std::ops::DerefMut for Held<'_> {
    fn deref_mut(&mut self) -> &mut Stream {
        &mut self.g
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let _ = HELD.try_with(|h| {
            if let Ok(mut h) = h.try_borrow_mut() {
                if let Some(at) = h.iter().rposition(|&k| k == self.key) {
                    h.swap_remove(at);
                }
            }
        });
    }
}

impl RSocket {
    /// The socket's lock. A thread that holds it already cannot take it again: that happens
    /// when a signal handler calls in while the thread is inside this library, or after one
    /// jumped out of a call (`siglongjmp`, as iperf3's SIGTERM handler does) and left the lock
    /// held for good. The call then fails with `EDEADLK` instead of waiting forever (a process
    /// that then would not even end on SIGTERM).
    fn lock(&self) -> Held<'_> {
        let key = self as *const RSocket as usize;
        // The record is gone once the thread's locals are destroyed (a call from an atexit
        // handler or a static destructor): the check is skipped then, never a failure.
        let held = HELD
            .try_with(|h| h.try_borrow().is_ok_and(|h| h.contains(&key)))
            .unwrap_or(false);
        if held {
            std::panic::resume_unwind(Box::new(crate::ErrnoUnwind(libc::EDEADLK)));
        }
        let g = self.s.lock().unwrap_or_else(|e| e.into_inner());
        let _ = HELD.try_with(|h| {
            if let Ok(mut h) = h.try_borrow_mut() {
                h.push(key);
            }
        });
        Held { g, key }
    }
}

/// Fails with `errno` `e`.
fn fail<T: From<i8>>(e: c_int) -> T {
    set_errno(e);
    T::from(-1)
}

/// Waits until `test` holds, processing completions (credits granted on the way); `Err` with
/// `EWOULDBLOCK` if `nonblock` and it does not hold now. The lock is let go while waiting.
fn wait<'a>(
    sock: &'a RSocket,
    mut g: Held<'a>,
    nonblock: bool,
    test: fn(&Stream) -> bool,
) -> (Held<'a>, Result<(), c_int>) {
    loop {
        g.update_credits();
        let polled = g.poll_cq();
        if !test(&g) {
            g.take_cm_event();
        }
        if test(&g) {
            g.update_credits();
            return (g, Ok(()));
        }
        if let Err(e) = polled {
            return (g, Err(e));
        }
        if nonblock {
            return (g, Err(libc::EWOULDBLOCK));
        }
        if !g.cq_armed {
            // Armed, then polled once more: a completion between the two is not missed.
            g.arm();
            continue;
        }
        g.update_credits();
        let fd = g.wait_fd();
        // Hands progress back to ferroce's engine before sleeping.
        g.take_cq_event();
        if !g.cq_armed {
            continue;
        }
        // The id's channel too, while connected: the peer's DREQ comes there.
        let id_fd = (g.state & ST_CONNECTED != 0 && fd != g.id_fd()).then(|| g.id_fd());
        drop(g);
        let mut p = [fd, id_fd.unwrap_or(-1)].map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        });
        // SAFETY: two pollfds (a negative descriptor is skipped). Bounded: another thread of
        // the socket may take the event this one waits for.
        unsafe { libc::poll(p.as_mut_ptr(), 2, 10) };
        g = sock.lock();
        if g.cm_id.is_null() {
            // Closed by another thread meanwhile.
            return (g, Err(libc::EBADF));
        }
        g.take_cq_event();
    }
}

/// Waits (unless non-blocking by the socket or `flags`) until the socket may send; a socket
/// whose sending side closed meanwhile fails with `ECONNRESET`.
fn wait_writable<'a>(
    sock: &'a RSocket,
    g: Held<'a>,
    flags: c_int,
) -> (Held<'a>, Result<(), c_int>) {
    if g.can_send() {
        return (g, Ok(()));
    }
    let nb = nonblocking(&g, flags);
    let (g, r) = wait(sock, g, nb, conn_can_send);
    if r.is_ok() && g.state & ST_WRITABLE == 0 {
        return (g, Err(libc::ECONNRESET));
    }
    (g, r)
}

fn nonblocking(s: &Stream, flags: c_int) -> bool {
    s.fd_flags & libc::O_NONBLOCK != 0 || flags & libc::MSG_DONTWAIT != 0
}

fn conn_can_send(s: &Stream) -> bool {
    s.can_send() || s.state & ST_WRITABLE == 0
}

fn conn_have_rdata(s: &Stream) -> bool {
    s.have_rdata() || s.state & ST_READABLE == 0
}

fn conn_can_send_ctrl(s: &Stream) -> bool {
    s.ctrl_avail() || s.state & ST_CONNECTED == 0
}

fn conn_all_sends_done(s: &Stream) -> bool {
    s.all_sends_done()
}

/// The next event of the socket's synchronous id, which must be `want` (librdmacm's
/// `ucma_complete`): `Err(EAGAIN)` while none has come on a non-blocking socket.
fn complete(s: &mut Stream, want: rdma_cm_event_type) -> Result<(), c_int> {
    // SAFETY: our live synchronous id.
    if unsafe { wait_sync(s.cm_id, want) } == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

/// The channel descriptor of the socket's id to (non-)block as the socket does.
fn set_id_nonblocking(s: &Stream, on: bool) {
    // SAFETY: our live id's own channel.
    let fd = unsafe { (*(*s.cm_id).channel).fd };
    // SAFETY: fcntl on a descriptor of ours.
    unsafe {
        let fl = libc::fcntl(fd, libc::F_GETFL);
        let fl = if on {
            fl | libc::O_NONBLOCK
        } else {
            fl & !libc::O_NONBLOCK
        };
        libc::fcntl(fd, libc::F_SETFL, fl);
    }
}

/// The private data of the event the socket's id keeps (a request's or an ESTABLISHED's).
fn event_private(s: &Stream) -> Option<Vec<u8>> {
    // SAFETY: our live id; its kept event (or NULL); the private data it points to lives
    // with the event.
    unsafe {
        let ev = (*s.cm_id).event;
        if ev.is_null() {
            return None;
        }
        let c = (*ev).param.conn;
        if c.private_data.is_null() {
            return None;
        }
        Some(
            std::slice::from_raw_parts(
                c.private_data.cast::<u8>(),
                usize::from(c.private_data_len),
            )
            .to_vec(),
        )
    }
}

/// Runs the active side's connection as far as it goes (librdmacm's `rs_do_connect`): address,
/// route, QP and buffers, connect, the peer's data; on a non-blocking socket each step that has
/// to wait leaves the state where it is and fails with `EINPROGRESS`.
fn do_connect(s: &mut Stream) -> Result<(), c_int> {
    // A connected or failed socket keeps its state (a second `rconnect` is common).
    if s.state & ST_CONNECTED != 0 {
        return Err(libc::EISCONN);
    }
    if s.state & ST_OPENING == 0 && s.state != ST_INIT && s.state != ST_BOUND {
        return Err(if s.state == ST_LISTENING {
            libc::EINVAL
        } else {
            libc::ENOTCONN
        });
    }
    let r = connect_steps(s);
    if let Err(e) = r {
        if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
            return Err(libc::EINPROGRESS);
        }
        s.state = ST_CONNECT_ERROR;
        s.err = e;
    }
    r
}

fn connect_steps(s: &mut Stream) -> Result<(), c_int> {
    match s.state {
        ST_INIT | ST_BOUND => {
            s.state = ST_RESOLVING_ADDR;
            // SAFETY: our live id; the destination was stored in its route.
            let rc = unsafe {
                let dst = std::ptr::addr_of_mut!((*s.cm_id).route.addr.__bindgen_anon_2.dst_addr);
                rdma_resolve_addr(s.cm_id, std::ptr::null_mut(), dst, 2000)
            };
            if rc != 0 {
                return Err(errno());
            }
            s.state = ST_RESOLVING_ROUTE;
            // SAFETY: our live id.
            if unsafe { rdma_resolve_route(s.cm_id, 2000) } != 0 {
                return Err(errno());
            }
            s.create_ep()?;
            let data = s.conn_data();
            let mut param = rdma_conn_param {
                private_data: data.as_ptr().cast(),
                private_data_len: CONN_DATA_LEN as u8,
                flow_control: 1,
                retry_count: 7,
                rnr_retry_count: 7,
                ..Default::default()
            };
            s.state = ST_CONNECTING;
            // SAFETY: our live id; the private data lives through the call (copied).
            if unsafe { active::rdma_connect(s.cm_id, &mut param) } != 0 {
                return Err(errno());
            }
            connected(s)
        }
        // ferroce resolves addresses and routes at once: a resolution never waits.
        ST_RESOLVING_ADDR | ST_RESOLVING_ROUTE => Err(libc::EINVAL),
        ST_CONNECTING => {
            complete(s, RDMA_CM_EVENT_ESTABLISHED)?;
            connected(s)
        }
        ST_ACCEPTING => {
            // The id's channel was made non-blocking only to accept; a blocking socket waits
            // for its connection (librdmacm's `rs_do_connect`).
            if s.fd_flags & libc::O_NONBLOCK == 0 {
                set_id_nonblocking(s, false);
            }
            complete(s, RDMA_CM_EVENT_ESTABLISHED)?;
            s.state = ST_CONNECT_RDWR;
            Ok(())
        }
        _ => Err(libc::EINVAL),
    }
}

fn connected(s: &mut Stream) -> Result<(), c_int> {
    let data = event_private(s).ok_or(libc::EPROTO)?;
    s.save_conn_data(&data)?;
    s.state = ST_CONNECT_RDWR;
    Ok(())
}

/// `rsocket`: a stream socket (`AF_INET`/`AF_INET6`, `SOCK_STREAM`, TCP or 0).
// partly(rsocket): `SOCK_DGRAM` (librdmacm's datagram rsockets: UD QPs, its own header and a
// UDP side channel; rdma-core's `udpong`) fails with `EOPNOTSUPP`, which `librspreload.so`
// takes as "use the kernel's socket"; stream sockets are whole.
#[no_mangle]
pub(super) extern "C" fn rsocket(domain: c_int, kind: c_int, protocol: c_int) -> c_int {
    guard(-1, || {
        let ok = (domain == libc::AF_INET || domain == libc::AF_INET6)
            && kind == libc::SOCK_STREAM
            && (protocol == 0 || protocol == libc::IPPROTO_TCP);
        if !ok {
            return fail(libc::EOPNOTSUPP);
        }
        let mut id = std::ptr::null_mut();
        // SAFETY: a synchronous id (NULL channel) for TCP's port space.
        if unsafe {
            rdma_create_id(
                std::ptr::null_mut(),
                &mut id,
                std::ptr::null_mut(),
                RDMA_PS_TCP,
            )
        } != 0
        {
            return -1;
        }
        // SAFETY: the id just made: its family, as librdmacm records it.
        unsafe { (*id).route.addr.__bindgen_anon_1.src_addr.sa_family = domain as u16 };
        insert(Stream::new(id, None))
    })
}

/// `rbind`.
#[no_mangle]
pub(super) unsafe extern "C" fn rbind(
    socket: c_int,
    addr: *const sockaddr,
    _len: libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        let mut s = sock.lock();
        // SAFETY: our live id; the program's address.
        if unsafe { rdma_bind_addr(s.cm_id, addr.cast_mut()) } != 0 {
            return -1;
        }
        s.state = ST_BOUND;
        0
    })
}

/// `rlisten`.
#[no_mangle]
pub(super) extern "C" fn rlisten(socket: c_int, backlog: c_int) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        let mut s = sock.lock();
        if s.state != ST_LISTENING {
            // SAFETY: our live id.
            if unsafe { rdma_listen(s.cm_id, backlog) } != 0 {
                return -1;
            }
            s.state = ST_LISTENING;
        }
        0
    })
}

/// `raccept`: the next connection request, answered with this side's buffers; a listener that
/// does not block lets the new socket finish connecting later (as librdmacm, so a thread may
/// connect to itself).
#[no_mangle]
pub(super) unsafe extern "C" fn raccept(
    socket: c_int,
    addr: *mut sockaddr,
    addrlen: *mut libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(listen) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        let (lid, nonblock, proto) = {
            let l = listen.lock();
            (
                l.cm_id,
                l.fd_flags & libc::O_NONBLOCK != 0,
                Stream::new(std::ptr::null_mut(), Some(&l)),
            )
        };
        let mut child = std::ptr::null_mut();
        // SAFETY: the listener's live synchronous id (waits unless its channel is
        // non-blocking). Not under the listener's lock: a request may take long.
        if unsafe { rdma_get_request(lid, &mut child) } != 0 {
            return -1;
        }
        let mut s = proto;
        s.cm_id = child;
        let Some(creq) = event_private(&s) else {
            // SAFETY: the request's id, never handed out.
            unsafe { rdma_destroy_id(child) };
            return fail(libc::EPROTO);
        };
        if creq.first() != Some(&1) {
            // SAFETY: as above.
            unsafe { rdma_destroy_id(child) };
            return fail(libc::EOPNOTSUPP);
        }
        if nonblock {
            set_id_nonblocking(&s, true);
        }
        let fail_child = |s: &mut Stream, e: c_int| -> c_int {
            s.free_ep();
            // SAFETY: the request's id, never handed out.
            unsafe { rdma_destroy_id(s.cm_id) };
            fail(e)
        };
        if let Err(e) = s.create_ep() {
            return fail_child(&mut s, e);
        }
        if let Err(e) = s.save_conn_data(&creq) {
            return fail_child(&mut s, e);
        }
        // SAFETY: the kept request event (checked above).
        let mut param = unsafe { (*(*child).event).param.conn };
        let data = s.conn_data();
        param.private_data = data.as_ptr().cast();
        param.private_data_len = CONN_DATA_LEN as u8;
        s.state = ST_CONNECT_RDWR;
        // SAFETY: our request's id; the private data lives through the call.
        if unsafe { rdma_accept(child, &mut param) } != 0 {
            let e = errno();
            if e == libc::EAGAIN || e == libc::EWOULDBLOCK {
                s.state = ST_ACCEPTING;
            } else {
                return fail_child(&mut s, e);
            }
        }
        let fd = insert(s);
        if !addr.is_null() && !addrlen.is_null() {
            // SAFETY: the program's output buffers.
            unsafe { rgetpeername(fd, addr, addrlen) };
        }
        fd
    })
}

/// `rconnect`.
#[no_mangle]
pub(super) unsafe extern "C" fn rconnect(
    socket: c_int,
    addr: *const sockaddr,
    _len: libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        // SAFETY: the program's address.
        let Some(dst) = (unsafe { read_sockaddr(addr) }) else {
            return fail(libc::EINVAL);
        };
        let mut s = sock.lock();
        if s.state == ST_INIT || s.state == ST_BOUND {
            // SAFETY: the storage arm covers the union.
            write_sockaddr(
                unsafe { &mut (*s.cm_id).route.addr.__bindgen_anon_2.dst_storage },
                dst,
            );
        }
        match do_connect(&mut s) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

/// Finishes a connection a non-blocking socket began, before it moves data.
fn ensure_connected(s: &mut Stream) -> Result<(), c_int> {
    if s.state & ST_OPENING != 0 {
        return do_connect(s).map_err(|e| {
            if e == libc::EINPROGRESS {
                libc::EAGAIN
            } else {
                e
            }
        });
    }
    Ok(())
}

fn send_bytes(socket: c_int, data: &[u8], flags: c_int) -> isize {
    let Some(sock) = lookup(socket) else {
        return fail(libc::EBADF);
    };
    let mut g = sock.lock();
    if let Err(e) = ensure_connected(&mut g) {
        return fail(e);
    }
    if g.state & ST_CONNECTED == 0 && g.state & ST_DISCONNECTED == 0 {
        return fail(libc::ENOTCONN);
    }
    let mut sent = 0usize;
    let mut olen = OLAP_START_SIZE;
    let mut err = 0;
    let (ng, r) = iomap::send_pending(&sock, g, flags);
    g = ng;
    if let Err(e) = r {
        return fail(e);
    }
    while sent < data.len() {
        let (ng, r) = wait_writable(&sock, g, flags);
        g = ng;
        if let Err(e) = r {
            err = e;
            break;
        }
        match g.send_some(&data[sent..], &mut olen) {
            Ok(n) => sent += n,
            Err(e) => {
                err = e;
                break;
            }
        }
    }
    if err != 0 && sent == 0 {
        return fail(err);
    }
    sent as isize
}

fn recv_bytes(socket: c_int, out: &mut [u8], flags: c_int) -> isize {
    let Some(sock) = lookup(socket) else {
        return fail(libc::EBADF);
    };
    let mut g = sock.lock();
    if let Err(e) = ensure_connected(&mut g) {
        return fail(e);
    }
    let mut got = 0usize;
    let mut err = 0;
    loop {
        if !g.have_rdata() {
            let nb = nonblocking(&g, flags);
            let (ng, r) = wait(&sock, g, nb, conn_have_rdata);
            g = ng;
            if let Err(e) = r {
                err = e;
                break;
            }
        }
        if flags & libc::MSG_PEEK != 0 {
            got = g.read_some(out, true);
            break;
        }
        got += g.read_some(&mut out[got..], false);
        g.update_credits();
        let more = got < out.len() && flags & libc::MSG_WAITALL != 0 && g.state & ST_READABLE != 0;
        if !more {
            break;
        }
    }
    if err != 0 && got == 0 {
        return fail(err);
    }
    got as isize
}

/// `rsend`.
#[no_mangle]
pub(super) unsafe extern "C" fn rsend(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
) -> isize {
    guard(-1, || {
        if buf.is_null() && len > 0 {
            return fail(libc::EFAULT);
        }
        // SAFETY: the program's `len` bytes.
        let data = unsafe { slice_or_empty(buf.cast(), len) };
        send_bytes(socket, data, flags)
    })
}

/// `rwrite`.
#[no_mangle]
pub(super) unsafe extern "C" fn rwrite(socket: c_int, buf: *const c_void, len: usize) -> isize {
    // SAFETY: the caller's contract, passed on.
    unsafe { rsend(socket, buf, len, 0) }
}

/// `rsendto`: a stream socket takes no address.
#[no_mangle]
pub(super) unsafe extern "C" fn rsendto(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    dest: *const sockaddr,
    addrlen: libc::socklen_t,
) -> isize {
    if !dest.is_null() || addrlen != 0 {
        return fail(libc::EISCONN);
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { rsend(socket, buf, len, flags) }
}

/// The bytes of `iov` gathered (rsockets copy every send into their own buffer anyway).
///
/// # Safety
/// `iov` holds `n` valid iovecs (or is NULL with `n` 0).
unsafe fn gather(iov: *const libc::iovec, n: c_int) -> Option<Vec<u8>> {
    if n < 0 || (iov.is_null() && n > 0) {
        return None;
    }
    let mut v = Vec::new();
    for i in 0..n as usize {
        // SAFETY: the caller's contract.
        let e = unsafe { &*iov.add(i) };
        // SAFETY: the program's buffer of `iov_len` bytes.
        v.extend_from_slice(unsafe { slice_or_empty(e.iov_base.cast(), e.iov_len) });
    }
    Some(v)
}

/// `rwritev`.
#[no_mangle]
pub(super) unsafe extern "C" fn rwritev(
    socket: c_int,
    iov: *const libc::iovec,
    iovcnt: c_int,
) -> isize {
    guard(-1, || {
        // SAFETY: the program's iovecs.
        let Some(data) = (unsafe { gather(iov, iovcnt) }) else {
            return fail(libc::EINVAL);
        };
        send_bytes(socket, &data, 0)
    })
}

/// `rsendmsg` (no control data).
#[no_mangle]
pub(super) unsafe extern "C" fn rsendmsg(
    socket: c_int,
    msg: *const libc::msghdr,
    flags: c_int,
) -> isize {
    guard(-1, || {
        // SAFETY: the program's header.
        let Some(m) = (unsafe { msg.as_ref() }) else {
            return fail(libc::EINVAL);
        };
        if !m.msg_control.is_null() && m.msg_controllen > 0 {
            return fail(libc::EOPNOTSUPP);
        }
        // SAFETY: its iovecs.
        let Some(data) = (unsafe { gather(m.msg_iov, m.msg_iovlen as c_int) }) else {
            return fail(libc::EINVAL);
        };
        send_bytes(socket, &data, flags)
    })
}

/// `rrecv`: what has arrived (waiting for something unless non-blocking); 0 at the end of the
/// peer's stream. Data already queued is still read after the peer disconnected.
#[no_mangle]
pub(super) unsafe extern "C" fn rrecv(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
) -> isize {
    guard(-1, || {
        if buf.is_null() && len > 0 {
            return fail(libc::EFAULT);
        }
        // SAFETY: the program's `len` writable bytes.
        let out = unsafe { slice_mut_or_empty(buf.cast(), len) };
        recv_bytes(socket, out, flags)
    })
}

/// `rread`.
#[no_mangle]
pub(super) unsafe extern "C" fn rread(socket: c_int, buf: *mut c_void, len: usize) -> isize {
    // SAFETY: the caller's contract, passed on.
    unsafe { rrecv(socket, buf, len, 0) }
}

/// `rrecvfrom`: `rrecv`, with the peer's address.
#[no_mangle]
pub(super) unsafe extern "C" fn rrecvfrom(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    src: *mut sockaddr,
    addrlen: *mut libc::socklen_t,
) -> isize {
    // SAFETY: the caller's contract, passed on.
    let n = unsafe { rrecv(socket, buf, len, flags) };
    if n > 0 && !src.is_null() && !addrlen.is_null() {
        // SAFETY: the program's output buffers.
        unsafe { rgetpeername(socket, src, addrlen) };
    }
    n
}

/// `rreadv`: into the first buffer only, as librdmacm's.
#[no_mangle]
pub(super) unsafe extern "C" fn rreadv(
    socket: c_int,
    iov: *const libc::iovec,
    iovcnt: c_int,
) -> isize {
    if iov.is_null() || iovcnt < 1 {
        return fail(libc::EINVAL);
    }
    // SAFETY: the program's first iovec.
    let e = unsafe { &*iov };
    // SAFETY: as above.
    unsafe { rrecv(socket, e.iov_base, e.iov_len, 0) }
}

/// `rrecvmsg`: into the first buffer only, as librdmacm's.
#[no_mangle]
pub(super) unsafe extern "C" fn rrecvmsg(
    socket: c_int,
    msg: *mut libc::msghdr,
    flags: c_int,
) -> isize {
    // SAFETY: the program's header.
    let Some(m) = (unsafe { msg.as_ref() }) else {
        return fail(libc::EINVAL);
    };
    if !m.msg_control.is_null() && m.msg_controllen > 0 {
        return fail(libc::EOPNOTSUPP);
    }
    if m.msg_iov.is_null() || m.msg_iovlen < 1 {
        return fail(libc::EINVAL);
    }
    // SAFETY: its first iovec.
    let e = unsafe { &*m.msg_iov };
    // SAFETY: as above.
    unsafe { rrecv(socket, e.iov_base, e.iov_len, flags) }
}

/// # Safety
/// `p` points to `len` readable bytes, or `len` is 0.
unsafe fn slice_or_empty<'a>(p: *const u8, len: usize) -> &'a [u8] {
    if len == 0 || p.is_null() {
        &[]
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts(p, len) }
    }
}

/// # Safety
/// `p` points to `len` writable bytes nothing else uses, or `len` is 0.
unsafe fn slice_mut_or_empty<'a>(p: *mut u8, len: usize) -> &'a mut [u8] {
    if len == 0 || p.is_null() {
        &mut []
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(p, len) }
    }
}

/// `rshutdown`: tells the peer (a control message), then waits for this side's sends to
/// complete.
#[no_mangle]
pub(super) extern "C" fn rshutdown(socket: c_int, how: c_int) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        let mut g = sock.lock();
        let saved = g.fd_flags;
        g.fd_flags &= !libc::O_NONBLOCK;
        let mut ret = 0;
        if g.state & ST_CONNECTED != 0 {
            let ctrl = if how == libc::SHUT_RDWR {
                g.state &= !(ST_READABLE | ST_WRITABLE);
                Some(CTRL_DISCONNECT)
            } else if how == libc::SHUT_WR {
                g.state &= !ST_WRITABLE;
                Some(if g.state & ST_READABLE != 0 {
                    CTRL_SHUTDOWN
                } else {
                    CTRL_DISCONNECT
                })
            } else {
                g.state &= !ST_READABLE;
                (g.state & ST_WRITABLE == 0).then_some(CTRL_DISCONNECT)
            };
            if let Some(ctrl) = ctrl {
                if !g.ctrl_avail() {
                    let (ng, r) = wait(&sock, g, false, conn_can_send_ctrl);
                    g = ng;
                    if r.is_err() {
                        ret = -1;
                    }
                }
                if ret == 0 && g.state & ST_CONNECTED != 0 && g.ctrl_avail() {
                    if let Err(e) = g.send_ctrl(ctrl) {
                        set_errno(e);
                        ret = -1;
                    }
                }
            }
        }
        if ret == 0 && g.state & ST_CONNECTED != 0 {
            let (ng, _) = wait(&sock, g, false, conn_all_sends_done);
            g = ng;
        }
        g.fd_flags = saved;
        if g.state & ST_DISCONNECTED != 0 {
            g.qp_to_error();
        }
        ret
    })
}

/// `rclose`: a graceful shutdown if connected, then everything freed (the id's connection
/// ends with it).
#[no_mangle]
pub(super) extern "C" fn rclose(socket: c_int) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        if sock.lock().state & ST_CONNECTED != 0 {
            rshutdown(socket, libc::SHUT_RDWR);
        }
        SOCKETS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&socket);
        let mut g = sock.lock();
        g.free_ep();
        // SAFETY: our id, destroyed once (the socket is out of the table).
        unsafe { rdma_destroy_id(g.cm_id) };
        g.cm_id = std::ptr::null_mut();
        0
    })
}

/// Copies `a` into the program's `addr` of `*len` bytes, writing the full length back.
///
/// # Safety
/// `addr` has `*len` writable bytes.
unsafe fn copy_addr_out(a: Option<SocketAddr>, addr: *mut sockaddr, len: *mut libc::socklen_t) {
    let mut st = sockaddr_storage::default();
    let full = match a {
        Some(SocketAddr::V4(_)) => std::mem::size_of::<libc::sockaddr_in>(),
        _ => std::mem::size_of::<libc::sockaddr_in6>(),
    };
    if let Some(a) = a {
        write_sockaddr(&mut st, a);
    }
    // SAFETY: the caller's contract: at most `*len` bytes written.
    unsafe {
        let n = (*len as usize).min(full);
        std::ptr::copy_nonoverlapping(
            (&st as *const sockaddr_storage).cast::<u8>(),
            addr.cast(),
            n,
        );
        *len = full as libc::socklen_t;
    }
}

/// `rgetpeername`.
#[no_mangle]
pub(super) unsafe extern "C" fn rgetpeername(
    socket: c_int,
    addr: *mut sockaddr,
    len: *mut libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        if addr.is_null() || len.is_null() {
            return fail(libc::EFAULT);
        }
        let g = sock.lock();
        // SAFETY: our live id.
        let Some(i) = (unsafe { id_of(g.cm_id) }) else {
            return fail(libc::EBADF);
        };
        let a = dst_addr(i);
        // SAFETY: the program's buffers.
        unsafe { copy_addr_out(a, addr, len) };
        0
    })
}

/// `rgetsockname`.
#[no_mangle]
pub(super) unsafe extern "C" fn rgetsockname(
    socket: c_int,
    addr: *mut sockaddr,
    len: *mut libc::socklen_t,
) -> c_int {
    guard(-1, || {
        let Some(sock) = lookup(socket) else {
            return fail(libc::EBADF);
        };
        if addr.is_null() || len.is_null() {
            return fail(libc::EFAULT);
        }
        let g = sock.lock();
        // SAFETY: our live id.
        let Some(i) = (unsafe { id_of(g.cm_id) }) else {
            return fail(libc::EBADF);
        };
        let a = src_addr(i);
        // SAFETY: the program's buffers.
        unsafe { copy_addr_out(a, addr, len) };
        0
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread that takes a socket's lock while it holds it (a signal handler's call, or a
    /// call after a handler jumped out of one) fails with EDEADLK through `guard`, and the
    /// lock is usable again once the holder lets go.
    #[test]
    fn a_lock_taken_twice_by_one_thread_is_edeadlk_not_a_hang() {
        let sock = RSocket {
            s: Mutex::new(Stream::new(std::ptr::null_mut(), None)),
            _number: None,
        };
        let held = sock.lock();
        let r: c_int = guard(-1, || {
            let _again = sock.lock();
            0
        });
        assert_eq!(r, -1);
        assert_eq!(errno(), libc::EDEADLK);
        drop(held);
        let r: c_int = guard(-1, || {
            let _g = sock.lock();
            7
        });
        assert_eq!(r, 7);
        // Another thread waits for the holder instead (no false EDEADLK).
        let sock = Arc::new(sock);
        let g = sock.lock();
        let other = {
            let sock = sock.clone();
            std::thread::spawn(move || guard(-1, || sock.lock().state as c_int))
        };
        std::thread::sleep(std::time::Duration::from_millis(20));
        drop(g);
        assert_eq!(other.join().unwrap(), ST_INIT as c_int);
    }
}
