#include "tools/trainer/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <regex>
#include <stdexcept>
#include <thread>
#include <tuple>

#include "runtime/host_copies.h"
#include "runtime/json.h"
#include "runtime/safetensors.h"

namespace accel {
namespace fs = std::filesystem;

namespace {
std::string state_file_of(int rank) {
  return "optimizer.rank" + std::to_string(rank) + ".safetensors";
}
std::string part_file_of(int rank) { return "part.rank" + std::to_string(rank) + ".json"; }
std::string failed_file_of(int rank) { return "part.rank" + std::to_string(rank) + ".failed"; }

// The largest step a checkpoint may claim: far beyond any run, small enough that no step
// arithmetic (step + 1, counts of tokens) can overflow.
constexpr int64_t kMaxStep = 1'000'000'000'000'000;

// N of a folder named step_N; nullopt for other names. A number past kMaxStep is no folder this
// program wrote: refused when `strict`, else skipped (pruning never deletes what it cannot read).
std::optional<int64_t> step_of(const fs::path& dir, bool strict) {
  static const std::regex name("step_([0-9]+)");
  std::smatch m;
  const std::string n = (dir.has_filename() ? dir : dir.parent_path()).filename().string();
  if (!std::regex_match(n, m, name)) return std::nullopt;
  const std::string digits = m[1];
  int64_t v = 0;
  for (char c : digits) {
    if (v > (kMaxStep - (c - '0')) / 10) {
      if (!strict) return std::nullopt;
      throw std::invalid_argument(
          dir.string() + ": not a checkpoint of accel-train (its step number is out of range, " +
          "at most " + std::to_string(kMaxStep) + "); rename or remove that folder");
    }
    v = v * 10 + (c - '0');
  }
  return v;
}

std::vector<std::pair<int64_t, fs::path>> complete_checkpoints(const fs::path& root, bool strict) {
  std::vector<std::pair<int64_t, fs::path>> out;
  if (!fs::is_directory(root)) return out;
  for (const auto& e : fs::directory_iterator(root)) {
    if (!e.is_directory() || !fs::exists(e.path() / "trainer_state.json")) continue;
    if (std::optional<int64_t> step = step_of(e.path(), strict)) out.push_back({*step, e.path()});
  }
  std::sort(out.begin(), out.end());
  return out;
}

// A JSON value for an error message, cut short: a hostile file must not flood the log.
std::string short_json(const nlohmann::json& v) {
  std::string s = v.dump();
  return s.size() > 40 ? s.substr(0, 40) + "..." : s;
}

// trainer_state.json's integer `key`, in [lo, hi].
int64_t state_int(const nlohmann::json& j, const char* key, int64_t lo, int64_t hi,
                  const std::string& file) {
  const nlohmann::json& v = j.at(key);
  // A non-negative number parses as unsigned: compare it as such until it is known to fit.
  const bool fits = v.is_number_integer() &&
                    (v.is_number_unsigned() ? v.get<uint64_t>() <= static_cast<uint64_t>(hi) &&
                                                  static_cast<int64_t>(v.get<uint64_t>()) >= lo
                                            : v.get<int64_t>() >= lo && v.get<int64_t>() <= hi);
  if (!fits)
    throw std::runtime_error(file + ": \"" + key + "\" is " + short_json(v) +
                             ", expected an integer from " + std::to_string(lo) + " to " +
                             std::to_string(hi) +
                             "; the file was altered or damaged: resume from another checkpoint");
  return v.get<int64_t>();
}

std::string errno_text() { return std::strerror(errno); }

// Writes `text` to `p` and fsyncs it: a checkpoint's files are on disk before it is renamed.
void write_synced(const fs::path& p, const std::string& text) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error(p.string() + ": cannot create: " + errno_text());
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0) {
      const std::string why = errno_text();
      ::close(fd);
      throw std::runtime_error(p.string() + ": write failed: " + why);
    }
    done += static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const std::string why = errno_text();
  ::close(fd);
  if (!synced) throw std::runtime_error(p.string() + ": fsync failed: " + why);
}

void fsync_dir(const fs::path& d) {
  const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

// A written file becomes visible under `to` at once (rename over a temporary name).
void write_synced_atomic(const fs::path& to, const std::string& text) {
  const fs::path tmp = to.string() + ".tmp";
  write_synced(tmp, text);
  fs::rename(tmp, to);
}

// 64-bit checksum over a byte stream: four independent lanes over 8-byte words (so that it runs
// near memory speed), each word mixed by xor, an odd multiply and a shift; the tail bytes and the
// length close it. Catches flipped, zeroed or truncated data; not meant against forgery.
class Checksum {
 public:
  void update(const uint8_t* p, size_t n) {
    while (n > 0) {
      if (pending_ == 0 && n >= 32) {
        const size_t blocks = n / 32;
        for (size_t b = 0; b < blocks; ++b, p += 32)
          for (int l = 0; l < 4; ++l) {
            uint64_t w;
            std::memcpy(&w, p + 8 * l, 8);
            lane_[l] = mix(lane_[l], w);
          }
        total_ += blocks * 32;
        n -= blocks * 32;
        continue;
      }
      const size_t take = std::min(n, 32 - pending_);
      std::memcpy(buf_ + pending_, p, take);
      pending_ += take;
      p += take;
      n -= take;
      if (pending_ == 32) {
        pending_ = 0;
        update(buf_, 32);
      }
    }
  }
  std::string hex() const {
    uint64_t h = static_cast<uint64_t>(total_ + pending_) * 0x9E3779B97F4A7C15ull;
    for (int l = 0; l < 4; ++l) h = mix(h, lane_[l] + static_cast<uint64_t>(l));
    for (size_t i = 0; i < pending_; ++i) h = mix(h, buf_[i] + (static_cast<uint64_t>(i) << 8));
    h = mix(h, h >> 29);
    char s[17];
    std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(h));
    return s;
  }

 private:
  static uint64_t mix(uint64_t h, uint64_t w) {
    h ^= w;
    h *= 0xFF51AFD7ED558CCDull;
    h ^= h >> 32;
    return h;
  }
  uint64_t lane_[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                       0x082EFA98EC4E6C89ull};
  uint8_t buf_[32] = {};
  size_t pending_ = 0;
  uint64_t total_ = 0;
};

