//! ferroce's libibverbs.so.1 under unmodified rdma-core programs: its ABI checked against the
//! installed rdma-core (headers compiled by gcc, exports read by objdump, strings from the real
//! library), then Debian's own `ibv_devices`, `ibv_devinfo`, `ibv_rc_pingpong` and perftest
//! binaries run over it — between two processes on this host, and between two network-namespace
//! hosts.
//!
//! Needs (scripts/test.sh installs them): gcc, binutils, libibverbs-dev, ibverbs-utils,
//! perftest, rdmacm-utils, ucx-utils, openmpi-bin, libopenmpi-dev, python3-pyverbs, iproute2;
//! root for the namespaces and /dev/infiniband.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use ferroce_ibverbs::abi::*;

/// The directory holding the linked libibverbs.so.1 (linked once per test run from the
/// staticlib cargo built beside this test).
fn library_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable");
        let archive = exe
            .parent()
            .and_then(Path::parent)
            .expect("target dir")
            .join("libferroce_ibverbs.a");
        assert!(
            archive.exists(),
            "{} was not built: cargo builds a crate's staticlib only when asked for the crate \
             itself; run `cargo build --profile test -p ferroce-ibverbs` first \
             (scripts/test.sh does)",
            archive.display()
        );
        let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("ibverbs");
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/build-libibverbs.sh");
        let st = Command::new(script)
            .arg("--link-only")
            .arg(&archive)
            .arg(&out)
            .status()
            .expect("running build-libibverbs.sh");
        assert!(st.success(), "linking libibverbs.so.1 failed");
        out
    })
}

/// A command that runs over ferroce's library.
fn over_ferroce(program: &str) -> Command {
    let mut c = Command::new(program);
    c.env("LD_LIBRARY_PATH", library_dir())
        .env("FERROCE_PCAP", "")
        .stdin(Stdio::null());
    c
}

fn text(o: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}--- stderr\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dropin");
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
}

/// Compiles a C program against the installed rdma-core headers and libibverbs.
fn compile_c(name: &str, source: &str) -> PathBuf {
    compile_c_with(name, source, &["-libverbs"])
}

/// Compiles a C program against the installed rdma-core headers, linked with `libs`.
fn compile_c_with(name: &str, source: &str, libs: &[&str]) -> PathBuf {
    let src = scratch(&format!("{name}.c"));
    let exe = scratch(name);
    std::fs::write(&src, source).unwrap();
    let o = Command::new("gcc")
        .args(["-O1", "-o"])
        .arg(&exe)
        .arg(&src)
        .args(libs)
        .output()
        .expect("gcc (install gcc, libibverbs-dev and librdmacm-dev)");
    assert!(o.status.success(), "compiling {name}: {}", text(&o));
    exe
}

macro_rules! fields {
    ($($ty:ident: $($field:ident).+;)*) => {
        [$((
            concat!(stringify!($ty), " ", stringify!($($field).+)),
            std::mem::offset_of!($ty, $($field).+),
        )),*]
    };
}

#[test]
fn abi_layout_matches_the_installed_headers() {
    // Every field the library reads or writes, and the size of each structure it hands out or
    // fills: gcc says where the installed headers put them.
    let offsets = fields! {
        ibv_device: name; ibv_device: dev_name; ibv_device: dev_path; ibv_device: ibdev_path;
        ibv_device: node_type; ibv_device: transport_type;
        ibv_context: device; ibv_context: ops; ibv_context: cmd_fd; ibv_context: async_fd;
        ibv_context: num_comp_vectors; ibv_context: mutex; ibv_context: abi_compat;
        ibv_context_ops: poll_cq; ibv_context_ops: req_notify_cq; ibv_context_ops: post_send;
        ibv_context_ops: post_recv; ibv_context_ops: post_srq_recv; ibv_context_ops: alloc_mw;
        ibv_pd: context; ibv_pd: handle;
        ibv_mr: context; ibv_mr: pd; ibv_mr: addr; ibv_mr: length; ibv_mr: lkey; ibv_mr: rkey;
        ibv_comp_channel: context; ibv_comp_channel: fd; ibv_comp_channel: refcnt;
        ibv_cq: context; ibv_cq: channel; ibv_cq: cq_context; ibv_cq: cqe;
        ibv_cq: comp_events_completed; ibv_cq: async_events_completed;
        ibv_qp: context; ibv_qp: qp_context; ibv_qp: pd; ibv_qp: send_cq; ibv_qp: recv_cq;
        ibv_qp: srq; ibv_qp: qp_num; ibv_qp: state; ibv_qp: qp_type; ibv_qp: events_completed;
        ibv_srq: context; ibv_srq: srq_context; ibv_srq: pd; ibv_srq: events_completed;
        ibv_srq_attr: max_wr; ibv_srq_attr: max_sge; ibv_srq_attr: srq_limit;
        ibv_srq_init_attr: srq_context; ibv_srq_init_attr: attr;
        ibv_qp_cap: max_send_wr; ibv_qp_cap: max_recv_wr; ibv_qp_cap: max_send_sge;
        ibv_qp_cap: max_recv_sge; ibv_qp_cap: max_inline_data;
        ibv_qp_init_attr: qp_context; ibv_qp_init_attr: send_cq; ibv_qp_init_attr: recv_cq;
        ibv_qp_init_attr: srq; ibv_qp_init_attr: cap; ibv_qp_init_attr: qp_type;
        ibv_qp_init_attr: sq_sig_all;
        ibv_qp_attr: qp_state; ibv_qp_attr: cur_qp_state; ibv_qp_attr: path_mtu;
        ibv_qp_attr: qkey; ibv_qp_attr: rq_psn; ibv_qp_attr: sq_psn; ibv_qp_attr: dest_qp_num;
        ibv_qp_attr: qp_access_flags; ibv_qp_attr: cap; ibv_qp_attr: ah_attr;
        ibv_qp_attr: pkey_index; ibv_qp_attr: max_rd_atomic; ibv_qp_attr: max_dest_rd_atomic;
        ibv_qp_attr: min_rnr_timer; ibv_qp_attr: port_num; ibv_qp_attr: timeout;
        ibv_qp_attr: retry_cnt; ibv_qp_attr: rnr_retry; ibv_qp_attr: rate_limit;
        ibv_ah_attr: grh; ibv_ah_attr: dlid; ibv_ah_attr: is_global; ibv_ah_attr: port_num;
        ibv_global_route: dgid; ibv_global_route: flow_label; ibv_global_route: sgid_index;
        ibv_global_route: hop_limit; ibv_global_route: traffic_class;
        ibv_sge: addr; ibv_sge: length; ibv_sge: lkey;
        ibv_send_wr: wr_id; ibv_send_wr: next; ibv_send_wr: sg_list; ibv_send_wr: num_sge;
        ibv_send_wr: opcode; ibv_send_wr: send_flags; ibv_send_wr: __bindgen_anon_1;
        ibv_send_wr: wr; ibv_send_wr: qp_type;
        ibv_recv_wr: wr_id; ibv_recv_wr: next; ibv_recv_wr: sg_list; ibv_recv_wr: num_sge;
        ibv_wc: wr_id; ibv_wc: status; ibv_wc: opcode; ibv_wc: vendor_err; ibv_wc: byte_len;
        ibv_wc: __bindgen_anon_1; ibv_wc: qp_num; ibv_wc: src_qp; ibv_wc: wc_flags;
        ibv_wc: pkey_index; ibv_wc: slid; ibv_wc: sl; ibv_wc: dlid_path_bits;
        ibv_device_attr: fw_ver; ibv_device_attr: node_guid; ibv_device_attr: max_mr_size;
        ibv_device_attr: vendor_id; ibv_device_attr: max_qp; ibv_device_attr: max_qp_wr;
        ibv_device_attr: device_cap_flags; ibv_device_attr: max_sge; ibv_device_attr: max_cqe;
        ibv_device_attr: max_qp_rd_atom; ibv_device_attr: atomic_cap; ibv_device_attr: max_srq_sge;
        ibv_device_attr: max_pkeys; ibv_device_attr: local_ca_ack_delay;
        ibv_device_attr: phys_port_cnt;
        ibv_port_attr: state; ibv_port_attr: active_mtu; ibv_port_attr: gid_tbl_len;
        ibv_port_attr: max_msg_sz; ibv_port_attr: pkey_tbl_len; ibv_port_attr: lid;
        ibv_port_attr: active_width; ibv_port_attr: active_speed; ibv_port_attr: phys_state;
        ibv_port_attr: link_layer; ibv_port_attr: port_cap_flags2;
        ibv_gid_entry: gid; ibv_gid_entry: gid_index; ibv_gid_entry: port_num;
        ibv_gid_entry: gid_type; ibv_gid_entry: ndev_ifindex;
        ibv_async_event: element; ibv_async_event: event_type;
    };
    let sizes = [
        ("ibv_device", std::mem::size_of::<ibv_device>()),
        ("ibv_context", std::mem::size_of::<ibv_context>()),
        ("ibv_context_ops", std::mem::size_of::<ibv_context_ops>()),
        ("ibv_pd", std::mem::size_of::<ibv_pd>()),
        ("ibv_mr", std::mem::size_of::<ibv_mr>()),
        ("ibv_comp_channel", std::mem::size_of::<ibv_comp_channel>()),
        ("ibv_cq", std::mem::size_of::<ibv_cq>()),
        ("ibv_qp", std::mem::size_of::<ibv_qp>()),
        ("ibv_srq", std::mem::size_of::<ibv_srq>()),
        ("ibv_qp_attr", std::mem::size_of::<ibv_qp_attr>()),
        ("ibv_qp_init_attr", std::mem::size_of::<ibv_qp_init_attr>()),
        ("ibv_send_wr", std::mem::size_of::<ibv_send_wr>()),
        ("ibv_recv_wr", std::mem::size_of::<ibv_recv_wr>()),
        ("ibv_wc", std::mem::size_of::<ibv_wc>()),
        ("ibv_device_attr", std::mem::size_of::<ibv_device_attr>()),
        ("ibv_port_attr", std::mem::size_of::<ibv_port_attr>()),
        ("ibv_gid_entry", std::mem::size_of::<ibv_gid_entry>()),
        ("ibv_async_event", std::mem::size_of::<ibv_async_event>()),
    ];
    let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void) {\n");
    for (name, _) in &offsets {
        let (ty, field) = name.split_once(' ').unwrap();
        // bindgen names the anonymous unions; in C they are reached through a member.
        let field = match (ty, field) {
            ("ibv_send_wr", "__bindgen_anon_1") | ("ibv_wc", "__bindgen_anon_1") => "imm_data",
            _ => field,
        };
        c += &format!("  printf(\"{name} %zu\\n\", offsetof(struct {ty}, {field}));\n");
    }
    for (ty, _) in &sizes {
        c += &format!("  printf(\"sizeof {ty} %zu\\n\", sizeof(struct {ty}));\n");
    }
    c += "  return 0;\n}\n";
    let exe = compile_c("layout", &c);
    let o = Command::new(&exe).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let from_c: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(String::from)
        .collect();
    let ours: Vec<String> = offsets
        .iter()
        .map(|(n, v)| format!("{n} {v}"))
        .chain(sizes.iter().map(|(t, v)| format!("sizeof {t} {v}")))
        .collect();
    assert_eq!(
        ours, from_c,
        "the Rust structures disagree with the installed headers"
    );
    // The two offsets the issue names, as the inline calls of verbs.h reach them on x86-64.
    if cfg!(target_arch = "x86_64") {
        assert_eq!(
            std::mem::offset_of!(ibv_context, ops)
                + std::mem::offset_of!(ibv_context_ops, post_send),
            208
        );
        assert_eq!(
            std::mem::offset_of!(ibv_context, ops) + std::mem::offset_of!(ibv_context_ops, poll_cq),
            96
        );
    }
}

