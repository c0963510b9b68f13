// cuDNN's fused flash attention (forward and backward) through the backend graph API.
//
// cuDNN has no "attention" call: it recognises the scaled-dot-product pattern in an operation
// graph (matmul, scale, causal mask and sliding window, softmax with saved statistics, matmul)
// and runs it as one fused kernel. The graphs below spell that pattern out with the same
// operations, data types and layouts that cuDNN's own frontend library builds for its SDPA node
// (which these machines do not have). Documents packed in a row (segment_ids) are declined. Built
// graphs and their execution plans are cached per problem (shape, dtype, mask, scale).
//
// Layouts: our q/out are [B, S, Hq, D] and k/v [B, S, Hkv, D]; cuDNN sees them as [B, H, S, D]
// with strides, K (and V in backward) as the transposed [B, H, D, S] views. lse [B, Hq, S] is
// cuDNN's "stats" tensor (natural-log log-sum-exp of the scaled scores), the same quantity our own
// kernels save, so a forward of one implementation pairs with a backward of the other.
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "ops/cuda/attention.cuh"
#include "runtime/cuda/context.h"

namespace accel::cuda {
namespace {

void check(cudnnStatus_t s, const char* call, const char* file, int line) {
  if (s == CUDNN_STATUS_SUCCESS) return;
  char detail[512] = {0};
  cudnnGetLastErrorString(detail, sizeof(detail));
  throw std::runtime_error(std::string(call) + " failed at " + file + ":" + std::to_string(line) +
                           ": " + cudnnGetErrorString(s) +
                           (detail[0] ? std::string(" (") + detail + ")" : ""));
}
#define ACCEL_CUDNN_CHECK(expr) check((expr), #expr, __FILE__, __LINE__)

// One backend descriptor, destroyed with the object.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type) {
    ACCEL_CUDNN_CHECK(cudnnBackendCreateDescriptor(type, &d_));
  }
  ~Desc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  template <class T>
  Desc& set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T* values,
            int64_t count = 1) {
    ACCEL_CUDNN_CHECK(cudnnBackendSetAttribute(d_, name, type, count, values));
    return *this;
  }
  Desc& set_desc(cudnnBackendAttributeName_t name, cudnnBackendDescriptor_t value) {
    return set(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &value);
  }
  void finalize() { ACCEL_CUDNN_CHECK(cudnnBackendFinalize(d_)); }
  // For plans: a finalize that may fail (an engine configuration that does not apply).
  bool try_finalize() { return cudnnBackendFinalize(d_) == CUDNN_STATUS_SUCCESS; }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