nlohmann::json file_entry(const fs::path& p) {
  return {{"bytes", fs::file_size(p)}, {"checksum", checksum_file(p.string())}};
}

// The checksums of a safetensors file that save_safetensors just wrote from `tensors` (host
// memory): the whole file's, equal to checksum_file's, and each tensor's, equal to
// checksum_bytes over its bytes, in one pass over the tensors in memory. Only the header is read
// back; re-reading gigabytes that were just written would check the page cache, not the disk.
struct WrittenChecksums {
  nlohmann::json file_entry;                     // {"bytes", "checksum"}
  std::map<std::string, std::string> by_tensor;  // name -> checksum
};
WrittenChecksums checksum_written(const fs::path& p,
                                  const std::vector<std::pair<std::string, Tensor>>& tensors) {
  std::ifstream in(p, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);  // little-endian, as this program's hosts are
  const uintmax_t size = fs::file_size(p);
  std::string header(in ? static_cast<size_t>(std::min<uint64_t>(n, size)) : 0, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header.size()));
  if (!in || n > size - 8)
    throw std::runtime_error(p.string() + ": cannot read back the header just written");
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [name, t] : tensors) {
    if (!t.device().is_cpu() || !t.is_contiguous())
      throw std::logic_error("checksum_written: '" + name + "' is not contiguous host memory");
    by_name[name] = &t;
  }
  std::vector<std::tuple<uint64_t, uint64_t, std::string>> order;  // data offsets, name
  const nlohmann::json index = nlohmann::json::parse(header);
  for (const auto& [name, e] : index.items())
    if (name != "__metadata__")
      order.emplace_back(e.at("data_offsets").at(0).get<uint64_t>(),
                         e.at("data_offsets").at(1).get<uint64_t>(), name);
  std::sort(order.begin(), order.end());
  Checksum whole;
  const uint8_t len[8] = {static_cast<uint8_t>(n),       static_cast<uint8_t>(n >> 8),
                          static_cast<uint8_t>(n >> 16), static_cast<uint8_t>(n >> 24),
                          static_cast<uint8_t>(n >> 32), static_cast<uint8_t>(n >> 40),
                          static_cast<uint8_t>(n >> 48), static_cast<uint8_t>(n >> 56)};
  whole.update(len, 8);
  whole.update(reinterpret_cast<const uint8_t*>(header.data()), header.size());
  WrittenChecksums out;
  uint64_t at = 0;
  for (const auto& [begin, end, name] : order) {
    auto it = by_name.find(name);
    if (it == by_name.end() || begin != at || end - begin != it->second->nbytes())
      throw std::runtime_error(p.string() + ": the file just written does not hold '" + name +
                               "' as it was handed over");
    const uint8_t* d = static_cast<const uint8_t*>(it->second->data_ptr());
    Checksum own;
    // Both sums over the same cache-sized pieces: the bytes are read from memory once.
    for (uint64_t o = 0; o < end - begin; o += 1 << 20) {
      const size_t k = static_cast<size_t>(std::min<uint64_t>(1 << 20, end - begin - o));
      whole.update(d + o, k);
      own.update(d + o, k);
    }
    out.by_tensor[name] = own.hex();
    at = end;
  }
  if (order.size() != tensors.size() || 8 + n + at != size)
    throw std::runtime_error(p.string() + ": the file just written has " + std::to_string(size) +
                             " bytes, not what its tensors and header make");
  out.file_entry = {{"bytes", size}, {"checksum", whole.hex()}};
  return out;
}
}  // namespace

std::string checksum_bytes(const void* data, size_t n) {
  Checksum c;
  c.update(static_cast<const uint8_t*>(data), n);
  return c.hex();
}

std::string checksum_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error(path + ": cannot open for its checksum");
  Checksum c;
  std::vector<char> buf(1 << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    c.update(reinterpret_cast<const uint8_t*>(buf.data()), static_cast<size_t>(in.gcount()));
  }
  return c.hex();
}

std::string checkpoint_tmp_dir(const std::string& output_dir, int64_t step) {
  return (fs::path(output_dir) / "checkpoints" / ("step_" + std::to_string(step) + ".tmp"))
      .string();
}
std::string checkpoint_final_dir(const std::string& output_dir, int64_t step) {
  return (fs::path(output_dir) / "checkpoints" / ("step_" + std::to_string(step))).string();
}

