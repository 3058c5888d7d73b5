// gradpack's MXNet extension-operator library (MXNet's lib_api, version 11).
//
// Registers _contrib_create_2bit, _contrib_quantize_2bit and
// _contrib_dequantize_2bit; every kernel runs in the Rust core through the cxx
// bridge. This file only checks what MXNet hands over (attributes, dtypes,
// shapes) and turns Rust errors into MXNet error messages.
#include <cmath>
#include <cstdlib>
#include <string>
#include <unordered_map>
#include <vector>

#include "mxnet/lib_api.h"
#include "gradpack/src/bridge.rs.h"

using mxnet::ext::MXReturnValue;
using mxnet::ext::MXTensor;
using mxnet::ext::MX_FAIL;
using mxnet::ext::MX_SUCCESS;
using Attrs = std::unordered_map<std::string, std::string>;

namespace {

// mshadow's type codes (lib_api's MXDType lacks bfloat16).
constexpr int kF32 = 0;
constexpr int kF16 = 2;
constexpr int kBF16 = 12;

const char* dtype_name(int t) {
  switch (t) {
    case 0: return "float32";
    case 1: return "float64";
    case 2: return "float16";
    case 3: return "uint8";
    case 4: return "int32";
    case 5: return "int8";
    case 6: return "int64";
    case 12: return "bfloat16";
    default: return "unknown";
  }
}

MXReturnValue fail(const char* op, const std::string& msg) {
  MX_ERROR_MSG << op << ": " << msg;
  return MX_FAIL;
}

// Parses a float attribute, rejecting trailing garbage.
bool parse_float(const Attrs& attrs, const char* key, float* value, std::string* err) {
  auto it = attrs.find(key);
  if (it == attrs.end()) {
    *err = std::string("missing attribute '") + key + "'";
    return false;
  }
  const char* s = it->second.c_str();
  char* end = nullptr;
  *value = std::strtof(s, &end);
  if (end == s || *end != '\0') {
    *err = std::string("attribute '") + key + "' must be a number, got '" + it->second + "'";
    return false;
  }
  return true;
}

// Keys MXNet's front end may add on its own (e.g. "__profiler_scope__").
bool is_internal_key(const std::string& k) { return k.rfind("__", 0) == 0; }

bool check_keys(const Attrs& attrs, const std::vector<std::string>& allowed, std::string* err) {
  for (const auto& kv : attrs) {
    if (is_internal_key(kv.first)) continue;
    bool ok = false;
    for (const auto& a : allowed) ok = ok || kv.first == a;
    if (!ok) {
      *err = "unknown attribute '" + kv.first + "'";
      return false;
    }
  }
  return true;
}

uint64_t num_elements(const std::vector<unsigned int>& shape) {
  uint64_t n = 1;
  for (unsigned int d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------- create_2bit

MXReturnValue create_parse(const Attrs& attrs, int* num_in, int* num_out) {
  std::string err;
  if (!check_keys(attrs, {}, &err)) return fail("create_2bit", err);
  *num_in = 1;
  *num_out = 1;
  return MX_SUCCESS;
}

MXReturnValue create_type(const Attrs&, std::vector<int>*, std::vector<int>* out) {
  (*out)[0] = kF32;
  return MX_SUCCESS;
}

MXReturnValue create_shape(const Attrs&, std::vector<std::vector<unsigned int>>* in,
                           std::vector<std::vector<unsigned int>>* out) {
  uint64_t len = gradpack::compressed_len(num_elements((*in)[0]));
  (*out)[0] = {static_cast<unsigned int>(len)};
  return MX_SUCCESS;
}

MXReturnValue create_forward(const Attrs&, std::vector<MXTensor>*, std::vector<MXTensor>* out,
                             const mxnet::ext::OpResource&) {
  MXTensor& compr = (*out)[0];
  float* p = compr.data<float>();
  for (int64_t i = 0; i < compr.size(); ++i) p[i] = 0.0f;
  return MX_SUCCESS;
}

// ------------------------------------------------------ shared by the mutators

MXReturnValue all_dense(const Attrs&, std::vector<int>* in, std::vector<int>*) {
  for (int& s : *in) {
    if (s != mxnet::ext::kDefaultStorage && s != -1) {
      MX_ERROR_MSG << "gradpack 2-bit operators take dense arrays only (got a sparse input)";
      return MX_FAIL;
    }
    s = mxnet::ext::kDefaultStorage;
  }
  return MX_SUCCESS;
}

// -------------------------------------------------------------- quantize_2bit

MXReturnValue quantize_parse(const Attrs& attrs, int* num_in, int* num_out) {
  std::string err;
  float neg = 0, pos = 0;
  if (!check_keys(attrs, {"neg_threshold", "pos_threshold"}, &err) ||
      !parse_float(attrs, "neg_threshold", &neg, &err) ||
      !parse_float(attrs, "pos_threshold", &pos, &err))
    return fail("quantize_2bit", err);
  try {
    gradpack::check_thresholds(neg, pos);
  } catch (const std::exception& e) {
    return fail("quantize_2bit", e.what());
  }
  *num_in = 3;
  *num_out = 0;
  return MX_SUCCESS;
}

MXReturnValue quantize_type(const Attrs&, std::vector<int>* in, std::vector<int>*) {
  int g = (*in)[0];
  if (g != kF32 && g != kF16 && g != kBF16 && g != -1)
    return fail("quantize_2bit", std::string("grad has dtype ") + dtype_name(g) +
                                     ", expected float32, float16 or bfloat16");
  const char* names[] = {"grad", "residual", "compr"};
  for (int i = 1; i < 3; ++i)
    if ((*in)[i] != kF32 && (*in)[i] != -1)
      return fail("quantize_2bit", std::string(names[i]) + " has dtype " + dtype_name((*in)[i]) +
                                       ", expected float32");
  return MX_SUCCESS;
}

MXReturnValue quantize_shape(const Attrs&, std::vector<std::vector<unsigned int>>* in,
                             std::vector<std::vector<unsigned int>>*) {
  uint64_t n = num_elements((*in)[0]);
  uint64_t r = num_elements((*in)[1]);
  uint64_t c = num_elements((*in)[2]);
  uint64_t want = gradpack::compressed_len(n);
  if (r != n)
    return fail("quantize_2bit", "residual has " + std::to_string(r) + " elements, expected " +
                                     std::to_string(n) + " (the size of grad)");
  if (c != want)
    return fail("quantize_2bit", "compr has " + std::to_string(c) + " elements, expected " +
                                     std::to_string(want) + " (3 + ceil(n/16))");
  return MX_SUCCESS;
}

MXReturnValue quantize_mutate(const Attrs&, std::vector<int>* idx) {
  *idx = {1, 2};
  return MX_SUCCESS;
}

MXReturnValue quantize_forward(const Attrs& attrs, std::vector<MXTensor>* in,
                               std::vector<MXTensor>*, const mxnet::ext::OpResource&) {
  std::string err;
  float neg = 0, pos = 0;
  if (!parse_float(attrs, "neg_threshold", &neg, &err) ||
      !parse_float(attrs, "pos_threshold", &pos, &err))
    return fail("quantize_2bit", err);
  MXTensor& grad = (*in)[0];
  MXTensor& residual = (*in)[1];
  MXTensor& compr = (*in)[2];
  if (residual.dtype != kF32 || compr.dtype != kF32)
    return fail("quantize_2bit", "residual and compr must be float32");
  rust::Slice<float> res(residual.data<float>(), residual.size());
  rust::Slice<float> out(compr.data<float>(), compr.size());
  try {
    switch (static_cast<int>(grad.dtype)) {
      case kF32:
        gradpack::quantize_2bit_f32({grad.data<float>(), static_cast<size_t>(grad.size())}, res, out, neg, pos);
        break;
      case kF16:
        gradpack::quantize_2bit_f16({grad.data<uint16_t>(), static_cast<size_t>(grad.size())}, res, out, neg, pos);
        break;
      case kBF16:
        gradpack::quantize_2bit_bf16({grad.data<uint16_t>(), static_cast<size_t>(grad.size())}, res, out, neg, pos);
        break;
      default:
        return fail("quantize_2bit", std::string("grad has dtype ") + dtype_name(grad.dtype) +
                                         ", expected float32, float16 or bfloat16");
    }
  } catch (const std::exception& e) {
    return fail("quantize_2bit", e.what());
  }
  return MX_SUCCESS;
}

// ------------------------------------------------------------ dequantize_2bit

MXReturnValue dequantize_parse(const Attrs& attrs, int* num_in, int* num_out) {
  std::string err;
  if (!check_keys(attrs, {}, &err)) return fail("dequantize_2bit", err);
  *num_in = 2;
  *num_out = 0;
  return MX_SUCCESS;
}

MXReturnValue dequantize_type(const Attrs&, std::vector<int>* in, std::vector<int>*) {
  const char* names[] = {"compr", "decompr"};
  for (int i = 0; i < 2; ++i)
    if ((*in)[i] != kF32 && (*in)[i] != -1)
      return fail("dequantize_2bit", std::string(names[i]) + " has dtype " + dtype_name((*in)[i]) +
                                         ", expected float32");
  return MX_SUCCESS;
}

MXReturnValue dequantize_shape(const Attrs&, std::vector<std::vector<unsigned int>>* in,
                               std::vector<std::vector<unsigned int>>*) {
  uint64_t c = num_elements((*in)[0]);
  uint64_t n = num_elements((*in)[1]);
  uint64_t want = gradpack::compressed_len(n);
  if (c != want)
    return fail("dequantize_2bit", "compr has " + std::to_string(c) + " elements, expected " +
                                       std::to_string(want) + " for decompr of " + std::to_string(n));
  return MX_SUCCESS;
}

MXReturnValue dequantize_mutate(const Attrs&, std::vector<int>* idx) {
  *idx = {1};
  return MX_SUCCESS;
}

MXReturnValue dequantize_forward(const Attrs&, std::vector<MXTensor>* in, std::vector<MXTensor>*,
                                 const mxnet::ext::OpResource&) {
  MXTensor& compr = (*in)[0];
  MXTensor& out = (*in)[1];
  try {
    gradpack::dequantize_2bit({compr.data<float>(), static_cast<size_t>(compr.size())},
                              {out.data<float>(), static_cast<size_t>(out.size())});
  } catch (const std::exception& e) {
    return fail("dequantize_2bit", e.what());
  }
  return MX_SUCCESS;
}

}  // namespace

REGISTER_OP(_contrib_create_2bit)
    .setParseAttrs(create_parse)
    .setInferType(create_type)
    .setInferShape(create_shape)
    .setForward(create_forward, "cpu");

REGISTER_OP(_contrib_quantize_2bit)
    .setParseAttrs(quantize_parse)
    .setInferType(quantize_type)
    .setInferSType(all_dense)
    .setInferShape(quantize_shape)
    .setMutateInputs(quantize_mutate)
    .setForward(quantize_forward, "cpu");

REGISTER_OP(_contrib_dequantize_2bit)
    .setParseAttrs(dequantize_parse)
    .setInferType(dequantize_type)
    .setInferSType(all_dense)
    .setInferShape(dequantize_shape)
    .setMutateInputs(dequantize_mutate)
    .setForward(dequantize_forward, "cpu");

MXReturnValue initialize(int version) {
  if (version >= 10900) return MX_SUCCESS;
  MX_ERROR_MSG << "gradpack's operators need MXNet >= 1.9 (found version " << version << ")";
  return MX_FAIL;
}
