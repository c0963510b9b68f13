// A CUPTI activity tracer the CUDA driver loads into any program:
//   CUDA_INJECTION64_PATH=build/lib/libaccel_kernel_trace.so ACCEL_TRACE_OUT=trace.csv prog ...
// It records every kernel, copy and memset the GPU ran (start and end by the GPU's clock) and
// every CUDA runtime and driver call the host made (start and end by the same clock, with the
// calling thread), and writes them as CSV when the program exits. "%p" in ACCEL_TRACE_OUT becomes
// the process id: several processes (ranks) need it, or they write the same file.
// tools/reference/step_timeline.py reads the file and says where a step's GPU time goes and why the
// GPU was idle (the host late to launch, or a wait). The machines we measure on have no Nsight
// Systems; this is the part of it we need.
#include <cupti.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct Record {
  char kind;  // 'K' kernel, 'C' copy, 'S' memset, 'R' runtime call, 'D' driver call
  uint64_t start, end;
  uint32_t correlation, stream;  // stream: the GPU's stream, or the host thread of a call
  std::string name;
};

std::mutex g_mutex;
// Never freed: CUPTI may still deliver buffers while static destructors run after write_trace.
std::vector<Record>& g_records = *new std::vector<Record>;
std::atomic<bool> g_written{false};  // after write_trace, late buffers are dropped
constexpr size_t kBufferBytes = 8u << 20;

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* msg = nullptr;
  cuptiGetResultString(r, &msg);
  std::fprintf(stderr, "kernel_trace: %s failed: %s\n", what, msg ? msg : "?");
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

std::string api_name(CUpti_CallbackDomain domain, CUpti_CallbackId cbid) {
  const char* name = nullptr;
  if (cuptiGetCallbackName(domain, cbid, &name) != CUPTI_SUCCESS || !name) return "?";
  return name;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* a = nullptr;
  std::vector<Record> got;
  while (cuptiActivityGetNextRecord(buffer, valid, &a) == CUPTI_SUCCESS) {
    switch (a->kind) {
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
      case CUPTI_ACTIVITY_KIND_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(a);
        got.push_back(
            {'K', k->start, k->end, k->correlationId, k->streamId, k->name ? k->name : "?"});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(a);
        got.push_back(
            {'C', m->start, m->end, m->correlationId, m->streamId,
             "memcpy kind " + std::to_string(m->copyKind) + " bytes " + std::to_string(m->bytes)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(a);
        got.push_back({'S', m->start, m->end, m->correlationId, m->streamId,
                       "memset bytes " + std::to_string(m->bytes)});
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME:
      case CUPTI_ACTIVITY_KIND_DRIVER: {
        const auto* r = reinterpret_cast<const CUpti_ActivityAPI*>(a);
        const bool runtime = a->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
        got.push_back({runtime ? 'R' : 'D', r->start, r->end, r->correlationId, r->threadId,
                       api_name(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API,
                                r->cbid)});
        break;
      }
      default:
        break;
    }
  }
  size_t dropped = 0;
  cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
  if (dropped) std::fprintf(stderr, "kernel_trace: %zu records dropped\n", dropped);
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mutex);
  if (!g_written) g_records.insert(g_records.end(), got.begin(), got.end());
}

const CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL,
                                     CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
                                     CUPTI_ACTIVITY_KIND_RUNTIME, CUPTI_ACTIVITY_KIND_DRIVER};

// ACCEL_TRACE_OUT (default kernel_trace.csv) with "%p" replaced by the process id.
std::string trace_path() {
  const char* env = std::getenv("ACCEL_TRACE_OUT");
  std::string path = env && *env ? env : "kernel_trace.csv";
  for (size_t at = path.find("%p"); at != std::string::npos; at = path.find("%p"))
    path.replace(at, 2, std::to_string(getpid()));
  return path;
}

// Kernel names can hold commas (templates): the name is the last field and is quoted.
void write_trace() {
  for (CUpti_ActivityKind k : kKinds) cuptiActivityDisable(k);
  cuptiActivityFlushAll(1);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_written = true;
  const std::string path = trace_path();
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", path.c_str());
    return;
  }
  std::fprintf(f, "kind,start_ns,end_ns,correlation,stream_or_thread,name\n");
  for (const Record& r : g_records) {
    std::string name = r.name;
    for (char& c : name)
      if (c == '"') c = '\'';
    std::fprintf(f, "%c,%llu,%llu,%u,%u,\"%s\"\n", r.kind, static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), r.correlation, r.stream, name.c_str());
  }
  std::fclose(f);
  std::fprintf(stderr, "kernel_trace: %zu records written to %s\n", g_records.size(), path.c_str());
}

}  // namespace

// Called by the CUDA driver when CUDA_INJECTION64_PATH names this library.
extern "C" int InitializeInjection() {
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "register callbacks");
  for (CUpti_ActivityKind k : kKinds) check(cuptiActivityEnable(k), "enable an activity kind");
  // Delivered every half second too: a program whose contexts are gone by exit loses at most
  // its last half second.
  check(cuptiActivityFlushPeriod(500), "flush period");
  std::atexit(write_trace);
  return 1;
}
