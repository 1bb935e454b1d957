#!/usr/bin/env bash
# Builds ferroce's drop-in libibverbs.so.1 and librdmacm.so.1 into target/ibverbs/ (with --debug: target/ibverbs-debug/):
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

# version_script SYMBOLS PREFIX: a linker version script from a "NODE name" list: the public
# nodes (PREFIX_1.x) chain in order of their minor number, each inheriting the one before; any
# other node (IBVERBS_PRIVATE_34) stands alone; everything else is local.
version_script() {
    awk -v pre="$2" '
        { names[$1] = names[$1] "        " $2 ";\n"; if (!($1 in seen)) { seen[$1] = 1; order[n++] = $1 } }
        END {
            prev = ""
            for (i = 0; i < n; i++) if (index(order[i], pre "_1.") == 1) { split(order[i], p, "."); pub[p[2] + 0] = order[i] }
            for (m = 0; m <= 99; m++) if (m in pub) {
                v = pub[m]
                printf "%s {\n    global:\n%s", v, names[v]
                if (prev == "") printf "    local: *;\n"
                printf "}%s;\n", (prev == "" ? "" : " " prev)
                prev = v
            }
            for (i = 0; i < n; i++) if (index(order[i], pre "_1.") != 1) printf "%s {\n    global:\n%s};\n", order[i], names[order[i]]
        }' "$1"
}

link() {
    local archive=$1 out=$2
    mkdir -p "$out"
    local abi="$root/crates/ferroce-ibverbs/abi"
    version_script "$abi/libibverbs.symbols" IBVERBS >"$out/libibverbs.map"
    cc -shared -o "$out/libibverbs.so.1" \
        -Wl,--whole-archive "$archive" -Wl,--no-whole-archive \
        -Wl,--version-script="$out/libibverbs.map" -Wl,-soname,libibverbs.so.1 -Wl,-z,now \
        -lgcc_s -lpthread -ldl -lm -lc
    ln -sf libibverbs.so.1 "$out/libibverbs.so"
    # librdmacm.so.1: the same archive, exporting only rdma_cm's calls; it reaches the verbs
    # through libibverbs.so.1 (dlsym), so it names that library as needed.
    version_script "$abi/librdmacm.symbols" RDMACM >"$out/librdmacm.map"
    cc -shared -o "$out/librdmacm.so.1" \
        -Wl,--whole-archive "$archive" -Wl,--no-whole-archive \
        -Wl,--version-script="$out/librdmacm.map" -Wl,-soname,librdmacm.so.1 -Wl,-z,now \
        -Wl,--no-as-needed -L"$out" -libverbs -lgcc_s -lpthread -ldl -lm -lc
    ln -sf librdmacm.so.1 "$out/librdmacm.so"
}

if [[ ${1:-} == --link-only ]]; then
    link "$2" "$3"
    exit 0
fi
cd "$root"
if [[ ${1:-} == --debug ]]; then
    cargo build -p ferroce-ibverbs
    link target/debug/libferroce_ibverbs.a target/ibverbs-debug
    echo "built target/ibverbs-debug/libibverbs.so.1 and librdmacm.so.1"
else
    cargo build --release -p ferroce-ibverbs
    link target/release/libferroce_ibverbs.a target/ibverbs
    echo "built target/ibverbs/libibverbs.so.1 and librdmacm.so.1"
fi
