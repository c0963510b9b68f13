#include "runtime/data/loader.h"

#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "runtime/data/shard.h"
#include "tests/data/test_util.h"

namespace accel {
namespace {

using testing::error_of;
using testing::TempDir;

// Shards whose token at global position p is p % 60000, so every sample is recognizable by its
// first token (with seq_len 8, sample k of a shard starts at token 8k of that shard).
struct Corpus {
  TempDir dir;
  std::vector<std::string> files;
  std::vector<int64_t> offsets;  // global position of each shard's first token
  explicit Corpus(const std::vector<int64_t>& sizes) {
    int64_t pos = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      std::vector<uint32_t> t(static_cast<size_t>(sizes[i]));
      for (int64_t k = 0; k < sizes[i]; ++k) t[k] = static_cast<uint32_t>((pos + k) % 60000);
      files.push_back(dir.file("train-" + std::to_string(10000 + i) + ".tok"));
      write_token_shard(files.back(), t, 60000);
      offsets.push_back(pos);
      pos += sizes[i];
    }
  }
};

DataOptions options(const std::vector<std::string>& files, int64_t seq_len = 8, int64_t batch = 2) {
  DataOptions o;
  o.source = DataSource::Shards;
  o.files = files;
  o.seq_len = seq_len;
  o.micro_batch_size = batch;
  o.seed = 1234;
  return o;
}

std::vector<int64_t> row(const Tensor& t, int64_t b) {
  const int64_t s = t.size(1);
  const int64_t* p = t.data<int64_t>() + b * s;
  return std::vector<int64_t>(p, p + s);
}

// First tokens of the samples of `n` batches.
std::vector<int64_t> sample_ids(BatchSource& src, int n) {
  std::vector<int64_t> ids;
  for (int i = 0; i < n; ++i) {
    Batch b = src.next();
    for (int64_t r = 0; r < b.input_ids.size(0); ++r) ids.push_back(row(b.input_ids, r)[0]);
  }
  return ids;
}

TEST(Loader, BatchShapesAndShiftedLabels) {
  Corpus c({1001, 517});
  auto src = make_data_sources(options(c.files, 16, 3)).train;
  for (int i = 0; i < 10; ++i) {
    Batch b = src->next();
    ASSERT_EQ(b.input_ids.shape(), (Shape{3, 16}));
    ASSERT_EQ(b.labels.shape(), (Shape{3, 16}));
    EXPECT_EQ(b.input_ids.dtype(), DType::I64);
    EXPECT_EQ(b.labels.dtype(), DType::I64);
    for (int64_t r = 0; r < 3; ++r) {
      auto in = row(b.input_ids, r), lab = row(b.labels, r);
      EXPECT_EQ(in[0] % 16, c.offsets[in[0] >= c.offsets[1] ? 1 : 0] % 16) << "sample boundary";
      for (int t = 0; t < 16; ++t) {
        EXPECT_EQ(in[t], (in[0] + t) % 60000);
        EXPECT_EQ(lab[t], (in[0] + t + 1) % 60000) << "labels[t] is the token after input[t]";
      }
    }
  }
  // (1001 - 1) / 16 + (517 - 1) / 16 samples.
  EXPECT_EQ(src->position().num_samples, 62 + 32);
  EXPECT_EQ(src->vocab_size(), 60000);
  EXPECT_NE(src->describe().find("94 samples"), std::string::npos) << src->describe();
}

TEST(Loader, SamplesNeverSpanShards) {
  Corpus c({20, 20});  // seq_len 8: 2 samples per shard; the last 3 tokens of each are unused
  auto o = options(c.files, 8, 1);
  o.shuffle = false;
  auto src = make_data_sources(o).train;
  EXPECT_EQ(sample_ids(*src, 4), (std::vector<int64_t>{0, 8, 20, 28}));
}

TEST(Loader, RanksAreDisjointAndCoverTheEpoch) {
  Corpus c({8 * 37 + 1, 8 * 26 + 1});  // 63 samples
  const int64_t n = 63;
  for (int world = 1; world <= 4; ++world) {
    std::map<int64_t, int> seen;
    const int64_t per_rank = n / world;
    for (int rank = 0; rank < world; ++rank) {
      auto o = options(c.files, 8, 1);
      o.rank = rank;
      o.world_size = world;
      auto src = make_data_sources(o).train;
      EXPECT_EQ(src->batches_per_epoch(), per_rank);
      for (int64_t id : sample_ids(*src, static_cast<int>(per_rank))) seen[id]++;
      EXPECT_EQ(src->position().epoch, 0);
      EXPECT_EQ(src->position().samples_consumed, per_rank * world);
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), per_rank * world) << "world " << world;
    for (auto& [id, count] : seen) EXPECT_EQ(count, 1) << "sample " << id << " world " << world;
  }
}

