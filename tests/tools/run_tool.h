// What the tests that drive the accel-train binary share: running it with its output captured, a
// fresh temporary folder, the config file, and reading metrics.jsonl back.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

namespace accel::tool_test {

namespace fs = std::filesystem;

struct Result {
  int code;            // exit code; 128 + signal when killed by one
  std::string output;  // stdout and stderr together
};

// Runs a shell command and waits for it, its stdout and stderr captured together.
inline Result run_command(const std::string& command) {
  const std::string cmd = command + " 2>&1";
  FILE* p = popen(cmd.c_str(), "r");
  Result r{-1, ""};
  if (!p) {
    r.output = "popen failed for: " + cmd;
    return r;
  }
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) r.output.append(buf, n);
  int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

// Runs `ACCEL_BIN_DIR/accel-train <args>`.
inline Result run_accel_train(const std::string& args) {
  return run_command(std::string(ACCEL_BIN_DIR) + "/accel-train " + args);
}

// An empty folder <tmp>/<prefix>_<name>_<pid> (emptied first when it exists).
inline fs::path fresh_temp_dir(const std::string& prefix, const std::string& name) {
  fs::path d = fs::temp_directory_path() / (prefix + "_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

// fresh_temp_dir named after the running GoogleTest test.
inline fs::path fresh_test_dir(const std::string& prefix) {
  return fresh_temp_dir(prefix, ::testing::UnitTest::GetInstance()->current_test_info()->name());
}

// Writes `text` to dir/config.yaml; returns that path.
inline fs::path write_config(const fs::path& dir, const std::string& text) {
  fs::path p = dir / "config.yaml";
  std::ofstream(p) << text;
  return p;
}

// The lines of a metrics.jsonl. A line that does not parse (the torn last line of a file still
// being written) is skipped and counted in *torn when `torn` is given; without it, it throws.
inline std::vector<nlohmann::json> read_metrics(const fs::path& file, int* torn = nullptr) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      out.push_back(nlohmann::json::parse(line));
    } catch (const std::exception&) {
      if (!torn) throw;
      ++*torn;
    }
  }
  return out;
}

// step -> loss of the step lines of a metrics.jsonl.
inline std::map<int, double> read_losses(const fs::path& file) {
  std::map<int, double> m;
  for (const auto& j : read_metrics(file))
    if (j.contains("step") && j.contains("loss")) m[j["step"].get<int>()] = j["loss"];
  return m;
}

// A fixture for tests of accel-train runs that share one config: SetUp makes a fresh folder dir_
// holding it as config.yaml; TearDown removes the folder unless the test failed (kept to look at).
class ConfigFolderTest : public ::testing::Test {
 protected:
  ConfigFolderTest(std::string prefix, std::string config)
      : prefix_(std::move(prefix)), config_(std::move(config)) {}
  void SetUp() override {
    dir_ = fresh_test_dir(prefix_);
    write_config(dir_, config_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(dir_);
  }
  // accel-train with this config into dir_/out; `env` (VAR=value ...) goes before the command.
  Result train(const std::string& out, const std::string& extra = "",
               const std::string& env = "") const {
    return run_command(env + " " + std::string(ACCEL_BIN_DIR) + "/accel-train --config " +
                       (dir_ / "config.yaml").string() + " --output-dir " + (dir_ / out).string() +
                       " " + extra);
  }
  std::map<int, double> losses(const std::string& out) const {
    return read_losses(dir_ / out / "metrics.jsonl");
  }
  // The checkpoint folder of step s of the run into dir_/out.
  fs::path step(const std::string& out, int s) const {
    return dir_ / out / "checkpoints" / ("step_" + std::to_string(s));
  }
  fs::path dir_;

 private:
  std::string prefix_, config_;
};

}  // namespace accel::tool_test
