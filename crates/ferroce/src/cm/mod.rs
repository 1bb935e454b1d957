//! Connection management: the out-of-band exchange of queue-pair endpoint parameters over TCP.
//!
//! Two RC queue pairs can only talk once each knows the other's QP number, first PSN, GID, UDP
//! port, path MTU and READ/atomic depth. RDMA tools traditionally swap these over a plain TCP
//! connection before touching the fabric (`ibv_rc_pingpong` and perftest use TCP port 18515);
//! this module does the same, in the spirit of librdmacm but without its event machinery. It
//! only moves parameters: the caller creates the QPs and drives them to RTR/RTS with what it
//! receives, then calls [`Connection::sync`] so neither side sends before the other can receive.
//!
//! # Protocol
//!
//! The side that called [`connect`] (the connector) sends an `ENDPOINTS` message; the side that
//! called [`Listener::accept`] (the acceptor) reads it, then answers with its own. Sending in turn
//! rather than at once means neither side can block writing up to 57 KiB while the other is also
//! writing. Both sides must send the same number of endpoints (1 to [`MAX_ENDPOINTS`]): endpoint
//! `i` of one side pairs with endpoint `i` of the other. [`Connection::exchange`] repeats the
//! exchange on the same connection; [`Connection::sync`] has both sides send a `READY` message and
//! wait for the other's.
//!
//! Every message starts with a 12-byte header; all integers are big-endian:
//!
//! | offset | size | field                                                          |
//! |-------:|-----:|----------------------------------------------------------------|
//! |      0 |    4 | magic, `b"FRCE"`                                               |
//! |      4 |    1 | protocol version, [`VERSION`] (1)                              |
//! |      5 |    1 | kind: 1 = `ENDPOINTS`, 2 = `READY`                             |
//! |      6 |    2 | entry count: 1..=1024 for `ENDPOINTS`, 0 for `READY`           |
//! |      8 |    4 | body length in bytes: count × 56 for `ENDPOINTS`, 0 for `READY` |
//!
//! An `ENDPOINTS` body is `count` records of 56 bytes, one per endpoint:
//!
//! | offset | size | field                                                        |
//! |-------:|-----:|--------------------------------------------------------------|
//! |      0 |    4 | QP number (≤ 2^24 − 1)                                       |
//! |      4 |    4 | first PSN the sender will send (≤ 2^24 − 1)                  |
//! |      8 |   16 | GID (IPv6; IPv4-mapped for RoCE v2 over IPv4)                |
//! |     24 |    2 | UDP port of the sender's RoCE socket (non-zero)              |
//! |     26 |    2 | path MTU in bytes: 256, 512, 1024, 2048 or 4096              |
//! |     28 |    1 | max_rd_atomic: READ/atomic depth served as responder (≤ 16)  |
//! |     29 |    1 | flags: bit 0 = a remote region follows; bit 1 = the sender's |
//! |        |      | responder acknowledges unasked requests (see below); bit 2 = |
//! |        |      | the sender's packets carry IPv4 Identifications below 64 (see |
//! |        |      | below); bit 3 = the sender does selective repeat (see below); |
//! |        |      | others 0                                                     |
//! |     30 |    2 | reserved, zero                                               |
//! |     32 |    8 | region address (zero without the region flag)                |
//! |     40 |    8 | region length in bytes (zero without the region flag)        |
//! |     48 |    4 | region rkey (zero without the region flag)                   |
//! |     52 |    4 | reserved, zero                                               |
//!
//! The flags say how the sender behaves where RoCE leaves a choice, so that the peer may rely
//! on it: bit 1, that its responder acknowledges requests that do not ask for an ACK
//! ([`EndpointInfo::acks_unasked`]); bit 2, that every packet it sends carries an IPv4
//! Identification below [`crate::SENT_IDENTIFICATION_LIMIT`]
//! ([`EndpointInfo::small_identifications`]), so the peer believes no other Identification it
//! solves from an ICRC; bit 3, that its responder keeps requests that arrive after a gap and its
//! requester takes a sequence-error NAK as one missing packet
//! ([`EndpointInfo::selective_repeat`]): when both ends set it, both do selective repeat,
//! otherwise go-back-N. A build that predates a flag refuses it like any unknown flag, so a
//! ferroce from before a flag cannot connect to one that sets it (both ends must be upgraded
//! together).
//!
//! # Why versioned, and why so strict
//!
//! The two ends are often different builds of ferroce on different hosts. A bare struct dump
//! (what `ibv_rc_pingpong` sends as text, perftest as raw C structs) silently misreads the peer's
//! fields once either side changes its layout, and the symptom is a QP that never connects, far
//! from the cause. So the magic rejects anything that is not this protocol (a port scanner, a
//! perftest peer), and the version byte, which sits at the same offset in every version, lets
//! either side say precisely "the peer speaks version 2" instead of misparsing it. A later
//! version may change anything after byte 4. Reserved bytes and unknown flags must be zero: a
//! v1 reader cannot know what they would mean, and refusing is safer than ignoring.
//!
//! When the acceptor sees a version it does not speak, it still answers with its own `ENDPOINTS`
//! (best effort) before failing, so the connector learns which version the acceptor speaks.
//!
//! Every value is validated before it is believed: lengths are checked against the count before
//! anything is allocated (a message is at most 12 + 1024 × 56 bytes), and each field against its
//! range, so bad input yields a [`CmError`] naming the field and never a panic. Every operation
//! takes a timeout that bounds the whole call, so a silent or slow peer is reported, not waited
//! on forever.

