// The autograd engine, views and modules: accumulation, hooks, no-grad, detach, checkpointing.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>

#include "models/decoder.h"
#include "ops/ops.h"
#include "ops/optimizer.h"

namespace accel {
namespace {

Tensor leaf(const std::vector<double>& v, const Shape& s) {
  Tensor t = Tensor::from_vector(v, s, DType::F64);
  t.set_requires_grad(true);
  return t;
}

TEST(Autograd, DiamondGraphSumsBothPaths) {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor y = mul(x, x);            // dy/dx = 2x
  Tensor z = add(y, mul(x, 3.0));  // + 3
  sum(z).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{5, 7, 9}));
}

// add's backward hands the same gradient tensor to both inputs, so the sums of a tensor used
// many times must never be accumulated into a gradient that another input still holds.
TEST(Autograd, ManyUsesSumWithoutWritingIntoSharedGradients) {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor a = mul(x, 2.0);
  Tensor y = add(add(add(a, a), a), mul(a, a));  // 3a + a^2
  Tensor z = add(y, x);                          // the seed's gradient is also passed on as is
  sum(z).backward();
  // dz/dx = (3 + 2a) * 2 + 1 = 8x + 7
  std::vector<double> g = x.grad().to_vector();
  EXPECT_EQ(g, (std::vector<double>{15, 23, 31}));
}

// A folding test op: out = 2a + b, recorded with record_folding on input `fold` (0 or 1). Its
// backward returns {2g, g} plus the pending gradient on the fold input, and logs what it got.
struct FoldLog {
  std::vector<std::vector<double>> pending;  // one entry per call; empty when none was pending
};
Tensor fold_op(const Tensor& a, const Tensor& b, int fold, FoldLog* log) {
  Tensor out;
  {
    NoGradGuard no_grad;
    out = add(mul(a, 2.0), b);
  }
  return record_folding(
      "fold_op", out, {a, b}, fold, [fold, log](const Tensor& g, const Tensor& pending) {
        log->pending.push_back(pending.defined() ? pending.to_vector() : std::vector<double>{});
        std::vector<Tensor> r{mul(g, 2.0), g};
        if (pending.defined()) r[fold] = add(r[fold], pending);
        return r;
      });
}

// The fold input's consumers that run before the folding node give it `pending`; later ones
// (here t_after, which runs after the node in topological order) still add.
TEST(Autograd, FoldingNodeGetsEarlierGradientsAndLaterOnesAdd) {
  Tensor x = leaf({1, 2, 3}, {3});
  Tensor a = mul(x, 1.0);
  Tensor t_after = mul(a, 5.0);
  Tensor c = Tensor::from_vector(std::vector<double>{0, 0, 0}, {3}, DType::F64);
  FoldLog log;
  // add(t_after, rest): t_after's node runs after fold_op's; rest's add gives `a` 1 before.
  Tensor rest = add(fold_op(a, c, 0, &log), a);
  sum(add(t_after, rest)).backward();
  ASSERT_EQ(log.pending.size(), 1u);
  EXPECT_EQ(log.pending[0], (std::vector<double>{1, 1, 1}));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{8, 8, 8}));  // 2 + 1 + 5

  // No earlier consumer: nothing pending; the later one adds.
  Tensor y = leaf({1, 2}, {2});
  Tensor b = mul(y, 1.0);
  FoldLog log2;
  Tensor cz = Tensor::from_vector(std::vector<double>{0, 0}, {2}, DType::F64);
  sum(add(mul(b, 3.0), fold_op(b, cz, 0, &log2))).backward();
  ASSERT_EQ(log2.pending.size(), 1u);
  EXPECT_TRUE(log2.pending[0].empty());
  EXPECT_EQ(y.grad().to_vector(), (std::vector<double>{5, 5}));
}

// The same tensor as both inputs (fold on either): the other input's gradient adds to the folded
// result, never replaced by it.
TEST(Autograd, FoldingNodeWithItsFoldInputTwice) {
  for (int fold : {0, 1}) {
    Tensor x = leaf({1, 2}, {2});
    Tensor a = mul(x, 1.0);
    FoldLog log;
    sum(add(fold_op(a, a, fold, &log), mul(a, 4.0))).backward();
    ASSERT_EQ(log.pending.size(), 1u);
    EXPECT_EQ(log.pending[0], (std::vector<double>{4, 4})) << "fold " << fold;
    EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{7, 7})) << "fold " << fold;  // 2+1+4
  }
}

