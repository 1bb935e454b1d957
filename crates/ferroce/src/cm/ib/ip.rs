//! rdma_cm's IP addressing over IB CM: how the kernel's `rdma_cm` names a service and says which
//! IP addresses a connection is between.
//!
//! - **Service ID**: `0x0000_0000_01` (the IETF prefix of RFC 4391's IP-based services), then
//!   the port space's low byte (TCP 0x06, UDP 0x11, IB 0x3f, IPoIB 0x02), then the port:
//!   `0x0000_0000_0106_1c06` is the TCP port space's port 7174 (rping's default).
//! - **The IP header** that leads the private data of every REQ and SIDR_REQ rdma_cm sends
//!   (36 bytes, the kernel's `struct cma_hdr`): version 0, the IP version in the high nibble,
//!   the source port, then the source and destination addresses as 16 bytes each (an IPv4
//!   address in the last four, the rest zero). The application's own private data follows, so
//!   it may be 56 bytes in a REQ (92 − 36) and 180 in a SIDR_REQ.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// rdma_cm's port spaces (`enum rdma_port_space`).
pub mod port_space {
    /// IPoIB.
    pub const IPOIB: u16 = 0x0002;
    /// Reliable, connected (RC QPs), TCP-like.
    pub const TCP: u16 = 0x0106;
    /// Unreliable datagram (UD QPs, SIDR), UDP-like.
    pub const UDP: u16 = 0x0111;
    /// Native IB service IDs.
    pub const IB: u16 = 0x013f;
}

/// Bytes of rdma_cm's IP header at the start of a REQ's or SIDR_REQ's private data.
pub const IP_HEADER_LEN: usize = 36;

const SERVICE_PREFIX: u64 = 0x0000_0000_0100_0000;

/// The service ID of `port` in `port_space`.
pub fn service_id(port_space: u16, port: u16) -> u64 {
    SERVICE_PREFIX | u64::from(port_space & 0xff) << 16 | u64::from(port)
}

/// The port space and port a service ID names, if it is one of rdma_cm's IP services.
pub fn service_port(service_id: u64) -> Option<(u16, u16)> {
    if service_id & !0xff_ffff != SERVICE_PREFIX {
        return None;
    }
    let space = match (service_id >> 16) as u8 {
        0x06 => port_space::TCP,
        0x11 => port_space::UDP,
        0x3f => port_space::IB,
        0x02 => port_space::IPOIB,
        _ => return None,
    };
    Some((space, service_id as u16))
}

/// rdma_cm's IP header: who connects to what.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpHeader {
    /// The active side's address and port.
    pub src: SocketAddr,
    /// The address the active side connects to (its port is the service ID's).
    pub dst: IpAddr,
}

/// Why an IP header could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum IpHeaderError {
    /// Shorter than 36 bytes.
    #[error("private data of {0} bytes holds no rdma_cm IP header")]
    Short(usize),
    /// A version other than 0, or an IP version other than 4 or 6.
    #[error("rdma_cm IP header of version {0}, IP version {1}")]
    Version(u8, u8),
    /// The two addresses are of different families.
    #[error("rdma_cm IP header with addresses of two families")]
    Mixed,
}

fn put_addr(out: &mut [u8], ip: IpAddr) {
    match ip {
        IpAddr::V4(v4) => {
            out[..12].fill(0);
            out[12..16].copy_from_slice(&v4.octets());
        }
        IpAddr::V6(v6) => out.copy_from_slice(&v6.octets()),
    }
}

impl IpHeader {
    /// The 36 bytes.
    pub fn to_bytes(&self) -> [u8; IP_HEADER_LEN] {
        let mut b = [0u8; IP_HEADER_LEN];
        b[1] = if self.src.is_ipv4() { 4 << 4 } else { 6 << 4 };
        b[2..4].copy_from_slice(&self.src.port().to_be_bytes());
        put_addr(&mut b[4..20], self.src.ip());
        put_addr(&mut b[20..36], self.dst);
        b
    }

    /// Reads the header from the start of `private_data`.
    pub fn parse(private_data: &[u8]) -> Result<IpHeader, IpHeaderError> {
        let b = private_data
            .get(..IP_HEADER_LEN)
            .ok_or(IpHeaderError::Short(private_data.len()))?;
        let ip_version = b[1] >> 4;
        let port = u16::from_be_bytes([b[2], b[3]]);
        let addr = |a: &[u8]| -> IpAddr {
            let mut o = [0u8; 16];
            o.copy_from_slice(a);
            if ip_version == 4 {
                IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]))
            } else {
                IpAddr::V6(Ipv6Addr::from(o))
            }
        };
        if b[0] != 0 || !(ip_version == 4 || ip_version == 6) {
            return Err(IpHeaderError::Version(b[0], ip_version));
        }
        let (src, dst) = (addr(&b[4..20]), addr(&b[20..36]));
        if src.is_ipv4() != dst.is_ipv4() {
            return Err(IpHeaderError::Mixed);
        }
        Ok(IpHeader {
            src: SocketAddr::new(src, port),
            dst,
        })
    }
}

/// The GID of an IP address as RoCE v2 uses it ([`crate::gid_of`], as the bytes a MAD
/// carries).
pub fn gid_of(ip: IpAddr) -> [u8; 16] {
    crate::gid_of(ip).octets()
}

/// The IP address of a RoCE v2 GID as a MAD carries it ([`crate::ip_of`]).
pub fn ip_of_gid(gid: [u8; 16]) -> IpAddr {
    crate::ip_of(Ipv6Addr::from(gid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpings_service_and_header_are_the_kernels() {
        // rping_rdmacm.pcap frame 1: service 0x0000000001061c06, header from 192.168.77.11
        // port 0x925e to 192.168.77.10.
        assert_eq!(service_id(port_space::TCP, 7174), 0x0000_0000_0106_1c06);
        assert_eq!(
            service_port(0x0000_0000_0106_1c06),
            Some((port_space::TCP, 7174))
        );
        assert_eq!(service_port(0x0000_0001_0106_1c06), None, "another prefix");
        let mut captured = [0u8; IP_HEADER_LEN];
        captured[..4].copy_from_slice(&[0x00, 0x40, 0x92, 0x5e]);
        captured[16..20].copy_from_slice(&[192, 168, 77, 11]);
        captured[32..36].copy_from_slice(&[192, 168, 77, 10]);
        let h = IpHeader::parse(&captured).unwrap();
        assert_eq!(h.src, "192.168.77.11:37470".parse().unwrap());
        assert_eq!(h.dst, "192.168.77.10".parse::<IpAddr>().unwrap());
        assert_eq!(h.to_bytes(), captured);
    }

    #[test]
    fn bad_headers_are_errors() {
        assert_eq!(IpHeader::parse(&[0; 35]), Err(IpHeaderError::Short(35)));
        let mut b = [0u8; IP_HEADER_LEN];
        b[1] = 0x50;
        assert_eq!(IpHeader::parse(&b), Err(IpHeaderError::Version(0, 5)));
        let v6 = IpHeader {
            src: "[fe80::1]:5".parse().unwrap(),
            dst: "fe80::2".parse().unwrap(),
        };
        assert_eq!(IpHeader::parse(&v6.to_bytes()).unwrap(), v6);
        assert_eq!(
            ip_of_gid(gid_of("10.1.2.3".parse().unwrap())),
            "10.1.2.3".parse::<IpAddr>().unwrap()
        );
    }
}
