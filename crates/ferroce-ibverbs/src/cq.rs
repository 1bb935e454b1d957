//! Completion channels and completion queues: `ibv_create_comp_channel`, `ibv_create_cq`,
//! `ibv_get_cq_event`, and the `poll_cq`/`req_notify_cq` operations the inline calls reach.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use ferroce_proto::{WcOpcode, WcStatus, WorkCompletion};

use crate::abi::*;
use crate::device::{limits, Context};
use crate::{errno_of, guard, set_errno};

#[repr(C)]
struct Channel {
    c: ibv_comp_channel,
    inner: ferroce::CompletionChannel,
    /// The CQs tied to the channel, by [`ferroce::CompletionQueue::event_id`].
    cqs: Mutex<HashMap<usize, usize>>,
}

#[repr(C)]
pub(crate) struct Cq {
    pub c: ibv_cq,
    pub inner: ferroce::CompletionQueue,
    channel: *mut Channel,
    /// What a UD receive's `sl` says of the datagram's L3 header (see [`to_ibv_wc`]).
    ud_l3_type: u8,
    /// The completion events handed out for this CQ and those acknowledged, which
    /// `ibv_destroy_cq` waits to see equal. In an `Arc` so that `ibv_ack_cq_events` can let go of
    /// the lock after the CQ is gone (see there).
    events: Arc<Events>,
}

/// What [`Cq::events`] counts: rdma-core keeps the same in `ibv_cq`'s `mutex`, `cond` and
/// `comp_events_completed`. Those fields are left untouched here: every entry point holds a
/// shared `&Cq`, which covers `c`, so writing a field of it while another thread polls would
/// be a data race; the count lives in Rust's own lock instead.
#[derive(Debug, Default)]
struct Events {
    count: Mutex<EventCount>,
    /// Signalled at each acknowledgement, for a destroy that waits.
    acked_cv: Condvar,
}

#[derive(Debug, Default)]
struct EventCount {
    /// Events `ibv_get_cq_event` returned for the CQ.
    reported: u64,
    /// Events the program acknowledged with `ibv_ack_cq_events`.
    acked: u64,
}

impl Cq {
    /// # Safety
    /// `cq` must be a CQ this library returned and not yet destroyed.
    pub(crate) unsafe fn from_c<'a>(cq: *mut ibv_cq) -> Option<&'a Cq> {
        // SAFETY: `c` is the first field of the repr(C) `Cq`.
        unsafe { cq.cast::<Cq>().as_ref() }
    }
}

/// `ibv_create_comp_channel`.
#[no_mangle]
unsafe extern "C" fn ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    guard(std::ptr::null_mut(), || {
        // SAFETY: per the API.
        let Some(c) = (unsafe { Context::from_c(ctx) }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        match c.ctx.create_comp_channel() {
            Ok(inner) => {
                let c = ibv_comp_channel {
                    context: ctx,
                    fd: inner.as_raw_fd(),
                    refcnt: 0,
                };
                let ch = Channel {
                    c,
                    inner,
                    cqs: Mutex::new(HashMap::new()),
                };
                Box::into_raw(Box::new(ch)).cast()
            }
            Err(e) => {
                set_errno(errno_of(&e));
                std::ptr::null_mut()
            }
        }
    })
}

/// `ibv_destroy_comp_channel`: EBUSY while a CQ still uses it, as rdma-core.
#[no_mangle]
unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> libc::c_int {
    guard(libc::EFAULT, || {
        let ch = ch.cast::<Channel>();
        // SAFETY: per the API, a channel from ibv_create_comp_channel.
        let Some(c) = (unsafe { ch.as_ref() }) else {
            return libc::EINVAL;
        };
        if !c.cqs.lock().unwrap_or_else(|e| e.into_inner()).is_empty() {
            return libc::EBUSY;
        }
        // SAFETY: destroyed once; no CQ points to it any more.
        drop(unsafe { Box::from_raw(ch) });
        0
    })
}

/// The fewest entries a drop-in CQ has, whatever the program asked for (ferroce's own floor).
const MIN_CQ_CAPACITY: usize = 63;

/// The capacity a CQ asked for with `cqe` entries gets: at least `cqe`, rounded up to a power
/// of two less one (as rxe sizes its queues: a ring with a slot kept free) and never under
/// [`MIN_CQ_CAPACITY`]; `cq->cqe` reports it, as the verbs API allows ("at least" the entries
/// asked for; rdma-core's providers round up too).
///
/// Why a floor: programs size a CQ to their own loop and then rely on timing the verbs do not
/// promise. perftest's `-e` latency loop gives its send CQ one entry and polls it once per
/// completion event; when an event wait returns before the send's completion landed, that
/// completion stays behind, and a CQ of exactly one entry overflows at the next (an error the
/// whole run dies of). With the spin of `ibv_get_cq_event` that happened in every run; with 63
/// entries, runs of 20000 iterations pass over UDP and over shared memory.
fn rounded_capacity(cqe: usize) -> usize {
    let max = limits::MAX_CQE as usize;
    (cqe.max(MIN_CQ_CAPACITY) + 1)
        .checked_next_power_of_two()
        .map_or(max, |n| (n - 1).min(max))
        .max(cqe)
}

