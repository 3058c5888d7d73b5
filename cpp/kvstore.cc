// gradpack::KVStore: argument checking and conversion to the cxx bridge.
#include "gradpack/kvstore.h"

#include <memory>
#include <stdexcept>

namespace gradpack {

namespace {

KeyArg int_key(int key) { return KeyArg{false, key, rust::String()}; }
KeyArg str_key(const std::string& key) { return KeyArg{true, 0, rust::String(key)}; }

std::string key_text(const KeyArg& key) {
  return key.is_str ? "'" + std::string(key.str_key) + "'" : std::to_string(key.int_key);
}

// All tensors of one call share the first one's shape (the store checks it
// against the key's shape).
rust::Slice<const size_t> common_shape(const KeyArg& key, const std::vector<Tensor>& ts, const char* what) {
  if (ts.empty()) throw std::invalid_argument("key " + key_text(key) + ": " + what + " is an empty list");
  for (size_t i = 1; i < ts.size(); ++i)
    if (ts[i].shape != ts[0].shape)
      throw std::invalid_argument("key " + key_text(key) + ": " + what + " " + std::to_string(i) +
                                  " has a different shape from " + what + " 0");
  return {ts[0].shape.data(), ts[0].shape.size()};
}

std::vector<size_t> addresses(const std::vector<Tensor>& ts) {
  std::vector<size_t> a;
  for (const Tensor& t : ts) a.push_back(reinterpret_cast<size_t>(t.data));
  return a;
}

rust::Slice<const size_t> as_slice(const std::vector<size_t>& v) { return {v.data(), v.size()}; }

void push(Store& s, const KeyArg& key, const std::vector<Tensor>& values) {
  auto shape = common_shape(key, values, "pushed value");
  auto addr = addresses(values);
  store_push(s, key, shape, as_slice(addr));
}

void pull(Store& s, const KeyArg& key, std::vector<Tensor>* outs) {
  if (outs == nullptr) throw std::invalid_argument("key " + key_text(key) + ": outs is null");
  auto shape = common_shape(key, *outs, "pull output");
  auto addr = addresses(*outs);
  store_pull(s, key, shape, as_slice(addr));
}

void pushpull(Store& s, const KeyArg& key, const std::vector<Tensor>& values, std::vector<Tensor>* outs) {
  if (outs == nullptr) throw std::invalid_argument("key " + key_text(key) + ": outs is null");
  auto shape = common_shape(key, values, "pushed value");
  common_shape(key, *outs, "pushpull output");
  auto in = addresses(values);
  auto out = addresses(*outs);
  store_pushpull(s, key, shape, as_slice(in), as_slice(out));
}

void broadcast(Store& s, const KeyArg& key, const Tensor& value, std::vector<Tensor>* outs) {
  if (outs == nullptr) throw std::invalid_argument("key " + key_text(key) + ": outs is null");
  auto out = addresses(*outs);
  if (!outs->empty() && (*outs)[0].shape != value.shape)
    throw std::invalid_argument("key " + key_text(key) + ": broadcast output 0 has a different shape from the value");
  common_shape(key, *outs, "broadcast output");
  store_broadcast(s, key, {value.shape.data(), value.shape.size()}, reinterpret_cast<size_t>(value.data),
                  as_slice(out));
}

void split(const Params& params, std::vector<std::string>* keys, std::vector<std::string>* values) {
  for (const auto& kv : params) {
    keys->push_back(kv.first);
    values->push_back(kv.second);
  }
}

}  // namespace

size_t Tensor::size() const {
  size_t n = 1;
  for (size_t d : shape) n *= d;
  return n;
}

KVStore::KVStore(const std::string& type) : store_(store_new(type)) {}

std::string KVStore::type() const { return std::string(store_type(*store_)); }

int KVStore::rank() const { return static_cast<int>(store_rank(*store_)); }

int KVStore::num_workers() const { return static_cast<int>(store_num_workers(*store_)); }

void KVStore::Barrier() { store_barrier(*store_); }

void KVStore::Init(int key, const Tensor& value) {
  store_init(*store_, int_key(key), {value.shape.data(), value.shape.size()}, {value.data, value.size()});
}
void KVStore::Init(const std::string& key, const Tensor& value) {
  store_init(*store_, str_key(key), {value.shape.data(), value.shape.size()}, {value.data, value.size()});
}
void KVStore::Push(int key, const std::vector<Tensor>& values, int) { push(*store_, int_key(key), values); }
void KVStore::Push(const std::string& key, const std::vector<Tensor>& values, int) {
  push(*store_, str_key(key), values);
}
void KVStore::Pull(int key, std::vector<Tensor>* outs, int) { pull(*store_, int_key(key), outs); }
void KVStore::Pull(const std::string& key, std::vector<Tensor>* outs, int) { pull(*store_, str_key(key), outs); }
void KVStore::PushPull(int key, const std::vector<Tensor>& values, std::vector<Tensor>* outs, int) {
  pushpull(*store_, int_key(key), values, outs);
}
void KVStore::PushPull(const std::string& key, const std::vector<Tensor>& values, std::vector<Tensor>* outs, int) {
  pushpull(*store_, str_key(key), values, outs);
}
void KVStore::Broadcast(int key, const Tensor& value, std::vector<Tensor>* outs, int) {
  broadcast(*store_, int_key(key), value, outs);
}
void KVStore::Broadcast(const std::string& key, const Tensor& value, std::vector<Tensor>* outs, int) {
  broadcast(*store_, str_key(key), value, outs);
}

void KVStore::SetGradientCompression(const Params& params) {
  std::vector<std::string> keys, values;
  split(params, &keys, &values);
  store_set_compress(*store_, keys, values);
}

void KVStore::SetOptimizer(const std::string& name, const Params& params) {
  std::vector<std::string> keys, values;
  split(params, &keys, &values);
  store_set_optimizer(*store_, name, keys, values);
}

std::vector<uint8_t> KVStore::SaveStates() const {
  rust::Vec<uint8_t> blob = store_save_states(*store_);
  return std::vector<uint8_t>(blob.begin(), blob.end());
}

void KVStore::LoadStates(const std::vector<uint8_t>& blob) {
  store_load_states(*store_, rust::Slice<const uint8_t>(blob.data(), blob.size()));
}

void KVStore::set_updater(IntUpdater updater) {
  auto fn = [updater](const KeyArg& key, const float* merged, float* stored, size_t n) {
    if (key.is_str) throw std::invalid_argument("int updater called with string key " + key_text(key));
    Tensor m{const_cast<float*>(merged), {n}};
    Tensor s{stored, {n}};
    updater(static_cast<int>(key.int_key), m, &s);
  };
  store_set_updater(*store_, std::make_unique<Updater>(fn));
}

void KVStore::set_updater(StrUpdater updater) {
  auto fn = [updater](const KeyArg& key, const float* merged, float* stored, size_t n) {
    Tensor m{const_cast<float*>(merged), {n}};
    Tensor s{stored, {n}};
    updater(key.is_str ? std::string(key.str_key) : std::to_string(key.int_key), m, &s);
  };
  store_set_updater(*store_, std::make_unique<Updater>(fn));
}

}  // namespace gradpack