namespace {
// This rank's slices that a snapshot holds, with the state kinds it copies ("master" left out
// where model.safetensors holds the fp32 masters): views of the live state. take_snapshot copies
// these, snapshot_layout describes them.
std::vector<ParamStateSlice> snapshot_slices(Strategy& strategy, int rank, bool save_optimizer,
                                             bool masters_in_model) {
  std::vector<ParamStateSlice> out;
  // Replicated state: rank 0 writes the one copy.
  if (!save_optimizer || (strategy.state_is_replicated() && rank != 0)) return out;
  for (ParamStateSlice& p : strategy.param_state_slices()) {
    if (masters_in_model)
      p.tensors.erase(std::remove_if(p.tensors.begin(), p.tensors.end(),
                                     [](const auto& kt) { return kt.first == "master"; }),
                      p.tensors.end());
    out.push_back(std::move(p));
  }
  return out;
}

// The GPU that one rank's snapshot sources are on (nullopt: all on the CPU), adding `d`.
void note_device(std::optional<int>& gpu, const Device& d) {
  if (!d.is_cuda()) return;
  if (gpu && *gpu != d.index)
    throw std::logic_error("take_snapshot: one rank's state on two GPUs (cuda:" +
                           std::to_string(*gpu) + ", " + d.str() + ")");
  gpu = d.index;
}
}  // namespace

SnapshotLayout snapshot_layout(Strategy& strategy, int rank, bool save_optimizer) {
  SnapshotLayout l;
  std::optional<int> gpu;
  const std::vector<StateDictEntry> weights = strategy.full_state_dict_layout();  // local
  bool masters_in_model = !weights.empty();
  for (const StateDictEntry& w : weights) masters_in_model &= w.dtype == DType::F32;
  if (rank == 0)
    for (const StateDictEntry& w : weights) {
      note_device(gpu, w.device);
      l.tensors.push_back({w.shape, w.dtype});
    }
  for (const ParamStateSlice& p : snapshot_slices(strategy, rank, save_optimizer, masters_in_model))
    for (const auto& [kind, t] : p.tensors) {
      note_device(gpu, t.device());
      l.tensors.push_back({t.shape(), t.dtype()});
    }
  l.on_gpu = gpu.has_value();
  return l;
}

CheckpointSnapshot take_snapshot(Strategy& strategy, int rank, int world_size, bool save_optimizer,
                                 SnapshotBuffer* buffer) {
  CheckpointSnapshot s;
  s.rank = rank;
  s.world_size = world_size;
  s.save_optimizer = save_optimizer;
  // What to copy, in the snapshot's order (snapshot_layout's): rank 0's full weights, then this
  // rank's slices.
  std::vector<Tensor> sources;
  std::vector<std::pair<std::string, Tensor>> weights = strategy.full_state_dict();  // collective
  s.masters_in_model = !weights.empty();
  for (const auto& [name, t] : weights) s.masters_in_model &= t.dtype() == DType::F32;
  if (rank == 0)
    for (const auto& [name, t] : weights) {
      s.full_weights.push_back({name, Tensor()});
      sources.push_back(t);
    }
  if (save_optimizer) s.kinds = strategy.state_kinds();
  for (ParamStateSlice& p : snapshot_slices(strategy, rank, save_optimizer, s.masters_in_model)) {
    ParamStateSlice h;
    h.name = p.name;
    h.shape = p.shape;
    h.begin = p.begin;
    h.end = p.end;
    for (const auto& [kind, t] : p.tensors) {
      h.tensors.push_back({kind, Tensor()});
      sources.push_back(t);
      s.kind_dtypes.emplace(kind, safetensors_dtype_name(t.dtype()));
    }
    s.slices.push_back(std::move(h));
  }
  // GPU sources contiguous before the copies are ordered after the queued work (a clone is
  // queued work too).
  std::optional<int> gpu;
  std::vector<HostTensorSpec> specs;
  for (Tensor& t : sources) {
    note_device(gpu, t.device());
    if (t.device().is_cuda() && !t.is_contiguous()) t = t.clone(MemCategory::Other);
    specs.push_back({t.shape(), t.dtype()});
  }
  std::unique_ptr<SnapshotBuffer> own;
  if (!buffer) {
    own = std::make_unique<SnapshotBuffer>(nullptr, pageable_host_memory());
    buffer = own.get();
  }
  std::vector<Tensor> host = buffer->carve(specs, gpu.has_value());
  s.pinned = buffer->pinned();
  if (gpu && s.pinned) s.copies = std::make_shared<cuda::HostCopies>(*gpu);
  for (size_t i = 0; i < sources.size(); ++i) {
    const Tensor& src = sources[i];
    const Tensor& dst = host[i];
    if (src.device().is_cpu())
      dst.copy_(src);
    else if (s.copies)
      s.copies->add(dst.data_ptr(), src.data_ptr(), src.nbytes());
    else  // pageable: synchronous, but straight into the buffer (no temporary host copy)
      cuda::copy_bytes(dst.data_ptr(), Device::cpu(), src.data_ptr(), src.device(), src.nbytes());
  }
  if (s.copies) s.copies->close();
  size_t i = 0;
  for (auto& [name, t] : s.full_weights) t = host[i++];
  for (ParamStateSlice& p : s.slices)
    for (auto& [kind, t] : p.tensors) t = host[i++];
  return s;
}