mod endpoint;
mod error;
pub mod ib;

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use ferroce_proto::PathMtu;

use self::endpoint::{decode_endpoint, header};
// Crate-visible for the fuzz hooks (`crate::fuzzing`).
pub(crate) use self::endpoint::encode_endpoints;
pub use self::endpoint::{EndpointInfo, RemoteRegion};
pub use self::error::{CmError, EndpointProblem, MessageKind, Phase};

/// The first four bytes of every message.
pub const MAGIC: [u8; 4] = *b"FRCE";
/// The protocol version this module speaks.
pub const VERSION: u8 = 1;
/// The TCP port RDMA tools conventionally exchange parameters on (`ibv_rc_pingpong`, perftest).
pub const DEFAULT_PORT: u16 = 18515;
/// The most endpoints one exchange may carry.
pub const MAX_ENDPOINTS: usize = 1024;
/// Size of a message header in bytes.
pub const HEADER_LEN: usize = 12;
/// Size of one endpoint record in bytes.
pub const ENDPOINT_LEN: usize = 56;

pub(crate) const QPN_MASK: u32 = 0x00ff_ffff;
pub(crate) const FLAG_REGION: u8 = 0x01;
pub(crate) const FLAG_ACKS_UNASKED: u8 = 0x02;
pub(crate) const FLAG_SMALL_IDENTIFICATIONS: u8 = 0x04;
pub(crate) const FLAG_SELECTIVE_REPEAT: u8 = 0x08;
/// Upper bound of the sleep between two polls of a non-blocking listener: short enough that a
/// connecting peer is not kept waiting noticeably, long enough not to spin a core.
const MAX_ACCEPT_POLL: Duration = Duration::from_millis(10);

/// The result of a connection-management operation.
pub type Result<T> = std::result::Result<T, CmError>;

/// A TCP listener waiting for peers to connect and exchange parameters.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
    local: SocketAddr,
}

impl Listener {
    /// Listens on `addr` (port 0 picks a free port; see [`Listener::local_addr`]).
    pub fn bind(addr: SocketAddr) -> Result<Listener> {
        let listen_err = |source| CmError::Listen { addr, source };
        let inner = TcpListener::bind(addr).map_err(listen_err)?;
        // Non-blocking so `accept` can give up at its deadline; std has no accept timeout.
        inner.set_nonblocking(true).map_err(listen_err)?;
        let local = inner.local_addr().map_err(listen_err)?;
        Ok(Listener { inner, local })
    }

    /// The address this listener is bound to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Waits for one peer to connect and exchanges one endpoint with it.
    ///
    /// `timeout` bounds the whole call: waiting for the peer and the exchange. A peer that
    /// connects and then misbehaves makes this call fail; call it again to wait for another.
    pub fn accept(&self, local: &EndpointInfo, timeout: Duration) -> Result<Connection> {
        self.accept_many(std::slice::from_ref(local), timeout)
    }

