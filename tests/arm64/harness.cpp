// Runs recorded calls of brisk's kernel ops and compares what they return (and write into their (a!) arguments)
// with what the recorded build returned. Used by .ci/arm64-check.sh under qemu-aarch64: the cases are recorded on
// x86 (tests/arm64/record_cases.py) and replayed against the cross-compiled aarch64 libraries. Only libc10 and
// libtorch_cpu are linked: no Python runs under emulation.
//
//   harness CASES LIB.so...   loads every library (their TORCH_LIBRARY_FRAGMENTs register the ops), then runs each
//                             case whose op is registered; exit status 1 when any case differs.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <dlfcn.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace torch {
// torch/serialize.h declares it, with the whole C++ frontend behind it: one declaration compiles much faster
TORCH_API c10::IValue pickle_load(const std::vector<char>& data);
}  // namespace torch

namespace {

// a recorded argument as the schema wants it: pickled Python lists arrive as generic lists, ints where a float is
// expected as ints
c10::IValue as_argument(const c10::IValue& v, const c10::Argument& arg) {
  const auto& type = arg.real_type();
  if (v.isNone()) return v;
  if (type->kind() == c10::TypeKind::FloatType && v.isInt()) return static_cast<double>(v.toInt());
  if (type->kind() == c10::TypeKind::ListType && v.isList()) {
    const auto elem = type->castRaw<c10::ListType>()->getElementType();
    if (elem->kind() == c10::TypeKind::IntType) {
      c10::List<int64_t> out;
      for (const auto& e : v.toListRef()) out.push_back(e.toInt());
      return out;
    }
    if (elem->kind() == c10::TypeKind::TensorType) {
      c10::List<at::Tensor> out;
      for (const auto& e : v.toListRef()) out.push_back(e.toTensor());
      return out;
    }
  }
  return v;
}

// {tensors} of a value: a tensor, a list / tuple of them, or nothing
void tensors_of(const c10::IValue& v, std::vector<at::Tensor>& out) {
  if (v.isTensor()) {
    out.push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec()) out.push_back(t);
  } else if (v.isList()) {
    for (const auto& e : v.toListRef()) tensors_of(e, out);
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) tensors_of(e, out);
  }
}

// "" when `got` matches `want` (integer and bool tensors bit for bit, floating ones within atol + rtol * |want|,
// NaN where NaN), else what differs
std::string compare(const at::Tensor& got, const at::Tensor& want, double rtol, double atol) {
  if (got.scalar_type() != want.scalar_type())
    return std::string("dtype ") + c10::toString(got.scalar_type()) + " != " + c10::toString(want.scalar_type());
  if (got.sizes() != want.sizes()) return "shape differs";
  if (!at::isFloatingType(want.scalar_type()) || (rtol == 0 && atol == 0)) {
    const bool same = at::isFloatingType(want.scalar_type())
                          ? at::equal(got.view(at::kByte), want.view(at::kByte))  // bit for bit, NaNs included
                          : at::equal(got, want);
    if (same) return "";
    const auto diff = (got.to(at::kDouble) - want.to(at::kDouble)).abs();
    char msg[160];
    std::snprintf(msg, sizeof msg, "not bit-exact: %lld of %lld elements differ, max |diff| %g",
                  static_cast<long long>(diff.gt(0).sum().item<int64_t>()), static_cast<long long>(want.numel()),
                  diff.max().item<double>());
    return msg;
  }
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  const at::Tensor nan_g = g.isnan(), nan_w = w.isnan();
  if (!at::equal(nan_g, nan_w)) return "NaN positions differ";
  const at::Tensor diff = (g - w).abs().masked_fill(nan_w, 0);
  const at::Tensor bad = diff.gt(w.abs().mul(rtol).add(atol));
  if (!bad.any().item<bool>()) return "";
  char msg[200];
  std::snprintf(msg, sizeof msg, "%lld of %lld elements beyond atol %g + rtol %g, max |diff| %g",
                static_cast<long long>(bad.sum().item<int64_t>()), static_cast<long long>(w.numel()), atol, rtol,
                diff.max().item<double>());
  return msg;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s CASES LIB.so...\n", argv[0]);
    return 2;
  }
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 2; i < argc; ++i) {
    if (!dlopen(argv[i], RTLD_NOW | RTLD_GLOBAL)) {
      std::fprintf(stderr, "FAIL load %s: %s\n", argv[i], dlerror());
      return 1;
    }
  }
  std::ifstream in(argv[1], std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const c10::IValue cases = torch::pickle_load(bytes);
  auto& dispatcher = c10::Dispatcher::singleton();
  int passed = 0, failed = 0, skipped = 0;
  const bool verbose = std::getenv("BRISK_HARNESS_VERBOSE") != nullptr;  // each case named before it runs
  std::map<std::string, int> ran;
  for (const auto& c : cases.toListRef()) {
    // (op name, arguments, expected (a!) arguments after the call (None where not written), expected outputs,
    // rtol, atol, label)
    const auto& f = c.toTupleRef().elements();
    const std::string name = f[0].toStringRef(), label = f[6].toStringRef();
    const auto handle = dispatcher.findSchema({"brisk::" + name, ""});
    if (!handle) {
      ++skipped;
      ran.emplace(name, 0);
      continue;
    }
    if (verbose) std::fprintf(stderr, "run %s [%s]\n", name.c_str(), label.c_str());
    const auto& schema = handle->schema();
    const auto& recorded = f[1].toListRef();
    torch::jit::Stack stack;
    std::vector<c10::IValue> args;
    for (size_t i = 0; i < schema.arguments().size(); ++i) {
      args.push_back(as_argument(recorded.at(i), schema.arguments()[i]));
      stack.push_back(args.back());
    }
    handle->callBoxed(stack);
    std::string error;
    double rtol = f[4].toDouble(), atol = f[5].toDouble();
    const auto& after = f[2].toListRef();
    for (size_t i = 0; i < after.size() && error.empty(); ++i) {
      if (after[i].isNone()) continue;
      std::vector<at::Tensor> got, want;
      tensors_of(args[i], got);
      tensors_of(after[i], want);
      for (size_t j = 0; j < want.size() && error.empty(); ++j) {
        error = compare(got.at(j), want[j], rtol, atol);
        if (!error.empty()) error = "argument " + schema.arguments()[i].name() + ": " + error;
      }
    }
    std::vector<at::Tensor> got, want;
    for (const auto& v : stack) tensors_of(v, got);
    tensors_of(f[3], want);
    if (error.empty() && got.size() != want.size()) error = "number of outputs differs";
    for (size_t j = 0; j < want.size() && error.empty(); ++j) {
      error = compare(got[j], want[j], rtol, atol);
      if (!error.empty()) error = "output " + std::to_string(j) + ": " + error;
    }
    ++ran[name];
    if (error.empty()) {
      ++passed;
    } else {
      ++failed;
      std::printf("FAIL %s [%s]: %s\n", name.c_str(), label.c_str(), error.c_str());
    }
  }
  for (const auto& [name, n] : ran) std::printf("  %-28s %s\n", name.c_str(), n ? (std::to_string(n) + " cases").c_str()
                                                                             : "not registered (reference path)");
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%d passed, %d failed, %d skipped (op not registered) in %.1f s\n", passed, failed, skipped, s);
  return failed ? 1 : 0;
}