void write_checkpoint_part(const std::string& tmp_dir, const CheckpointSnapshot& s) {
  const fs::path tmp(tmp_dir);
  try {
    if (s.copies) s.copies->wait();  // the device-to-host copies of the snapshot are complete
    nlohmann::json params = nlohmann::json::object();
    nlohmann::json files = nlohmann::json::object();
    auto add_slice = [&params](const std::string& name, const Shape& shape, nlohmann::json slice) {
      nlohmann::json& p = params[name];
      p["shape"] = shape;
      p["slices"].push_back(std::move(slice));
    };
    if (!s.slices.empty()) {
      std::vector<std::pair<std::string, Tensor>> tensors;
      const std::string file = state_file_of(s.rank);
      for (const ParamStateSlice& p : s.slices)
        for (const auto& [kind, t] : p.tensors) tensors.push_back({p.name + "." + kind, t});
      save_safetensors((tmp / file).string(), tensors,
                       {{"format", "accel-train-state"}, {"rank", std::to_string(s.rank)}});
      WrittenChecksums sums = checksum_written(tmp / file, tensors);
      for (const ParamStateSlice& p : s.slices) {
        nlohmann::json keys = nlohmann::json::object();
        for (const auto& [kind, t] : p.tensors) {
          const std::string key = p.name + "." + kind;
          keys[kind] = {key, sums.by_tensor.at(key)};
        }
        add_slice(p.name, p.shape,
                  {{"file", file}, {"begin", p.begin}, {"end", p.end}, {"keys", keys}});
      }
      files[file] = sums.file_entry;
    }
    if (s.rank == 0 && s.model_files) {
      if (!s.full_weights.empty()) {
        save_safetensors((tmp / "model.safetensors").string(), s.full_weights, {{"format", "pt"}});
        WrittenChecksums sums = checksum_written(tmp / "model.safetensors", s.full_weights);
        files["model.safetensors"] = sums.file_entry;
        if (s.masters_in_model && s.save_optimizer)
          for (const auto& [name, t] : s.full_weights)
            add_slice(name, t.shape(),
                      {{"file", "model.safetensors"},
                       {"begin", 0},
                       {"end", t.numel()},
                       {"keys", {{"master", {name, sums.by_tensor.at(name)}}}}});
      }
      write_hf_model_config(s.model_config, (tmp / "config.json").string());
      write_synced(tmp / "config.yaml", s.config_yaml);
    }
    write_synced_atomic(
        tmp / part_file_of(s.rank),
        nlohmann::json{{"rank", s.rank}, {"params", params}, {"files", files}}.dump());
  } catch (const std::exception& e) {
    std::ofstream(tmp / failed_file_of(s.rank)) << e.what();
    throw;
  }
}

std::string finish_checkpoint(const std::string& tmp_dir, const std::string& final_dir,
                              const CheckpointSnapshot& s, int64_t keep_last, double timeout_s) {
  const fs::path tmp(tmp_dir), final_path(final_dir);
  nlohmann::json params = nlohmann::json::object(), files = nlohmann::json::object();
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  for (int r = 0; r < s.world_size; ++r) {
    const fs::path part = tmp / part_file_of(r);
    while (!fs::exists(part)) {
      if (fs::exists(tmp / failed_file_of(r))) {
        std::ifstream in(tmp / failed_file_of(r));
        const std::string why((std::istreambuf_iterator<char>(in)), {});
        throw std::runtime_error("rank " + std::to_string(r) +
                                 "'s checkpoint writer failed: " + why);
      }
      if (std::chrono::steady_clock::now() > deadline)
        throw std::runtime_error(tmp.string() + ": rank " + std::to_string(r) +
                                 " wrote no part within " + std::to_string(timeout_s) +
                                 " s (distributed.timeout_s); the checkpoint stays incomplete");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    const nlohmann::json j = read_json_file(part.string());
    for (const auto& [name, p] : j.at("params").items()) {
      nlohmann::json& into = params[name];
      into["shape"] = p.at("shape");
      for (const nlohmann::json& slice : p.at("slices")) into["slices"].push_back(slice);
    }
    files.update(j.at("files"));
    fs::remove(part);
  }
  // The files other parts of the run wrote (fp8 state, tokenizer, generation config).
  for (const auto& e : fs::directory_iterator(tmp)) {
    const std::string n = e.path().filename().string();
    if (e.is_regular_file() && !files.contains(n) && n != "trainer_state.json")
      files[n] = file_entry(e.path());
  }
  nlohmann::json j = {{"format", "accel-train checkpoint"},
                      {"format_version", kCheckpointFormatVersion},
                      {"step", s.state.step},
                      {"optimizer_steps", s.state.optimizer_steps},
                      {"seed", s.state.seed},
                      {"world_size", s.world_size},
                      {"data_position", s.state.data_position},
                      {"loss_scale", s.state.loss_scale},
                      {"extra", s.state.extra},
                      {"optimizer_saved", s.save_optimizer}};
  j.update(s.info);
  if (s.save_optimizer) {
    // Each kind's dtype: the masters are fp32; the moments are in the optimizer's state dtype.
    nlohmann::json dtypes = nlohmann::json::object();
    bool all_f32 = true;
    for (const std::string& k : s.kinds) {
      auto it = s.kind_dtypes.find(k);
      dtypes[k] = it == s.kind_dtypes.end() ? "F32" : it->second;
      all_f32 &= dtypes[k] == "F32";
    }
    j["state"] = {{"dtype", all_f32 ? "F32" : "mixed"},
                  {"dtypes", dtypes},
                  {"kinds", s.kinds},
                  {"params", params}};
  }
  j["files"] = files;
  write_synced(tmp / "trainer_state.json", j.dump(1) + "\n");
  fsync_dir(tmp);
  // The step's folder may exist (the same step saved again): it goes only once the new one is in
  // place.
  const fs::path replaced = final_path.string() + ".replaced";
  if (fs::exists(final_path)) {
    fs::remove_all(replaced);
    fs::rename(final_path, replaced);
  }
  fs::rename(tmp, final_path);
  fs::remove_all(replaced);
  fsync_dir(final_path.parent_path());
  if (keep_last > 0) {
    // The oldest beyond keep_last go, counting the new one; the new one always stays, even
    // where newer steps exist (a resume from an older step that moved none of them aside).
    std::vector<std::pair<int64_t, fs::path>> others;
    for (auto& c : complete_checkpoints(final_path.parent_path(), /*strict=*/false))
      if (c.second.filename() != final_path.filename()) others.push_back(c);
    for (size_t i = 0; i + keep_last < others.size() + 1; ++i) fs::remove_all(others[i].second);
  }
  return final_path.string();
}

// ---- the saver ---------------------------------------------------------------------------

struct CheckpointSaver::Job {
  std::thread thread;
  std::mutex mu;
  bool done = false;
  std::string dir;          // the final folder
  std::string error;        // the writer's failure
  double seconds = 0;       // the writer's time, less its wait for the copies
  double copy_seconds = 0;  // the device-to-host copies, from queued to complete
  std::unique_ptr<CheckpointSnapshot> snapshot;
};

CheckpointSaver::CheckpointSaver(Options o)
    : o_(std::move(o)), buffer_(o_.buffer ? std::move(o_.buffer) : SnapshotBuffer::for_run()) {}

CheckpointSaver::~CheckpointSaver() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "accel-train: %s\n", e.what());
  }
}

