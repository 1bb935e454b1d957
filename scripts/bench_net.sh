#!/usr/bin/env bash
# ferroce through a shared bottleneck, beside TCP on the same link in the same run (issue #29).
# Hosts are network namespaces joined by veth; the bottleneck is a tbf qdisc on the egress of
# both ends of the link (1 Gbit/s at MTU 1500, 10 Gbit/s at MTU 9000; burst 32 KB per Gbit/s
# and latency 1 ms, so tbf holds rate x 1 ms + burst: 157 KB at 1 Gbit/s). Cases:
#   1g_1 1g_4 1g_16       1, 4, 16 flows at 1 Gbit/s, MTU 1500
#   10g_1 10g_4 10g_16    the same at 10 Gbit/s, MTU 9000
#   loss_0.1 loss_1 loss_5  one flow at 1 Gbit/s with 0.1 / 1 / 5 % of packets dropped at random
#   incast_8              8 senders to 1 receiver through a switch (a bridge namespace); the
#                         bottleneck is the switch port to the receiver (and the receiver's egress)
#   ecn_1                 one flow at 1 Gbit/s, 1 % of ECT packets marked CE at random
#   probe_idle probe_load an 8 B ping-pong on an idle link, and beside 4 bulk flows
#   allreduce             all_reduce_perf, 4 ranks on 2 hosts (2 each), against Open MPI over TCP
# ferroce: `ferroce perf write_bw -s 65536 -q N --duration D --events` (one process per side, N
# QPs, each QP its own window of 128 messages; per-QP bytes from its JSON); incast: 8 such pairs,
# one QP each. --events (perftest's -e): the client sleeps on completion events while its windows
# are full, as a throughput program on a shared host would (and as iperf3 sleeps in the kernel);
# a busy-polling client holds a CPU of the 2 all the time, and 8 of them starve the receivers'
# engines (WAIT=poll measures that way). TCP: iperf3 -P N for the same D seconds (incast: 8 iperf3 pairs). Flows send from host
# A to host B in both.
# Columns: goodput = bytes delivered in the D seconds / D, summed over flows (MB = 10^6 B);
# retx/deliv = retransmitted bytes per delivered byte (ferroce: the sender's counters,
# retransmits x sent_bytes/sent_pkts; TCP: iperf3's retransmitted segments x MSS); Jain's
# fairness index over the per-flow goodputs ((sum x)^2 / (n sum x^2); 1 is fair, 1/n is one flow
# taking everything); probe = round trip of an 8 B ping-pong in us, p50/p99: ferroce
# `perf write_lat -s 8` (busy-polling; its reported half round trip x 2; PROBE=send_lat_events
# for an 8 B SEND ping-pong that sleeps on events instead) beside ferroce bulk flows, a TCP
# ping-pong of 8 B (TCP_NODELAY, Python, tens of us of its own; one ping every 2 ms at most,
# so its 1000 samples span 2 s of the load; ferroce's probe is not paced, its round trips
# under load are of the order of the queue, ms) beside iperf3. Every figure is
# the median over REPS repetitions with the range (min-max); ferroce and TCP alternate which
# goes first. A ferroce run that cannot finish prints what it delivered and "did not finish".
# Loss is per packet on the wire: an nftables rule drops in each host's prerouting (so both
# directions lose, data and ACKs), with GSO segmentation before the veth (gso_max_segs 1), as
# netfilter on the sending side sees whole GSO super-packets (up to 64 KB) and would drop them
# together. The CE rule stands at the same place and marks only ECT(0)/ECT(1) packets.
#   sudo scripts/bench_net.sh                     # root: namespaces, tc, nft
#   sudo CASES="1g_1 1g_4 loss_1" REPS=1 scripts/bench_net.sh
# Environment: REPS (3), DURATION seconds per run (8), CASES (names or globs; all), FERROCE (a
# prebuilt ferroce binary; else built here), OUT (keep every run's raw output there), WAIT
# (events, or poll for busy-polling bulk clients), PROBE (write_lat, or send_lat_events).
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${REPS:-3}
D=${DURATION:-8}
CASES=${CASES:-all}
WAIT=${WAIT:-events}
PROBE=${PROBE:-write_lat}
case "$WAIT" in events | poll) ;; *) echo "bench_net: WAIT is events or poll, not $WAIT" >&2; exit 1 ;; esac
case "$PROBE" in write_lat | send_lat_events) ;;
  *) echo "bench_net: PROBE is write_lat or send_lat_events, not $PROBE" >&2; exit 1 ;;
