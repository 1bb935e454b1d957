//! The collectives as a table of C functions, for the package's C++ c10d backend
//! (`ferroce/csrc/ProcessGroupFerroce.cpp`, built against the installed torch).
//!
//! Why C++ at all: torch routes each device's tensors to a backend only if that backend is a
//! C++ `c10d::Backend`, and torch 2.11 (what GPU machines carry) cannot make one from Python
//! ("No constructor defined!"). A C++ backend also gives torch a C++ `Work`, whose
//! `is_completed()` and `source_rank()` torch reads directly (its wrapper of a Python Work
//! forwards only `wait` and `get_future`). The C++ backend queues each operation to a worker
//! thread and calls these functions there, without the GIL and without Python objects.
//!
//! How the backend gets them: `_coll_api()` returns a capsule named [`API_CAPSULE`] holding one
//! [`CollApi`]; the backend's constructor calls [`CollApi::take`] on the `Communicator` Python
//! made (the endpoint exchange runs in Python, over torch's store), which moves the
//! communicator out of the Python object into a box the backend owns (the Python object is
//! empty afterwards: a use of it raises) and frees with [`CollApi::free`]. Each other function
//! takes that box and raw buffers: the backend passes the data pointers of tensors it holds
//! for the whole call (at::Tensor references captured by the queued operation), as gloo's
//! backend does. No address passes through Python, as in the rest of the extension.
//!
//! Every function returns 0, or writes a message into `err` (UTF-8, NUL-terminated, cut to
//! `err_len` bytes) and returns a [`Status`] code; a panic is caught and reported the same way,
//! never unwound into C++.

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Duration;

use ferroce_coll::{AbortHandle, CollError, DataType, ReduceOp};
use pyo3::prelude::*;
use pyo3::types::PyCapsule;

use crate::Communicator;

/// The capsule's name, which the C++ side asks `PyCapsule_GetPointer` for.
pub const API_CAPSULE: &CStr = c"ferroce._ferroce.coll_api";

/// The table's version: the C++ side refuses another (a package built from mixed sources).
pub const API_VERSION: u32 = 3;

/// What a function returns (the C++ side maps them to torch's error types).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Done.
    Ok = 0,
    /// Bad arguments (a size, a rank, a type or operator ferroce lacks).
    Invalid = 1,
    /// A peer stopped answering within the timeout.
    Timeout = 2,
    /// A peer failed, left, or called another collective.
    Peer = 3,
    /// Anything else (a ferroce call, a panic).
    Other = 4,
}

/// The communicator a backend owns, and whether a panic left it in an unknown state (then
/// every later call fails: a panic may have stopped a collective between its sends and the
/// completions the next call's safety rests on).
pub struct Comm {
    comm: ferroce_coll::Communicator,
    poisoned: bool,
}