void CheckpointSaver::save(const std::string& output_dir, CheckpointSnapshot s) {
  if (busy())
    wait();  // at most one in flight
  else
    poll();
  auto job = std::make_unique<Job>();
  job->snapshot = std::make_unique<CheckpointSnapshot>(std::move(s));
  const int64_t step = job->snapshot->state.step;
  const std::string tmp = checkpoint_tmp_dir(output_dir, step);
  job->dir = checkpoint_final_dir(output_dir, step);
  Job* j = job.get();
  auto write = [this, j, tmp] {
    std::string error;
    double copy_s = 0;
    auto start = std::chrono::steady_clock::now();
    try {
      if (j->snapshot->copies) {
        copy_s = j->snapshot->copies->wait();
        start = std::chrono::steady_clock::now();  // the write proper starts here
      }
      if (o_.before_write) o_.before_write(tmp);
      write_checkpoint_part(tmp, *j->snapshot);
      if (j->snapshot->rank == 0)
        finish_checkpoint(tmp, j->dir, *j->snapshot, o_.keep_last, o_.timeout_s);
    } catch (const std::exception& e) {
      error = e.what();
    }
    std::lock_guard<std::mutex> lock(j->mu);
    j->error = error;
    j->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    j->copy_seconds = copy_s;
    j->snapshot.reset();  // its host buffer is free for the next snapshot
    j->done = true;
  };
  job_ = std::move(job);
  if (o_.async) {
    job_->thread = std::thread(write);
  } else {
    write();
    // A failure throws here; a success stays for wait() or poll() to hand over its folder (the
    // caller's "saved checkpoint" line).
    if (!job_->error.empty()) poll();
  }
}

bool CheckpointSaver::busy() const {
  if (!job_) return false;
  std::lock_guard<std::mutex> lock(job_->mu);
  return !job_->done;
}

std::optional<std::string> CheckpointSaver::poll() {
  if (!job_ || busy()) return std::nullopt;
  if (job_->thread.joinable()) job_->thread.join();
  std::unique_ptr<Job> job = std::move(job_);
  last_write_s_ = job->seconds;
  last_copy_s_ = job->copy_seconds;
  if (!job->error.empty())
    throw std::runtime_error("checkpoint " + job->dir + " could not be written: " + job->error);
  return job->dir;
}

std::optional<std::string> CheckpointSaver::wait() {
  if (job_ && job_->thread.joinable()) job_->thread.join();
  return poll();
}

std::string save_checkpoint(const std::string& output_dir, const TrainerState& state,
                            Strategy& strategy, const DecoderConfig& model_config,
                            const std::string& config_yaml, const CheckpointWriter& w,
                            int64_t keep_last) {
  const std::string tmp = checkpoint_tmp_dir(output_dir, state.step);
  if (w.rank == 0) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  if (w.barrier) w.barrier();
  CheckpointSaver::Options o;
  o.keep_last = keep_last;
  // Pageable: a one-off save gains nothing from pinning a block it uses once.
  o.buffer = std::make_unique<SnapshotBuffer>(nullptr, pageable_host_memory());
  CheckpointSaver saver(std::move(o));
  CheckpointSnapshot s =
      take_snapshot(strategy, w.rank, w.world_size, w.save_optimizer, saver.buffer());
  s.state = state;
  s.model_config = model_config;
  s.config_yaml = config_yaml;
  s.info = w.info;
  if (w.save_extra) {
    const nlohmann::json extra = w.save_extra(tmp);
    if (extra.is_object()) s.info.update(extra);
  }
  saver.save(output_dir, std::move(s));
  saver.wait();
  if (w.barrier) w.barrier();
  return checkpoint_final_dir(output_dir, state.step);
}

// ---- reading ------------------------------------------------------------------------------

