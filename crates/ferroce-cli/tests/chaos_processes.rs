//! Three real processes: a `ferroce perf` server, a `ferroce chaos` relay and a `ferroce perf`
//! client that connects to the relay as if it were the server. At 1%, 5% and 20% loss with
//! reordering, duplication and corruption, every operation kind completes with every byte
//! verified and every FETCH_ADD counted exactly once, WRITE, SEND and READ up to 16 MiB;
//! nothing hangs (every process has a deadline); the relay's own counters prove the faults
//! were injected. Also `perf --loopback --chaos`, the one-command view of what loss does to a
//! WRITE stream.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Every process runs without congestion control (`FERROCE_CC=off`): these cases check that
/// recovery keeps every promise under extreme faults, and through the relay's loss, delay and
/// reordering the delay-based window keeps a few packets in flight and waits out most losses
/// in timeouts (a 16 MiB READ at 20 % loss takes minutes; a known gap of issue #29).
/// Congestion control under faults is checked for correctness in ferroce-proto's scenario
/// suites, where it is on.
fn ferroce() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ferroce"));
    c.env("FERROCE_CC", "off");
    c
}

/// Waits for `child` at most `limit`, killing it past that.
fn wait_bounded(mut child: Child, limit: Duration, what: &str) -> Output {
    let deadline = Instant::now() + limit;
    loop {
        match child.try_wait().unwrap() {
            Some(_) => return child.wait_with_output().unwrap(),
            None if Instant::now() > deadline => {
                let _ = child.kill();
                let out = child.wait_with_output().unwrap();
                panic!(
                    "{what} still running after {limit:?}; stderr: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            None => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

struct Relay {
    child: Child,
    port: u16,
}

impl Relay {
    fn start(to_port: u16, faults: &str) -> Relay {
        let mut child = ferroce()
            .args([
                "chaos",
                faults,
                "--to",
                &format!("127.0.0.1:{to_port}"),
                "--listen",
                "127.0.0.1:0",
                "--stats-every",
                "0",
                "--duration",
                "300",
                "--json",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the relay");
        let mut first = String::new();
        BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut first)
            .unwrap();
        // "ferroce chaos: listening on 127.0.0.1:PORT, relaying to ..."
        let port = first
            .split("listening on 127.0.0.1:")
            .nth(1)
            .and_then(|r| r.split(',').next())
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("relay said: {first}"));
        Relay { child, port }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs one test through a relay; `Err` only for the one failure IBTA allows on a lossy path:
/// the retry budget spent ("transport retry counter exceeded").
fn run_through_relay(test: &str, faults: &str, extra: &[&str]) -> Result<(), String> {
    // One three-process case at a time: on two cores, several at once starve the relay and the
    // engines for longer than an ACK timeout and measure the machine, not the transport.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let started = Instant::now();
    // Port 0: the server takes one the kernel picks and names it on its first line, so no
    // other test can take it between a choice and the bind.
    let mut server = ferroce()
        .args(["perf", test, "--port", "0"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the server");
    let mut server_err = BufReader::new(server.stderr.take().expect("stderr"));
    let mut server_first = String::new();
    server_err
        .read_line(&mut server_first)
        .expect("the server's first line");
    // "ferroce perf: write_bw server on 127.0.0.1:39609"
    let server_port: u16 = server_first
        .trim_end()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in the server's first line: {server_first:?}"));
    // The rest of its stderr, read as it comes (a full pipe would stop the server).
    let server_rest = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut server_err, &mut rest);
        rest
    });
    let relay = Relay::start(server_port, faults);
    // The server may still be binding: retry the connection for a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    let client = loop {
        let c = ferroce()
            .args(["perf", test, "127.0.0.1", "--port", &relay.port.to_string()])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the client");
        let out = wait_bounded(c, Duration::from_secs(120), "client");
        let refused = String::from_utf8_lossy(&out.stderr).contains("refused");
        if !refused || Instant::now() > deadline {
            break out;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut server = wait_bounded(server, Duration::from_secs(30), "server");
    server.stderr =
        format!("{server_first}{}", server_rest.join().unwrap_or_default()).into_bytes();
    let what = format!("{test} {extra:?} through {faults}");
    let client_err = String::from_utf8_lossy(&client.stderr).to_string();
    if !client.status.success() && client_err.contains("transport retry counter exceeded") {
        return Err(format!("{what}: {client_err}"));
    }
    assert!(
        server.status.success() && client.status.success(),
        "{what}: server {:?} {}\nclient {:?} {}\n{}",
        server.status,
        String::from_utf8_lossy(&server.stderr),
        client.status,
        String::from_utf8_lossy(&client.stderr),
        String::from_utf8_lossy(&client.stdout)
    );
    drop(relay);
    // Seen with --nocapture: what each case costs (its turn included, not the wait for it).
    eprintln!("{what}: {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// 16.8 ms ACK timeout: tail losses recover quickly, and the retry budget (8 × 16.8 ms of no
/// progress at all) stays far above a loaded CI machine's scheduling stalls. A 16 MiB READ at
/// 20% loss spends most of its time in ACK timeouts (a piece of a retry whose request or last
/// response is lost): 1.6-3.5 s at 16.8 ms, 5.6-13 s at the default 67 ms (`perf --loopback`,
/// relay seeds 1-5).
const IN_FLIGHT: &[&str] = &[
    "--qp-timeout",
    "12",
    "--timeout",
    "60",
    "--verify",
    "--json",
];

/// One 16 MiB message: 4096 packets at the loopback MTU, each lost one time in five at 20%.
const ONE_16_MIB: &[&str] = &["--size", "16777216", "--iters", "1", "--tx-depth", "1"];

/// One case through the relay, rerun with the next seed (at most 3 runs) when the retry budget
/// ran out and `budget_may_run_out` says that is a legitimate outcome at this loss rate.
fn run_case(faults: &str, budget_may_run_out: bool, test: &str, args: &[&str]) {
    let mut tries = 0;
    loop {
        let spec = format!("{faults},seed={}", 1000 + tries);
        match run_through_relay(test, &spec, args) {
            Ok(()) => return,
            Err(e) if budget_may_run_out && tries < 2 => {
                eprintln!("retry budget spent (allowed at this loss rate), again: {e}");
                tries += 1;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

/// Every operation kind through `faults`: WRITE and SEND up to `big`, READ up to `read_big`,
/// latency tests, and FETCH_ADDs. With `budget_may_run_out`, a run that ends in "transport
/// retry counter exceeded" is run again with another seed (at most 3 times in all): at 20% loss
/// each way an operation's request or answer is lost 36% of the time, so the 8 tries IBTA allows
/// (retry_cnt 7) all fail with probability 0.36^8 ≈ 3·10⁻⁴ per stalled operation — a correct
/// outcome, but not one a test should flake on.
fn all_operations(faults: &str, big: &str, read_big: &str, budget_may_run_out: bool) {
    let run = |test: &str, args: &[&str]| run_case(faults, budget_may_run_out, test, args);
    for test in ["write_bw", "read_bw", "send_bw"] {
        let top = if test == "read_bw" { read_big } else { big };
        for size in ["0", "4097", top] {
            let iters = if size == top { "2" } else { "30" };
            let args = [
                &["--size", size, "--iters", iters, "--tx-depth", "8"][..],
                IN_FLIGHT,
            ]
            .concat();
            run(test, &args);
        }
    }
    for test in ["write_lat", "read_lat", "send_lat"] {
        let args = [&["--size", "4097", "--iters", "30"][..], IN_FLIGHT].concat();
        run(test, &args);
    }
    // The server checks the counter is exactly the number of FETCH_ADDs; the latency test's
    // client checks every original value.
    for test in ["atomic_bw", "atomic_lat"] {
        let args = [&["--iters", "200", "--tx-depth", "16"][..], IN_FLIGHT].concat();
        run(test, &args);
    }
}

#[test]
fn one_percent_loss_every_operation_writes_and_sends_up_to_16_mib() {
    all_operations(
        "loss=0.01,reorder=0.01,duplicate=0.01,corrupt=0.005",
        "16777216",
        "4194304",
        false,
    );
}

#[test]
fn five_percent_loss_every_operation_up_to_16_mib() {
    let faults = "loss=0.05,reorder=0.05,duplicate=0.02,corrupt=0.01";
    all_operations(faults, "16777216", "1048576", false);
    // One 16 MiB READ. Its retries ask for pieces of the rest (see ferroce_proto::requester):
    // asking for the whole rest each time overflowed the relay's buffer (~500k drops for a
    // 4096-packet answer) and took 7-9 s through `perf --loopback --chaos loss=0.05`.
    run_case(faults, false, "read_bw", &[ONE_16_MIB, IN_FLIGHT].concat());
}

/// At 20% the 16 MiB cases may be rerun like the others: a READ's retry budget runs out only
/// when eight pieces in a row bring nothing new (each does with probability ~0.2, its request
/// lost), so a systematic failure still fails all three runs.
#[test]
fn twenty_percent_loss_every_operation_up_to_16_mib() {
    let faults = "loss=0.2,reorder=0.05,duplicate=0.05,corrupt=0.01";
    all_operations(faults, "1048576", "262144", true);
    for test in ["write_bw", "send_bw", "read_bw"] {
        run_case(faults, true, test, &[ONE_16_MIB, IN_FLIGHT].concat());
    }
}

#[test]
fn perf_loopback_chaos_shows_what_loss_does() {
    let out = ferroce()
        .args([
            "perf",
            "write_bw",
            "--loopback",
            "--size",
            "65536",
            "--iters",
            "200",
            "--verify",
            "--counters",
            "--json",
            "--qp-timeout",
            "10",
            "--chaos",
            "loss=0.05,reorder=0.05,duplicate=0.02,corrupt=0.01,delay_ms=0.2,seed=7",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let counters = lines
        .iter()
        .find_map(|v| v.get("counters"))
        .expect("counters");
    let chaos = lines
        .iter()
        .find_map(|v| v.get("chaos"))
        .expect("relay stats");
    let to_server = &chaos["to_server"];
    let lost = to_server["lost"].as_u64().unwrap();
    assert!(lost > 0, "{chaos}");
    assert!(to_server["corrupted"].as_u64().unwrap() > 0, "{chaos}");
    assert!(
        counters["retransmits"].as_u64().unwrap() >= lost,
        "every lost request packet was sent again: {counters} {chaos}"
    );
    assert_eq!(counters["retry_exceeded_err"].as_u64(), Some(0));

    let bad = ferroce()
        .args(["perf", "write_bw", "--loopback", "--chaos", "loss=2"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let err = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("loss=2") && err.contains("between 0 and 1"),
        "{err}"
    );
}