// Builds an operation graph: tensors (by unique id) and operations, kept alive together.
class GraphBuilder {
 public:
  // A tensor of the graph. Virtual tensors live only inside the fused kernel; by-value tensors are
  // host scalars passed at execution.
  cudnnBackendDescriptor_t tensor(cudnnDataType_t dtype, const Dims& dims, const Dims& strides,
                                  bool is_virtual, int64_t uid = 0, bool by_value = false) {
    auto t = std::make_unique<Desc>(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t id = uid ? uid : next_virtual_uid_++;
    const int64_t alignment = 16;
    t->set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &dtype)
        .set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims.data(), 4)
        .set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides.data(), 4)
        .set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &id)
        .set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &alignment)
        .set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &is_virtual);
    if (by_value) t->set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &by_value);
    t->finalize();
    return keep(std::move(t));
  }
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    const Dims one{1, 1, 1, 1};
    return tensor(CUDNN_DATA_FLOAT, one, one, false, uid, true);
  }
  cudnnBackendDescriptor_t temp(const Dims& dims, const Dims& strides,
                                cudnnDataType_t dtype = CUDNN_DATA_FLOAT) {
    return tensor(dtype, dims, strides, true);
  }

  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    auto desc = std::make_unique<Desc>(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    desc->set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &compute).finalize();
    auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)
        .set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, desc->get())
        .finalize();
    keep(std::move(desc));
    add_op(std::move(op));
  }

  // y = mode(x[, b[, t]]); `t` is the condition of BINARY_SELECT (y = t ? x : b).
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
                 cudnnBackendDescriptor_t b = nullptr, cudnnBackendDescriptor_t t = nullptr,
                 cudnnDataType_t precision = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    auto desc = std::make_unique<Desc>(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    desc->set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &mode)
        .set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &precision);
    if (axis >= 0) desc->set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, &axis);
    desc->finalize();
    auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, desc->get())
        .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x)
        .set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    if (b) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t) op->set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    op->finalize();
    keep(std::move(desc));
    add_op(std::move(op));
  }

  void reduction(cudnnReduceTensorOp_t reduce, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t y) {
    auto desc = std::make_unique<Desc>(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t compute = CUDNN_DATA_FLOAT;
    desc->set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &reduce)
        .set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &compute)
        .finalize();
    auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)
        .set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, desc->get())
        .finalize();
    keep(std::move(desc));
    add_op(std::move(op));
  }

  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    auto op = std::make_unique<Desc>(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    op->set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x)
        .set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y)
        .finalize();
    add_op(std::move(op));
  }

  // Top-left causal mask: scores above the diagonal become -huge (row >= col is kept).
  cudnnBackendDescriptor_t causal_mask(cudnnBackendDescriptor_t s, const Dims& dims,
                                       const Dims& strides, int64_t neg_inf_uid) {
    auto row = temp(dims, strides, CUDNN_DATA_INT32);
    auto col = temp(dims, strides, CUDNN_DATA_INT32);
    auto keep_mask = temp(dims, strides, CUDNN_DATA_BOOLEAN);
    auto masked = temp(dims, strides);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, row, nullptr, nullptr, CUDNN_DATA_INT32, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, col, nullptr, nullptr, CUDNN_DATA_INT32, 3);
    pointwise(CUDNN_POINTWISE_CMP_GE, row, keep_mask, col, nullptr, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, masked, scalar(neg_inf_uid), keep_mask);
    return masked;
  }

  // Hugging Face's sliding window on top of the causal mask: scores with col + window <= row
  // become -huge (col + window > row is kept), the pattern cuDNN's frontend builds for a left
  // bound ("diagonal band") with a top-left diagonal: the window is a by-value float scalar.
  cudnnBackendDescriptor_t window_mask(cudnnBackendDescriptor_t s, const Dims& dims,
                                       const Dims& strides, int64_t window_uid,
                                       int64_t neg_inf_uid) {
    auto row = temp(dims, strides, CUDNN_DATA_INT32);
    auto col = temp(dims, strides, CUDNN_DATA_INT32);
    auto col_plus_window = temp(dims, strides);
    auto keep_mask = temp(dims, strides, CUDNN_DATA_BOOLEAN);
    auto masked = temp(dims, strides);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, row, nullptr, nullptr, CUDNN_DATA_INT32, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, s, col, nullptr, nullptr, CUDNN_DATA_INT32, 3);
    pointwise(CUDNN_POINTWISE_ADD, col, col_plus_window, scalar(window_uid), nullptr,
              CUDNN_DATA_FLOAT, 3);
    pointwise(CUDNN_POINTWISE_CMP_GT, col_plus_window, keep_mask, row, nullptr, CUDNN_DATA_BOOLEAN);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, masked, scalar(neg_inf_uid), keep_mask);
    return masked;
  }

  // The finalized operation graph on `handle`.
  std::unique_ptr<Desc> finish(cudnnHandle_t handle) {
    std::vector<cudnnBackendDescriptor_t> ops;
    for (auto& op : ops_) ops.push_back(op->get());
    auto graph = std::make_unique<Desc>(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph->set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &handle)
        .set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops.data(),
             static_cast<int64_t>(ops.size()))
        .finalize();
    return graph;
  }

 private:
  cudnnBackendDescriptor_t keep(std::unique_ptr<Desc> d) {
    kept_.push_back(std::move(d));
    return kept_.back()->get();
  }
  void add_op(std::unique_ptr<Desc> op) { ops_.push_back(std::move(op)); }

  std::vector<std::unique_ptr<Desc>> kept_, ops_;
  int64_t next_virtual_uid_ = 1000;
};

// Unique ids of the tensors the caller supplies at execution.
enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kNegInf,
  kDO,
  kDQ,
  kDK,
  kDV,
  kOne,
  kSoftmaxSum,  // backward workspace: rowsum(dO * O), fp32 [B, Hq, S, 1]
  kDQAccum,     // backward workspace: fp32 dQ accumulator [B, Hq, S, D]
  kWindow,      // the sliding window (float scalar)
  kNegInfWindow,
};

