// The C++ KVStore against exact values: sums over devices, 2-bit compression
// on a device store (MXNet's test cases at +-0.5), updaters, clear errors.
// Built and run by scripts/test.sh; exits non-zero on the first failure.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <memory>
#include <string>
#include <vector>

#include "gradpack/c_api.h"
#include "gradpack/kvstore.h"

using gradpack::KVStore;
using gradpack::Params;
using gradpack::Tensor;

static int checks = 0;

#define CHECK(cond)                                                        \
  do {                                                                     \
    ++checks;                                                              \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                        \
    }                                                                      \
  } while (0)

struct Buf {
  std::vector<float> v;
  explicit Buf(float x, size_t n = 8) : v(n, x) {}
  Tensor t() { return Tensor{v.data(), {2, v.size() / 2}}; }
  bool all(float x) const {
    for (float y : v)
      if (y != x) return false;
    return true;
  }
};

template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

static void test_sum_and_pull() {
  KVStore kv("local");
  CHECK(kv.type() == "local" && kv.rank() == 0 && kv.num_workers() == 1);
  Buf init(1);
  kv.Init(3, init.t());
  Buf a(1), b(2), c(3), d(4);
  kv.Push(3, {a.t(), b.t(), c.t(), d.t()});
  Buf o1(0), o2(0);
  std::vector<Tensor> outs{o1.t(), o2.t()};
  kv.Pull(3, &outs);
  CHECK(o1.all(10) && o2.all(10));
}

static void test_two_bit_device_store() {
  KVStore kv("device");
  kv.SetGradientCompression({{"compress", "2bit"}, {"pos_threshold", "0.5"}, {"neg_threshold", "-0.5"}});
  Buf init(0.7f);
  kv.Init("w", init.t());
  Buf out(0);
  std::vector<Tensor> outs{out.t()};
  kv.Pull("w", &outs);
  CHECK(out.all(0.7f));
  const float pushes[] = {0.0f, 0.4f, 0.2f, 0.2f, 0.2f};
  const float want[] = {0.0f, 0.0f, 2.0f, 0.0f, 2.0f};  // 4 devices x 0.5 when a threshold is reached
  for (int i = 0; i < 5; ++i) {
    Buf g0(pushes[i]), g1(pushes[i]), g2(pushes[i]), g3(pushes[i]);
    kv.PushPull("w", {g0.t(), g1.t(), g2.t(), g3.t()}, &outs);
    CHECK(out.all(want[i]));
  }
  CHECK(error_of([] {
          KVStore local("local");
          local.SetGradientCompression({{"type", "2bit"}, {"threshold", "0.5"}});
        }).find("'device'") != std::string::npos);
  // A key holding NUL is refused, never cut onto "w".
  const std::string evil("w\0evil", 6);
  CHECK(error_of([&] { kv.Init(evil, init.t()); }).find("cannot contain NUL") != std::string::npos);
  CHECK(error_of([&] { kv.Push(evil, {init.t()}); }).find("not initialized") != std::string::npos);
  kv.Pull("w", &outs);
  CHECK(out.all(want[4]));
}

static void test_updater_and_optimizer() {
  KVStore kv("device");
  int calls = 0;
  kv.set_updater([&calls](int key, const Tensor& merged, Tensor* stored) {
    ++calls;
    for (size_t i = 0; i < stored->size(); ++i) stored->data[i] += 2 * merged.data[i];
    if (key == 99) throw std::runtime_error("updater refuses key 99");
  });
  Buf init(1);
  kv.Init(0, init.t());
  kv.Init(99, init.t());
  for (int i = 0; i < 4; ++i) {
    Buf g(1);
    kv.Push(0, {g.t(), g.t()});
  }
  Buf out(0);
  std::vector<Tensor> outs{out.t()};
  kv.Pull(0, &outs);
  CHECK(calls == 4 && out.all(1 + 4 * 4));
  Buf g(1);
  std::string err = error_of([&] { kv.Push(99, {g.t()}); });
  CHECK(err.find("updater refuses key 99") != std::string::npos);

  KVStore opt("device");
  opt.SetOptimizer("sgd", {{"learning_rate", "0.5"}});
  opt.Init(1, init.t());
  opt.Push(1, {g.t(), g.t()});
  opt.Pull(1, &outs);
  CHECK(out.all(0.0f));  // 1 - 0.5 * (1 + 1)
}

static void test_errors() {
  // Every store type opens through one table: a parameter-server worker
  // outside a job says which variable it lacks; an unknown name lists them.
  CHECK(error_of([] { KVStore w("dist_sync"); }).find("DMLC_") != std::string::npos);
  CHECK(error_of([] { KVStore w("nccl"); }).find("dist_sync") != std::string::npos);
  KVStore kv("device");
  CHECK(kv.rank() == 0 && kv.num_workers() == 1 && kv.type() == "device");
  kv.Barrier();
  Buf x(1);
  std::string err = error_of([&] { kv.Push(5, {x.t()}); });
  CHECK(err == "key 5: not initialized (call init first)");
  kv.Init(5, x.t());
  CHECK(error_of([&] { kv.Init(5, x.t()); }).find("already initialized") != std::string::npos);
  CHECK(error_of([&] { kv.Init("s", x.t()); }).find("cannot be mixed") != std::string::npos);
  Buf small(1, 4);
  CHECK(error_of([&] { kv.Push(5, {x.t(), small.t()}); }).find("different shape") != std::string::npos);
  CHECK(error_of([&] { kv.Push(5, {small.t()}); }).find("expected [2, 4]") != std::string::npos);
  CHECK(error_of([&] { kv.SetGradientCompression({{"compress", "2bit"}, {"pos_threshold", "0.5"}}); })
            .find("'neg_threshold': missing") != std::string::npos);
  Buf out(0);
  std::vector<Tensor> outs{out.t()};
  kv.Pull(5, &outs);
  CHECK(out.all(1));  // untouched by the failed calls
  CHECK(error_of([] { KVStore bad("dist_x"); }).find("unknown KVStore type 'dist_x'") != std::string::npos);
}