TEST(Loader, EpochsWrapAndReshuffle) {
  Corpus c({8 * 50 + 1});
  auto src = make_data_sources(options(c.files, 8, 5)).train;
  auto e0 = sample_ids(*src, 10);
  auto e1 = sample_ids(*src, 10);
  EXPECT_EQ(src->position().epoch, 1);
  std::set<int64_t> s0(e0.begin(), e0.end()), s1(e1.begin(), e1.end());
  EXPECT_EQ(s0.size(), 50u);
  EXPECT_EQ(s0, s1) << "each epoch visits every sample once";
  EXPECT_NE(e0, e1) << "each epoch has its own order";
}

TEST(Loader, DeterministicFromSeed) {
  Corpus c({8 * 100 + 1});
  auto o = options(c.files, 8, 4);
  auto a = sample_ids(*make_data_sources(o).train, 20);
  auto b = sample_ids(*make_data_sources(o).train, 20);
  EXPECT_EQ(a, b);
  o.seed = 99;
  EXPECT_NE(a, sample_ids(*make_data_sources(o).train, 20));
  o.shuffle = false;
  auto in_order = sample_ids(*make_data_sources(o).train, 2);
  EXPECT_EQ(in_order, (std::vector<int64_t>{0, 8, 16, 24, 32, 40, 48, 56}));
}

TEST(Loader, ResumeEqualsUninterruptedStream) {
  Corpus c({8 * 30 + 1, 8 * 11 + 1});
  for (int world : {1, 3}) {
    for (int rank = 0; rank < world; ++rank) {
      auto o = options(c.files, 8, 4);
      o.rank = rank;
      o.world_size = world;
      auto full = sample_ids(*make_data_sources(o).train, 30);  // crosses epochs
      auto first = make_data_sources(o).train;
      auto head = sample_ids(*first, 13);
      nlohmann::json saved = first->position();  // what a checkpoint stores
      auto resumed = make_data_sources(o).train;
      resumed->restore(saved.get<DataPosition>());
      auto tail = sample_ids(*resumed, 17);
      head.insert(head.end(), tail.begin(), tail.end());
      EXPECT_EQ(head, full) << "world " << world << " rank " << rank;
    }
  }
}

TEST(Loader, ResumeUnderAnotherWorldSizeSkipsWhatWasSeen) {
  Corpus c({8 * 40 + 1});  // 40 samples
  std::set<int64_t> seen;
  DataPosition pos;
  for (int rank = 0; rank < 2; ++rank) {  // 2 ranks take 3 batches of 2: 12 samples
    auto o = options(c.files, 8, 2);
    o.rank = rank;
    o.world_size = 2;
    auto src = make_data_sources(o).train;
    for (int64_t id : sample_ids(*src, 3)) seen.insert(id);
    pos = src->position();
  }
  EXPECT_EQ(pos.samples_consumed, 12);
  std::set<int64_t> rest;
  for (int rank = 0; rank < 4; ++rank) {  // 4 ranks take the remaining 28 samples
    auto o = options(c.files, 8, 7);
    o.rank = rank;
    o.world_size = 4;
    auto src = make_data_sources(o).train;
    src->restore(pos);
    for (int64_t id : sample_ids(*src, 1)) {
      EXPECT_EQ(seen.count(id), 0u) << id;
      rest.insert(id);
    }
  }
  EXPECT_EQ(seen.size() + rest.size(), 40u);
}

TEST(Loader, PositionJson) {
  DataPosition p{3, 96, 1000, 18446744073709551615ull};
  nlohmann::json j = p;
  EXPECT_EQ(j.dump(),
            R"({"epoch":3,"num_samples":1000,"samples_consumed":96,"seed":18446744073709551615})");
  EXPECT_EQ(j.get<DataPosition>(), p);
  nlohmann::json missing = {{"epoch", 1}, {"num_samples", 4}, {"seed", 1}};
  EXPECT_NE(error_of([&] { missing.get<DataPosition>(); }).find("missing key 'samples_consumed'"),
            std::string::npos);
  nlohmann::json negative = j;
  negative["epoch"] = -1;
  EXPECT_NE(error_of([&] { negative.get<DataPosition>(); }).find("'epoch'"), std::string::npos);
  EXPECT_NE(error_of([&] { nlohmann::json(5).get<DataPosition>(); }).find("JSON object"),
            std::string::npos);
}

