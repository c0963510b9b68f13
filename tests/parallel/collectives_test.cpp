// Every collective of the CPU process group with 2, 3 and 4 forked ranks, all dtypes, uneven and
// zero sizes, both the direct (small message) and the ring/chain (large message) algorithms.
#include <cmath>
#include <thread>

#include "tests/parallel/harness.h"

namespace accel {
namespace {

using testing::make_world;
using testing::pick_free_port;
using testing::run_ranks;

const DType kReducible[] = {DType::F32, DType::F64, DType::BF16, DType::F16,
                            DType::I32, DType::I64, DType::U8,   DType::Bool};
const DType kAll[] = {DType::F32,  DType::F64, DType::BF16, DType::F16, DType::E4M3,
                      DType::E5M2, DType::I32, DType::I64,  DType::U8,  DType::Bool};

// Small integers: exact in every dtype (fp8 included) and in any sum of four of them.
double value(DType d, int rank, int64_t i, int salt) {
  int64_t v = (rank * 7 + i * 3 + salt * 5) % 11;
  if (d == DType::Bool) return (rank + i + salt) % 3 == 0 ? 1 : 0;
  if (d == DType::U8) return static_cast<double>(v);
  return static_cast<double>(v - 5);
}

Tensor input(DType d, int64_t numel, int rank, int salt) {
  std::vector<double> v(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) v[i] = value(d, rank, i, salt);
  return Tensor::from_vector(v, {numel}, d);
}

double reduce_expected(DType d, ReduceOp op, int n, int64_t i, int salt) {
  double acc = value(d, 0, i, salt);
  for (int r = 1; r < n; ++r) {
    double v = value(d, r, i, salt);
    if (d == DType::Bool)
      acc = (acc != 0 || v != 0) ? 1 : 0;
    else
      acc = op == ReduceOp::Max ? std::max(acc, v) : acc + v;
  }
  if (op == ReduceOp::Avg) acc = is_floating(d) ? acc / n : std::trunc(acc / n);
  return acc;
}

double tolerance(DType d, double expected) {
  switch (d) {
    case DType::BF16:
      return std::abs(expected) / 128;
    case DType::F16:
      return std::abs(expected) / 1024;
    case DType::F32:
      return std::abs(expected) * 1e-6;
    default:
      return 0;
  }
}

// Returns "" or a description of the first mismatch.
std::string compare(const Tensor& t, const std::function<double(int64_t)>& expected) {
  std::vector<double> got = t.to_vector();
  for (size_t i = 0; i < got.size(); ++i) {
    double e = expected(static_cast<int64_t>(i));
    if (!(std::abs(got[i] - e) <= tolerance(t.dtype(), e)))
      return "element " + std::to_string(i) + ": got " + std::to_string(got[i]) + ", expected " +
             std::to_string(e);
  }
  return "";
}

int check_everything(ProcessGroup& pg, const char* label) {
  const int n = pg.size(), r = pg.rank();
  const int64_t sizes[] = {0, 1, n - 1, 5, 1003};
  int salt = 0;
  for (DType d : kReducible) {
    for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max}) {
      if (d == DType::Bool && op == ReduceOp::Avg) continue;
      for (int64_t numel : sizes) {
        ++salt;
        Tensor t = input(d, numel, r, salt);
        pg.all_reduce(t, op)->wait();
        std::string err = compare(t, [&](int64_t i) { return reduce_expected(d, op, n, i, salt); });
        RANK_CHECK(err.empty(), "%s all_reduce %s %s numel %lld: %s", label, dtype_name(d),
                   reduce_op_name(op), static_cast<long long>(numel), err.c_str());

        ++salt;
        Tensor in = input(d, numel * n, r, salt);
        Tensor out = Tensor::zeros({numel}, d);
        pg.reduce_scatter(out, in, op)->wait();
        err =
            compare(out, [&](int64_t i) { return reduce_expected(d, op, n, r * numel + i, salt); });
        RANK_CHECK(err.empty(), "%s reduce_scatter %s %s chunk %lld: %s", label, dtype_name(d),
                   reduce_op_name(op), static_cast<long long>(numel), err.c_str());
        std::string same = compare(in, [&](int64_t i) { return value(d, r, i, salt); });
        RANK_CHECK(same.empty(), "%s reduce_scatter modified its input: %s", label, same.c_str());
      }
    }
  }
  for (DType d : kAll) {
    for (int64_t numel : sizes) {
      ++salt;
      Tensor in = input(d, numel, r, salt);
      Tensor out = Tensor::zeros({numel * n}, d);
      pg.all_gather(out, in)->wait();
      std::string err = compare(out, [&](int64_t i) {
        return numel ? value(d, static_cast<int>(i / numel), i % numel, salt) : 0;
      });
      RANK_CHECK(err.empty(), "%s all_gather %s numel %lld: %s", label, dtype_name(d),
                 static_cast<long long>(numel), err.c_str());

      // In place: the input is this rank's chunk of the output.
      ++salt;
      Tensor buf = Tensor::zeros({numel * n}, d);
      Tensor mine = buf.as_strided({numel}, {1}, r * numel);
      mine.copy_(input(d, numel, r, salt));
      pg.all_gather(buf, mine)->wait();
      err = compare(buf, [&](int64_t i) {
        return numel ? value(d, static_cast<int>(i / numel), i % numel, salt) : 0;
      });
      RANK_CHECK(err.empty(), "%s in-place all_gather %s: %s", label, dtype_name(d), err.c_str());

      ++salt;
      int root = static_cast<int>((numel + salt) % n);
      Tensor b = input(d, numel, r, salt);
      pg.broadcast(b, root)->wait();
      err = compare(b, [&](int64_t i) { return value(d, root, i, salt); });
      RANK_CHECK(err.empty(), "%s broadcast %s root %d: %s", label, dtype_name(d), root,
                 err.c_str());

      if (n > 1) {  // ring exchange, receives posted after the sends
        ++salt;
        Tensor s = input(d, numel, r, salt);
        Tensor got = Tensor::zeros({numel}, d);
        auto ws = pg.send(s, (r + 1) % n);
        auto wr = pg.recv(got, (r + n - 1) % n);
        ws->wait();
        wr->wait();
        err = compare(got, [&](int64_t i) { return value(d, (r + n - 1) % n, i, salt); });
        RANK_CHECK(err.empty(), "%s send/recv %s: %s", label, dtype_name(d), err.c_str());
      }
    }
  }
  pg.barrier()->wait();
  return 0;
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllOpsAllDtypesBothAlgorithms) {
  const int n = GetParam();
  const int port = pick_free_port();
  auto exits = run_ranks(n, [&](int rank) {
    ProcessGroupOptions direct;  // everything here is below the ring threshold
    ProcessGroupOptions ring;
    ring.ring_threshold_bytes = 0;  // everything goes around the ring / down the chain
    ring.segment_bytes = 64;        // many segments: reduce-while-receiving and forwarding
    auto w = make_world(rank, n, port, direct);
    auto pg_ring = make_cpu_process_group(w.store, rank, n, ring);
    if (int rc = check_everything(*w.pg, "direct")) return rc;
    if (int rc = check_everything(*pg_ring, "ring")) return rc;
    return 0;
  });
  testing::expect_all_ok(exits);
}