/// (version, name) of every default-version symbol a library defines.
fn exports(lib: &Path) -> BTreeSet<(String, String)> {
    let o = Command::new("objdump")
        .arg("-T")
        .arg(lib)
        .output()
        .expect("objdump (binutils)");
    assert!(o.status.success(), "{}", text(&o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| !l.contains("*UND*"))
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (ver, name) = (f.get(f.len().checked_sub(2)?)?, f.last()?);
            // A hidden (non-default) version is printed in parentheses; the node's own
            // symbol carries the node's name.
            let ours = ver.starts_with("IBVERBS") || ver.starts_with("FERROCE_PRIVATE");
            (ours && ver != name).then(|| (ver.to_string(), name.to_string()))
        })
        .collect()
}

#[test]
fn exports_every_rdma_core_symbol_in_its_version_node() {
    let ours = exports(&library_dir().join("libibverbs.so.1"));
    let listed: BTreeSet<(String, String)> = include_str!("../abi/libibverbs.symbols")
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(v, n)| (v.to_string(), n.to_string()))
        .collect();
    assert_eq!(ours, listed, "exports differ from abi/libibverbs.symbols");
    assert!(listed.len() >= 145);
    let installed = Path::new("/usr/lib/x86_64-linux-gnu/libibverbs.so.1");
    if installed.exists() {
        // ferroce's own node (QP1 for its librdmacm, `src/gsi.rs`) is the one difference.
        let rdma_core: BTreeSet<_> = ours
            .iter()
            .filter(|(v, _)| !v.starts_with("FERROCE_PRIVATE"))
            .cloned()
            .collect();
        assert_eq!(rdma_core.len() + 4, ours.len());
        assert_eq!(
            rdma_core,
            exports(installed),
            "exports differ from the installed rdma-core's"
        );
    }
}