TEST(Loader, RestoreRefusesAPositionFromOtherData) {
  Corpus c({8 * 30 + 1});
  auto o = options(c.files);
  auto src = make_data_sources(o).train;
  DataPosition p = src->position();
  p.num_samples = 31;
  EXPECT_NE(error_of([&] {
              src->restore(p);
            }).find("saved for 31 samples per epoch but the data now has 30"),
            std::string::npos);
  p = src->position();
  p.seed = 7;
  EXPECT_NE(error_of([&] { src->restore(p); }).find("seed 7"), std::string::npos);
  p = src->position();
  p.samples_consumed = 31;
  EXPECT_NE(error_of([&] { src->restore(p); }).find("exceeds"), std::string::npos);
}

TEST(Loader, EvalFractionHoldsOutTheLastSamples) {
  Corpus c({8 * 100 + 1});
  auto o = options(c.files, 8, 5);
  o.eval_fraction = 0.1;
  auto d = make_data_sources(o);
  ASSERT_TRUE(d.eval);
  EXPECT_EQ(d.train->position().num_samples, 90);
  EXPECT_EQ(d.eval->position().num_samples, 10);
  EXPECT_EQ(d.eval->batches_per_epoch(), 2);
  auto eval_ids = sample_ids(*d.eval, 2);
  EXPECT_EQ(eval_ids, (std::vector<int64_t>{720, 728, 736, 744, 752, 760, 768, 776, 784, 792}));
  std::set<int64_t> train_ids;
  for (int64_t id : sample_ids(*d.train, 18)) train_ids.insert(id);
  EXPECT_EQ(train_ids.size(), 90u);
  EXPECT_LT(*train_ids.rbegin(), 720);
  // Without a fraction or eval files there is no eval source.
  EXPECT_FALSE(make_data_sources(options(c.files)).eval);
}

TEST(Loader, EvalFilesAndEvalSplitAcrossRanks) {
  Corpus train({8 * 20 + 1});
  Corpus eval({8 * 6 + 1});
  std::set<int64_t> ids;
  for (int rank = 0; rank < 2; ++rank) {
    auto o = options(train.files, 8, 3);
    o.eval_files = {eval.dir.path().string()};  // a folder: its *.tok files
    o.rank = rank;
    o.world_size = 2;
    auto d = make_data_sources(o);
    ASSERT_TRUE(d.eval);
    EXPECT_EQ(d.eval->batches_per_epoch(), 1);
    for (int64_t id : sample_ids(*d.eval, 1)) ids.insert(id);
  }
  EXPECT_EQ(ids, (std::set<int64_t>{0, 8, 16, 24, 32, 40}));
}

TEST(Loader, FoldersAndPatterns) {
  Corpus c({8 * 3 + 1, 8 * 4 + 1, 8 * 5 + 1});
  auto expected = c.files;
  EXPECT_EQ(expand_data_paths({c.dir.path().string()}, "data.files", ".tok"), expected);
  EXPECT_EQ(expand_data_paths({c.dir.file("train-*.tok")}, "data.files", ".tok"), expected);
  EXPECT_EQ(expand_data_paths({c.files[2], c.files[0]}, "data.files", ".tok"),
            (std::vector<std::string>{c.files[2], c.files[0]}));
  auto o = options({c.dir.file("train-1000[01].tok")});
  EXPECT_EQ(make_data_sources(o).train->position().num_samples, 7);
}

