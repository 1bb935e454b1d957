//! How a ferroce host reaches a ferroce target's queue where the IB CM on the wire cannot: the
//! processes of one host share its IP address and only one of them answers QP1 (see
//! `ferroce::cm::ib`). It carries what rdma_cm would — the NVMe/RDMA private data of the REQ
//! and of the REP or REJ — beside the queue pairs' endpoints ([`ferroce::cm::EndpointInfo`]),
//! over one TCP connection per queue, which then stays open as the queue's connection: its
//! end is the queue's disconnect, as a DREQ would be.
//!
//! Every integer is big-endian, and each message starts with the magic `FNVM` and a kind:
//!
//! | kind | after the kind |
//! |---|---|
//! | 1 REQ | the 32 bytes of NVMe/RDMA request private data; a 2-byte length and the host's endpoint |
//! | 2 REP | the 32 bytes of accept private data; a 2-byte length and the target's endpoint |
//! | 3 REJ | the 4 bytes of reject private data |
//!
//! A reader checks the magic, the kind, the lengths and the endpoint before anything is used:
//! a malformed message is an [`ExchangeError`], never a panic.

use std::io::{self, Read, Write};

use ferroce::cm::EndpointInfo;

use crate::cm::{CmAccept, CmRejectStatus, CmRequest, PRIVATE_LEN};

const MAGIC: &[u8; 4] = b"FNVM";
const KIND_REQ: u8 = 1;
const KIND_REP: u8 = 2;
const KIND_REJ: u8 = 3;
/// An endpoint's encoding is 56 bytes; anything much longer is not one.
const MAX_ENDPOINT_LEN: usize = 1024;

/// What went wrong in an exchange.
#[derive(Debug, thiserror::Error)]
pub enum ExchangeError {
    /// The connection failed or closed.
    #[error("the queue's exchange: {0}")]
    Io(#[from] io::Error),
    /// The peer sent something that is not this exchange.
    #[error("the queue's exchange: {0}")]
    Malformed(String),
    /// The target refused the queue, with the NVMe/RDMA status.
    #[error("the target refused the queue: {0:?}")]
    Rejected(CmRejectStatus),
}

/// The target's answer to a queue's request.
#[derive(Debug, Clone)]
pub enum Answer {
    /// Accepted: the private data and the target's endpoint.
    Accept(CmAccept, EndpointInfo),
    /// Refused.
    Reject(CmRejectStatus),
}

fn malformed(what: impl Into<String>) -> ExchangeError {
    ExchangeError::Malformed(what.into())
}

fn read_head(s: &mut impl Read) -> Result<u8, ExchangeError> {
    let mut head = [0u8; 5];
    s.read_exact(&mut head)?;
    if &head[..4] != MAGIC {
        return Err(malformed("not an NVMe/RDMA exchange (bad magic)"));
    }
    Ok(head[4])
}

fn read_endpoint(s: &mut impl Read) -> Result<EndpointInfo, ExchangeError> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len)?;
    let len = usize::from(u16::from_be_bytes(len));
    if len > MAX_ENDPOINT_LEN {
        return Err(malformed(format!("an endpoint of {len} bytes")));
    }
    let mut b = vec![0u8; len];
    s.read_exact(&mut b)?;
    EndpointInfo::from_bytes(&b).map_err(|e| malformed(format!("the peer's endpoint: {e}")))
}

fn with_endpoint(kind: u8, private: &[u8; PRIVATE_LEN], ep: &EndpointInfo) -> Vec<u8> {
    let e = ep.to_bytes();
    let mut m = Vec::with_capacity(5 + PRIVATE_LEN + 2 + e.len());
    m.extend_from_slice(MAGIC);
    m.push(kind);
    m.extend_from_slice(private);
    m.extend_from_slice(&(e.len() as u16).to_be_bytes());
    m.extend_from_slice(&e);
    m
}

/// The host's side: sends the request, returns the target's answer.
pub fn request(
    s: &mut (impl Read + Write),
    req: &CmRequest,
    host: &EndpointInfo,
) -> Result<(CmAccept, EndpointInfo), ExchangeError> {
    s.write_all(&with_endpoint(KIND_REQ, &req.encode(), host))?;
    match read_answer(s)? {
        Answer::Accept(a, ep) => Ok((a, ep)),
        Answer::Reject(r) => Err(ExchangeError::Rejected(r)),
    }
}