/// ferroce-coll's collectives, for C (the layout `ProcessGroupFerroce.cpp` declares).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct CollApi {
    /// [`API_VERSION`].
    pub version: u32,
    /// `size_of::<CollApi>()`, checked by the C++ side too.
    pub size: u32,
    /// Moves the communicator out of a Python `Communicator` (the GIL held); null on error.
    pub take: unsafe extern "C" fn(*mut pyo3::ffi::PyObject, *mut c_char, usize) -> *mut Comm,
    /// Frees what `take` returned.
    pub free: unsafe extern "C" fn(*mut Comm),
    /// Sets the timeout in seconds.
    pub set_timeout: unsafe extern "C" fn(*mut Comm, f64),
    /// The timeout in seconds.
    pub timeout: unsafe extern "C" fn(*const Comm) -> f64,
    /// allreduce(comm, buf, bytes, dtype, op, err, err_len), in place.
    pub allreduce:
        unsafe extern "C" fn(*mut Comm, *mut c_void, usize, u32, u32, *mut c_char, usize) -> Status,
    /// broadcast(comm, buf, bytes, root, err, err_len).
    pub broadcast:
        unsafe extern "C" fn(*mut Comm, *mut c_void, usize, usize, *mut c_char, usize) -> Status,
    /// reduce(comm, buf, bytes, dtype, op, root, err, err_len), in place at the root.
    pub reduce: unsafe extern "C" fn(
        *mut Comm,
        *mut c_void,
        usize,
        u32,
        u32,
        usize,
        *mut c_char,
        usize,
    ) -> Status,
    /// allgather(comm, in, in_bytes, out, out_bytes, err, err_len).
    pub allgather: unsafe extern "C" fn(
        *mut Comm,
        *const c_void,
        usize,
        *mut c_void,
        usize,
        *mut c_char,
        usize,
    ) -> Status,
    /// reduce_scatter(comm, in, in_bytes, out, out_bytes, dtype, op, err, err_len).
    pub reduce_scatter: unsafe extern "C" fn(
        *mut Comm,
        *const c_void,
        usize,
        *mut c_void,
        usize,
        u32,
        u32,
        *mut c_char,
        usize,
    ) -> Status,
    /// alltoall(comm, in, in_bytes, out, out_bytes, err, err_len): equal blocks.
    pub alltoall: unsafe extern "C" fn(
        *mut Comm,
        *const c_void,
        usize,
        *mut c_void,
        usize,
        *mut c_char,
        usize,
    ) -> Status,
    /// sendrecv(comm, out, out_bytes, to, into, into_bytes, from, err, err_len): either side
    /// skipped with `usize::MAX` as its rank.
    pub sendrecv: unsafe extern "C" fn(
        *mut Comm,
        *const c_void,
        usize,
        usize,
        *mut c_void,
        usize,
        usize,
        *mut c_char,
        usize,
    ) -> Status,
    /// barrier(comm, err, err_len).
    pub barrier: unsafe extern "C" fn(*mut Comm, *mut c_char, usize) -> Status,
    /// recv_any(comm, into, into_bytes, tag, &from, err, err_len): a send of that length and
    /// tag from whichever rank's comes first; `from` gets the rank.
    pub recv_any: unsafe extern "C" fn(
        *mut Comm,
        *mut c_void,
        usize,
        u32,
        *mut usize,
        *mut c_char,
        usize,
    ) -> Status,
    /// start_send(comm, buf, len, to, tag, &ticket, err, err_len): starts a send (see
    /// [`ferroce_coll::Communicator::start_send`]); `buf` stays valid and unwritten until its
    /// ticket is reported, a call fails, or the communicator is freed.
    pub start_send: unsafe extern "C" fn(
        *mut Comm,
        *const c_void,
        usize,
        usize,
        u32,
        *mut u64,
        *mut c_char,
        usize,
    ) -> Status,
    /// start_recv(comm, buf, len, from, tag, &ticket, err, err_len): starts a receive; `buf` stays
    /// valid, and untouched by anything else, until as for `start_send`.
    pub start_recv: unsafe extern "C" fn(
        *mut Comm,
        *mut c_void,
        usize,
        usize,
        u32,
        *mut u64,
        *mut c_char,
        usize,
    ) -> Status,
    /// progress(comm, wait_seconds, tickets, capacity, &count, &moved, err, err_len): moves
    /// what was started on for up to `wait_seconds` and writes the tickets of those that
    /// completed (at most `capacity`; the rest come next time), and whether anything moved. A
    /// failure (or an abort) ends every operation in flight.
    pub progress: unsafe extern "C" fn(
        *mut Comm,
        f64,
        *mut u64,
        usize,
        *mut usize,
        *mut u8,
        *mut c_char,
        usize,
    ) -> Status,
    /// abort_handle(comm): a handle that aborts the communicator from any thread (taken while
    /// no other thread uses `comm`); null if `comm` is. Freed with `abort_free`.
    pub abort_handle: unsafe extern "C" fn(*mut Comm) -> *mut AbortHandle,
    /// abort_raise(handle): the call under way on the communicator fails at once with
    /// "aborted", and so does every later one (safe from any thread, while the handle lives).
    pub abort_raise: unsafe extern "C" fn(*const AbortHandle),
    /// abort_free(handle): frees what `abort_handle` returned.
    pub abort_free: unsafe extern "C" fn(*mut AbortHandle),
}