    /// Like [`Listener::accept`], for 1 to [`MAX_ENDPOINTS`] endpoints; the peer must send as
    /// many, and [`Connection::peers`] holds them in the peer's order.
    pub fn accept_many(&self, local: &[EndpointInfo], timeout: Duration) -> Result<Connection> {
        validate_local(local)?;
        let deadline = Deadline::new(timeout);
        let mut pause = Duration::from_millis(1);
        let (stream, peer) = loop {
            match self.inner.accept() {
                Ok(pair) => break pair,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    let Some(left) = deadline.remaining() else {
                        return Err(CmError::AcceptTimeout {
                            local: self.local,
                            timeout,
                        });
                    };
                    thread::sleep(pause.min(left));
                    pause = (pause * 2).min(MAX_ACCEPT_POLL);
                }
                // A peer that gave up between SYN and accept is not this listener's failure.
                Err(e) if is_transient_accept_error(&e) => {}
                Err(source) => {
                    return Err(CmError::Listen {
                        addr: self.local,
                        source,
                    })
                }
            }
        };
        let io_err = |source| CmError::Io {
            peer,
            phase: Phase::Exchange,
            source,
        };
        // Linux does not pass O_NONBLOCK on to accepted sockets, other systems do.
        stream.set_nonblocking(false).map_err(io_err)?;
        Connection::establish(stream, peer, Role::Acceptor, local, deadline)
    }
}

fn is_transient_accept_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::Interrupted
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// Connects to a [`Listener`] at `addr` and exchanges one endpoint with it.
///
/// `timeout` bounds the whole call: the TCP connection and the exchange. A refused connection
/// fails at once with [`CmError::Refused`] rather than retrying: start the listening side first.
pub fn connect(addr: SocketAddr, local: &EndpointInfo, timeout: Duration) -> Result<Connection> {
    connect_many(addr, std::slice::from_ref(local), timeout)
}

/// Like [`connect`], for 1 to [`MAX_ENDPOINTS`] endpoints; the peer must send as many, and
/// [`Connection::peers`] holds them in the peer's order.
pub fn connect_many(
    addr: SocketAddr,
    local: &[EndpointInfo],
    timeout: Duration,
) -> Result<Connection> {
    validate_local(local)?;
    let deadline = Deadline::new(timeout);
    if timeout.is_zero() {
        return Err(CmError::ConnectTimeout { addr, timeout });
    }
    let stream =
        TcpStream::connect_timeout(&addr, timeout).map_err(|source| match source.kind() {
            io::ErrorKind::ConnectionRefused => CmError::Refused { addr },
            io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => {
                CmError::ConnectTimeout { addr, timeout }
            }
            _ => CmError::Connect { addr, source },
        })?;
    Connection::establish(stream, addr, Role::Connector, local, deadline)
}

/// An established exchange: the peer's parameters and the TCP connection to it, kept open for
/// [`Connection::sync`] and further exchanges.
#[derive(Debug)]
pub struct Connection {
    /// The peer's first (for [`connect`]/[`Listener::accept`], only) endpoint.
    pub peer: EndpointInfo,
    /// All the peer's endpoints, in its order; `peers[0] == peer`. Pair `peers[i]` with the
    /// caller's `local[i]`.
    pub peers: Vec<EndpointInfo>,
    /// The peer's TCP address.
    pub peer_addr: SocketAddr,
    stream: TcpStream,
    role: Role,
}

impl Connection {
    fn establish(
        mut stream: TcpStream,
        peer_addr: SocketAddr,
        role: Role,
        local: &[EndpointInfo],
        deadline: Deadline,
    ) -> Result<Connection> {
        // The messages are small and each waits for an answer: Nagle would only add latency.
        stream.set_nodelay(true).map_err(|source| CmError::Io {
            peer: peer_addr,
            phase: Phase::Exchange,
            source,
        })?;
        let peers = exchange_on(&mut stream, peer_addr, role, local, deadline)?;
        Ok(Connection {
            peer: peers[0],
            peers,
            peer_addr,
            stream,
            role,
        })
    }