namespace {
// A file name inside the checkpoint folder, as the index gives it: no folders, no way out.
std::string plain_file_name(const nlohmann::json& v, const std::string& where) {
  const std::string n = v.get<std::string>();
  if (n.empty() || n.find('/') != std::string::npos || n == "." || n == "..")
    throw std::runtime_error(where + ": file name " + short_json(v) +
                             " is not a plain name inside the checkpoint folder");
  return n;
}

void parse_index(const nlohmann::json& state, const std::string& where, LoadedCheckpoint& c) {
  c.kinds = state.at("kinds").get<std::vector<std::string>>();
  // Per-kind dtypes (absent before optimizer.state_dtype: everything F32).
  const nlohmann::json dtypes = state.value("dtypes", nlohmann::json::object());
  for (const std::string& k : c.kinds) {
    const std::string d = dtypes.value(k, std::string("F32"));
    if (d != "F32" && d != "BF16")
      throw std::runtime_error(where + ": state kind '" + k + "' has dtype " + d +
                               ", expected F32 or BF16");
    c.dtypes[k] = d;
  }
  for (const auto& [name, p] : state.at("params").items()) {
    CheckpointParam cp;
    cp.shape = p.at("shape").get<Shape>();
    int64_t numel = 1;
    for (int64_t d : cp.shape) {
      if (d < 0 || (d > 0 && numel > std::numeric_limits<int64_t>::max() / d))
        throw std::runtime_error(where + ": parameter '" + name + "' has a bad shape");
      numel *= d;
    }
    for (const nlohmann::json& s : p.at("slices")) {
      CheckpointSlice cs;
      cs.file = plain_file_name(s.at("file"), where);
      cs.begin = state_int(s, "begin", 0, numel, where);
      cs.end = state_int(s, "end", cs.begin + 1, numel, where);
      for (const auto& [kind, k] : s.at("keys").items())
        cs.keys[kind] = {k.at(0).get<std::string>(), k.at(1).get<std::string>()};
      cp.slices.push_back(std::move(cs));
    }
    c.params[name] = std::move(cp);
  }
}
}  // namespace

LoadedCheckpoint load_checkpoint(const std::string& dir) {
  LoadedCheckpoint c;
  c.dir = dir;
  const std::string state_file = (fs::path(dir) / "trainer_state.json").string();
  nlohmann::json j;
  bool optimizer_saved = true;
  try {
    j = read_json_file(state_file);
    if (!j.contains("format_version"))
      throw std::runtime_error(
          dir +
          ": checkpoint format version 1 (an accel-train from before checkpoints were "
          "stored per parameter range); this accel-train reads format version " +
          std::to_string(kCheckpointFormatVersion) +
          ". Resume it with the accel-train that wrote it, or run `accel-checkpoint consolidate` "
          "on it and start a new run with model.init_from pointing at the result (weights only)");
    const int64_t version = state_int(j, "format_version", 1, 1000, state_file);
    if (version != kCheckpointFormatVersion)
      throw std::runtime_error(dir + ": checkpoint format version " + std::to_string(version) +
                               "; this accel-train reads format version " +
                               std::to_string(kCheckpointFormatVersion) +
                               " (resume it with the accel-train that wrote it)");
    c.state.step = state_int(j, "step", 0, kMaxStep, state_file);
    c.state.optimizer_steps = state_int(j, "optimizer_steps", 0, c.state.step, state_file);
    if (!j.at("seed").is_number_unsigned())
      throw std::runtime_error(state_file + ": \"seed\" is " + short_json(j["seed"]) +
                               ", expected a non-negative integer; resume from another checkpoint");
    c.state.seed = j.at("seed");
    c.state.world_size = static_cast<int>(
        state_int(j, "world_size", 1, std::numeric_limits<int>::max(), state_file));
    c.state.data_position = j.at("data_position");
    c.state.loss_scale = j.value("loss_scale", 1.0);
    c.state.extra = j.value("extra", nlohmann::json::object());
    optimizer_saved = j.value("optimizer_saved", true);
    if (optimizer_saved) parse_index(j.at("state"), state_file, c);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(dir + "/trainer_state.json: unreadable (" + e.what() + ")");
  }
  if (!std::isfinite(c.state.loss_scale) || c.state.loss_scale <= 0)
    throw std::runtime_error(state_file + ": \"loss_scale\" is " + short_json(j["loss_scale"]) +
                             ", expected a positive number; resume from another checkpoint");
  const std::optional<int64_t> named = step_of(fs::path(dir), /*strict=*/false);
  if (named && *named != c.state.step)
    throw std::runtime_error(state_file + ": \"step\" is " + std::to_string(c.state.step) +
                             " but the folder is named for step " + std::to_string(*named) +
                             "; the file was altered or copied from another checkpoint");
  if (!optimizer_saved)
    throw std::runtime_error(
        dir +
        ": saved with checkpoint.save_optimizer: false, so it holds the weights but no optimizer "
        "state, and a resumed run could not continue the same trajectory. Start a new run from "
        "it with model.init_from: " +
        dir + " (the optimizer, the learning-rate schedule and the data order start afresh)");
  c.trainer_state = j;
  return c;
}

CheckpointStateReader::CheckpointStateReader(const LoadedCheckpoint& ck) : ck_(ck) {}
CheckpointStateReader::~CheckpointStateReader() = default;