// [B, H, S, D] view of a contiguous [B, S, H, D] tensor, and its transpose [B, H, D, S].
Dims bshd_strides(int64_t s, int64_t h, int64_t d) { return {s * h * d, d, h * d, 1}; }
Dims bshd_strides_t(int64_t s, int64_t h, int64_t d) { return {s * h * d, d, 1, h * d}; }

cudnnDataType_t cudnn_dtype(DType t) {
  return t == DType::BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
}

// A graph with a finalized execution plan.
struct Plan {
  std::unique_ptr<GraphBuilder> builder;
  std::unique_ptr<Desc> graph;
  std::vector<std::unique_ptr<Desc>> configs;
  std::unique_ptr<Desc> plan;
  int64_t workspace = 0;
  bool supported = false;
  std::string why_not;  // when not supported
};

// Picks the first engine configuration cuDNN's heuristic offers that finalizes into a plan.
void make_plan(Plan& p, cudnnHandle_t handle) {
  p.graph = p.builder->finish(handle);
  Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
  const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
  heur.set_desc(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, p.graph->get())
      .set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode)
      .finalize();
  int64_t count = 0;
  ACCEL_CUDNN_CHECK(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                             CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr));
  if (count <= 0) {
    p.why_not = "cuDNN's heuristic offers no engine for this attention graph";
    return;
  }
  std::vector<cudnnBackendDescriptor_t> raw;
  for (int64_t i = 0; i < count; ++i) {
    p.configs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
    raw.push_back(p.configs.back()->get());
  }
  int64_t returned = 0;
  ACCEL_CUDNN_CHECK(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                             CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &returned,
                                             raw.data()));
  for (int64_t i = 0; i < returned; ++i) {
    auto plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
    plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &handle)
        .set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[i]);
    if (!plan->try_finalize()) continue;
    int64_t n = 0;
    ACCEL_CUDNN_CHECK(cudnnBackendGetAttribute(plan->get(),
                                               CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                               CUDNN_TYPE_INT64, 1, &n, &p.workspace));
    p.plan = std::move(plan);
    p.supported = true;
    return;
  }
  p.why_not = "none of the " + std::to_string(returned) +
              " engine configurations cuDNN offers for this attention graph finalizes";
}

// Dimensions and layouts both graphs use, and their shared start.
struct AttnGraph {
  GraphBuilder& g;
  cudnnDataType_t io;
  int64_t b, hq, hk, s, d;
  Dims scores, scores_st, row, row_st;

  AttnGraph(GraphBuilder& builder, const AttnParams& a, DType dtype)
      : g(builder),
        io(cudnn_dtype(dtype)),
        b(a.b),
        hq(a.hq),
        hk(a.hkv),
        s(a.sq),
        d(a.d),
        scores{b, hq, s, s},
        scores_st{hq * s * s, s * s, s, 1},
        row{b, hq, s, 1},
        row_st{hq * s, s, 1, 1} {}

  // q, out and their gradients; k/v and their gradients; k/v as [B, H, D, S]; the lse.
  cudnnBackendDescriptor_t q_like(int64_t uid) {
    return g.tensor(io, {b, hq, s, d}, bshd_strides(s, hq, d), false, uid);
  }
  cudnnBackendDescriptor_t kv_like(int64_t uid) {
    return g.tensor(io, {b, hk, s, d}, bshd_strides(s, hk, d), false, uid);
  }
  cudnnBackendDescriptor_t kv_transposed(int64_t uid) {
    return g.tensor(io, {b, hk, d, s}, bshd_strides_t(s, hk, d), false, uid);
  }
  cudnnBackendDescriptor_t stats() {
    return g.tensor(CUDNN_DATA_FLOAT, row, row_st, false, kStats);
  }
  cudnnBackendDescriptor_t score_temp(cudnnDataType_t dtype = CUDNN_DATA_FLOAT) {
    return g.temp(scores, scores_st, dtype);
  }
  cudnnBackendDescriptor_t row_temp() { return g.temp(row, row_st); }

