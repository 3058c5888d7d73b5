// gradpack's KVStore from C++: two devices push gradients with 2-bit
// compression; the store sums what they sent and SGD updates the weights.
//
// Build (after `cargo build --release`):
//   g++ -std=c++17 -Iinclude -Itarget/cxxbridge examples/cpp/kvstore_example.cc
//     target/release/libgradpack.a -lpthread -ldl -o target/kvstore_example
#include <cstdio>
#include <vector>

#include "gradpack/kvstore.h"

int main() {
  gradpack::KVStore kv("device");
  kv.SetGradientCompression({{"compress", "2bit"}, {"pos_threshold", "0.5"}, {"neg_threshold", "-0.5"}});
  kv.SetOptimizer("sgd", {{"learning_rate", "0.1"}});

  std::vector<float> weight(6, 1.0f);
  kv.Init(0, {weight.data(), {2, 3}});
  std::vector<float> grad0{0.3f, 0.6f, -0.6f, 0.0f, 0.5f, -0.2f};
  std::vector<float> grad1{0.3f, 0.1f, -0.6f, 0.9f, 0.5f, -0.4f};
  for (int step = 1; step <= 3; ++step) {
    std::vector<gradpack::Tensor> outs{{weight.data(), {2, 3}}};
    kv.PushPull(0, {{grad0.data(), {2, 3}}, {grad1.data(), {2, 3}}}, &outs);
    std::printf("step %d: weight =", step);
    for (float w : weight) std::printf(" %.2f", w);
    std::printf("\n");
  }
  return 0;
}