static API: CollApi = CollApi {
    version: API_VERSION,
    size: std::mem::size_of::<CollApi>() as u32,
    take,
    free,
    set_timeout,
    timeout,
    allreduce,
    broadcast,
    reduce,
    allgather,
    reduce_scatter,
    alltoall,
    sendrecv,
    barrier,
    recv_any,
    start_send,
    start_recv,
    progress,
    abort_handle,
    abort_raise,
    abort_free,
};

/// The capsule holding the table (see the module doc): a copy of it, which the capsule's
/// pointer names (`PyCapsule_GetPointer` gives the address of the value the capsule holds).
#[pyfunction]
pub fn _coll_api(py: Python<'_>) -> PyResult<Bound<'_, PyCapsule>> {
    PyCapsule::new(py, API, Some(API_CAPSULE.to_owned()))
}

/// Element types by the number the C++ side uses (its `ScalarType` map).
fn dtype(code: u32) -> Option<DataType> {
    Some(match code {
        0 => DataType::F32,
        1 => DataType::F64,
        2 => DataType::F16,
        3 => DataType::Bf16,
        4 => DataType::I32,
        5 => DataType::I64,
        6 => DataType::U8,
        _ => return None,
    })
}

/// Operators by the number the C++ side uses.
fn op(code: u32) -> Option<ReduceOp> {
    Some(match code {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Prod,
        2 => ReduceOp::Min,
        3 => ReduceOp::Max,
        4 => ReduceOp::Avg,
        _ => return None,
    })
}

/// Writes `msg` into `err` (at most `len` bytes with the NUL, cut at a character boundary).
///
/// # Safety
/// `err` is null or points at `len` writable bytes.
unsafe fn report(err: *mut c_char, len: usize, msg: &str) {
    if err.is_null() || len == 0 {
        return;
    }
    let mut n = msg.len().min(len - 1);
    while !msg.is_char_boundary(n) {
        n -= 1;
    }
    // SAFETY: the caller's contract: `len` bytes at `err`, and n + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(msg.as_ptr(), err.cast::<u8>(), n);
        *err.add(n) = 0;
    }
}

fn status_of(e: &CollError) -> Status {
    match e {
        CollError::Timeout { .. } => Status::Timeout,
        CollError::Transfer { .. }
        | CollError::Mismatch { .. }
        | CollError::OutOfStep { .. }
        | CollError::PeerFailed { .. }
        | CollError::Broken(_) => Status::Peer,
        CollError::Size { .. } | CollError::BadRank { .. } | CollError::Reduce(_) => {
            Status::Invalid
        }
        _ => Status::Other,
    }
}

/// Runs `f` on the communicator, reporting its error or panic.
///
/// # Safety
/// `comm` came from `take` and is not used by another thread meanwhile; `err` as in [`report`].
unsafe fn run(
    comm: *mut Comm,
    err: *mut c_char,
    err_len: usize,
    f: impl FnOnce(&mut ferroce_coll::Communicator) -> Result<(), CollError>,
) -> Status {
    if comm.is_null() {
        // SAFETY: passed on from the caller.
        unsafe { report(err, err_len, "the ferroce communicator is gone") };
        return Status::Other;
    }
    // SAFETY: the caller's contract: a live box of ours, used by one thread at a time.
    let Comm { comm: c, poisoned } = unsafe { &mut *comm };
    if *poisoned {
        // SAFETY: passed on from the caller.
        unsafe {
            report(
                err,
                err_len,
                "the ferroce communicator is unusable after a panic",
            )
        };
        return Status::Other;
    }
    match catch_unwind(AssertUnwindSafe(|| f(c))) {
        Ok(Ok(())) => Status::Ok,
        Ok(Err(e)) => {
            // SAFETY: passed on from the caller.
            unsafe { report(err, err_len, &e.to_string()) };
            status_of(&e)
        }
        Err(_) => {
            *poisoned = true;
            // SAFETY: passed on from the caller.
            unsafe {
                report(
                    err,
                    err_len,
                    "ferroce panicked (a bug): the communicator is unusable",
                )
            };
            Status::Other
        }
    }
}