// (i) add hands one tensor to both of its inputs; the folding node reads it as `pending` for one
// of them while the other still holds it (its node runs later): that one must stay as it was.
// (ii) A folded result returned for a second input too (aliased): a later contribution to the
// first input must not be accumulated into it in place.
TEST(Autograd, FoldingNeverWritesIntoSharedGradients) {
  {
    Tensor x = leaf({1, 2}, {2}), y = leaf({10, 20}, {2});
    Tensor a = mul(x, 1.0), b = mul(y, 1.0);
    Tensor cz = Tensor::from_vector(std::vector<double>{0, 0}, {2}, DType::F64);
    FoldLog log;
    // Nodes run: add(f, s), s (a and b get one tensor), fold_op, a, mul(b, 7), b.
    Tensor inner = add(fold_op(a, cz, 0, &log), add(a, b));
    sum(add(mul(b, 7.0), inner)).backward();
    ASSERT_EQ(log.pending.size(), 1u);
    EXPECT_EQ(log.pending[0], (std::vector<double>{1, 1}));
    EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{3, 3}));  // 2 + 1
    EXPECT_EQ(y.grad().to_vector(), (std::vector<double>{8, 8}));  // 1 + 7
  }
  {
    Tensor x = leaf({1, 2}, {2}), y = leaf({10, 20}, {2});
    Tensor a = mul(x, 1.0), b = mul(y, 1.0);
    Tensor t_after = mul(a, 3.0);
    FoldLog log;
    Tensor out;
    {
      NoGradGuard no_grad;
      out = add(a, b);
    }
    Tensor f = record_folding("aliasing_fold", out, {a, b}, 0,
                              [&log](const Tensor& g, const Tensor& pending) {
                                log.pending.push_back(pending.to_vector());
                                Tensor r = add(g, pending);
                                return std::vector<Tensor>{r, r};
                              });
    // Nodes run: add(f, mul(a, 1)), mul(a, 1) (a's pending), f (a and b get r), add(m7,
    // t_after), t_after (adds 3 to a), a, mul(b, 7) (adds 7 to b), b.
    Tensor add1 = add(mul(b, 7.0), t_after);
    sum(add(add1, add(f, mul(a, 1.0)))).backward();
    ASSERT_EQ(log.pending.size(), 1u);
    EXPECT_EQ(log.pending[0], (std::vector<double>{1, 1}));
    EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{5, 5}));  // (1 + 1) + 3
    EXPECT_EQ(y.grad().to_vector(), (std::vector<double>{9, 9}));  // (1 + 1) + 7
  }
}

// Pending is this pass's gradient only: leaves accumulate across backward calls and a retained
// graph folds again from scratch.
TEST(Autograd, FoldingAcrossBackwardCallsAndRetainedGraphs) {
  Tensor x = leaf({1, 2}, {2});
  Tensor c = Tensor::from_vector(std::vector<double>{0, 0}, {2}, DType::F64);
  FoldLog log;
  Tensor loss = sum(add(fold_op(x, c, 0, &log), x));  // x itself (a leaf) is the fold input
  loss.backward(Tensor(), /*retain_graph=*/true);
  loss.backward();
  Tensor loss2 = sum(add(fold_op(x, c, 0, &log), mul(x, 2.0)));
  loss2.backward();
  ASSERT_EQ(log.pending.size(), 3u);
  EXPECT_EQ(log.pending[1], (std::vector<double>{1, 1}));
  EXPECT_EQ(log.pending[2], (std::vector<double>{2, 2}));
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{3 + 3 + 4, 3 + 3 + 4}));
}

TEST(Autograd, GradientsAccumulateAcrossBackwardCalls) {
  Tensor x = leaf({1, 2}, {2});
  sum(mul(x, 2.0)).backward();
  sum(mul(x, 5.0)).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{7, 7}));
  x.zero_grad();
  EXPECT_FALSE(x.grad().defined());
}

