#!/usr/bin/env bash
# Rebuilds fuzz/corpus/parse_packet from the golden captures: one file per distinct kind of frame.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo run -q -p ferroce-wire --example extract_frames -- fuzz/corpus/parse_packet ../shared/captures/*.pcap
