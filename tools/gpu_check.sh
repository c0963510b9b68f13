#!/usr/bin/env bash
# Builds accel-train with CUDA, runs every CUDA test against the CPU backend, runs the CUDA kernel
# benchmark, and prints a short summary. Needs only the repository and the CUDA toolkit:
#   tools/gpu_check.sh [build-dir]        (default build-gpu; set JOBS=N to change parallelism)
# Outputs: <build-dir>/gpu_check/{tests.log,tests.xml,bench.log}.
set -uo pipefail
cd "$(dirname "$0")/.."
B=${1:-build-gpu}
JOBS=${JOBS:-$(nproc)}
OUT=$B/gpu_check
mkdir -p "$OUT"

echo "== configure ($B)"
cmake -S . -B "$B" -G Ninja -DACCEL_CUDA=ON -DCMAKE_BUILD_TYPE=Release >"$OUT/configure.log" 2>&1 ||
  { tail -30 "$OUT/configure.log"; exit 1; }
echo "== build accel_cuda_tests (-j$JOBS)"
ninja -C "$B" -j "$JOBS" accel_cuda_tests >"$OUT/build.log" 2>&1 || { grep -E "error|FAILED" "$OUT/build.log" | head -40; exit 1; }

# The benchmark target exists only when Google Benchmark is installed; it is a plain main, so
# build it by hand from the static libraries otherwise.
BENCH=$B/bin/bench_cuda_kernels
if ninja -C "$B" -t targets all 2>/dev/null | grep -q '^bench_cuda_kernels:'; then
  ninja -C "$B" -j "$JOBS" bench_cuda_kernels >>"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
else
  echo "== Google Benchmark not found: building bench_cuda_kernels directly"
  mkdir -p "$B/bin"
  CUDA_LIB=$(dirname "$(grep -m1 '^CUDA_cudart_LIBRARY' "$B/CMakeCache.txt" | cut -d= -f2)")
  CUDNN=$(grep -m1 '^CUDNN_LIBRARY' "$B/CMakeCache.txt" | cut -d= -f2)
  g++ -O2 -std=c++17 -DACCEL_WITH_CUDA=1 -I. -I/usr/local/cuda/include tests/bench/cuda_kernels.cpp \
    "$B/libaccel_ops.a" "$B/libaccel_runtime.a" -L"$CUDA_LIB" -L/usr/local/cuda/lib64 "$CUDNN" \
    -lcublasLt -lcudart -lyaml-cpp -fopenmp -lpthread -ldl -lrt -o "$BENCH" >>"$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; exit 1; }
fi

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'

echo "== CUDA tests"
"$B/tests/accel_cuda_tests" --gtest_output="xml:$OUT/tests.xml" >"$OUT/tests.log" 2>&1
TEST_RC=$?
PASSED=$(grep -c '^\[       OK \]' "$OUT/tests.log")
FAILED=$(grep -cE '^\[  FAILED  \] .* ms\)$' "$OUT/tests.log")
SKIPPED=$(grep -cE '^\[  SKIPPED \] .* ms\)$' "$OUT/tests.log")
echo "tests: $PASSED passed, $FAILED failed, $SKIPPED skipped (exit $TEST_RC; log $OUT/tests.log)"
if [ "$FAILED" -gt 0 ] || [ "$TEST_RC" -ne 0 ]; then
  echo "-- failures (first lines of each):"
  grep -B2 -A6 -E 'Failure|^\[  FAILED  \]' "$OUT/tests.log" | head -80
fi

echo "== kernel benchmark"
"$BENCH" >"$OUT/bench.log" 2>&1
BENCH_RC=$?
cat "$OUT/bench.log"
echo "== summary: tests exit $TEST_RC ($PASSED passed, $FAILED failed), benchmark exit $BENCH_RC"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