TEST_P(Collectives, LargeMessagesAndStats) {
  const int n = GetParam();
  const int port = pick_free_port();
  auto exits = run_ranks(n, [&](int r) {
    auto w = make_world(r, n, port);
    ProcessGroup& pg = *w.pg;
    const int64_t numel = 300001;  // 1.2 MB of f32: ring, uneven chunks, several segments
    Tensor t = input(DType::F32, numel, r, 1);
    pg.all_reduce(t, ReduceOp::Sum)->wait();
    std::string err =
        compare(t, [&](int64_t i) { return reduce_expected(DType::F32, ReduceOp::Sum, n, i, 1); });
    RANK_CHECK(err.empty(), "large all_reduce: %s", err.c_str());

    // Wire bytes of the ring: 2 * S minus the two chunks this rank never sends.
    CommCounter c = pg.stats()[CommKind::AllReduce];
    int64_t base = numel / n, rem = numel % n;
    auto chunk = [&](int k) { return (base + (k % n < rem ? 1 : 0)) * 4; };
    int64_t expect_wire = 2 * numel * 4 - chunk((r + 1) % n) - chunk((r + 2) % n);
    RANK_CHECK(c.calls == 1 && c.bytes == numel * 4 && c.wire_bytes == expect_wire,
               "stats calls %lld bytes %lld wire %lld (expected wire %lld)",
               static_cast<long long>(c.calls), static_cast<long long>(c.bytes),
               static_cast<long long>(c.wire_bytes), static_cast<long long>(expect_wire));

    // A 4 MiB exchange in both directions at once cannot deadlock: sends do not block the queue.
    Tensor big = Tensor::full({1 << 20}, r, DType::F32), got = Tensor::zeros({1 << 20});
    int peer = r ^ 1;
    if (peer < n) {
      auto a = pg.send(big, peer);
      auto b = pg.recv(got, peer);
      a->wait();
      b->wait();
      RANK_CHECK(got.to_vector()[12345] == peer, "exchange got wrong data");
    }
    Tensor bc = Tensor::full({400000}, r == 1 ? 7.0 : 0.0, DType::BF16);
    pg.broadcast(bc, 1)->wait();
    RANK_CHECK(bc.to_vector().back() == 7.0, "large broadcast");
    pg.reset_stats();
    RANK_CHECK(pg.stats().total().calls == 0, "reset_stats");
    return 0;
  });
  testing::expect_all_ok(exits);
}