// A leaf's first gradient is the backward's own result when nothing else holds its memory (no
// copy, counted as gradients from then on); when the backward also keeps that tensor, the leaf
// gets a copy, and a later accumulation leaves the kept tensor as it was.
TEST(Autograd, FirstGradientIsKeptWithoutACopyOnlyWhenNothingElseHoldsIt) {
  for (const bool kept_elsewhere : {false, true}) {
    SCOPED_TRACE(kept_elsewhere ? "kept elsewhere" : "sole owner");
    Tensor x = leaf({1, 2, 3}, {3});
    const void* returned = nullptr;
    Tensor stash;
    Tensor y = record("scale_by_3", mul(x.detach(), 3.0), {x}, [&](const Tensor& g) {
      Tensor r = mul(g, 3.0);
      returned = r.storage()->data;
      if (kept_elsewhere) stash = r;
      return std::vector<Tensor>{r};
    });
    const int64_t grads_before =
        memory_stats(Device::cpu()).current[static_cast<int>(MemCategory::Grads)];
    sum(y).backward();
    EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{3, 3, 3}));
    EXPECT_EQ(x.grad().storage()->data == returned, !kept_elsewhere);
    EXPECT_EQ(x.grad().storage()->category, MemCategory::Grads);
    EXPECT_EQ(memory_stats(Device::cpu()).current[static_cast<int>(MemCategory::Grads)],
              grads_before + 3 * 8);
    sum(mul(x, 2.0)).backward();  // accumulates in place
    EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{5, 5, 5}));
    if (kept_elsewhere) {
      EXPECT_EQ(stash.to_vector(), (std::vector<double>{3, 3, 3}));
    }
  }
}

// backward_with_seed: the gradients of root.backward(full(seed)); the root's own op (and only it,
// only in that pass) reads the seed as a number.
TEST(Autograd, ASeedGivenAsANumberIsVisibleToTheRootsOpOnly) {
  std::vector<std::optional<double>> seen_root, seen_inner;
  auto graph = [&](const Tensor& x) {
    Tensor inner = record("inner", mul(x.detach(), 2.0), {x}, [&](const Tensor& g) {
      seen_inner.push_back(backward_seed_value(g));
      return std::vector<Tensor>{mul(g, 2.0)};
    });
    return record("root", sum(inner.detach()), {inner}, [&, inner](const Tensor& g) {
      seen_root.push_back(backward_seed_value(g));
      return std::vector<Tensor>{mul(Tensor::ones(inner.shape(), inner.dtype()), g)};
    });
  };
  Tensor x = leaf({1, 2, 3}, {3});
  backward_with_seed(graph(x), 1.5);
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{3, 3, 3}));
  ASSERT_EQ(seen_root.size(), 1u);
  ASSERT_TRUE(seen_root[0].has_value());
  EXPECT_EQ(*seen_root[0], 1.5);
  ASSERT_EQ(seen_inner.size(), 1u);
  EXPECT_FALSE(seen_inner[0].has_value()) << "not the seed tensor";
  // A tensor seed, or no pass at all: nothing.
  Tensor y = leaf({1, 2, 3}, {3});
  graph(y).backward(Tensor::full({}, 1.5, DType::F64));
  EXPECT_EQ(y.grad().to_vector(), (std::vector<double>{3, 3, 3}));
  ASSERT_EQ(seen_root.size(), 2u);
  EXPECT_FALSE(seen_root[1].has_value());
  EXPECT_FALSE(backward_seed_value(Tensor::full({}, 1.5)).has_value());
  EXPECT_THROW(backward_with_seed(mul(x, 1.0), 1.0), std::invalid_argument);  // not one element
}

TEST(Autograd, NoGradGuardRecordsNothingAndDetachCutsHistory) {
  Tensor x = leaf({1, 2}, {2});
  {
    NoGradGuard g;
    Tensor y = mul(x, 2.0);
    EXPECT_FALSE(y.requires_grad());
  }
  Tensor d = x.detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_EQ(d.data_ptr(), x.data_ptr());  // same storage
  Tensor z = add(mul(d, 10.0), x);
  sum(z).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{1, 1}));
}

TEST(Autograd, SecondBackwardThroughFreedGraphIsAClearError) {
  Tensor x = leaf({1, 2}, {2});
  Tensor s = sum(mul(x, x));
  s.backward();
  try {
    s.backward();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("retain_graph"), std::string::npos) << e.what();
  }
  Tensor t = sum(mul(x, x));
  t.backward(Tensor(), /*retain_graph=*/true);
  t.backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{2 + 2 + 2, 4 + 4 + 4}));
}