esac
ALL_CASES="1g_1 1g_4 1g_16 10g_1 10g_4 10g_16 loss_0.1 loss_1 loss_5 incast_8 ecn_1 probe_idle probe_load allreduce"
for tool in ip tc nft iperf3 ss python3 timeout; do
  command -v $tool >/dev/null || { echo "bench_net: $tool is not installed" >&2; exit 1; }
done
[ "$(id -u)" -eq 0 ] || { echo "bench_net: run as root (network namespaces)" >&2; exit 1; }
if [ -n "${FERROCE:-}" ]; then
  F=$(realpath "$FERROCE")
else
  # Several sessions may build in this tree: cargo runs under the shared lock when flock exists.
  if command -v flock >/dev/null; then flock /tmp/ferroce-cargo.lock cargo build --release -q -p ferroce-cli
  else cargo build --release -q -p ferroce-cli; fi
  F=$PWD/target/release/ferroce
fi
tmp=$(mktemp -d)
RAW=${OUT:-$tmp/raw}
mkdir -p "$RAW"
NS_PREFIX=fnet-$$
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for ns in $(ip netns list | awk '{print $1}' | grep "^$NS_PREFIX-" || true); do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$tmp"
}
trap cleanup EXIT
log() { echo "bench_net: $*" >&2; }

# ---- topologies ------------------------------------------------------------------------------
# The hosts of the current case: A and B (two hosts), or S (switch), R and H1..H8 (incast).
A=$NS_PREFIX-a B=$NS_PREFIX-b S=$NS_PREFIX-s R=$NS_PREFIX-r
IP_A=10.215.0.1 IP_B=10.215.0.2 IP_R=10.215.1.100
teardown() {
  for ns in $(ip netns list | awk '{print $1}' | grep "^$NS_PREFIX-" || true); do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$p" 2>/dev/null || true; done
    ip netns del "$ns"
  done
}
newns() { ip netns add "$1"; ip -n "$1" link set lo up; }
shape() { # NS IF RATE_GBIT: tbf of RATE Gbit/s, burst 32 KB per Gbit/s, latency 1 ms
  tc -n "$1" qdisc add dev "$2" root tbf rate "${3}gbit" burst "$((32 * $3))kb" latency 1ms
}
two_hosts() { # MTU RATE_GBIT
  teardown
  newns "$A"; newns "$B"
  ip link add veth0 netns "$A" mtu "$1" type veth peer name veth0 netns "$B" mtu "$1"
  ip -n "$A" addr add $IP_A peer $IP_B dev veth0
  ip -n "$B" addr add $IP_B peer $IP_A dev veth0
  for ns in "$A" "$B"; do ip -n "$ns" link set veth0 up; shape "$ns" veth0 "$2"; done
}
incast_hosts() { # MTU RATE_GBIT: H1..H8 and R on a bridge in S; S's port to R is the bottleneck
  teardown
  newns "$S"; newns "$R"
  ip -n "$S" link add br0 type bridge
  ip -n "$S" link set br0 up
  ip link add eth0 netns "$R" mtu "$1" type veth peer name pr netns "$S" mtu "$1"
  ip -n "$R" addr add $IP_R/24 dev eth0
  for i in 1 2 3 4 5 6 7 8; do
    newns "$NS_PREFIX-h$i"
    ip link add eth0 netns "$NS_PREFIX-h$i" mtu "$1" type veth peer name p$i netns "$S" mtu "$1"
    ip -n "$NS_PREFIX-h$i" addr add 10.215.1.$i/24 dev eth0
    ip -n "$NS_PREFIX-h$i" link set eth0 up
    ip -n "$S" link set p$i master br0 up
  done
  ip -n "$S" link set pr master br0 up
  ip -n "$R" link set eth0 up
  shape "$S" pr "$2"
  shape "$R" eth0 "$2"
}
nft_ingress() { # NS RULE...: one rule in a prerouting chain of NS
  local ns=$1
  shift
  printf 'table inet fbench {\n chain pre {\n  type filter hook prerouting priority -300; policy accept;\n  %s\n }\n}\n' "$*" |
    ip netns exec "$ns" nft -f -
}
lossy() { # PER_MILLE: random drop on both hosts' ingress, segments on the wire
  for ns in "$A" "$B"; do
    ip -n "$ns" link set dev veth0 gso_max_segs 1
    nft_ingress "$ns" "iifname veth0 numgen random mod 1000 < $1 counter drop"
  done
}
ce_marking() { # PERCENT: random CE on ECT packets at both hosts' ingress; TCP asks for ECN
  for ns in "$A" "$B"; do
    ip -n "$ns" link set dev veth0 gso_max_segs 1
    nft_ingress "$ns" "iifname veth0 ip ecn { ect0, ect1 } numgen random mod 100 < $1 counter ip ecn set ce"
    ip netns exec "$ns" sysctl -qw net.ipv4.tcp_ecn=1
  done
}