    /// After both sides have moved their QPs to RTR (or RTS): tells the peer so and waits until
    /// the peer says the same, so neither side sends before the other can receive.
    pub fn sync(&mut self, timeout: Duration) -> Result<()> {
        let peer = self.peer_addr;
        let mut io = Io {
            stream: &mut self.stream,
            peer,
            deadline: Deadline::new(timeout),
            phase: Phase::Sync,
        };
        // Both sides write first: 12 bytes always fit in the socket buffer, so this cannot
        // deadlock, and it saves a round trip over taking turns.
        io.write_all(&header(MessageKind::Ready, 0, 0))?;
        read_message(peer, MessageKind::Ready, &mut |buf| io.read_exact(buf))?;
        Ok(())
    }

    /// The path MTU both sides support: the smaller of `local.mtu` and the peer's first
    /// endpoint's.
    pub fn mtu(&self, local: &EndpointInfo) -> PathMtu {
        local.mtu.min(self.peer.mtu)
    }

    /// Exchanges another set of 1 to [`MAX_ENDPOINTS`] endpoints on this connection (for
    /// example new QPs for the next test); the peer must call it too, with as many endpoints.
    /// Returns the peer's list; [`Connection::peer`] and [`Connection::peers`] are unchanged.
    pub fn exchange(
        &mut self,
        local: &[EndpointInfo],
        timeout: Duration,
    ) -> Result<Vec<EndpointInfo>> {
        validate_local(local)?;
        exchange_on(
            &mut self.stream,
            self.peer_addr,
            self.role,
            local,
            Deadline::new(timeout),
        )
    }

    /// This side's TCP address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.stream.local_addr().map_err(|source| CmError::Io {
            peer: self.peer_addr,
            phase: Phase::Exchange,
            source,
        })
    }
}

/// Who speaks first in an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    Connector,
    Acceptor,
}

fn validate_local(local: &[EndpointInfo]) -> Result<()> {
    if local.is_empty() || local.len() > MAX_ENDPOINTS {
        return Err(CmError::LocalCount { count: local.len() });
    }
    for (index, e) in local.iter().enumerate() {
        e.validate()
            .map_err(|problem| CmError::InvalidLocalEndpoint { index, problem })?;
    }
    Ok(())
}

fn exchange_on(
    stream: &mut TcpStream,
    peer: SocketAddr,
    role: Role,
    local: &[EndpointInfo],
    deadline: Deadline,
) -> Result<Vec<EndpointInfo>> {
    let msg = encode_endpoints(local);
    let mut io = Io {
        stream,
        peer,
        deadline,
        phase: Phase::Exchange,
    };
    let peers = match role {
        Role::Connector => {
            io.write_all(&msg)?;
            read_message(peer, MessageKind::Endpoints, &mut |buf| io.read_exact(buf))?
        }
        Role::Acceptor => {
            let received =
                read_message(peer, MessageKind::Endpoints, &mut |buf| io.read_exact(buf));
            match received {
                Ok(peers) => {
                    // Answer even when the counts differ, so that both sides can report the
                    // mismatch with both numbers.
                    io.write_all(&msg)?;
                    peers
                }
                Err(e @ CmError::Version { .. }) => {
                    // Tell the peer which version this side speaks; it fails either way.
                    let _ = io.write_all(&msg);
                    return Err(e);
                }
                Err(e) => return Err(e),
            }
        }
    };
    if peers.len() != local.len() {
        return Err(CmError::CountMismatch {
            peer,
            local: local.len(),
            remote: peers.len(),
        });
    }
    Ok(peers)
}

/// A timeout turned into a deadline without `Instant + Duration`, which panics on overflow for
/// huge timeouts.
#[derive(Debug, Clone, Copy)]
struct Deadline {
    start: Instant,
    timeout: Duration,
}

impl Deadline {
    fn new(timeout: Duration) -> Deadline {
        Deadline {
            start: Instant::now(),
            timeout,
        }
    }

    /// Time left, `None` once the deadline has passed.
    fn remaining(&self) -> Option<Duration> {
        let left = self.timeout.saturating_sub(self.start.elapsed());
        (!left.is_zero()).then_some(left)
    }
}

/// Reads and writes on the stream against one deadline, mapping failures to [`CmError`].
struct Io<'a> {
    stream: &'a mut TcpStream,
    peer: SocketAddr,
    deadline: Deadline,
    phase: Phase,
}

