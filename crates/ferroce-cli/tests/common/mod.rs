//! What the process tests share.

use std::net::TcpListener;

/// A TCP port free now, below the ephemeral range: a port the kernel hands out for `:0` can be
/// taken, between this check and the server's bind, by any outgoing connection of a test
/// running beside this one (seen: "Address already in use" for the server). Ports below the
/// range are only ever taken by an explicit bind.
pub fn free_port() -> u16 {
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32768);
    let span = low.saturating_sub(10_000).max(1);
    let mut seed = u64::from(std::process::id()) << 20
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    loop {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let port = (10_000 + (seed >> 33) as u32 % span) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}