/// `ibv_create_cq`: a CQ of at least `cqe` entries (see [`rounded_capacity`]).
#[no_mangle]
unsafe extern "C" fn ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: libc::c_int,
    cq_context: *mut libc::c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: libc::c_int,
) -> *mut ibv_cq {
    guard(std::ptr::null_mut(), || {
        // SAFETY: per the API.
        let Some(c) = (unsafe { Context::from_c(ctx) }) else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        // One completion vector, as `num_comp_vectors` says.
        if comp_vector != 0 {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        }
        let Some(capacity) = usize::try_from(cqe)
            .ok()
            .filter(|&n| n >= 1 && n <= limits::MAX_CQE as usize)
            .map(rounded_capacity)
        else {
            set_errno(libc::EINVAL);
            return std::ptr::null_mut();
        };
        let ch = channel.cast::<Channel>();
        // SAFETY: per the API, a channel of this context or NULL.
        let ch_ref = unsafe { ch.as_ref() };
        let inner = match c.ctx.create_cq(capacity, ch_ref.map(|h| &h.inner)) {
            Ok(q) => q,
            Err(e) => {
                set_errno(errno_of(&e));
                return std::ptr::null_mut();
            }
        };
        let id = inner.event_id();
        let cq = Box::into_raw(Box::new(Cq {
            c: ibv_cq {
                context: ctx,
                channel,
                cq_context,
                cqe: capacity as i32,
                ..Default::default()
            },
            inner,
            channel: ch,
            ud_l3_type: if ferroce::ip_of(c.ctx.gid()).is_ipv4() {
                L3_IPV4
            } else {
                L3_IPV6
            },
            events: Arc::default(),
        }));
        if let Some(h) = ch_ref {
            h.cqs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(id, cq as usize);
        }
        cq.cast()
    })
}

/// `ibv_destroy_cq`: as rdma-core's, waits until every completion event
/// `ibv_get_cq_event` returned for the CQ was acknowledged (a program that never acknowledges
/// one blocks here, as it would on rdma-core). Events the CQ raised that no one took yet are
/// dropped, as the kernel drops them.
#[no_mangle]
unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> libc::c_int {
    guard(libc::EFAULT, || {
        let p = cq.cast::<Cq>();
        // SAFETY: per the API, a CQ from ibv_create_cq, not yet destroyed. Only a shared
        // reference while other threads may still hold one (a getter finishing with its event,
        // an acknowledger); the box is freed below, after they are done.
        let Some(q) = (unsafe { p.as_ref() }) else {
            return libc::EINVAL;
        };
        // First out of the channel's table, under its lock: from then on `ibv_get_cq_event`
        // cannot hand the CQ out, and any getter that found it there has already counted its
        // event (it counts before letting go of the table's lock).
        // SAFETY: a channel outlives its CQs (its destroy refuses while any is left).
        if let Some(h) = unsafe { q.channel.as_ref() } {
            h.cqs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&q.inner.event_id());
        }
        // Then wait for every event handed out to be acknowledged: until then the program may
        // still use the CQ it got from the event (rdma-core's one-to-one rule).
        let events = &q.events;
        let mut n = events.count.lock().unwrap_or_else(|e| e.into_inner());
        while n.acked < n.reported {
            n = events.acked_cv.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        drop(n);
        // SAFETY: out of the channel's table and every event acknowledged, so no other thread
        // of a correct program holds the CQ now; destroyed once, per the API.
        drop(unsafe { Box::from_raw(p) });
        0
    })
}

/// `ibv_resize_cq`: a ferroce CQ keeps the capacity it was created with.
#[no_mangle]
unsafe extern "C" fn ibv_resize_cq(_cq: *mut ibv_cq, _cqe: libc::c_int) -> libc::c_int {
    libc::EOPNOTSUPP
}

fn fd_is_nonblocking(fd: RawFd) -> bool {
    // SAFETY: F_GETFL takes no pointer.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    flags >= 0 && flags & libc::O_NONBLOCK != 0
}

