//! rdma_cm ids: what each holds, its synchronous mode (a NULL channel), its creation and
//! destruction, and its options.

use super::*;

/// What the threads of a connection share with the id.
pub(super) struct IdShared {
    pub(super) alive: AtomicBool,
    pub(super) stream: Mutex<Option<TcpStream>>,
    /// The id's QP (its address, or 0). A connection's thread touches the QP only under this
    /// lock and only while `alive`; `rdma_destroy_qp` and `rdma_destroy_id` take it too.
    pub(super) qp: Mutex<usize>,
    /// The id's channel's events; another channel's after `rdma_migrate_id`. Locked while an
    /// event is queued, so none lands on a channel the id has left.
    pub(super) queue: Mutex<Arc<EventQueue>>,
    /// The id's channel (its address): what a listener's new request ids report on, read
    /// when the request comes (`rdma_migrate_id` may have moved the listener since).
    pub(super) channel: std::sync::atomic::AtomicUsize,
    /// The peer's ECE, from its REQ (a passive id) or REP (an active one); vendor 0 if it sent
    /// none (`rdma_get_remote_ece`).
    pub(super) remote_ece: Mutex<Ece>,
    /// A connection through IB CM on the wire (instead of `stream`): its manager (a leaked
    /// [`wire::WireCm`], by address) and connection.
    pub(super) wire: Mutex<Option<(usize, wire::WireId)>>,
}

/// The peer's side of a connection, as its REQ or REP said.
#[derive(Clone)]
pub(super) struct Peer {
    pub(super) qpn: u32,
    pub(super) psn: u32,
    pub(super) gid: [u8; 16],
    pub(super) mtu: u8,
    pub(super) responder_resources: u8,
    pub(super) initiator_depth: u8,
    pub(super) retry_count: u8,
    pub(super) rnr_retry_count: u8,
    /// Its ECE; `None` from a build before ECE, which is answered in its own kinds.
    pub(super) ece: Option<Ece>,
}

#[repr(C)]
pub(super) struct CmId {
    pub(super) c: rdma_cm_id,
    pub(super) shared: Arc<IdShared>,
    pub(super) device: Option<Device>,
    pub(super) listener: Option<TcpListener>,
    /// The REQ a passive id was made for.
    pub(super) request: Option<Peer>,
    pub(super) my_psn: u32,
    /// The ECE this side's REQ offers: its QP's (`ibv_query_ece` when `rdma_create_qp` makes
    /// it), else what `rdma_set_local_ece` set; vendor 0 for none.
    pub(super) local_ece: Ece,
    /// The local ACK timeout (`RDMA_OPTION_ID_ACK_TIMEOUT`), else 14 (67 ms), as ferroce's own.
    pub(super) ack_timeout: u8,
    pub(super) owns_pd: bool,
    /// CQs and channels `rdma_create_qp` made because the program passed none (librdmacm
    /// does the same); destroyed with the QP.
    pub(super) owns_cqs: bool,
    /// A synchronous id (made with a NULL channel): each call waits for its own event, on a
    /// channel of the id's own (`owns_channel`).
    pub(super) sync: bool,
    pub(super) owns_channel: bool,
    /// `RDMA_OPTION_ID_AFONLY`: bound to `::`, the id takes IPv6 requests only.
    pub(super) afonly: bool,
    /// For a passive endpoint (`rdma_create_ep`): the PD and QP attributes each request's QP
    /// is made with in `rdma_get_request`.
    pub(super) ep_qp: Option<(usize, ibv_qp_init_attr)>,
    pub(super) path: Box<ibv_sa_path_rec>,
    /// The services a listening id takes REQs for on the wire, and on which managers.
    pub(super) wire_listens: Vec<(&'static wire::WireCm, u64)>,
}

/// # Safety
/// `id` must be NULL or an id this library returned and not yet destroyed.
pub(super) unsafe fn id_of<'a>(id: *mut rdma_cm_id) -> Option<&'a mut CmId> {
    // SAFETY: `c` is the first field of the repr(C) `CmId`.
    unsafe { id.cast::<CmId>().as_mut() }
}

pub(super) fn random_psn() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: fills 4 bytes of a local.
    unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
    u32::from_ne_bytes(b) & 0x00ff_ffff
}

