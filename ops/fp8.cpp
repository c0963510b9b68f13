// ops/fp8.h: argument checks, device dispatch, delayed-scaling bookkeeping and the fp8 linear op.
#include "ops/fp8.h"

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "ops/common.h"

namespace accel {
using detail::op_error;
using detail::row_block;

namespace {

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

bool is_fp8(DType t) { return t == DType::E4M3 || t == DType::E5M2; }
bool is_compute_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

void check_fp8_format(const char* op, DType fmt) {
  if (!is_fp8(fmt))
    op_error(op, std::string("target dtype must be e4m3 or e5m2, got ") + dtype_name(fmt));
}

void check_scalar_f32(const char* op, const Tensor& t, const char* what, Device dev) {
  if (!t.defined()) op_error(op, std::string(what) + " is undefined");
  if (t.dtype() != DType::F32 || t.numel() != 1)
    op_error(op, std::string(what) + " must be an f32 tensor of one element, got " + t.str());
  if (t.device() != dev)
    op_error(op, std::string(what) + " is on " + t.device().str() + ", the data on " + dev.str());
}

void check_cast_input(const char* op, const Tensor& x, const Fp8CastOptions& opts) {
  detail::check_defined(op, x, "input");
  if (x.dim() != 2) op_error(op, "input must be 2-d [rows, cols], got " + x.str());
  if (!is_compute_float(x.dtype()))
    op_error(op, std::string("input must be f32, bf16 or f16, got ") + dtype_name(x.dtype()));
  if (!opts.rowwise && !opts.columnwise)
    op_error(op, "nothing to produce: both rowwise and columnwise are off");
  if (opts.pad < 1) op_error(op, "pad must be at least 1, got " + std::to_string(opts.pad));
}

// Allocates the outputs of a cast of x [R, C].
Fp8Tensor make_fp8(const Tensor& x, DType fmt, const Fp8CastOptions& opts) {
  Fp8Tensor q;
  q.rows = x.size(0);
  q.cols = x.size(1);
  const int64_t rp = round_up(q.rows, opts.pad), cp = round_up(q.cols, opts.pad);
  if (opts.rowwise) q.data = Tensor::empty({rp, cp}, fmt, x.device());
  if (opts.columnwise) q.data_t = Tensor::empty({cp, rp}, fmt, x.device());
  q.scale_inv = Tensor::empty({1}, DType::F32, x.device());
  return q;
}

Tensor contiguous_raw(const Tensor& x) { return x.is_contiguous() ? x : x.clone(); }

// x [..., K] as the 2-d [rows, K] the GEMMs take, detached (a view when x is contiguous).
Tensor as_rows(const Tensor& x, int64_t K) {
  return x.is_contiguous() ? x.detach().as_strided({x.numel() / K, K}, {K, 1}, x.offset())
                           : reshape(x.detach(), {-1, K});
}

// A contiguous GEMM result viewed with `shape` (the same number of elements).
Tensor with_shape(const Tensor& t, const Shape& shape) {
  return t.as_strided(shape, contiguous_strides(shape), t.offset());
}

// The [rows, cols] corner of a padded 2-d result (a view when only rows were padded).
Tensor unpad(const Tensor& t, int64_t rows, int64_t cols) {
  if (t.size(1) == cols) return t.size(0) == rows ? t : narrow(t, 0, 0, rows);
  return contiguous(narrow(narrow(t, 0, 0, rows), 1, 0, cols));
}

// [M, N] in `dtype` = a [M_p, K_p] . b [N_p, K_p]^T from padded fp8 operands, plus `addend`
// ([M, N], contiguous, only read) where defined: inside the GEMM (summed in fp32, rounded once)
// when nothing is padded and it starts on 16 bytes (cuBLASLt's rule for every operand), else
// added after. Folds an input gradient into the one its input already has (dgrad), and a
// residual connection into the projection before it (the fused MLP's down projection).
Tensor fp8_gemm_add(const Tensor& a, const Tensor& a_si, const Tensor& b, const Tensor& b_si,
                    DType dtype, int64_t M, int64_t N, bool fast_accum, const Tensor& addend) {
  const bool fold = addend.defined() && a.size(0) == M && b.size(0) == N &&
                    reinterpret_cast<uintptr_t>(addend.data_ptr()) % 16 == 0;
  Tensor out = Tensor::empty({a.size(0), b.size(0)}, dtype, a.device());
  fp8_gemm(out, a, a_si, b, b_si, fast_accum, fold ? addend : Tensor());
  Tensor y = unpad(out, M, N);
  return addend.defined() && !fold ? add(y, addend) : y;
}

}  // namespace

// ---- recipe -----------------------------------------------------------------------------------

std::string Fp8Recipe::str() const {
  std::ostringstream o;
  switch (scaling) {
    case Fp8Scaling::Delayed:
      o << "delayed scaling (amax_history_len " << amax_history_len << ", amax_compute_algo "
        << (amax_algo == AmaxAlgo::Max ? "max" : "most_recent") << ", margin " << margin
        << ", interval " << interval << ")";
      break;
    case Fp8Scaling::Dynamic:
      o << "dynamic per-tensor scaling (scale from each tensor's current amax";
      if (margin) o << ", margin " << margin;
      o << ")";
      break;
    case Fp8Scaling::MxBlock:
      o << "MXFP8 block scaling, EMULATED (1x32 blocks, e8m0 scales; quantize-dequantize + bf16 "
           "GEMMs: MX numerics, no fp8 speed-up)";
      break;
    case Fp8Scaling::Rowwise:
      o << "dynamic rowwise scaling (one scale per row along each GEMM's contraction dimension"
        << (pow2_scales ? ", power-of-2 scales" : "")
        << (dgrad_weight_tensorwise ? "; the weight tensorwise in the dgrad GEMM" : "") << ")";
      break;
    case Fp8Scaling::Blockwise:
      o << "dynamic blockwise scaling (DeepSeek-V3: activations and gradients per 1x128 tile along "
           "each GEMM's contraction dimension, weights per 128x128 block"
        << (pow2_scales ? ", power-of-2 scales" : ", fp32 scales") << ")";
      break;
  }
  o << ", " << dtype_name(forward_dtype) << " forward / " << dtype_name(backward_dtype)
    << " gradients, GEMMs fprop " << (hp_fprop ? "high-precision" : "fp8") << " dgrad "
    << (hp_dgrad ? "high-precision" : "fp8") << " wgrad " << (hp_wgrad ? "high-precision" : "fp8");
  return o.str();
}

// ---- casts ------------------------------------------------------------------------------------

Fp8Tensor fp8_cast(const Tensor& x, DType fmt, const Tensor& scale, const Tensor& amax_accum,
                   const Fp8CastOptions& opts) {
  const char* op = "fp8_cast";
  check_cast_input(op, x, opts);
  check_fp8_format(op, fmt);
  check_scalar_f32(op, scale, "scale", x.device());
  if (amax_accum.defined()) check_scalar_f32(op, amax_accum, "amax", x.device());
  Tensor xc = contiguous_raw(x);
  Fp8Tensor q = make_fp8(xc, fmt, opts);
  q.scale = scale;
  backend_for(x.device()).fp8_cast(xc, scale, q.data, q.data_t, amax_accum, q.scale_inv);
  return q;
}

Fp8Tensor fp8_cast_dynamic(const Tensor& x, DType fmt, const Fp8CastOptions& opts, int margin) {
  const char* op = "fp8_cast_dynamic";
  check_cast_input(op, x, opts);
  check_fp8_format(op, fmt);
  Tensor xc = contiguous_raw(x);
  Fp8Tensor q = make_fp8(xc, fmt, opts);
  Tensor amax = Tensor::zeros({1}, DType::F32, x.device());
  q.scale = Tensor::empty({1}, DType::F32, x.device());
  backend_for(x.device()).fp8_amax(xc, amax);
  backend_for(x.device())
      .fp8_scale_from_amax(amax, q.scale, q.scale_inv, fp8_max_value(fmt), margin);
  backend_for(x.device()).fp8_cast(xc, q.scale, q.data, q.data_t, Tensor(), Tensor());
  return q;
}

Fp8Tensor fp8_with_transpose(const Fp8Tensor& q) {
  if (!q.data.defined()) op_error("fp8_with_transpose", "the fp8 tensor has no row-major data");
  if (q.data_t.defined()) return q;
  Fp8Tensor r = q;
  r.data_t = Tensor::empty({q.data.size(1), q.data.size(0)}, q.data.dtype(), q.data.device());
  backend_for(q.data.device()).fp8_transpose(r.data_t, q.data);
  return r;
}

Tensor fp8_dequantize(const Fp8Tensor& q, DType dtype) {
  const char* op = "fp8_dequantize";
  if (!q.data.defined() && !q.data_t.defined()) op_error(op, "the fp8 tensor holds no data");
  check_scalar_f32(op, q.scale_inv, "scale_inv", q.device());
  NoGradGuard no_grad;
  Tensor codes = q.data.defined() ? q.data : transpose(q.data_t, 0, 1);
  codes = narrow(narrow(codes, 0, 0, q.rows), 1, 0, q.cols);
  Tensor v = mul(cast(codes, DType::F32), q.scale_inv);
  return dtype == DType::F32 ? v : cast(v, dtype);
}

Tensor fp8_amax(const Tensor& x) {
  detail::check_defined("fp8_amax", x, "input");
  if (!is_compute_float(x.dtype()))
    op_error("fp8_amax",
             std::string("input must be f32, bf16 or f16, got ") + dtype_name(x.dtype()));
  Tensor out = Tensor::zeros({1}, DType::F32, x.device());
  backend_for(x.device()).fp8_amax(contiguous_raw(x), out);
  return out;
}

// ---- grouped casts ----------------------------------------------------------------------------

Fp8Tensor Fp8GroupedTensor::group(int64_t g) const {
  Fp8Tensor q;
  const auto i = static_cast<size_t>(g);
  q.rows = rows.at(i);
  q.cols = cols;
  const int64_t rp = rows_p[i], off = offsets[i];
  if (data.defined())
    q.data = data.as_strided({rp, cols_p}, {cols_p, 1}, data.offset() + off * cols_p);
  if (data_t.defined())
    q.data_t = data_t.as_strided({cols_p, rp}, {rp, 1}, data_t.offset() + cols_p * off);
  q.scale = scales.at(i);
  q.scale_inv = scale_inv.as_strided({1}, {1}, scale_inv.offset() + 4 * g);
  return q;
}

Fp8GroupedTensor fp8_cast_grouped(const std::vector<Tensor>& xs, DType fmt,
                                  const Fp8GroupScales& scaling, const Fp8CastOptions& opts) {
  const char* op = "fp8_cast_grouped";
  check_fp8_format(op, fmt);
  if (xs.empty()) op_error(op, "no groups");
  const size_t G = xs.size();
  const bool dynamic = scaling.scales.empty();
  if (!dynamic && scaling.scales.size() != G)
    op_error(
        op, std::to_string(scaling.scales.size()) + " scales for " + std::to_string(G) + " groups");
  if (!scaling.amaxes.empty() && (dynamic || scaling.amaxes.size() != G))
    op_error(op, std::to_string(scaling.amaxes.size()) + " amaxes for " + std::to_string(G) +
                     " groups" + (dynamic ? " under dynamic scaling (which records none)" : ""));
  for (size_t g = 0; g < G; ++g) {
    check_cast_input(op, xs[g], opts);
    if (xs[g].size(1) != xs[0].size(1) || xs[g].dtype() != xs[0].dtype())
      op_error(op, "group " + std::to_string(g) + " is " + xs[g].str() + ", group 0 " +
                       xs[0].str() + " (one dtype and column count for all)");
    detail::check_same_device(op, xs[0], xs[g]);
    if (!dynamic) {
      check_scalar_f32(op, scaling.scales[g], "scale", xs[0].device());
      if (!scaling.amaxes.empty() && scaling.amaxes[g].defined())
        check_scalar_f32(op, scaling.amaxes[g], "amax", xs[0].device());
    }
  }
  const Device dev = xs[0].device();
  Fp8GroupedTensor q;
  q.cols = xs[0].size(1);
  q.cols_p = round_up(q.cols, opts.pad);
  int64_t total = 0;
  for (const Tensor& x : xs) {
    q.rows.push_back(x.size(0));
    q.rows_p.push_back(round_up(x.size(0), opts.pad));
    q.offsets.push_back(total);
    total += q.rows_p.back();
  }
  if (opts.rowwise) q.data = Tensor::empty({total, q.cols_p}, fmt, dev);
  if (opts.columnwise) q.data_t = Tensor::empty({q.cols_p * total}, fmt, dev);
  const auto n = static_cast<int64_t>(G);
  q.scale_inv = Tensor::empty({4 * n}, DType::F32, dev);
  Tensor dyn_scales, dyn_amaxes;
  if (dynamic) {
    dyn_scales = Tensor::empty({n}, DType::F32, dev);
    dyn_amaxes = Tensor::zeros({n}, DType::F32, dev);
  }
  auto slot = [](const Tensor& t, int64_t i) { return t.as_strided({1}, {1}, t.offset() + i); };
  std::vector<Tensor> rows;  // the groups with rows, and where they go
  std::vector<Fp8CastGroup> groups;
  for (size_t g = 0; g < G; ++g) {
    const auto gi = static_cast<int64_t>(g);
    q.scales.push_back(dynamic ? slot(dyn_scales, gi) : scaling.scales[g]);
    if (q.rows[g] == 0) continue;
    const Fp8Tensor part = q.group(gi);
    Fp8CastTarget t{q.scales[g], part.data, part.data_t, Tensor(), part.scale_inv};
    if (dynamic)
      t.amax = slot(dyn_amaxes, gi);
    else if (!scaling.amaxes.empty())
      t.amax = scaling.amaxes[g];
    rows.push_back(contiguous_raw(xs[g]));
    groups.push_back({rows.back(), t});
  }
  if (groups.empty()) return q;
  Backend& b = backend_for(dev);
  if (dynamic) {
    std::vector<Tensor> amaxes;
    for (const Fp8CastGroup& g : groups) amaxes.push_back(g.out.amax);
    b.fp8_amax_grouped(rows, amaxes);
  }
  b.fp8_cast_grouped(groups, Fp8GroupScaling{dynamic, fp8_max_value(fmt), scaling.margin});
  return q;
}

// ---- GEMM -------------------------------------------------------------------------------------

void fp8_gemm(const Tensor& out, const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
              const Tensor& b_scale_inv, bool fast_accum, const Tensor& addend) {
  const char* op = "fp8_gemm";
  detail::check_defined(op, a, "a");
  detail::check_defined(op, b, "b");
  detail::check_defined(op, out, "out");
  if (a.dim() != 2 || b.dim() != 2 || out.dim() != 2)
    op_error(op, "a [M, K], b [N, K] and out [M, N] must be 2-d, got " + a.str() + ", " + b.str() +
                     ", " + out.str());
  if (!is_fp8(a.dtype()) || !is_fp8(b.dtype()))
    op_error(op, "a and b must be e4m3 or e5m2, got " + a.str() + " and " + b.str());
  if (a.dtype() == DType::E5M2 && b.dtype() == DType::E5M2)
    op_error(op, "e5m2 x e5m2 is not a supported fp8 GEMM (one operand must be e4m3)");
  if (!is_compute_float(out.dtype()))
    op_error(op, std::string("out must be f32, bf16 or f16, got ") + dtype_name(out.dtype()));
  if (!addend_fits(out, addend))
    op_error(op, "the addend " + addend.str() + " must be contiguous and match out " + out.str());
  if (a.size(1) != b.size(1))
    op_error(op, "contraction dims differ: a " + shape_str(a.shape()) + ", b " +
                     shape_str(b.shape()) + " (both operands are [rows, K])");
  if (out.size(0) != a.size(0) || out.size(1) != b.size(0))
    op_error(op, "out " + shape_str(out.shape()) + " is not [M, N] = [" +
                     std::to_string(a.size(0)) + ", " + std::to_string(b.size(0)) + "]");
  if (!a.is_contiguous() || !b.is_contiguous() || !out.is_contiguous())
    op_error(op, "a, b and out must be contiguous");
  detail::check_same_device(op, a, b);
  detail::check_same_device(op, a, out);
  check_scalar_f32(op, a_scale_inv, "a_scale_inv", a.device());
  check_scalar_f32(op, b_scale_inv, "b_scale_inv", a.device());
  // cuBLASLt on an H200 refuses ("not supported") scale pointers that are not 16-byte aligned;
  // the CPU emulation holds callers to the same rule so that CPU tests catch it.
  for (const Tensor* s : {&a_scale_inv, &b_scale_inv})
    if (reinterpret_cast<uintptr_t>(s->data_ptr()) % 16 != 0)
      op_error(op,
               "scale_inv tensors must start on 16-byte boundaries (a view at an offset into "
               "a vector of scales is not; give each scale its own 16 bytes)");
  if (out.numel() == 0) return;
  backend_for(a.device()).fp8_gemm(out, a, a_scale_inv, b, b_scale_inv, fast_accum, addend);
}

Tensor fp8_gemm(const Tensor& a, const Tensor& a_scale_inv, const Tensor& b,
                const Tensor& b_scale_inv, DType out_dtype, bool fast_accum) {
  detail::check_defined("fp8_gemm", a, "a");
  detail::check_defined("fp8_gemm", b, "b");
  if (a.dim() != 2 || b.dim() != 2)
    op_error("fp8_gemm", "a [M, K] and b [N, K] must be 2-d, got " + a.str() + ", " + b.str());
  return keep_output("fp8_gemm", [&] {
    Tensor out = Tensor::empty({a.size(0), b.size(0)}, out_dtype, a.device());
    fp8_gemm(out, a, a_scale_inv, b, b_scale_inv, fast_accum);
    return out;
  });
}

Tensor fp8_mx_fake_quant(const Tensor& x, DType fmt, int block_dim) {
  const char* op = "fp8_mx_fake_quant";
  check_cast_input(op, x, Fp8CastOptions{});
  check_fp8_format(op, fmt);
  if (block_dim != 0 && block_dim != 1)
    op_error(op, "block_dim must be 0 or 1, got " + std::to_string(block_dim));
  Tensor xc = contiguous_raw(x);
  Tensor out = Tensor::empty(xc.shape(), xc.dtype(), xc.device());
  backend_for(x.device()).fp8_mx_fake_quant(out, xc, fmt, block_dim);
  return out;
}

// ---- per-row / per-block scaled fp8 ----------------------------------------------------------

const char* fp8_scale_mode_name(Fp8ScaleMode m) {
  switch (m) {
    case Fp8ScaleMode::Row:
      return "rowwise (OUTER_VEC_32F)";
    case Fp8ScaleMode::Block1x128:
      return "1x128 blocks (VEC128_32F)";
    case Fp8ScaleMode::Block128x128:
      return "128x128 blocks (BLK128x128_32F)";
  }
  return "?";
}

Fp8ScaledTensor fp8_cast_scaled(const Tensor& x, DType fmt, Fp8ScaleMode mode, bool transpose,
                                bool pow2, bool one_scale, int64_t pad) {
  const char* op = "fp8_cast_scaled";
  check_cast_input(op, x, Fp8CastOptions{true, false, pad});
  check_fp8_format(op, fmt);
  Tensor xc = contiguous_raw(x);
  Fp8ScaledTensor q;
  q.mode = mode;
  q.rows = transpose ? xc.size(1) : xc.size(0);
  q.k = transpose ? xc.size(0) : xc.size(1);
  const int64_t rows_p = round_up(q.rows, pad), k_p = round_up(q.k, pad);
  q.data = Tensor::empty({rows_p, k_p}, fmt, x.device());
  Shape s_shape;
  switch (mode) {
    case Fp8ScaleMode::Row:
      s_shape = {rows_p};
      break;
    case Fp8ScaleMode::Block1x128:
      s_shape = {(k_p + kFp8Block - 1) / kFp8Block, rows_p};
      break;
    case Fp8ScaleMode::Block128x128:
      s_shape = {(rows_p + kFp8Block - 1) / kFp8Block, fp8_block_ld(k_p)};
      break;
  }
  q.scale_inv = Tensor::empty(s_shape, DType::F32, x.device());
  if (q.data.numel() == 0) return q;
  backend_for(x.device())
      .fp8_cast_scaled(xc, transpose, mode, pow2, one_scale, q.data, q.scale_inv);
  return q;
}

Tensor fp8_scaled_dequantize(const Fp8ScaledTensor& q, DType dtype) {
  const char* op = "fp8_scaled_dequantize";
  if (!q.data.defined() || !q.scale_inv.defined()) op_error(op, "the fp8 tensor holds no data");
  NoGradGuard no_grad;
  Tensor codes = cast(q.data.device().is_cpu() ? q.data : q.data.to(Device::cpu()), DType::F32);
  Tensor si = q.scale_inv.device().is_cpu() ? q.scale_inv : q.scale_inv.to(Device::cpu());
  const int64_t rows_p = q.data.size(0), k_p = q.data.size(1);
  std::vector<float> v(static_cast<size_t>(q.rows * q.k));
  const float* c = static_cast<const float*>(codes.data_ptr());
  const float* s = static_cast<const float*>(si.data_ptr());
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t k = 0; k < q.k; ++k)
      v[r * q.k + k] = c[r * k_p + k] * s[fp8_scale_index(q.mode, r, k, rows_p, k_p)];
  Tensor out = Tensor::from_vector(v, {q.rows, q.k}, DType::F32, Device::cpu());
  if (dtype != DType::F32) out = cast(out, dtype);
  return q.data.device().is_cpu() ? out : out.to(q.data.device());
}