# ---- runs ------------------------------------------------------------------------------------
wait_listen() { # NS PORT: until something listens on TCP PORT in NS (10 s at most)
  for _ in $(seq 200); do
    [ -n "$(ip netns exec "$1" ss -Hltn "sport = :$2")" ] && return 0
    sleep 0.05
  done
  log "nothing listens on port $2 in $1"
  return 1
}
# ferroce_flows OUT QPS PAIR...: PAIR = SERVER_NS:SERVER_IP:CLIENT_NS:PORT; one perf process pair
# each, all at once; client JSON to OUT.N.
ferroce_flows() {
  local out=$1 qps=$2; shift 2
  local common=(perf write_bw -s 65536 -q "$qps" --duration "$D" --timeout 5 --json)
  [ "$WAIT" = events ] && common+=(--events)
  local n=0 spids=() cpids=()
  for pair in "$@"; do
    IFS=: read -r sns sip cns port <<<"$pair"
    timeout $((D + 40)) ip netns exec "$sns" "$F" "${common[@]}" --bind "$sip" -p "$port" \
      >"$out.server.$n" 2>&1 &
    spids+=($!)
    n=$((n + 1))
  done
  n=0
  for pair in "$@"; do
    IFS=: read -r sns sip cns port <<<"$pair"
    wait_listen "$sns" "$port" || true
  done
  for pair in "$@"; do
    IFS=: read -r sns sip cns port <<<"$pair"
    timeout $((D + 30)) ip netns exec "$cns" "$F" "${common[@]}" --counters -p "$port" "$sip" \
      >"$out.$n" 2>"$out.$n.err" &
    cpids+=($!)
    n=$((n + 1))
  done
  pids+=("${spids[@]}" "${cpids[@]}")
  for p in "${cpids[@]}"; do wait "$p" || true; done
  for p in "${spids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
}
# tcp_flows OUT STREAMS PAIR...: iperf3 pairs, same PAIR form; client JSON to OUT.N.
tcp_flows() {
  local out=$1 streams=$2; shift 2
  local n=0 spids=() cpids=()
  for pair in "$@"; do
    IFS=: read -r sns sip cns port <<<"$pair"
    timeout $((D + 40)) ip netns exec "$sns" iperf3 -s -1 -B "$sip" -p "$port" >/dev/null 2>&1 &
    spids+=($!)
  done
  for pair in "$@"; do
    IFS=: read -r sns sip cns port <<<"$pair"
    wait_listen "$sns" "$port" || true
  done
  for pair in "$@"; do
    IFS=: read -r sns sip cns port <<<"$pair"
    timeout $((D + 30)) ip netns exec "$cns" iperf3 -c "$sip" -p "$port" -P "$streams" -t "$D" -J \
      >"$out.$n" 2>"$out.$n.err" &
    cpids+=($!)
    n=$((n + 1))
  done
  pids+=("${spids[@]}" "${cpids[@]}")
  for p in "${cpids[@]}"; do wait "$p" || true; done
  for p in "${spids[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
}
# Probes, from A to B, after a second of whatever else runs: ITERS round trips.
PROBE_ITERS=1000
ferroce_probe() { # OUT
  local probe=(perf write_lat -s 8 -n $PROBE_ITERS --timeout 10 --json)
  [ "$PROBE" = send_lat_events ] && probe=(perf send_lat --events -s 8 -n $PROBE_ITERS --timeout 10 --json)
  timeout 40 ip netns exec "$B" "$F" "${probe[@]}" \
    --bind $IP_B -p 18700 >"$1.server" 2>&1 &
  local sp=$!
  pids+=($sp)
  wait_listen "$B" 18700 || true
  timeout 30 ip netns exec "$A" "$F" "${probe[@]}" -p 18700 $IP_B >"$1" 2>"$1.err" || true
  kill $sp 2>/dev/null || true; wait $sp 2>/dev/null || true
}
tcp_probe() { # OUT
  timeout 40 ip netns exec "$B" python3 "$tmp/bn.py" pp-serve $IP_B 18701 >/dev/null 2>&1 &
  local sp=$!
  pids+=($sp)
  wait_listen "$B" 18701 || true
  timeout 30 ip netns exec "$A" python3 "$tmp/bn.py" pp-client $IP_B 18701 $PROBE_ITERS \
    >"$1" 2>"$1.err" || true
  kill $sp 2>/dev/null || true; wait $sp 2>/dev/null || true
}
record() { python3 "$tmp/bn.py" record "$tmp/records.jsonl" "$@" || log "could not record $*"; }

