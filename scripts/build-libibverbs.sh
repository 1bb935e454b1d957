#!/usr/bin/env bash
# Builds ferroce's drop-in libibverbs.so.1 into target/ibverbs/ (with --debug: target/ibverbs-debug/):
#
#   scripts/build-libibverbs.sh
#   LD_LIBRARY_PATH=$PWD/target/ibverbs ibv_devinfo
#
# A Rust cdylib comes out with unversioned exports, which binaries linked against rdma-core
# refuse (`version IBVERBS_1.1 not found`). So the crate is built as a staticlib and linked here
# with a version script made from abi/libibverbs.symbols: every name in its rdma-core node.
#
#   scripts/build-libibverbs.sh --link-only <libferroce_ibverbs.a> <out dir>
# only links (what the crate's tests do with the staticlib cargo built for them).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
symbols="$root/crates/ferroce-ibverbs/abi/libibverbs.symbols"

link() {
    local archive=$1 out=$2
    mkdir -p "$out"
    local map="$out/libibverbs.map"
    # The nodes chain in rdma-core's order; IBVERBS_PRIVATE_34 stands alone.
    awk '
        { names[$1] = names[$1] "        " $2 ";\n"; if (!($1 in seen)) { seen[$1] = 1; order[n++] = $1 } }
        END {
            prev = ""
            # Public nodes sorted by their minor number, so each inherits the one before.
            for (i = 0; i < n; i++) if (order[i] ~ /^IBVERBS_1\./) { split(order[i], p, "."); pub[p[2] + 0] = order[i] }
            for (m = 0; m <= 99; m++) if (m in pub) {
                v = pub[m]
                printf "%s {\n    global:\n%s", v, names[v]
                if (prev == "") printf "    local: *;\n"
                printf "}%s;\n", (prev == "" ? "" : " " prev)
                prev = v
            }
            for (i = 0; i < n; i++) if (order[i] !~ /^IBVERBS_1\./) printf "%s {\n    global:\n%s};\n", order[i], names[order[i]]
        }' "$symbols" >"$map"
    cc -shared -o "$out/libibverbs.so.1" \
        -Wl,--whole-archive "$archive" -Wl,--no-whole-archive \
        -Wl,--version-script="$map" -Wl,-soname,libibverbs.so.1 -Wl,-z,now \
        -lgcc_s -lpthread -ldl -lm -lc
    ln -sf libibverbs.so.1 "$out/libibverbs.so"
}

if [[ ${1:-} == --link-only ]]; then
    link "$2" "$3"
    exit 0
fi
cd "$root"
if [[ ${1:-} == --debug ]]; then
    cargo build -p ferroce-ibverbs
    link target/debug/libferroce_ibverbs.a target/ibverbs-debug
    echo "built target/ibverbs-debug/libibverbs.so.1"
else
    cargo build --release -p ferroce-ibverbs
    link target/release/libferroce_ibverbs.a target/ibverbs
    echo "built target/ibverbs/libibverbs.so.1"
fi
