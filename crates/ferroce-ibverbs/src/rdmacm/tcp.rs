//! ferroce's own rdma_cm exchange over TCP, kept for ferroce peers that QP1 cannot reach: the
//! processes of one host share its address, and only the first of them (host slot 0) is QP1 to
//! the world. The listener's TCP port is the rdma_cm port, so a peer finds it in any slot.

use super::*;

pub(super) const MAGIC: &[u8; 4] = b"FRCM";

/// The kinds of message, the byte after the magic. It is the format's version too: a reader
/// refuses a kind it does not know (and closes the connection), so a new field comes as new
/// kinds, here REQ and REP with an ECE (see [`Message`]).
pub(super) mod kind {
    pub const REQ: u8 = 1;
    pub const REP: u8 = 2;
    pub const REJ: u8 = 3;
    pub const RTU: u8 = 4;
    pub const DREQ: u8 = 5;
    pub const REQ_ECE: u8 = 6;
    pub const REP_ECE: u8 = 7;
}

/// The IB CM messages rdma_cm exchanges, carried over TCP. (`pub` only so that the `fuzzing`
/// feature's hooks can name it; the module is private.)
///
/// Each starts with the magic `FRCM` and a kind byte. A REQ or REP (kind 1 or 2) follows with
/// the QPN and PSN (4 bytes each, big-endian, 24 bits used), the GID (16), the path MTU, the
/// responder resources, the initiator depth, the retry and RNR retry counts (a byte each), the
/// private data's length (a byte) and the private data. Kinds 6 and 7 are a REQ and a REP with
/// the sender's ECE after that: vendor id and options, 4 bytes each, big-endian. A REJ (3) is
/// the private data's length and the private data; an RTU (4) and a DREQ (5) are the kind
/// alone.
///
/// A build from before ECE knows kinds 1 to 5 only and closes the connection on a REQ of kind
/// 6; the active side then sends its REQ again as kind 1, on a new connection, and goes on
/// without ECE (go-back-N). A passive side answers a REQ of kind 1 with a REP of kind 2.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// REQ (from the active side) and REP (the passive side's answer) carry the same fields.
    Connect {
        /// REP (else REQ).
        reply: bool,
        /// The sender's QP number (24 bits).
        qpn: u32,
        /// The sender's first PSN (24 bits).
        psn: u32,
        /// The sender's GID.
        gid: [u8; 16],
        /// Path MTU, as the verbs enum.
        mtu: u8,
        /// READ/atomic requests the sender serves at once.
        responder_resources: u8,
        /// READ/atomic requests the sender issues at once.
        initiator_depth: u8,
        /// Transport retries.
        retry_count: u8,
        /// RNR retries.
        rnr_retry_count: u8,
        /// The application's private data (at most 255 bytes: its length is one byte).
        private: Vec<u8>,
        /// The sender's ECE: in a REQ what its QP offers, in a REP what is in force. `None` in
        /// the kinds of a build from before ECE.
        ece: Option<Ece>,
    },
    /// REJ, with the rejecting side's private data.
    Reject {
        /// The application's private data (at most 255 bytes).
        private: Vec<u8>,
    },
    /// RTU: the active side is ready; the passive side is established.
    ReadyToUse,
    /// DREQ.
    Disconnect,
}

impl Message {
    /// The message's bytes on the wire.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = MAGIC.to_vec();
        match self {
            Message::Connect {
                reply,
                qpn,
                psn,
                gid,
                mtu,
                responder_resources,
                initiator_depth,
                retry_count,
                rnr_retry_count,
                private,
                ece,
            } => {
                b.push(match (*reply, ece.is_some()) {
                    (false, false) => kind::REQ,
                    (true, false) => kind::REP,
                    (false, true) => kind::REQ_ECE,
                    (true, true) => kind::REP_ECE,
                });
                b.extend_from_slice(&qpn.to_be_bytes());
                b.extend_from_slice(&psn.to_be_bytes());
                b.extend_from_slice(gid);
                b.extend_from_slice(&[
                    *mtu,
                    *responder_resources,
                    *initiator_depth,
                    *retry_count,
                    *rnr_retry_count,
                    private.len() as u8,
                ]);
                b.extend_from_slice(private);
                if let Some(e) = ece {
                    b.extend_from_slice(&e.vendor_id.to_be_bytes());
                    b.extend_from_slice(&e.options.to_be_bytes());
                }
            }
            Message::Reject { private } => {
                b.push(kind::REJ);
                b.push(private.len() as u8);
                b.extend_from_slice(private);
            }
            Message::ReadyToUse => b.push(kind::RTU),
            Message::Disconnect => b.push(kind::DREQ),
        }
        b
    }

    /// Reads one message from `s` (an error for anything else, never a panic).
    pub fn read(s: &mut impl Read) -> std::io::Result<Message> {
        let bad =
            |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
        let mut head = [0u8; 5];
        s.read_exact(&mut head)?;
        if &head[..4] != MAGIC {
            return Err(bad("not a ferroce rdma_cm peer"));
        }
        let read_private = |s: &mut dyn Read, n: u8| -> std::io::Result<Vec<u8>> {
            let mut p = vec![0u8; usize::from(n)];
            s.read_exact(&mut p)?;
            Ok(p)
        };
        match head[4] {
            k @ (kind::REQ | kind::REP | kind::REQ_ECE | kind::REP_ECE) => {
                let mut f = [0u8; 4 + 4 + 16 + 6];
                s.read_exact(&mut f)?;
                let private = read_private(s, f[29])?;
                let ece = if k == kind::REQ_ECE || k == kind::REP_ECE {
                    let mut e = [0u8; 8];
                    s.read_exact(&mut e)?;
                    Some(Ece {
                        vendor_id: u32::from_be_bytes([e[0], e[1], e[2], e[3]]),
                        options: u32::from_be_bytes([e[4], e[5], e[6], e[7]]),
                    })
                } else {
                    None
                };
                Ok(Message::Connect {
                    reply: k == kind::REP || k == kind::REP_ECE,
                    qpn: u32::from_be_bytes([f[0], f[1], f[2], f[3]]) & 0x00ff_ffff,
                    psn: u32::from_be_bytes([f[4], f[5], f[6], f[7]]) & 0x00ff_ffff,
                    gid: f[8..24].try_into().map_err(|_| bad("gid"))?,
                    mtu: f[24],
                    responder_resources: f[25],
                    initiator_depth: f[26],
                    retry_count: f[27],
                    rnr_retry_count: f[28],
                    private,
                    ece,
                })
            }
            kind::REJ => {
                let mut n = [0u8; 1];
                s.read_exact(&mut n)?;
                Ok(Message::Reject {
                    private: read_private(s, n[0])?,
                })
            }
            kind::RTU => Ok(Message::ReadyToUse),
            kind::DREQ => Ok(Message::Disconnect),
            _ => Err(bad("unknown rdma_cm message")),
        }
    }
}