TEST_P(Collectives, Subgroups) {
  const int n = GetParam();
  const int port = pick_free_port();
  auto exits = run_ranks(n, [&](int r) {
    auto w = make_world(r, n, port);
    std::vector<int> evens, odds, reversed;
    for (int i = 0; i < n; ++i) (i % 2 ? odds : evens).push_back(i);
    for (int i = n - 1; i >= 0; --i) reversed.push_back(i);
    auto ge = w.pg->new_group(evens);
    auto go = w.pg->new_group(odds);
    auto gr = w.pg->new_group(reversed);
    auto& mine = r % 2 ? go : ge;
    RANK_CHECK(mine && !(r % 2 ? ge : go), "membership");
    RANK_CHECK(gr->rank() == n - 1 - r && gr->size() == n, "reversed group rank %d", gr->rank());
    // Interleave work in the subgroup and the world group.
    Tensor t = Tensor::full({10}, r + 1, DType::I64);
    auto w1 = mine->all_reduce(t, ReduceOp::Sum);
    Tensor u = Tensor::full({3}, r, DType::F32);
    auto w2 = w.pg->all_reduce(u, ReduceOp::Max);
    w1->wait();
    w2->wait();
    int64_t expect = 0;
    for (int i = r % 2; i < n; i += 2) expect += i + 1;
    RANK_CHECK(t.to_vector()[9] == expect, "subgroup sum %f vs %lld", t.to_vector()[9],
               static_cast<long long>(expect));
    RANK_CHECK(u.to_vector()[0] == n - 1, "world max");
    // Group ranks in the reversed group: broadcast from its rank 0 = world rank n-1.
    Tensor b = Tensor::full({4}, r, DType::I32);
    gr->broadcast(b, 0)->wait();
    RANK_CHECK(b.to_vector()[0] == n - 1, "reversed broadcast got %f", b.to_vector()[0]);
    // A second group with the same members is a different group.
    auto ge2 = w.pg->new_group(evens);
    auto go2 = w.pg->new_group(odds);
    auto& mine2 = r % 2 ? go2 : ge2;
    mine2->barrier()->wait();
    return 0;
  });
  testing::expect_all_ok(exits);
}

// Rows rank `from` sends rank `to` in all_to_all round `salt`: uneven, often zero.
int64_t a2a_rows(int from, int to, int salt) { return (from * 3 + to * 5 + salt) % 4; }
// Element j of row i of the block rank `from` sends rank `to`.
double a2a_value(DType d, int from, int to, int64_t i, int64_t j, int salt) {
  return value(d, from * 5 + to, i * 3 + j, salt);
}