TEST(Autograd, GradReadyHooksFireOnceInBackwardOrderWithFinalGradients) {
  Tensor a = leaf({1, 2}, {2}), b = leaf({3, 4}, {2});
  std::vector<std::string> order;
  std::vector<std::vector<double>> seen;
  a.set_name("a");
  b.set_name("b");
  for (const Tensor& t : {a, b})
    t.add_grad_ready_hook([&](const Tensor& p) {
      order.push_back(p.name());
      seen.push_back(p.grad().to_vector());
    });
  // b is used last in forward, so its gradient is ready first; a gets two contributions.
  Tensor h = mul(a, 2.0);
  Tensor out = add(mul(h, b), a);
  sum(out).backward();
  ASSERT_EQ(order, (std::vector<std::string>{"b", "a"}));
  EXPECT_EQ(seen[0], (std::vector<double>{2, 4}));  // d/db = 2a
  EXPECT_EQ(seen[1], (std::vector<double>{7, 9}));  // d/da = 2b + 1, complete
}

TEST(Autograd, CheckpointGivesTheSameGradientsAndRecomputes) {
  int calls = 0;
  auto block = [&](const std::vector<Tensor>& in) {
    ++calls;
    return tanh(mul(in[0], in[1]));
  };
  Tensor x1 = leaf({0.1, -0.2, 0.3}, {3}), w1 = leaf({0.5, 0.6, -0.7}, {3});
  sum(mul(block({x1, w1}), 3.0)).backward();
  Tensor x2 = leaf({0.1, -0.2, 0.3}, {3}), w2 = leaf({0.5, 0.6, -0.7}, {3});
  calls = 0;
  Tensor y = checkpoint(block, {x2, w2});
  EXPECT_EQ(calls, 1);
  sum(mul(y, 3.0)).backward();
  EXPECT_EQ(calls, 2);  // recomputed in backward
  EXPECT_EQ(x1.grad().to_vector(), x2.grad().to_vector());
  EXPECT_EQ(w1.grad().to_vector(), w2.grad().to_vector());
}

// An expensive op written as the real ones are (matmul, attention): its computation inside
// keep_output, its node recorded around the result. `computed` counts the computations.
Tensor counted_square(const Tensor& x, int& computed) {
  Tensor y = keep_output("counted_square", [&] {
    ++computed;
    NoGradGuard no_grad;
    return mul(x, x);
  });
  Tensor xd = x.detach();
  return record("counted_square", y, {x},
                [xd](const Tensor& g) { return std::vector<Tensor>{mul(mul(g, xd), 2.0)}; });
}

TEST(Autograd, SelectiveCheckpointRecomputesOnlyWhatItDoesNotKeep) {
  int expensive = 0, calls = 0;
  auto block = [&](const std::vector<Tensor>& in) {
    ++calls;
    return tanh(counted_square(exp(mul(in[0], in[1])), expensive));
  };
  Tensor x1 = leaf({0.1, -0.2, 0.3}, {3}), w1 = leaf({0.5, 0.6, -0.7}, {3});
  sum(mul(block({x1, w1}), 3.0)).backward();
  for (CheckpointMode mode : {CheckpointMode::Full, CheckpointMode::Selective}) {
    SCOPED_TRACE(mode == CheckpointMode::Full ? "full" : "selective");
    Tensor x2 = leaf({0.1, -0.2, 0.3}, {3}), w2 = leaf({0.5, 0.6, -0.7}, {3});
    calls = expensive = 0;
    Tensor y = checkpoint(block, {x2, w2}, mode);
    sum(mul(y, 3.0)).backward();
    EXPECT_EQ(calls, 2);  // the function runs again in backward
    // ... but the selective recomputation takes the kept product instead of computing it.
    EXPECT_EQ(expensive, mode == CheckpointMode::Full ? 2 : 1);
    EXPECT_EQ(x1.grad().to_vector(), x2.grad().to_vector());
    EXPECT_EQ(w1.grad().to_vector(), w2.grad().to_vector());
  }
}

TEST(Autograd, SelectiveCheckpointReplaysForEveryBackwardOfARetainedGraph) {
  int expensive = 0;
  auto block = [&](const std::vector<Tensor>& in) { return counted_square(exp(in[0]), expensive); };
  Tensor x = leaf({0.1, -0.2}, {2});
  Tensor loss = sum(checkpoint(block, {x}, CheckpointMode::Selective));
  loss.backward(Tensor(), /*retain_graph=*/true);
  const std::vector<double> once = x.grad().to_vector();
  loss.backward();
  EXPECT_EQ(expensive, 1);
  const std::vector<double> twice = x.grad().to_vector();
  for (size_t i = 0; i < once.size(); ++i) EXPECT_EQ(twice[i], 2 * once[i]);
}

