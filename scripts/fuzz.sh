#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for a bounded time: scripts/fuzz.sh [SECONDS_PER_TARGET]
# (default 30). Each target starts from a temporary copy of its corpus in fuzz/corpus, so a run
# never changes the repository; new inputs it finds are thrown away with the copy. Exits
# non-zero if any target crashes (a panic is a crash: the targets' invariants are panics),
# hangs or runs out of memory, printing the input that did it (its path, kept, and its bytes).
#
# Needs only the stable toolchain. Without a sanitizer cargo-fuzz passes no unstable rustc flag
# (checked: it builds on stable as it is); RUSTC_BOOTSTRAP=1 is set anyway so that a run with
# `--sanitizer address` (-Zsanitizer) works too. cargo-fuzz is installed from the registry if
# missing (about 25 s on this 2-core machine with an empty cargo registry).
#
# Built without a sanitizer (`-s none`) but with debug assertions and overflow checks (`-a`):
# ferroce-wire and ferroce-proto forbid unsafe code, so AddressSanitizer has nothing of theirs
# to check, while it costs half again the build time and a third to six sevenths of the runs per
# second (measured: 31 s vs 48 s CPU to build the three targets; runs/s parse_packet 850k vs
# 130k, responder 4.9k vs 1.5k, requester 4.7k vs 1.4k, on a loaded 2-core machine). Overflow
# checks turn silent wrap-arounds into crashes.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${1:-30}"
case "$secs" in
  '' | *[!0-9]*)
    echo "usage: $0 [SECONDS_PER_TARGET]" >&2
    exit 2
    ;;
esac

export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
export RUSTC_BOOTSTRAP=1
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "== installing cargo-fuzz"
  cargo install cargo-fuzz --locked
fi

flags=(--sanitizer none --debug-assertions)
echo "== cargo fuzz build (${flags[*]})"
cargo fuzz build "${flags[@]}"

work="$(mktemp -d "${TMPDIR:-/tmp}/ferroce-fuzz.XXXXXX")"
failed=()
for target in $(cargo fuzz list); do
  corpus="$work/corpus/$target"
  artifacts="$work/artifacts/$target"
  mkdir -p "$corpus" "$artifacts"
  if [ -d "fuzz/corpus/$target" ]; then
    cp -R "fuzz/corpus/$target/." "$corpus/"
  fi
  echo "== fuzz $target for ${secs}s from $(find "$corpus" -type f | wc -l) corpus inputs"
  log="$work/$target.log"
  status=0
  cargo fuzz run "${flags[@]}" "$target" "$corpus" -- \
    -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$artifacts/" -print_final_stats=1 >"$log" 2>&1 || status=$?
  grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added)' "$log" || true
  crashes=$(find "$artifacts" -type f | sort)
  if [ "$status" -ne 0 ] || [ -n "$crashes" ]; then
    failed+=("$target")
    echo "!! $target failed (exit $status); what it said (whole log: $log):" >&2
    grep -E -A3 'panicked at|^==[0-9]+== ERROR|^SUMMARY|^Error' "$log" | head -n 40 >&2
    for f in $crashes; do
      echo "!! crashing input: $f" >&2
      od -An -tx1 -v "$f" | head -n 64 >&2
      echo "!! replay: RUSTC_BOOTSTRAP=1 cargo fuzz run ${flags[*]} $target $f" >&2
      echo "!!   (FERROCE_FUZZ_TRACE=1 prints each step)" >&2
    done
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "fuzzing failed: ${failed[*]} (inputs kept under $work)" >&2
  exit 1
fi
rm -rf "$work"
echo "fuzzing passed: $(cargo fuzz list | tr '\n' ' ')(${secs}s each)"