Tensor fp8_gemm_scaled(const Fp8ScaledTensor& a, const Fp8ScaledTensor& b, DType out_dtype,
                       bool fast_accum) {
  const char* op = "fp8_gemm_scaled";
  if (!a.data.defined() || !b.data.defined()) op_error(op, "an operand holds no data");
  if (!is_fp8(a.dtype()) || !is_fp8(b.dtype()))
    op_error(op, "a and b must be e4m3 or e5m2, got " + a.data.str() + " and " + b.data.str());
  if (a.dtype() == DType::E5M2 && b.dtype() == DType::E5M2)
    op_error(op, "e5m2 x e5m2 is not a supported fp8 GEMM (one operand must be e4m3)");
  if (!is_compute_float(out_dtype))
    op_error(op, std::string("out must be f32, bf16 or f16, got ") + dtype_name(out_dtype));
  if (a.data.size(1) != b.data.size(1))
    op_error(op, "contraction dims differ: a " + shape_str(a.data.shape()) + ", b " +
                     shape_str(b.data.shape()));
  detail::check_same_device(op, a.data, b.data);
  using M = Fp8ScaleMode;
  const bool row = a.mode == M::Row && b.mode == M::Row;
  const bool blocks = (a.mode == M::Block1x128 && b.mode == M::Block128x128) ||
                      (a.mode == M::Block128x128 && b.mode == M::Block1x128) ||
                      (a.mode == M::Block1x128 && b.mode == M::Block1x128);
  if (!row && !blocks)
    op_error(op, std::string("no fp8 GEMM scales a by ") + fp8_scale_mode_name(a.mode) +
                     " and b by " + fp8_scale_mode_name(b.mode) +
                     ": cuBLASLt 13 on Hopper takes rowwise x rowwise, 1x128 x 128x128, 128x128 x "
                     "1x128 and 1x128 x 1x128");
  if (blocks && fast_accum)
    op_error(op,
             "block-scaled fp8 GEMMs (1x128 / 128x128) have no fast accumulation in cuBLASLt "
             "(ask for precise accumulation)");
  for (const Fp8ScaledTensor* t : {&a, &b}) {
    const int64_t want = fp8_scale_slots(t->mode, t->data.size(0), t->data.size(1));
    if (t->scale_inv.dtype() != DType::F32 || t->scale_inv.numel() != want ||
        !t->scale_inv.is_contiguous())
      op_error(op, std::string("scale_inv of an operand scaled by ") +
                       fp8_scale_mode_name(t->mode) + " must be a contiguous f32 tensor of " +
                       std::to_string(want) + " elements, got " + t->scale_inv.str());
    detail::check_same_device(op, t->data, t->scale_inv);
    if (reinterpret_cast<uintptr_t>(t->scale_inv.data_ptr()) % 16 != 0)
      op_error(op, "scale_inv tensors must start on 16-byte boundaries");
  }
  return keep_output(op, [&] {  // selective checkpointing keeps it (runtime/autograd.h)
    Tensor out = Tensor::empty({a.data.size(0), b.data.size(0)}, out_dtype, a.data.device());
    if (out.numel() == 0) return out;
    backend_for(a.data.device())
        .fp8_gemm_scaled(out, a.data, a.scale_inv, a.mode, b.data, b.scale_inv, b.mode, fast_accum);
    return out;
  });
}