// all_to_all of [rows, cols] blocks in every dtype; returns 0 or fails naming the case.
int check_all_to_all(ProcessGroup& pg, const char* label, int64_t cols, int salt) {
  const int n = pg.size(), r = pg.rank();
  for (DType d : kAll) {
    ++salt;
    std::vector<int64_t> in_splits(n), out_splits(n);
    std::vector<double> src;
    for (int p = 0; p < n; ++p) {
      in_splits[p] = a2a_rows(r, p, salt);
      out_splits[p] = a2a_rows(p, r, salt);
      for (int64_t i = 0; i < in_splits[p]; ++i)
        for (int64_t j = 0; j < cols; ++j) src.push_back(a2a_value(d, r, p, i, j, salt));
    }
    int64_t in_rows = 0, out_rows = 0;
    for (int p = 0; p < n; ++p) {
      in_rows += in_splits[p];
      out_rows += out_splits[p];
    }
    Tensor in = Tensor::from_vector(src, {in_rows, cols}, d);
    Tensor out = Tensor::full({out_rows, cols}, 99, d);
    pg.all_to_all(out, in, out_splits, in_splits)->wait();
    std::vector<double> got = out.to_vector();
    size_t k = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < out_splits[p]; ++i)
        for (int64_t j = 0; j < cols; ++j, ++k) {
          double e = a2a_value(d, p, r, i, j, salt);
          if (d == DType::Bool) e = e != 0;
          RANK_CHECK(got[k] == e,
                     "%s all_to_all %s: row %lld from rank %d col %lld: got %f, want %f", label,
                     dtype_name(d), static_cast<long long>(i), p, static_cast<long long>(j), got[k],
                     e);
        }
  }
  return 0;
}

TEST_P(Collectives, AllToAllUnevenAndZeroSplits) {
  const int n = GetParam();
  const int port = pick_free_port();
  auto exits = run_ranks(n, [&](int r) {
    auto w = make_world(r, n, port);
    ProcessGroupOptions small_segments;
    small_segments.segment_bytes = 64;  // rows arrive in many segments
    auto pg2 = make_cpu_process_group(w.store, r, n, small_segments);
    for (int64_t cols : {1, 3, 40})
      for (int salt = 0; salt < 4; ++salt) {
        if (int rc = check_all_to_all(*w.pg, "world", cols, salt * 100)) return rc;
        if (int rc = check_all_to_all(*pg2, "segments", cols, salt * 100 + 50)) return rc;
      }

    // Nothing to send at all, and 1-d tensors (a row is one element).
    std::vector<int64_t> zeros(n, 0);
    w.pg->all_to_all(Tensor::zeros({0, 4}), Tensor::zeros({0, 4}), zeros, zeros)->wait();
    std::vector<int64_t> one(n, 1);
    Tensor v = Tensor::full({n}, r, DType::I64), got = Tensor::zeros({n}, DType::I64);
    w.pg->all_to_all(got, v, one, one)->wait();
    for (int p = 0; p < n; ++p) RANK_CHECK(got.to_vector()[p] == p, "1-d all_to_all");

    // Stats: bytes = the input, wire = the rows for the other ranks.
    w.pg->reset_stats();
    std::vector<int64_t> in_splits(n), out_splits(n);
    int64_t in_rows = 0, out_rows = 0, sent = 0;
    for (int p = 0; p < n; ++p) {
      in_splits[p] = p + 1;
      out_splits[p] = r + 1;
      in_rows += p + 1;
      out_rows += r + 1;
      if (p != r) sent += p + 1;
    }
    w.pg->all_to_all(Tensor::zeros({out_rows, 5}), Tensor::ones({in_rows, 5}), out_splits,
                     in_splits)
        ->wait();
    CommCounter c = w.pg->stats()[CommKind::AllToAll];
    RANK_CHECK(c.calls == 1 && c.bytes == in_rows * 5 * 4 && c.wire_bytes == sent * 5 * 4,
               "all_to_all stats: calls %lld bytes %lld wire %lld", static_cast<long long>(c.calls),
               static_cast<long long>(c.bytes), static_cast<long long>(c.wire_bytes));
    RANK_CHECK(std::string(comm_kind_name(CommKind::AllToAll)) == "all_to_all", "kind name");

    // In a subgroup (the ranks above 0), interleaved with the world group.
    std::vector<int> upper;
    for (int i = 1; i < n; ++i) upper.push_back(i);
    auto sub = w.pg->new_group(upper);
    if (sub) {
      if (int rc = check_all_to_all(*sub, "subgroup", 2, 7)) return rc;
    }
    return check_all_to_all(*w.pg, "after subgroup", 2, 9);
  });
  testing::expect_all_ok(exits);
}

