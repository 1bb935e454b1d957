//! Which local address reaches a peer, and which ferroce device (and GID) holds it: what
//! `perf` and `pingpong` both decide before they open a context.

use std::net::{IpAddr, UdpSocket};

use ferroce::Device;

/// This host's address on the route to `peer`: the source the kernel would choose.
pub fn source_for(peer: IpAddr) -> Result<IpAddr, String> {
    let any: IpAddr = if peer.is_ipv4() {
        [0u8; 4].into()
    } else {
        [0u16; 8].into()
    };
    let probe = |e: std::io::Error| format!("probing the route to {peer}: {e}");
    let sock = UdpSocket::bind((any, 0)).map_err(probe)?;
    sock.connect((peer, 9))
        .map_err(|e| format!("no route to {peer}: {e}"))?;
    Ok(sock.local_addr().map_err(probe)?.ip())
}

/// The device named `name` (with the index of `ip` in its GID table, else 0), or without a
/// name the device whose GID table holds `ip`, with that index.
pub fn device_for(name: Option<&str>, ip: IpAddr) -> Result<(Device, usize), String> {
    let devices = ferroce::devices().map_err(|e| e.to_string())?;
    if let Some(name) = name {
        let d = devices
            .into_iter()
            .find(|d| d.name() == name || d.ifname() == name)
            .ok_or_else(|| format!("no device {name} (see 'ferroce devices')"))?;
        let idx = d.gids().iter().position(|g| g.ip == ip).unwrap_or(0);
        return Ok((d, idx));
    }
    devices
        .into_iter()
        .find_map(|d| {
            let i = d.gids().iter().position(|g| g.ip == ip)?;
            Some((d, i))
        })
        .ok_or_else(|| format!("no device holds the address {ip} (see 'ferroce devices')"))
}