TEST(Autograd, SelectiveRecomputationMustCallTheSameOps) {
  int expensive = 0, calls = 0;
  // Not deterministic: the recomputation multiplies where the forward squared.
  auto block = [&](const std::vector<Tensor>& in) {
    return ++calls == 1 ? counted_square(in[0], expensive)
                        : matmul(reshape(in[0], {1, 2}), reshape(in[0], {2, 1}));
  };
  Tensor x = leaf({0.1, -0.2}, {2});
  Tensor y = checkpoint(block, {x}, CheckpointMode::Selective);
  try {
    sum(y).backward();
    FAIL() << "a recomputation that calls other ops was accepted";
  } catch (const std::logic_error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("'matmul'"), std::string::npos) << m;
    EXPECT_NE(m.find("'counted_square'"), std::string::npos) << m;
  }
}

TEST(Views, ShareStorageAndGradientsFlowBack) {
  Tensor base = Tensor::from_vector(std::vector<double>{0, 1, 2, 3, 4, 5}, {2, 3}, DType::F64);
  Tensor t = transpose(base, 0, 1);
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_FALSE(t.is_contiguous());
  Tensor n = narrow(base, 1, 1, 2);
  n.fill_(9);
  EXPECT_EQ(base.to_vector(), (std::vector<double>{0, 9, 9, 3, 9, 9}));
  Tensor e = expand(Tensor::from_vector(std::vector<double>{1, 2}, {2, 1}, DType::F64), {2, 4});
  EXPECT_EQ(e.strides()[1], 0);
  EXPECT_EQ(contiguous(e).to_vector(), (std::vector<double>{1, 1, 1, 1, 2, 2, 2, 2}));

  Tensor x = leaf({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor y = mul(permute(reshape(x, {3, 2}), {1, 0}), 2.0);
  sum(narrow(y, 1, 0, 2)).backward();
  EXPECT_EQ(x.grad().to_vector(), (std::vector<double>{2, 2, 2, 2, 0, 0}));
  EXPECT_THROW(view(transpose(x, 0, 1), {6}), std::invalid_argument);
}

TEST(Views, CastRoundsToNearestEven) {
  // 1 + 2^-8 lies exactly between two bf16 values (1 and 1 + 2^-7): ties go to the even one.
  Tensor t = Tensor::from_vector(std::vector<double>{1.0 + 1.0 / 256, 1.0 + 3.0 / 256}, {2});
  EXPECT_EQ(cast(t, DType::BF16).to_vector(), (std::vector<double>{1.0, 1.0 + 4.0 / 256}));
}

TEST(Modules, ParameterNamesFollowHuggingFace) {
  DecoderConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 8;
  c.vocab_size = 11;
  CausalLM m(c, DType::F32, Device::cpu(), 0);
  std::vector<std::string> names;
  for (Parameter* p : m.parameters()) names.push_back(p->name);
  ASSERT_EQ(names.size(), 2u + 2 * 9 + 1);
  EXPECT_EQ(names.front(), "model.embed_tokens.weight");
  EXPECT_EQ(names[1], "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(names[5], "model.layers.0.mlp.gate_proj.weight");
  EXPECT_EQ(names[8], "model.layers.0.input_layernorm.weight");
  EXPECT_EQ(names[names.size() - 2], "model.norm.weight");
  EXPECT_EQ(names.back(), "lm_head.weight");
  EXPECT_EQ(m.config.num_parameters(), [&] {
    int64_t n = 0;
    for (Parameter* p : m.parameters()) n += p->value.numel();
    return n;
  }());
}

TEST(Schedules, WarmupThenDecay) {
  LRSchedule s{LrScheduleKind::Cosine, 1.0, 10, 110, 0.1};
  EXPECT_DOUBLE_EQ(s.at(0), 0.1);
  EXPECT_DOUBLE_EQ(s.at(9), 1.0);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);  // halfway down the cosine
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  LRSchedule lin{LrScheduleKind::Linear, 2.0, 0, 100, 0.0};
  EXPECT_DOUBLE_EQ(lin.at(50), 1.0);
  LRSchedule c{LrScheduleKind::Constant, 0.5, 5, 100, 0.1};
  EXPECT_DOUBLE_EQ(c.at(99), 0.5);
  EXPECT_DOUBLE_EQ(clip_coefficient(10.0, 1.0), 1.0 / (10.0 + 1e-6));
  EXPECT_DOUBLE_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(10.0, 0.0), 1.0);
}

}  // namespace
}  // namespace accel
