//! The shared-memory provider: same-host peers without UDP, and one-sided operations that run
//! no code in the target process.
//!
//! # How it fits the verbs API
//! Every context (unless the provider is forced to UDP) publishes two things on the host:
//! - a **key table** in a memfd: for each registered region its key, protection domain,
//!   access rights, address, length, and the number and inode of the memfd holding its bytes
//!   (regions ferroce allocates live in memfds; see `mr`);
//! - a **listener**: an abstract Unix socket named after the context's RoCE address
//!   (`ferroce-shm/IP/PORT`). Abstract sockets live in the network namespace, so reaching it
//!   proves the peer is on this host and in this network namespace (peers in other namespaces —
//!   other "hosts" — keep using UDP).
//!
//! When a QP moves to RTR, it tries the listener of its destination address. If it answers and
//! the kernel says the process behind it may link with this one (same uid by default; see
//! `host`), the QP sends a hello carrying its QP number and — with `SCM_RIGHTS` — the
//! descriptors of its context's key table and of its own **QP page** (its state, access flags,
//! protection domain and an inbound packet ring). The peer does the same from its side; a QP
//! whose own hello went out and whose peer's hello arrived from exactly that process is
//! *linked*. With [`Provider::Auto`](crate::Provider::Auto) a QP whose destination has no
//! listener, or one of another user, uses UDP; [`Provider::Shm`](crate::Provider::Shm) makes
//! that an error instead. A context that writes a packet capture uses UDP unless shm is forced,
//! since a capture is asked for to see the wire.
//!
//! # What moves how
//! - **WRITE, READ, COMPARE_SWAP, FETCH_ADD** on a linked QP whose send queue is idle are done
//!   by the initiator itself, inside `post_send`: it checks the target QP's state and access
//!   flags, the rkey in the target's key table, its protection domain, rights and bounds, maps
//!   the target region's memfd the first time it uses the rkey (opening
//!   `/proc/PID/fd/N` and checking the inode, so the target runs no code even then, and may be
//!   stopped), and copies, or applies a CPU atomic to the shared page. The completion is
//!   immediate.
//! - Everything else takes the **packet path**: the RC transport runs exactly as over UDP, but
//!   its packets go through the peer's inbound ring instead of a socket: SEND/RECV, WRITE with
//!   immediate, requests on a QP with requests already under way (so completions and execution
//!   stay in posting order), operations on regions the caller registered itself (their bytes
//!   are not in a memfd, unless the context adopts them: see `adopt`), and any request a check refuses — the target's own responder then
//!   refuses it with the IBTA status (remote access error, invalid request) and both QPs go to
//!   ERR, exactly as on the wire. A refused request never touches memory.
//! - A peer's engine that sleeps is woken by one byte on the hello connection; a peer process
//!   that dies closes that connection, and the survivor's QP goes to ERR (flushing its work).
//!
//! # Memory ordering, and the CPUs this path supports
//! Every word another process polls or checks — ring positions, key-table sequence numbers and
//! slots, QP page words, the sleeping flag — is an atomic, stored with release and loaded with
//! acquire (the key table is a seqlock: odd while a slot changes, fenced on both sides). Bytes
//! (ring records, region contents) are plain copies ordered by those atomics, and by fences
//! where the protocol is the application's own: a direct WRITE's copy is preceded by a release
//! fence and a READ's followed by an acquire fence, as `MemoryRegion::write`/`read` are, so a
//! flag written after data (by a later WRITE, or a later `write`) is never seen before the data
//! on any CPU. As on a NIC, the order of bytes *within* one WRITE is not promised. On x86-64
//! these fences cost nothing (TSO); on AArch64 and other weakly ordered CPUs they are barrier
//! instructions, and the design holds there too, though it is tested on x86-64 only. The ring
//! and the seqlock are model-checked with loom (`tests/loom_models.rs`).
//!
//! # Files
//! `pages` (the key table and QP page layouts), `admit` (the one check of a direct access), `adopt` (caller memory moved onto a memfd), `host` (the listener and the hello exchange),
//! `link` (a QP's link and its way into the peer's memory), `transfer` (the packet path through
//! rings), `direct` and `shortcut` (one-sided operations inside `post_send`), `ring`, `map`.

mod admit;
pub(crate) mod adopt;
pub(crate) mod direct;
mod host;
mod link;
pub(crate) mod map;
mod pages;
pub(crate) mod ring;
pub(crate) mod shortcut;
mod transfer;

pub(crate) use host::ShmHost;
#[cfg(feature = "fuzzing")]
pub(crate) use host::{hello, parse_hello};
pub(crate) use link::{Link, PeerMemory, ShmQp};
pub(crate) use pages::{KeyTable, QpPage};
pub(crate) use transfer::{receive, ring_room, ring_send};