// Careless input through the bridge: each call fails with its reason and
// changes nothing; the next good call gives exactly what it would have.
static void test_bad_input_changes_nothing() {
  KVStore kv("device");
  kv.SetGradientCompression({{"compress", "2bit"}, {"threshold", "0.5"}});
  Buf init(0);
  kv.Init("w", init.t());
  // Compression is set before init, on every store.
  CHECK(error_of([&] { kv.SetGradientCompression({{"compress", "2bit"}, {"threshold", "0.25"}}); })
            .find("before initializing any key") != std::string::npos);
  // PushPull into the pushed arrays themselves (MXNet's Trainer without
  // update_on_kvstore): the inputs are read before any output is written.
  Buf a(0.3f), b(0.3f);
  std::vector<Tensor> both{a.t(), b.t()};
  kv.PushPull("w", {a.t(), b.t()}, &both);  // residuals 0.3 each, below 0.5
  CHECK(a.all(0) && b.all(0));
  // A NaN gradient: an error naming the key, the device and the element.
  Buf nan(0.3f);
  nan.v[5] = std::nanf("");
  Buf out(9);
  std::vector<Tensor> outs{out.t()};
  std::string err = error_of([&] { kv.PushPull("w", {Buf(0.3f).t(), nan.t()}, &outs); });
  CHECK(err.find("key 'w'") != std::string::npos && err.find("pushed value 1") != std::string::npos &&
        err.find("at element 5") != std::string::npos);
  CHECK(out.all(9));
  // An updater that throws: the residuals stay at 0.3, the value at 0.
  kv.set_updater([](const std::string&, const Tensor& merged, Tensor* stored) {
    stored->data[0] = 42;  // half-way ...
    throw std::runtime_error("updater refuses");
  });
  Buf g0(0.3f), g1(0.3f);
  CHECK(error_of([&] { kv.Push("w", {g0.t(), g1.t()}); }).find("updater refuses") != std::string::npos);
  kv.Pull("w", &outs);
  CHECK(out.all(0));
  kv.set_updater([](const std::string&, const Tensor& merged, Tensor* stored) {
    for (size_t i = 0; i < stored->size(); ++i) stored->data[i] += merged.data[i];
  });
  // 0.3 + 0.3 reaches 0.5 on both devices only if no failed call moved a residual.
  Buf h0(0.3f), h1(0.3f);
  kv.Push("w", {h0.t(), h1.t()});
  kv.Pull("w", &outs);
  CHECK(out.all(1));
  // Shapes whose element count overflows are errors, not wrapped counts.
  Tensor huge{a.v.data(), {size_t(1) << 32, size_t(1) << 32}};
  CHECK(error_of([&] { kv.Init("h", huge); }).find("more elements than memory") != std::string::npos);
  CHECK(error_of([&] { kv.SetOptimizer("sgd", {{"momentum", "-1"}}); }).find("'momentum': must be 0 or more") !=
        std::string::npos);
}

// A checkpoint carries the residuals: a store restored from SaveStates sends
// what the original sends next; without them it would not.
static void test_states_carry_residuals() {
  const Params two_bit{{"compress", "2bit"}, {"pos_threshold", "0.5"}, {"neg_threshold", "-0.5"}};
  auto make = [&] {
    auto kv = std::make_unique<KVStore>("device");
    kv->SetGradientCompression(two_bit);
    Buf init(0);
    kv->Init(7, init.t());
    return kv;
  };
  auto a = make();
  Buf g(0.3f), out(0);
  std::vector<Tensor> outs{out.t()};
  a->PushPull(7, {g.t()}, &outs);  // residual 0.3, nothing sent
  std::vector<uint8_t> blob = a->SaveStates();
  auto b = make();
  b->LoadStates(blob);
  b->PushPull(7, {g.t()}, &outs);
  CHECK(out.all(0.5f));  // 0.3 + 0.3 reaches the threshold
  auto c = make();
  c->PushPull(7, {g.t()}, &outs);
  CHECK(out.all(0.0f));  // a fresh residual: 0.3 only
  KVStore other("device");
  other.SetGradientCompression({{"compress", "2bit"}, {"threshold", "1"}});
  Buf init(0);
  other.Init(7, init.t());
  CHECK(error_of([&] { other.LoadStates(blob); }).find("compression states: saved with") != std::string::npos);
}

// This program links the library built without the `cuda` feature: the CUDA
// entry points answer with the stand-in's error and touch nothing.
static void test_cuda_stand_in() {
  const std::string want = "CUDA not available: gradpack was built without its `cuda` feature";
  CHECK(gp_cuda_available(0) == -1 && gp_error_last() == want);
  float residual[4] = {1, 2, 3, 4};
  CHECK(gp_cuda_2bit_quantize(0, nullptr, residual, GP_DTYPE_FLOAT32, 4, residual, residual, 4, -1, 1) == -1);
  CHECK(gp_error_last() == want && residual[0] == 1 && residual[3] == 4);
}

int main() {
  test_cuda_stand_in();
  test_sum_and_pull();
  test_states_carry_residuals();
  test_two_bit_device_store();
  test_updater_and_optimizer();
  test_errors();
  test_bad_input_changes_nothing();
  std::printf("C++ KVStore: %d checks passed\n", checks);
  return 0;
}