/// A byte slice from C, empty for a null pointer with length 0.
///
/// # Safety
/// `p` points at `len` readable bytes that stay unchanged (no writer) for `'a`, or `len` is 0.
unsafe fn bytes<'a>(p: *const c_void, len: usize) -> Option<&'a [u8]> {
    if len == 0 {
        return Some(&[]);
    }
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    Some(unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) })
}

/// A mutable byte slice from C, empty for a null pointer with length 0.
///
/// # Safety
/// `p` points at `len` writable bytes that nothing else reads or writes for `'a`, or `len` is 0.
unsafe fn bytes_mut<'a>(p: *mut c_void, len: usize) -> Option<&'a mut [u8]> {
    if len == 0 {
        return Some(&mut []);
    }
    if p.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    Some(unsafe { std::slice::from_raw_parts_mut(p.cast::<u8>(), len) })
}

/// Whether two byte ranges overlap (ferroce-coll reads one while writing the other, and Rust
/// may not hold a shared and a mutable view of the same bytes).
fn overlap(a: *const c_void, a_len: usize, b: *const c_void, b_len: usize) -> bool {
    let (a, b) = (a as usize, b as usize);
    a_len > 0 && b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

macro_rules! invalid {
    ($err:expr, $len:expr, $($msg:tt)*) => {{
        // SAFETY: passed on from the caller.
        unsafe { report($err, $len, &format!($($msg)*)) };
        return Status::Invalid;
    }};
}

/// # Safety
/// The GIL is held; `obj` is a live Python object; `err` as in [`report`].
unsafe extern "C" fn take(
    obj: *mut pyo3::ffi::PyObject,
    err: *mut c_char,
    err_len: usize,
) -> *mut Comm {
    let got = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: the caller holds the GIL (the C++ constructor runs in a Python call).
        let py = unsafe { Python::assume_gil_acquired() };
        if obj.is_null() {
            return Err("no communicator".to_string());
        }
        // SAFETY: a live object the caller holds a reference to for this call.
        let any = unsafe { Bound::from_borrowed_ptr(py, obj) };
        let c = any
            .downcast::<Communicator>()
            .map_err(|_| "not a ferroce Communicator".to_string())?;
        let mut c = c.try_borrow_mut().map_err(|e| e.to_string())?;
        c.comm
            .take()
            .map(|comm| {
                Box::into_raw(Box::new(Comm {
                    comm,
                    poisoned: false,
                }))
            })
            .ok_or_else(|| "the communicator was already taken by a backend".to_string())
    }));
    match got {
        Ok(Ok(p)) => p,
        Ok(Err(msg)) => {
            // SAFETY: passed on from the caller.
            unsafe { report(err, err_len, &msg) };
            std::ptr::null_mut()
        }
        Err(_) => {
            // SAFETY: passed on from the caller.
            unsafe { report(err, err_len, "ferroce panicked (a bug)") };
            std::ptr::null_mut()
        }
    }
}

/// # Safety
/// `comm` came from `take` (or is null) and is not used afterwards.
unsafe extern "C" fn free(comm: *mut Comm) {
    if !comm.is_null() {
        // SAFETY: a box of ours, given back once (the caller's contract). Dropping it closes
        // the QPs; a panic there must not unwind into C++.
        let _ = catch_unwind(AssertUnwindSafe(|| drop(unsafe { Box::from_raw(comm) })));
    }
}