// ---- delayed scaling --------------------------------------------------------------------------

Fp8DelayedScaling::Fp8DelayedScaling(const Fp8Recipe& recipe, Device device)
    : recipe_(recipe), device_(device) {
  if (recipe.amax_history_len < 1)
    throw std::invalid_argument("[fp8] amax_history_len must be at least 1, got " +
                                std::to_string(recipe.amax_history_len));
  if (recipe.interval < 1)
    throw std::invalid_argument("[fp8] interval must be at least 1, got " +
                                std::to_string(recipe.interval));
}

int Fp8DelayedScaling::add_slot(DType fmt) {
  check_fp8_format("fp8_delayed_scaling", fmt);
  if (history_.defined())
    throw std::logic_error("[fp8] slots must be added before the scaling state is first used");
  formats_.push_back(fmt);
  return static_cast<int>(formats_.size()) - 1;
}

void Fp8DelayedScaling::allocate() {
  if (history_.defined()) return;
  const int64_t n = num_slots();
  history_ = Tensor::zeros({recipe_.amax_history_len, n}, DType::F32, device_);
  scale_ = Tensor::ones({n}, DType::F32, device_);
  scale_inv_ = Tensor::ones({n}, DType::F32, device_);
  std::vector<float> maxes;
  for (DType f : formats_) maxes.push_back(fp8_max_value(f));
  max_values_ = Tensor::from_vector(maxes, {n}, DType::F32, device_);
}

namespace {
Tensor slot_view(const Tensor& t, int slot, int64_t n) {
  if (slot < 0 || slot >= n)
    throw std::logic_error("[fp8] slot " + std::to_string(slot) + " out of range (" +
                           std::to_string(n) + " slots)");
  return t.as_strided({1}, {1}, t.offset() + slot);
}
}  // namespace

Tensor Fp8DelayedScaling::scale(int slot) {
  allocate();
  return slot_view(scale_, slot, num_slots());
}
Tensor Fp8DelayedScaling::scale_inv(int slot) {
  allocate();
  return slot_view(scale_inv_, slot, num_slots());
}
Tensor Fp8DelayedScaling::amax(int slot) {
  allocate();
  return slot_view(history_, slot, num_slots());
}
Tensor Fp8DelayedScaling::amax_history() {
  allocate();
  return history_;
}
Tensor Fp8DelayedScaling::scales() {
  allocate();
  return scale_;
}
Tensor Fp8DelayedScaling::scale_invs() {
  allocate();
  return scale_inv_;
}
Tensor Fp8DelayedScaling::current_amaxes() {
  allocate();
  return history_.as_strided({num_slots()}, {1}, history_.offset());
}

void Fp8DelayedScaling::update() {
  allocate();
  ++updates_;
  const bool recompute = (updates_ - 1) % recipe_.interval == 0;
  if (num_slots() == 0) return;
  backend_for(device_).fp8_delayed_update(history_, scale_, scale_inv_, max_values_,
                                          recipe_.amax_algo == AmaxAlgo::Max, recipe_.margin,
                                          recompute);
}

std::vector<std::pair<std::string, Tensor>> Fp8DelayedScaling::state_tensors() {
  allocate();
  return {{"fp8.amax_history", history_},
          {"fp8.scale", scale_},
          {"fp8.scale_inv", scale_inv_},
          {"fp8.updates", Tensor::from_vector(std::vector<int64_t>{updates_}, {1})}};
}

void Fp8DelayedScaling::load_state(const std::vector<std::pair<std::string, Tensor>>& tensors) {
  allocate();
  int found = 0;
  NoGradGuard no_grad;
  for (const auto& [name, t] : tensors) {
    Tensor* dst = name == "fp8.amax_history" ? &history_
                  : name == "fp8.scale"      ? &scale_
                  : name == "fp8.scale_inv"  ? &scale_inv_
                                             : nullptr;
    if (name == "fp8.updates") {
      updates_ = static_cast<int64_t>(t.item());
      ++found;
      continue;
    }
    if (!dst) continue;
    if (t.shape() != dst->shape())
      throw std::invalid_argument("[fp8] checkpoint tensor " + name + " has shape " +
                                  shape_str(t.shape()) + ", this model's fp8 state needs " +
                                  shape_str(dst->shape()) +
                                  " (different model, fp8 layers or amax_history_len)");
    dst->copy_(t.device() == device_ ? t : t.to(device_));
    ++found;
  }
  if (found != 4)
    throw std::invalid_argument(
        "[fp8] checkpoint lacks part of the delayed-scaling state (fp8.amax_history, fp8.scale, "
        "fp8.scale_inv, fp8.updates)");
}

// ---- fp8 linear -------------------------------------------------------------------------------

