//! The nccl-tests-shaped tools (`ferroce all_reduce_perf` and its siblings) as separate
//! processes: every collective's table with every element checked, on local ranks it starts
//! itself, over shared memory and over UDP; 4 ranks on two hosts made of network namespaces
//! (shared memory inside a host, UDP between them); a rank killed mid-run failing the others
//! within the timeout; bad arguments refused.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const TOOLS: [&str; 7] = [
    "all_reduce_perf",
    "all_gather_perf",
    "reduce_scatter_perf",
    "broadcast_perf",
    "reduce_perf",
    "alltoall_perf",
    "sendrecv_perf",
];

fn ferroce() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ferroce"))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Checks a tool's table: every row has nccl-tests' 13 columns with `#wrong` 0 in both, there
/// are `rows` of them, and the footer says OK. Returns the rows.
fn check_table(tool: &str, out: &str, rows: usize) -> Vec<Vec<String>> {
    let table: Vec<Vec<String>> = out
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect();
    assert_eq!(table.len(), rows, "{tool}: rows\n{out}");
    for row in &table {
        assert_eq!(row.len(), 13, "{tool}: columns of {row:?}\n{out}");
        assert_eq!((&*row[8], &*row[12]), ("0", "0"), "{tool}: #wrong\n{out}");
        for f in [5, 6, 7, 9, 10, 11] {
            assert!(row[f].parse::<f64>().is_ok(), "{tool}: {row:?}");
        }
    }
    assert!(
        out.contains("# Out of bounds values : 0 OK"),
        "{tool}\n{out}"
    );
    assert!(out.contains("# Avg bus bandwidth    : "), "{tool}\n{out}");
    assert!(
        out.contains(
            "#       size         count      type   redop    root     time   algbw   busbw #wrong"
        ),
        "{tool}\n{out}"
    );
    table
}

#[test]
fn every_tool_checks_every_element_on_local_ranks() {
    for (provider, ranks) in [("auto", 3), ("udp", 2), ("auto", 1)] {
        for tool in TOOLS {
            if tool == "sendrecv_perf" && ranks == 1 {
                continue;
            }
            let out = ferroce()
                .args(["--provider", provider, tool, "--ranks", &ranks.to_string()])
                .args(["-b", "1", "-e", "600K", "-f", "9", "-n", "3", "-w", "1"])
                .args([
                    "-d",
                    "bfloat16",
                    "-o",
                    "max",
                    "-r",
                    &(ranks - 1).to_string(),
                ])
                .output()
                .unwrap();
            let all = text(&out);
            assert!(out.status.success(), "{provider} {ranks} {tool}\n{all}");
            // 1, 9, 81, 729, 6561, 59049, 531441 bytes.
            let table = check_table(tool, &String::from_utf8_lossy(&out.stdout), 7);
            let rooted = matches!(tool, "broadcast_perf" | "reduce_perf");
            let root = if rooted {
                (ranks - 1).to_string()
            } else {
                "-1".into()
            };
            assert!(
                table.iter().all(|r| r[2] == "bfloat16" && r[4] == root),
                "{all}"
            );
            let links = format!(
                "links: {} {}",
                ranks - 1,
                if provider == "auto" { "shm" } else { "udp" }
            );
            let lines = all.lines().filter(|l| l.starts_with("#  Rank")).count();
            assert_eq!(lines, ranks, "{all}");
            if ranks > 1 {
                assert!(all.contains(&links), "{provider} {tool}: {links}\n{all}");
            }
        }
    }
}

#[test]
fn bad_arguments_are_refused_with_one_line() {
    for (args, says) in [
        (&["-d", "int8"][..], "datatype 'int8' is not supported"),
        (&["-o", "xor"][..], "op 'xor' is not supported"),
        (&["-g", "2"][..], "-g and -t must be 1"),
        (&["-b", "2M", "-e", "1M"][..], "is larger than -e"),
        (&["-b", "1X"][..], "not a size"),
        (&["--ranks", "0"][..], "--ranks must be at least 1"),
        (&["-a", "7"][..], "-a takes"),
    ] {
        let out = ferroce()
            .arg("all_reduce_perf")
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
    }
}