impl Io<'_> {
    fn timeout(&self) -> CmError {
        CmError::Timeout {
            peer: self.peer,
            timeout: self.deadline.timeout,
            phase: self.phase,
        }
    }

    fn error(&self, source: io::Error) -> CmError {
        match source.kind() {
            io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::UnexpectedEof
            | io::ErrorKind::WriteZero => CmError::Closed {
                peer: self.peer,
                phase: self.phase,
            },
            _ => CmError::Io {
                peer: self.peer,
                phase: self.phase,
                source,
            },
        }
    }

    /// Whether an error only means "try again" (the socket timeout of one call fired, or a
    /// signal interrupted it); the loop then rechecks the overall deadline.
    fn retryable(e: &io::Error) -> bool {
        matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
        )
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<()> {
        let mut filled = 0;
        while filled < buf.len() {
            let left = self.deadline.remaining().ok_or_else(|| self.timeout())?;
            // Reset before every read: the socket timeout bounds one call, the deadline the
            // whole message, however slowly its bytes trickle in.
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| self.error(e))?;
            match self.stream.read(&mut buf[filled..]) {
                Ok(0) => {
                    return Err(CmError::Closed {
                        peer: self.peer,
                        phase: self.phase,
                    })
                }
                Ok(n) => filled += n,
                Err(e) if Self::retryable(&e) => {}
                Err(e) => return Err(self.error(e)),
            }
        }
        Ok(())
    }

    fn write_all(&mut self, buf: &[u8]) -> Result<()> {
        let mut sent = 0;
        while sent < buf.len() {
            let left = self.deadline.remaining().ok_or_else(|| self.timeout())?;
            self.stream
                .set_write_timeout(Some(left))
                .map_err(|e| self.error(e))?;
            match self.stream.write(&buf[sent..]) {
                Ok(0) => {
                    return Err(CmError::Closed {
                        peer: self.peer,
                        phase: self.phase,
                    })
                }
                Ok(n) => sent += n,
                Err(e) if Self::retryable(&e) => {}
                Err(e) => return Err(self.error(e)),
            }
        }
        Ok(())
    }
}

