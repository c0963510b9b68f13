#!/usr/bin/env bash
# Installs what is missing (Debian/Ubuntu packages), configures and builds accel-train into
# ./build. Safe to run again: it installs nothing that is already there and rebuilds incrementally.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build pkg-config libeigen3-dev libyaml-cpp-dev libboost-dev
          libgtest-dev libgmock-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev libpcre2-dev zlib1g-dev libzstd-dev libprotobuf-dev protobuf-compiler fortunes
          openmpi-bin)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# CUDA parts build when nvcc is found (the toolkit lives in /usr/local/cuda on our machines).
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release ${ACCEL_CMAKE_ARGS:-}
cmake --build build -j "$(nproc)"

# The fine-tuning example (configs/sft-tiny.yaml): prompt/completion samples made from fortunes.
tools/make_sft_example.sh build/sft