/// The crate docs' table of exported symbols (`SYMBOLS.md`) says what the sources say.
#[test]
fn the_symbol_table_is_current() {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gen-ibverbs-symbol-table.py");
    let o = Command::new("python3")
        .arg(script)
        .arg("--check")
        .output()
        .expect("python3");
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn names_and_rates_read_as_rdma_core_prints_them() {
    let exe = compile_c(
        "strings",
        r#"#include <stdio.h>
#include <infiniband/verbs.h>
int main(void) {
    for (int i = -1; i <= 30; i++) printf("wc %d %s\n", i, ibv_wc_status_str(i));
    for (int i = -2; i <= 9; i++) printf("node %d %s\n", i, ibv_node_type_str(i));
    for (int i = -1; i <= 7; i++) printf("port %d %s\n", i, ibv_port_state_str(i));
    for (int i = -1; i <= 22; i++) printf("event %d %s\n", i, ibv_event_type_str(i));
    for (int i = -1; i <= 26; i++) printf("rate %d %d %d\n", i, ibv_rate_to_mult(i), ibv_rate_to_mbps(i));
    for (int i = -1; i <= 500; i++) printf("mult %d %d\n", i, mult_to_ibv_rate(i));
    int mbps[] = {0, 1, 2500, 5000, 10000, 14062, 20000, 25781, 28125, 30000, 40000, 53125, 56250,
                  60000, 80000, 103125, 112500, 120000, 168750, 206250, 309375, 425000, 637500,
                  850000, 1275000, 100000};
    for (unsigned i = 0; i < sizeof mbps / sizeof *mbps; i++) printf("mbps %d %d\n", mbps[i], mbps_to_ibv_rate(mbps[i]));
    return 0;
}
"#,
    );
    let real = Command::new(&exe).output().unwrap();
    let ours = Command::new(&exe)
        .env("LD_LIBRARY_PATH", library_dir())
        .output()
        .unwrap();
    assert!(real.status.success() && ours.status.success());
    assert_eq!(
        String::from_utf8_lossy(&ours.stdout),
        String::from_utf8_lossy(&real.stdout)
    );
}

#[test]
fn ibv_devices_and_ibv_devinfo_show_roce_v2_devices() {
    let o = over_ferroce("ibv_devices")
        .output()
        .expect("ibv_devices (ibverbs-utils)");
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("ferroce_lo"), "{out}");
    let o = over_ferroce("ibv_devinfo")
        .args(["-v", "-d", "ferroce_lo"])
        .output()
        .unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for want in [
        "hca_id:\tferroce_lo",
        "fw_ver:\t\t\t\tferroce ",
        "state:\t\t\tPORT_ACTIVE (4)",
        "active_mtu:\t\t4096 (5)",
        "link_layer:\t\tEthernet",
        "GID[  0]:\t\t::ffff:127.0.0.1, RoCE v2",
        "atomic_cap:\t\t\tATOMIC_HCA (1)",
        "phys_port_cnt:\t\t\t1",
    ] {
        assert!(out.contains(want), "missing {want:?} in\n{out}");
    }
    // A device that is not there is an error, not a crash.
    let o = over_ferroce("ibv_devinfo")
        .args(["-d", "no_such_device"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", text(&o));
}

/// Waits until something listens on TCP `port` (read from /proc, so that the check does not
/// take the server's one connection).
fn wait_listening(port: u16, server: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let want = format!(":{port:04X} ");
    loop {
        let tables = ["/proc/net/tcp", "/proc/net/tcp6"]
            .iter()
            .filter_map(|p| std::fs::read_to_string(p).ok())
            .collect::<String>();
        if tables.lines().any(|l| {
            l.split_whitespace()
                .nth(1)
                .is_some_and(|a| a.ends_with(want.trim()))
                && l.split_whitespace().nth(3) == Some("0A")
        }) {
            return;
        }
        if let Ok(Some(st)) = server.try_wait() {
            panic!("the server ended before listening: {st}");
        }
        assert!(Instant::now() < deadline, "nothing listens on {port}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs a server and a client of a perftest-shaped tool (the server first, the client with the
/// server's address last); returns both outputs after checking both succeeded.
fn pair(server: Command, client: Command, port: u16) -> (String, String) {
    let (label, s, c) = run_pair(server, client, port);
    let (st, ct) = (text(&s), text(&c));
    assert!(
        s.status.success() && c.status.success(),
        "{label}\nserver:\n{st}\nclient:\n{ct}"
    );
    (st, ct)
}

/// Runs a server and a client as [`pair`] does, without judging them: a label for messages and
/// both outputs. A client that fails leaves its server a few seconds to end, not a minute.
fn run_pair(server: Command, mut client: Command, port: u16) -> (String, Output, Output) {
    // Pairs of processes take turns: on a 2-core machine several at once only starve each
    // other (and a busy-spinning perftest pair needs both cores).
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    let label = format!(
        "{:?} / {:?}",
        server.get_program(),
        server.get_args().collect::<Vec<_>>()
    );
    let mut server = server;
    let mut s = server
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("server");
    wait_listening(port, &mut s);
    let c = client.output().expect("client");
    let limit = if c.status.success() { 60 } else { 5 };
    let s = wait_with_timeout(s, Duration::from_secs(limit));
    (label, s, c)
}

fn wait_with_timeout(mut child: Child, limit: Duration) -> Output {
    let deadline = Instant::now() + limit;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn ibv_rc_pingpong_between_two_processes_on_one_host() {
    // Sizes from 1 B to 1 MiB with the data check, polling and event-driven, over each provider.
    let cases: &[(&str, u32, u32, bool)] = &[
        ("auto", 1, 500, false),
        ("auto", 4096, 500, true),
        ("auto", 65536, 200, false),
        ("auto", 1 << 20, 20, true),
        ("udp", 1, 500, true),
        ("udp", 4096, 500, false),
        ("udp", 1 << 20, 20, false),
    ];
    for (i, &(provider, size, iters, events)) in cases.iter().enumerate() {
        let port = 18600 + i as u16;
        let args = |c: &mut Command| {
            c.args(["-d", "ferroce_lo", "-g", "0", "-c", "-p"])
                .arg(port.to_string())
                .args(["-s", &size.to_string(), "-n", &iters.to_string()])
                .env("FERROCE_PROVIDER", provider);
            if events {
                c.arg("-e");
            }
        };
        let mut s = over_ferroce("ibv_rc_pingpong");
        args(&mut s);
        let mut c = over_ferroce("ibv_rc_pingpong");
        args(&mut c);
        c.arg("127.0.0.1");
        let (st, ct) = pair(s, c, port);
        for out in [&st, &ct] {
            assert!(
                out.contains(&format!("{} iters in", iters)),
                "{provider} {size} B events={events}:\n{out}"
            );
            assert!(!out.contains("Failed"), "{out}");
        }
    }
}

/// UC: rdma-core's `ibv_uc_pingpong` (its `-c` checks every byte received) and perftest's
/// `-c UC` WRITE bandwidth and latency between two processes, over shared memory and over UDP.
/// Nothing is lost on these paths, so every message must arrive; what UC does with a loss is
/// the transport's own tests' (`ferroce-proto/tests/uc.rs`). perftest's `ib_send_bw -c UC` is
/// left out: its client may run ahead of the server's reposted receives, and UC drops what
/// finds none, so the server may wait for ever (as over rxe).
#[test]
fn ibv_uc_pingpong_and_perftest_uc_between_two_processes_on_one_host() {
    let cases: &[(&str, u32, u32, bool)] = &[
        ("auto", 1, 500, false),
        ("auto", 65536, 200, true),
        ("udp", 4096, 500, false),
        ("udp", 1 << 20, 20, true),
    ];
    for (i, &(provider, size, iters, events)) in cases.iter().enumerate() {
        let port = 18640 + i as u16;
        let args = |c: &mut Command| {
            c.args(["-d", "ferroce_lo", "-g", "0", "-c", "-p"])
                .arg(port.to_string())
                .args(["-s", &size.to_string(), "-n", &iters.to_string()])
                .env("FERROCE_PROVIDER", provider);
            if events {
                c.arg("-e");
            }
        };
        let mut s = over_ferroce("ibv_uc_pingpong");
        args(&mut s);
        let mut c = over_ferroce("ibv_uc_pingpong");
        args(&mut c);
        c.arg("127.0.0.1");
        let (st, ct) = pair(s, c, port);
        for out in [&st, &ct] {
            assert!(
                out.contains(&format!("{} iters in", iters)),
                "{provider} {size} B events={events}:\n{out}"
            );
            assert!(!out.contains("Failed"), "{out}");
        }
    }
    for (i, provider) in ["auto", "udp"].into_iter().enumerate() {
        for (j, run) in [
            &["ib_write_bw", "-c", "UC", "-s", "65536", "-n", "2000"][..],
            &["ib_write_lat", "-c", "UC", "-s", "8", "-n", "2000"][..],
        ]
        .into_iter()
        .enumerate()
        {
            let port = 18650 + (i * 2 + j) as u16;
            let mk = || {
                let mut c = over_ferroce(run[0]);
                c.args(["-d", "ferroce_lo", "-x", "0", "-p", &port.to_string()])
                    .args(&run[1..])
                    .env("FERROCE_PROVIDER", provider);
                c
            };
            let mut client = mk();
            client.arg("127.0.0.1");
            let (_, ct) = pair(mk(), client, port);
            // The result row: the size, then the iterations.
            let size = run[4];
            let row = ct
                .lines()
                .find(|l| l.split_whitespace().next() == Some(size))
                .unwrap_or_else(|| panic!("{provider} {run:?}: no result row\n{ct}"));
            assert_eq!(
                row.split_whitespace().nth(1),
                Some("2000"),
                "{provider} {run:?}:\n{ct}"
            );
            assert!(ct.contains("Transport type"), "{ct}");
        }
    }
}

/// Whether a perftest `-R` client failed the way perftest's own listener race ends (see
/// [`perftest_pair`]): IB CM's "invalid service ID" REJ, status 8.
fn perftest_lost_listener_race(client: &Output, client_text: &str) -> bool {
    !client.status.success() && client_text.contains("Event: RDMA_CM_EVENT_REJECTED; error: 8.")
}

/// Runs perftest's `run` (program and options) as server and client on `ferroce_lo` with TCP
/// port `port`; returns the client's output after checking both succeeded.
fn perftest_pair(run: &[&str], port: u16) -> String {
    let mk = || {
        let mut c = over_ferroce(run[0]);
        c.args(["-d", "ferroce_lo", "-x", "0", "-p", &port.to_string()])
            .args(&run[1..]);
        c
    };
    // perftest's `-R` has a race of its own: after the two sides' handshake over their first
    // connection, the server makes its listener for the measured QPs while the client already
    // connects to it. A client that comes first gets IB CM's "invalid service ID" REJ (status
    // 8), as from the kernel's rdma_cm, and perftest retries, but Debian's perftest (4.5-0.17)
    // retries on the ids it has just freed and dies of SIGSEGV (fixed upstream later). Only that
    // failure, recognised by its REJ, runs the pair again, at most twice; any other fails.
    for attempt in 0.. {
        let mut client = mk();
        client.arg("127.0.0.1");
        let (label, s, c) = run_pair(mk(), client, port);
        let (st, ct) = (text(&s), text(&c));
        if s.status.success() && c.status.success() {
            return ct;
        }
        let listener_race = run.contains(&"-R") && perftest_lost_listener_race(&c, &ct);
        assert!(
            listener_race && attempt < 2,
            "{label}\nserver:\n{st}\nclient:\n{ct}"
        );
        eprintln!("{label}: the client came before the listener (perftest's race); again");
    }
    unreachable!()
}

/// perftest's latency tests over UDP, where the polling hand-over and its lazy hand-back
/// decide who reads the socket: `ib_write_lat` polls for its WRITE's completion and then spins
/// on memory, which only the engine thread can fill (a hand-back that stayed lazy would stall
/// each iteration for the hand-over's grace); `ib_send_lat` polls for everything. Each must
/// finish its iterations and print its row (20000 stalls of the 4 ms grace would outlast the
/// pair's 60 s); with completion events (`-e`) too, where
/// `ibv_get_cq_event` spins before it sleeps.
#[test]
fn perftest_latency_over_udp_between_two_processes() {
    let runs: &[&[&str]] = &[
        &["ib_write_lat", "-s", "8", "-n", "20000"],
        &["ib_send_lat", "-s", "8", "-n", "3000"],
        // 20000: each wait that returns before its send's completion leaves one behind in
        // perftest's one-entry send CQ (see `cq::rounded_capacity`); a long run shows the room
        // the drop-in's CQs give is enough.
        &["ib_send_lat", "-s", "8", "-n", "20000", "-e"],
        &["ib_read_lat", "-s", "8", "-n", "1000", "-e"],
    ];
    for (i, run) in runs.iter().enumerate() {
        let port = 18760 + i as u16;
        let mk = || {
            let mut c = over_ferroce(run[0]);
            c.args(["-d", "ferroce_lo", "-x", "0", "-p", &port.to_string()])
                .args(&run[1..])
                .env("FERROCE_PROVIDER", "udp");
            c
        };
        let mut client = mk();
        client.arg("127.0.0.1");
        let (_, ct) = pair(mk(), client, port);
        assert_eq!(result_rows(&ct), 1, "{run:?}\n{ct}");
    }
}

/// perftest's result rows in `out`: lines that start with a size and an iteration count.
fn result_rows(out: &str) -> usize {
    out.lines()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() >= 4 && f[0].parse::<u64>().is_ok() && f[1].parse::<u64>().is_ok()
        })
        .count()
}

/// perftest's tests between two processes; every run must finish and print its table row.
#[test]
fn perftest_between_two_processes_on_one_host() {
    let runs: &[&[&str]] = &[
        &["ib_write_lat", "-s", "64", "-n", "1000"],
        &["ib_read_lat", "-s", "4096", "-n", "1000"],
        &["ib_send_lat", "-s", "1024", "-n", "1000"],
        &["ib_atomic_lat", "-n", "1000"],
        &["ib_atomic_lat", "-n", "1000", "-A", "CMP_AND_SWAP"],
        &["ib_write_bw", "-s", "65536", "-n", "500", "--report_gbits"],
        &["ib_read_bw", "-s", "65536", "-n", "500"],
        &["ib_send_bw", "-s", "65536", "-n", "500"],
        &["ib_atomic_bw", "-n", "500", "-A", "FETCH_AND_ADD"],
        &["ib_atomic_bw", "-n", "500", "-A", "CMP_AND_SWAP"],
        &["ib_write_bw", "-a", "-n", "50", "-q", "2"],
        &["ib_send_lat", "-a", "-n", "50"],
        &["ib_send_lat", "-s", "8", "-n", "20000", "-e"],
    ];
    for (i, run) in runs.iter().enumerate() {
        let ct = perftest_pair(run, 18700 + i as u16);
        let rows = result_rows(&ct);
        let want = if run.contains(&"-a") { 2 } else { 1 };
        assert!(rows >= want, "{run:?}: {rows} result rows\n{ct}");
    }
}

fn is_root() -> bool {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

fn ip(args: &[&str]) {
    let o = Command::new("ip")
        .args(args)
        .output()
        .expect("ip (iproute2)");
    assert!(o.status.success(), "ip {args:?}: {}", text(&o));
}

/// Two hosts: namespaces joined by a veth pair, 10.77.0.1 and 10.77.0.2. One pair at a time
/// (the tests that make it take turns).
struct TwoHosts {
    _turn: std::sync::MutexGuard<'static, ()>,
}

const NS_A: &str = "ferroce-ibv-a";
const NS_B: &str = "ferroce-ibv-b";

impl TwoHosts {
    fn new() -> TwoHosts {
        static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let turn = ONE.lock().unwrap_or_else(|e| e.into_inner());
        let _ = Command::new("ip").args(["netns", "del", NS_A]).output();
        let _ = Command::new("ip").args(["netns", "del", NS_B]).output();
        ip(&["netns", "add", NS_A]);
        ip(&["netns", "add", NS_B]);
        ip(&[
            "link", "add", "fib-a", "netns", NS_A, "type", "veth", "peer", "name", "fib-b",
            "netns", NS_B,
        ]);
        for (ns, dev, addr) in [
            (NS_A, "fib-a", "10.77.0.1/24"),
            (NS_B, "fib-b", "10.77.0.2/24"),
        ] {
            ip(&["-n", ns, "addr", "add", addr, "dev", dev]);
            ip(&["-n", ns, "link", "set", dev, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        TwoHosts { _turn: turn }
    }

    fn run(&self, ns: &str, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns, program])
            .env("LD_LIBRARY_PATH", library_dir())
            .env("FERROCE_PCAP", "")
            .stdin(Stdio::null());
        c
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", NS_A]).output();
        let _ = Command::new("ip").args(["netns", "del", NS_B]).output();
    }
}

/// Starts `server` (in host A) with its output captured and waits until it listens on TCP
/// `port`.
fn spawn_listening(server: &mut Command, port: u16) -> Child {
    let mut s = server
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_listening_in(NS_A, port, &mut s);
    s
}

/// Waits for a listener inside a namespace (its /proc/net is the namespace's).
fn wait_listening_in(ns: &str, port: u16, server: &mut Child) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let o = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "cat",
                "/proc/net/tcp",
                "/proc/net/tcp6",
            ])
            .output()
            .unwrap();
        let want = format!(":{port:04X}");
        if String::from_utf8_lossy(&o.stdout).lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[1].ends_with(&want) && f[3] == "0A"
        }) {
            return;
        }
        if let Ok(Some(st)) = server.try_wait() {
            panic!("the server ended before listening: {st}");
        }
        assert!(
            Instant::now() < deadline,
            "nothing listens on {port} in {ns}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn ibv_rc_pingpong_and_perftest_between_two_namespace_hosts() {
    assert!(
        is_root(),
        "this test makes network namespaces: run it as root (CI does)"
    );
    let hosts = TwoHosts::new();
    let runs: &[(&str, &[&str], &str)] = &[
        (
            "ibv_rc_pingpong",
            &[
                "-d",
                "ferroce_fib-a",
                "-g",
                "0",
                "-c",
                "-s",
                "4096",
                "-n",
                "300",
            ],
            "300 iters in",
        ),
        (
            "ibv_rc_pingpong",
            &[
                "-d",
                "ferroce_fib-a",
                "-g",
                "0",
                "-c",
                "-e",
                "-s",
                "65536",
                "-n",
                "50",
            ],
            "50 iters in",
        ),
        (
            "ib_write_bw",
            &["-d", "ferroce_fib-a", "-x", "0", "-s", "65536", "-n", "300"],
            "65536",
        ),
        (
            "ib_read_lat",
            &["-d", "ferroce_fib-a", "-x", "0", "-n", "300"],
            "300",
        ),
    ];
    for (i, (program, args, want)) in runs.iter().enumerate() {
        let port = 18800 + i as u16;
        let port_s = port.to_string();
        let mut s = hosts.run(NS_A, program);
        s.args(*args).args(["-p", &port_s]);
        let server = spawn_listening(&mut s, port);
        // The client's device is its own host's interface.
        let client_args: Vec<&str> = args
            .iter()
            .map(|a| {
                if *a == "ferroce_fib-a" {
                    "ferroce_fib-b"
                } else {
                    a
                }
            })
            .collect();
        let c = hosts
            .run(NS_B, program)
            .args(&client_args)
            .args(["-p", &port_s, "10.77.0.1"])
            .output()
            .unwrap();
        let s = wait_with_timeout(server, Duration::from_secs(60));
        let (st, ct) = (text(&s), text(&c));
        assert!(
            s.status.success() && c.status.success(),
            "{program} {args:?}\nserver:\n{st}\nclient:\n{ct}"
        );
        // perftest's servers print no result table for latency tests.
        let server_reports = *program == "ibv_rc_pingpong";
        assert!(
            ct.contains(want) && (!server_reports || st.contains(want)),
            "{program}: {want:?} missing\n{st}\n{ct}"
        );
        if *program == "ibv_rc_pingpong" {
            assert!(
                ct.contains("GID ::ffff:10.77.0.1"),
                "the peer is the other host:\n{ct}"
            );
        }
    }
}

/// rdma_cm through IB CM on the wire (`FERROCE_RDMA_CM=ib`: REQ, REP, RTU, DREQ and DREP as
/// MADs to QP1, no TCP), between two hosts: rping (every byte checked) and ucmatose (two
/// connections at once), and a REQ for a port nobody listens on rejected as the kernel does
/// (status 8, invalid service ID), by the manager of the other host's process.
#[test]
fn rdma_cm_programs_connect_on_the_wire_between_two_namespace_hosts() {
    assert!(
        is_root(),
        "this test makes network namespaces: run it as root (CI does)"
    );
    let hosts = TwoHosts::new();
    let wire = |ns: &str, program: &str, args: &[&str]| {
        let mut c = hosts.run(ns, program);
        c.env("FERROCE_RDMA_CM", "ib").args(args);
        c
    };
    // A server in host A (listening on `port`), then its client in host B: both outputs; a
    // server whose client failed gets a few seconds to end, not a minute.
    let start = |mut server: Command, port: u16, mut client: Command| {
        let s = spawn_listening(&mut server, port);
        let c = client.output().unwrap();
        let limit = if c.status.success() { 60 } else { 5 };
        (wait_with_timeout(s, Duration::from_secs(limit)), c)
    };
    // The same, after checking both succeeded.
    let run = |server: Command, port: u16, client: Command, what: &str| {
        let (s, c) = start(server, port, client);
        let (st, ct) = (text(&s), text(&c));
        assert!(
            s.status.success() && c.status.success(),
            "{what}\nserver:\n{st}\nclient:\n{ct}"
        );
        (st, ct)
    };
    let rping = |role: &str, port: &str| {
        let a = [
            "-a",
            "10.77.0.1",
            "-p",
            port,
            "-C",
            "20",
            "-S",
            "4096",
            "-V",
        ];
        let ns = if role == "-s" { NS_A } else { NS_B };
        wire(ns, "rping", &[&[role][..], &a].concat())
    };
    // A REQ to a port nobody listens on, while the other host's process listens on another:
    // rejected with status 8 by that process's manager. Then rping, every byte checked.
    let refused = |port: &str| {
        let o = rping("-c", port).output().unwrap();
        let t = text(&o);
        assert!(
            !o.status.success() && t.contains("RDMA_CM_EVENT_REJECTED") && t.contains("error 8"),
            "a REQ for no listener is rejected with status 8:\n{t}"
        );
        rping("-c", "19013")
    };
    let server = spawn_listening(&mut rping("-s", "19013"), 19013);
    let c = refused("19012").output().unwrap();
    let s = wait_with_timeout(server, Duration::from_secs(60));
    assert!(
        s.status.success() && c.status.success(),
        "rping\n{}\n{}",
        text(&s),
        text(&c)
    );
    // ucmatose, two connections at once.
    let uc = |ns: &str, flag: &str| {
        wire(
            ns,
            "ucmatose",
            &[flag, "10.77.0.1", "-p", "19014", "-c", "2", "-C", "10"],
        )
    };
    let (st, ct) = run(uc(NS_A, "-b"), 19014, uc(NS_B, "-s"), "ucmatose");
    assert!(
        st.contains("return status 0") && ct.contains("return status 0"),
        "{st}\n{ct}"
    );
    // ECE on the wire (vendor ID 24 bits there, ferroce's 32-bit one restored): two ferroce
    // processes negotiate selective repeat through the REQ and REP MADs as through TCP.
    let ece = |ns: &str, args: &[&str]| {
        let mut w = hosts.run(ns, ece_program().to_str().unwrap());
        w.env("FERROCE_RDMA_CM", "ib")
            .env_remove("FERROCE_SR")
            .args(args);
        w
    };
    let mut ece_server = ece(NS_A, &["server", "19016"]);
    ece_server.env("ECE_BIND", "10.77.0.1");
    let client = ece(NS_B, &["client", "10.77.0.1", "19016"]);
    let (st, ct) = run(ece_server, 19016, client, "ece");
    assert_eq!(line(&st, "remote_ece"), ece_line("0x1"), "{st}");
    assert_eq!(line(&st, "in_force"), ece_line("0x1"), "{st}");
    assert_eq!(line(&ct, "in_force"), ece_line("0x1"), "{ct}");
    assert_eq!(line(&st, "received"), ["hello"]);
    // udaddy: UD QPs resolved by SIDR, then datagrams each way.
    let server = wire(NS_A, "udaddy", &["-b", "10.77.0.1"]);
    let (st, ct) = run(
        server,
        7174,
        wire(NS_B, "udaddy", &["-s", "10.77.0.1"]),
        "udaddy",
    );
    assert!(
        st.contains("return status 0") && ct.contains("data transfers complete"),
        "{st}\n{ct}"
    );
    // perftest -R opens the device itself and through librdmacm: both contexts are one RoCE
    // socket, so the QP librdmacm made is the one the other host reaches.
    let perf = |ns: &str, dev: &str, to: Option<&str>| {
        let a = ["-R", "-d", dev, "-x", "0", "-F", "-n", "100", "-p", "19015"];
        wire(ns, "ib_send_bw", &[&a[..], to.as_slice()].concat())
    };
    // perftest's own listener race is run again, at most twice, as in `perftest_pair`.
    for attempt in 0.. {
        let server = perf(NS_A, "ferroce_fib-a", None);
        let client = perf(NS_B, "ferroce_fib-b", Some("10.77.0.1"));
        let (s, c) = start(server, 19015, client);
        let (st, ct) = (text(&s), text(&c));
        if s.status.success() && c.status.success() {
            assert!(result_rows(&ct) >= 1, "{ct}");
            break;
        }
        assert!(
            perftest_lost_listener_race(&c, &ct) && attempt < 2,
            "ib_send_bw -R\nserver:\n{st}\nclient:\n{ct}"
        );
        eprintln!("ib_send_bw -R: the client came before the listener (perftest's race); again");
    }
}

/// rsockets: rdma-core's unmodified `rstream`, `riostream` and `rcopy` over the drop-in
/// librdmacm, between two processes (over shared memory and over UDP) and between two
/// namespace hosts through the wire CM. `-T v` checks every byte; `rstream` also runs its
/// asynchronous (`rpoll`) and non-blocking modes; `rcopy`'s copy is compared with the source.
#[test]
fn rsockets_rstream_riostream_and_rcopy_between_processes_and_namespace_hosts() {
    let row = |out: &str, what: &str| {
        assert!(
            out.lines()
                .any(|l| l.starts_with("custom") || l.contains("_bw")),
            "{what}: no result row\n{out}"
        );
    };
    let cases: &[(&str, &str, &[&str])] = &[
        ("rstream", "auto", &["-T", "v"]),
        (
            "rstream",
            "udp",
            &["-T", "v", "-S", "65536", "-C", "1000", "-I", "1"],
        ),
        (
            "rstream",
            "auto",
            &["-T", "a", "-S", "4096", "-C", "10000", "-I", "1"],
        ),
        (
            "rstream",
            "auto",
            &["-T", "n", "-S", "65536", "-C", "1000", "-I", "1"],
        ),
        (
            "riostream",
            "auto",
            &["-T", "v", "-S", "65536", "-C", "1000", "-I", "1"],
        ),
        (
            "riostream",
            "udp",
            &["-T", "v", "-S", "4096", "-C", "1000", "-I", "1"],
        ),
    ];
    for (i, &(tool, provider, opts)) in cases.iter().enumerate() {
        let port = (18970 + i).to_string();
        let mk = |bind: (&str, &str)| {
            let mut c = over_ferroce(tool);
            c.args([bind.0, bind.1, "-p", &port])
                .args(opts)
                .env("FERROCE_PROVIDER", provider);
            c
        };
        let (st, ct) = pair(
            mk(("-b", "127.0.0.1")),
            mk(("-s", "127.0.0.1")),
            port.parse().unwrap(),
        );
        let what = format!("{tool} {provider} {opts:?}");
        row(&st, &what);
        row(&ct, &what);
    }
    // rcopy: 5 MB of random bytes, compared after the copy.
    let src = scratch("rcopy.src");
    let dst = scratch("rcopy.dst");
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..5_000_000)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed as u8
        })
        .collect();
    std::fs::write(&src, &data).unwrap();
    let _ = std::fs::remove_file(&dst);
    let mut server = over_ferroce("rcopy");
    server.args(["-p", "18990"]);
    let mut s = server
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_listening(18990, &mut s);
    let c = over_ferroce("rcopy")
        .arg(&src)
        .arg(format!("127.0.0.1:{}", dst.display()))
        .args(["-p", "18990"])
        .output()
        .unwrap();
    let _ = s.kill();
    let s = s.wait_with_output().unwrap();
    assert!(
        c.status.success(),
        "rcopy client\n{}\nserver\n{}",
        text(&c),
        text(&s)
    );
    assert!(text(&c).contains("5000000 bytes"), "{}", text(&c));
    assert!(std::fs::read(&dst).unwrap() == data, "rcopy's copy differs");

    // Two namespace hosts, the CM on the wire.
    assert!(
        is_root(),
        "this test makes network namespaces: run it as root (CI does)"
    );
    let hosts = TwoHosts::new();
    for (i, tool) in ["rstream", "riostream"].into_iter().enumerate() {
        let port = (18995 + i).to_string();
        let opts = [
            "-T",
            "v",
            "-S",
            "65536",
            "-C",
            "500",
            "-I",
            "1",
            "-p",
            port.as_str(),
        ];
        let mut server = hosts.run(NS_A, tool);
        server
            .env("FERROCE_RDMA_CM", "ib")
            .args(["-b", "10.77.0.1"])
            .args(opts);
        let s = spawn_listening(&mut server, port.parse().unwrap());
        let c = hosts
            .run(NS_B, tool)
            .env("FERROCE_RDMA_CM", "ib")
            .args(["-s", "10.77.0.1"])
            .args(opts)
            .output()
            .unwrap();
        let limit = if c.status.success() { 60 } else { 5 };
        let s = wait_with_timeout(s, Duration::from_secs(limit));
        let (st, ct) = (text(&s), text(&c));
        assert!(
            s.status.success() && c.status.success(),
            "{tool} between hosts\nserver:\n{st}\nclient:\n{ct}"
        );
        row(&st, tool);
        row(&ct, tool);
    }
}

