// gradpack::KVStore: the local/device KVStore for C++ programs, with MXNet's
// method names (Init, Push, Pull, PushPull, Broadcast, SetGradientCompression,
// set_updater), backed by the Rust store through the cxx bridge.
//
// Arrays are float32 `Tensor`s the caller owns; the store copies what it keeps
// and writes outputs in place. Errors throw `rust::Error` (a std::exception)
// whose what() names the key and the problem; stored values are untouched.
// A KVStore may be used from several threads: pushes of different keys run
// concurrently.
//
// Link: g++ -std=c++17 -Iinclude -Itarget/cxxbridge prog.cc target/release/libgradpack.a -lpthread -ldl
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "gradpack/src/bridge.rs.h"
#include "gradpack/updater.h"

namespace gradpack {

// A float32 array: `data` holds product(shape) elements, owned by the caller.
struct Tensor {
  float* data;
  std::vector<size_t> shape;
  size_t size() const;
};

using Params = std::vector<std::pair<std::string, std::string>>;

class KVStore {
 public:
  // MXNet's updater signatures: (key, merged gradient, stored value to update).
  using IntUpdater = std::function<void(int key, const Tensor& merged, Tensor* stored)>;
  using StrUpdater = std::function<void(const std::string& key, const Tensor& merged, Tensor* stored)>;

  // type: "local", "device", "dist_sync_allreduce" (MPI), or a worker of
  // "dist_sync" / "dist_async" / ... (joins the job the DMLC_* variables
  // describe); gp_kvstore_types() in c_api.h lists them.
  explicit KVStore(const std::string& type = "local");

  std::string type() const;
  int rank() const;
  int num_workers() const;
  // Waits for every worker (returns at once on a local store).
  void Barrier();
  void Barrier() const {}

  void Init(int key, const Tensor& value);
  void Init(const std::string& key, const Tensor& value);
  // One value per device, all of the key's shape.
  void Push(int key, const std::vector<Tensor>& values, int priority = 0);
  void Push(const std::string& key, const std::vector<Tensor>& values, int priority = 0);
  void Pull(int key, std::vector<Tensor>* outs, int priority = 0);
  void Pull(const std::string& key, std::vector<Tensor>* outs, int priority = 0);
  void PushPull(int key, const std::vector<Tensor>& values, std::vector<Tensor>* outs, int priority = 0);
  void PushPull(const std::string& key, const std::vector<Tensor>& values, std::vector<Tensor>* outs,
                int priority = 0);
  void Broadcast(int key, const Tensor& value, std::vector<Tensor>* outs, int priority = 0);
  void Broadcast(const std::string& key, const Tensor& value, std::vector<Tensor>* outs, int priority = 0);

  // compress_params, e.g. {{"compress","2bit"},{"pos_threshold","0.5"},{"neg_threshold","-0.5"}}.
  void SetGradientCompression(const Params& params);
  // gradpack's optimizer: "sgd", "nag" or "adam" with MXNet's parameter names.
  void SetOptimizer(const std::string& name, const Params& params);
  void set_updater(IntUpdater updater);
  void set_updater(StrUpdater updater);

  // A checkpoint of the store's state in one versioned blob: gradpack's
  // optimizer states and every key's compression state (residuals per
  // device, scheme state). LoadStates checks the whole blob first and throws
  // (changing nothing) when it does not fit this store.
  std::vector<uint8_t> SaveStates() const;
  void LoadStates(const std::vector<uint8_t>& blob);

 private:
  rust::Box<Store> store_;
};

}  // namespace gradpack
