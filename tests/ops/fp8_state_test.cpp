// The fp8 delayed-scaling state as checkpoints hold it (models/fp8_linear.h): the file round trip
// restores every history, scale and the update count; states that do not fit the run are refused
// naming what differs; dynamic and MX scaling have none; the replication check over 2 CPU ranks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "models/decoder.h"
#include "models/fp8_linear.h"
#include "runtime/safetensors.h"
#include "tests/parallel/harness.h"

namespace accel {
namespace {

namespace fs = std::filesystem;

DecoderConfig tiny(int64_t layers = 2) {
  DecoderConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 16;
  c.vocab_size = 32;
  c.max_position_embeddings = 32;
  return c;
}

Fp8Config te(int64_t history = 4) {
  Fp8Config c;
  c.backend = Fp8Backend::TE;
  c.amax_history_len = history;
  c.amax_compute_algo = AmaxComputeAlgo::Max;
  c.interval = 2;
  return c;
}

Tensor batch(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int64_t> ids(2 * 8);
  for (int64_t& v : ids) v = static_cast<int64_t>(rng() % 32);
  return Tensor::from_vector(ids, {2, 8});
}

// Forward + backward + step_end (no optimizer: the weights stay put, the state moves).
void steps(CausalLM& m, Fp8Training& fp8, int n, uint64_t seed) {
  for (int i = 0; i < n; ++i) {
    Tensor ids = batch(seed + static_cast<uint64_t>(i));
    CausalLM::loss(m.forward(ids), ids).backward();
    fp8.step_end(static_cast<ProcessGroup*>(nullptr));
  }
}

std::string temp_file(const std::string& name) {
  return (fs::temp_directory_path() /
          ("accel_fp8_state_" + std::to_string(getpid()) + "_" + name + ".safetensors"))
      .string();
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no std::runtime_error";
  return "";
}

TEST(Fp8State, FileRoundTripRestoresHistoriesScalesAndUpdateCount) {
  CausalLM a(tiny(), DType::F32, Device::cpu(), 1);
  auto fa = apply_fp8(a, te(), Device::cpu());
  steps(a, *fa, 5, 10);
  const std::string path = temp_file("roundtrip");
  save_fp8_state(*fa, path);
  {
    SafetensorsReader f(path);
    // 2 layers x 7 linears + lm_head (untied) = 15 layers, 3 roles, 3 tensors.
    EXPECT_EQ(f.names().size(), 15u * 3u * 3u);
    EXPECT_EQ(f.info("model.layers.1.self_attn.o_proj.grad_output.amax_history").shape, Shape{4});
    EXPECT_EQ(f.info("lm_head.input.scale").shape, Shape{1});
    EXPECT_EQ(f.metadata().at("updates"), "5");
    EXPECT_EQ(f.metadata().at("fp8_format"), "HYBRID");
  }
  CausalLM b(tiny(), DType::F32, Device::cpu(), 1);
  auto fb = apply_fp8(b, te(), Device::cpu());
  EXPECT_EQ(load_fp8_state(*fb, path), "");
  fs::remove(path);
  Fp8DelayedScaling &da = *fa->delayed(), &db = *fb->delayed();
  EXPECT_EQ(db.amax_history().to_vector(), da.amax_history().to_vector());
  EXPECT_EQ(db.scales().to_vector(), da.scales().to_vector());
  EXPECT_EQ(db.scale_invs().to_vector(), da.scale_invs().to_vector());
  EXPECT_EQ(db.updates(), 5);
  // ... so both continue identically (step 6 recomputes with interval 2: updates 5 -> 6 does not,
  // 6 -> 7 does).
  steps(a, *fa, 2, 50);
  steps(b, *fb, 2, 50);
  EXPECT_EQ(db.scales().to_vector(), da.scales().to_vector());
  EXPECT_EQ(db.amax_history().to_vector(), da.amax_history().to_vector());
  // A fresh state differs: the round trip above is not vacuous.
  CausalLM c(tiny(), DType::F32, Device::cpu(), 1);
  auto fc = apply_fp8(c, te(), Device::cpu());
  EXPECT_NE(fc->delayed()->scales().to_vector(), da.scales().to_vector());
}

TEST(Fp8State, StateThatDoesNotFitIsRefusedSayingWhatDiffers) {
  CausalLM a(tiny(), DType::F32, Device::cpu(), 1);
  auto fa = apply_fp8(a, te(4), Device::cpu());
  steps(a, *fa, 2, 10);
  const Fp8CheckpointState st = fp8_checkpoint_state(*fa);

  CausalLM b(tiny(), DType::F32, Device::cpu(), 1);
  auto longer = apply_fp8(b, te(8), Device::cpu());
  std::string m = message_of([&] { fp8_load_checkpoint_state(*longer, st, "ck/fp8"); });
  EXPECT_NE(m.find("ck/fp8: "), std::string::npos) << m;
  EXPECT_NE(m.find("amax_history_len changed"), std::string::npos) << m;
  EXPECT_NE(m.find("holds 4 steps"), std::string::npos) << m;
  EXPECT_NE(m.find("this run's amax_history_len is 8"), std::string::npos) << m;

  Fp8Config e4m3 = te(4);
  e4m3.fp8_format = Fp8Format::E4M3;
  CausalLM c(tiny(), DType::F32, Device::cpu(), 1);
  auto fc = apply_fp8(c, e4m3, Device::cpu());
  m = message_of([&] { fp8_load_checkpoint_state(*fc, st, "ck"); });
  EXPECT_NE(m.find("fp8_format HYBRID, this run uses E4M3"), std::string::npos) << m;

  CausalLM deep(tiny(3), DType::F32, Device::cpu(), 1);
  auto fdeep = apply_fp8(deep, te(4), Device::cpu());
  m = message_of([&] { fp8_load_checkpoint_state(*fdeep, st, "ck"); });
  EXPECT_NE(m.find("7 fp8 layer(s) of this run have no saved state (model.layers.2."),
            std::string::npos)
      << m;

  CausalLM shallow(tiny(1), DType::F32, Device::cpu(), 1);
  auto fshallow = apply_fp8(shallow, te(4), Device::cpu());
  m = message_of([&] { fp8_load_checkpoint_state(*fshallow, st, "ck"); });
  EXPECT_NE(m.find("7 saved layer(s) are not fp8 layers of this run (model.layers.1."),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("model.init_from"), std::string::npos) << m;

  // A tensor missing, a wrong shape.
  Fp8CheckpointState cut = st;
  cut.tensors.erase(cut.tensors.begin() + 1);
  CausalLM d(tiny(), DType::F32, Device::cpu(), 1);
  auto fd = apply_fp8(d, te(4), Device::cpu());
  m = message_of([&] { fp8_load_checkpoint_state(*fd, cut, "ck"); });
  EXPECT_NE(m.find("is missing"), std::string::npos) << m;
  Fp8CheckpointState bad = st;
  bad.tensors[0].second = Tensor::zeros({5});
  m = message_of([&] { fp8_load_checkpoint_state(*fd, bad, "ck"); });
  EXPECT_NE(m.find("expected f32 [4]"), std::string::npos) << m;
}

TEST(Fp8State, ChangedMarginAlgorithmOrIntervalIsAcceptedWithANote) {
  CausalLM a(tiny(), DType::F32, Device::cpu(), 1);
  auto fa = apply_fp8(a, te(4), Device::cpu());
  steps(a, *fa, 2, 10);
  Fp8Config other = te(4);
  other.margin = 1;
  other.amax_compute_algo = AmaxComputeAlgo::MostRecent;
  CausalLM b(tiny(), DType::F32, Device::cpu(), 1);
  auto fb = apply_fp8(b, other, Device::cpu());
  std::string note = fp8_load_checkpoint_state(*fb, fp8_checkpoint_state(*fa), "ck");
  EXPECT_NE(note.find("amax_compute_algo changed from max to most_recent"), std::string::npos)
      << note;
  EXPECT_NE(note.find("margin changed from 0 to 1"), std::string::npos) << note;
  EXPECT_EQ(note.find("interval"), std::string::npos) << note;
  EXPECT_EQ(fb->delayed()->scales().to_vector(), fa->delayed()->scales().to_vector());
}

TEST(Fp8State, DynamicAndMxScalingHaveNoState) {
  CausalLM m(tiny(), DType::F32, Device::cpu(), 1);
  Fp8Config ao;
  ao.backend = Fp8Backend::AO;
  auto f = apply_fp8(m, ao, Device::cpu());
  EXPECT_FALSE(fp8_has_checkpoint_state(f.get()));
  EXPECT_TRUE(fp8_checkpoint_state(*f).tensors.empty());
  EXPECT_TRUE(fp8_checkpoint_state(*f).metadata.empty());
  EXPECT_THROW(save_fp8_state(*f, temp_file("ao")), std::logic_error);
  EXPECT_FALSE(fs::exists(temp_file("ao")));
  CausalLM m2(tiny(), DType::F32, Device::cpu(), 1);
  Fp8Config mx = te();
  mx.use_mxfp8_block_scaling = true;
  auto f2 = apply_fp8(m2, mx, Device::cpu());
  EXPECT_FALSE(fp8_has_checkpoint_state(f2.get()));
  EXPECT_FALSE(fp8_has_checkpoint_state(nullptr));
  CausalLM m3(tiny(), DType::F32, Device::cpu(), 1);
  auto f3 = apply_fp8(m3, te(), Device::cpu());
  EXPECT_TRUE(fp8_has_checkpoint_state(f3.get()));
  // The rowwise and blockwise recipes scale each tensor from its own amaxes: no state either.
  for (Fp8RecipeName name :
       {Fp8RecipeName::Rowwise, Fp8RecipeName::RowwiseWithGwHp, Fp8RecipeName::Blockwise}) {
    CausalLM m4(tiny(), DType::F32, Device::cpu(), 1);
    Fp8Config c = ao;
    c.recipe_name = name;
    auto f4 = apply_fp8(m4, c, Device::cpu());
    EXPECT_FALSE(fp8_has_checkpoint_state(f4.get())) << name_of(name);
    EXPECT_EQ(f4->delayed(), nullptr) << name_of(name);
    EXPECT_TRUE(fp8_checkpoint_state(*f4).tensors.empty()) << name_of(name);
    EXPECT_THROW(save_fp8_state(*f4, temp_file("rw")), std::logic_error) << name_of(name);
  }
}

extern "C" void omp_set_num_threads(int) __attribute__((weak));

// The premise of saving the state once: check_fp8_state_replicated passes when the ranks agree
// (after step_end's all-reduce) and throws on every rank, naming the slot, when they do not.
TEST(Fp8State, ReplicationCheckOverTwoRanks) {
  const int n = 2, port = testing::pick_free_port();
  auto exits = testing::run_ranks(n, [&](int rank) {
    if (omp_set_num_threads) omp_set_num_threads(1);
    testing::World w = testing::make_world(rank, n, port);
    CausalLM model(tiny(), DType::F32, Device::cpu(), 3);
    auto fp8 = apply_fp8(model, te(), Device::cpu());
    Tensor ids = batch(100 + static_cast<uint64_t>(rank));  // different data per rank
    CausalLM::loss(model.forward(ids), ids).backward();
    fp8->step_end(w.pg.get());
    check_fp8_state_replicated(*fp8, w.pg.get());  // the same after the all-reduce
    // Rank 1 skips the all-reduce once: the ranks' states now differ.
    CausalLM::loss(model.forward(ids), ids).backward();
    if (rank == 0)
      fp8->step_end(w.pg.get());
    else
      fp8->step_end([&](const Tensor& amaxes) {
        Tensor other = amaxes.clone();
        w.pg->all_reduce(other, ReduceOp::Max)->wait();  // keep the collectives paired
      });
    std::string what;
    try {
      check_fp8_state_replicated(*fp8, w.pg.get());
    } catch (const std::logic_error& e) {
      what = e.what();
    }
    RANK_CHECK(what.find("differs across data-parallel ranks") != std::string::npos, "got '%s'",
               what.c_str());
    RANK_CHECK(what.find("model.layers.") != std::string::npos, "got '%s'", what.c_str());
    return 0;
  });
  testing::expect_all_ok(exits);
}

}  // namespace
}  // namespace accel