two_host_pair() { echo "$B:$IP_B:$A:$1"; }
incast_pairs() { for i in 1 2 3 4 5 6 7 8; do echo "$R:$IP_R:$NS_PREFIX-h$i:$((18600 + i))"; done; }

# run_case CASE REP: builds the case's network, runs both sides (in an order that alternates
# with REP), records the figures.
run_case() {
  local c=$1 rep=$2 mtu=1500 rate=1 flows=1 order="ferroce tcp"
  [ $((rep % 2)) -eq 0 ] && order="tcp ferroce"
  case $c in
    1g_*) flows=${c#1g_} ;;
    10g_*) flows=${c#10g_} mtu=9000 rate=10 ;;
  esac
  local base="$RAW/$c.$rep"
  if [ "$c" = allreduce ]; then run_allreduce "$base" "$rep"; return; fi
  if [ "$c" = incast_8 ]; then incast_hosts $mtu $rate; else two_hosts $mtu $rate; fi
  case $c in
    loss_*) lossy "$(python3 -c "print(round(float('${c#loss_}') * 10))")" ;;
    ecn_*) ce_marking "${c#ecn_}" ;;
  esac
  for impl in $order; do
    local out="$base.$impl"
    case $c in
      incast_8)
        mapfile -t prs < <(incast_pairs)
        if [ $impl = ferroce ]; then ferroce_flows "$out" 1 "${prs[@]}"
        else tcp_flows "$out" 1 "${prs[@]}"; fi
        record "$c" $impl "$rep" bw "$out".[0-9] ;;
      probe_idle)
        if [ $impl = ferroce ]; then ferroce_probe "$out.probe"; else tcp_probe "$out.probe"; fi
        record "$c" $impl "$rep" probe "$out.probe" ;;
      probe_load)
        if [ $impl = ferroce ]; then
          ferroce_flows "$out" 4 "$(two_host_pair 18515)" &
          local bulk=$!
          sleep 1
          ferroce_probe "$out.probe"
          wait $bulk || true
        else
          tcp_flows "$out" 4 "$(two_host_pair 5201)" &
          local bulk=$!
          sleep 1
          tcp_probe "$out.probe"
          wait $bulk || true
        fi
        record "$c" $impl "$rep" bw "$out.0" --probe "$out.probe" ;;
      *)
        if [ $impl = ferroce ]; then ferroce_flows "$out" "$flows" "$(two_host_pair 18515)"
        else tcp_flows "$out" "$flows" "$(two_host_pair 5201)"; fi
        record "$c" $impl "$rep" bw "$out.0" ;;
    esac
  done
  # What the rules did (drops, marks), for the log.
  case $c in
    loss_* | ecn_*)
      for ns in "$A" "$B"; do
        echo "$c rep $rep ${ns##*-}: $(ip netns exec "$ns" nft list chain inet fbench pre | grep -o 'counter packets [0-9]*')"
      done >>"$tmp/nft.log" ;;
  esac
}