// Rank 0 expects one row more from rank 1 than rank 1 sends it: both ranks fail, rank 0 (which
// sees the mismatch) naming the counts, rank 1 pointing at rank 0's failure.
TEST(Collectives, AllToAllMismatchedSplitsAreRefused) {
  const int port = pick_free_port();
  auto exits = run_ranks(2, [&](int r) {
    ProcessGroupOptions o;
    o.timeout = std::chrono::seconds(10);
    auto w = make_world(r, 2, port, o);
    // Rank 0 sends rank 1 two rows and rank 1 expects two; rank 1 sends rank 0 two rows, but
    // rank 0 expects three.
    std::vector<int64_t> in_splits = {1, 2}, out_splits = {1, 3};
    if (r == 1) in_splits = {2, 1}, out_splits = {2, 1};
    int64_t in_rows = in_splits[0] + in_splits[1], out_rows = out_splits[0] + out_splits[1];
    std::string msg;
    try {
      w.pg->all_to_all(Tensor::zeros({out_rows, 2}), Tensor::ones({in_rows, 2}), out_splits,
                       in_splits)
          ->wait();
    } catch (const DistributedError& e) {
      msg = e.what();
    }
    std::fprintf(stderr, "[rank %d] %s\n", r, msg.c_str());
    if (r == 1) w.store->set("checked", "1");
    RANK_CHECK(msg.find("rank 1 sends 2 rows to rank 0, which expects 3") != std::string::npos,
               "unclear: %s", msg.c_str());
    // The group is aborted: later calls fail at once.
    bool failed = false;
    try {
      w.pg->barrier()->wait();
    } catch (const DistributedError&) {
      failed = true;
    }
    RANK_CHECK(failed, "the group kept working after a refused all_to_all");
    // Rank 1 reads rank 0's failure from the store rank 0 serves: rank 0 stays until it has.
    if (r == 0) w.store->wait({"checked"}, std::chrono::seconds(60));
    return 0;
  });
  testing::expect_all_ok(exits);
}

// A peer that exits, and one that stalls past the timeout: all_to_all fails naming it, as the
// other collectives do.
TEST(Collectives, AllToAllDeadOrStalledPeerIsNamed) {
  for (bool stall : {false, true}) {
    const int port = pick_free_port();
    auto exits = run_ranks(2, [&](int r) {
      ProcessGroupOptions o;
      o.timeout = std::chrono::milliseconds(stall ? 3000 : 10000);
      auto w = make_world(r, 2, port, o);
      w.pg->barrier()->wait();
      if (r == 1) {
        // Stalled: alive (connections open) until rank 0 has its message, however long that
        // takes on a loaded machine; a fixed sleep could end first and turn "timed out" into
        // "closed".
        if (stall) {
          try {
            w.store->wait({"checked"}, std::chrono::seconds(60));
          } catch (const std::exception&) {
          }
        }
        return 0;  // never joins the all_to_all
      }
      std::vector<int64_t> splits = {1, 1};
      std::string msg;
      try {
        w.pg->all_to_all(Tensor::zeros({2, 3}), Tensor::ones({2, 3}), splits, splits)->wait();
      } catch (const DistributedError& e) {
        msg = e.what();
      }
      if (stall) w.store->set("checked", "1");
      RANK_CHECK(msg.find("all_to_all") != std::string::npos &&
                     msg.find("rank 1") != std::string::npos &&
                     (stall ? msg.find("timed out") : msg.find("closed")) != std::string::npos,
                 "%s: unclear: %s", stall ? "stalled" : "dead", msg.c_str());
      return 0;
    });
    testing::expect_all_ok(exits);
  }
}

TEST(Collectives, AllToAllMismatchedRowSizesAreRefused) {
  const int port = pick_free_port();
  auto exits = run_ranks(2, [&](int r) {
    ProcessGroupOptions o;
    o.timeout = std::chrono::seconds(10);
    auto w = make_world(r, 2, port, o);
    std::vector<int64_t> splits = {1, 1};
    const DType d = r == 0 ? DType::F32 : DType::BF16;  // rows of 8 vs 4 bytes
    std::string msg;
    try {
      w.pg->all_to_all(Tensor::zeros({2, 2}, d), Tensor::ones({2, 2}, d), splits, splits)->wait();
    } catch (const DistributedError& e) {
      msg = e.what();
    }
    if (r == 1) w.store->set("checked", "1");
    RANK_CHECK(msg.find("rows of") != std::string::npos &&
                   msg.find("same dtype and shape past dim 0") != std::string::npos,
               "unclear: %s", msg.c_str());
    if (r == 0) w.store->wait({"checked"}, std::chrono::seconds(60));  // rank 1 done with the store
    return 0;
  });
  testing::expect_all_ok(exits);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Collectives, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "world" + std::to_string(i.param);
                         });

