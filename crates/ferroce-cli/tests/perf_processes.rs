//! `ferroce perf` as two real processes on loopback: a server and a client, each with its own
//! context, UDP socket and engine, connected over TCP. Every operation at sizes from 0 B to
//! 16 MiB with every byte checked, 64 QPs at once, one-sided operations served while the server's
//! application thread only waits on TCP, and a capture that tshark and `ferroce decode` read
//! cleanly.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use ferroce_test_support::hosts::free_tcp_port as free_port;

fn ferroce() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ferroce"))
}

/// A `ferroce perf` server listening on a TCP port the kernel chose (`--port 0`; the server
/// names it on its first line), so no other test can take the port between a choice and the
/// bind, as with a port picked in advance.
struct Server {
    child: Child,
    port: u16,
    /// The rest of its stderr, read as it comes (a full pipe would stop the server).
    stderr: std::thread::JoinHandle<String>,
    first_line: String,
}

impl Server {
    fn wait_with_output(self) -> std::io::Result<Output> {
        let mut out = self.child.wait_with_output()?;
        let rest = self.stderr.join().unwrap_or_default();
        out.stderr = format!("{}{rest}", self.first_line).into_bytes();
        Ok(out)
    }
}

fn spawn_server(test: &str, extra: &[&str], env: &[(&str, &Path)]) -> Server {
    use std::io::{BufRead, BufReader, Read};
    let mut c = ferroce();
    c.args(["perf", test, "--port", "0"]).args(extra);
    for (k, v) in env {
        c.env(k, v);
    }
    let mut child = c
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    let mut err = BufReader::new(child.stderr.take().expect("stderr"));
    let mut first_line = String::new();
    err.read_line(&mut first_line)
        .expect("the server's first line");
    // "ferroce perf: write_bw server on 127.0.0.1:39609"
    let port = first_line
        .trim_end()
        .rsplit([':', ' '])
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in the server's first line: {first_line:?}"));
    let stderr = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = err.read_to_string(&mut rest);
        rest
    });
    Server {
        child,
        port,
        stderr,
        first_line,
    }
}

