//! `ferroce nvmf-perf` against `ferroce nvmf-target` as separate processes: on one host (shared
//! memory) and between two network-namespace hosts (RoCE v2 over UDP), every read checked
//! against what was written; a host killed mid-run leaves the target serving the next, and the
//! target ends on SIGINT with every queue it opened closed.

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferroce_test_support::hosts::{free_tcp_port, TwoHosts};

const NQN: &str = "nqn.2026-11.io.ferroce:cli-test";

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `ferroce`, inside network namespace `ns` if given.
fn ferroce_in(ns: Option<&str>) -> Command {
    match ns {
        None => Command::new(env!("CARGO_BIN_EXE_ferroce")),
        Some(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_ferroce")]);
            c
        }
    }
}

fn start_target(ns: Option<&str>, listen: &str, port: u16) -> Child {
    let t = ferroce_in(ns)
        .args(["nvmf-target", "--nqn", NQN, "--listen", listen])
        .args(["--port", &port.to_string(), "--memory", "32M"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if !listening(ns, port) {
        let mut t = t;
        let _ = t.kill();
        let out = t.wait_with_output().unwrap();
        panic!("the target did not listen\n{}", text(&out));
    }
    t
}

/// Whether the TCP port answers within 20 s.
fn listening(ns: Option<&str>, port: u16) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        let probe = match ns {
            None => std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
            Some(ns) => Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    ns,
                    "ss",
                    "-ltnH",
                    &format!("sport = :{port}"),
                ])
                .output()
                .is_ok_and(|o| !o.stdout.is_empty()),
        };
        if probe {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// One `nvmf-perf` run, which must succeed with every read checked; returns its output.
fn perf(ns: Option<&str>, target: &str, port: u16, args: &[&str]) -> String {
    let out = ferroce_in(ns)
        .args(["nvmf-perf", "--target", target, "--port", &port.to_string()])
        .args(["--nqn", NQN, "--verify"])
        .args(args)
        .output()
        .unwrap();
    let t = text(&out);
    assert!(out.status.success(), "nvmf-perf {args:?}\n{t}");
    let verify = t
        .lines()
        .find_map(|l| l.trim().strip_prefix("verify: "))
        .unwrap_or_else(|| panic!("no verify line\n{t}"));
    let checked: u64 = verify.split_whitespace().next().unwrap().parse().unwrap();
    assert!(verify.ends_with(", 0 mismatches"), "{t}");
    let reads = !args.iter().any(|a| *a == "write" || *a == "randwrite");
    assert!(!reads || checked > 0, "no read was checked\n{t}");
    assert!(t.contains("errors: 0"), "{t}");
    t
}

/// SIGINT to the target: it must end cleanly and report every queue it opened as closed.
fn stop_target(t: Child, opened_at_least: u64) -> String {
    let pid = t.id().to_string();
    let k = Command::new("kill").args(["-INT", &pid]).status().unwrap();
    assert!(k.success());
    let out = t.wait_with_output().unwrap();
    let s = text(&out);
    assert!(out.status.success(), "{s}");
    let line = s
        .lines()
        .find(|l| l.contains("queues opened"))
        .unwrap_or_else(|| panic!("no counters\n{s}"));
    let (opened, closed) = (
        number_after(line, "queues opened "),
        number_after(line, " closed "),
    );
    assert!(opened >= opened_at_least, "{s}");
    assert_eq!(opened, closed, "queues left open at exit: {s}");
    s
}

/// A host killed mid-run: the target must keep serving the next one.
fn kill_a_host_mid_run(ns: Option<&str>, target: &str, port: u16) {
    let mut victim = ferroce_in(ns)
        .args(["nvmf-perf", "--target", target, "--port", &port.to_string()])
        .args(["--nqn", NQN, "--rw", "randwrite", "--bs", "4k", "--qd", "8"])
        .args(["--time", "30", "--size", "8M"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Long enough to be connected and moving (a debug build on a busy machine included).
    std::thread::sleep(Duration::from_millis(3000));
    assert!(victim.try_wait().unwrap().is_none(), "the host ended early");
    victim.kill().unwrap();
    victim.wait().unwrap();
}

#[test]
fn nvmf_perf_against_nvmf_target_on_one_host() {
    let port = free_tcp_port();
    let t = start_target(None, "127.0.0.1", port);
    perf(
        None,
        "127.0.0.1",
        port,
        &[
            "--rw", "randrw", "--bs", "4k", "--qd", "8", "--time", "1", "--size", "8M",
        ],
    );
    perf(
        None,
        "127.0.0.1",
        port,
        &[
            "--rw", "read", "--bs", "1M", "--qd", "2", "--time", "1", "--size", "16M",
        ],
    );
    kill_a_host_mid_run(None, "127.0.0.1", port);
    perf(
        None,
        "127.0.0.1",
        port,
        &[
            "--rw", "randread", "--bs", "8k", "--qd", "4", "--time", "1", "--size", "4M",
        ],
    );
    // Three hosts that finished and one killed: two queues each.
    stop_target(t, 8);
}

#[test]
fn nvmf_perf_against_nvmf_target_between_namespace_hosts() {
    if !ferroce_test_support::require_root(
        "nvmf_perf_against_nvmf_target_between_namespace_hosts",
        "network namespaces",
    ) {
        return;
    }
    let hosts = TwoHosts::new("nvmf", ["10.212.0.1", "10.212.0.2"]);
    let (names, addrs) = (&hosts.names, &hosts.addrs);
    let port = 4420;
    let t = start_target(Some(&names[0]), &addrs[0], port);
    let host = Some(names[1].as_str());
    perf(
        host,
        &addrs[0],
        port,
        &[
            "--rw", "randrw", "--bs", "4k", "--qd", "8", "--time", "1", "--size", "8M",
        ],
    );
    perf(
        host,
        &addrs[0],
        port,
        &[
            "--rw", "write", "--bs", "256k", "--qd", "4", "--time", "1", "--size", "16M",
        ],
    );
    kill_a_host_mid_run(host, &addrs[0], port);
    perf(
        host,
        &addrs[0],
        port,
        &[
            "--rw", "randread", "--bs", "4k", "--qd", "16", "--time", "1", "--size", "4M",
        ],
    );
    stop_target(t, 8);
    drop(hosts);
}

/// The first number after the first `key` in `text`.
fn number_after(text: &str, key: &str) -> u64 {
    let at = text
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} in\n{text}"))
        + key.len();
    text[at..]
        .split(|c: char| !c.is_ascii_digit())
        .find(|w| !w.is_empty())
        .unwrap()
        .parse()
        .unwrap()
}

/// Command capsules lost on the wire: nftables in the host's namespace drops every tenth
/// datagram to the target the size of a bare 64-byte capsule (a SEND of one SQE: UDP length
/// 8 + BTH 12 + 64 + ICRC 4). RC sends each again, so every command still completes with
/// success and every read checks; the host counts what it sent again, and the target goes on
/// serving the next host and ends with every queue closed.
#[test]
fn lost_command_capsules_are_sent_again_and_every_command_succeeds() {
    if !ferroce_test_support::require_root(
        "lost_command_capsules_are_sent_again_and_every_command_succeeds",
        "network namespaces and nftables",
    ) {
        return;
    }
    let hosts = TwoHosts::new("nvmfloss", ["10.213.0.1", "10.213.0.2"]);
    let (names, addrs) = (&hosts.names, &hosts.addrs);
    let port = 4420;
    let t = start_target(Some(&names[0]), &addrs[0], port);
    let table = "ferroce_capsule_loss";
    let ruleset = format!(
        "table inet {table} {{\n chain out {{\n  type filter hook output priority 0; policy accept;\n  ip daddr {} udp dport 4791 udp length 88 numgen inc mod 10 == 0 counter drop\n }}\n}}\n",
        addrs[0]
    );
    let mut nft = Command::new("ip")
        .args(["netns", "exec", &names[1], "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .expect("running nft (nftables)");
    use std::io::Write;
    nft.stdin
        .take()
        .unwrap()
        .write_all(ruleset.as_bytes())
        .unwrap();
    assert!(nft.wait().unwrap().success(), "loading {ruleset}");
    let host = Some(names[1].as_str());
    let out = perf(
        host,
        &addrs[0],
        port,
        &[
            "--rw", "randread", "--bs", "4k", "--qd", "8", "--time", "1", "--size", "2M",
        ],
    );
    let listed = Command::new("ip")
        .args([
            "netns", "exec", &names[1], "nft", "list", "table", "inet", table,
        ])
        .output()
        .unwrap();
    let dropped = number_after(&String::from_utf8_lossy(&listed.stdout), "counter packets ");
    assert!(dropped > 0, "no capsule was dropped\n{out}");
    let transport = out
        .lines()
        .find(|l| l.contains("transport:"))
        .unwrap_or_else(|| panic!("no transport line\n{out}"));
    let resent = number_after(transport, "retransmitted ");
    assert!(
        resent >= dropped,
        "{dropped} capsules dropped, {resent} packets sent again\n{out}"
    );
    // The target serves the next host as before (the loss still on).
    perf(
        host,
        &addrs[0],
        port,
        &[
            "--rw",
            "randwrite",
            "--bs",
            "4k",
            "--qd",
            "4",
            "--time",
            "1",
            "--size",
            "1M",
        ],
    );
    stop_target(t, 4);
    drop(hosts);
}