namespace {

struct LinearShapes {
  int64_t M, N, K;
  DType x_dtype, w_dtype;
};

struct Fp8WgradSum;

// One fp8 linear over 2-d rows, outside autograd: fp8_linear's numbers for x2 [M, K] (detached)
// and a weight [N, K] (detached), and the backward that fp8_linear and fp8_grouped_linear record
// (and the chunked LM head runs per chunk).
struct Fp8RowsPass {
  Tensor y2;  // [M, N] in x's dtype
  // g2 [M, N] (contiguous) -> {dx2 [M, K] in x's dtype, dw [N, K] in the weight's dtype}, each
  // undefined where not wanted; null when no gradient is wanted. With dw_sum (an f32 weight
  // gradient summed over row blocks) the weight gradient goes into it, before any rounding, and dw
  // is undefined. With dx_add ([M, K] in x's dtype, contiguous, only read: the gradient x
  // already has) dx2 includes it, added inside the dgrad GEMM where its operands are unpadded.
  std::function<std::pair<Tensor, Tensor>(const Tensor& g2, Fp8WgradSum* dw_sum,
                                          const Tensor& dx_add)>
      backward;
};

// The GEMMs in high precision, in x's dtype: those override_linear_precision keeps out of fp8, and
// all three under MXFP8, emulated: each operand quantized in 1x32 blocks along that GEMM's
// contraction dimension from the high-precision tensor (an MX tensor cannot be transposed
// exactly), the GEMM run on the exactly representable dequantized values.
bool fprop_in_hp(const Fp8Recipe& r) { return r.hp_fprop || r.scaling == Fp8Scaling::MxBlock; }
bool dgrad_in_hp(const Fp8Recipe& r) { return r.hp_dgrad || r.scaling == Fp8Scaling::MxBlock; }
bool wgrad_in_hp(const Fp8Recipe& r) { return r.hp_wgrad || r.scaling == Fp8Scaling::MxBlock; }

// A high-precision GEMM's operand t: as it is where overridden, MX-quantized along `block_dim`
// (1: rows' elements, 0: down columns; the GEMM's contraction dimension) under MXFP8.
Tensor hp_operand(const Tensor& t, const Fp8Recipe& r, bool overridden, DType fmt, int block_dim) {
  return r.scaling == Fp8Scaling::MxBlock && !overridden ? fp8_mx_fake_quant(t, fmt, block_dim) : t;
}

// A weight gradient summed in fp32 over row blocks (the chunked LM head's chunks), so that it is
// rounded once as fp8_linear's one wgrad GEMM rounds it: [N_p, K_p] for the fp8 GEMM (padded as
// its operands), [N, K] for a high-precision one. The first block's GEMM writes it (no zeroing
// pass over the weight-sized buffer), the others add into it.
struct Fp8WgradSum {
  Tensor acc;
  bool hp = false;
  bool written = false;
  Fp8WgradSum(const LinearShapes& s, const Fp8Recipe& r, Device device) : hp(wgrad_in_hp(r)) {
    acc = hp ? Tensor::empty({s.N, s.K}, DType::F32, device)
             : Tensor::empty({round_up(s.N, 16), round_up(s.K, 16)}, DType::F32, device);
  }
  // What a GEMM into acc adds to: nothing for the first (it writes acc), acc after.
  Tensor addend() {
    const bool first = !written;
    written = true;
    return first ? Tensor() : acc;
  }
  // The sum rounded as the one GEMM's output would be: to the weight's dtype from the fp8 GEMM,
  // to x's dtype (then the weight's) from a high-precision one; zeros when no rows came.
  Tensor result(const LinearShapes& s) {
    if (!written) acc.fill_(0.0);
    Tensor dw = unpad(acc, s.N, s.K);
    if (hp && dw.dtype() != s.x_dtype) dw = cast(dw, s.x_dtype);
    return dw.dtype() == s.w_dtype ? dw : cast(dw, s.w_dtype);
  }
};

// The weight gradient of a high-precision wgrad GEMM, dW [N, K] = a^T . b for a [M, N] and
// b [M, K] in x's dtype: the GEMM's output in that dtype, then the weight's (as fp8_linear always
// did), or, with a sum, the fp32 product into it (the operands widened exactly).
Tensor hp_wgrad(const Tensor& a, const Tensor& b, DType w_dtype, Fp8WgradSum* sum) {
  if (!sum) {
    Tensor dw = matmul(transpose(a, 0, 1), b);
    return dw.dtype() == w_dtype ? dw : cast(dw, w_dtype);
  }
  auto wide = [](const Tensor& t) {
    Tensor f = t.dtype() == DType::F32 ? contiguous(t) : cast(t, DType::F32);
    return f.as_strided({1, f.size(0), f.size(1)}, {f.numel(), f.size(1), 1}, f.offset());
  };
  const Tensor& acc = sum->acc;
  const Tensor add = sum->addend();
  backend_for(acc.device())
      .matmul(acc.as_strided({1, acc.size(0), acc.size(1)}, {acc.numel(), acc.size(1), 1},
                             acc.offset()),
              wide(a), wide(b), /*trans_a=*/true, /*trans_b=*/false, 1.0, add.defined() ? 1.0 : 0.0,
              Tensor());
  return Tensor();
}

// The rowwise and blockwise recipes: every GEMM operand is cast from the high-precision tensor with
// scales along that GEMM's contraction dimension (a row- or tile-scaled tensor cannot be
// transposed exactly), so x, w and dy are each cast twice: x per row/tile along K for fprop and
// along M for wgrad; w along K for fprop and along N for dgrad; dy along N for dgrad and along M
// for wgrad. The forward makes x's and w's second casts too and saves them (one byte per element)
// for backward.
//   rowwise:    Row x Row for all three GEMMs (fprop fast accumulation), e4m3 everywhere.
//   rowwise_with_gw_hp: fprop as rowwise; dgrad dy per row x w tensorwise (one scale, stored in
//               the Row layout); wgrad in high precision (x saved in high precision).
//   blockwise:  fprop x 1x128 x w 128x128; dgrad dy 1x128 x w^T 128x128; wgrad dy^T 1x128 (along
//               M) x x^T 1x128 (along M); precise accumulation (cuBLASLt has no fast mode here).
Fp8RowsPass scaled_linear_rows(const Tensor& x2, const Tensor& w, const LinearShapes& s,
                               const Fp8Recipe& r, bool want_dx, bool want_dw) {
  using M = Fp8ScaleMode;
  const bool block = r.scaling == Fp8Scaling::Blockwise;
  const M act = block ? M::Block1x128 : M::Row, wmode = block ? M::Block128x128 : M::Row;
  const bool fast_fprop = !block;
  const DType fwd = r.forward_dtype, bwd = r.backward_dtype;
  const bool pow2 = r.pow2_scales;
  Fp8ScaledTensor qx = fp8_cast_scaled(x2, fwd, act, false, pow2);
  Fp8ScaledTensor qw = fp8_cast_scaled(w, fwd, wmode, false, pow2);
  Fp8RowsPass p;
  p.y2 = unpad(fp8_gemm_scaled(qx, qw, s.x_dtype, fast_fprop), s.M, s.N);
  if (!want_dx && !want_dw) return p;
  Fp8ScaledTensor qw_t, qx_t;
  Tensor x_hp;
  if (want_dx)  // w^T [K, N]: rows along K, scaled along N
    qw_t = fp8_cast_scaled(w, fwd, wmode, true, pow2, r.dgrad_weight_tensorwise);
  if (want_dw) {
    if (r.hp_wgrad)
      x_hp = x2;
    else  // x^T [K, M]: scaled along M
      qx_t = fp8_cast_scaled(x2, fwd, act, true, pow2);
  }
  p.backward = [=](const Tensor& g2, Fp8WgradSum* dw_sum, const Tensor& dx_add) {
    if (dw_sum)
      throw std::logic_error("[fp8_linear] " + r.str() + " does not sum weight gradients");
    Tensor dx, dw;
    if (want_dx) {  // dX [M, K] = dY [M, N] . W [N, K]: contraction over N
      Fp8ScaledTensor qg = fp8_cast_scaled(g2, bwd, act, false, pow2);
      dx = unpad(fp8_gemm_scaled(qg, qw_t, s.x_dtype, false), s.M, s.K);
      if (dx_add.defined()) dx = add(dx, dx_add);
    }
    if (want_dw) {  // dW [N, K] = dY^T [N, M] . X [M, K]: contraction over M
      if (r.hp_wgrad) {
        dw = matmul(transpose(g2, 0, 1), x_hp);
        if (dw.dtype() != s.w_dtype) dw = cast(dw, s.w_dtype);
      } else {
        Fp8ScaledTensor qg_t = fp8_cast_scaled(g2, bwd, act, true, pow2);
        dw = unpad(fp8_gemm_scaled(qg_t, qx_t, s.w_dtype, false), s.N, s.K);
      }
    }
    return std::pair<Tensor, Tensor>{dx, dw};
  };
  return p;
}

}  // namespace

// ---- one input cast for the layers that read the same tensor ----------------------------------

namespace {
thread_local Fp8SharedInputCast* t_shared_input = nullptr;

bool same_tensor(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.storage() == b.storage() && a.offset() == b.offset() &&
         a.shape() == b.shape() && a.strides() == b.strides() && a.dtype() == b.dtype();
}
}  // namespace

Fp8SharedInputCast::Fp8SharedInputCast(const Tensor& input)
    : input_(input), previous_(t_shared_input) {
  t_shared_input = this;
}

Fp8SharedInputCast::~Fp8SharedInputCast() { t_shared_input = previous_; }

Fp8SharedInputCast* Fp8SharedInputCast::current() { return t_shared_input; }

const Fp8Tensor* Fp8SharedInputCast::find(const Tensor& x, DType fmt, bool row, bool col,
                                          int scaling) const {
  if (!have_ || !same_tensor(x, input_) || fmt != fmt_ || scaling != scaling_) return nullptr;
  if ((row && !cast_.data.defined()) || (col && !cast_.data_t.defined())) return nullptr;
  return &cast_;
}

void Fp8SharedInputCast::remember(const Tensor& x, DType fmt, int scaling, const Fp8Tensor& cast,
                                  int slot) {
  if (!same_tensor(x, input_)) return;
  have_ = true;
  fmt_ = fmt;
  scaling_ = scaling;
  slot_ = slot;
  cast_ = cast;
}

