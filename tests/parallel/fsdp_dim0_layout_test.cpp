// FlatLayout's dim-0 mode (FSDP2's per-parameter sharding, parallel/sharding.h): every rank's owned
// rows, the shard size, and that all-gather + copy-out reproduces the parameters and copy-in +
// reduce-scatter gives each rank the summed gradient's rows. The suite names start with "Fsdp" so
// that the FSDP test selection (ctest -R Fsdp) runs them.
#include <nlohmann/json.hpp>

#include "parallel/sharding.h"
#include "tests/parallel/harness.h"

namespace accel {
namespace {

using namespace testing;
using Mode = FlatLayout::Mode;

// A [10, 3] (10 rows over 4 ranks: 3, 3, 3, 1), B [2, 5] (fewer rows than ranks: ranks 2 and 3
// own none), C [7] (1-d: 2, 2, 2, 1), D [4, 2] (divisible: 1 row each).
std::vector<std::pair<std::string, Shape>> shapes() {
  return {{"A", {10, 3}}, {"B", {2, 5}}, {"C", {7}}, {"D", {4, 2}}};
}

std::vector<double> iota(int64_t n, double start, double step) {
  std::vector<double> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = start + step * static_cast<double>(i);
  return v;
}

// The flat parameter-ordered buffer with element e of the parameters = base + e (padding 0).
Tensor flat_values(const FlatLayout& l, double base) {
  std::vector<double> v(l.flat_numel, 0.0);
  for (int64_t e = 0; e < l.numel; ++e) v[e] = base + static_cast<double>(e);
  return Tensor::from_vector(v, {l.flat_numel});
}

TEST(FsdpDim0Layout, OwnedRowsShardSizeAndOffsets) {
  FlatLayout l(shapes(), 4, Mode::Dim0);
  EXPECT_EQ(l.numel, 30 + 10 + 7 + 8);
  // Per rank: A 3 rows * 3 + B 1 row * 5 + C 2 * 1 + D 1 row * 2 = 18 -> 32 aligned.
  EXPECT_EQ(l.shard_numel, 32);
  EXPECT_EQ(l.padded_numel, 4 * 32);
  EXPECT_EQ(l.flat_numel, 64);  // 55 rounded up to 16
  const int64_t want_rows[4][4] = {{3, 3, 3, 1}, {1, 1, 0, 0}, {2, 2, 2, 1}, {1, 1, 1, 1}};
  const int64_t want_c[4] = {3, 1, 2, 1};
  const int64_t want_off[4] = {0, 9, 14, 16};
  for (size_t i = 0; i < l.slots.size(); ++i) {
    const FlatSlot& s = l.slots[i];
    EXPECT_EQ(s.rows_per_rank, want_c[i]) << s.name;
    for (int r = 0; r < 4; ++r) {
      FlatLayout::Range range = l.owned(i, r);
      EXPECT_EQ(range.size(), want_rows[i][r] * s.row_numel) << s.name << " rank " << r;
      if (range.size()) {
        EXPECT_EQ(range.begin, r * s.rows_per_rank * s.row_numel) << s.name << " rank " << r;
        EXPECT_EQ(l.shard_offset(i, r), want_off[i]) << s.name << " rank " << r;
      }
    }
  }
  // World 1: the shard is the flat buffer itself.
  FlatLayout one(shapes(), 1, Mode::Dim0);
  EXPECT_EQ(one.shard_numel, one.flat_numel);
  for (size_t i = 0; i < one.slots.size(); ++i)
    EXPECT_EQ(one.shard_offset(i, 0), one.slots[i].offset);
  // The manifest round trip.
  FlatLayout back = FlatLayout::from_json(l.to_json());
  EXPECT_EQ(back.mode, Mode::Dim0);
  EXPECT_EQ(back.shard_numel, l.shard_numel);
  nlohmann::json bad = l.to_json();
  bad["params"][1]["shard_offset"] = 8;
  EXPECT_THROW(FlatLayout::from_json(bad), std::runtime_error);
}

TEST(FsdpDim0Layout, PackIsRankMajorRowsAndUnpackInvertsIt) {
  FlatLayout l(shapes(), 4, Mode::Dim0);
  Tensor flat = flat_values(l, 1.0);
  Tensor wire = Tensor::full({l.padded_numel}, -7.0);
  l.pack(flat, wire);
  std::vector<double> w = wire.to_vector(), f = flat.to_vector();
  for (int r = 0; r < 4; ++r) {
    Tensor shard = Tensor::full({l.shard_numel}, -7.0);
    l.extract_shard(flat, r, shard);
    std::vector<double> sh = shard.to_vector();
    std::vector<char> used(l.shard_numel, 0);
    for (size_t i = 0; i < l.slots.size(); ++i) {
      const FlatSlot& s = l.slots[i];
      FlatLayout::Range range = l.owned(i, r);
      for (int64_t k = 0; k < s.rows_per_rank * s.row_numel; ++k) {
        const int64_t pos = s.shard_offset + k;
        // Rank r's part of slot i: element r*c*row + k of the parameter, then zero padding.
        const double want = k < range.size() ? f[s.offset + range.begin + k] : 0.0;
        EXPECT_EQ(w[r * l.shard_numel + pos], want) << s.name << " rank " << r << " k " << k;
        EXPECT_EQ(sh[pos], want) << s.name << " rank " << r << " k " << k;
        used[pos] = 1;
      }
    }
    for (int64_t pos = 0; pos < l.shard_numel; ++pos)
      if (!used[pos]) {
        EXPECT_EQ(w[r * l.shard_numel + pos], 0.0) << "padding, rank " << r;
        EXPECT_EQ(sh[pos], 0.0) << "padding, rank " << r;
      }
  }
  Tensor back = Tensor::full({l.flat_numel}, -7.0);
  l.unpack(wire, back);
  EXPECT_EQ(back.to_vector(), f);
  Tensor rebuilt = Tensor::zeros({l.flat_numel});
  for (int r = 0; r < 4; ++r) {
    Tensor shard = Tensor::empty({l.shard_numel});
    l.extract_shard(flat, r, shard);
    l.insert_shard(shard, r, rebuilt);
  }
  EXPECT_EQ(rebuilt.to_vector(), f);
}

// Over real ranks: each rank's shard all-gathered into the wire and copied out reproduces the
// parameters; every rank's gradient copied in and reduce-scattered (sum) gives rank r the rows it
// owns of the summed gradient (integers: exact in fp32).
TEST(FsdpDim0Layout, GatherCopyOutAndCopyInReduceScatterOverRanks) {
  for (int world : {3, 4}) {
    const int port = pick_free_port();
    auto exits = run_ranks(world, [&](int rank) -> int {
      World w = make_world(rank, world, port);
      Comm comm(w.pg);
      FlatLayout l(shapes(), world, Mode::Dim0);
      const Tensor params = flat_values(l, 1.0);
      Tensor shard = Tensor::empty({l.shard_numel});
      l.extract_shard(params, rank, shard);
      Tensor wire = Tensor::empty({l.padded_numel});
      Tensor mine = flat_view(wire, rank * l.shard_numel, {l.shard_numel});
      mine.copy_(shard);
      comm.all_gather(wire, mine)->wait();
      Tensor flat = Tensor::full({l.flat_numel}, -1.0);
      l.unpack(wire, flat);
      RANK_CHECK(flat.to_vector() == params.to_vector(), "world %d: gather + copy-out differs",
                 world);
      // Gradients: rank q holds 100 * (q + 1) + e.
      Tensor grad = flat_values(l, 100.0 * (rank + 1));
      Tensor gwire = Tensor::empty({l.padded_numel});
      l.pack(grad, gwire);
      Tensor out = Tensor::empty({l.shard_numel});
      comm.reduce_scatter(out, gwire, ReduceOp::Sum)->wait();
      double base = 0;
      for (int q = 0; q < world; ++q) base += 100.0 * (q + 1);
      Tensor sum = Tensor::from_vector(iota(l.flat_numel, base, world), {l.flat_numel});
      flat_view(sum, l.numel, {l.flat_numel - l.numel}).zero_();
      Tensor want = Tensor::empty({l.shard_numel});
      l.extract_shard(sum, rank, want);
      RANK_CHECK(out.to_vector() == want.to_vector(),
                 "world %d rank %d: copy-in + reduce-scatter is not the summed gradient's rows",
                 world, rank);
      return 0;
    });
    expect_all_ok(exits);
  }
}

}  // namespace
}  // namespace accel
