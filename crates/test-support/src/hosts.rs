//! Two hosts made of network namespaces for process tests: each with its loopback up, joined by
//! a veth pair (`veth0` on both sides) with one address each, deleted when dropped. Needs root
//! (see [`crate::require_root`]).

use std::process::Command;

/// Runs `ip args`, panicking with its output on failure.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("running ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespace hosts, deleted on drop.
pub struct TwoHosts {
    /// The namespaces' names.
    pub names: [String; 2],
    /// Their addresses on the veth pair.
    pub addrs: [String; 2],
}

impl TwoHosts {
    /// Namespaces named `ferroce-{tag}-{pid}-a` and `-b`, with addresses `addrs` (IPv4, each the
    /// other's point-to-point peer).
    pub fn new(tag: &str, addrs: [&str; 2]) -> TwoHosts {
        let names = ["a", "b"].map(|h| format!("ferroce-{tag}-{}-{h}", std::process::id()));
        let hosts = TwoHosts {
            names: names.clone(),
            addrs: addrs.map(str::to_string),
        };
        for ns in &names {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
            ip(&["netns", "add", ns]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        ip(&[
            "link", "add", "veth0", "netns", &names[0], "type", "veth", "peer", "name", "veth0",
            "netns", &names[1],
        ]);
        for (i, ns) in names.iter().enumerate() {
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                addrs[i],
                "peer",
                addrs[1 - i],
                "dev",
                "veth0",
            ]);
            ip(&["-n", ns, "link", "set", "veth0", "up"]);
        }
        hosts
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.names {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// A TCP port free on this host now (the kernel's choice for port 0).
pub fn free_tcp_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding port 0")
        .port()
}
