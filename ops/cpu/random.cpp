// Random fills from the Philox stream of runtime/random.h: element i of the output (row-major) is
// element i of stream (seed, offset), so any device and any split of the work give the same values.
// The affine map runs in float (double for f64 outputs): v = low + (high - low) * u.
#include "runtime/random.h"

#include "ops/cpu/cpu_backend.h"
#include "ops/cpu/cpu_common.h"

namespace accel {
namespace {
using namespace cpu;

template <class F>
void fill_random(const char* op, const Tensor& out, F&& gen) {
  if (!out.is_contiguous())
    throw std::logic_error(std::string("[") + op + "] output must be contiguous, got " + out.str());
  dispatch_float(out.dtype(), op, [&](auto tr) {
    using Tr = decltype(tr);
    using C = typename Tr::C;
    auto* o = ptr<Tr>(out);
    parallel_for(out.numel(), kGrain / 8, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) o[i] = Tr::store(gen(C{}, static_cast<uint64_t>(i)));
    });
  });
}
}  // namespace

void CpuBackend::rand_uniform(const Tensor& out, uint64_t seed, uint64_t offset, double low,
                              double high) {
  fill_random("rand_uniform", out, [&](auto c_tag, uint64_t i) {
    using C = decltype(c_tag);
    return static_cast<C>(low) +
           static_cast<C>(high - low) * static_cast<C>(philox::uniform(seed, offset, i));
  });
}

void CpuBackend::rand_normal(const Tensor& out, uint64_t seed, uint64_t offset, double mean,
                             double stddev) {
  fill_random("rand_normal", out, [&](auto c_tag, uint64_t i) {
    using C = decltype(c_tag);
    return static_cast<C>(mean) +
           static_cast<C>(stddev) * static_cast<C>(philox::normal(seed, offset, i));
  });
}

}  // namespace accel
