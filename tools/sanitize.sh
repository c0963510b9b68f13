#!/usr/bin/env bash
# CI sanitizer stage: the whole test suite under AddressSanitizer + UndefinedBehaviorSanitizer, plus
# a short libFuzzer run of each fuzz target (tests/fuzz, fuzz_*_smoke), from one clang build folder
# ./build-asan (CPU only). Installs clang and its runtime libraries when missing (Debian packages),
# on top of what tools/setup.sh installs. Safe to run again (incremental). See
# docs/fault_tolerance.md ("Sanitizers in CI").
set -euo pipefail
cd "$(dirname "$0")/.."

# clang + libclang-rt-NN-dev (ASan/UBSan/libFuzzer runtimes, e.g. libclang_rt.fuzzer-x86_64.a) +
# libomp-dev (OpenMP for clang). Debian's "clang" package pulls the matching libclang-rt only as a
# recommendation, so the runtime package is named explicitly from clang's version.
packages=(build-essential cmake ninja-build pkg-config libeigen3-dev libyaml-cpp-dev libboost-dev
          libgtest-dev libgmock-dev nlohmann-json3-dev libcli11-dev libpcre2-dev zlib1g-dev libzstd-dev libprotobuf-dev protobuf-compiler
          fortunes openmpi-bin clang libomp-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
updated=0
if ((${#missing[@]})); then
  echo "sanitize: installing ${missing[*]}"
  $sudo apt-get update -qq
  updated=1
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
clang_major=$(clang++ -dumpversion | cut -d. -f1)
rt="libclang-rt-${clang_major}-dev"
if ! dpkg-query -W -f='${Status}' "$rt" 2>/dev/null | grep -q "install ok installed"; then
  echo "sanitize: installing $rt"
  if ((!updated)); then $sudo apt-get update -qq; fi
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$rt"
fi

# -O2 keeps the CPU math tests fast enough; no -DNDEBUG, so assert() is checked too.
# -gline-tables-only: file:line in sanitizer reports at a fraction of -g's build time.
# Benchmarks are not tests: not built here.
CC=clang CXX=clang++ cmake -S . -B build-asan -G Ninja -DACCEL_CUDA=OFF -DACCEL_SANITIZE=ON \
  -DACCEL_FUZZ=ON -DACCEL_BENCHMARKS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -gline-tables-only" ${ACCEL_SANITIZE_CMAKE_ARGS:-}
cmake --build build-asan -j "$(nproc)"

# Any sanitizer report fails the stage, also one from a child process whose failure a test expects
# (the fault tests kill ranks and accept non-zero exits): every report goes to a file under
# build-asan/sanitizer-logs/ (log_path, one file per process) and the stage fails when one exists.
# - halt_on_error + -fno-sanitize-recover=undefined: a process stops at its first report.
# - LeakSanitizer stays on (ASan's default on Linux): the suite ran leak-free under it. Forked
#   processes that end in SIGKILL or _exit() are not checked. Where LeakSanitizer cannot run
#   (it needs ptrace; some containers forbid it) set ASAN_OPTIONS=detect_leaks=0 (ours come first,
#   the caller's override them).
logs="$PWD/build-asan/sanitizer-logs"
# LeakSanitizer needs ptrace, which some containers forbid; then every sanitized process would fail
# at exit. Probe once with an empty program and, if it cannot run, say so loudly and turn leak
# checking off (ASan and UBSan still run).
probe_dir=$(mktemp -d)
echo 'int main() { return 0; }' > "$probe_dir/probe.cpp"
clang++ -fsanitize=address "$probe_dir/probe.cpp" -o "$probe_dir/probe"
if ! "$probe_dir/probe" > "$probe_dir/out" 2>&1; then
  echo "sanitize: WARNING: LeakSanitizer cannot run here ($(head -c 200 "$probe_dir/out"));" \
    "running with ASAN_OPTIONS=detect_leaks=0" >&2
  ASAN_OPTIONS="detect_leaks=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
fi
rm -rf "$probe_dir"
rm -rf "$logs" && mkdir -p "$logs"
export ASAN_OPTIONS="halt_on_error=1:log_path=$logs/asan${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$logs/ubsan${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
rc=0
ctest --test-dir build-asan --output-on-failure -j "$(nproc)" || rc=$?
if compgen -G "$logs/*" > /dev/null; then
  for f in "$logs"/*; do
    echo "==== sanitizer report $f"
    cat "$f"
  done
  echo "sanitize: sanitizer reports above (build-asan/sanitizer-logs)" >&2
  exit 1
fi
exit $rc