pub(super) fn new_id(
    channel: *mut rdma_event_channel,
    queue: Arc<EventQueue>,
    context: *mut c_void,
    ps: rdma_port_space,
) -> *mut CmId {
    Box::into_raw(Box::new(CmId {
        c: rdma_cm_id {
            channel,
            context,
            ps,
            // rdma_cm's UDP port space is UD QPs (resolved by SIDR); TCP's is RC.
            qp_type: if ps == RDMA_PS_UDP {
                IBV_QPT_UD
            } else {
                IBV_QPT_RC
            },
            ..Default::default()
        },
        shared: Arc::new(IdShared {
            alive: AtomicBool::new(true),
            stream: Mutex::new(None),
            qp: Mutex::new(0),
            queue: Mutex::new(queue),
            channel: std::sync::atomic::AtomicUsize::new(channel as usize),
            remote_ece: Mutex::new(Ece::default()),
            wire: Mutex::new(None),
        }),
        device: None,
        listener: None,
        request: None,
        my_psn: random_psn(),
        local_ece: Ece::default(),
        ack_timeout: 14,
        owns_pd: false,
        owns_cqs: false,
        sync: false,
        owns_channel: false,
        afonly: false,
        ep_qp: None,
        path: Box::default(),
        wire_listens: Vec::new(),
    }))
}

/// A new id with a channel of its own, for librdmacm's synchronous mode.
pub(super) fn new_sync_id(context: *mut c_void, ps: rdma_port_space) -> Option<*mut CmId> {
    let channel = rdma_create_event_channel();
    // SAFETY: just made.
    let queue = unsafe { channel_of(channel) }?.queue.clone();
    let id = new_id(channel, queue, context, ps);
    // SAFETY: just made, not yet handed out.
    let i = unsafe { &mut *id };
    i.sync = true;
    i.owns_channel = true;
    Some(id)
}

/// In synchronous mode, waits for the id's next event: 0 if it is `want`, else -1 with the
/// errno that event stands for. An asynchronous id returns 0 at once (its event is the
/// program's to read).
///
/// # Safety
/// `id` must be a live id of ours.
pub(super) unsafe fn wait_sync(id: *mut rdma_cm_id, want: rdma_cm_event_type) -> c_int {
    // SAFETY: the caller's contract.
    let Some(i) = (unsafe { id_of(id) }) else {
        return 0;
    };
    if !i.sync {
        return 0;
    }
    // The event the last call kept is done with now (librdmacm's `ucma_complete`).
    release_sync_event(i);
    let mut ev: *mut rdma_cm_event = std::ptr::null_mut();
    // SAFETY: the id's own channel.
    if unsafe { rdma_get_cm_event(i.c.channel, &mut ev) } != 0 {
        return -1;
    }
    // SAFETY: an event just handed out.
    let (kind, status) = unsafe { ((*ev).event, (*ev).status) };
    if kind == want && status == 0 {
        // Kept in `event` until the id's next call, as librdmacm keeps it: the program (and
        // rsockets) read the peer's private data of an ESTABLISHED there.
        i.c.event = ev;
        return 0;
    }
    // SAFETY: acknowledged once, here.
    unsafe { rdma_ack_cm_event(ev) };
    set_errno(match kind {
        RDMA_CM_EVENT_REJECTED => libc::ECONNREFUSED,
        RDMA_CM_EVENT_UNREACHABLE => libc::ENETUNREACH,
        RDMA_CM_EVENT_ADDR_ERROR | RDMA_CM_EVENT_ROUTE_ERROR => libc::EADDRNOTAVAIL,
        _ if status < 0 => -status,
        _ => libc::ECONNRESET,
    });
    -1
}