/// rdma-core's `librspreload.so`, unmodified, carries Debian's unmodified `iperf3` over
/// rsockets over the drop-in librdmacm: between two namespace hosts (UDP, the CM on the wire),
/// in both directions, and within one host (shared memory). The preload library falls back to
/// the kernel's socket wherever an rsocket cannot be made, so TCP is watched (nftables): both
/// namespaces drop every TCP packet between them, and within the host TCP carries only
/// ferroce's own rdma_cm exchange (a same-host peer shares the host's RoCE address, so CM
/// replies on the wire could not find it), a few hundred bytes against iperf3's megabytes.
#[test]
fn iperf3_over_librspreload_between_namespace_hosts_and_within_one() {
    assert!(
        is_root(),
        "this test makes network namespaces: run it as root (CI does)"
    );
    let preload = ["x86_64-linux-gnu", "aarch64-linux-gnu"]
        .iter()
        .map(|t| PathBuf::from(format!("/usr/lib/{t}/rsocket/librspreload.so")))
        .find(|p| p.exists())
        .expect("rdma-core's librspreload.so (Debian's librdmacm1) is not installed");
    let hosts = TwoHosts::new();
    for ns in [NS_A, NS_B] {
        let mut nft = Command::new("ip")
            .args(["netns", "exec", ns, "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write as _;
        nft.stdin
            .take()
            .unwrap()
            .write_all(
                b"table inet ferroce_no_tcp {\n chain in {\n  type filter hook input priority 0; policy accept;\n  iifname \"lo\" meta l4proto tcp counter accept\n  meta l4proto tcp counter drop\n }\n}\n",
            )
            .unwrap();
        assert!(nft.wait().unwrap().success(), "nft in {ns}");
    }
    // (client's namespace, iperf3's options, how rdma_cm connects)
    let cases: &[(&str, &[&str], &str)] = &[
        (NS_B, &[], "ib"),
        (NS_B, &["-R"], "ib"),
        (NS_A, &[], "auto"),
    ];
    for (i, &(client_ns, extra, cm)) in cases.iter().enumerate() {
        let port = (47700 + i).to_string();
        let run = |ns: &str| {
            let mut c = hosts.run(ns, "iperf3");
            c.env("LD_PRELOAD", &preload)
                .env("FERROCE_RDMA_CM", cm)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            c
        };
        let mut s = run(NS_A).args(["-s", "-1", "-p", &port]).spawn().unwrap();
        wait_listening_in(NS_A, port.parse().unwrap(), &mut s);
        let c = run(client_ns)
            .args(["-c", "10.77.0.1", "-p", &port, "-t", "1", "-f", "m"])
            .args(extra)
            .spawn()
            .unwrap();
        let c = wait_with_timeout(c, Duration::from_secs(30));
        let s = wait_with_timeout(
            s,
            Duration::from_secs(if c.status.success() { 10 } else { 2 }),
        );
        let (st, ct) = (text(&s), text(&c));
        let what = format!("iperf3 {extra:?} from {client_ns}");
        assert!(
            s.status.success() && c.status.success() && ct.contains("iperf Done."),
            "{what}\nserver:\n{st}\nclient:\n{ct}"
        );
        // The client's summary: what the sender sent and the receiver received, in MB
        // (iperf3 picks the transfer's unit by its size).
        let summary = |role: &str| -> f64 {
            ct.lines()
                .filter(|l| l.trim_end().ends_with(role))
                .find_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    let (at, scale) = f.iter().enumerate().find_map(|(i, &w)| {
                        let scale = match w {
                            "Bytes" => 1e-6,
                            "KBytes" => 1024.0 / 1e6,
                            "MBytes" => 1024.0 * 1024.0 / 1e6,
                            "GBytes" => 1024.0 * 1024.0 * 1024.0 / 1e6,
                            _ => return None,
                        };
                        Some((i, scale))
                    })?;
                    f.get(at.checked_sub(1)?)?
                        .parse::<f64>()
                        .ok()
                        .map(|v| v * scale)
                })
                .unwrap_or_else(|| panic!("{what}: no {role} summary\n{ct}"))
        };
        let (sent, received) = (summary("sender"), summary("receiver"));
        assert!(
            received > 1.0 && received <= sent,
            "{what}: sent {sent} MB, received {received} MB\n{ct}"
        );
        assert!(
            !ct.contains("getsockopt") && !st.contains("getsockopt"),
            "{what}: an option iperf3 asks for failed\nserver:\n{st}\nclient:\n{ct}"
        );
        // TCP between the hosts is dropped; TCP within NS_A (only the last case makes any)
        // must be a sliver of what iperf3 moved.
        let rules = Command::new("ip")
            .args([
                "netns",
                "exec",
                NS_A,
                "nft",
                "list",
                "table",
                "inet",
                "ferroce_no_tcp",
            ])
            .output()
            .unwrap();
        let rules = String::from_utf8_lossy(&rules.stdout).into_owned();
        let local_tcp: u64 = rules
            .lines()
            .find(|l| l.contains("iifname \"lo\""))
            .and_then(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.get(f.iter().position(|&w| w == "bytes")? + 1)?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no counter for local TCP\n{rules}"));
        assert!(
            (local_tcp as f64) < received * 1e6 / 100.0,
            "{what}: {local_tcp} bytes of local TCP beside {received} MB through iperf3\n{rules}"
        );
    }
    // SIGTERM in the middle of a transfer: iperf3's handler jumps out of whatever call it
    // interrupted (siglongjmp), then reports over its sockets and exits. Both ends must end:
    // the client (a library lock left held by the jump once hung it for good, past SIGTERM),
    // and the server, which hears of it by the client's message or, if that was lost with the
    // process, by the DREQs the client's exit sends (it only receives: nothing else would
    // tell it).
    let port = "47710";
    let run = |ns: &str| {
        let mut c = hosts.run(ns, "iperf3");
        c.env("LD_PRELOAD", &preload)
            .env("FERROCE_RDMA_CM", "ib")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c
    };
    let mut s = run(NS_A).args(["-s", "-1", "-p", port]).spawn().unwrap();
    wait_listening_in(NS_A, port.parse().unwrap(), &mut s);
    let c = run(NS_B)
        .args(["-c", "10.77.0.1", "-p", port, "-t", "30", "-f", "m"])
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    // SAFETY: kill(2) on our own child's pid (`ip netns exec` execs iperf3 in place).
    assert_eq!(unsafe { libc::kill(c.id() as i32, libc::SIGTERM) }, 0);
    let started = Instant::now();
    let c = wait_with_timeout(c, Duration::from_secs(10));
    let s = wait_with_timeout(s, Duration::from_secs(10));
    let (ct, st) = (text(&c), text(&s));
    assert!(
        started.elapsed() < Duration::from_secs(10)
            && ct.contains("interrupt - the client has terminated")
            && (st.contains("the client has terminated")
                || st.contains("the client has unexpectedly closed the connection")),
        "iperf3 after SIGTERM ({:?})\nclient:\n{ct}\nserver:\n{st}",
        started.elapsed()
    );
}

/// libfabric's verbs provider over the drop-in libraries: Debian's unmodified `fi_pingpong`
/// (libfabric 1.17) with MSG endpoints (rdma_cm connections and verbs RC QPs) and RDM
/// endpoints (libfabric's rxm over MSG), every size from 64 B to 1 MiB, each message checked
/// (`-c`), between two namespace hosts and within one. Within one the client connects to
/// 127.0.0.1 (the control connection); libfabric binds "localhost", finds no device there (as
/// with the kernel's rdma_cm) and takes each device's own address for its endpoints.
#[test]
fn libfabric_fi_pingpong_over_verbs_between_namespace_hosts_and_within_one() {
    assert!(
        is_root(),
        "this test makes network namespaces: run it as root (CI does)"
    );
    let hosts = TwoHosts::new();
    // `fi_info` lists the host's device for MSG endpoints, with its address.
    let info = hosts
        .run(NS_A, "fi_info")
        .args(["-p", "verbs", "-t", "FI_EP_MSG", "-v"])
        .output()
        .unwrap();
    let it = text(&info);
    assert!(info.status.success(), "{it}");
    for want in [
        "name: ferroce_fib-a",
        "type: FI_EP_MSG",
        "src_addr: fi_sockaddr_in://10.77.0.1:0",
    ] {
        assert!(it.contains(want), "fi_info: no {want:?}\n{it}");
    }
    for (k, ep) in ["msg", "rdm"].into_iter().enumerate() {
        for (j, (client_ns, server_ip)) in [(NS_B, "10.77.0.1"), (NS_A, "127.0.0.1")]
            .into_iter()
            .enumerate()
        {
            // rxm's teardown race (see below) is given one more run; anything else fails at once.
            for attempt in 0..2 {
                let port = (47600 + k * 2 + j + attempt * 10).to_string();
                let mut server = hosts.run(NS_A, "fi_pingpong");
                server.args(["-p", "verbs", "-e", ep, "-I", "50", "-c", "-B", &port]);
                let s = spawn_listening(&mut server, port.parse().unwrap());
                let mut client = hosts.run(client_ns, "fi_pingpong");
                client.args([
                    "-p", "verbs", "-e", ep, "-I", "50", "-c", "-P", &port, server_ip,
                ]);
                let c = client.output().unwrap();
                let limit = if c.status.success() { 60 } else { 5 };
                let s = wait_with_timeout(s, Duration::from_secs(limit));
                let (st, ct) = (text(&s), text(&c));
                let what = format!("-e {ep} to {server_ip} from {client_ns}");
                // Known, not yet understood (issue #33's note, session 26): under load, one end of
                // an rdm pair between namespace hosts sometimes reads a flushed completion while
                // both ends finish their `fin` exchange, after every size moved and was checked
                // (about 1 run in 20 with two busy loops on this 2-core VM). That run, and only
                // that failure, is tried once more, loudly.
                let teardown_race = ep == "rdm"
                    && attempt == 0
                    && (st.contains("Work Request Flushed Error")
                        || ct.contains("Work Request Flushed Error"))
                    && [&st, &ct].iter().all(|o| o.contains("\n1m "));
                if !(s.status.success() && c.status.success()) && teardown_race {
                    eprintln!("{what}: rxm teardown race (flushed at fin); once more\n{st}\n{ct}");
                    continue;
                }
                assert!(
                    s.status.success() && c.status.success(),
                    "{what}\nserver:\n{st}\nclient:\n{ct}"
                );
                // A row per size: bytes, sent, acknowledged, on both sides.
                for out in [&st, &ct] {
                    for size in ["64", "256", "1k", "4k", "64k", "1m"] {
                        assert!(
                            out.lines().any(|l| {
                                let f: Vec<&str> = l.split_whitespace().collect();
                                f.len() >= 3 && f[0] == size && f[1] == "50" && f[2] == "=50"
                            }),
                            "{what}: no row for {size} B\n{out}"
                        );
                    }
                }
                break;
            }
        }
    }
}

/// librdmacm: perftest's `-R` (connection by rdma_cm), rdmacm-utils' synchronous and
/// asynchronous examples, and `rping` (which
/// advertises buffers over SEND and moves them with RDMA READ and WRITE, `-V` checking every
/// byte) between two processes.
#[test]
fn rdma_cm_programs_connect_through_ferroce_librdmacm() {
    let runs: &[&[&str]] = &[
        &["ib_send_lat", "-R", "-n", "500"],
        &["ib_write_bw", "-R", "-s", "65536", "-n", "300"],
        &["ib_read_lat", "-R", "-n", "300"],
        &["ib_atomic_bw", "-R", "-n", "300"],
    ];
    for (i, run) in runs.iter().enumerate() {
        let ct = perftest_pair(run, 18900 + i as u16);
        assert!(
            ct.contains("rdma_cm QPs\t : ON"),
            "{run:?} did not use rdma_cm:\n{ct}"
        );
    }
    // rdmacm-utils' rdma_server/rdma_client (librdmacm's synchronous calls: rdma_create_ep,
    // rdma_get_request, and the CQs and channels it makes) and ucmatose (asynchronous, with
    // its own QPs and private data).
    for (i, (server, client)) in [
        (vec!["rdma_server"], vec!["rdma_client", "-s", "127.0.0.1"]),
        (vec!["ucmatose"], vec!["ucmatose", "-s", "127.0.0.1"]),
        (
            vec!["rdma_xserver"],
            vec!["rdma_xclient", "-s", "127.0.0.1"],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let port = (18930 + i as u16).to_string();
        let mut s = over_ferroce(server[0]);
        s.args(&server[1..]).args(["-p", &port]);
        let mut c = over_ferroce(client[0]);
        c.args(&client[1..]).args(["-p", &port]);
        let (st, ct) = pair(s, c, 18930 + i as u16);
        for out in [&st, &ct] {
            assert!(
                out.contains("end 0") || out.contains("return status 0"),
                "{server:?}:\n{out}"
            );
        }
    }
    for (i, size) in [64usize, 4096, 60000].into_iter().enumerate() {
        let port = 18950 + i as u16;
        let mk = |role: &str| {
            let mut c = over_ferroce("rping");
            c.args([
                role,
                "-a",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-C",
                "30",
                "-V",
            ])
            .args(["-S", &size.to_string()]);
            c
        };
        let (st, ct) = pair(mk("-s"), mk("-c"), port);
        for out in [&st, &ct] {
            assert!(
                !out.contains("data mismatch") && !out.contains("failed"),
                "rping {size}:\n{out}"
            );
        }
    }
}

/// UCX's own benchmark on its RC verbs transport (UCT level: `-x rc_verbs`) between two
/// processes: PUT and active-message ping-pongs and a zero-copy PUT stream.
#[test]
fn ucx_perftest_runs_on_rc_verbs() {
    make_uverbs_devices();
    let runs: &[&[&str]] = &[
        &["-t", "put_lat", "-s", "8", "-n", "2000"],
        &["-t", "am_lat", "-s", "8", "-n", "2000"],
        &["-t", "put_bw", "-s", "65536", "-n", "500", "-D", "zcopy"],
    ];
    for (i, run) in runs.iter().enumerate() {
        for provider in ["udp", "auto"] {
            let port = 19010 + 2 * i as u16 + u16::from(provider == "auto");
            let client: Vec<&str> = ["-d", "ferroce_lo:1", "-x", "rc_verbs"]
                .iter()
                .chain(run.iter())
                .copied()
                .collect();
            ucx_perftest_pair(provider, port, &[], &client);
        }
    }
}

/// `ucx_perftest` as server and client (with `client_args`) over ferroce's library with
/// `provider` and the environment `env`; checks the client printed its result and no error.
fn ucx_perftest_pair(provider: &str, port: u16, env: &[(&str, &str)], client_args: &[&str]) {
    let mk = || {
        let mut c = over_ferroce("ucx_perftest");
        c.env("FERROCE_PROVIDER", provider)
            .envs(env.iter().copied())
            .args(["-p", &port.to_string()]);
        c
    };
    let mut client = mk();
    client.arg("127.0.0.1").args(client_args);
    let (_, ct) = pair(mk(), client, port);
    assert!(
        ct.lines().any(|l| l.starts_with("Final:")),
        "{provider} {client_args:?}: no result\n{ct}"
    );
    assert!(!ct.contains("ERROR"), "{provider} {client_args:?}\n{ct}");
}

/// `tests/c/ece.c`, built against rdma-core's headers and libraries (ferroce's at run time).
fn ece_program() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        compile_c_with(
            "ece",
            include_str!("c/ece.c"),
            &["-std=gnu11", "-lrdmacm", "-libverbs"],
        )
    })
}