  // scale * Q K^T.
  cudnnBackendDescriptor_t scaled_scores(cudnnBackendDescriptor_t q, cudnnBackendDescriptor_t kt,
                                         cudnnBackendDescriptor_t scale) {
    auto qk = score_temp();
    g.matmul(q, kt, qk);
    auto scaled = score_temp();
    g.pointwise(CUDNN_POINTWISE_MUL, qk, scaled, scale);
    return scaled;
  }
  // The causal mask, and the sliding window's on top where there is one.
  cudnnBackendDescriptor_t masked(cudnnBackendDescriptor_t x, const AttnParams& a) {
    if (!a.causal) return x;
    auto causal = g.causal_mask(x, scores, scores_st, kNegInf);
    return a.window > 0 ? g.window_mask(causal, scores, scores_st, kWindow, kNegInfWindow) : causal;
  }
};

std::unique_ptr<Plan> build_forward(const AttnParams& a, DType dtype, cudnnHandle_t handle) {
  auto p = std::make_unique<Plan>();
  p->builder = std::make_unique<GraphBuilder>();
  GraphBuilder& g = *p->builder;
  AttnGraph t(g, a, dtype);
  auto q = t.q_like(kQ), kt = t.kv_transposed(kK), v = t.kv_like(kV), o = t.q_like(kO);
  auto stats = t.stats();

  auto logits = t.masked(t.scaled_scores(q, kt, g.scalar(kScale)), a);
  // Softmax with saved statistics: stats = max + log(sum(exp(x - max))).
  auto row_max = t.row_temp();
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, logits, row_max);
  auto shifted = t.score_temp();
  g.pointwise(CUDNN_POINTWISE_SUB, logits, shifted, row_max);
  auto e = t.score_temp();
  g.pointwise(CUDNN_POINTWISE_EXP, shifted, e);
  auto row_sum = t.row_temp();
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, row_sum);
  auto log_sum = t.row_temp();
  g.pointwise(CUDNN_POINTWISE_LOG, row_sum, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, row_max, stats, log_sum);
  auto probs = t.score_temp(t.io);  // P is rounded to the input dtype for P V
  g.pointwise(CUDNN_POINTWISE_DIV, e, probs, row_sum);
  g.matmul(probs, v, o);
  make_plan(*p, handle);
  return p;
}

std::unique_ptr<Plan> build_backward(const AttnParams& a, DType dtype, cudnnHandle_t handle) {
  auto p = std::make_unique<Plan>();
  p->builder = std::make_unique<GraphBuilder>();
  GraphBuilder& g = *p->builder;
  AttnGraph t(g, a, dtype);
  const int64_t b = t.b, hq = t.hq, hk = t.hk, s = t.s, d = t.d;
  const Dims scores_t_st{hq * s * s, s * s, 1, s};  // the transposed [B, H, Sk, Sq] view
  auto q = t.q_like(kQ), kt = t.kv_transposed(kK), vt = t.kv_transposed(kV), o = t.q_like(kO);
  auto d_o = t.q_like(kDO), stats = t.stats();
  auto dq = t.q_like(kDQ), dk = t.kv_like(kDK), dv = t.kv_like(kDV);
  auto scale = g.scalar(kScale);

  // softmax_sum = rowsum(dO * O) (FlashAttention's delta), kept in the workspace.
  auto do_o = g.temp({b, hq, s, d}, {hq * s * d, s * d, hq * d, 1});
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, do_o, o);
  auto delta = t.row_temp();
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, delta);
  auto softmax_sum = g.tensor(CUDNN_DATA_FLOAT, t.row, t.row_st, false, kSoftmaxSum);
  g.pointwise(CUDNN_POINTWISE_MUL, delta, softmax_sum, g.scalar(kOne));

  // P = exp(scale * Q K^T - stats), masked.
  auto shifted = t.score_temp();
  g.pointwise(CUDNN_POINTWISE_SUB, t.scaled_scores(q, kt, scale), shifted, stats);
  auto probs = t.score_temp();
  g.pointwise(CUDNN_POINTWISE_EXP, t.masked(shifted, a), probs);

  // dV = P^T dO (per q head, then summed over each KV head's group). The per-head partial sums are
  // in the input dtype: that is the pattern cuDNN knows (declared fp32, the graph still finalizes
  // but computes wrong gradients, measured on the H200 with cuDNN 9.14).
  auto probs_t = g.temp(t.scores, scores_t_st, t.io);
  g.reshape(probs, probs_t);
  const Dims kv_full{b, hq, s, d}, kv_full_st{hq * s * d, s * d, d, 1};
  auto per_group = [&](cudnnBackendDescriptor_t lhs, cudnnBackendDescriptor_t rhs,
                       cudnnBackendDescriptor_t out) {
    if (hq == hk) {
      g.matmul(lhs, rhs, out);
      return;
    }
    auto full = g.temp(kv_full, kv_full_st, t.io);
    g.matmul(lhs, rhs, full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
  };
  per_group(probs_t, d_o, dv);

  // dS = scale * P * (dO V^T - softmax_sum).
  auto dp = t.score_temp();
  g.matmul(d_o, vt, dp);
  auto dp_centered = t.score_temp();
  g.pointwise(CUDNN_POINTWISE_SUB, dp, dp_centered, softmax_sum);
  auto ds_unscaled = t.score_temp();
  g.pointwise(CUDNN_POINTWISE_MUL, dp_centered, ds_unscaled, probs);
  auto ds = t.score_temp();
  g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, ds, scale);

  // dK = dS^T Q.
  auto ds_t = g.temp(t.scores, scores_t_st, t.io);
  g.reshape(ds, ds_t);
  per_group(ds_t, q, dk);

  // dQ = dS K, accumulated in fp32 in the workspace, then converted.
  auto k_rows = g.temp({b, hk, s, d}, bshd_strides(s, hk, d));
  g.reshape(kt, k_rows);
  auto dq_accum = g.tensor(CUDNN_DATA_FLOAT, kv_full, kv_full_st, false, kDQAccum);
  g.matmul(ds, k_rows, dq_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, dq);
  make_plan(*p, handle);
  return p;
}