/// Reads the target's answer.
pub fn read_answer(s: &mut impl Read) -> Result<Answer, ExchangeError> {
    match read_head(s)? {
        KIND_REP => {
            let mut p = [0u8; PRIVATE_LEN];
            s.read_exact(&mut p)?;
            let a = CmAccept::parse(&p).map_err(|e| malformed(e.to_string()))?;
            Ok(Answer::Accept(a, read_endpoint(s)?))
        }
        KIND_REJ => {
            let mut p = [0u8; 4];
            s.read_exact(&mut p)?;
            let r = CmRejectStatus::parse(&p).map_err(|e| malformed(e.to_string()))?;
            Ok(Answer::Reject(r))
        }
        k => Err(malformed(format!("answer of kind {k}"))),
    }
}

/// The target's side: reads a queue's request.
pub fn read_request(s: &mut impl Read) -> Result<(CmRequest, EndpointInfo), ExchangeError> {
    if read_head(s)? != KIND_REQ {
        return Err(malformed("a first message that is not a request"));
    }
    let mut p = [0u8; PRIVATE_LEN];
    s.read_exact(&mut p)?;
    let req = CmRequest::parse(&p).map_err(|e| malformed(e.to_string()))?;
    Ok((req, read_endpoint(s)?))
}

/// Sends the target's answer.
pub fn answer(s: &mut impl Write, a: &Answer) -> Result<(), ExchangeError> {
    match a {
        Answer::Accept(acc, ep) => s.write_all(&with_endpoint(KIND_REP, &acc.encode(), ep))?,
        Answer::Reject(r) => {
            let mut m = Vec::with_capacity(9);
            m.extend_from_slice(MAGIC);
            m.push(KIND_REJ);
            m.extend_from_slice(&r.encode());
            s.write_all(&m)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferroce::cm::RemoteRegion;
    use ferroce::{PathMtu, Psn};

    fn endpoint() -> EndpointInfo {
        EndpointInfo {
            qpn: 0x12,
            psn: Psn::new(77),
            gid: "::ffff:10.1.2.3".parse().unwrap(),
            udp_port: 4791,
            mtu: PathMtu::Mtu1024,
            max_rd_atomic: 16,
            region: None::<RemoteRegion>,
            acks_unasked: true,
            small_identifications: true,
            selective_repeat: false,
        }
    }

    #[test]
    fn a_request_and_its_answers_read_back() {
        let req = CmRequest {
            recfmt: 0,
            qid: 3,
            hrqsize: 32,
            hsqsize: 31,
            cntlid: 0xffff,
        };
        let mut wire = Vec::new();
        wire.extend_from_slice(&with_endpoint(KIND_REQ, &req.encode(), &endpoint()));
        let (r, ep) = read_request(&mut wire.as_slice()).unwrap();
        assert_eq!(r, req);
        assert_eq!(ep, endpoint());
        for a in [
            Answer::Accept(
                CmAccept {
                    recfmt: 0,
                    crqsize: 32,
                },
                endpoint(),
            ),
            Answer::Reject(CmRejectStatus::InvalidQueueId),
        ] {
            let mut w = Vec::new();
            answer(&mut w, &a).unwrap();
            match (read_answer(&mut w.as_slice()).unwrap(), a) {
                (Answer::Accept(x, e), Answer::Accept(y, f)) => assert_eq!((x, e), (y, f)),
                (Answer::Reject(x), Answer::Reject(y)) => assert_eq!(x, y),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn hostile_bytes_are_errors() {
        let good = with_endpoint(KIND_REQ, &[0u8; PRIVATE_LEN], &endpoint());
        // Every truncation, a bad magic, a bad kind, a huge endpoint length.
        for n in 0..good.len() {
            assert!(read_request(&mut &good[..n]).is_err(), "{n}");
        }
        let mut bad = good.clone();
        bad[0] = b'X';
        assert!(read_request(&mut bad.as_slice()).is_err());
        let mut bad = good.clone();
        bad[4] = 9;
        assert!(read_request(&mut bad.as_slice()).is_err());
        let mut bad = good.clone();
        bad[5 + PRIVATE_LEN] = 0xff;
        assert!(read_request(&mut bad.as_slice()).is_err());
        assert!(read_answer(&mut good.as_slice()).is_err());
    }
}
