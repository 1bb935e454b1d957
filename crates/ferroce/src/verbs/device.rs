//! Devices: one per network interface that has an address RoCE v2 can use, loopback included,
//! like the `rxe0` a Soft-RoCE user binds to an interface.

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::net::{IpAddr, Ipv6Addr};

use ferroce_proto::PathMtu;

use super::context::{Context, ContextOptions};
use crate::error::{Error, Result};

/// One entry of a device's GID table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gid {
    /// Index in the table.
    pub index: usize,
    /// The GID: the IPv6 address, or the IPv4-mapped IPv6 address of an IPv4 address.
    pub gid: Ipv6Addr,
    /// The interface address it stands for.
    pub ip: IpAddr,
}

/// A RoCE v2 device: an interface and its GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Device {
    name: String,
    ifname: String,
    gids: Vec<Gid>,
    netdev_mtu: u32,
}

/// IP, UDP, BTH, the largest extension headers and the ICRC, beyond the payload.
const ROCE_OVERHEAD: u32 = 40 + 8 + 12 + 28 + 4;

impl Device {
    /// The device name: `ferroce_` and the interface name.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// The interface.
    pub fn ifname(&self) -> &str {
        &self.ifname
    }
    /// The GID table.
    pub fn gids(&self) -> &[Gid] {
        &self.gids
    }
    /// The interface MTU.
    pub fn netdev_mtu(&self) -> u32 {
        self.netdev_mtu
    }
    /// The largest IBTA path MTU whose packets fit the interface MTU (rxe's rule: 1024 on a
    /// 1500-byte Ethernet, 4096 on loopback).
    pub fn active_mtu(&self) -> PathMtu {
        let room = self.netdev_mtu.saturating_sub(ROCE_OVERHEAD);
        [
            PathMtu::Mtu4096,
            PathMtu::Mtu2048,
            PathMtu::Mtu1024,
            PathMtu::Mtu512,
        ]
        .into_iter()
        .find(|m| m.bytes() <= room)
        .unwrap_or(PathMtu::Mtu256)
    }
    /// Opens the device.
    pub fn open(&self, options: &ContextOptions) -> Result<Context> {
        Context::open(self, options)
    }
}

/// Every device of this host, sorted by name. Loopback is `ferroce_lo`.
pub fn devices() -> Result<Vec<Device>> {
    let mut ifaces: BTreeMap<String, Vec<IpAddr>> = BTreeMap::new();
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(Error::io(
            "listing interfaces",
            std::io::Error::last_os_error(),
        ));
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, valid until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: ifa_addr is non-null and points to a sockaddr whose family we read first.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: the family says it is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                IpAddr::V4(std::net::Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)))
            }
            libc::AF_INET6 => {
                // SAFETY: the family says it is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                // Link-local addresses need a scope on every socket call; RoCE v2 between
                // hosts uses routable addresses, so they are left out.
                if ip.segments()[0] & 0xffc0 == 0xfe80 {
                    continue;
                }
                IpAddr::V6(ip)
            }
            _ => continue,
        };
        ifaces.entry(name).or_default().push(ip);
    }
    // SAFETY: `head` came from getifaddrs and is freed exactly once.
    unsafe { libc::freeifaddrs(head) };
    Ok(ifaces
        .into_iter()
        .map(|(ifname, mut ips)| {
            // IPv4 first: it is what RoCE v2 deployments and rxe's GID index 1 use most.
            ips.sort_by_key(|ip| (ip.is_ipv6(), *ip));
            let gids = ips
                .into_iter()
                .enumerate()
                .map(|(index, ip)| Gid {
                    index,
                    ip,
                    gid: gid_of(ip),
                })
                .collect();
            let netdev_mtu = std::fs::read_to_string(format!("/sys/class/net/{ifname}/mtu"))
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(1500);
            Device {
                name: format!("ferroce_{ifname}"),
                ifname,
                gids,
                netdev_mtu,
            }
        })
        .collect())
}

/// The device with this name (`ferroce_lo`) or interface name (`lo`).
pub fn device_by_name(name: &str) -> Result<Device> {
    devices()?
        .into_iter()
        .find(|d| d.name == name || d.ifname == name)
        .ok_or_else(|| Error::NoDevice(name.to_string()))
}

/// The GID of an address: IPv4 addresses are mapped into IPv6.
pub fn gid_of(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

/// The address a GID stands for.
pub fn ip_of(gid: Ipv6Addr) -> IpAddr {
    match gid.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(gid),
    }
}