const SafetensorsReader& CheckpointStateReader::file(const std::string& name) {
  auto it = files_.find(name);
  if (it != files_.end()) return *it->second;
  const fs::path p = fs::path(ck_.dir) / name;
  if (!fs::exists(p))
    throw std::runtime_error(p.string() +
                             ": missing; the checkpoint's index lists slices in it (copy it back "
                             "from where the checkpoint came from)");
  auto r = std::make_unique<SafetensorsReader>(p.string());
  return *files_.emplace(name, std::move(r)).first->second;
}

std::string LoadedCheckpoint::dtype_of(const std::string& kind) const {
  auto it = dtypes.find(kind);
  return it == dtypes.end() ? "F32" : it->second;
}

void CheckpointStateReader::read(const std::string& name, const std::string& kind, int64_t begin,
                                 const Tensor& dst) {
  if (dst.dtype() == DType::BF16) {  // read in fp32, then round (exact for BF16 slices)
    Tensor wide = Tensor::empty(dst.shape(), DType::F32, Device::cpu(), MemCategory::Other);
    read(name, kind, begin, wide);
    dst.copy_(wide);
    return;
  }
  if (dst.dtype() != DType::F32 || !dst.is_contiguous() || !dst.device().is_cpu())
    throw std::logic_error(
        "CheckpointStateReader::read: the destination must be a contiguous "
        "F32 or BF16 tensor on the CPU, not " +
        dst.str());
  const int64_t n = dst.numel(), end = begin + n;
  const std::string stored = ck_.dtype_of(kind);
  const size_t elem = stored == "BF16" ? 2 : 4;
  auto it = ck_.params.find(name);
  if (it == ck_.params.end())
    throw std::runtime_error(ck_.dir + ": the checkpoint holds no state for parameter '" + name +
                             "'");
  float* out = dst.data<float>();
  std::vector<std::pair<int64_t, int64_t>> covered;
  std::string sources;  // the files read, for messages
  for (const CheckpointSlice& s : it->second.slices) {
    auto key = s.keys.find(kind);
    if (key == s.keys.end() || s.end <= begin || s.begin >= end) continue;
    const SafetensorsReader& f = file(s.file);
    const std::string where = (fs::path(ck_.dir) / s.file).string();
    const std::string& tensor = key->second.first;
    if (!f.contains(tensor))
      throw std::runtime_error(where + ": no tensor '" + tensor +
                               "', which the checkpoint's index lists; the file was replaced");
    const SafetensorsTensorInfo& info = f.info(tensor);
    if (info.dtype_name != stored || info.nbytes() != static_cast<uint64_t>(s.end - s.begin) * elem)
      throw std::runtime_error(where + ": tensor '" + tensor + "' has dtype " + info.dtype_name +
                               " (" + std::to_string(info.nbytes()) + " bytes), the index says " +
                               stored + " [" + std::to_string(s.end - s.begin) +
                               "]; the file was replaced or altered");
    const uint8_t* raw = f.raw_data(tensor);
    if (verified_.insert({s.file, tensor}).second &&
        checksum_bytes(raw, info.nbytes()) != key->second.second)
      throw std::runtime_error(
          where + ": tensor '" + tensor + "' (elements " + std::to_string(s.begin) + "-" +
          std::to_string(s.end) + " of " + name +
          ") does not match the checksum recorded at save; the file is damaged. Restore it "
          "from a copy or resume from another checkpoint (accel-checkpoint verify checks all)");
    const int64_t lo = std::max(begin, s.begin), hi = std::min(end, s.end);
    if (elem == sizeof(float)) {
      std::memcpy(out + (lo - begin), raw + (lo - s.begin) * sizeof(float),
                  static_cast<size_t>(hi - lo) * sizeof(float));
    } else {  // BF16: widened (exact)
      for (int64_t i = lo; i < hi; ++i) {
        uint16_t b;
        std::memcpy(&b, raw + (i - s.begin) * 2, 2);
        out[i - begin] = bf16_to_f32(b);
      }
    }
    covered.push_back({lo, hi});
    sources += (sources.empty() ? "" : ", ") + where;
  }
  std::sort(covered.begin(), covered.end());
  int64_t reached = begin;
  for (const auto& [lo, hi] : covered)
    if (lo <= reached) reached = std::max(reached, hi);
  if (reached < end)
    throw std::runtime_error(ck_.dir + ": no slice holds elements " + std::to_string(reached) +
                             "-" + std::to_string(end) + " of '" + name + "' (" + kind +
                             "); a file of the checkpoint is missing from its index");
  if (has_non_finite(dst))
    throw std::runtime_error(sources + ": '" + name + "' (" + kind +
                             ") holds NaN or Inf values; the checkpoint is damaged (or was "
                             "saved after the run diverged): resume from an earlier one");
}

int64_t CheckpointStateReader::verify_all() {
  int64_t n = 0;
  for (const auto& [name, p] : ck_.params)
    for (const std::string& kind : ck_.kinds) {
      const int64_t numel = shape_numel(p.shape);
      Tensor t = Tensor::empty({numel}, DType::F32, Device::cpu(), MemCategory::Other);
      read(name, kind, 0, t);
      ++n;
    }
  return n;
}

std::vector<std::string> CheckpointStateReader::files_opened() const {
  std::vector<std::string> out;
  for (const auto& [name, f] : files_) out.push_back(name);
  return out;
}