struct DeviceState {
  cudnnHandle_t handle = nullptr;
  std::map<std::tuple<bool, int64_t, int64_t, int64_t, int64_t, int, int, bool, int64_t, float>,
           std::unique_ptr<Plan>>
      plans;
};

std::mutex g_mu;
std::map<int, DeviceState*> g_states;  // leaked on purpose: handles outlive static tensors

DeviceState& state(int device) {
  auto it = g_states.find(device);
  if (it != g_states.end()) return *it->second;
  auto* st = new DeviceState();
  ACCEL_CUDNN_CHECK(cudnnCreate(&st->handle));
  g_states.emplace(device, st);
  return *st;
}

// The cached plan for a problem, built on first use. Null when cuDNN does not support it, with
// the reason in `why_not`.
const Plan* plan_for(bool backward, const AttnParams& a, DType dtype, std::string* why_not) {
  std::lock_guard<std::mutex> lock(g_mu);
  DeviceState& st = state(current_device());
  const auto key = std::make_tuple(backward, a.b, a.sq, a.hq, a.hkv, a.d, static_cast<int>(dtype),
                                   a.causal, a.window, a.scale);
  auto it = st.plans.find(key);
  if (it == st.plans.end()) {
    std::unique_ptr<Plan> plan;
    try {
      plan = backward ? build_backward(a, dtype, st.handle) : build_forward(a, dtype, st.handle);
    } catch (const std::runtime_error& e) {  // cuDNN refused a descriptor of the graph
      plan = std::make_unique<Plan>();
      plan->why_not = std::string("cuDNN refused the attention graph: ") + e.what();
    }
    it = st.plans.emplace(key, std::move(plan)).first;
  }
  if (!it->second->supported) {
    if (why_not) *why_not = it->second->why_not;
    return nullptr;
  }
  return it->second.get();
}

void execute(const Plan& plan, cudaStream_t stream, std::vector<int64_t> uids,
             std::vector<void*> pointers, void* workspace) {
  std::lock_guard<std::mutex> lock(g_mu);  // the handle's stream is set per call
  DeviceState& st = state(current_device());
  ACCEL_CUDNN_CHECK(cudnnSetStream(st.handle, stream));
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids.data(),
           static_cast<int64_t>(uids.size()))
      .set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, pointers.data(),
           static_cast<int64_t>(pointers.size()))
      .set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &workspace)
      .finalize();
  ACCEL_CUDNN_CHECK(cudnnBackendExecute(st.handle, plan.plan->get(), pack.get()));
}

size_t round_up(size_t n) { return (n + 255) / 256 * 256; }