namespace {

// The weight's operands for fp8_linear's GEMMs (not the rowwise and blockwise recipes), made once
// however many row passes use them: fp8_linear and each group of fp8_grouped_linear make one pass,
// the chunked LM head one per chunk (so its weight is cast once per forward, not per chunk).
struct Fp8WeightOperands {
  Fp8Tensor q;    // the fp8 cast: data for an fp8 fprop, data_t for an fp8 dgrad
  Tensor fprop;   // a high-precision fprop's weight (in x's dtype; MX-quantized along K)
  Tensor weight;  // the weight itself (detached), for a high-precision dgrad
  // A high-precision dgrad's weight (in x's dtype; MX-quantized along N), made at its first use:
  // in fp8_linear's backward, as before, or at the chunked head's first chunk for all of them.
  std::shared_ptr<Tensor> dgrad = std::make_shared<Tensor>();

  Tensor dgrad_hp(const Fp8Recipe& r, DType x_dtype) const {
    if (!dgrad->defined()) {
      Tensor w = weight.dtype() == x_dtype ? weight : cast(weight, x_dtype);
      *dgrad = hp_operand(w, r, r.hp_dgrad, r.forward_dtype, 0);
    }
    return *dgrad;
  }
};

void check_delayed_slots(const char* op, const Fp8LinearContext& ctx) {
  if (ctx.recipe.scaling == Fp8Scaling::Delayed &&
      (!ctx.delayed || ctx.slot_input < 0 || ctx.slot_weight < 0 || ctx.slot_grad_output < 0))
    throw std::logic_error(std::string("[") + op +
                           "] delayed scaling without a scaling state and slots");
}

bool records_amax(const Fp8LinearContext& ctx) {
  return (ctx.autocast ? *ctx.autocast : Fp8Autocast{}).record_amax;
}

// A cast with the recipe's scaling (delayed: the slot's scale, the amax max-accumulated into the
// slot when recording; dynamic: the tensor's own amax). Nothing is cast when neither copy is
// wanted.
Fp8Tensor fp8_quantize(const Fp8LinearContext& ctx, bool record_amax, const Tensor& t, DType fmt,
                       int slot, bool row, bool col) {
  if (!row && !col) return Fp8Tensor{};
  const Fp8CastOptions o{row, col, 16};
  if (ctx.recipe.scaling != Fp8Scaling::Delayed)
    return fp8_cast_dynamic(t, fmt, o, ctx.recipe.margin);
  return fp8_cast(t, fmt, ctx.delayed->scale(slot),
                  record_amax ? ctx.delayed->amax(slot) : Tensor(), o);
}

Fp8WeightOperands fp8_weight_operands(const Tensor& weight, const LinearShapes& s,
                                      const Fp8LinearContext& ctx, bool want_dx) {
  const char* op = "fp8_linear";
  const Fp8Recipe& r = ctx.recipe;
  Fp8WeightOperands w;
  w.weight = weight;
  if (fprop_in_hp(r)) {
    NoGradGuard no_grad;
    Tensor wx = weight.dtype() == s.x_dtype ? weight : cast(weight, s.x_dtype);
    w.fprop = hp_operand(wx, r, r.hp_fprop, r.forward_dtype, 1);
  }
  if (r.scaling == Fp8Scaling::MxBlock) return w;
  const bool fp8_dgrad = want_dx && !r.hp_dgrad;
  if (ctx.weight_provider) {
    w.q = ctx.weight_provider(weight);
    if (w.q.rows != s.N || w.q.cols != s.K)
      op_error(op, "the weight provider returned an fp8 tensor of [" + std::to_string(w.q.rows) +
                       ", " + std::to_string(w.q.cols) + "] for weight " + weight.str());
    if (!r.hp_fprop && !w.q.data.defined())
      op_error(op, "the weight provider's fp8 tensor has no row-major data");
    if (w.q.data.defined() &&
        (w.q.data.size(0) != round_up(s.N, 16) || w.q.data.size(1) != round_up(s.K, 16)))
      op_error(op, "the weight provider's fp8 data " + w.q.data.str() +
                       " is not padded to multiples of 16");
    if (fp8_dgrad) w.q = fp8_with_transpose(w.q);
  } else {
    w.q = fp8_quantize(ctx, records_amax(ctx), weight, r.forward_dtype, ctx.slot_weight,
                       !r.hp_fprop, fp8_dgrad);
  }
  return w;
}

// One pass of rows x2 [M, K] through the weight's operands. `x` keys the shared input cast
// (Fp8SharedInputCast; undefined: none).
Fp8RowsPass fp8_rows_pass(const Tensor& x, const Tensor& x2, const Fp8WeightOperands& w,
                          const LinearShapes& s, const Fp8LinearContext& ctx, bool want_dx,
                          bool want_dw) {
  const Fp8Recipe& r = ctx.recipe;
  const bool record_amax = records_amax(ctx);
  Fp8Tensor qx;
  if (r.scaling != Fp8Scaling::MxBlock) {
    const bool x_row = !r.hp_fprop, x_col = want_dw && !r.hp_wgrad;
    Fp8SharedInputCast* shared = x.defined() ? Fp8SharedInputCast::current() : nullptr;
    const Fp8Tensor* reuse =
        shared ? shared->find(x, r.forward_dtype, x_row, x_col, static_cast<int>(r.scaling))
               : nullptr;
    if (reuse) {
      qx = *reuse;
      // This layer's slot takes the amax the shared cast recorded (max over the same tensors).
      if (r.scaling == Fp8Scaling::Delayed && record_amax && shared->cast_slot() != ctx.slot_input)
        ctx.delayed->amax(ctx.slot_input).copy_(ctx.delayed->amax(shared->cast_slot()));
    } else {
      qx = fp8_quantize(ctx, record_amax, x2, r.forward_dtype, ctx.slot_input, x_row, x_col);
      if (shared)
        shared->remember(x, r.forward_dtype, static_cast<int>(r.scaling), qx, ctx.slot_input);
    }
  }
  Fp8RowsPass p;
  if (fprop_in_hp(r)) {
    NoGradGuard no_grad;
    p.y2 = matmul(hp_operand(x2, r, r.hp_fprop, r.forward_dtype, 1), transpose(w.fprop, 0, 1));
  } else {
    p.y2 =
        unpad(fp8_gemm(qx.data, qx.scale_inv, w.q.data, w.q.scale_inv, s.x_dtype, true), s.M, s.N);
  }
  if (!want_dx && !want_dw) return p;
  // Saved for backward: the fp8 transposes (1 byte per element), or the high-precision tensors
  // for the GEMMs that run in high precision.
  Tensor x_t = qx.data_t, x_si = qx.scale_inv, w_t = w.q.data_t, w_si = w.q.scale_inv;
  Tensor x_hp = wgrad_in_hp(r) ? x2 : Tensor();
  Fp8WeightOperands wd;  // a high-precision dgrad's weight; not the forward's operands
  if (want_dx && dgrad_in_hp(r)) {
    wd.weight = w.weight;
    wd.dgrad = w.dgrad;
  }
  const int slot_g = ctx.slot_grad_output;
  p.backward = [=](const Tensor& g2, Fp8WgradSum* dw_sum, const Tensor& dx_add) {
    const bool dx_fp8 = want_dx && !dgrad_in_hp(r), dw_fp8 = want_dw && !wgrad_in_hp(r);
    Fp8Tensor qg = fp8_quantize(ctx, record_amax, g2, r.backward_dtype, slot_g, dx_fp8, dw_fp8);
    Tensor dx, dw;
    if (want_dx) {  // dX [M, K] = dY [M, N] . W [N, K]: contraction over N
      if (dgrad_in_hp(r)) {
        dx = matmul(hp_operand(g2, r, r.hp_dgrad, r.backward_dtype, 1), wd.dgrad_hp(r, g2.dtype()));
        if (dx_add.defined()) dx = add(dx, dx_add);
      } else {
        dx = fp8_gemm_add(qg.data, qg.scale_inv, w_t, w_si, s.x_dtype, s.M, s.K, false, dx_add);
      }
    }
    if (want_dw) {  // dW [N, K] = dY^T [N, M] . X [M, K]: contraction over M
      if (wgrad_in_hp(r)) {
        dw = hp_wgrad(hp_operand(g2, r, r.hp_wgrad, r.backward_dtype, 0),
                      hp_operand(x_hp, r, r.hp_wgrad, r.forward_dtype, 0), s.w_dtype, dw_sum);
      } else if (dw_sum) {
        fp8_gemm(dw_sum->acc, qg.data_t, qg.scale_inv, x_t, x_si, false, dw_sum->addend());
      } else {
        // The wgrad GEMM accumulates in fp32 and writes the weight's dtype: an fp32 weight
        // receives the fp32 product itself, a 16-bit weight that product rounded once by the
        // GEMM's epilogue (as TE writes wgrad in the activation dtype when it does not fuse the
        // accumulation into fp32 main_grad). Autograd and every strategy keep a parameter's
        // gradient in the parameter's dtype, so an fp32 output for a bf16 weight would only be
        // rounded by a separate pass over an fp32 [N, K] buffer.
        dw = unpad(fp8_gemm(qg.data_t, qg.scale_inv, x_t, x_si, s.w_dtype, false), s.N, s.K);
      }
    }
    return std::pair<Tensor, Tensor>{dx, dw};
  };
  return p;
}

// fp8_linear's pass of x2 through `weight` under ctx's recipe.
Fp8RowsPass fp8_linear_rows(const Tensor& x, const Tensor& x2, const Tensor& weight,
                            const LinearShapes& s, const Fp8LinearContext& ctx, bool want_dx,
                            bool want_dw) {
  const char* op = "fp8_linear";
  const Fp8Recipe& r = ctx.recipe;
  if (r.scaling == Fp8Scaling::Rowwise || r.scaling == Fp8Scaling::Blockwise) {
    if (ctx.weight_provider)
      op_error(op, "a weight provider (FSDP's fp8 all-gather: one tensorwise scale) cannot feed " +
                       r.str() + " (it casts the weight per row or block itself)");
    if (r.hp_fprop || r.hp_dgrad || (r.hp_wgrad && r.scaling == Fp8Scaling::Blockwise))
      op_error(op, "override_linear_precision does not combine with " + r.str());
    return scaled_linear_rows(x2, weight, s, r, want_dx, want_dw);
  }
  check_delayed_slots(op, ctx);
  return fp8_rows_pass(x, x2, fp8_weight_operands(weight, s, ctx, want_dx), s, ctx, want_dx,
                       want_dw);
}

void check_fp8_linear_operands(const char* op, const Tensor& x, const Tensor& weight) {
  if (!is_compute_float(x.dtype()) || !is_compute_float(weight.dtype()))
    op_error(op,
             "input and weight must be f32, bf16 or f16, got " + x.str() + " and " + weight.str());
}

}  // namespace

