// Expert parallelism without the MoE model: the mesh, the differentiable all-to-all, the count
// exchange, the config key, and ExpertParallelStrategy on a toy mixture-of-experts model
// (shared parameters plus experts under global names, tokens sent to their expert's owner and
// back by all_to_all_rows) against one process running the whole toy model: 2, 3 and 4 CPU ranks
// with expert_parallel_size 1, 2 and 4 and DDP, ZeRO-2/3 and FSDP for the rest, plus checkpoints
// saved under expert parallelism and resumed without it and the other way round.
#include "parallel/expert_parallel.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>

#include "ops/ops.h"
#include "parallel/expert_parallel_strategy.h"
#include "parallel/fsdp.h"
#include "runtime/config.h"
#include "tests/parallel/strategy_test_util.h"
#include "tools/trainer/checkpoint.h"

namespace accel {
namespace {

namespace fs = std::filesystem;
using testing::compare_losses;
using testing::compare_weights;
using testing::expect_all_ok;
using testing::make_world;
using testing::pick_free_port;
using testing::ReferenceStrategy;
using testing::run_ranks;
using testing::test_optimizer;
using testing::Weights;
using testing::World;

constexpr double kRel = 1e-5;

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// ---- the mesh ----------------------------------------------------------------------------------

TEST(ExpertParallel, MeshGroupsAreConsecutiveBlocksAndStrides) {
  EXPECT_EQ(expert_parallel_group_ranks(8, 4, 1), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(expert_data_parallel_group_ranks(8, 4, 1), (std::vector<int>{1, 5}));
  EXPECT_EQ(expert_data_parallel_group_ranks(6, 2, 0), (std::vector<int>{0, 2, 4}));
  EXPECT_TRUE(is_expert_param("model.layers.3.mlp.experts.5.gate_proj.weight"));
  EXPECT_EQ(expert_index_of("model.layers.3.block_sparse_moe.experts.12.w1.weight"), 12);
  EXPECT_FALSE(is_expert_param("model.layers.3.mlp.gate.weight"));
  EXPECT_FALSE(is_expert_param("model.layers.3.mlp.shared_expert.up_proj.weight"));
  EXPECT_FALSE(is_expert_param("experts.5.weight"));  // needs the ".experts." of a module path
  EXPECT_EQ(with_expert_index("layers.0.experts.3.weight", 11), "layers.0.experts.11.weight");
}

TEST(ExpertParallel, MeshOnFourRanks) {
  const int port = pick_free_port();
  auto exits = run_ranks(4, [&](int rank) -> int {
    World w = make_world(rank, 4, port);
    ExpertParallelContext c = make_expert_parallel(w.pg, 2, 6, Device::cpu());
    RANK_CHECK(c.ep_rank == rank % 2 && c.ep_size == 2, "ep rank %d", c.ep_rank);
    RANK_CHECK(c.expert_begin == 3 * (rank % 2) && c.expert_end == c.expert_begin + 3,
               "experts %lld..%lld", static_cast<long long>(c.expert_begin),
               static_cast<long long>(c.expert_end));
    RANK_CHECK(c.ep_group->world_ranks() == expert_parallel_group_ranks(4, 2, rank / 2),
               "EP group");
    RANK_CHECK(c.expert_dp_group->world_ranks() == expert_data_parallel_group_ranks(4, 2, rank % 2),
               "expert-data-parallel group");
    RANK_CHECK(c.owner(4) == 1 && c.holds(c.expert_begin) && !c.holds(c.expert_end), "owner");
    // The groups work, and the world group next to them.
    Tensor t = Tensor::full({1}, rank);
    c.expert_dp_group->all_reduce(t, ReduceOp::Sum)->wait();
    RANK_CHECK(t.item() == (rank % 2 == 0 ? 0 + 2 : 1 + 3), "expert-dp sum %f", t.item());
    w.pg->barrier()->wait();
    // A world size the EP size does not divide, and experts it does not divide: refused.
    std::string m = message_of([&] { make_expert_parallel(w.pg, 3, 6, Device::cpu()); });
    RANK_CHECK(m.find("distributed.expert_parallel_size 3") != std::string::npos &&
                   m.find("number of processes (4)") != std::string::npos,
               "unclear: %s", m.c_str());
    m = message_of([&] { make_expert_parallel(w.pg, 4, 6, Device::cpu()); });
    RANK_CHECK(m.find("number of experts (6)") != std::string::npos, "unclear: %s", m.c_str());
    return 0;
  });
  expect_all_ok(exits);
}

TEST(ExpertParallel, ThreeRanksWithEpTwoAreRefused) {
  const int port = pick_free_port();
  auto exits = run_ranks(3, [&](int rank) -> int {
    World w = make_world(rank, 3, port);
    std::string m = message_of([&] { make_expert_parallel(w.pg, 2, 4, Device::cpu()); });
    RANK_CHECK(m.find("divide the number of processes (3)") != std::string::npos, "unclear: %s",
               m.c_str());
    return 0;
  });
  expect_all_ok(exits);
}

// ---- the config key -----------------------------------------------------------------------------

TEST(ExpertParallel, ConfigKeyIsValidatedNamingIt) {
  Config d = default_config();
  EXPECT_EQ(d.distributed.expert_parallel_size, 1);
  EXPECT_EQ(model_num_experts(d.model), 0);
  auto refused = [](const std::vector<std::string>& sets) {
    return message_of([&] { load_config("", sets, {}); });
  };
  const std::vector<std::string> two_cpu = {"distributed_type=MULTI_CPU", "num_processes=4",
                                            "use_cpu=true"};
  auto with = [&](const std::string& s) {
    std::vector<std::string> v = two_cpu;
    v.push_back(s);
    return v;
  };
  EXPECT_EQ(load_config("", with("distributed.expert_parallel_size=1"), {})
                .distributed.expert_parallel_size,
            1);
  // The default model (llama) has no experts: any split is refused naming the key and the model
  // fields.
  std::string m = refused(with("distributed.expert_parallel_size=2"));
  EXPECT_NE(m.find("distributed.expert_parallel_size"), std::string::npos) << m;
  EXPECT_NE(m.find("has no experts"), std::string::npos) << m;
  EXPECT_NE(m.find("model.num_experts"), std::string::npos) << m;
  m = refused(with("distributed.expert_parallel_size=0"));
  EXPECT_NE(m.find("distributed.expert_parallel_size"), std::string::npos) << m;
  // validate_config on a Config changed in code: the world-size rule (once experts exist the
  // expert-count rule follows it; both name the key).
  Config c = load_config("", two_cpu, {});
  c.distributed.expert_parallel_size = 3;
  m = message_of([&] { validate_config(c); });
  EXPECT_NE(m.find("distributed.expert_parallel_size 3"), std::string::npos) << m;
}

// ---- all_to_all_rows and the count exchange ----------------------------------------------------

// Rows rank q sends rank p (uneven, some zero).
int64_t rows_between(int q, int p) { return (q * 2 + p * 3 + 1) % 4; }
double row_value(int q, int p, int64_t i, int64_t j) { return q * 100 + p * 10 + i + 0.25 * j; }
// Exact in fp32 (quarters).
double out_weight(int p, int q, int64_t i, int64_t j) { return 1 + p + 0.5 * q + 0.25 * i - j; }

class EpRanks : public ::testing::TestWithParam<int> {};

TEST_P(EpRanks, AllToAllRowsForwardAndBackwardMatchOneProcess) {
  const int n = GetParam();
  const int port = pick_free_port();
  auto exits = run_ranks(n, [&](int r) -> int {
    World w = make_world(r, n, port);
    const int64_t cols = 3;
    std::vector<int64_t> send(n), recv(n);
    std::vector<double> x_values;
    for (int p = 0; p < n; ++p) {
      send[p] = rows_between(r, p);
      recv[p] = rows_between(p, r);
      for (int64_t i = 0; i < send[p]; ++i)
        for (int64_t j = 0; j < cols; ++j) x_values.push_back(row_value(r, p, i, j));
    }
    const int64_t in_rows = std::accumulate(send.begin(), send.end(), int64_t{0});
    Tensor x = Tensor::from_vector(x_values, {in_rows, cols});
    x.set_requires_grad(true);
    Tensor y = all_to_all_rows(x, send, recv, *w.pg);
    // The forward: rows from rank 0, 1, ... as each sent them.
    std::vector<double> got = y.to_vector(), weights;
    size_t k = 0;
    for (int q = 0; q < n; ++q)
      for (int64_t i = 0; i < recv[q]; ++i)
        for (int64_t j = 0; j < cols; ++j, ++k) {
          RANK_CHECK(got[k] == row_value(q, r, i, j), "forward row %lld from %d",
                     static_cast<long long>(i), q);
          weights.push_back(out_weight(r, q, i, j));
        }
    // loss = sum(y * weights): d loss / d x on the sender is the receiver's weight.
    Tensor wt = Tensor::from_vector(weights, y.shape());
    sum(mul(y, wt)).backward();
    std::vector<double> g = x.grad().to_vector();
    k = 0;
    for (int p = 0; p < n; ++p)
      for (int64_t i = 0; i < send[p]; ++i)
        for (int64_t j = 0; j < cols; ++j, ++k)
          RANK_CHECK(g[k] == out_weight(p, r, i, j), "gradient of row %lld for %d: %f vs %f",
                     static_cast<long long>(i), p, g[k], out_weight(p, r, i, j));
    RANK_CHECK(w.pg->stats()[CommKind::AllToAll].calls == 2, "one all-to-all each way");
    return 0;
  });
  expect_all_ok(exits);
}

TEST_P(EpRanks, ExpertCountsExchange) {
  const int n = GetParam();
  const int port = pick_free_port();
  auto exits = run_ranks(n, [&](int r) -> int {
    World w = make_world(r, n, port);
    const int64_t E = 2 * n;  // two local experts per rank
    ExpertParallelContext c = make_expert_parallel(w.pg, n, E, Device::cpu());
    auto count = [](int rank, int64_t e) { return (rank * 5 + e * 3) % 4; };
    std::vector<int64_t> counts(E);
    for (int64_t e = 0; e < E; ++e) counts[e] = count(r, e);
    ExpertDispatch d = plan_expert_dispatch(c, counts);
    for (int p = 0; p < n; ++p) {
      RANK_CHECK(d.send_rows[p] == count(r, 2 * p) + count(r, 2 * p + 1), "send to %d", p);
      RANK_CHECK(d.recv_rows[p] == count(p, 2 * r) + count(p, 2 * r + 1), "recv from %d", p);
      for (int j = 0; j < 2; ++j)
        RANK_CHECK(d.recv_group_sizes()[p * 2 + j] == count(p, 2 * r + j), "group %d/%d", p, j);
    }
    for (int j = 0; j < 2; ++j) {
      int64_t all = 0;
      for (int p = 0; p < n; ++p) all += count(p, 2 * r + j);
      RANK_CHECK(d.local_expert_rows[j] == all, "local expert %d", j);
    }
    RANK_CHECK(message_of([&] {
                 plan_expert_dispatch(c, {1, 2, 3});
               }).find("expert counts") != std::string::npos,
               "wrong count size accepted");
    return 0;
  });
  expect_all_ok(exits);
}

INSTANTIATE_TEST_SUITE_P(Ranks, EpRanks, ::testing::Values(1, 2, 3, 4),
                         [](const ::testing::TestParamInfo<int>& i) {
                           return "world" + std::to_string(i.param);
                         });

// ---- a toy mixture-of-experts model ------------------------------------------------------------

constexpr int64_t kHidden = 8, kExperts = 4, kLayers = 2, kTokens = 24;

// The same initial value for a parameter name in every process (experts by global index).
Tensor initial_value(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  Tensor t = rand_normal({kHidden, kHidden}, 1234, (h % 100000) * 4096, DType::F32, Device::cpu(),
                         0, 0.35);
  t.set_requires_grad(true);
  return t;
}

// Top-1 routing by token and layer: uneven, and a rank's few tokens leave some experts empty.
int64_t expert_of(int64_t token, int64_t layer) {
  return (token * 7 + layer * 3 + token / 5) % kExperts;
}

class ToyLayer : public Module {
 public:
  ToyLayer(int64_t layer, const ExpertParallelContext* ep) : layer_(layer), ep_(ep) {
    const std::string prefix = "layers." + std::to_string(layer) + ".";
    in_ = &register_parameter("in_proj.weight", initial_value(prefix + "in_proj.weight"));
    const int64_t begin = ep ? ep->expert_begin : 0, end = ep ? ep->expert_end : kExperts;
    for (int64_t e = begin; e < end; ++e) {
      const std::string n = "experts." + std::to_string(e) + ".weight";
      experts_.push_back(&register_parameter(n, initial_value(prefix + n)));
    }
  }
  std::string type_name() const override { return "ToyLayer"; }

  // x [T, H] of the tokens with global indices token_ids.
  Tensor forward(const Tensor& x, const std::vector<int64_t>& token_ids) {
    return with_forward_hooks(*this, [&] {
      const int64_t T = x.shape()[0];
      Tensor h = linear(x, in_->value);
      std::vector<int64_t> expert(T), perm(T), inverse(T), counts(kExperts, 0);
      for (int64_t t = 0; t < T; ++t) {
        expert[t] = expert_of(token_ids[t], layer_);
        ++counts[expert[t]];
      }
      std::iota(perm.begin(), perm.end(), 0);
      std::stable_sort(perm.begin(), perm.end(),
                       [&](int64_t a, int64_t b) { return expert[a] < expert[b]; });
      for (int64_t i = 0; i < T; ++i) inverse[perm[i]] = i;
      Tensor rows = embedding(h, Tensor::from_vector(perm, {T}));  // sorted by expert
      std::vector<int64_t> groups = counts;
      ExpertDispatch d;
      if (ep_) {
        d = plan_expert_dispatch(*ep_, counts);
        rows = all_to_all_rows(rows, d.send_rows, d.recv_rows, *ep_->ep_group);
        groups = d.recv_group_sizes();  // by sender, then local expert
      }
      std::vector<Tensor> parts;
      int64_t at = 0;
      for (size_t g = 0; g < groups.size(); ++g) {
        Parameter* w = experts_[g % experts_.size()];
        parts.push_back(linear(narrow(rows, 0, at, groups[g]), w->value));
        at += groups[g];
      }
      Tensor y = cat(parts, 0);
      if (ep_) y = all_to_all_rows(y, d.recv_rows, d.send_rows, *ep_->ep_group);
      Tensor mixed = embedding(y, Tensor::from_vector(inverse, {T}));  // token order again
      return add(x, tanh(add(mixed, h)));
    });
  }

 private:
  int64_t layer_;
  const ExpertParallelContext* ep_;
  Parameter* in_;
  std::vector<Parameter*> experts_;
};

class ToyMoe : public Module {
 public:
  // ep null: one process with every expert.
  explicit ToyMoe(const ExpertParallelContext* ep) {
    embed_ = &register_parameter("embed.weight", initial_value("embed.weight"));
    for (int64_t l = 0; l < kLayers; ++l)
      layers_.push_back(
          &register_module("layers." + std::to_string(l), std::make_unique<ToyLayer>(l, ep)));
    head_ = &register_parameter("head.weight", initial_value("head.weight"));
    finalize();
  }
  std::string type_name() const override { return "ToyMoe"; }
  Tensor loss(const Tensor& x, const Tensor& target, const std::vector<int64_t>& ids) {
    return with_forward_hooks(*this, [&] {
      Tensor h = linear(x, embed_->value);
      for (ToyLayer* l : layers_) h = l->forward(h, ids);
      Tensor d = sub(linear(h, head_->value), target);
      return mean(mul(d, d));
    });
  }

 private:
  Parameter* embed_;
  std::vector<ToyLayer*> layers_;
  Parameter* head_;
};

struct ToyRun {
  std::string engine = "ddp";  // ddp | zero1 | zero2 | zero3 | fsdp
  int world = 1;
  int ep = 1;
  int steps = 4;
  OptimizerName optimizer = OptimizerName::AdamW;
  double lr = 0.02;
  double clip = 0.5;  // below the first steps' norms: clipping takes part
};

std::string toy_name(const ToyRun& r) {
  return r.engine + "_world" + std::to_string(r.world) + "_ep" + std::to_string(r.ep) +
         (r.optimizer == OptimizerName::Sgd ? "_sgd" : "");
}

void PrintTo(const ToyRun& r, std::ostream* os) { *os << toy_name(r); }

// Step `step`'s batch rows [first, first + count) of the global batch of kTokens tokens.
std::pair<Tensor, Tensor> toy_batch(int step, int64_t first, int64_t count) {
  Tensor x = rand_normal({kTokens, kHidden}, 99, static_cast<uint64_t>(step) * 1000000);
  Tensor t = rand_normal({kTokens, kHidden}, 99, static_cast<uint64_t>(step) * 1000000 + 500000);
  return {narrow(x, 0, first, count).clone(), narrow(t, 0, first, count).clone()};
}

std::unique_ptr<FlatDataParallel> toy_engine(const std::string& engine,
                                             std::shared_ptr<ProcessGroup> pg, ParamFilter f) {
  if (engine == "ddp")
    return std::make_unique<DdpStrategy>(pg, DType::F32, 0.0005, false, std::move(f));
  if (engine == "fsdp") {
    FsdpOptions o;
    o.layer_cls_to_wrap = {"ToyLayer"};
    o.state_dict_type = FsdpStateDictType::Full;
    o.param_filter = std::move(f);
    return std::make_unique<FsdpStrategy>(pg, o);
  }
  DataParallelOptions o;
  o.zero_stage = engine.back() - '0';
  o.bucket_cap_mb = 0.0005;  // ~130 fp32 elements: a bucket per parameter or two
  o.unit_types = {"ToyLayer"};
  o.save_16bit_model = true;  // fp32 compute: full_state_dict gives the fp32 weights
  o.param_filter = std::move(f);
  return std::make_unique<ZeroStrategy>(pg, o);
}

struct ToyResult {
  std::vector<double> losses, norms;
  Weights weights;
};

struct ToyTrainee {
  std::unique_ptr<ExpertParallelContext> ctx;
  std::unique_ptr<ToyMoe> model;
  std::unique_ptr<Strategy> strategy;
};

// pg null: the whole model in one process with the reference strategy. ep 0: every rank holds
// every expert and the engine runs alone (no expert parallelism at all).
ToyTrainee make_toy(const ToyRun& r, std::shared_ptr<ProcessGroup> pg) {
  ToyTrainee t;
  OptimizerOptions opts = test_optimizer(r.optimizer);
  if (!pg) {
    t.model = std::make_unique<ToyMoe>(nullptr);
    t.strategy = std::make_unique<ReferenceStrategy>(DType::F32);
  } else if (r.ep == 0) {
    t.model = std::make_unique<ToyMoe>(nullptr);
    t.strategy = toy_engine(r.engine, pg, {});
  } else {
    t.ctx = std::make_unique<ExpertParallelContext>(
        make_expert_parallel(pg, r.ep, kExperts, Device::cpu()));
    t.model = std::make_unique<ToyMoe>(t.ctx.get());
    t.strategy = std::make_unique<ExpertParallelStrategy>(
        pg, *t.ctx, [&r](std::shared_ptr<ProcessGroup> g, ParamFilter f) {
          return toy_engine(r.engine, std::move(g), std::move(f));
        });
  }
  t.strategy->setup(*t.model, opts);
  return t;
}

// One step on this rank's share of the batch; returns the global mean loss.
double toy_step(const ToyRun& r, ToyTrainee& t, int step, ProcessGroup* pg, double* norm) {
  const int world = pg ? pg->size() : 1, rank = pg ? pg->rank() : 0;
  const int64_t count = kTokens / world, first = rank * count;
  auto [x, target] = toy_batch(step, first, count);
  std::vector<int64_t> ids(count);
  std::iota(ids.begin(), ids.end(), first);
  t.strategy->begin_micro_batch(true);
  Tensor loss = t.model->loss(x, target, ids);
  double l = loss.item();
  loss.backward();
  t.strategy->end_micro_batch();
  StepResult s = t.strategy->step(r.lr, r.clip, 1.0);
  if (norm) *norm = s.grad_norm;
  return testing::mean_over_ranks(l, pg);
}

ToyResult toy_reference(const ToyRun& r) {
  ToyTrainee t = make_toy(r, nullptr);
  ToyResult out;
  for (int step = 0; step < r.steps; ++step) {
    double norm = 0;
    out.losses.push_back(toy_step(r, t, step, nullptr, &norm));
    out.norms.push_back(norm);
  }
  for (auto& [n, w] : t.strategy->full_state_dict()) out.weights.push_back({n, w.clone()});
  return out;
}

class ToyParity : public ::testing::TestWithParam<ToyRun> {};

TEST_P(ToyParity, MatchesOneProcess) {
  const ToyRun r = GetParam();
  const ToyResult ref = toy_reference(r);
  // The test would not see a wrong gradient scale if clipping never acted (AdamW hardly sees
  // the scale); the gradient norm itself is compared too.
  ASSERT_GT(*std::max_element(ref.norms.begin(), ref.norms.end()), r.clip);
  const int port = pick_free_port();
  auto exits = run_ranks(r.world, [&](int rank) -> int {
    World w = make_world(rank, r.world, port);
    ToyTrainee t = make_toy(r, w.pg);
    for (int step = 0; step < r.steps; ++step) {
      double norm = 0;
      const double loss = toy_step(r, t, step, w.pg.get(), &norm);
      RANK_CHECK(testing::close_rel(loss, ref.losses[step], kRel),
                 "%s step %d: loss %.9g, one process %.9g", toy_name(r).c_str(), step + 1, loss,
                 ref.losses[step]);
      RANK_CHECK(testing::close_rel(norm, ref.norms[step], kRel),
                 "%s step %d: gradient norm %.9g, one process %.9g", toy_name(r).c_str(), step + 1,
                 norm, ref.norms[step]);
    }
    Weights got = t.strategy->full_state_dict();  // every expert, gathered from its owners
    const std::string diff = compare_weights(got, ref.weights, kRel);
    RANK_CHECK(diff.empty(), "%s final weights: %s", toy_name(r).c_str(), diff.c_str());
    if (r.ep > 1) {
      auto* ep = dynamic_cast<ExpertParallelStrategy*>(t.strategy.get());
      RANK_CHECK(
          ep && ep->optimizer_steps() == r.steps && ep->experts().optimizer_steps() == r.steps,
          "one step count");
      // Two all-to-alls of rows per layer forward, two in backward, plus the count exchange.
      const CommCounter a2a = ep->group_comm_stats()[CommKind::AllToAll];
      RANK_CHECK(a2a.calls == r.steps * kLayers * 5, "all-to-all calls %lld",
                 static_cast<long long>(a2a.calls));
      const nlohmann::json rep = ep->run_report();
      RANK_CHECK(rep.at("expert_parallel").at("all_to_all_bytes_per_step").get<int64_t>() ==
                     a2a.bytes / r.steps,
                 "run report: %s", rep.dump().c_str());
      RANK_CHECK(ep->forward_is_collective(), "the all-to-all makes forward collective");
    }
    return 0;
  });
  expect_all_ok(exits);
}

std::vector<ToyRun> toy_runs() {
  std::vector<ToyRun> out;
  for (const char* engine : {"ddp", "zero2", "fsdp"})
    for (int world : {2, 3, 4})
      for (int ep : {1, 2, 4}) {
        if (ep > world || world % ep != 0) continue;
        ToyRun r;
        r.engine = engine;
        r.world = world;
        r.ep = ep;
        out.push_back(r);
      }
  for (const char* engine : {"zero1", "zero3"}) {
    ToyRun r;
    r.engine = engine;
    r.world = 4;
    r.ep = 2;
    out.push_back(r);
  }
  // SGD sees the gradients' scale directly (AdamW almost not).
  for (const char* engine : {"ddp", "fsdp"}) {
    ToyRun r;
    r.engine = engine;
    r.world = 4;
    r.ep = 2;
    r.optimizer = OptimizerName::Sgd;
    r.lr = 0.05;
    r.clip = 0;  // off: the scale goes straight into the update
    out.push_back(r);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Runs, ToyParity, ::testing::ValuesIn(toy_runs()),
                         [](const ::testing::TestParamInfo<ToyRun>& i) {
                           return toy_name(i.param);
                         });

// The model must hold only the rank's experts.
TEST(ExpertParallel, SetupRefusesAModelWithOtherRanksExperts) {
  const int port = pick_free_port();
  auto exits = run_ranks(2, [&](int rank) -> int {
    World w = make_world(rank, 2, port);
    ExpertParallelContext c = make_expert_parallel(w.pg, 2, kExperts, Device::cpu());
    ToyMoe all(nullptr);  // every expert
    ExpertParallelStrategy s(w.pg, c, [](std::shared_ptr<ProcessGroup> g, ParamFilter f) {
      return toy_engine("ddp", std::move(g), std::move(f));
    });
    std::string m = message_of([&] { s.setup(all, test_optimizer()); });
    RANK_CHECK(m.find("must build just the local experts") != std::string::npos, "unclear: %s",
               m.c_str());
    RANK_CHECK(s.param_held_elsewhere("layers.0.experts." + std::to_string(rank == 0 ? 3 : 0) +
                                      ".weight") &&
                   !s.param_held_elsewhere("layers.0.experts." + std::to_string(rank == 0 ? 0 : 3) +
                                           ".weight") &&
                   !s.param_held_elsewhere("embed.weight"),
               "param_held_elsewhere");
    return 0;
  });
  expect_all_ok(exits);
}

// make_strategy picks the composite over the YAML's engine kind, and needs the mesh.
TEST(ExpertParallel, MakeStrategyComposesTheConfiguredEngine) {
  const int port = pick_free_port();
  auto exits = run_ranks(2, [&](int rank) -> int {
    World w = make_world(rank, 2, port);
    ExpertParallelContext c = make_expert_parallel(w.pg, 2, kExperts, Device::cpu());
    Config cfg = default_config();
    cfg.num_processes = 2;
    cfg.distributed.expert_parallel_size = 2;
    cfg.fsdp.fsdp_transformer_layer_cls_to_wrap = "ToyLayer";
    const std::pair<DistributedType, std::string> cases[] = {
        {DistributedType::MultiCpu, "ddp+ep2"},
        {DistributedType::DeepSpeed, "zero2+ep2"},
        {DistributedType::Fsdp, "fsdp+ep2"}};
    for (const auto& [type, name] : cases) {
      cfg.distributed_type = type;
      std::unique_ptr<Strategy> s = make_strategy(cfg, w.pg, DType::F32, &c);
      RANK_CHECK(s->name() == name, "got %s, want %s", s->name().c_str(), name.c_str());
      ToyMoe m(&c);
      s->setup(m, test_optimizer());
      RANK_CHECK(!s->state_is_replicated(), "%s: the experts differ by rank", name.c_str());
      RANK_CHECK(message_of([&] {
                   make_strategy(cfg, w.pg, DType::F32, nullptr);
                 }).find("expert-parallel mesh") != std::string::npos,
                 "no mesh accepted");
    }
    return 0;
  });
  expect_all_ok(exits);
}

// A NaN on one rank: every rank skips the step and names the same first parameter.
TEST(ExpertParallel, NonFiniteGradientSkipsTheStepOnEveryRank) {
  const int port = pick_free_port();
  auto exits = run_ranks(4, [&](int rank) -> int {
    World w = make_world(rank, 4, port);
    ToyRun r;
    r.world = 4;
    r.ep = 2;
    ToyTrainee t = make_toy(r, w.pg);
    Weights before;
    for (auto& [n, v] : t.strategy->full_state_dict()) before.push_back({n, v.clone()});
    auto [x, target] = toy_batch(0, rank * 6, 6);
    if (rank == 3) x.data<float>()[5] = std::nanf("");
    std::vector<int64_t> ids(6);
    std::iota(ids.begin(), ids.end(), rank * 6);
    t.strategy->begin_micro_batch(true);
    t.model->loss(x, target, ids).backward();
    t.strategy->end_micro_batch();
    StepResult s = t.strategy->step(r.lr, r.clip, 1.0);
    RANK_CHECK(s.skipped && s.first_non_finite == "embed.weight", "skipped %d, first '%s'",
               static_cast<int>(s.skipped), s.first_non_finite.c_str());
    const std::string diff = compare_weights(t.strategy->full_state_dict(), before, 0.0);
    RANK_CHECK(diff.empty(), "a skipped step changed weights: %s", diff.c_str());
    return 0;
  });
  expect_all_ok(exits);
}

// ---- checkpoints across layouts ----------------------------------------------------------------

// Saves after 2 steps in layout `a`, resumes in layout `b` and compares steps 3-4 with `a`'s
// uninterrupted run (and with one process).
void save_and_resume(const ToyRun& a, const ToyRun& b) {
  const ToyResult ref = toy_reference(a);
  const fs::path dir =
      fs::temp_directory_path() / ("accel_ep_ck_" + toy_name(a) + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const int port = pick_free_port();
  auto exits = run_ranks(a.world, [&](int rank) -> int {
    World w = make_world(rank, a.world, port);
    ToyTrainee t = make_toy(a, w.pg);
    for (int step = 0; step < 2; ++step) toy_step(a, t, step, w.pg.get(), nullptr);
    TrainerState st;
    st.step = 2;
    st.optimizer_steps = t.strategy->optimizer_steps();
    st.world_size = a.world;
    st.extra = t.strategy->checkpoint_manifest();
    CheckpointWriter writer{rank, a.world, [&] { w.pg->barrier()->wait(); }};
    save_checkpoint(dir.string(), st, *t.strategy, testing::tiny_llama(), "", writer, 0);
    return 0;
  });
  expect_all_ok(exits);
  const std::string ck_dir = (dir / "checkpoints" / "step_2").string();
  ASSERT_TRUE(fs::exists(ck_dir));
  // Every expert is in the checkpoint, whichever rank held it.
  LoadedCheckpoint ck = load_checkpoint(ck_dir);
  for (int64_t l = 0; l < kLayers; ++l)
    for (int64_t e = 0; e < kExperts; ++e)
      EXPECT_TRUE(ck.params.count("layers." + std::to_string(l) + ".experts." + std::to_string(e) +
                                  ".weight"));
  const int port2 = pick_free_port();
  exits = run_ranks(b.world, [&](int rank) -> int {
    World w = make_world(rank, b.world, port2);
    ToyTrainee t = make_toy(b, w.pg);
    LoadedCheckpoint loaded = load_checkpoint(ck_dir);
    check_checkpoint_matches_run(loaded, *t.model, *t.strategy);
    restore_strategy_state(loaded, *t.strategy);
    for (int step = 2; step < a.steps; ++step) {
      const double loss = toy_step(b, t, step, w.pg.get(), nullptr);
      RANK_CHECK(testing::close_rel(loss, ref.losses[step], kRel),
                 "resumed %s -> %s step %d: loss %.9g, uninterrupted %.9g", toy_name(a).c_str(),
                 toy_name(b).c_str(), step + 1, loss, ref.losses[step]);
    }
    const std::string diff = compare_weights(t.strategy->full_state_dict(), ref.weights, kRel);
    RANK_CHECK(diff.empty(), "resumed final weights: %s", diff.c_str());
    return 0;
  });
  expect_all_ok(exits);
  fs::remove_all(dir);
}

TEST(ExpertParallelCheckpoint, SavedUnderEpResumedWithout) {
  ToyRun a;
  a.engine = "zero2";
  a.world = 4;
  a.ep = 2;
  ToyRun b;
  b.engine = "ddp";
  b.world = 2;
  b.ep = 0;  // plain DDP over the whole toy model
  save_and_resume(a, b);
}

TEST(ExpertParallelCheckpoint, SavedWithoutEpResumedUnderEp) {
  ToyRun a;
  a.engine = "fsdp";
  a.world = 2;
  a.ep = 0;
  ToyRun b;
  b.engine = "ddp";
  b.world = 4;
  b.ep = 4;
  save_and_resume(a, b);
}

TEST(ExpertParallelCheckpoint, SavedUnderEpResumedUnderAnotherEp) {
  ToyRun a;
  a.engine = "ddp";  // replicated parts: only the groups' rank 0 write their slices
  a.world = 4;
  a.ep = 4;
  ToyRun b;
  b.engine = "zero3";
  b.world = 4;
  b.ep = 2;
  save_and_resume(a, b);
}

}  // namespace
}  // namespace accel