/// `ibv_get_cq_event`: the next armed CQ that fired; blocks unless the program made the
/// channel's descriptor non-blocking (then EAGAIN, as rdma-core).
#[no_mangle]
unsafe extern "C" fn ibv_get_cq_event(
    channel: *mut ibv_comp_channel,
    cq: *mut *mut ibv_cq,
    cq_context: *mut *mut libc::c_void,
) -> libc::c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(ch) = (unsafe { channel.cast::<Channel>().as_ref() }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let mut spun = false;
        loop {
            match ch.inner.try_next_event() {
                Ok(Some(id)) => {
                    let table = ch.cqs.lock().unwrap_or_else(|e| e.into_inner());
                    // A CQ destroyed after it fired leaves an event no one can take.
                    let Some(&addr) = table.get(&id) else {
                        continue;
                    };
                    // SAFETY: the CQ is in the channel's table, so not freed: `ibv_destroy_cq`
                    // takes it out under this lock before anything else, and then waits for
                    // the event counted here to be acknowledged before it frees the CQ.
                    let q = unsafe { &*(addr as *const Cq) };
                    q.events
                        .count
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .reported += 1;
                    let context = q.c.cq_context;
                    drop(table);
                    // SAFETY: the output pointers are the caller's (NULL ones are skipped).
                    unsafe {
                        if !cq.is_null() {
                            *cq = addr as *mut ibv_cq;
                        }
                        if !cq_context.is_null() {
                            *cq_context = context;
                        }
                    }
                    return 0;
                }
                Ok(None) => {}
                Err(e) => {
                    set_errno(errno_of(&e));
                    return -1;
                }
            }
            if fd_is_nonblocking(ch.c.fd) {
                // The program will wait in its own poll or epoll: the engine must not be
                // waiting for it to poll.
                ch.inner.spin_for_event(Duration::ZERO);
                set_errno(libc::EAGAIN);
                return -1;
            }
            // Before sleeping, drive progress briefly: the event may be a round trip away (see
            // `CompletionChannel::spin_for_event`); once per call. Every later turn (an event
            // of a destroyed CQ, dropped above) only hands progress back before it blocks.
            let budget = if spun { Duration::ZERO } else { Duration::MAX };
            spun = true;
            if ch.inner.spin_for_event(budget) {
                continue;
            }
            let mut p = libc::pollfd {
                fd: ch.c.fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one live pollfd.
            if unsafe { libc::poll(&mut p, 1, -1) } < 0
                && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                return -1;
            }
        }
    })
}

/// `ibv_ack_cq_events`: counts `nevents` events acknowledged, under the CQ's lock, and wakes
/// a destroy waiting for them (as rdma-core). Safe to call from any thread while others poll,
/// arm or take events.
#[no_mangle]
unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: libc::c_uint) {
    guard((), || {
        // SAFETY: per the API, a live CQ: it has unacknowledged events (these), so a destroy
        // waits for this call before it frees the CQ.
        let Some(q) = (unsafe { Cq::from_c(cq) }) else {
            return;
        };
        // Our own reference to the counter: once `acked` is raised a waiting destroy may free
        // the CQ, while this thread is still releasing the lock and signalling; the `Arc` keeps
        // the mutex and condvar alive until then. `q` is not used after this line.
        let events = Arc::clone(&q.events);
        let mut n = events.count.lock().unwrap_or_else(|e| e.into_inner());
        n.acked = n.acked.saturating_add(u64::from(nevents));
        events.acked_cv.notify_all();
    })
}

/// `ctx->ops.req_notify_cq`.
pub(crate) unsafe extern "C" fn req_notify_cq(
    cq: *mut ibv_cq,
    solicited_only: libc::c_int,
) -> libc::c_int {
    guard(libc::EFAULT, || {
        // SAFETY: per the API.
        let Some(q) = (unsafe { Cq::from_c(cq) }) else {
            return libc::EINVAL;
        };
        match q.inner.req_notify(solicited_only != 0) {
            Ok(()) => 0,
            Err(e) => errno_of(&e),
        }
    })
}

fn wc_status(s: WcStatus) -> ibv_wc_status {
    match s {
        WcStatus::Success => IBV_WC_SUCCESS,
        WcStatus::LocalLengthError => IBV_WC_LOC_LEN_ERR,
        WcStatus::LocalProtectionError => IBV_WC_LOC_PROT_ERR,
        WcStatus::LocalQpOperationError => IBV_WC_LOC_QP_OP_ERR,
        WcStatus::RemoteAccessError => IBV_WC_REM_ACCESS_ERR,
        WcStatus::RemoteInvalidRequestError => IBV_WC_REM_INV_REQ_ERR,
        WcStatus::RemoteOperationalError => IBV_WC_REM_OP_ERR,
        WcStatus::RnrRetryExceeded => IBV_WC_RNR_RETRY_EXC_ERR,
        WcStatus::TransportRetryExceeded => IBV_WC_RETRY_EXC_ERR,
        WcStatus::WorkRequestFlushed => IBV_WC_WR_FLUSH_ERR,
    }
}