# all_reduce_perf against Open MPI: ranks 0, 1 on A and 2, 3 on B, 1 Gbit/s at MTU 1500.
run_allreduce() { # BASE REP
  command -v mpirun.openmpi >/dev/null && command -v mpicc.openmpi >/dev/null || {
    log "allreduce: Open MPI (mpirun.openmpi, mpicc.openmpi) is not installed; skipped"
    return 0
  }
  [ -x "$tmp/mpi_allreduce" ] || mpicc.openmpi -O2 -o "$tmp/mpi_allreduce" bench/mpi_allreduce.c
  two_hosts 1500 1
  local order="ferroce mpi"
  [ $(($2 % 2)) -eq 0 ] && order="mpi ferroce"
  for impl in $order; do
    if [ $impl = ferroce ]; then
      local port=$((29000 + RANDOM % 1000)) rp=()
      for r in 1 2 3; do
        local ns=$A
        [ $r -ge 2 ] && ns=$B
        RANK=$r WORLD_SIZE=4 MASTER_ADDR=$IP_A MASTER_PORT=$port timeout 300 \
          ip netns exec "$ns" "$F" all_reduce_perf -b 1M -e 64M -f 4 -n 3 -w 1 -a 3 -c 1 \
          >/dev/null 2>"$1.ferroce.rank$r" &
        rp+=($!)
      done
      pids+=("${rp[@]}")
      RANK=0 WORLD_SIZE=4 MASTER_ADDR=$IP_A MASTER_PORT=$port timeout 300 \
        ip netns exec "$A" "$F" all_reduce_perf -b 1M -e 64M -f 4 -n 3 -w 1 -a 3 -c 1 \
        >"$1.ferroce" 2>"$1.ferroce.err" || true
      for p in "${rp[@]}"; do wait "$p" || true; done
    else
      # As in bench_coll.sh: mpirun in A listens on the veth for its ranks in B; TCP only
      # (every rank is on this machine, so shared memory would bypass the link).
      PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include=veth0 timeout 300 \
        ip netns exec "$A" mpirun.openmpi --allow-run-as-root --oversubscribe --bind-to none \
        --mca plm isolated --mca pml ob1 --mca oob_tcp_if_include veth0 --mca btl self,tcp \
        --mca btl_tcp_if_include veth0 -np 2 "$tmp/mpi_allreduce" 0.3 : \
        -np 2 ip netns exec "$B" "$tmp/mpi_allreduce" 0.3 >"$1.mpi" 2>"$1.mpi.err" || true
    fi
  done
  record allreduce ferroce "$2" nccl "$1.ferroce"
  record allreduce mpi "$2" mpi "$1.mpi"
}

cat >"$tmp/bn.py" <<'PY'
"""bench_net.sh's helpers: a TCP ping-pong, parsing each run into a record, the report."""
import json, math, os, socket, statistics, struct, sys, time

MB = 1e6

def json_objects(path):
    out = []
    try:
        text = open(path).read()
    except OSError:
        return out
    try:  # one document (iperf3 -J)
        return [json.loads(text)]
    except ValueError:
        pass
    for line in text.splitlines():
        line = line.strip()
        if line.startswith('{'):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out

def ferroce_bw(paths):
    flows, delivered, retx, finished, notes, dur = [], 0, 0.0, True, [], None
    for p in paths:
        objs = json_objects(p)
        res = next((o for o in objs if 'bw_avg_mb_s' in o), None)
        cnt = next((o['counters'] for o in objs if 'counters' in o), None)
        if res is None:
            finished = False
            notes.append('no report')
            err = open(p + '.err').read().strip().splitlines() if os.path.exists(p + '.err') else []
            if err:
                notes.append(err[-1][:100])
            flows.append(0)
            continue
        dur = res['duration_s']
        flows += res['per_qp_bytes']
        delivered += res['delivered_bytes']
        if not res.get('finished', False):
            finished = False
            if res.get('outstanding'):
                notes.append(f"{res['outstanding']} msgs outstanding")
            if res.get('failed_qps'):
                notes.append(f"{res['failed_qps']} QPs failed: {res.get('error')}")
        if cnt and cnt.get('sent_pkts'):
            retx += cnt['retransmits'] * cnt['sent_bytes'] / cnt['sent_pkts']
    return flows, delivered, retx, finished, notes, dur