/// The ECE program with `args`, over ferroce's libraries, offering selective repeat or not
/// (`FERROCE_SR`).
fn ece_run(args: &[&str], sr: bool) -> Command {
    let mut c = over_ferroce(ece_program().to_str().unwrap());
    c.args(args);
    if sr {
        c.env_remove("FERROCE_SR");
    } else {
        c.env("FERROCE_SR", "0");
    }
    c
}

/// The words after `key` on the line of `out` that starts with it.
fn line<'a>(out: &'a str, key: &str) -> Vec<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' '))
        .map(|r| r.split_whitespace().collect())
        .unwrap_or_else(|| panic!("no {key} line in:\n{out}"))
}

/// ferroce's ECE vendor id as the program prints it, and an ECE line with `options`.
const FRCE: &str = "0x46524345";

fn ece_line(options: &str) -> Vec<&str> {
    vec![FRCE, options, "0"]
}

/// A program's `ibv_query_ece` on a new QP: ferroce's vendor with selective repeat, unless
/// `FERROCE_SR=0`; and `ibv_set_ece`'s refusals as rdma-core makes them.
#[test]
fn ibv_query_ece_shows_the_offer_and_ferroce_sr_0_withdraws_it() {
    for (sr, options) in [(true, "0x1"), (false, "0x0")] {
        let o = ece_run(&["query"], sr).output().expect("ece query");
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        assert_eq!(line(&out, "offer"), ece_line(options), "FERROCE_SR {sr}");
        let (einval, eopnotsupp) = (libc::EINVAL.to_string(), libc::EOPNOTSUPP.to_string());
        assert_eq!(line(&out, "set_comp_mask"), [&einval, &einval]);
        assert_eq!(line(&out, "set_vendor_0"), [&eopnotsupp, &eopnotsupp]);
        assert_eq!(line(&out, "set_ours"), ["0"]);
    }
}