/// # Safety
/// `comm` came from `take` and no other thread uses it meanwhile.
unsafe extern "C" fn set_timeout(comm: *mut Comm, seconds: f64) {
    if comm.is_null() || !seconds.is_finite() {
        return;
    }
    if let Ok(t) = Duration::try_from_secs_f64(seconds.max(0.001)) {
        // SAFETY: the caller's contract.
        unsafe { (*comm).comm.set_timeout(t) };
    }
}

/// # Safety
/// `comm` came from `take` and no other thread changes it meanwhile.
unsafe extern "C" fn timeout(comm: *const Comm) -> f64 {
    if comm.is_null() {
        return 0.0;
    }
    // SAFETY: the caller's contract.
    unsafe { (*comm).comm.timeout().as_secs_f64() }
}

/// # Safety
/// As [`run`]; `buf` points at `len` writable bytes nothing else touches during the call.
unsafe extern "C" fn allreduce(
    comm: *mut Comm,
    buf: *mut c_void,
    len: usize,
    dt: u32,
    o: u32,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    let (Some(t), Some(o)) = (dtype(dt), op(o)) else {
        invalid!(
            err,
            err_len,
            "element type {dt} or operator {o} unknown to ferroce"
        );
    };
    // SAFETY: the caller's contract.
    let Some(b) = (unsafe { bytes_mut(buf, len) }) else {
        invalid!(err, err_len, "a null buffer of {len} bytes");
    };
    // SAFETY: passed on.
    unsafe { run(comm, err, err_len, |c| c.allreduce(b, t, o)) }
}

/// # Safety
/// As [`allreduce`].
unsafe extern "C" fn broadcast(
    comm: *mut Comm,
    buf: *mut c_void,
    len: usize,
    root: usize,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    // SAFETY: the caller's contract.
    let Some(b) = (unsafe { bytes_mut(buf, len) }) else {
        invalid!(err, err_len, "a null buffer of {len} bytes");
    };
    // SAFETY: passed on.
    unsafe { run(comm, err, err_len, |c| c.broadcast(b, root)) }
}

/// # Safety
/// As [`allreduce`].
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn reduce(
    comm: *mut Comm,
    buf: *mut c_void,
    len: usize,
    dt: u32,
    o: u32,
    root: usize,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    let (Some(t), Some(o)) = (dtype(dt), op(o)) else {
        invalid!(
            err,
            err_len,
            "element type {dt} or operator {o} unknown to ferroce"
        );
    };
    // SAFETY: the caller's contract.
    let Some(b) = (unsafe { bytes_mut(buf, len) }) else {
        invalid!(err, err_len, "a null buffer of {len} bytes");
    };
    // SAFETY: passed on.
    unsafe { run(comm, err, err_len, |c| c.reduce_in_place(b, t, o, root)) }
}

/// Checks an input and an output range and makes slices of them.
///
/// # Safety
/// `inp` points at `in_len` readable bytes and `out` at `out_len` writable bytes, nothing else
/// writing either (or touching `out`) for `'a`.
unsafe fn in_out<'a>(
    inp: *const c_void,
    in_len: usize,
    out: *mut c_void,
    out_len: usize,
) -> Result<(&'a [u8], &'a mut [u8]), String> {
    if overlap(inp, in_len, out, out_len) {
        return Err("the input overlaps the output".into());
    }
    // SAFETY: the caller's contract; they do not overlap.
    match unsafe { (bytes(inp, in_len), bytes_mut(out, out_len)) } {
        (Some(i), Some(o)) => Ok((i, o)),
        _ => Err("a null buffer".into()),
    }
}

