#include "runtime/dtype.h"

#include <stdexcept>

namespace accel {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64:
    case DType::I64:
      return 8;
    case DType::F32:
    case DType::I32:
      return 4;
    case DType::BF16:
    case DType::F16:
      return 2;
    case DType::E4M3:
    case DType::E5M2:
    case DType::U8:
    case DType::Bool:
      return 1;
  }
  throw std::logic_error("dtype_size: bad dtype");
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "f32";
    case DType::F64:
      return "f64";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::E4M3:
      return "e4m3";
    case DType::E5M2:
      return "e5m2";
    case DType::I32:
      return "i32";
    case DType::I64:
      return "i64";
    case DType::U8:
      return "u8";
    case DType::Bool:
      return "bool";
  }
  return "?";
}

bool is_floating(DType t) {
  switch (t) {
    case DType::F32:
    case DType::F64:
    case DType::BF16:
    case DType::F16:
    case DType::E4M3:
    case DType::E5M2:
      return true;
    default:
      return false;
  }
}

DType dtype_from_name(const std::string& name) {
  for (int i = 0; i < kNumDTypes; ++i) {
    DType t = static_cast<DType>(i);
    if (name == dtype_name(t)) return t;
  }
  throw std::invalid_argument("unknown dtype '" + name +
                              "' (expected one of f32 f64 bf16 f16 e4m3 e5m2 i32 i64 u8 bool)");
}

}  // namespace accel