Tensor fp8_linear(const Tensor& x, const Tensor& weight, const Tensor& bias,
                  const Fp8LinearContext& ctx) {
  const char* op = "fp8_linear";
  detail::check_defined(op, x, "input");
  detail::check_defined(op, weight, "weight");
  if (weight.dim() != 2) op_error(op, "weight must be 2-d [out, in], got " + weight.str());
  if (x.dim() < 1 || x.size(-1) != weight.size(1))
    op_error(op, "input " + shape_str(x.shape()) + " does not end in in_features=" +
                     std::to_string(weight.size(1)) + " of weight " + shape_str(weight.shape()));
  check_fp8_linear_operands(op, x, weight);
  detail::check_same_device(op, x, weight);
  const Fp8Autocast mode = ctx.autocast ? *ctx.autocast : Fp8Autocast{};
  if (!mode.enabled) return linear(x, weight, bias);

  LinearShapes s{0, weight.size(0), weight.size(1), x.dtype(), weight.dtype()};
  if (x.numel() == 0 || s.K == 0) return linear(x, weight, bias);  // nothing to quantize
  Tensor x2 = as_rows(x, s.K);
  s.M = x2.size(0);
  const bool want_dx = grad_enabled() && x.requires_grad();
  const bool want_dw = grad_enabled() && weight.requires_grad();
  Fp8RowsPass p = fp8_linear_rows(x, x2, weight.detach(), s, ctx, want_dx, want_dw);
  const Shape x_shape = x.shape();
  Shape out_shape = x_shape;
  out_shape.back() = s.N;
  Tensor y = with_shape(p.y2, out_shape);
  if (p.backward)
    // The input gradient folds in the one x already has (q/k/v read one input): one GEMM adds it.
    y = record_folding(
        op, y, {x, weight}, 0,
        [backward = p.backward, x_shape, N = s.N, K = s.K](const Tensor& g, const Tensor& pending) {
          auto [dx2, dw] =
              backward(contiguous(reshape(g, {-1, N})), nullptr,
                       pending.defined() ? contiguous(reshape(pending, {-1, K})) : Tensor());
          return std::vector<Tensor>{dx2.defined() ? with_shape(dx2, x_shape) : Tensor(), dw};
        });
  if (bias.defined()) y = add(y, bias.dtype() == y.dtype() ? bias : cast(bias, y.dtype()));
  return y;
}

namespace {

// Whether the experts run the grouped path below: tensorwise scaling (TE delayed, AO dynamic) with
// every GEMM in fp8 and the weights cast here, under one recipe. The others (MXFP8, the rowwise
// and blockwise recipes, override_linear_precision, a weight provider) run each expert through
// fp8_linear_rows.
bool grouped_cast_path(const std::vector<const Fp8LinearContext*>& contexts) {
  const Fp8Recipe& r = contexts[0]->recipe;
  if ((r.scaling != Fp8Scaling::Delayed && r.scaling != Fp8Scaling::Dynamic) || r.hp_fprop ||
      r.hp_dgrad || r.hp_wgrad)
    return false;
  for (const Fp8LinearContext* c : contexts) {
    const Fp8Recipe& o = c->recipe;
    if (c->weight_provider || o.scaling != r.scaling || o.forward_dtype != r.forward_dtype ||
        o.backward_dtype != r.backward_dtype || o.margin != r.margin || o.hp_fprop || o.hp_dgrad ||
        o.hp_wgrad)
      return false;
    check_delayed_slots("fp8_grouped_linear", *c);
  }
  return true;
}

// Each group's scaling for the casts of one operand role (whose slot `slot_of` picks): delayed,
// the slot's scale and (when recording) amax in each context's state; dynamic, the margin.
Fp8GroupScales group_scales(const std::vector<const Fp8LinearContext*>& contexts,
                            int Fp8LinearContext::*slot_of, bool record_amax) {
  Fp8GroupScales s;
  s.margin = contexts[0]->recipe.margin;
  if (contexts[0]->recipe.scaling != Fp8Scaling::Delayed) return s;
  for (const Fp8LinearContext* c : contexts) {
    s.scales.push_back(c->delayed->scale(c->*slot_of));
    s.amaxes.push_back(record_amax ? c->delayed->amax(c->*slot_of) : Tensor());
  }
  return s;
}

// Group g's rows of a grouped GEMM's [rows, cols] result, written by fp8_gemm straight into rows
// [begin, begin + rows_p) of `dst` when the GEMM's padded width is dst's (the rows past `rows`,
// zero-padding products, land in the next group's rows before its GEMM writes them, or in the
// slack rows after the last group; so the groups' GEMMs must run in order). Otherwise (a width
// not a multiple of 16) through a padded buffer and a copy.
void gemm_rows_into(const Tensor& dst, int64_t begin, int64_t rows, const Tensor& a,
                    const Tensor& a_si, const Tensor& b, const Tensor& b_si, bool fast) {
  const int64_t rows_p = a.size(0), cols = dst.size(1);
  if (b.size(0) == cols) {
    fp8_gemm(row_block(dst, begin, rows_p), a, a_si, b, b_si, fast);
  } else {
    Tensor full = Tensor::empty({rows_p, b.size(0)}, dst.dtype(), dst.device());
    fp8_gemm(full, a, a_si, b, b_si, fast);
    row_block(dst, begin, rows).copy_(narrow(narrow(full, 0, 0, rows), 1, 0, cols));
  }
}

// [rows, cols] of x's dtype, in a buffer with room for the padded rows of the last group's GEMM
// (gemm_rows_into).
Tensor rows_with_slack(int64_t rows, int64_t cols, int64_t slack, DType dtype, Device device) {
  return narrow(Tensor::empty({rows + slack, cols}, dtype, device), 0, 0, rows);
}

// fp8_grouped_linear under tensorwise scaling: each operand cast once for all groups
// (fp8_cast_grouped: the experts' rows, their weights, the output gradient's rows; each group
// with its own context's scale and amax), then one fp8 GEMM per non-empty group on slices of those
// buffers, writing into the output (and dx) rows directly. The forward keeps only what the
// backward's GEMMs read: the transposed fp8 copies of the rows and of the weights (one byte per
// element) and their scale_invs.
Tensor grouped_tensorwise(const Tensor& x, const std::vector<Tensor>& weights,
                          const std::vector<int64_t>& sizes,
                          const std::vector<const Fp8LinearContext*>& contexts) {
  const char* op = "fp8_grouped_linear";
  const Fp8Recipe& r = contexts[0]->recipe;
  const bool record_amax = records_amax(*contexts[0]);
  const size_t G = weights.size();
  const int64_t rows_total = x.size(0), K = x.size(1), N = weights[0].size(0);
  const DType act = x.dtype(), w_dtype = weights[0].dtype();
  Tensor xc = contiguous(x).detach();
  const bool want_dx = grad_enabled() && x.requires_grad();
  std::vector<bool> want_dw;
  bool any_dw = false;
  std::vector<Tensor> x_rows, w_used;  // every group's rows; the weights of groups with rows
  std::vector<const Fp8LinearContext*> used;
  std::vector<int64_t> begin(G), weight_index(G, -1);
  int64_t next_row = 0, slack = 0;
  for (size_t g = 0; g < G; ++g) {
    want_dw.push_back(grad_enabled() && weights[g].requires_grad());
    begin[g] = next_row;
    x_rows.push_back(row_block(xc, next_row, sizes[g]));
    if (sizes[g] > 0) {
      any_dw = any_dw || want_dw[g];
      weight_index[g] = static_cast<int64_t>(w_used.size());
      w_used.push_back(weights[g].detach());
      used.push_back(contexts[g]);
      slack = std::max(slack, next_row + round_up(sizes[g], 16) - rows_total);
    }
    next_row += sizes[g];
  }
  const bool need_grad =
      want_dx || std::find(want_dw.begin(), want_dw.end(), true) != want_dw.end();

  Fp8GroupedTensor qx, qw;
  if (!w_used.empty()) {
    qx = fp8_cast_grouped(x_rows, r.forward_dtype,
                          group_scales(contexts, &Fp8LinearContext::slot_input, record_amax),
                          Fp8CastOptions{true, any_dw, 16});
    qw = fp8_cast_grouped(w_used, r.forward_dtype,
                          group_scales(used, &Fp8LinearContext::slot_weight, record_amax),
                          Fp8CastOptions{true, want_dx, 16});
  }
  Tensor y = keep_output(op, [&] {  // selective checkpointing keeps it (runtime/autograd.h)
    Tensor out = rows_with_slack(rows_total, N, slack, act, x.device());
    for (size_t g = 0; g < G; ++g) {
      if (weight_index[g] < 0) continue;
      const Fp8Tensor a = qx.group(static_cast<int64_t>(g)), b = qw.group(weight_index[g]);
      gemm_rows_into(out, begin[g], sizes[g], a.data, a.scale_inv, b.data, b.scale_inv, true);
    }
    return out;
  });
  if (!need_grad) return y;

  // Saved for backward: the transposed copies and scale_invs (the row-major ones are dropped).
  qx.data = Tensor();
  qw.data = Tensor();
  std::vector<Tensor> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  const Fp8GroupScales g_scales =
      group_scales(contexts, &Fp8LinearContext::slot_grad_output, record_amax);
  const bool any_rows = !used.empty();
  const DType bwd = r.backward_dtype;
  return record(op, y, inputs, [=](const Tensor& gy) {
    Tensor gc = contiguous(gy);
    std::vector<Tensor> g_rows;
    for (size_t g = 0; g < G; ++g)  // (a group whose GEMMs want no gradient casts nothing)
      g_rows.push_back(row_block(gc, begin[g], want_dx || want_dw[g] ? sizes[g] : 0));
    std::vector<Tensor> grads(1 + G);
    Fp8GroupedTensor qg;
    if (any_rows && (want_dx || any_dw))
      qg = fp8_cast_grouped(g_rows, bwd, g_scales, Fp8CastOptions{want_dx, any_dw, 16});
    if (want_dx) {  // dX [M, K] = dY [M, N] . W [N, K]: contraction over N
      Tensor dx = rows_with_slack(rows_total, K, slack, act, gc.device());
      for (size_t g = 0; g < G; ++g) {
        if (weight_index[g] < 0) continue;
        const Fp8Tensor a = qg.group(static_cast<int64_t>(g)), b = qw.group(weight_index[g]);
        gemm_rows_into(dx, begin[g], sizes[g], a.data, a.scale_inv, b.data_t, b.scale_inv, false);
      }
      grads[0] = dx;
    }
    for (size_t g = 0; g < G; ++g) {  // dW [N, K] = dY^T [N, M] . X [M, K]: contraction over M
      if (!want_dw[g]) continue;
      if (weight_index[g] < 0) {  // no rows: nothing cast, a zero gradient
        grads[1 + g] = Tensor::zeros(weights[g].shape(), w_dtype, weights[g].device());
        continue;
      }
      // The GEMM writes the weight's dtype from fp32 accumulation (fp8_linear_rows says why).
      const Fp8Tensor a = qg.group(static_cast<int64_t>(g)), b = qx.group(static_cast<int64_t>(g));
      grads[1 + g] =
          unpad(fp8_gemm(a.data_t, a.scale_inv, b.data_t, b.scale_inv, w_dtype, false), N, K);
    }
    return grads;
  });
}

}  // namespace