/// Two ferroce processes connected by rdma_cm negotiate selective repeat with no help from the
/// program: the REQ carries the client QP's offer (which the server reads with
/// `rdma_get_remote_ece` before making its QP), the REP what is in force; and a side that does
/// not offer it (`FERROCE_SR=0`) leaves both on go-back-N.
#[test]
fn rdma_cm_between_ferroce_processes_negotiates_selective_repeat() {
    let einval = libc::EINVAL.to_string();
    // (server offers, client offers, the REQ's options, in force)
    let cases = [
        (true, true, "0x1", "0x1"),
        (false, true, "0x1", "0x0"),
        (true, false, "0x0", "0x0"),
    ];
    for (i, (server_sr, client_sr, req, in_force)) in cases.into_iter().enumerate() {
        let port = 19100 + i as u16;
        let p = port.to_string();
        let (st, ct) = pair(
            ece_run(&["server", &p], server_sr),
            ece_run(&["client", "127.0.0.1", &p], client_sr),
            port,
        );
        let label = format!("server SR {server_sr}, client SR {client_sr}");
        assert_eq!(
            line(&st, "remote_ece"),
            ece_line(req),
            "{label}
{st}"
        );
        assert_eq!(
            line(&st, "in_force"),
            ece_line(in_force),
            "{label}
{st}"
        );
        assert_eq!(
            line(&ct, "in_force"),
            ece_line(in_force),
            "{label}
{ct}"
        );
        assert_eq!(line(&st, "received"), ["hello"], "{label}");
        // librdmacm's rules: ECE calls on an id only while it has no QP; no vendor 0 or
        // comp_mask; an ECE set before rdma_create_qp gives way to the QP's own.
        assert_eq!(line(&st, "remote_ece_with_qp"), ["-1", &einval]);
        assert_eq!(line(&st, "local_ece_with_qp"), ["-1", &einval]);
        assert_eq!(line(&ct, "local_ece_vendor_0"), ["-1", &einval]);
        assert_eq!(line(&ct, "local_ece_comp_mask"), ["-1", &einval]);
        assert_eq!(line(&ct, "local_ece"), ["0"]);
        let offer = if client_sr { "0x1" } else { "0x0" };
        assert_eq!(line(&ct, "offer"), ece_line(offer), "{label}");
    }
}