/// Checks an input and an output range, then runs `f` on them: the shape of every collective
/// that reads one buffer and writes another.
///
/// # Safety
/// As [`run`] and [`in_out`].
#[allow(clippy::too_many_arguments)]
unsafe fn run_in_out(
    comm: *mut Comm,
    inp: *const c_void,
    in_len: usize,
    out: *mut c_void,
    out_len: usize,
    err: *mut c_char,
    err_len: usize,
    f: impl FnOnce(&mut ferroce_coll::Communicator, &[u8], &mut [u8]) -> Result<(), CollError>,
) -> Status {
    // SAFETY: the caller's contract.
    let (i, o) = match unsafe { in_out(inp, in_len, out, out_len) } {
        Ok(io) => io,
        Err(e) => invalid!(err, err_len, "{e}"),
    };
    // SAFETY: passed on.
    unsafe { run(comm, err, err_len, |c| f(c, i, o)) }
}

/// # Safety
/// As [`run`] and [`in_out`].
unsafe extern "C" fn allgather(
    comm: *mut Comm,
    inp: *const c_void,
    in_len: usize,
    out: *mut c_void,
    out_len: usize,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    // SAFETY: passed on.
    unsafe {
        run_in_out(comm, inp, in_len, out, out_len, err, err_len, |c, i, o| {
            c.allgather(i, o)
        })
    }
}

/// # Safety
/// As [`run`] and [`in_out`].
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn reduce_scatter(
    comm: *mut Comm,
    inp: *const c_void,
    in_len: usize,
    out: *mut c_void,
    out_len: usize,
    dt: u32,
    o: u32,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    let (Some(t), Some(op)) = (dtype(dt), op(o)) else {
        invalid!(
            err,
            err_len,
            "element type {dt} or operator {o} unknown to ferroce"
        );
    };
    // SAFETY: passed on.
    unsafe {
        run_in_out(comm, inp, in_len, out, out_len, err, err_len, |c, i, o| {
            c.reduce_scatter(i, o, t, op)
        })
    }
}

/// # Safety
/// As [`run`] and [`in_out`].
unsafe extern "C" fn alltoall(
    comm: *mut Comm,
    inp: *const c_void,
    in_len: usize,
    out: *mut c_void,
    out_len: usize,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    // SAFETY: passed on.
    unsafe {
        run_in_out(comm, inp, in_len, out, out_len, err, err_len, |c, i, o| {
            c.alltoall(i, o)
        })
    }
}

/// # Safety
/// As [`run`] and [`in_out`] (`out` is the input here, `into` the output).
#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn sendrecv(
    comm: *mut Comm,
    out: *const c_void,
    out_len: usize,
    to: usize,
    into: *mut c_void,
    into_len: usize,
    from: usize,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    // SAFETY: passed on.
    unsafe {
        run_in_out(
            comm,
            out,
            out_len,
            into,
            into_len,
            err,
            err_len,
            |c, s, r| c.sendrecv(s, to, r, from),
        )
    }
}

/// # Safety
/// As [`run`].
unsafe extern "C" fn barrier(comm: *mut Comm, err: *mut c_char, err_len: usize) -> Status {
    // SAFETY: passed on.
    unsafe { run(comm, err, err_len, |c| c.barrier()) }
}

/// # Safety
/// As [`allreduce`]; `from` points at a writable `usize` (or is null).
unsafe extern "C" fn recv_any(
    comm: *mut Comm,
    into: *mut c_void,
    len: usize,
    tag: u32,
    from: *mut usize,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    // SAFETY: the caller's contract.
    let Some(b) = (unsafe { bytes_mut(into, len) }) else {
        invalid!(err, err_len, "a null buffer of {len} bytes");
    };
    // SAFETY: passed on.
    unsafe {
        run(comm, err, err_len, |c| {
            let rank = c.recv_any_tagged(b, tag)?;
            if !from.is_null() {
                // SAFETY: the caller's contract.
                *from = rank;
            }
            Ok(())
        })
    }
}