Tensor fp8_grouped_linear(const Tensor& x, const std::vector<Tensor>& weights,
                          const std::vector<int64_t>& group_sizes,
                          const std::vector<const Fp8LinearContext*>& contexts) {
  const char* op = "fp8_grouped_linear";
  detail::check_grouped_linear(op, x, weights, group_sizes);
  check_fp8_linear_operands(op, x, weights[0]);
  if (contexts.size() != weights.size())
    op_error(op, std::to_string(contexts.size()) + " fp8 contexts for " +
                     std::to_string(weights.size()) + " weights");
  for (size_t g = 0; g < contexts.size(); ++g)
    if (!contexts[g] || contexts[g]->autocast != contexts[0]->autocast)
      op_error(op, "contexts[" + std::to_string(g) +
                       "] is null or switched by another autocast than contexts[0]'s");
  const Fp8Autocast mode = contexts[0]->autocast ? *contexts[0]->autocast : Fp8Autocast{};
  const int64_t K = x.size(1), N = weights[0].size(0);
  if (!mode.enabled || K == 0) return grouped_linear(x, weights, group_sizes);
  if (grouped_cast_path(contexts)) return grouped_tensorwise(x, weights, group_sizes, contexts);

  // The other recipes: each group is fp8_linear over its rows with its own context, one expert
  // after the other (the per-group casts those recipes make).
  // An empty group casts nothing and gets a zero weight gradient.
  Tensor xc = contiguous(x).detach();
  Tensor y = Tensor::empty({x.size(0), N}, x.dtype(), x.device());
  const bool want_dx = grad_enabled() && x.requires_grad();
  std::vector<bool> want_dw;
  std::vector<Fp8RowsPass> passes(weights.size());
  bool need_grad = want_dx;
  int64_t begin = 0;
  for (size_t g = 0; g < weights.size(); ++g) {
    want_dw.push_back(grad_enabled() && weights[g].requires_grad());
    need_grad = need_grad || want_dw.back();
    const int64_t rows = group_sizes[g];
    if (rows > 0) {
      const LinearShapes s{rows, N, K, x.dtype(), weights[g].dtype()};
      passes[g] = fp8_linear_rows(Tensor(), row_block(xc, begin, rows), weights[g].detach(), s,
                                  *contexts[g], want_dx, want_dw[g]);
      row_block(y, begin, rows).copy_(passes[g].y2);
      passes[g].y2 = Tensor();  // y holds it; the backward needs only the pass's saved casts
    }
    begin += rows;
  }
  if (!need_grad) return y;
  std::vector<Tensor> inputs{x};
  inputs.insert(inputs.end(), weights.begin(), weights.end());
  const Shape x_shape = xc.shape();
  return record(op, y, inputs, [=](const Tensor& g) {
    Tensor gc = contiguous(g);
    std::vector<Tensor> grads(1 + weights.size());
    if (want_dx) grads[0] = Tensor::empty(x_shape, gc.dtype(), gc.device());
    int64_t first = 0;
    for (size_t e = 0; e < passes.size(); ++e) {
      const int64_t rows = group_sizes[e];
      if (rows > 0) {
        auto [dx2, dw] = passes[e].backward(row_block(gc, first, rows), nullptr, Tensor());
        if (want_dx) row_block(grads[0], first, rows).copy_(dx2);
        grads[1 + e] = dw;
      } else if (want_dw[e]) {
        grads[1 + e] = Tensor::zeros(weights[e].shape(), weights[e].dtype(), weights[e].device());
      }
      first += rows;
    }
    return grads;
  });
}

// ---- the fp8 LM head fused with the loss ------------------------------------------------------

std::string fp8_linear_cross_entropy_unfused_reason(const Fp8Recipe& r) {
  switch (r.scaling) {
    case Fp8Scaling::Delayed:
    case Fp8Scaling::MxBlock:
      return "";
    case Fp8Scaling::Dynamic:
      return "dynamic scaling casts the output gradient with the amax of all its rows, known only "
             "after the last chunk";
    case Fp8Scaling::Rowwise:
      return "the rowwise recipes scale the wgrad GEMM's output-gradient operand per column, over "
             "all rows";
    case Fp8Scaling::Blockwise:
      return "the blockwise recipe is not chunked (AO keeps the LM head in high precision)";
  }
  return "unknown recipe";
}

namespace {

// fp8_linear's GEMMs over the chunks: the weight's operands made once, then one row pass per
// chunk, whose backward adds the chunk's weight gradient into an fp32 sum.
class Fp8ChunkedLinear : public detail::ChunkedLinear {
 public:
  Fp8ChunkedLinear(const Tensor& x2, const Tensor& w, const Fp8LinearContext& ctx, bool need_x,
                   bool need_w)
      : x2_(x2),
        ctx_(ctx),
        s_{0, w.size(0), w.size(1), x2.dtype(), w.dtype()},
        need_x_(need_x),
        need_w_(need_w),
        w_(fp8_weight_operands(w, s_, ctx, need_x)) {
    if (need_w) sum_ = std::make_unique<Fp8WgradSum>(s_, ctx.recipe, x2.device());
  }
  // MXFP8 quantizes the wgrad GEMM's operands in blocks of 32 rows: chunks of whole blocks make
  // the blocks of one pass. Otherwise 16, the rows the fp8 casts pad to.
  int64_t row_multiple() const override {
    return ctx_.recipe.scaling == Fp8Scaling::MxBlock ? 32 : 16;
  }
  Tensor logits(int64_t r0, int64_t n) override {
    LinearShapes s = s_;
    s.M = n;
    pass_ = fp8_rows_pass(Tensor(), row_block(x2_, r0, n), w_, s, ctx_, need_x_, need_w_);
    return pass_.y2;
  }
  void backward(int64_t, int64_t, const Tensor& g, const Tensor& gx) override {
    auto [dx, dw] = pass_.backward(g, sum_.get(), Tensor());
    if (gx.defined()) gx.copy_(dx);
  }
  Tensor weight_grad() override { return sum_ ? sum_->result(s_) : Tensor(); }

 private:
  Tensor x2_;
  const Fp8LinearContext& ctx_;
  LinearShapes s_;
  bool need_x_, need_w_;
  Fp8WeightOperands w_;
  std::unique_ptr<Fp8WgradSum> sum_;
  Fp8RowsPass pass_;
};

}  // namespace

Tensor fp8_linear_cross_entropy(const Tensor& x, const Tensor& weight, const Tensor& targets,
                                const Fp8LinearContext& ctx, int64_t ignore_index,
                                int64_t chunk_rows, double grad_scale) {
  const char* op = "fp8_linear_cross_entropy";
  detail::check_defined(op, x, "x");
  detail::check_defined(op, weight, "weight");
  check_fp8_linear_operands(op, x, weight);
  const Fp8Autocast mode = ctx.autocast ? *ctx.autocast : Fp8Autocast{};
  // As fp8_linear: fp8 switched off runs the plain linear (here: fused with the loss), and so
  // does an input with nothing to quantize.
  if (!mode.enabled || x.numel() == 0 || (weight.dim() == 2 && weight.size(1) == 0))
    return linear_cross_entropy(x, weight, targets, ignore_index, chunk_rows, grad_scale);
  if (!fp8_linear_cross_entropy_unfused_reason(ctx.recipe).empty()) {
    Tensor y = fp8_linear(x, weight, Tensor(), ctx);
    return cross_entropy(reshape(y, {-1, y.size(-1)}), reshape(targets, {-1}), ignore_index);
  }
  check_delayed_slots(op, ctx);
  return detail::chunked_linear_cross_entropy(
      op, x, weight, targets, ignore_index, chunk_rows, grad_scale,
      [&ctx](const Tensor& x2, const Tensor& w, bool need_x, bool need_w) {
        return std::make_unique<Fp8ChunkedLinear>(x2, w, ctx, need_x, need_w);
      });
}

// ---- the fp8 swiglu MLP -----------------------------------------------------------------------