/// A QPN on a host slot no process takes (slot 4000), for the QP of a fake rdma_cm peer that
/// never sends.
const FAKE_QPN: u32 = 4000 * 4096 + 1;

/// A REQ (`kind` 1, or 6 with `ece`) or REP (2, or 7) as a ferroce peer sends it: a QP on
/// 127.0.0.1 and no private data.
fn connect_message(kind: u8, ece: Option<(u32, u32)>) -> Vec<u8> {
    let mut m = b"FRCM".to_vec();
    m.push(kind);
    m.extend_from_slice(&FAKE_QPN.to_be_bytes());
    m.extend_from_slice(&0u32.to_be_bytes());
    m.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 127, 0, 0, 1]);
    m.extend_from_slice(&[3, 1, 1, 7, 7, 0]);
    if let Some((vendor, options)) = ece {
        m.extend_from_slice(&vendor.to_be_bytes());
        m.extend_from_slice(&options.to_be_bytes());
    }
    m
}

/// Reads a REQ or REP: its kind and ECE (kinds 6 and 7 carry one).
fn read_connect(s: &mut impl std::io::Read) -> (u8, Option<(u32, u32)>) {
    let mut head = [0u8; 5 + 30];
    s.read_exact(&mut head).expect("a REQ or REP");
    assert_eq!(&head[..4], b"FRCM");
    let mut private = vec![0u8; usize::from(head[34])];
    s.read_exact(&mut private).unwrap();
    let ece = matches!(head[4], 6 | 7).then(|| {
        let mut e = [0u8; 8];
        s.read_exact(&mut e).unwrap();
        (
            u32::from_be_bytes([e[0], e[1], e[2], e[3]]),
            u32::from_be_bytes([e[4], e[5], e[6], e[7]]),
        )
    });
    (head[4], ece)
}

