//! Every packet ferroce puts on a real link verifies for whoever receives it, GSO included.
//!
//! Two hosts are network namespaces joined by a veth pair whose sending end has UDP
//! segmentation offload turned off, so the kernel cuts each GSO send into datagrams on that
//! link, numbering their IPv4 Identification 0, 1, 2, ... (the field the ICRC covers). A
//! `ferroce perf write_bw` stream of 64 KiB WRITEs at path MTU 1024 crosses it while `dumpcap`
//! records the receiving end. Every RoCE packet of the capture must verify in `ferroce decode`
//! and in an independent checker (`scripts/verify_icrc.py`, zlib's CRC-32), the capture must
//! show the numbered Identifications (segments were really cut), and the receiver must have
//! refused nothing and accepted the numbered ones by solving for their Identification.
//!
//! Needs root (namespaces, ethtool); without it the test prints one "skipped" line and passes,
//! except under CI (`CI=true`), where it fails (`ferroce_test_support::require`). With root, a
//! missing tool is a failure (`scripts/test.sh` installs them).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const A: (&str, &str, &str) = ("a", "vcut-a", "10.213.9.1");
const B: (&str, &str, &str) = ("b", "vcut-b", "10.213.9.2");

fn ferroce() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ferroce"))
}

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `cmd` to completion within `limit`; its output (read as it comes, so a talkative
/// program never blocks on a full pipe).
fn run(cmd: &mut Command, limit: Duration) -> Output {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("starting {cmd:?}: {e}"));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("{cmd:?} still running after {limit:?}");
        }
    }
}

fn ok(cmd: &mut Command) -> String {
    let out = run(cmd, Duration::from_secs(60));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Two namespaces joined by a veth pair; dropping it deletes them (and the pair).
struct Hosts {
    names: [String; 2],
}

impl Hosts {
    fn new() -> Hosts {
        let pid = std::process::id();
        let names = [A.0, B.0].map(|h| format!("ferroce-cut-{pid}-{h}"));
        for n in &names {
            ok(Command::new("ip").args(["netns", "add", n]));
        }
        let hosts = Hosts { names };
        let (na, nb) = (&hosts.names[0], &hosts.names[1]);
        ok(Command::new("ip").args([
            "link", "add", A.1, "netns", na, "type", "veth", "peer", "name", B.1, "netns", nb,
        ]));
        for (ns, me, peer) in [(na, A, B), (nb, B, A)] {
            ok(Command::new("ip")
                .args(["-n", ns, "addr", "add", me.2, "peer", peer.2, "dev", me.1]));
            ok(Command::new("ip").args(["-n", ns, "link", "set", me.1, "up"]));
        }
        hosts
    }

    fn exec(&self, host: usize, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.names[host]]).arg(program);
        c
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = Command::new("ip").args(["netns", "del", n]).output();
        }
    }
}

/// A child killed if the test fails before it is waited for.
struct Guard(Option<Child>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The value of counter `name` in `perf --counters` output.
fn counter(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some(name)).then(|| w.next()?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("no counter {name} in:\n{text}"))
}

#[test]
fn gso_segments_cut_on_a_veth_link_all_verify() {
    if !ferroce_test_support::require_root(
        "gso_segments_cut_on_a_veth_link_all_verify",
        "network namespaces and ethtool",
    ) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("ferroce-cut-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pcap = dir.join("link.pcap");
    let hosts = Hosts::new();
    // The sending end cuts GSO sends itself (as a NIC without offload, or a bridge, would).
    ok(hosts
        .exec(0, Path::new("ethtool"))
        .args(["-K", A.1, "tx-udp-segmentation", "off"]));

    let mut dumpcap = hosts.exec(1, Path::new("dumpcap"));
    dumpcap
        .args(["-q", "-P", "-B", "64", "-i", B.1, "-w"])
        .arg(&pcap)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut capture = Guard(Some(
        dumpcap.spawn().expect("dumpcap (Debian package tshark)"),
    ));
    // dumpcap writes the file's header once it captures.
    let t0 = Instant::now();
    while std::fs::metadata(&pcap).map_or(0, |m| m.len()) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "dumpcap did not start"
        );
        std::thread::sleep(Duration::from_millis(50));
    }

    let common = [
        "--roce-port",
        "4791",
        "--size",
        "65536",
        "--iters",
        "100",
        "--mtu",
        "1024",
        "--verify",
        "--counters",
    ];
    let mut server = hosts.exec(1, &ferroce());
    server
        .args(["perf", "write_bw", "--bind", B.2])
        .args(common)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let server = Guard(Some(server.spawn().unwrap()));
    std::thread::sleep(Duration::from_millis(300));
    let client = ok(hosts
        .exec(0, &ferroce())
        .args(["perf", "write_bw", B.2])
        .args(common));
    let server = {
        let mut g = server;
        let child = g.0.take().unwrap();
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "server: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    std::thread::sleep(Duration::from_millis(300));
    let mut dc = capture.0.take().unwrap();
    // SIGINT: dumpcap closes its file and exits.
    ok(Command::new("kill").args(["-INT", &dc.id().to_string()]));
    assert!(dc.wait().unwrap().success(), "dumpcap must exit cleanly");
    drop(hosts);

    // Every RoCE packet on the link verifies: ferroce's decoder, then an independent one.
    let decoded = ok(Command::new(ferroce()).arg("decode").arg(&pcap));
    let summary = decoded.lines().last().unwrap_or_default().to_string();
    let roce: u64 = summary
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("decode summary: {summary}"));
    assert!(summary.contains("0 bad ICRC"), "{summary}");
    // 100 WRITEs of 64 KiB at MTU 1024 are 6400 packets (dumpcap may miss some of a burst
    // that fast: what it caught is what is checked).
    assert!(roce >= 3200, "{summary}");
    let independent = ok(Command::new("python3")
        .arg(workspace().join("scripts/verify_icrc.py"))
        .arg(&pcap));
    assert!(
        independent.contains(&format!("{roce} RoCEv2 packets, ICRC ok {roce}, bad 0")),
        "{independent}"
    );

    // The segments were cut on the link: Identifications 1, 2, ... are on the wire.
    let ids = ok(Command::new("tshark").args(["-r"]).arg(&pcap).args([
        "-Y",
        "udp.dstport == 4791",
        "-T",
        "fields",
        "-e",
        "ip.id",
    ]));
    let numbered = ids
        .lines()
        .filter(|l| u16::from_str_radix(l.trim().trim_start_matches("0x"), 16).is_ok_and(|v| v > 0))
        .count() as u64;
    assert!(
        numbered > roce / 2,
        "{numbered} of {roce} packets with a non-zero Identification: no segments were cut?"
    );

    // The receiver refused nothing, and accepted the numbered ones by solving for their
    // Identification; the sender saw its ACKs, which leave alone, with Identification 0.
    assert_eq!(counter(&server, "icrc_errors"), 0, "{server}");
    assert!(
        counter(&server, "icrc_ident_solved") >= numbered,
        "{server}"
    );
    assert_eq!(counter(&client, "icrc_errors"), 0, "{client}");
    let _ = std::fs::remove_dir_all(&dir);
}