void check_checkpoint_matches_run(const LoadedCheckpoint& ck, Module& model, Strategy& strategy) {
  const std::string advice =
      "this run's model settings differ from those the checkpoint was saved with (its "
      "config.yaml and config.json hold them). Resume with those settings, or start a new run "
      "with model.init_from pointing at a model folder";
  std::map<std::string, OfferedWeight> offered;
  const std::string file = (fs::path(ck.dir) / "trainer_state.json").string() + " (\"state\")";
  // Expert parallelism: other ranks' experts are in the checkpoint but not in this rank's model.
  for (const auto& [name, p] : ck.params)
    if (!strategy.param_held_elsewhere(name)) offered[name] = {file, "F32", p.shape};
  check_offered_weights(model, offered, ck.dir, advice, /*allow_tied_lm_head=*/false);
  const std::vector<std::string> kinds = strategy.state_kinds();
  auto list = [](const std::vector<std::string>& v) {
    std::string s;
    for (const std::string& k : v) s += (s.empty() ? "" : ", ") + k;
    return s;
  };
  if (std::set<std::string>(kinds.begin(), kinds.end()) !=
      std::set<std::string>(ck.kinds.begin(), ck.kinds.end()))
    throw std::runtime_error(ck.dir + ": the checkpoint holds the state " + list(ck.kinds) +
                             ", this run's optimizer keeps " + list(kinds) +
                             " (another optimizer.name?); resume with the optimizer it was "
                             "saved with, or start a new run with model.init_from");
  for (const auto& [name, p] : ck.params)
    for (const std::string& kind : ck.kinds) {
      bool any = false;
      for (const CheckpointSlice& s : p.slices) any |= s.keys.count(kind) > 0;
      if (!any)
        throw std::runtime_error(file + ": no slice holds '" + name + "' (" + kind +
                                 "); the index is incomplete: resume from another checkpoint");
    }
}

void restore_strategy_state(const LoadedCheckpoint& ck, Strategy& strategy) {
  CheckpointStateReader reader(ck);
  strategy.import_param_state(
      [&reader](const std::string& name, const std::string& kind, int64_t begin,
                const Tensor& dst) { reader.read(name, kind, begin, dst); },
      ck.state.optimizer_steps);
}

std::vector<std::string> verify_checkpoint(const std::string& dir) {
  std::vector<std::string> problems;
  const fs::path d(dir);
  nlohmann::json j = read_json_file((d / "trainer_state.json").string());
  if (!j.contains("files"))
    return {(d / "trainer_state.json").string() +
            ": no \"files\" (checkpoint format version 1 recorded no checksums)"};
  for (const auto& [name, e] : j.at("files").items()) {
    const fs::path p = d / plain_file_name(name, (d / "trainer_state.json").string());
    if (!fs::exists(p)) {
      problems.push_back(p.string() + ": missing");
      continue;
    }
    const uint64_t bytes = e.at("bytes").get<uint64_t>();
    if (fs::file_size(p) != bytes) {
      problems.push_back(p.string() + ": " + std::to_string(fs::file_size(p)) +
                         " bytes, recorded at save: " + std::to_string(bytes));
      continue;
    }
    const std::string sum = checksum_file(p.string());
    if (sum != e.at("checksum").get<std::string>())
      problems.push_back(p.string() + ": checksum " + sum + ", recorded at save: " +
                         e.at("checksum").get<std::string>() + " (the file is damaged)");
  }
  return problems;
}

std::optional<std::string> find_checkpoint(const std::string& output_dir, const std::string& spec) {
  if (spec == "auto") {
    auto all = complete_checkpoints(fs::path(output_dir) / "checkpoints", /*strict=*/true);
    if (all.empty()) return std::nullopt;
    return all.back().second.string();
  }
  if (!fs::is_directory(spec))
    throw std::runtime_error("--resume " + spec + ": no such checkpoint folder");
  if (!fs::exists(fs::path(spec) / "trainer_state.json"))
    throw std::runtime_error("--resume " + spec +
                             ": not a complete checkpoint (no trainer_state.json); it may be a "
                             "save that was interrupted");
  return spec;
}

std::vector<std::string> handle_newer_checkpoints(const std::string& output_dir, int64_t step,
                                                  bool move_aside, bool mover) {
  const fs::path root = fs::path(output_dir) / "checkpoints";
  std::vector<fs::path> newer;
  for (const auto& [s, dir] : complete_checkpoints(root, /*strict=*/true))
    if (s > step) newer.push_back(dir);
  if (newer.empty()) return {};
  if (!move_aside) {
    std::string names;
    for (size_t i = 0; i < newer.size() && i < 3; ++i)
      names += (i ? ", " : "") + newer[i].filename().string();
    if (newer.size() > 3) names += " and " + std::to_string(newer.size() - 3) + " more";
    throw std::invalid_argument(
        "--resume: the checkpoint is at step " + std::to_string(step) + ", but " + root.string() +
        " holds newer ones (" + names +
        ") from the run that went on from there. Training beside them would mix two runs "
        "(keep_last prunes by step, --resume auto picks the newest). Pass "
        "--move-newer-checkpoints-aside to rename them to step_N.superseded (nothing is "
        "deleted), resume the newest with --resume auto, or pass another --output-dir");
  }
  std::vector<std::string> notes;
  if (!mover) return notes;
  for (const fs::path& dir : newer) {
    fs::path to = dir.string() + ".superseded";
    for (int i = 2; fs::exists(to); ++i) to = dir.string() + ".superseded." + std::to_string(i);
    fs::rename(dir, to);
    notes.push_back("resuming at step " + std::to_string(step) + ": moved the newer " +
                    dir.string() + " aside to " + to.filename().string());
  }
  return notes;
}

}  // namespace accel