/// Rank 2 of 3 is killed with SIGKILL while the ranks stream 16 MiB allreduces: ranks 0 and 1
/// fail with an error within the timeout (3 s without progress), over either provider.
#[test]
fn a_killed_rank_fails_the_others_within_the_timeout() {
    for provider in ["auto", "udp"] {
        let mut rank0 = ferroce()
            .args(["--provider", provider, "all_reduce_perf", "--ranks", "3"])
            .args([
                "-b", "16M", "-e", "16M", "-n", "100000", "-w", "0", "-c", "0",
            ])
            .args(["--timeout", "3"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Rank 0 prints every rank's pid once all are connected.
        let mut lines = BufReader::new(rank0.stdout.take().unwrap()).lines();
        let pid = loop {
            let line = lines
                .next()
                .expect("rank 0 ended before listing the ranks")
                .unwrap();
            if line.starts_with("#  Rank  2") {
                let pid = line.split_whitespace().nth(6).unwrap().to_string();
                break pid;
            }
        };
        // Let the stream start, then kill rank 2.
        std::thread::sleep(Duration::from_millis(300));
        assert!(Command::new("kill")
            .args(["-9", &pid])
            .status()
            .unwrap()
            .success());
        let killed = Instant::now();
        let status = rank0.wait().unwrap();
        let took = killed.elapsed();
        let mut err = String::new();
        std::io::Read::read_to_string(&mut rank0.stderr.take().unwrap(), &mut err).unwrap();
        assert!(
            !status.success(),
            "{provider}: rank 0 succeeded without rank 2\n{err}"
        );
        // Rank 1's error and rank 0's each make a line (rank 1 is rank 0's child).
        assert!(
            err.matches("ferroce: rank").count() >= 2,
            "{provider}: {err}"
        );
        assert!(
            took < Duration::from_secs(12),
            "{provider}: {took:?}\n{err}"
        );
    }
}

/// 4 ranks on two hosts, 2 each: every tool's table checked element by element on every
/// rank, each rank reaching its neighbour on the host over shared memory and the other host's
/// two over UDP.
#[test]
fn four_ranks_on_two_namespace_hosts() {
    if !ferroce_test_support::require_root(
        "four_ranks_on_two_namespace_hosts",
        "network namespaces",
    ) {
        return;
    }
    let hosts = ferroce_test_support::hosts::TwoHosts::new("coll", ["10.211.0.1", "10.211.0.2"]);
    let (names, addrs) = (&hosts.names, &hosts.addrs);
    for (k, tool) in TOOLS.iter().enumerate() {
        let port = (29500 + k).to_string();
        let children: Vec<_> = (0..4)
            .map(|rank| {
                let host = rank / 2;
                Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        &names[host],
                        env!("CARGO_BIN_EXE_ferroce"),
                        tool,
                    ])
                    .args([
                        "-b", "4", "-e", "3M", "-f", "16", "-n", "3", "-w", "1", "-r", "3",
                    ])
                    .args(["--timeout", "20"])
                    .env("RANK", rank.to_string())
                    .env("WORLD_SIZE", "4")
                    .env("LOCAL_RANK", (rank % 2).to_string())
                    .env("MASTER_ADDR", &addrs[0])
                    .env("MASTER_PORT", &port)
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let outs: Vec<Output> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        for (rank, out) in outs.iter().enumerate() {
            assert!(out.status.success(), "{tool} rank {rank}\n{}", text(out));
        }
        let lead = String::from_utf8_lossy(&outs[0].stdout).to_string();
        // 4, 64, 1024, 16384, 262144 bytes.
        check_table(tool, &lead, 5);
        let ranks: Vec<&str> = lead.lines().filter(|l| l.starts_with("#  Rank")).collect();
        assert_eq!(ranks.len(), 4, "{lead}");
        for line in ranks {
            assert!(line.contains("links: 1 shm, 2 udp"), "{tool}: {line}");
        }
    }
    drop(hosts);
}

/// Under Open MPI's `mpirun`, ranks come from its own variables (`OMPI_COMM_WORLD_RANK`, ...)
/// and the rendezvous from `-x MASTER_ADDR -x MASTER_PORT`.
#[test]
fn launched_by_mpirun_with_open_mpis_rank_variables() {
    let probe = Command::new("mpirun.openmpi").arg("--version").output();
    if !ferroce_test_support::require(
        probe.is_ok(),
        "launched_by_mpirun",
        "mpirun.openmpi",
        "scripts/test.sh installs openmpi-bin",
    ) {
        return;
    }
    assert!(
        probe.unwrap().status.success(),
        "mpirun.openmpi --version failed"
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let out = Command::new("mpirun.openmpi")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
        ])
        .args(["--mca", "plm", "isolated", "-np", "3"])
        .args([
            "-x",
            "MASTER_ADDR=127.0.0.1",
            "-x",
            &format!("MASTER_PORT={port}"),
        ])
        .arg(env!("CARGO_BIN_EXE_ferroce"))
        .args([
            "alltoall_perf",
            "-b",
            "3",
            "-e",
            "300K",
            "-f",
            "10",
            "-n",
            "3",
            "-w",
            "1",
        ])
        .output()
        .unwrap();
    let all = text(&out);
    assert!(out.status.success(), "{all}");
    // 3, 30, 300, 3000, 30000, 300000 bytes.
    check_table("alltoall_perf", &String::from_utf8_lossy(&out.stdout), 6);
    assert_eq!(all.matches("#  Rank").count(), 3, "{all}");
}

/// Every collective at 64 MiB, every element checked: 3 ranks over shared memory, 2 over UDP.
#[test]
fn every_tool_at_sixty_four_mib() {
    for (provider, ranks) in [("auto", "3"), ("udp", "2")] {
        for tool in TOOLS {
            let out = ferroce()
                .args(["--provider", provider, tool, "--ranks", ranks])
                .args(["-b", "64M", "-e", "64M", "-n", "1", "-w", "0", "-r", "1"])
                .output()
                .unwrap();
            let all = text(&out);
            assert!(out.status.success(), "{provider} {tool}\n{all}");
            check_table(tool, &String::from_utf8_lossy(&out.stdout), 1);
        }
    }
}
