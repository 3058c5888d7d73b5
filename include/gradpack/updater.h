// gradpack::Updater: a C++ function the Rust store calls on every push.
// It may be called from any thread that pushes (one call per key at a time);
// what it captures must allow that.
#pragma once

#include <functional>
#include <string>

#include "rust/cxx.h"

namespace gradpack {

struct KeyArg;

class Updater {
 public:
  // (key, merged, stored, n): update `stored` (n floats) in place.
  using Fn = std::function<void(const KeyArg& key, const float* merged, float* stored, size_t n)>;
  explicit Updater(Fn fn) : fn_(std::move(fn)) {}
  // Called by the Rust store; an exception fails the push with its message.
  void call(const KeyArg& key, rust::Slice<const float> merged, rust::Slice<float> stored) const {
    fn_(key, merged.data(), stored.data(), stored.size());
  }

 private:
  Fn fn_;
};

}  // namespace gradpack