TEST(Collectives, SingleRankGroupIsLocal) {
  const int port = pick_free_port();
  auto w = make_world(0, 1, port);
  Tensor t = Tensor::from_vector(std::vector<double>{1, 2, 3}, {3}, DType::BF16);
  w.pg->all_reduce(t, ReduceOp::Avg)->wait();
  EXPECT_EQ(t.to_vector(), (std::vector<double>{1, 2, 3}));
  Tensor out = Tensor::zeros({3}, DType::BF16);
  w.pg->reduce_scatter(out, t)->wait();
  EXPECT_EQ(out.to_vector(), (std::vector<double>{1, 2, 3}));
  w.pg->all_gather(out, t)->wait();
  w.pg->broadcast(t, 0)->wait();
  w.pg->barrier()->wait();
  EXPECT_THROW(w.pg->send(t, 0), std::invalid_argument);
  // all_to_all over one rank is a copy of the rank's own rows.
  Tensor rows = Tensor::from_vector(std::vector<double>{1, 2, 3, 4}, {2, 2});
  Tensor moved = Tensor::zeros({2, 2});
  w.pg->all_to_all(moved, rows, {2}, {2})->wait();
  EXPECT_EQ(moved.to_vector(), rows.to_vector());
  EXPECT_EQ(w.pg->stats()[CommKind::AllToAll].wire_bytes, 0);
}

TEST(Collectives, BadArgumentsAreClearErrors) {
  const int port = pick_free_port();
  auto w = make_world(0, 1, port);
  auto expect_message = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "no exception; expected one mentioning '" << part << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  Tensor fp8 = Tensor::zeros({4}, DType::E4M3);
  expect_message([&] { w.pg->all_reduce(fp8); }, "cannot reduce e4m3");
  Tensor e5 = Tensor::zeros({8}, DType::E5M2);
  expect_message([&] { w.pg->reduce_scatter(e5, e5, ReduceOp::Max); }, "cannot reduce e5m2");
  Tensor m = Tensor::zeros({4, 3});
  Tensor transposed = m.as_strided({3, 4}, {1, 3}, 0);
  expect_message([&] { w.pg->all_reduce(transposed); }, "contiguous");
  expect_message([&] { w.pg->all_gather(Tensor::zeros({5}), Tensor::zeros({4})); },
                 "times its 4 elements");
  expect_message([&] { w.pg->broadcast(m, 3); }, "root 3");
  expect_message([&] { w.pg->all_reduce(Tensor::zeros({2}, DType::Bool), ReduceOp::Avg); }, "bool");
  expect_message([&] { w.pg->new_group({0, 0}); }, "distinct");
  // all_to_all's local contract.
  Tensor rows = Tensor::zeros({3, 2});
  expect_message(
      [&] {
        w.pg->all_to_all(Tensor::zeros({3, 2}), rows, {3, 0}, {3});
      },
      "out_splits has 2 entries");
  expect_message(
      [&] {
        w.pg->all_to_all(Tensor::zeros({3, 2}), rows, {3}, {2});
      },
      "in_splits sums to 2 rows");
  expect_message([&] { w.pg->all_to_all(Tensor::zeros({3, 2}), rows, {3}, {-1}); }, ">= 0");
  expect_message(
      [&] {
        w.pg->all_to_all(Tensor::zeros({3, 3}), rows, {3}, {3});
      },
      "same shape past dim 0");
  expect_message(
      [&] {
        w.pg->all_to_all(Tensor::zeros({3, 2}, DType::BF16), rows, {3}, {3});
      },
      "same dtype");
  expect_message(
      [&] {
        w.pg->all_to_all(Tensor::zeros({4, 2}), rows, {4}, {3});
      },
      "sends itself 3 rows");
  expect_message([&] { w.pg->all_to_all(rows, rows, {3}, {3}); }, "overlap");
  expect_message([&] { w.pg->all_to_all(Tensor::zeros({}), Tensor::zeros({}), {1}, {1}); },
                 "at least one dimension");
  // fp8 still moves as bytes.
  w.pg->all_gather(Tensor::zeros({4}, DType::E4M3), fp8)->wait();
}

}  // namespace
}  // namespace accel
