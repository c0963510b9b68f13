// TensorBoard scalars for a run: <output_dir>/tb/events.out.tfevents.<seconds>.<host>, read by
// TensorBoard itself. Each record is TFRecord-framed (payload length, masked CRC-32C of the
// length bytes, payload, masked CRC-32C of the payload); the payload is a tensorflow.Event
// (tools/trainer/tensorboard.proto).
#pragma once

#include <cstdint>
#include <cstdio>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

namespace accel {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord uses it.
uint32_t crc32c(const void* data, size_t n);
// TFRecord's mask over a CRC: rotate right by 15 bits, add 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t n);

// The scalars of one metrics.jsonl object: every number, nested objects as "outer/inner" tags
// (host_busy_ms_per_step/forward). The step itself, strings, booleans and nulls are not scalars.
std::vector<std::pair<std::string, double>> metrics_scalars(const nlohmann::json& line);

class TensorBoardWriter {
 public:
  // Creates `dir` and a new event file in it, which starts with the file_version event.
  explicit TensorBoardWriter(const std::string& dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  const std::string& path() const { return path_; }
  // One event holding every scalar of the list (nothing is written for an empty list).
  void add_scalars(int64_t step, const std::vector<std::pair<std::string, double>>& scalars,
                   double wall_time);
  // A metrics.jsonl object at its "step" (objects without one, like the summary, are skipped).
  void add_metrics(const nlohmann::json& line, double wall_time);
  // Pushes what was written to the file; throws std::runtime_error naming it when that failed.
  void flush();

 private:
  void write_record(const std::string& payload);
  std::string path_;
  std::FILE* file_ = nullptr;
  bool failed_ = false;
};

// Seconds since the epoch, the wall_time TensorBoard expects.
double wall_time_now();

}  // namespace accel
