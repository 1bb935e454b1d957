//! Event channels and events: the queue each channel's `fd` counts, and the calls that take
//! events from it.

use super::*;

#[repr(C)]
pub(super) struct Channel {
    pub(super) c: rdma_event_channel,
    pub(super) queue: Arc<EventQueue>,
}

/// A channel's events: shared with the threads of its ids' connections, which may outlive
/// the channel (a program destroys its ids and channel while a connection winds down).
pub(super) struct EventQueue {
    /// A blocking semaphore eventfd (the channel's `fd`): one count per queued event.
    pub(super) efd: OwnedFd,
    pub(super) events: Mutex<VecDeque<usize>>,
}

#[repr(C)]
pub(super) struct Event {
    pub(super) c: rdma_cm_event,
    /// The bytes `c.param.conn.private_data` points to.
    pub(super) private: Vec<u8>,
}

impl IdShared {
    pub(super) fn post(&self, ev: Box<Event>) {
        self.queue().post(self, ev);
    }

    /// The id's channel's queue, held (events are queued under this lock, see `queue`).
    pub(super) fn queue(&self) -> std::sync::MutexGuard<'_, Arc<EventQueue>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl EventQueue {
    /// Queues an event for `id` unless the id was destroyed (checked under the queue's lock,
    /// which `rdma_destroy_id` takes too, so no event for a dead id is ever queued).
    pub(super) fn post(&self, id: &IdShared, mut ev: Box<Event>) {
        let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        if !id.alive.load(Ordering::Acquire) {
            return;
        }
        if !ev.private.is_empty() {
            // The conn arm of the union, which these events use.
            ev.c.param.conn.private_data = ev.private.as_ptr().cast();
            ev.c.param.conn.private_data_len = ev.private.len() as u8;
        }
        q.push_back(Box::into_raw(ev) as usize);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a local to our eventfd.
        let _ = unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

impl EventQueue {
    /// Queues an event taken from another queue (see `rdma_migrate_id`), counted as new.
    pub(super) fn push_moved(&self, events: Vec<usize>) {
        let mut q = self.events.lock().unwrap_or_else(|e| e.into_inner());
        for e in events {
            q.push_back(e);
            let one: u64 = 1;
            // SAFETY: writes 8 bytes from a local to our eventfd.
            let _ = unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
        }
    }
}

impl Drop for EventQueue {
    fn drop(&mut self) {
        for e in self
            .events
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            // SAFETY: each entry is a leaked Event box, freed once.
            drop(unsafe { Box::from_raw(e as *mut Event) });
        }
    }
}

pub(super) fn event(id: *mut rdma_cm_id, kind: rdma_cm_event_type, status: c_int) -> Box<Event> {
    Box::new(Event {
        c: rdma_cm_event {
            id,
            event: kind,
            status,
            ..Default::default()
        },
        private: Vec::new(),
    })
}

/// # Safety
/// `ch` must be NULL or a channel this library returned and not yet destroyed.
pub(super) unsafe fn channel_of<'a>(ch: *mut rdma_event_channel) -> Option<&'a Channel> {
    // SAFETY: `c` is the first field of the repr(C) `Channel`.
    unsafe { ch.cast::<Channel>().as_ref() }
}

/// `rdma_create_event_channel`.
#[no_mangle]
pub(super) extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    guard(std::ptr::null_mut(), || {
        // SAFETY: eventfd takes no pointers.
        let fd = unsafe { libc::eventfd(0, libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return std::ptr::null_mut();
        }
        // SAFETY: just created, ours.
        let efd = unsafe { OwnedFd::from_raw_fd(fd) };
        Box::into_raw(Box::new(Channel {
            c: rdma_event_channel { fd },
            queue: Arc::new(EventQueue {
                efd,
                events: Mutex::new(VecDeque::new()),
            }),
        }))
        .cast()
    })
}

/// `rdma_destroy_event_channel`: events not yet read are freed with it (once no connection
/// thread holds its queue any more).
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_destroy_event_channel(ch: *mut rdma_event_channel) {
    if ch.is_null() {
        return;
    }
    // SAFETY: per the API, a channel of ours, destroyed once.
    drop(unsafe { Box::from_raw(ch.cast::<Channel>()) });
}

/// `rdma_get_cm_event`: the next event; blocks unless the channel's fd is non-blocking.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    out: *mut *mut rdma_cm_event,
) -> c_int {
    guard(-1, || {
        // SAFETY: per the API.
        let Some(ch) = (unsafe { channel_of(channel) }) else {
            set_errno(libc::EINVAL);
            return -1;
        };
        if out.is_null() {
            set_errno(libc::EINVAL);
            return -1;
        }
        // The queue, not the channel: a program may destroy the channel while this thread
        // waits (rping's event thread waits on while the main thread tears down). The queue
        // and its descriptor then live on with this wait, which goes on blocking, as a read of
        // the kernel's event file does once the file is closed under it.
        let queue = ch.queue.clone();
        // A count whose event went with its destroyed id is skipped: the next read blocks (or
        // says EAGAIN on a non-blocking fd), as for a channel with nothing to report.
        let e = loop {
            let mut v: u64 = 0;
            // SAFETY: reads 8 bytes into a local; blocks per the fd's flags, as librdmacm's.
            let n = unsafe { libc::read(queue.efd.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
            if n != 8 {
                return -1;
            }
            let e = queue
                .events
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .pop_front();
            if e.is_some() {
                break e;
            }
        };
        match e {
            Some(e) => {
                let ev = e as *mut Event;
                // SAFETY: a queued event box, now the program's until acknowledged. Only
                // `rdma_get_request` and a synchronous call keep an event in `id->event`, as
                // librdmacm: an event the program acknowledges itself is never left there.
                unsafe { *out = ev.cast() };
                0
            }
            None => {
                set_errno(libc::EAGAIN);
                -1
            }
        }
    })
}

/// `rdma_ack_cm_event`.
#[no_mangle]
pub(super) unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    if event.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: an event this library handed out, acknowledged once.
    drop(unsafe { Box::from_raw(event.cast::<Event>()) });
    0
}

/// `rdma_event_str`.
#[no_mangle]
pub(super) extern "C" fn rdma_event_str(event: rdma_cm_event_type) -> *const c_char {
    let s: &CStr = match event {
        RDMA_CM_EVENT_ADDR_RESOLVED => c"RDMA_CM_EVENT_ADDR_RESOLVED",
        RDMA_CM_EVENT_ADDR_ERROR => c"RDMA_CM_EVENT_ADDR_ERROR",
        RDMA_CM_EVENT_ROUTE_RESOLVED => c"RDMA_CM_EVENT_ROUTE_RESOLVED",
        RDMA_CM_EVENT_ROUTE_ERROR => c"RDMA_CM_EVENT_ROUTE_ERROR",
        RDMA_CM_EVENT_CONNECT_REQUEST => c"RDMA_CM_EVENT_CONNECT_REQUEST",
        RDMA_CM_EVENT_CONNECT_RESPONSE => c"RDMA_CM_EVENT_CONNECT_RESPONSE",
        RDMA_CM_EVENT_CONNECT_ERROR => c"RDMA_CM_EVENT_CONNECT_ERROR",
        RDMA_CM_EVENT_UNREACHABLE => c"RDMA_CM_EVENT_UNREACHABLE",
        RDMA_CM_EVENT_REJECTED => c"RDMA_CM_EVENT_REJECTED",
        RDMA_CM_EVENT_ESTABLISHED => c"RDMA_CM_EVENT_ESTABLISHED",
        RDMA_CM_EVENT_DISCONNECTED => c"RDMA_CM_EVENT_DISCONNECTED",
        RDMA_CM_EVENT_DEVICE_REMOVAL => c"RDMA_CM_EVENT_DEVICE_REMOVAL",
        RDMA_CM_EVENT_MULTICAST_JOIN => c"RDMA_CM_EVENT_MULTICAST_JOIN",
        RDMA_CM_EVENT_MULTICAST_ERROR => c"RDMA_CM_EVENT_MULTICAST_ERROR",
        RDMA_CM_EVENT_ADDR_CHANGE => c"RDMA_CM_EVENT_ADDR_CHANGE",
        RDMA_CM_EVENT_TIMEWAIT_EXIT => c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
        _ => c"UNKNOWN EVENT",
    };
    s.as_ptr()
}
