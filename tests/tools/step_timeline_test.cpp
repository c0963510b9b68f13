// tools/reference/step_timeline.py on a hand-made trace whose answer is known: how it splits a
// step's idle GPU time (host late after a wait, host late while launching, queued) and names the
// gaps. The trace is in the CSV that tools/profile/kernel_trace.cpp writes.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "tests/tools/run_tool.h"

namespace accel {
namespace {
using namespace tool_test;

// Three steps of 6.3 ms, in microseconds from the step's start, launched from thread 1: the
// embedding lookup (launched at 0, runs 10..1000), a GEMM (launched at 20, runs 1000..5000), a
// host wait (30..5100) on the GEMM, then AdamW launched late at 5300 (runs 5310..6000) and a copy
// launched late at 6100 (runs 6110..6200); the next step's lookup is launched at 6300. Thread 2
// waits 6000..6150: another thread's wait does not make thread 1's late launch "after a wait".
std::string synthetic_trace() {
  std::ostringstream f;
  f << "kind,start_ns,end_ns,correlation,stream_or_thread,name\n";
  auto row = [&](char kind, long start_us, long end_us, int corr, const char* name,
                 int thread = 1) {
    f << kind << ',' << start_us * 1000 << ',' << end_us * 1000 << ',' << corr << ','
      << (kind == 'K' ? 7 : thread) << ",\"" << name << "\"\n";
  };
  int c = 0;
  for (long t = 0; t < 3 * 6300; t += 6300) {
    row('R', t, t + 5, ++c, "cudaLaunchKernel");
    row('K', t + 10, t + 1000, c, "void accel::embedding_kernel<float>(float*)");
    row('D', t + 20, t + 25, ++c, "cuLaunchKernelEx");
    row('K', t + 1000, t + 5000, c, "nvjet_gemm");
    row('R', t + 30, t + 5100, 0, "cudaStreamSynchronize");
    row('R', t + 5300, t + 5305, ++c, "cudaLaunchKernel");
    row('K', t + 5310, t + 6000, c, "void accel::(anonymous namespace)::adamw_kernel(float*)");
    row('R', t + 6000, t + 6150, 0, "cudaStreamSynchronize", 2);
    row('R', t + 6100, t + 6105, ++c, "cudaLaunchKernel");
    row('K', t + 6110, t + 6200, c, "copy_kernel");
  }
  return f.str();
}

TEST(StepTimeline, SplitsIdleTimeByCauseAndNamesTheGaps) {
  if (run_command("python3 -c 'import csv'").code != 0) GTEST_SKIP() << "no python3";
  const fs::path dir = fresh_test_dir("step_timeline");
  std::ofstream(dir / "trace.csv") << synthetic_trace();
  const Result r = run_command("python3 " + std::string(ACCEL_SOURCE_DIR) +
                               "/tools/reference/step_timeline.py " + (dir / "trace.csv").string() +
                               " --steps 2 --kernels 2");
  ASSERT_EQ(r.code, 0) << r.output;
  // wall 6.30 ms; busy 0.99 + 4.00 + 0.69 + 0.09; the AdamW gap (0.31) is 0.30 late after the
  // wait plus 0.01 queued; the copy's and the next lookup's (0.11 each) 0.10 late while launching
  // plus 0.01 queued.
  EXPECT_NE(r.output.find("# 2 steps"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| 6.30 | 5.77 | 0.30 | 0.20 | 0.03 |"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("| nvjet_gemm -> adamw_kernel (after a wait) | 0.310 |"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("| adamw_kernel -> copy_kernel (cudaLaunchKernel) | 0.110 |"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("| nvjet_gemm | 4.00 | 1 | 4000.0 |"), std::string::npos) << r.output;

  // Too short a trace: a message that says so, and a failing exit.
  std::ofstream(dir / "short.csv") << "kind,start_ns,end_ns,correlation,stream_or_thread,name\n"
                                   << "K,0,10,1,7,\"embedding_kernel\"\n";
  const Result s = run_command("python3 " + std::string(ACCEL_SOURCE_DIR) +
                               "/tools/reference/step_timeline.py " + (dir / "short.csv").string());
  EXPECT_NE(s.code, 0);
  EXPECT_NE(s.output.find("need two forward embedding launches"), std::string::npos) << s.output;
}

}  // namespace
}  // namespace accel
