#!/usr/bin/env bash
# Build the planner core with AddressSanitizer + UndefinedBehaviorSanitizer and fuzz it with
# random input in every mode (any, valid, state, source). Any sanitizer report or uncaught exception fails the run.
#   bash tools/fuzz_core.sh [ITERATIONS]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
g++ -O1 -g -std=c++17 -Wall -Wextra -fsanitize=address,undefined -fno-sanitize-recover=all \
  -I"$root/cpp/include" "$root"/cpp/src/*.cpp "$root/tools/fuzz_core.cpp" -o "$out/fuzz_core"
"$out/fuzz_core" any "${1:-200000}"
"$out/fuzz_core" valid "${1:-20000}"
"$out/fuzz_core" state "${1:-20000}"
"$out/fuzz_core" source "${1:-20000}"