namespace {

// A cast's allocation (as fp8_cast makes it) and the target the fused kernels write.
std::pair<Fp8Tensor, Fp8CastTarget> fused_target(const Tensor& like, DType fmt,
                                                 const Fp8CastOptions& o, const Tensor& scale,
                                                 const Tensor& amax) {
  Fp8Tensor q = make_fp8(like, fmt, o);
  q.scale = scale;
  return {q, Fp8CastTarget{scale, q.data, q.data_t, amax, q.scale_inv}};
}

bool fused_mlp_applies(const Fp8LinearContext& c, const Fp8LinearContext& first) {
  const Fp8Autocast mode = c.autocast ? *c.autocast : Fp8Autocast{};
  const Fp8Recipe& r = c.recipe;
  return mode.enabled && r.scaling == Fp8Scaling::Delayed && c.delayed &&
         c.delayed == first.delayed && c.autocast == first.autocast && !c.weight_provider &&
         !r.hp_fprop && !r.hp_dgrad && !r.hp_wgrad && c.slot_input >= 0 && c.slot_weight >= 0 &&
         c.slot_grad_output >= 0;
}

}  // namespace

Tensor fp8_swiglu_mlp(const Tensor& x, const Tensor& w_gate, const Tensor& w_up,
                      const Tensor& w_down, const Fp8LinearContext& gate,
                      const Fp8LinearContext& up, const Fp8LinearContext& down,
                      const Tensor& residual) {
  const char* op = "fp8_swiglu_mlp";
  if (!fused_mlp_applies(gate, gate) || !fused_mlp_applies(up, gate) ||
      !fused_mlp_applies(down, gate))
    return Tensor();
  detail::check_defined(op, x, "input");
  if (x.dtype() == DType::F32 || !is_compute_float(x.dtype()) || x.dim() < 1) return Tensor();
  for (const Tensor* w : {&w_gate, &w_up, &w_down})
    if (w->dim() != 2 || !is_compute_float(w->dtype())) return Tensor();
  const int64_t K = x.size(-1), F = w_gate.size(0), H = w_down.size(0);
  if (w_gate.size(1) != K || w_up.shape() != w_gate.shape() || w_down.size(1) != F)
    op_error(op, "weights gate " + w_gate.str() + ", up " + w_up.str() + ", down " + w_down.str() +
                     " do not fit an input ending in " + std::to_string(K));
  if (x.numel() == 0 || K == 0 || F == 0) return Tensor();
  detail::check_same_device(op, x, w_gate);
  detail::check_same_device(op, x, w_up);
  detail::check_same_device(op, x, w_down);
  Shape out_shape = x.shape();
  out_shape.back() = H;
  detail::check_residual(op, residual, x, out_shape);  // before any cast records an amax

  Fp8DelayedScaling& d = *gate.delayed;
  const Fp8Recipe& r = gate.recipe;
  const DType fwd = r.forward_dtype, bwd = r.backward_dtype, act = x.dtype();
  const bool record_amax = records_amax(gate);
  auto amax_of = [&](int slot) { return record_amax ? d.amax(slot) : Tensor(); };
  auto cast_with = [&](const Tensor& t, DType fmt, int slot, bool row, bool col) {
    return fp8_cast(t, fmt, d.scale(slot), amax_of(slot), Fp8CastOptions{row, col, 16});
  };

  Tensor x2 = as_rows(x, K);
  const int64_t M = x2.size(0);
  const bool want_dx = grad_enabled() && x.requires_grad();
  const bool want_dwg = grad_enabled() && w_gate.requires_grad();
  const bool want_dwu = grad_enabled() && w_up.requires_grad();
  const bool want_dwd = grad_enabled() && w_down.requires_grad();
  const bool want_dh = want_dx || want_dwg || want_dwu;  // the gradient reaching swiglu

  // x once for gate and up; up's input slot takes the amax gate's cast recorded.
  Fp8Tensor qx = cast_with(x2, fwd, gate.slot_input, true, want_dwg || want_dwu);
  if (record_amax) d.amax(up.slot_input).copy_(d.amax(gate.slot_input));
  Fp8Tensor qwg = cast_with(w_gate.detach(), fwd, gate.slot_weight, true, want_dx);
  Fp8Tensor qwu = cast_with(w_up.detach(), fwd, up.slot_weight, true, want_dx);
  Fp8Tensor qwd = cast_with(w_down.detach(), fwd, down.slot_weight, true, want_dh);
  Tensor g = unpad(fp8_gemm(qx.data, qx.scale_inv, qwg.data, qwg.scale_inv, act, true), M, F);
  Tensor u = unpad(fp8_gemm(qx.data, qx.scale_inv, qwu.data, qwu.scale_inv, act, true), M, F);

  // h = swiglu(g, u), cast for the down projection.
  const Fp8CastOptions h_opts{true, want_dwd, 16};
  Fp8Tensor qh;
  if (backend_for(g.device()).fp8_fused_cast_layout({&g, &u}, F)) {
    auto [q, target] =
        fused_target(g, fwd, h_opts, d.scale(down.slot_input), amax_of(down.slot_input));
    backend_for(g.device()).fp8_swiglu_cast(g, u, target);
    qh = q;
  } else {
    NoGradGuard no_grad;
    qh = cast_with(swiglu(g, u), fwd, down.slot_input, true, want_dwd);
  }
  // The residual rides on the down GEMM (its addend), kept as the GEMM's output under selective
  // checkpointing.
  const Tensor r2 = residual.defined() ? contiguous(reshape(residual.detach(), {M, H})) : Tensor();
  Tensor y2 = keep_output("fp8_gemm", [&] {
    return fp8_gemm_add(qh.data, qh.scale_inv, qwd.data, qwd.scale_inv, act, M, H, true, r2);
  });
  Tensor y = with_shape(y2, out_shape);
  const bool want_dr = grad_enabled() && residual.defined() && residual.requires_grad();
  if (!(want_dh || want_dwd || want_dr)) return y;

  // Saved for backward: the transposed fp8 copies (and swiglu's inputs), not the row-major ones.
  const Shape x_shape = x.shape();
  const Tensor x_t = qx.data_t, x_si = qx.scale_inv, h_t = qh.data_t, h_si = qh.scale_inv;
  const Tensor wg_t = qwg.data_t, wg_si = qwg.scale_inv, wu_t = qwu.data_t, wu_si = qwu.scale_inv;
  const Tensor wd_t = qwd.data_t, wd_si = qwd.scale_inv;
  const DType wg_dtype = w_gate.dtype(), wu_dtype = w_up.dtype(), wd_dtype = w_down.dtype();
  const int slot_gg = gate.slot_grad_output, slot_gu = up.slot_grad_output,
            slot_gd = down.slot_grad_output;
  auto state = gate.delayed;
  std::vector<Tensor> inputs{x, w_gate, w_up, w_down};
  const bool with_residual = residual.defined();  // captured instead of the residual itself
  if (with_residual) inputs.push_back(residual);
  return record_folding(op, y, std::move(inputs), 0, [=](const Tensor& gy, const Tensor& pending) {
    Fp8DelayedScaling& ds = *state;
    auto amax_b = [&](int slot) { return record_amax ? ds.amax(slot) : Tensor(); };
    Tensor gy2 = contiguous(reshape(gy, {-1, H}));
    Fp8Tensor qgy;  // none when only the residual wants a gradient
    if (want_dh || want_dwd)
      qgy = fp8_cast(gy2, bwd, ds.scale(slot_gd), amax_b(slot_gd),
                     Fp8CastOptions{want_dh, want_dwd, 16});
    Tensor dx, dwg, dwu, dwd;
    if (want_dwd)
      dwd = unpad(fp8_gemm(qgy.data_t, qgy.scale_inv, h_t, h_si, wd_dtype, false), H, F);
    if (want_dh) {
      Tensor dh = unpad(fp8_gemm(qgy.data, qgy.scale_inv, wd_t, wd_si, act, false), M, F);
      const Fp8CastOptions g_opts{want_dx, want_dwg, 16}, u_opts{want_dx, want_dwu, 16};
      Fp8Tensor qdg, qdu;
      const bool both =
          (g_opts.rowwise || g_opts.columnwise) && (u_opts.rowwise || u_opts.columnwise);
      if (both && backend_for(g.device()).fp8_fused_cast_layout({&dh, &g, &u}, F)) {
        auto [q1, t1] = fused_target(g, bwd, g_opts, ds.scale(slot_gg), amax_b(slot_gg));
        auto [q2, t2] = fused_target(u, bwd, u_opts, ds.scale(slot_gu), amax_b(slot_gu));
        backend_for(g.device()).fp8_swiglu_backward_cast(dh, g, u, t1, t2);
        qdg = q1;
        qdu = q2;
      } else {
        Tensor dg = Tensor::empty(g.shape(), act, g.device());
        Tensor du = Tensor::empty(u.shape(), act, u.device());
        backend_for(g.device()).swiglu_backward(dg, du, dh, contiguous(g), contiguous(u));
        if (g_opts.rowwise || g_opts.columnwise)
          qdg = fp8_cast(dg, bwd, ds.scale(slot_gg), amax_b(slot_gg), g_opts);
        if (u_opts.rowwise || u_opts.columnwise)
          qdu = fp8_cast(du, bwd, ds.scale(slot_gu), amax_b(slot_gu), u_opts);
      }
      if (want_dx) {  // folded as the layers one by one fold them: up's first, then gate's
        const Tensor add_x = pending.defined() ? contiguous(reshape(pending, {-1, K})) : Tensor();
        const Tensor dx_up =
            fp8_gemm_add(qdu.data, qdu.scale_inv, wu_t, wu_si, act, M, K, false, add_x);
        dx = with_shape(fp8_gemm_add(qdg.data, qdg.scale_inv, wg_t, wg_si, act, M, K, false, dx_up),
                        x_shape);
      }
      if (want_dwg)
        dwg = unpad(fp8_gemm(qdg.data_t, qdg.scale_inv, x_t, x_si, wg_dtype, false), F, K);
      if (want_dwu)
        dwu = unpad(fp8_gemm(qdu.data_t, qdu.scale_inv, x_t, x_si, wu_dtype, false), F, K);
    }
    std::vector<Tensor> grads{dx, dwg, dwu, dwd};
    if (with_residual) grads.push_back(want_dr ? gy : Tensor());
    return grads;
  });
}

}  // namespace accel
