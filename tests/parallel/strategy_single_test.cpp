// The single process (distributed_type NO) is the shared engine at stage 0 over one rank, checked
// against ReferenceStrategy (tests/parallel/strategy_test_util.h), a per-parameter implementation
// that does not use the engine: the same losses, gradient norms and weights bit for bit, the same
// checkpoint keys and no manifest, and resuming a checkpoint the reference wrote (the layout
// SingleProcessStrategy wrote before the engine ran it).
#include <filesystem>

#include "runtime/config.h"
#include "tests/parallel/strategy_test_util.h"
#include "tools/trainer/checkpoint.h"

namespace accel {
namespace {

namespace fs = std::filesystem;
using namespace testing;

TEST(SingleProcess, IsTheEngineAtStageZeroWithoutCollectives) {
  Config cfg = default_config();
  std::unique_ptr<Strategy> s = make_strategy(cfg, nullptr, DType::BF16);
  EXPECT_EQ(s->name(), "single");
  auto* engine = dynamic_cast<FlatDataParallel*>(s.get());
  ASSERT_NE(engine, nullptr);
  EXPECT_EQ(engine->options().zero_stage, 0);
  EXPECT_FALSE(engine->options().flat_grads);
  EXPECT_FALSE(s->forward_is_collective());
  // Per-parameter gradients exist only where nothing is reduced.
  DataParallelOptions o;
  o.flat_grads = false;
  o.zero_stage = 1;
  EXPECT_THROW(FlatDataParallel(nullptr, o), std::logic_error);
}

TEST(SingleProcess, CheckpointKeysAndOrderAreTheReferences) {
  for (DType compute : {DType::F32, DType::BF16}) {
    RunSpec ref, single;
    ref.compute = single.compute = compute;
    single.strategy = "single";
    Trainee a = make_trainee(ref, nullptr, ref.seed);
    Trainee b = make_trainee(single, nullptr, single.seed);
    train_step(ref, a, 0, 0, nullptr);
    train_step(single, b, 0, 0, nullptr);
    EXPECT_TRUE(b.strategy->checkpoint_manifest().is_null());
    auto keys = [](const Weights& w) {
      std::vector<std::string> k;
      for (const auto& [name, t] : w) k.push_back(name + " " + shape_str(t.shape()));
      return k;
    };
    EXPECT_EQ(keys(b.strategy->full_state_dict()), keys(a.strategy->full_state_dict()));
    EXPECT_EQ(keys(b.strategy->optimizer_state()), keys(a.strategy->optimizer_state()));
    EXPECT_EQ(compare_weights(b.strategy->optimizer_state(), a.strategy->optimizer_state(), 0.0),
              "");
    for (const auto& [name, t] : b.strategy->full_state_dict()) EXPECT_EQ(t.dtype(), DType::F32);
    EXPECT_EQ(b.strategy->optimizer_steps(), 1);
  }
}

struct Variant {
  const char* what;
  RunSpec spec;
};

std::vector<Variant> variants() {
  std::vector<Variant> out;
  RunSpec s;
  out.push_back({"fp32", s});
  s.compute = DType::BF16;
  s.accum = 2;
  out.push_back({"bf16, two micro-batches", s});
  s = RunSpec{};
  s.compute = DType::F16;
  out.push_back({"fp16", s});
  s = RunSpec{};
  s.optimizer = OptimizerName::Sgd;
  s.tied_embeddings = true;
  out.push_back({"sgd, tied embeddings", s});
  s = RunSpec{};
  s.layers = 3;
  s.activation_checkpointing = ActivationCheckpointing::Full;
  s.clip = 0.0;
  out.push_back({"activation checkpointing, no clipping", s});
  return out;
}

TEST(SingleProcess, TrainsBitForBitLikeTheReference) {
  for (const Variant& v : variants()) {
    RunSpec single = v.spec;
    single.strategy = "single";
    const RunResult want = run_training(v.spec, nullptr, 0, v.spec.seed);
    const RunResult got = run_training(single, nullptr, 0, single.seed);
    EXPECT_EQ(got.losses, want.losses) << v.what;
    EXPECT_EQ(got.grad_norms, want.grad_norms) << v.what;
    EXPECT_EQ(compare_weights(got.final_weights, want.final_weights, 0.0), "") << v.what;
    EXPECT_LT(want.losses.back(), want.losses.front()) << v.what;
  }
}

// A parameter that takes no part in the loss has no gradient: the single process leaves it
// alone (no weight decay, no error), as the reference does; DDP would stop and name it.
class TwoParams : public Module {
 public:
  TwoParams() : a(register_parameter("a", leaf(0.5))), b(register_parameter("b", leaf(1.0))) {
    finalize();
  }
  static Tensor leaf(double v) {
    Tensor t = Tensor::full({4}, v);
    t.set_requires_grad(true);
    return t;
  }
  std::string type_name() const override { return "TwoParams"; }
  Parameter& a;
  Parameter& b;
};

TEST(SingleProcess, SkipsAParameterWithoutGradient) {
  for (const char* kind : {"reference", "single"}) {
    TwoParams m;
    RunSpec s;
    s.strategy = kind;
    auto strategy = make_test_strategy(s, nullptr);
    strategy->setup(m, test_optimizer());
    strategy->begin_micro_batch(true);
    sum(mul(m.a.value, m.a.value)).backward();
    strategy->end_micro_batch();
    StepResult r = strategy->step(0.1, 0.0, 1.0);
    EXPECT_NEAR(r.grad_norm, 1.0 * std::sqrt(4.0), 1e-12) << kind;
    for (auto& [name, t] : strategy->full_state_dict())
      for (double x : t.to_vector())
        EXPECT_NEAR(x, name == "a" ? 0.5 * (1 - 0.1 * 0.1) - 0.1 : 1.0, 1e-6)
            << kind << " " << name;
  }
}

// The reference writes what SingleProcessStrategy wrote before the engine ran it; the engine's
// single process resumes from it (into a model initialized differently) and continues exactly as
// the reference does. The reverse direction holds as well.
TEST(SingleProcess, ResumesCheckpointsOfTheOldLayoutExactly) {
  for (DType compute : {DType::F32, DType::BF16}) {
    for (bool from_reference : {true, false}) {
      RunSpec writer_spec, reader_spec;
      writer_spec.compute = reader_spec.compute = compute;
      (from_reference ? reader_spec : writer_spec).strategy = "single";
      const fs::path dir =
          fs::temp_directory_path() / ("accel_single_resume_" + std::to_string(getpid()) + "_" +
                                       dtype_name(compute) + (from_reference ? "_ref" : "_single"));
      fs::remove_all(dir);
      Trainee w = make_trainee(writer_spec, nullptr, writer_spec.seed);
      std::vector<double> losses;
      for (int step = 0; step < writer_spec.steps; ++step) {
        losses.push_back(train_step(writer_spec, w, step, 0, nullptr));
        if (step + 1 == 5) {
          TrainerState st;
          st.step = 5;
          st.optimizer_steps = w.strategy->optimizer_steps();
          st.world_size = 1;
          st.extra = w.strategy->checkpoint_manifest();
          CheckpointWriter writer{0, 1, nullptr};
          save_checkpoint(dir.string(), st, *w.strategy, w.model->config, "", writer, 0);
        }
      }
      Trainee r = make_trainee(reader_spec, nullptr, 1000);
      const std::string ckpt = (dir / "checkpoints" / "step_5").string();
      LoadedCheckpoint ck = load_checkpoint(ckpt);
      EXPECT_TRUE(ck.state.extra.is_null());
      restore_strategy_state(ck, *r.strategy);
      for (int step = 5; step < reader_spec.steps; ++step)
        EXPECT_EQ(train_step(reader_spec, r, step, 0, nullptr), losses[step])
            << dtype_name(compute) << (from_reference ? " reference -> single" : " single -> ref")
            << ", resumed step " << step + 1;
      EXPECT_EQ(compare_weights(full_weights(*r.strategy), full_weights(*w.strategy), 0.0), "")
          << dtype_name(compute);
      fs::remove_all(dir);
    }
  }
}

}  // namespace
}  // namespace accel