/// Acknowledges the event a synchronous id kept from its last call, if any.
pub(super) fn release_sync_event(i: &mut CmId) {
    let ev = std::mem::replace(&mut i.c.event, std::ptr::null_mut());
    if !ev.is_null() {
        // SAFETY: an event of this id's own channel, kept unacknowledged, acknowledged once.
        unsafe { rdma_ack_cm_event(ev) };
    }
}

/// `rdma_create_id`: an id for RC connections (`RDMA_PS_TCP`) reporting on `channel`.
// partly(rdma_create_id): the port spaces `RDMA_PS_IB` and `RDMA_PS_IPOIB` fail with
// `EOPNOTSUPP` (`RDMA_PS_TCP`, RC, and `RDMA_PS_UDP`, UD with SIDR, are made), and with them
// UC QPs over rdma_cm, which only `RDMA_PS_IB` carries (the REQ's transport type); UC QPs the
// program connects itself work.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: rdma_port_space,
) -> c_int {
    guard(-1, || {
        if id.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        if ps != RDMA_PS_TCP && ps != RDMA_PS_UDP {
            set_errno(libc::EOPNOTSUPP);
            return -1;
        }
        // A NULL channel asks for librdmacm's synchronous mode.
        if channel.is_null() {
            let Some(made) = new_sync_id(context, ps) else {
                return -1;
            };
            // SAFETY: checked non-null; the caller's output.
            unsafe { *id = made.cast() };
            return 0;
        }
        // SAFETY: per the API, a channel of ours.
        let Some(ch) = (unsafe { channel_of(channel) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        // SAFETY: checked non-null; the caller's output.
        unsafe { *id = new_id(channel, ch.queue.clone(), context, ps).cast() };
        0
    })
}

/// `rdma_migrate_id`: moves the id to `channel` (NULL: synchronous mode, on a channel of its
/// own), and with it the events the program has not read yet, its own and its listener's
/// connection requests, as the kernel moves them. Events come on the new channel from then on;
/// a channel the id owned (synchronous mode) is destroyed.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_migrate_id(
    id: *mut rdma_cm_id,
    channel: *mut rdma_event_channel,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API, an id of ours.
        let Some(i) = (unsafe { id_of(id) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        let (to, owned) = if channel.is_null() {
            let ch = rdma_create_event_channel();
            if ch.is_null() {
                return -1;
            }
            (ch, true)
        } else {
            (channel, false)
        };
        // SAFETY: per the API (or just made), a channel of ours.
        let Some(new_queue) = (unsafe { channel_of(to) }).map(|c| c.queue.clone()) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        {
            // Under the id's queue lock no event of it is being queued.
            let mut current = i.shared.queue();
            if !Arc::ptr_eq(&current, &new_queue) {
                let mut moved = Vec::new();
                let mut children = Vec::new();
                current
                    .events
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retain(|&e| {
                        // SAFETY: queued events are live boxes.
                        let ev = unsafe { &*(e as *const Event) };
                        let mine = ev.c.id == id || ev.c.listen_id == id;
                        if mine {
                            moved.push(e);
                            if ev.c.listen_id == id && ev.c.id != id {
                                children.push(ev.c.id);
                            }
                        }
                        !mine
                    });
                // A request not yet read moves with its new id: that id's later events follow
                // it to the new channel.
                for child in children {
                    // SAFETY: a request's id, not yet the program's (its event is unread),
                    // alive while its event is queued.
                    if let Some(c) = unsafe { id_of(child) } {
                        if !c.sync {
                            c.c.channel = to;
                            c.shared.channel.store(to as usize, Ordering::Release);
                            *c.shared.queue() = new_queue.clone();
                        }
                    }
                }
                new_queue.push_moved(moved);
                *current = new_queue;
            }
        }
        if i.sync && !channel.is_null() {
            // Leaving synchronous mode: the event its last call kept is done with.
            release_sync_event(i);
        }
        let (old, old_owned) = (i.c.channel, i.owns_channel);
        i.c.channel = to;
        i.shared.channel.store(to as usize, Ordering::Release);
        i.sync = channel.is_null();
        i.owns_channel = owned;
        if old_owned && old != to {
            // SAFETY: the id's own channel, which nothing else holds, destroyed once.
            unsafe { rdma_destroy_event_channel(old) };
        }
        0
    })
}

/// `rdma_destroy_id`: closes its connection and drops its unread events.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    guard(-1, || {
        if id.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // SAFETY: per the API, an id of ours, destroyed once.
        let b = unsafe { Box::from_raw(id.cast::<CmId>()) };
        // The ids of requests to this listener that the program never read: nobody else can
        // reach them, so they go with it (their peers hear a rejection), as with the kernel.
        let mut orphans = Vec::new();
        {
            // Under the QP lock no connection thread is using the QP; under the queue's lock
            // none is queuing an event. After both, none will.
            let _qp = b.shared.qp.lock().unwrap_or_else(|e| e.into_inner());
            let queue = b.shared.queue.lock().unwrap_or_else(|e| e.into_inner());
            let mut q = queue.events.lock().unwrap_or_else(|e| e.into_inner());
            b.shared.alive.store(false, Ordering::Release);
            q.retain(|&e| {
                // SAFETY: queued events are live boxes.
                let ev = unsafe { &*(e as *const Event) };
                let mine = ev.c.id == id || ev.c.listen_id == id;
                if ev.c.listen_id == id
                    && ev.c.id != id
                    && ev.c.event == RDMA_CM_EVENT_CONNECT_REQUEST
                {
                    orphans.push(ev.c.id as usize);
                }
                if mine {
                    // SAFETY: removed from the queue, freed once.
                    drop(unsafe { Box::from_raw(e as *mut Event) });
                }
                !mine
            });
        }
        if let Some(s) = b
            .shared
            .stream
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some((cm, conn)) = wire::of_id(&b.shared) {
            cm.release(conn);
        }
        for (cm, service) in &b.wire_listens {
            cm.unlisten(*service, &b.shared);
        }
        for child in orphans {
            // SAFETY: a request's id, never handed to the program (its event was not read),
            // destroyed once, here.
            unsafe { rdma_destroy_id(child as *mut rdma_cm_id) };
        }
        if let Some(l) = &b.listener {
            // Stops listening now, so the port may be bound again at once (the accepting
            // thread holds a clone of the socket; its accept then fails and it ends).
            // SAFETY: shutdown on a descriptor this id owns.
            unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
        }
        if b.sync && !b.c.event.is_null() {
            // The request event `rdma_get_request` kept for the program.
            // SAFETY: an event of ours, not acknowledged yet.
            unsafe { rdma_ack_cm_event(b.c.event) };
        }
        if b.owns_channel {
            // SAFETY: the id's own channel, which nothing else uses.
            unsafe { rdma_destroy_event_channel(b.c.channel) };
        }
        0
    })
}