def tcp_bw(paths):
    flows, delivered, retx, finished, notes, dur = [], 0, 0.0, True, [], None
    for p in paths:
        objs = json_objects(p)
        if not objs or 'end' not in objs[0] or objs[0].get('error'):
            finished = False
            notes.append((objs[0].get('error') if objs else 'no report') or 'no report')
            flows.append(0)
            continue
        d = objs[0]
        end = d['end']
        dur = end['sum_received']['seconds']
        mss = d['start'].get('tcp_mss_default') or d['start'].get('tcp_mss') or 1448
        for s in end['streams']:
            flows.append(s['receiver']['bytes'])
        delivered += end['sum_received']['bytes']
        retx += end['sum_sent'].get('retransmits', 0) * mss
    return flows, delivered, retx, finished, notes, dur

def probe(path, impl):
    objs = json_objects(path)
    if not objs:
        return None
    o = objs[0]
    if impl == 'ferroce':  # a half round trip: the round trip is twice it
        return (2 * o['t_typical_us'], 2 * o['p99_us'])
    return (o['p50_us'], o['p99_us'])

def jain(xs):
    s2 = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * s2) if xs and s2 > 0 else None

def nccl(path):  # all_reduce_perf: size -> out-of-place busbw GB/s
    rows = {}
    try:
        for line in open(path):
            f = line.split()
            if line.startswith('#') or len(f) != 13:
                continue
            rows[int(f[0])] = (float(f[7]), int(f[8]))
    except OSError:
        pass
    return rows

def mpi(path):
    rows = {}
    try:
        for f in (l.split() for l in open(path)):
            if f and f[0] == 'RESULT':
                rows[int(f[1])] = (float(f[3]), 0)
    except OSError:
        pass
    return rows

def record(dbfile, case, impl, rep, kind, *rest):
    rec = {'case': case, 'impl': impl, 'rep': int(rep), 'kind': kind}
    if kind == 'bw' or kind == 'probe':
        paths, probe_path = [], None
        it = iter(rest)
        for a in it:
            if a == '--probe':
                probe_path = next(it)
            else:
                paths.append(a)
        if kind == 'probe':
            probe_path, paths = paths[0], []
        if paths:
            flows, delivered, retx, finished, notes, dur = (ferroce_bw if impl == 'ferroce' else tcp_bw)(paths)
            dur = dur or 1
            rec.update(goodput=delivered / dur / MB, retx=(retx / delivered if delivered else None),
                       jain=jain([f / dur for f in flows]) if len(flows) > 1 else None,
                       flows=[f / dur / MB for f in flows], finished=finished, notes=notes)
        if probe_path:
            p = probe(probe_path, impl)
            rec['probe'] = p
            if p is None:
                rec['probe_notes'] = 'probe did not finish'
    else:
        rows = nccl(rest[0]) if kind == 'nccl' else mpi(rest[0])
        rec['busbw'] = {str(k): v[0] for k, v in rows.items()}
        rec['wrong'] = sum(v[1] for v in rows.values())
        rec['finished'] = bool(rows)
    with open(dbfile, 'a') as f:
        f.write(json.dumps(rec) + '\n')
    show = {k: v for k, v in rec.items() if k not in ('flows',)}
    print('bench_net:', json.dumps(show), file=sys.stderr)

def fmt(vals, digits=1):
    vals = [v for v in vals if v is not None]
    if not vals:
        return '-'
    m = statistics.median(vals)
    f = f"{{:.{digits}f}}"
    return f"{f.format(m)} [{f.format(min(vals))}-{f.format(max(vals))}]" if len(vals) > 1 else f.format(m)