fn wc_opcode(o: WcOpcode) -> ibv_wc_opcode {
    match o {
        WcOpcode::Send => IBV_WC_SEND,
        WcOpcode::RdmaWrite => IBV_WC_RDMA_WRITE,
        WcOpcode::RdmaRead => IBV_WC_RDMA_READ,
        WcOpcode::CompareSwap => IBV_WC_COMP_SWAP,
        WcOpcode::FetchAdd => IBV_WC_FETCH_ADD,
        WcOpcode::Recv => IBV_WC_RECV,
        WcOpcode::RecvRdmaWithImm => IBV_WC_RECV_RDMA_WITH_IMM,
    }
}

/// RoCE v2 datagram types, as RoCE NICs report them in a UD receive's `sl` (a service level
/// means nothing on Ethernet): UCX reads it to find the destination address in the GRH.
const L3_IPV6: u8 = 0x1;
const L3_IPV4: u8 = 0x2;

/// A ferroce completion as rdma-core's `ibv_wc`. The immediate is in network byte order, as
/// on the wire and as programs expect (they `ntohl` it). A UD receive's `sl` is
/// `ud_l3_type`.
pub(crate) fn to_ibv_wc(w: &WorkCompletion, ud_l3_type: u8) -> ibv_wc {
    let mut flags = 0;
    let mut imm_or_rkey = 0u32;
    if let Some(imm) = w.imm_data {
        flags |= IBV_WC_WITH_IMM;
        imm_or_rkey = imm.to_be();
    } else if let Some(rkey) = w.invalidated_rkey {
        flags |= IBV_WC_WITH_INV;
        imm_or_rkey = rkey;
    }
    // A UD receive: its buffer starts with the GRH.
    let mut sl = 0;
    if w.src_qp.is_some() {
        flags |= IBV_WC_GRH;
        sl = ud_l3_type;
    }
    ibv_wc {
        wr_id: w.wr_id,
        status: wc_status(w.status),
        opcode: wc_opcode(w.opcode),
        vendor_err: 0,
        byte_len: w.byte_len,
        __bindgen_anon_1: ibv_wc__bindgen_ty_1 {
            invalidated_rkey: imm_or_rkey,
        },
        qp_num: w.qp_num,
        src_qp: w.src_qp.unwrap_or(0),
        wc_flags: flags,
        pkey_index: 0,
        slid: 0,
        sl,
        dlid_path_bits: 0,
    }
}

/// `ctx->ops.poll_cq`: up to `num_entries` completions, oldest first; a negative value on a
/// CQ overflow (reported once; no completion is lost).
pub(crate) unsafe extern "C" fn poll_cq(
    cq: *mut ibv_cq,
    num_entries: libc::c_int,
    wc: *mut ibv_wc,
) -> libc::c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(q) = (unsafe { Cq::from_c(cq) }) else {
            return -1;
        };
        let want = usize::try_from(num_entries).unwrap_or(0);
        if want == 0 || wc.is_null() {
            return 0;
        }
        if want == 1 {
            // The ping-pong case: one completion, without filling a whole buffer first.
            return match q.inner.poll_one() {
                Ok(Some(w)) => {
                    // SAFETY: the caller's array holds at least one entry.
                    unsafe { *wc = to_ibv_wc(&w, q.ud_l3_type) };
                    1
                }
                Ok(None) => 0,
                Err(e) => {
                    set_errno(errno_of(&e));
                    -1
                }
            };
        }
        let mut buf = [ferroce::empty_wc(); 32];
        let mut done = 0usize;
        while done < want {
            let chunk = (want - done).min(buf.len());
            let n = match q.inner.poll(&mut buf[..chunk]) {
                Ok(n) => n,
                Err(e) => {
                    set_errno(errno_of(&e));
                    return if done > 0 { done as i32 } else { -1 };
                }
            };
            for (i, w) in buf[..n].iter().enumerate() {
                // SAFETY: done + i < want = the caller's array length.
                unsafe { *wc.add(done + i) = to_ibv_wc(w, q.ud_l3_type) };
            }
            done += n;
            if n < chunk {
                break;
            }
        }
        done as libc::c_int
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_round_up_to_a_power_of_two_less_one_with_a_floor() {
        assert_eq!(rounded_capacity(1), 63);
        assert_eq!(rounded_capacity(63), 63);
        assert_eq!(rounded_capacity(64), 127);
        assert_eq!(rounded_capacity(100), 127);
        assert_eq!(rounded_capacity(127), 127);
        assert_eq!(rounded_capacity(128), 255);
        let max = limits::MAX_CQE as usize;
        assert_eq!(rounded_capacity(max - 1), max - 1);
        assert_eq!(rounded_capacity(max), max);
    }
}