impl CmId {
    pub(super) fn local(&self) -> Option<Local> {
        Some(Local {
            device: self.device?,
            psn: self.my_psn,
            ack_timeout: self.ack_timeout,
            ece: self.local_ece,
        })
    }
}

/// `rdma_set_option`: the local ACK timeout and IPv6-only binding are honoured, address reuse
/// is what ferroce does anyway; anything else (TOS, path records) is not supported.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_set_option(
    id: *mut rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    // SAFETY: per the API.
    let Some(i) = (unsafe { id_of(id) }) else {
        set_errno(libc::EINVAL);
        return -1;
    };
    match (level as u32, optname as u32) {
        (RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT) if optlen >= 1 && !optval.is_null() => {
            // SAFETY: at least one byte, as optlen says.
            i.ack_timeout = unsafe { *optval.cast::<u8>() }.min(31);
            0
        }
        (RDMA_OPTION_ID, RDMA_OPTION_ID_REUSEADDR) => 0,
        (RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY)
            if optlen >= std::mem::size_of::<c_int>() && !optval.is_null() =>
        {
            // SAFETY: an int, as optlen says (read unaligned: the program's buffer).
            i.afonly = unsafe { std::ptr::read_unaligned(optval.cast::<c_int>()) } != 0;
            0
        }
        _ => {
            set_errno(libc::EOPNOTSUPP);
            -1
        }
    }
}