fn run_client(test: &str, port: u16, extra: &[&str], env: &[(&str, &Path)]) -> Output {
    // The server may still be binding: retry the connection for a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = ferroce();
        c.args(["perf", test, "127.0.0.1", "--port", &port.to_string()])
            .args(extra);
        for (k, v) in env {
            c.env(k, v);
        }
        let out = c.output().expect("run the client");
        let refused = String::from_utf8_lossy(&out.stderr).contains("refused");
        if !refused || Instant::now() > deadline {
            return out;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn pair(test: &str, extra: &[&str]) -> (Output, Output) {
    pair_env(test, extra, &[], &[], &[])
}

fn pair_env(
    test: &str,
    extra: &[&str],
    server_only: &[&str],
    server_env: &[(&str, &Path)],
    client_env: &[(&str, &Path)],
) -> (Output, Output) {
    let server = spawn_server(test, &[extra, server_only].concat(), server_env);
    let client = run_client(test, server.port, extra, client_env);
    let server = server.wait_with_output().expect("server exits");
    (server, client)
}

fn assert_ok(what: &str, server: &Output, client: &Output) {
    assert!(
        server.status.success() && client.status.success(),
        "{what}: server {:?} {}\nclient {:?} {}\n{}",
        server.status,
        String::from_utf8_lossy(&server.stderr),
        client.status,
        String::from_utf8_lossy(&client.stderr),
        String::from_utf8_lossy(&client.stdout)
    );
}

fn json_lines(out: &Output) -> Vec<serde_json::Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

#[test]
fn every_operation_every_size_with_verification() {
    for provider in ["udp", "shm"] {
        every_operation_every_size_on(provider);
    }
}

fn every_operation_every_size_on(provider: &str) {
    // 0 B, 1 B, around the 4096-byte path MTU, and up to 16 MiB.
    let sizes = [
        "0", "1", "4095", "4096", "4097", "65536", "1048576", "16777216",
    ];
    // The banner names the provider the QPs really use.
    let (s, c) = pair(
        "write_bw",
        &["--size", "64", "--iters", "4", "--provider", provider],
    );
    assert_ok(provider, &s, &c);
    let want = if provider == "shm" {
        "shared memory"
    } else {
        "RoCE v2 over UDP"
    };
    assert!(
        String::from_utf8_lossy(&c.stdout).contains(&format!("Transport type : {want}")),
        "{provider}: {}",
        String::from_utf8_lossy(&c.stdout)
    );
    for test in ["write_bw", "read_bw", "send_bw"] {
        for size in sizes {
            let iters = if size.len() > 6 { "4" } else { "50" };
            let extra = [
                "--size",
                size,
                "--iters",
                iters,
                "--verify",
                "--json",
                "--provider",
                provider,
            ];
            let (s, c) = pair(test, &extra);
            assert_ok(&format!("{test} {size}"), &s, &c);
            let v = json_lines(&c);
            assert_eq!(v.len(), 1, "{test} {size}");
            assert_eq!(v[0]["bytes"].as_u64(), Some(size.parse().unwrap()));
            assert!(v[0]["msg_rate_mpps"].as_f64().unwrap() > 0.0);
            assert_eq!(v[0]["bw_avg_mb_s"].as_f64().unwrap() > 0.0, size != "0");
        }
    }
    for test in ["write_lat", "send_lat", "read_lat"] {
        for size in ["1", "4097", "1048576"] {
            let (s, c) = pair(
                test,
                &[
                    "--size",
                    size,
                    "--iters",
                    "20",
                    "--verify",
                    "--json",
                    "--provider",
                    provider,
                ],
            );
            assert_ok(&format!("{test} {size}"), &s, &c);
            let v = json_lines(&c);
            assert!(
                v[0]["t_typical_us"].as_f64().unwrap() > 0.0,
                "{test} {size}: {v:?}"
            );
        }
    }
    for test in ["atomic_lat", "atomic_bw"] {
        // The server checks the counter ends at exactly the number of FETCH_ADDs; the client
        // checks every original value in the latency test.
        let (s, c) = pair(test, &["--iters", "500", "--verify", "--json"]);
        assert_ok(test, &s, &c);
        let bytes: Vec<u64> = json_lines(&c)
            .iter()
            .map(|v| v["bytes"].as_u64().unwrap())
            .collect();
        assert_eq!(bytes, vec![8], "{test} reports the 8 bytes an atomic moves");
    }
}

#[test]
fn all_sizes_in_one_run() {
    let (s, c) = pair("write_bw", &["--all", "--iters", "8", "--verify", "--json"]);
    assert_ok("write_bw --all", &s, &c);
    let bytes: Vec<u64> = json_lines(&c)
        .iter()
        .map(|v| v["bytes"].as_u64().unwrap())
        .collect();
    assert_eq!(bytes, (1..=23).map(|k| 1u64 << k).collect::<Vec<_>>());
}

#[test]
fn sixty_four_qps_between_two_processes() {
    for (test, provider) in ["write_bw", "read_bw", "send_bw", "atomic_bw"]
        .into_iter()
        .flat_map(|t| [(t, "udp"), (t, "shm")])
    {
        let size: &[&str] = if test == "atomic_bw" {
            &[]
        } else {
            &["--size", "8192"]
        };
        let args = [
            &[
                "--qps",
                "64",
                "--iters",
                "40",
                "--verify",
                "--json",
                "--provider",
                provider,
            ][..],
            size,
        ]
        .concat();
        let (s, c) = pair(test, &args);
        assert_ok(&format!("{test} 64 QPs over {provider}"), &s, &c);
        assert_eq!(json_lines(&c)[0]["iterations"].as_u64(), Some(64 * 40));
    }
}

#[test]
fn a_timed_run_reports_what_each_qp_delivered() {
    for provider in ["udp", "shm"] {
        let args = [
            "--duration",
            "0.4",
            "--qps",
            "3",
            "--size",
            "8192",
            "--verify",
            "--json",
            "--provider",
            provider,
        ];
        let (s, c) = pair("write_bw", &args);
        assert_ok(&format!("write_bw --duration over {provider}"), &s, &c);
        let v = &json_lines(&c)[0];
        assert_eq!(v["finished"], true, "{v}");
        assert_eq!(v["duration_s"].as_f64(), Some(0.4));
        let per_qp: Vec<u64> = v["per_qp_bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap())
            .collect();
        assert_eq!(per_qp.len(), 3, "{v}");
        assert!(per_qp.iter().all(|&b| b > 0 && b % 8192 == 0), "{v}");
        let total: u64 = per_qp.iter().sum();
        assert_eq!(v["delivered_bytes"].as_u64(), Some(total));
        assert_eq!(v["iterations"].as_u64(), Some(total / 8192));
    }
}

/// `--events`: the waits sleep on the CQ's completion channel; every test that waits on the
/// CQ still moves every byte, over both providers, timed or counted.
#[test]
fn tests_that_sleep_on_completion_events_move_every_byte() {
    for provider in ["udp", "shm"] {
        for (test, extra) in [
            ("write_bw", &["--iters", "300", "--size", "65536"][..]),
            (
                "write_bw",
                &["--duration", "0.3", "--qps", "2", "--size", "8192"],
            ),
            ("read_bw", &["--iters", "200", "--size", "65536"]),
            ("send_bw", &["--iters", "300", "--size", "4096"]),
            ("send_lat", &["--iters", "300", "--size", "8"]),
            ("read_lat", &["--iters", "300", "--size", "64"]),
            ("atomic_lat", &["--iters", "300"]),
        ] {
            let args = [
                extra,
                &[
                    "--events",
                    "--verify",
                    "--json",
                    "--counters",
                    "--provider",
                    provider,
                ],
            ]
            .concat();
            let (s, c) = pair(test, &args);
            assert_ok(&format!("{test} --events over {provider}"), &s, &c);
            let lines = json_lines(&c);
            let v = &lines[0];
            assert!(
                v["iterations"].as_u64().is_some_and(|n| n > 0),
                "{test}: {v}"
            );
            if v.get("finished").is_some() {
                assert_eq!(v["finished"], true, "{test}: {v}");
            }
            // The client waited on its channel. A latency test over UDP must have slept: each
            // answer is a round trip away when it starts waiting. (A bandwidth test's window
            // may always hold a completion by the time it looks, and over shared memory a
            // one-sided operation completes inside its post.)
            let waits = lines.iter().find_map(|l| l["event_waits"].as_u64());
            let must_sleep = provider == "udp" && test.ends_with("_lat");
            let slept = waits.is_some_and(|n| n > 0 || !must_sleep);
            assert!(slept, "{test} over {provider}: {lines:?}");
        }
    }
}

#[test]
fn a_timed_run_that_cannot_finish_still_reports_what_was_delivered() {
    // Every RoCE packet is lost: the QPs give up after their retries (8 × 4 ms, timeout code
    // 10) and the client says so after printing the (empty) result, instead of hanging.
    let out = ferroce()
        .args(["perf", "write_bw", "--loopback", "--provider", "udp"])
        .args(["--chaos", "loss=1", "--duration", "0.2", "--timeout", "5"])
        .args(["--qp-timeout", "10", "--qps", "2", "--json", "--counters"])
        .output()
        .expect("run perf");
    assert!(!out.status.success());
    let lines = json_lines(&out);
    let v = &lines[0];
    assert_eq!(v["finished"], false, "{v}");
    assert_eq!(v["delivered_bytes"].as_u64(), Some(0), "{v}");
    assert_eq!(v["failed_qps"].as_u64(), Some(2), "{v}");
    assert!(lines
        .iter()
        .any(|l| l["counters"]["retransmits"].as_u64() > Some(0)));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("did not finish"), "{err}");
}

#[test]
fn duration_is_refused_where_the_server_must_count() {
    for test in ["send_bw", "atomic_bw", "write_lat"] {
        let out = ferroce()
            .args(["perf", test, "--loopback", "--duration", "1"])
            .output()
            .expect("run perf");
        assert!(!out.status.success(), "{test}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("--duration"),
            "{test}"
        );
    }
}

#[test]
fn one_sided_operations_need_no_server_thread() {
    // In READ, WRITE and atomic tests the server's only thread blocks reading the TCP
    // connection for the whole round: every packet is handled by its engine thread. The
    // server's CPU time is accordingly tiny next to the client's busy loop.
    for (test, provider) in ["read_bw", "write_bw", "atomic_bw"]
        .into_iter()
        .flat_map(|t| [(t, "udp"), (t, "shm")])
    {
        let size: &[&str] = if test == "atomic_bw" {
            &[]
        } else {
            &["--size", "4096"]
        };
        let args = [
            &[
                "--iters",
                "3000",
                "--verify",
                "--json",
                "--counters",
                "--provider",
                provider,
            ][..],
            size,
        ]
        .concat();
        let (s, c) = pair(test, &args);
        assert_ok(test, &s, &c);
        let v = json_lines(&c);
        let counters = &v.last().unwrap()["counters"];
        assert_eq!(counters["retry_exceeded_err"].as_u64(), Some(0), "{v:?}");
        assert_eq!(counters["rkey_violations"].as_u64(), Some(0));
    }
}

fn free_udp_port() -> u16 {
    std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Decodes `file` with `ferroce decode --json`, RoCE v2 on the UDP `ports`: the output, the
/// number of RoCE packets, and how many of them carry a correct ICRC.
fn decode_icrcs(file: &Path, ports: &[&str]) -> (Output, usize, usize) {
    let mut cmd = ferroce();
    cmd.args(["decode", "--json"]);
    for p in ports {
        cmd.args(["--udp-port", p]);
    }
    let out = cmd.arg(file).output().unwrap();
    let v = json_lines(&out);
    let roce = v.iter().filter(|v| v.get("skipped").is_none()).count();
    let good = v
        .iter()
        .filter(|v| v["icrc_ok"] == serde_json::Value::Bool(true))
        .count();
    (out, roce, good)
}

#[test]
fn a_capture_of_a_perf_run_decodes_cleanly_in_tshark_and_ferroce() {
    let dir = std::env::temp_dir().join(format!("ferroce-capture-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The server on the RoCE v2 port; the client on a port the decoders are told about (two
    // processes on one address cannot both have 4791).
    let client_port = free_udp_port().to_string();
    let mut files = Vec::new();
    for (test, size) in [
        ("write_lat", "5000"),
        ("read_bw", "3000"),
        ("send_lat", "100"),
        ("atomic_bw", ""),
    ] {
        let file = dir.join(format!("{test}.pcap"));
        let mut extra = vec!["--iters", "50", "--verify"];
        if !size.is_empty() {
            extra.extend(["--size", size]);
        }
        let client = [&extra[..], &["--roce-port", &client_port]].concat();
        let server = spawn_server(test, &[&extra[..], &["--roce-port", "4791"]].concat(), &[]);
        let c = run_client(test, server.port, &client, &[("FERROCE_PCAP", &file)]);
        let s = server.wait_with_output().unwrap();
        assert_ok(&format!("captured {test}"), &s, &c);
        files.push(file);
    }
    for file in files {
        // ferroce's own decoder: every packet parses and every ICRC verifies (exit 0).
        let (ours, roce, good) = decode_icrcs(&file, &["4791", &client_port]);
        assert_eq!(
            ours.status.code(),
            Some(0),
            "{}",
            String::from_utf8_lossy(&ours.stdout)
        );
        assert!(
            roce >= 100 && good == roce,
            "{file:?}: {good} of {roce} packets verify"
        );
        // tshark: every frame is RoCE v2 (InfiniBand BTH) and nothing is malformed.
        let decode_as = format!("udp.port=={client_port},infiniband");
        let t = Command::new("tshark")
            .args(["-n", "-d", &decode_as, "-r"])
            .arg(&file)
            .args([
                "-T",
                "fields",
                "-e",
                "frame.number",
                "-e",
                "infiniband.bth.opcode",
                "-e",
                "_ws.malformed",
            ])
            .output()
            .expect("tshark must be installed (scripts/test.sh installs it)");
        assert!(t.status.success(), "{}", String::from_utf8_lossy(&t.stderr));
        let text = String::from_utf8_lossy(&t.stdout);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines.len(),
            roce,
            "{file:?}: every frame of the capture is RoCE"
        );
        for l in lines {
            let f: Vec<&str> = l.split('\t').collect();
            assert!(
                f.len() >= 2 && !f[1].is_empty(),
                "{file:?}: tshark did not see a BTH in {l:?}"
            );
            assert!(
                f.get(2).is_none_or(|m| m.is_empty()),
                "{file:?}: malformed frame {l:?}"
            );
        }
    }
}

#[test]
fn unreachable_peer_and_bad_arguments_fail_in_one_line() {
    let port = free_port();
    let out = ferroce()
        .args([
            "perf",
            "write_lat",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--timeout",
            "2",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("refused"), "{err}");
    for args in [
        &["perf", "write_lat", "--qps", "2", "--loopback"][..],
        &["perf", "bogus_test"],
        &["perf", "write_bw", "--size", "-1"],
        &["perf", "write_lat", "--size", "0", "--loopback"],
        &["perf", "write_bw", "--mtu", "1000", "--loopback"],
        &["pingpong", "--size", "0"],
        &["pingpong", "-m", "1000", "--loopback"],
        &["pingpong", "--ib-port", "2"],
        // What perftest's exchange would need and ferroce does not do: refused before any
        // connection is made.
        &["perf", "write_bw", "--perftest", "-q", "2", "127.0.0.1"],
        &["perf", "write_bw", "--perftest", "-a", "127.0.0.1"],
        &["perf", "atomic_lat", "--perftest", "-s", "16", "127.0.0.1"],
        &["perf", "write_bw", "--perftest", "--loopback"],
        &["perf", "atomic_bw", "--perftest", "-A", "SWAP", "127.0.0.1"],
        // A WRITE ping-pong waits on memory, which raises no event; perftest's exchange is
        // perftest's.
        &["perf", "write_lat", "--events", "--loopback"],
        &["perf", "write_bw", "--perftest", "-e", "127.0.0.1"],
    ] {
        let out = ferroce().args(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert_eq!(
            String::from_utf8_lossy(&out.stderr).lines().count(),
            1,
            "{args:?}"
        );
    }
}

#[test]
fn pingpong_and_devices_and_demo() {
    let out = ferroce()
        .args(["pingpong", "--loopback", "--iters", "200", "--verify"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("1638400 bytes in") && text.contains("200 iters in"),
        "{text}"
    );
    let out = ferroce().arg("devices").output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("hca_id: ferroce_lo") && text.contains("::ffff:127.0.0.1"),
        "{text}"
    );
    let out = ferroce().output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    for op in [
        "SEND/RECV",
        "RDMA WRITE",
        "RDMA WRITE with imm",
        "RDMA READ",
        "COMPARE_SWAP",
        "FETCH_ADD",
        "Bandwidth",
        "run 1: udp",
        "run 2: shm",
    ] {
        assert!(text.contains(op), "{op} missing:\n{text}");
    }
    // The counters row of each run: (UDP run, shm run), as read from A's context.
    let row = |name: &str| -> (u64, u64) {
        let line = text
            .lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no row {name}:\n{text}"));
        let v: Vec<u64> = line[line.find(name).unwrap() + name.len()..]
            .split_whitespace()
            .map(|w| w.parse().unwrap())
            .collect();
        (v[0], v[1])
    };
    // Over UDP nothing is done directly; over shm every WRITE (1000 and 1000 read-backs), READ,
    // CAS and FETCH_ADD of step 2 and the 256 WRITEs of step 3 are.
    assert_eq!(
        row("one-sided ops done in B's memory directly"),
        (0, 5 * 1000 + 256),
        "{text}"
    );
    let (udp_sent, shm_sent) = row("packets sent (UDP datagrams / ring entries)");
    // 256 MiB of WRITEs at MTU 4096 alone is 65536 packets; over shm only the 1000 SENDs and
    // 1000 WRITEs with immediate are packets.
    assert!(udp_sent >= 65536 + 6000, "{text}");
    assert!((2000..2100).contains(&shm_sent), "{text}");
    assert_eq!(row("ICRC errors"), (0, 0), "{text}");
}

#[test]
fn without_segmentation_offload_the_same_bytes_arrive() {
    // FERROCE_NO_GSO / FERROCE_NO_GRO force the plain sendmmsg/recvmmsg path a kernel without
    // UDP offloads would take.
    let no_offload = Path::new("1");
    let env = [
        ("FERROCE_NO_GSO", no_offload),
        ("FERROCE_NO_GRO", no_offload),
    ];
    let opts = ["--size", "1048576", "--iters", "20", "--verify", "--json"];
    let server = spawn_server("write_bw", &opts, &env);
    let client = run_client("write_bw", server.port, &opts, &env);
    let server = server.wait_with_output().unwrap();
    assert_ok("write_bw without offloads", &server, &client);
}

/// Regression: a receiver that stops polling right after its engine held back an ACK, while the
/// engine thread slept with nothing to wake it (the application had drained the socket), left
/// the sender without completions until its timeout (15 runs in 20 failed).
#[test]
fn acks_are_never_stranded_when_the_receiver_stops_polling() {
    for _ in 0..10 {
        let out = ferroce()
            .args([
                "perf",
                "send_bw",
                "--loopback",
                "--size",
                "1",
                "--iters",
                "50",
                "--timeout",
                "5",
                "--json",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn packets_captured_on_the_wire_carry_correct_icrcs() {
    // FERROCE_PCAP records what ferroce meant to send; this looks at what the kernel actually
    // sent, headers included. The ICRC covers the IPv4 Identification, which the kernel chooses
    // (a connected socket numbers its datagrams; an unconnected one with DF sends 0), so only
    // the wire shows whether ferroce computed its ICRCs over the right header. Capturing on
    // `lo` needs root, as CI runs the suite.
    let dir = std::env::temp_dir().join(format!("ferroce-wire-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("wire.pcap");
    let (server_roce, client_roce) = (free_udp_port().to_string(), free_udp_port().to_string());
    let filter = format!("udp port {server_roce} or udp port {client_roce}");
    let dumpcap = Command::new("dumpcap")
        .args(["-q", "-P", "-i", "lo", "-f", &filter, "-w"])
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("dumpcap must be installed (scripts/test.sh installs tshark)");
    // dumpcap creates the file once it captures.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !file.exists() {
        assert!(Instant::now() < deadline, "dumpcap did not start capturing");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let common = [
        "--iters",
        "50",
        "--size",
        "3000",
        "--verify",
        "--provider",
        "udp",
    ];
    let server = spawn_server(
        "write_lat",
        &[&common[..], &["--roce-port", &server_roce]].concat(),
        &[],
    );
    let c = run_client(
        "write_lat",
        server.port,
        &[&common[..], &["--roce-port", &client_roce]].concat(),
        &[],
    );
    let s = server.wait_with_output().unwrap();
    assert_ok("write_lat over UDP", &s, &c);
    std::thread::sleep(Duration::from_millis(300));
    // SIGINT: dumpcap finishes the file and exits.
    let _ = Command::new("kill")
        .args(["-INT", &dumpcap.id().to_string()])
        .status();
    let done = dumpcap.wait_with_output().unwrap();
    assert!(
        done.status.success(),
        "dumpcap: {:?} {}",
        done.status,
        String::from_utf8_lossy(&done.stderr)
    );
    let (out, _, _) = decode_icrcs(&file, &[&server_roce, &client_roce]);
    // A capture on `lo` sees a GSO send whole, before any segmentation (loopback never
    // segments it; the receiving socket checks each segment): such a "packet" is longer than
    // the path MTU and its trailing bytes are no ICRC. A resend of several WRITEs after a fast
    // retransmission timeout leaves that way. Only single packets are judged.
    let single: Vec<serde_json::Value> = json_lines(&out)
        .into_iter()
        .filter(|v| v.get("skipped").is_none())
        .filter(|v| v["payload_len"].as_u64().is_some_and(|n| n <= 4096))
        .collect();
    let roce = single.len();
    let good = single
        .iter()
        .filter(|v| v["icrc_ok"] == serde_json::Value::Bool(true))
        .count();
    assert!(
        roce >= 100 && good == roce,
        "{good} of {roce} packets on the wire carry a correct ICRC:\n{}",
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("\"icrc_ok\":false"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--wait-like-perftest`: the WRITE latency test between two processes with no CQ poll while
/// waiting (the engine thread lands a WRITE that arrives over UDP), on both providers.
#[test]
fn write_latency_waiting_like_perftest() {
    for provider in ["udp", "shm"] {
        let (s, c) = pair(
            "write_lat",
            &[
                "--wait-like-perftest",
                "--iters",
                "500",
                "--provider",
                provider,
                "--json",
            ],
        );
        assert_ok(provider, &s, &c);
        let lines = json_lines(&c);
        let typical = lines
            .iter()
            .find_map(|j| j["t_typical_us"].as_f64())
            .unwrap_or_else(|| panic!("{provider}: no result: {lines:?}"));
        assert!(typical > 0.0, "{provider}: {typical}");
    }
}

/// Issue #28: a user of another uid ran `ferroce perf write_lat` against a server run as root
/// and got "Transport type : shared memory", reaching root's QP over shared pages. Now the
/// client, run as `nobody` against a root server, is refused by the kernel-reported uid and
/// takes RoCE v2 over UDP, where the server's responder checks everything; the run still
/// verifies every byte, in both directions.
#[test]
fn a_client_of_another_uid_gets_udp_not_shared_memory() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    if !ferroce_test_support::require_root(
        "a_client_of_another_uid_gets_udp_not_shared_memory",
        "to run the client as nobody",
    ) {
        return;
    }
    // nobody needs a copy of the binary it may reach and execute.
    let dir = std::env::temp_dir().join(format!("ferroce-uid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = dir.join("ferroce");
    std::fs::copy(env!("CARGO_BIN_EXE_ferroce"), &exe).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
    for test in ["write_lat", "read_bw"] {
        let extra = ["--iters", "300", "--size", "4096", "--verify"];
        let server = spawn_server(test, &extra, &[]);
        let deadline = Instant::now() + Duration::from_secs(10);
        let client = loop {
            let out = Command::new(&exe)
                .args([
                    "perf",
                    test,
                    "127.0.0.1",
                    "--port",
                    &server.port.to_string(),
                ])
                .args(extra)
                .uid(65534)
                .gid(65534)
                .output()
                .expect("run the client as nobody");
            let refused = String::from_utf8_lossy(&out.stderr).contains("refused");
            if !refused || Instant::now() > deadline {
                break out;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let server = server.wait_with_output().expect("server exits");
        assert_ok(test, &server, &client);
        let out = String::from_utf8_lossy(&client.stdout);
        assert!(
            out.contains("Transport type : RoCE v2 over UDP (ferroce)"),
            "{test} as nobody against root:\n{out}"
        );
        assert!(!out.contains("shared memory"), "{out}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