/// Reads one message of kind `expected` through `fill` (which fills its buffer completely or
/// fails) and returns its endpoints (none for `READY`).
///
/// The header is read in steps, magic first, so that a peer speaking something else is named as
/// such even when it sends fewer than 12 bytes and then waits or hangs up.
pub(crate) fn read_message(
    peer: SocketAddr,
    expected: MessageKind,
    fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
) -> Result<Vec<EndpointInfo>> {
    let mut magic = [0u8; 4];
    fill(&mut magic)?;
    if magic != MAGIC {
        return Err(CmError::BadMagic { peer, got: magic });
    }
    let mut version = [0u8; 1];
    fill(&mut version)?;
    if version[0] != VERSION {
        return Err(CmError::Version {
            peer,
            got: version[0],
            supported: VERSION,
        });
    }
    let mut rest = [0u8; HEADER_LEN - 5];
    fill(&mut rest)?;
    let kind = rest[0];
    let count = u16::from_be_bytes([rest[1], rest[2]]);
    let len = u32::from_be_bytes([rest[3], rest[4], rest[5], rest[6]]);
    if kind != expected.code() {
        return Err(CmError::UnexpectedMessage {
            peer,
            got: kind,
            expected,
        });
    }
    let count_ok = match expected {
        MessageKind::Endpoints => (1..=MAX_ENDPOINTS).contains(&usize::from(count)),
        MessageKind::Ready => count == 0,
    };
    if !count_ok {
        return Err(CmError::BadCount {
            peer,
            kind: expected,
            got: count,
        });
    }
    // count ≤ 1024, so this neither overflows nor lets the peer choose the allocation size.
    let want = u32::from(count) * ENDPOINT_LEN as u32;
    if len != want {
        return Err(CmError::BadLength {
            peer,
            kind: expected,
            got: len,
            expected: want,
        });
    }
    let mut body = vec![0u8; want as usize];
    fill(&mut body)?;
    body.chunks_exact(ENDPOINT_LEN)
        .enumerate()
        .map(|(index, record)| {
            decode_endpoint(record).map_err(|problem| CmError::InvalidPeerEndpoint {
                peer,
                index,
                problem,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::endpoint::{gid_is_addressable, region_fits};
    use super::*;
    use ferroce_wire::Psn;
    use std::net::Ipv6Addr;
    use std::net::{Ipv4Addr, SocketAddrV4};

    fn peer() -> SocketAddr {
        SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 1))
    }

    fn sample(i: u32) -> EndpointInfo {
        EndpointInfo {
            qpn: 0x11 + i,
            psn: Psn::new(0xabcdef ^ i),
            gid: Ipv4Addr::new(10, 0, 0, 1).to_ipv6_mapped(),
            udp_port: 4791,
            mtu: PathMtu::Mtu1024,
            max_rd_atomic: 16,
            region: (i % 2 == 0).then_some(RemoteRegion {
                addr: 0x7f00_0000_1000 + u64::from(i),
                rkey: 0x1234_5600 | i,
                len: 1 << 20,
            }),
            acks_unasked: i % 3 == 0,
            small_identifications: i % 2 == 0,
            selective_repeat: i % 3 == 0,
        }
    }

    fn decode(bytes: &[u8], expected: MessageKind) -> Result<Vec<EndpointInfo>> {
        let mut at = 0;
        read_message(peer(), expected, &mut |buf: &mut [u8]| {
            let end = at + buf.len();
            if end > bytes.len() {
                return Err(CmError::Closed {
                    peer: peer(),
                    phase: Phase::Exchange,
                });
            }
            buf.copy_from_slice(&bytes[at..end]);
            at = end;
            Ok(())
        })
    }

    #[test]
    fn encode_decode_round_trip() {
        let list: Vec<_> = (0..5).map(sample).collect();
        let msg = encode_endpoints(&list);
        assert_eq!(msg.len(), HEADER_LEN + 5 * ENDPOINT_LEN);
        assert_eq!(decode(&msg, MessageKind::Endpoints).unwrap(), list);
        let ready = header(MessageKind::Ready, 0, 0);
        assert!(decode(&ready, MessageKind::Ready).unwrap().is_empty());
    }

    /// Every single-byte corruption and every truncation of a valid message is either accepted
    /// or rejected with an error, never a panic.
    #[test]
    fn mutations_never_panic() {
        let list: Vec<_> = (0..3).map(sample).collect();
        let msg = encode_endpoints(&list);
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for at in 0..msg.len() {
            for _ in 0..16 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let mut m = msg.clone();
                m[at] = state as u8;
                let _ = decode(&m, MessageKind::Endpoints);
                let _ = decode(&m, MessageKind::Ready);
            }
        }
        for cut in 0..msg.len() {
            assert!(matches!(
                decode(&msg[..cut], MessageKind::Endpoints),
                Err(CmError::Closed { .. })
            ));
        }
    }

    #[test]
    fn huge_count_rejected_before_allocating() {
        let mut h = header(MessageKind::Endpoints, u16::MAX, u32::MAX);
        assert!(matches!(
            decode(&h, MessageKind::Endpoints),
            Err(CmError::BadCount { got: u16::MAX, .. })
        ));
        h = header(MessageKind::Endpoints, 1024, u32::MAX);
        assert!(matches!(
            decode(&h, MessageKind::Endpoints),
            Err(CmError::BadLength {
                got: u32::MAX,
                expected: 57344,
                ..
            })
        ));
    }

    #[test]
    fn region_bounds() {
        assert!(region_fits(u64::MAX, 1));
        assert!(!region_fits(u64::MAX, 2));
        assert!(region_fits(u64::MAX, 0));
        assert!(region_fits(0, u64::MAX));
    }

    #[test]
    fn gid_rules() {
        assert!(!gid_is_addressable(Ipv6Addr::UNSPECIFIED));
        assert!(!gid_is_addressable(Ipv4Addr::UNSPECIFIED.to_ipv6_mapped()));
        assert!(!gid_is_addressable("ff02::1".parse().unwrap()));
        assert!(!gid_is_addressable(
            Ipv4Addr::new(224, 0, 0, 1).to_ipv6_mapped()
        ));
        assert!(gid_is_addressable(Ipv6Addr::LOCALHOST));
        assert!(gid_is_addressable("fe80::1".parse().unwrap()));
        assert!(gid_is_addressable(Ipv4Addr::LOCALHOST.to_ipv6_mapped()));
    }
}
