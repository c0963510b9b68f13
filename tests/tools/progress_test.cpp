// The progress bar: its line fits the terminal at any width, and under a real pseudo-terminal of
// 80 and 200 columns a run's redraws leave nothing behind (no wrapped lines, no stale bars).
#include "tools/trainer/progress.h"

#include <gtest/gtest.h>
#include <pty.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace {

using accel::Progress;
using accel::StepReport;

StepReport big_report(int64_t step) {
  StepReport r;
  r.step = step;
  r.loss = 12345.678901;
  r.lr = 3e-4;
  r.grad_norm = 1.5;
  r.tokens_per_s = 123456789.0;
  r.mfu = 0.537;
  r.peak_mem_bytes = int64_t{123} << 30;
  return r;
}

TEST(ProgressBar, LineNeverReachesTheLastColumn) {
  for (int cols : {1, 5, 12, 20, 40, 60, 80, 120, 200, 400})
    for (bool numbers : {false, true}) {
      const std::string s = Progress::bar_line(big_report(999999), numbers, 1000000, 1e6, cols);
      EXPECT_LE(static_cast<int>(s.size()), std::max(cols - 1, 1)) << cols << ": " << s;
      if (cols > 15) {
        EXPECT_NE(s.find("999999/1000000"), std::string::npos) << cols << ": " << s;
      }
    }
}

TEST(ProgressBar, WideTerminalsShowEveryFieldNarrowOnesTheMostUsefulFirst) {
  const StepReport r = big_report(40);
  const std::string wide = Progress::bar_line(r, true, 100, 65, 200);
  for (const char* f : {"loss 12345.6789", "eta 1m05s", "123.46M tok/s", "lr 3.00e-04", "mfu 53.7%",
                        "mem 123.0 GiB"})
    EXPECT_NE(wide.find(f), std::string::npos) << f << " missing from: " << wide;
  const std::string narrow = Progress::bar_line(r, true, 100, 65, 50);
  EXPECT_NE(narrow.find("loss"), std::string::npos) << narrow;
  EXPECT_EQ(narrow.find("mem"), std::string::npos) << narrow;
  EXPECT_EQ(wide.substr(0, 13), "[############");  // 40% of a 30-column bar
}

// What a terminal of `cols` columns shows after `bytes`: its lines, and whether any line wrapped.
struct Screen {
  std::vector<std::string> lines;
  bool wrapped = false;
};

Screen render(const std::string& bytes, int cols) {
  Screen s;
  std::string line;
  size_t col = 0;
  for (size_t i = 0; i < bytes.size(); ++i) {
    const char c = bytes[i];
    if (c == '\r') {
      col = 0;
    } else if (c == '\n') {
      s.lines.push_back(line);
      line.clear();
      col = 0;
    } else if (c == '\033' && i + 2 < bytes.size() && bytes.compare(i, 3, "\033[K") == 0) {
      line.resize(std::min(line.size(), col));
      i += 2;
    } else {
      if (col >= static_cast<size_t>(cols)) {  // the terminal would wrap here
        s.wrapped = true;
        s.lines.push_back(line);
        line.clear();
        col = 0;
      }
      if (line.size() <= col) line.resize(col + 1, ' ');
      line[col++] = c;
    }
  }
  if (!line.empty()) s.lines.push_back(line);
  return s;
}

// Runs a 300-step progress display in a child whose stderr is a pseudo-terminal of `cols`.
std::string run_under_pty(int cols) {
  winsize ws{};
  ws.ws_row = 24;
  ws.ws_col = static_cast<unsigned short>(cols);
  int master = -1;
  const pid_t pid = forkpty(&master, nullptr, nullptr, &ws);
  if (pid == 0) {
    Progress p(accel::ProgressMode::Auto, 300, 0, true);
    for (int64_t step = 1; step <= 300; ++step) {
      p.tick(step);
      if (step % 50 == 0) p.update(big_report(step));
      if (step == 150) p.println("step 150 eval_loss 2.125000");
      usleep(2000);  // 0.6 s in all: several rate-limited redraws between the logged steps
    }
    p.finish();
    std::fflush(stderr);
    _exit(0);
  }
  EXPECT_GT(pid, 0);
  std::string out;
  char buf[4096];
  for (;;) {
    const ssize_t n = read(master, buf, sizeof buf);
    if (n <= 0) break;  // EIO once the child has exited and closed its side
    out.append(buf, static_cast<size_t>(n));
  }
  int status = 0;
  waitpid(pid, &status, 0);
  close(master);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  return out;
}

void expect_clean_screen(int cols) {
  const std::string out = run_under_pty(cols);
  const Screen s = render(out, cols);
  EXPECT_FALSE(s.wrapped) << cols << " columns: a line wrapped";
  // The eval line, then the final bar: nothing else stays on the screen.
  ASSERT_EQ(s.lines.size(), 2u) << cols << " columns:\n" << out;
  EXPECT_EQ(s.lines[0], "step 150 eval_loss 2.125000");
  EXPECT_EQ(s.lines[1].rfind("[###", 0), 0u) << s.lines[1];
  const size_t close = s.lines[1].find("] 300/300 | loss 12345.6789");
  ASSERT_NE(close, std::string::npos) << s.lines[1];
  EXPECT_EQ(s.lines[1].substr(1, close - 1), std::string(close - 1, '#')) << "a full bar";
  EXPECT_LT(static_cast<int>(s.lines[1].size()), cols);
  // The bar was redrawn between logged steps, not only at them.
  size_t redraws = 0;
  for (size_t at = out.find("\033[K"); at != std::string::npos; at = out.find("\033[K", at + 1))
    ++redraws;
  EXPECT_GT(redraws, 8u);
}

TEST(ProgressBar, PseudoTerminalOf80ColumnsKeepsOneLine) { expect_clean_screen(80); }
TEST(ProgressBar, PseudoTerminalOf200ColumnsKeepsOneLine) { expect_clean_screen(200); }

}  // namespace