// The by-value scalars of the masks in the graph (the host values must outlive the execution).
void add_mask_scalars(const AttnParams& p, std::vector<int64_t>& uids, std::vector<void*>& ptrs,
                      float* neg_inf, float* window) {
  if (!p.causal) return;
  uids.push_back(kNegInf);
  ptrs.push_back(neg_inf);
  if (p.window == 0) return;
  uids.push_back(kWindow);
  ptrs.push_back(window);
  uids.push_back(kNegInfWindow);
  ptrs.push_back(neg_inf);
}

// Empty when cuDNN can take the problem by its shape and dtype, else the reason it cannot.
std::string cudnn_attention_unsupported(const AttnParams& p, DType dtype) {
  if (dtype != DType::BF16 && dtype != DType::F16)
    return "cuDNN's fused attention needs bf16 or f16";
  if (p.d % 8 != 0 || p.d > 128)
    return "cuDNN's fused attention needs a head dim <= 128, a multiple of 8";
  if (p.sq != p.sk) return "cuDNN's fused attention runs here with as many keys as queries only";
  if (p.seg_lo != nullptr)
    return "cuDNN's fused attention takes no segment_ids (documents packed in a row) here";
  if (p.sq == 0 || p.b == 0) return "empty problem";
  return "";
}

}  // namespace

bool attention_forward_cudnn(const AttnParams& p, const Tensor& out, const Tensor& lse,
                             const Tensor& q, const Tensor& k, const Tensor& v, cudaStream_t stream,
                             std::string* why_not) {
  if (std::string no = cudnn_attention_unsupported(p, q.dtype()); !no.empty()) {
    if (why_not) *why_not = no;
    return false;
  }
  const Plan* plan = plan_for(false, p, q.dtype(), why_not);
  if (!plan) return false;
  float scale = p.scale, neg_inf = -3.4028234663852886e38f;  // finite: -inf - (-inf) is NaN
  DeviceBuffer workspace(std::max<size_t>(static_cast<size_t>(plan->workspace), 256));
  std::vector<int64_t> uids{kQ, kK, kV, kO, kStats, kScale};
  std::vector<void*> ptrs{q.data_ptr(),   k.data_ptr(),   v.data_ptr(),
                          out.data_ptr(), lse.data_ptr(), &scale};
  float window = static_cast<float>(p.window);
  add_mask_scalars(p, uids, ptrs, &neg_inf, &window);
  execute(*plan, stream, uids, ptrs, workspace.get());
  return true;
}

bool attention_backward_cudnn(const AttnParams& p, const Tensor& grad_q, const Tensor& grad_k,
                              const Tensor& grad_v, const Tensor& grad_out, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& out,
                              const Tensor& lse, cudaStream_t stream, std::string* why_not) {
  if (std::string no = cudnn_attention_unsupported(p, q.dtype()); !no.empty()) {
    if (why_not) *why_not = no;
    return false;
  }
  const Plan* plan = plan_for(true, p, q.dtype(), why_not);
  if (!plan) return false;
  float scale = p.scale, neg_inf = -3.4028234663852886e38f, one = 1.0f;
  const size_t plan_bytes = round_up(static_cast<size_t>(plan->workspace));
  const size_t sum_bytes = round_up(static_cast<size_t>(p.b * p.hq * p.sq) * sizeof(float));
  const size_t accum_bytes = static_cast<size_t>(p.b * p.hq * p.sq * p.d) * sizeof(float);
  DeviceBuffer workspace(plan_bytes + sum_bytes + accum_bytes);
  char* base = workspace.as<char>();
  std::vector<int64_t> uids{kQ,  kK,  kV,     kO,   kDO,         kStats,  kDQ,
                            kDK, kDV, kScale, kOne, kSoftmaxSum, kDQAccum};
  std::vector<void*> ptrs{q.data_ptr(),
                          k.data_ptr(),
                          v.data_ptr(),
                          out.data_ptr(),
                          grad_out.data_ptr(),
                          lse.data_ptr(),
                          grad_q.data_ptr(),
                          grad_k.data_ptr(),
                          grad_v.data_ptr(),
                          &scale,
                          &one,
                          base + plan_bytes,
                          base + plan_bytes + sum_bytes};
  float window = static_cast<float>(p.window);
  add_mask_scalars(p, uids, ptrs, &neg_inf, &window);
  execute(*plan, stream, uids, ptrs, base);
  return true;
}

}  // namespace accel::cuda