/// Checks a start's arguments and runs it, writing its ticket.
///
/// # Safety
/// As [`run`]; `ticket` points at a writable `u64` (checked non-null here).
unsafe fn start_with(
    comm: *mut Comm,
    null_buffer: bool,
    len: usize,
    ticket: *mut u64,
    err: *mut c_char,
    err_len: usize,
    start: impl FnOnce(&mut ferroce_coll::Communicator) -> Result<u64, CollError>,
) -> Status {
    if ticket.is_null() || (null_buffer && len > 0) {
        invalid!(err, err_len, "a null buffer of {len} bytes or ticket");
    }
    // SAFETY: passed on; `ticket` checked, writable by the caller's contract.
    unsafe {
        run(comm, err, err_len, |c| {
            *ticket = start(c)?;
            Ok(())
        })
    }
}

/// # Safety
/// As [`start_with`]; `buf` as [`ferroce_coll::Communicator::start_send`] asks.
unsafe extern "C" fn start_send(
    comm: *mut Comm,
    buf: *const c_void,
    len: usize,
    to: usize,
    tag: u32,
    ticket: *mut u64,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        start_with(comm, buf.is_null(), len, ticket, err, err_len, |c| {
            c.start_send(buf.cast(), len, to, tag)
        })
    }
}

/// # Safety
/// As [`start_with`]; `buf` as [`ferroce_coll::Communicator::start_recv`] asks.
unsafe extern "C" fn start_recv(
    comm: *mut Comm,
    buf: *mut c_void,
    len: usize,
    from: usize,
    tag: u32,
    ticket: *mut u64,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        start_with(comm, buf.is_null(), len, ticket, err, err_len, |c| {
            c.start_recv(buf.cast(), len, from, tag)
        })
    }
}

/// # Safety
/// As [`run`]; `tickets` points at `capacity` writable `u64`s, `count` at a writable `usize`
/// and `moved` at a writable byte.
unsafe extern "C" fn progress(
    comm: *mut Comm,
    wait_seconds: f64,
    tickets: *mut u64,
    capacity: usize,
    count: *mut usize,
    moved: *mut u8,
    err: *mut c_char,
    err_len: usize,
) -> Status {
    if tickets.is_null() || count.is_null() || moved.is_null() || capacity == 0 {
        invalid!(err, err_len, "no room for tickets");
    }
    let wait = Duration::try_from_secs_f64(wait_seconds.max(0.0)).unwrap_or(Duration::ZERO);
    // SAFETY: the caller's contract.
    unsafe {
        *count = 0;
        *moved = 0;
    }
    // SAFETY: passed on.
    unsafe {
        run(comm, err, err_len, |c| {
            let p = c.progress(wait, capacity)?;
            // SAFETY: the caller's contract: `capacity` slots, and `p.completed` has at most
            // that; `count` and `moved` writable.
            std::ptr::copy_nonoverlapping(p.completed.as_ptr(), tickets, p.completed.len());
            *count = p.completed.len();
            *moved = u8::from(p.moved);
            Ok(())
        })
    }
}

/// # Safety
/// `comm` came from `take` (or is null) and no other thread uses it meanwhile.
unsafe extern "C" fn abort_handle(comm: *mut Comm) -> *mut AbortHandle {
    if comm.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the caller's contract.
    let handle = unsafe { (*comm).comm.abort_handle() };
    Box::into_raw(Box::new(handle))
}

/// # Safety
/// `handle` came from `abort_handle` and was not freed (or is null).
unsafe extern "C" fn abort_raise(handle: *const AbortHandle) {
    // SAFETY: the caller's contract; the handle is shared state (an atomic flag), safe to
    // use from any thread.
    if let Some(h) = unsafe { handle.as_ref() } {
        h.abort();
    }
}

/// # Safety
/// `handle` came from `abort_handle` (or is null) and is not used afterwards.
unsafe extern "C" fn abort_free(handle: *mut AbortHandle) {
    if !handle.is_null() {
        // SAFETY: a box of ours, given back once.
        drop(unsafe { Box::from_raw(handle) });
    }
}