/// Toward rdma_cm peers from before ECE (played here by the test, as such a build answers),
/// and one with a foreign ECE: the connection is made, on go-back-N. A client whose REQ with
/// an ECE is refused sends it again without; a server answers a REQ without an ECE with a REP
/// without one, and takes a foreign vendor's as offering nothing.
#[test]
fn rdma_cm_toward_peers_without_ferroces_ece_keeps_go_back_n() {
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    let limit = Some(Duration::from_secs(20));

    // An old server: it refuses the kind after reading it, then serves the old REQ.
    let port = 19110;
    let l = TcpListener::bind(("127.0.0.1", port)).unwrap();
    let old_server = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut head = [0u8; 5];
        s.read_exact(&mut head).unwrap();
        drop(s);
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(limit).unwrap();
        let (kind, ece) = read_connect(&mut s);
        s.write_all(&connect_message(2, None)).unwrap();
        let mut rtu = [0u8; 5];
        s.read_exact(&mut rtu).unwrap();
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        (head[4], kind, ece, rtu, rest)
    });
    let client = ece_run(&["client", "127.0.0.1", &port.to_string(), "nodata"], true)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let o = wait_with_timeout(client, Duration::from_secs(60));
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    let (first, second, ece, rtu, rest) = old_server.join().unwrap();
    assert_eq!(
        (first, second, ece),
        (6, 1, None),
        "REQ with ECE, then without"
    );
    assert_eq!(&rtu, b"FRCM");
    assert!(rest.starts_with(b"FRCM"), "a DREQ at the end: {rest:?}");
    assert_eq!(line(&out, "offer"), ece_line("0x1"));
    assert_eq!(line(&out, "in_force"), ece_line("0x0"), "{out}");

    // Clients: an old one (REQ kind 1), and one of a vendor whose bit 0 means something else.
    for (i, (req, want_rep, remote)) in [
        (connect_message(1, None), (2, None), vec!["0x0", "0x0", "0"]),
        (
            connect_message(6, Some((0x15b3, 1))),
            (7, Some((0x4652_4345, 0))),
            vec!["0x15b3", "0x1", "0"],
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let port = 19111 + i as u16;
        let mut server = ece_run(&["server", &port.to_string(), "nodata"], true)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_listening(port, &mut server);
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(limit).unwrap();
        s.write_all(&req).unwrap();
        let rep = read_connect(&mut s);
        s.write_all(b"FRCMFRCM").unwrap();
        let o = wait_with_timeout(server, Duration::from_secs(60));
        drop(s);
        let out = text(&o);
        assert!(o.status.success(), "{out}");
        assert_eq!(rep, want_rep, "the REP to {req:?}");
        assert_eq!(line(&out, "remote_ece"), remote);
        assert_eq!(line(&out, "in_force"), ece_line("0x0"), "{out}");
    }
}

/// UD: rdma-core's `ibv_ud_pingpong` and perftest's `-c UD` between two processes, datagrams
/// through address handles, with the sender's GRH in front of each.
#[test]
fn ud_programs_run_between_two_processes() {
    for (i, provider) in ["auto", "udp"].into_iter().enumerate() {
        let port = 18900 + i as u16;
        let args = |c: &mut Command| {
            c.args([
                "-d",
                "ferroce_lo",
                "-g",
                "0",
                "-s",
                "2048",
                "-n",
                "500",
                "-p",
            ])
            .arg(port.to_string())
            .env("FERROCE_PROVIDER", provider);
        };
        let mut s = over_ferroce("ibv_ud_pingpong");
        args(&mut s);
        let mut c = over_ferroce("ibv_ud_pingpong");
        args(&mut c);
        c.arg("127.0.0.1");
        let (st, ct) = pair(s, c, port);
        for out in [&st, &ct] {
            assert!(out.contains("500 iters in"), "{provider}:\n{out}");
        }
    }
    let runs: &[&[&str]] = &[
        &["ib_send_lat", "-c", "UD", "-s", "1024", "-n", "1000"],
        &["ib_send_bw", "-c", "UD", "-s", "4096", "-n", "1000"],
    ];
    for (i, run) in runs.iter().enumerate() {
        let ct = perftest_pair(run, 18910 + i as u16);
        assert!(result_rows(&ct) >= 1, "{run:?}: no result row\n{ct}");
    }
}

/// UCP, the layer MPI and most UCX users sit on: it connects RC endpoints through a UD
/// transport, so both run here (`UCX_TLS=rc_verbs,ud_verbs`); tag matching and RMA
/// ping-pongs, eager and rendezvous sizes.
#[test]
fn ucx_ucp_runs_on_rc_verbs_with_ud_verbs() {
    make_uverbs_devices();
    let runs: &[&[&str]] = &[
        &["-t", "tag_lat", "-s", "8", "-n", "5000"],
        &["-t", "tag_lat", "-s", "1048576", "-n", "100"],
        &["-t", "ucp_put_lat", "-s", "8", "-n", "5000"],
        &["-t", "ucp_get", "-s", "65536", "-n", "500"],
    ];
    let env = [
        ("UCX_TLS", "rc_verbs,ud_verbs,self"),
        ("UCX_NET_DEVICES", "ferroce_lo:1"),
    ];
    for (i, run) in runs.iter().enumerate() {
        for provider in ["udp", "auto"] {
            let port = 18920 + 2 * i as u16 + u16::from(provider == "auto");
            ucx_perftest_pair(provider, port, &env, run);
        }
    }
}

/// Open MPI over UCX over ferroce: the anchors' `mpi_bench.c` (ping-pong, and MPI_Allreduce,
/// which checks its own result and aborts on a wrong one) with two ranks, UCX restricted to
/// ferroce's devices, so every byte between the ranks crosses ferroce.
#[test]
fn open_mpi_runs_over_ucx_on_ferroce() {
    make_uverbs_devices();
    let src =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/anchors/bench/mpi_bench.c");
    assert!(src.exists(), "{} is missing", src.display());
    let bin = scratch("mpi_bench");
    let st = Command::new("mpicc.openmpi")
        .args(["-O2", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .expect("mpicc.openmpi (scripts/test.sh installs libopenmpi-dev)");
    assert!(st.success(), "compiling mpi_bench.c failed");
    for (mode, extra) in [("pingpong", None), ("allreduce", Some("20"))] {
        let mut c = Command::new("mpirun.openmpi");
        c.args([
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
            "--mca",
            "plm",
            "isolated",
            "--mca",
            "oob_tcp_if_include",
            "lo",
            "--mca",
            "btl",
            "^vader,tcp,openib,uct",
            "--mca",
            "pml",
            "ucx",
            "--mca",
            "pml_ucx_devices",
            "any",
            "-x",
            "LD_LIBRARY_PATH",
            "-x",
            "UCX_TLS=rc_verbs,ud_verbs,self",
            "-x",
            "UCX_NET_DEVICES=ferroce_lo:1",
            "-x",
            "UCX_LOG_LEVEL=info",
            "-np",
            "2",
        ])
        .arg(&bin)
        .arg(mode)
        .args(extra)
        .env("LD_LIBRARY_PATH", library_dir())
        .env("FERROCE_PCAP", "")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
        let o = wait_with_timeout(c.spawn().expect("mpirun.openmpi"), Duration::from_secs(300));
        let out = text(&o);
        assert!(o.status.success(), "mpirun {mode}:\n{out}");
        // UCX says which transport each endpoint uses: ferroce's RC between the ranks.
        assert!(
            out.lines()
                .any(|l| l.contains("ep_cfg") && l.contains("rc_verbs/ferroce_lo:1")),
            "{mode}: no endpoint over ferroce's rc_verbs\n{out}"
        );
        let results: Vec<&str> = out.lines().filter(|l| l.starts_with("RESULT ")).collect();
        let want = if mode == "pingpong" { 2 } else { 12 };
        assert_eq!(results.len(), want, "{mode}:\n{out}");
        for r in &results {
            let v: f64 = r.split_whitespace().nth(2).unwrap().parse().unwrap();
            assert!(v.is_finite() && v > 0.0, "{r}");
        }
        println!("{}", results.join("\n"));
    }
}

/// UCX accepts a device only if `/dev/infiniband/<uverbsN>` is a character device it may open:
/// made here as links to /dev/null (root; CI runs as root).
fn make_uverbs_devices() {
    std::fs::create_dir_all("/dev/infiniband").expect("making /dev/infiniband (run as root)");
    for i in 0..8 {
        let link = PathBuf::from(format!("/dev/infiniband/uverbs{i}"));
        if std::fs::symlink_metadata(&link).is_err() {
            std::os::unix::fs::symlink("/dev/null", &link).expect("linking a uverbs device");
        }
    }
}

/// rdma-core's own conformance suite (Debian's python3-pyverbs ships it), run against
/// ferroce's library: every test it can run must pass; the rest skip because they need a
/// feature ferroce does not claim (mlx5/EFA direct verbs, UD, ODP, device memory, extended
/// QPs, …), which the suite finds out by asking the library.
#[test]
fn rdma_core_pyverbs_suite_passes() {
    let shipped = Path::new("/usr/share/doc/rdma-core/tests");
    assert!(
        shipped.exists(),
        "install python3-pyverbs (scripts/test.sh does)"
    );
    let dir = scratch("pyverbs-tests");
    let _ = std::fs::remove_dir_all(&dir);
    let st = Command::new("cp")
        .arg("-r")
        .arg(shipped)
        .arg(&dir)
        .status()
        .unwrap();
    assert!(st.success());
    // Debian compresses the larger modules.
    let st = Command::new("sh")
        .arg("-c")
        .arg("gunzip -f *.py.gz")
        .current_dir(&dir)
        .status()
        .unwrap();
    assert!(st.success());
    let o = Command::new("/usr/bin/python3")
        .args(["run_tests.py", "--dev", "ferroce_lo", "--gid", "0", "-v"])
        .current_dir(&dir)
        .env("LD_LIBRARY_PATH", library_dir())
        .env("FERROCE_PCAP", "")
        .output()
        .expect("python3");
    let out = text(&o);
    let passed = out.lines().filter(|l| l.ends_with("... ok")).count();
    println!(
        "pyverbs suite: {passed} passed; {}",
        out.lines().last().unwrap_or("")
    );
    assert!(o.status.success(), "{out}");
    assert!(passed >= 45, "only {passed} tests ran and passed:\n{out}");
}
