#include "tools/trainer/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "tensorboard.pb.h"  // generated from tools/trainer/tensorboard.proto

namespace accel {
namespace fs = std::filesystem;

namespace {

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

void put_u32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_u64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void collect(const nlohmann::json& j, const std::string& prefix,
             std::vector<std::pair<std::string, double>>& out) {
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string tag = prefix.empty() ? it.key() : prefix + "/" + it.key();
    if (it->is_object())
      collect(*it, tag, out);
    else if (it->is_number() && !(prefix.empty() && it.key() == "step"))
      out.emplace_back(tag, it->get<double>());
  }
}

std::string host_name() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || !buf[0]) return "localhost";
  return buf;
}

}  // namespace

uint32_t crc32c(const void* data, size_t n) {
  static const std::array<uint32_t, 256> table = make_crc32c_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

uint32_t masked_crc32c(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::vector<std::pair<std::string, double>> metrics_scalars(const nlohmann::json& line) {
  std::vector<std::pair<std::string, double>> out;
  if (line.is_object()) collect(line, "", out);
  return out;
}

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw std::runtime_error("cannot create the TensorBoard folder " + dir + ": " + ec.message());
  const double now = wall_time_now();
  // TensorBoard reads every events.out.tfevents.* file of the folder; the time and host keep
  // the names of successive runs (a resume) apart.
  path_ = (fs::path(dir) / ("events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) +
                            "." + host_name() + "." + std::to_string(getpid())))
              .string();
  file_ = std::fopen(path_.c_str(), "wb");
  if (!file_)
    throw std::runtime_error("cannot create the TensorBoard file " + path_ + ": " +
                             std::strerror(errno) + " (logging.tensorboard: false turns it off)");
  tensorflow::Event e;
  e.set_wall_time(now);
  e.set_file_version("brain.Event:2");
  write_record(e.SerializeAsString());
  flush();
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::write_record(const std::string& payload) {
  std::string rec;
  rec.reserve(payload.size() + 16);
  put_u64(rec, payload.size());
  put_u32(rec, masked_crc32c(rec.data(), 8));
  rec += payload;
  put_u32(rec, masked_crc32c(payload.data(), payload.size()));
  if (std::fwrite(rec.data(), 1, rec.size(), file_) != rec.size()) failed_ = true;
}

void TensorBoardWriter::add_scalars(int64_t step,
                                    const std::vector<std::pair<std::string, double>>& scalars,
                                    double wall_time) {
  if (scalars.empty()) return;
  tensorflow::Event e;
  e.set_wall_time(wall_time);
  e.set_step(step);
  tensorflow::Summary* s = e.mutable_summary();
  for (const auto& [tag, value] : scalars) {
    tensorflow::Summary::Value* v = s->add_value();
    v->set_tag(tag);
    v->set_simple_value(static_cast<float>(value));
  }
  write_record(e.SerializeAsString());
}

void TensorBoardWriter::add_metrics(const nlohmann::json& line, double wall_time) {
  if (!line.is_object() || !line.contains("step") || !line["step"].is_number_integer()) return;
  add_scalars(line["step"].get<int64_t>(), metrics_scalars(line), wall_time);
}

void TensorBoardWriter::flush() {
  if (std::fflush(file_) != 0) failed_ = true;
  if (failed_)
    throw std::runtime_error("writing the TensorBoard file " + path_ +
                             " failed: " + std::strerror(errno));
}

}  // namespace accel