/// The REQ (or, `reply`, the REP) this side sends: its QP, PSN, GID and path MTU, `p`'s depths
/// and retry counts, the program's private data and `ece` (`None` toward a build before ECE).
pub(super) fn connect_message(
    i: &CmId,
    local: &Local,
    p: &rdma_conn_param,
    reply: bool,
    private: Vec<u8>,
    ece: Option<Ece>,
) -> Message {
    let qpn = if i.c.qp.is_null() {
        p.qp_num
    } else {
        // SAFETY: the id's live QP.
        unsafe { (*i.c.qp).qp_num }
    };
    // The route's source was set when the address was resolved or bound.
    let src_ip = src_addr(i)
        .map(|a| a.ip())
        .unwrap_or(Ipv4Addr::UNSPECIFIED.into());
    Message::Connect {
        reply,
        qpn,
        psn: local.psn,
        gid: gid_of(src_ip),
        mtu: local.device.mtu as u8,
        responder_resources: p.responder_resources,
        initiator_depth: p.initiator_depth,
        retry_count: p.retry_count,
        rnr_retry_count: p.rnr_retry_count,
        private,
        ece,
    }
}

pub(super) fn peer_of(m: &Message) -> Option<(Peer, Vec<u8>)> {
    match m {
        Message::Connect {
            qpn,
            psn,
            gid,
            mtu,
            responder_resources,
            initiator_depth,
            retry_count,
            rnr_retry_count,
            private,
            ece,
            ..
        } => Some((
            Peer {
                qpn: *qpn,
                psn: *psn,
                gid: *gid,
                mtu: *mtu,
                responder_resources: *responder_resources,
                initiator_depth: *initiator_depth,
                retry_count: *retry_count,
                rnr_retry_count: *rnr_retry_count,
                ece: *ece,
            },
            private.clone(),
        )),
        _ => None,
    }
}

/// Reads the rest of a connection: a DREQ or the stream closing is `DISCONNECTED`.
pub(super) fn watch_disconnect(mut s: TcpStream, shared: Arc<IdShared>, id: usize) {
    loop {
        match Message::read(&mut s) {
            Ok(Message::Disconnect) | Err(_) => break,
            Ok(_) => continue,
        }
    }
    // The QP stays as it is, as with the kernel's rdma_cm: the program reacts to the event
    // (usually with its own rdma_disconnect, which moves its QP to ERR).
    shared.post(event(id as *mut rdma_cm_id, RDMA_CM_EVENT_DISCONNECTED, 0));
}

/// Sends the REQ `req` to `dst` on a new connection; the connection and the peer's answer, or
/// the event (and status) that reports the failure. A peer that closes the connection on a REQ
/// with an ECE is a build from before ECE (see [`Message`]): the REQ goes again without it.
pub(super) fn request(
    dst: SocketAddr,
    mut req: Message,
) -> Result<(TcpStream, Message), (rdma_cm_event_type, c_int)> {
    loop {
        let mut s = match TcpStream::connect_timeout(&dst, Duration::from_secs(5)) {
            Ok(s) => s,
            // Nothing listens: IB CM's "invalid service ID" rejection, status 8.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                return Err((RDMA_CM_EVENT_REJECTED, 8))
            }
            Err(_) => return Err((RDMA_CM_EVENT_UNREACHABLE, -libc::ETIMEDOUT)),
        };
        let _ = s.set_nodelay(true);
        if s.write_all(&req.encode()).is_err() {
            return Err((RDMA_CM_EVENT_UNREACHABLE, -libc::ECONNRESET));
        }
        match Message::read(&mut s) {
            Ok(m) => return Ok((s, m)),
            Err(e) => {
                use std::io::ErrorKind as K;
                // The old reader refuses the kind after reading 5 bytes and closes with the
                // rest unread: a reset, or an end of stream if it all came in one read.
                let refused = matches!(
                    e.kind(),
                    K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted
                );
                if let Message::Connect {
                    ece: ece @ Some(_), ..
                } = &mut req
                {
                    if refused {
                        *ece = None;
                        continue;
                    }
                }
                return Err((RDMA_CM_EVENT_UNREACHABLE, -libc::EPROTO));
            }
        }
    }
}