TEST(Loader, BadInputErrors) {
  Corpus c({8 * 3 + 1});
  auto o = options({c.dir.file("missing.tok")});
  EXPECT_NE(error_of([&] {
              make_data_sources(o);
            }).find("data.train_path: '" + c.dir.file("missing.tok") + "' does not exist"),
            std::string::npos);
  o = options({c.dir.file("*.bin")});
  EXPECT_NE(error_of([&] { make_data_sources(o); }).find("matches no file"), std::string::npos);
  o = options({});
  EXPECT_NE(error_of([&] { make_data_sources(o); }).find("data.train_path is empty"),
            std::string::npos);
  TempDir empty;
  o = options({empty.path().string()});
  EXPECT_NE(error_of([&] { make_data_sources(o); }).find("holds no *.tok files"),
            std::string::npos);

  // A corpus smaller than one sample.
  o = options(c.files, 64, 1);
  std::string err = error_of([&] { make_data_sources(o); });
  EXPECT_NE(err.find("smaller than one sample"), std::string::npos) << err;
  EXPECT_NE(err.find("25 tokens"), std::string::npos) << err;
  EXPECT_NE(err.find(c.files[0]), std::string::npos) << err;

  // Fewer samples than ranks.
  o = options(c.files, 8, 1);
  o.world_size = 4;
  o.rank = 3;
  EXPECT_NE(error_of([&] { make_data_sources(o); }).find("only 3 samples"), std::string::npos);

  // Tokens from a bigger vocabulary than the model's.
  o = options(c.files);
  o.vocab_size = 32000;
  err = error_of([&] { make_data_sources(o); });
  EXPECT_NE(err.find("vocab_size 60000"), std::string::npos) << err;
  EXPECT_NE(err.find("model's vocab_size 32000"), std::string::npos) << err;
  o.vocab_size = 60000;
  EXPECT_NO_THROW(make_data_sources(o));

  // Impossible options.
  o = options(c.files);
  o.seq_len = 0;
  EXPECT_THROW(make_data_sources(o), std::invalid_argument);
  o = options(c.files);
  o.rank = 1;
  EXPECT_THROW(make_data_sources(o), std::invalid_argument);
  o = options(c.files);
  o.eval_fraction = 1.0;
  EXPECT_THROW(make_data_sources(o), std::invalid_argument);
  o = options(c.files);
  o.eval_fraction = 0.5;  // 3 samples: 1 eval leaves 2 train, fine for one rank
  EXPECT_NO_THROW(make_data_sources(o));
  o.world_size = 2;  // but not for two (2 eval samples, 1 train)
  EXPECT_NE(error_of([&] { make_data_sources(o); }).find("too few to hold out"), std::string::npos);
}

TEST(Synthetic, SeededInRangeAndResumable) {
  DataOptions o;
  o.source = DataSource::Synthetic;
  o.seq_len = 64;
  o.micro_batch_size = 3;
  o.vocab_size = 1000;
  o.seed = 5;
  auto a = make_data_sources(o);
  EXPECT_FALSE(a.eval);
  EXPECT_EQ(a.train->batches_per_epoch(), -1);
  EXPECT_EQ(a.train->vocab_size(), 1000);
  std::vector<std::vector<int64_t>> rows;
  std::set<int64_t> distinct;
  for (int i = 0; i < 6; ++i) {
    Batch b = a.train->next();
    ASSERT_EQ(b.input_ids.shape(), (Shape{3, 64}));
    for (int64_t r = 0; r < 3; ++r) {
      auto in = row(b.input_ids, r), lab = row(b.labels, r);
      for (int t = 0; t < 64; ++t) {
        ASSERT_GE(in[t], 0);
        ASSERT_LT(in[t], 1000);
        ASSERT_LT(lab[t], 1000);
        if (t + 1 < 64) {
          ASSERT_EQ(lab[t], in[t + 1]);
        }
        distinct.insert(in[t]);
      }
      rows.push_back(in);
    }
  }
  EXPECT_GT(distinct.size(), 600u) << "roughly uniform over the vocabulary";
  // Same seed, same stream; resume from a saved position continues it.
  auto b = make_data_sources(o).train;
  b->next();
  b->next();
  nlohmann::json saved = b->position();
  auto c = make_data_sources(o).train;
  c->restore(saved.get<DataPosition>());
  EXPECT_EQ(row(c->next().input_ids, 0), rows[6]);
  // Another seed, another stream; ranks get different samples.
  o.seed = 6;
  EXPECT_NE(row(make_data_sources(o).train->next().input_ids, 0), rows[0]);
  o.seed = 5;
  o.world_size = 2;
  o.rank = 1;
  EXPECT_EQ(row(make_data_sources(o).train->next().input_ids, 0), rows[1]);
  o.vocab_size = 0;
  EXPECT_THROW(make_data_sources(o), std::invalid_argument);
}

}  // namespace
}  // namespace accel
