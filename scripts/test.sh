#!/usr/bin/env bash
# The whole ferroce test suite, from a fresh Debian machine with only the Rust toolchain.
# Installs what the tests need (tshark, as an independent decoder to compare against; iproute2 and
# ethtool for the network-namespace tests, nftables for their bottleneck scenarios, iperf3 for
# scripts/bench_net.sh; python3 for scripts/verify_icrc.py, an independent ICRC
# checker; rdma-core's headers, tools and perftest for the drop-in libibverbs; cargo-fuzz, by
# scripts/fuzz.sh), then runs formatting, lint, every test of the workspace, the Python
# package's tests (scripts/test-python.sh: maturin, pytest, numpy and torch from the registry),
# and every fuzz target for a bounded time.
set -euo pipefail
cd "$(dirname "$0")/.."

need_pkgs=()
command -v tshark >/dev/null 2>&1 || need_pkgs+=(tshark)
command -v ip >/dev/null 2>&1 || need_pkgs+=(iproute2)
command -v ethtool >/dev/null 2>&1 || need_pkgs+=(ethtool)
# The bottleneck scenarios of the network-namespace tests drop and mark packets with nftables;
# scripts/bench_net.sh runs iperf3 beside ferroce.
command -v nft >/dev/null 2>&1 || need_pkgs+=(nftables)
command -v iperf3 >/dev/null 2>&1 || need_pkgs+=(iperf3)
command -v python3 >/dev/null 2>&1 || need_pkgs+=(python3)
# The drop-in libibverbs is checked against rdma-core itself: its headers (gcc compiles the
# layout check), its library's exports (objdump) and its unmodified tools and perftest.
command -v gcc >/dev/null 2>&1 || need_pkgs+=(gcc)
command -v objdump >/dev/null 2>&1 || need_pkgs+=(binutils)
[ -f /usr/include/infiniband/verbs.h ] || need_pkgs+=(libibverbs-dev)
# librdmacm's header, for the C programs that test the drop-in librdmacm (ECE over rdma_cm).
[ -f /usr/include/rdma/rdma_cma.h ] || need_pkgs+=(librdmacm-dev)
command -v ibv_rc_pingpong >/dev/null 2>&1 || need_pkgs+=(ibverbs-utils)
command -v ib_write_lat >/dev/null 2>&1 || need_pkgs+=(perftest)
command -v rping >/dev/null 2>&1 || need_pkgs+=(rdmacm-utils)
# libfabric's fi_pingpong over its verbs provider, over the drop-in libraries.
command -v fi_pingpong >/dev/null 2>&1 || need_pkgs+=(libfabric-bin)
command -v ucx_perftest >/dev/null 2>&1 || need_pkgs+=(ucx-utils)
[ -d /usr/share/doc/rdma-core/tests ] || need_pkgs+=(python3-pyverbs)
# Open MPI over UCX over the drop-in (mpirun, and mpicc for the anchors' mpi_bench.c).
command -v mpirun.openmpi >/dev/null 2>&1 || need_pkgs+=(openmpi-bin)
command -v mpicc.openmpi >/dev/null 2>&1 || need_pkgs+=(libopenmpi-dev)
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "== installing ${need_pkgs[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  echo "wireshark-common wireshark-common/install-setuid boolean false" | $SUDO debconf-set-selections || true
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi
command -v tshark >/dev/null || { echo "tshark is required by the tests and could not be installed" >&2; exit 1; }

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "== cargo test"
# The drop-in libibverbs tests link libibverbs.so.1 from the crate's staticlib, which cargo
# builds only when asked for the crate itself (not for its tests): build it in the test profile
# first, so it lands beside the test binaries (target/debug).
cargo build --profile test -p ferroce-ibverbs
# --no-fail-fast: a red run names every failing test binary, not just the first.
cargo test --workspace --all-targets --no-fail-fast
cargo test --workspace --doc
echo "== python package (pip install ./python, pytest)"
scripts/test-python.sh
echo "== live interop with Linux rxe (QEMU guest; set-up on first run)"
./interop/run-live.sh --self-check
./interop/run-live.sh
echo "== fuzz (bounded)"
./scripts/fuzz.sh "${FERROCE_FUZZ_SECONDS:-20}"