def report(dbfile, cases):
    recs = [json.loads(l) for l in open(dbfile)] if os.path.exists(dbfile) else []
    order = cases.split()
    print()
    print(f"{'case':<11} {'impl':<8} {'goodput MB/s':>20} {'retx/deliv':>20} {'Jain':>18} "
          f"{'probe RTT p50 us':>20} {'probe RTT p99 us':>22}  status")
    for case in order:
        for impl in ('ferroce', 'tcp'):
            rs = [r for r in recs if r['case'] == case and r['impl'] == impl and r['kind'] in ('bw', 'probe')]
            if not rs:
                continue
            fin = sum(1 for r in rs if r.get('finished', True) and (r.get('probe', 1) is not None))
            status = 'finished' if fin == len(rs) else f"did not finish in {len(rs) - fin} of {len(rs)}"
            notes = sorted({n for r in rs for n in r.get('notes', [])} | {r['probe_notes'] for r in rs if 'probe_notes' in r})
            if notes:
                status += ': ' + '; '.join(notes)[:160]
            probes = [r.get('probe') for r in rs]
            print(f"{case:<11} {impl:<8} {fmt([r.get('goodput') for r in rs]):>20} "
                  f"{fmt([r.get('retx') for r in rs], 4):>20} {fmt([r.get('jain') for r in rs], 3):>18} "
                  f"{fmt([p[0] if p else None for p in probes]):>20} "
                  f"{fmt([p[1] if p else None for p in probes]):>22}  {status}")
    ar = [r for r in recs if r['case'] == 'allreduce']
    if ar:
        sizes = sorted({int(s) for r in ar if r['impl'] == 'ferroce' for s in r['busbw']}
                       & {int(s) for r in ar if r['impl'] == 'mpi' for s in r['busbw']})
        print('\nallreduce, 4 ranks on 2 hosts (2 each), 1 Gbit/s: out-of-place busbw GB/s')
        print(f"{'bytes':>10} {'ferroce':>22} {'Open MPI (TCP)':>22}")
        for s in sizes:
            f = [r['busbw'].get(str(s)) for r in ar if r['impl'] == 'ferroce']
            m = [r['busbw'].get(str(s)) for r in ar if r['impl'] == 'mpi']
            print(f"{s:>10} {fmt(f, 3):>22} {fmt(m, 3):>22}")
        bad = [r for r in ar if not r['finished']]
        wrong = sum(r.get('wrong', 0) for r in ar)
        print(f"runs without a result: {len(bad)} of {len(ar)}; ferroce #wrong: {wrong}")
    print()
    for r in recs:
        if r.get('flows') and len(r['flows']) > 1:
            print(f"per-flow MB/s {r['case']} {r['impl']} rep {r['rep']}: "
                  + ' '.join(f"{x:.1f}" for x in r['flows']))

def pp_serve(ip, port):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, int(port)))
    s.listen(1)
    c, _ = s.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        m = b''
        while len(m) < 8:
            d = c.recv(8 - len(m))
            if not d:
                return
            m += d
        c.sendall(m)

def pp_client(ip, port, n):
    c = socket.create_connection((ip, int(port)), timeout=10)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    samples = []
    gap = 2_000_000  # ns: one ping every 2 ms at most, so the samples span seconds of load
    t = time.perf_counter_ns() - gap
    for i in range(int(n)):
        while time.perf_counter_ns() - t < gap:
            time.sleep(max(0, gap - (time.perf_counter_ns() - t)) / 1e9)
        t = time.perf_counter_ns()
        c.sendall(struct.pack('<Q', i))
        m = b''
        while len(m) < 8:
            d = c.recv(8 - len(m))
            if not d:
                raise SystemExit('the ping-pong server went away')
            m += d
        samples.append((time.perf_counter_ns() - t) / 1000)
    samples.sort()
    pct = lambda p: samples[min(len(samples) - 1, max(0, math.ceil(p * len(samples)) - 1))]
    print(json.dumps({'iterations': len(samples), 'p50_us': pct(0.5), 'p99_us': pct(0.99)}))

if __name__ == '__main__':
    cmd, args = sys.argv[1], sys.argv[2:]
    {'record': record, 'report': report, 'pp-serve': pp_serve, 'pp-client': pp_client}[cmd](*args)
PY

chosen=""
for c in $ALL_CASES; do
  for pat in $CASES; do
    # shellcheck disable=SC2053
    if [ "$pat" = all ] || [[ $c == $pat ]]; then chosen="$chosen $c"; break; fi
  done
done
[ -n "$chosen" ] || { echo "bench_net: no case matches CASES=$CASES (cases: $ALL_CASES)" >&2; exit 1; }
log "cases:$chosen; $REPS repetitions of $D s; ferroce: $F"
for rep in $(seq "$REPS"); do
  for c in $chosen; do
    log "$c, repetition $rep"
    run_case "$c" "$rep"
  done
done
teardown
python3 "$tmp/bn.py" report "$tmp/records.jsonl" "$chosen"
[ -f "$tmp/nft.log" ] && { echo "nftables counters (drops or CE marks applied at each host's ingress):"; cat "$tmp/nft.log"; }
[ -n "${OUT:-}" ] && cp "$tmp/records.jsonl" "$OUT/" && log "raw outputs and records.jsonl kept in $OUT"
exit 0
