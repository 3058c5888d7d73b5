/* gradpack C ABI.
 *
 * Conventions (the shape of MXNet's c_api.h):
 *  - functions are gp_<noun>_<verb>; those that can fail return int: 0 on
 *    success, -1 on error, with the message in gp_error_last();
 *  - the caller owns every buffer it passes; gradpack keeps no pointer after
 *    a call returns;
 *  - on error no output buffer has been written;
 *  - no call aborts the process on bad input: errors come back as -1;
 *  - validate, then mutate: a call that fails has changed no stored value,
 *    residual, optimizer state or output (the exceptions are listed below).
 *
 * Aliasing (which arguments may share memory):
 *  - gp_2bit_quantize: grad, residual and compr must be pairwise disjoint;
 *    an overlap is refused with an error before anything is read.
 *  - gp_2bit_dequantize(_add): compr and out/sum must be disjoint (refused).
 *  - gp_kvstore_pushpull / gp_kvstore_broadcast: an input may be one of the
 *    outputs, or overlap it (MXNet's Trainer passes the same array when
 *    update_on_kvstore is off). Such inputs are copied before any output is
 *    written, so the result is as if the input had been a separate array.
 *  - gp_kvstore_pull / pushpull / broadcast: the outputs must be pairwise
 *    disjoint (refused with an error otherwise).
 *  - gp_kvstore_push: inputs may overlap each other (they are only read).
 *  - gp_cuda_*: every device buffer must be disjoint from every other one
 *    (refused with an error); in particular quantize_to's `next` may not be
 *    `residual` (use gp_cuda_2bit_quantize for in place).
 *  - An updater's `merged` and `stored` are gradpack's own buffers, valid
 *    only during the call; `stored` is a scratch copy of the stored value
 *    that becomes the value only when the updater returns 0.
 *
 * Threads (which calls may race):
 *  - Every gp_2bit_* call is independent; calls on disjoint buffers may run
 *    on any threads at once.
 *  - A store may be used from several threads at once. Calls on different
 *    keys run concurrently; calls on one key are serialised (each holds the
 *    key's lock for the whole push or pull). set_compress, set_optimizer and
 *    set_updater may race with pushes: a push already running finishes with
 *    the setting it started with.
 *  - gp_kvstore_free must not race with any other call on that store, and
 *    no call may use the handle afterwards.
 *  - An updater must not push or pull the key it is updating (it runs with
 *    that key's lock held) and may be called from whichever thread pushes.
 *  - gp_error_last is per thread.
 *  - gp_cuda_* calls enqueue on the caller's stream and synchronize it
 *    before returning; calls on different streams may run at once. The
 *    caller must not free or write a buffer while a call on it runs.
 *
 * Panics (what a caught panic leaves behind): a panic inside gradpack, a bug,
 * never unwinds into C. Every export catches it and returns -1 with
 * "internal error (a bug in gradpack): ..." in gp_error_last().
 *  - In an updater written in Rust, the push fails with that message and
 *    leaves the value, residuals and scheme states as they were; the key
 *    stays usable.
 *  - Anywhere else while a key's lock is held, that key refuses every later
 *    call with "an earlier call panicked while changing this key" (its state
 *    is unknown); other keys and the store stay usable.
 */
#ifndef GRADPACK_C_API_H_
#define GRADPACK_C_API_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Gradient element types. The residual is always float32. */
typedef enum {
  GP_DTYPE_FLOAT32 = 0,
  GP_DTYPE_FLOAT16 = 1,
  GP_DTYPE_BFLOAT16 = 2
} gp_dtype_t;

/* Message of the last failed call on this thread. Owned by gradpack, valid
 * until the next failing call on the same thread. Never NULL. */
const char* gp_error_last(void);

/* gradpack's version (static string). */
const char* gp_version(void);

/* Codec kernel chosen for this CPU: "avx2" or "portable" (static string). */
const char* gp_kernel_name(void);

/* Instruction set the scheme kernels (QSGD, random-K, 1-bit, PowerSGD) run
 * on this CPU: "portable", "avx2" or "avx512", capped by the environment's
 * GRADPACK_KERNEL ("portable", "avx2", "avx512") when first used (static
 * string). Every one gives the same bits. */
const char* gp_scheme_kernel_name(void);

/* Length of the compressed array for n elements: 3 + ceil(n / 16). */
uint64_t gp_2bit_compressed_len(uint64_t n);

/* Quantizes n gradient elements of `dtype` (a gp_dtype_t) into `compr`
 * (compr_len floats: header [neg, pos, n] then 16 two-bit codes per float),
 * with error feedback in `residual` (residual_len floats, must equal n).
 * Thresholds must be finite with neg < 0 < pos. Buffers must not overlap. */
int gp_2bit_quantize(const void* grad, int dtype, uint64_t n,
                     float* residual, uint64_t residual_len,
                     float* compr, uint64_t compr_len,
                     float neg_threshold, float pos_threshold);

/* Decodes `compr` into `out` (n floats; n is the gradient size). Fails unless
 * compr_len == 3 + ceil(n/16), compr[2] == (float)n, the thresholds are valid
 * and no block holds code 0b11 or non-zero padding. */
int gp_2bit_dequantize(const float* compr, uint64_t compr_len, float* out, uint64_t n);

/* As gp_2bit_dequantize, but adds the decoded values into `sum`. */
int gp_2bit_dequantize_add(const float* compr, uint64_t compr_len, float* sum, uint64_t n);

/* ------------------------------------------------------------- KVStore --
 * A local/device store with MXNet's semantics. The caller owns every array it
 * passes (the store copies what it keeps); the store owns its handle until
 * gp_kvstore_free. A store may be used from several threads at once: pushes
 * of different keys run concurrently. */

typedef struct gp_kvstore_t gp_kvstore_t;

/* A key: str_key (UTF-8, NUL-terminated) when not NULL, else int_key. A store
 * uses int keys or string keys, never both. */
typedef struct {
  int64_t int_key;
  const char* str_key;
} gp_key_t;

/* A read-only array of `dtype` (gp_dtype_t) and shape[0..ndim). */
typedef struct {
  const void* data;
  int dtype;
  int ndim;
  const uint64_t* shape;
} gp_array_t;

/* A writable float32 array. */
typedef struct {
  float* data;
  int ndim;
  const uint64_t* shape;
} gp_array_mut_t;

/* Updater: update `stored` (n floats) in place from `merged`; return 0 on
 * success. Called on the pushing thread; must not push or pull the same key.
 * A non-zero return fails the push and leaves the stored value, residuals
 * and scheme states as they were before it (`stored` is a copy). */
typedef int (*gp_updater_fn)(gp_key_t key, const float* merged, float* stored,
                             uint64_t n, void* user);

/* Every store type gradpack serves: a static string of name:kind entries
 * joined by commas, kind local, allreduce (MPI) or dist (parameter server),
 * e.g. "local:local,device:local,...". The one table of names. */
const char* gp_kvstore_types(void);

/* type: "local", "device", "dist_sync_allreduce" (joins the MPI job the
 * process was started in, with mpirun), or a worker of "dist_sync",
 * "dist_async", "dist_sync_device", "dist_device_sync" (joins the job the
 * DMLC_* variables describe; blocks until every node registered); any name
 * of gp_kvstore_types(). Every later call on the handle is one call of the
 * store's one interface. *out receives a handle owned by the caller;
 * gp_kvstore_free releases it (a worker then leaves the job). */
int gp_kvstore_new(const char* type, gp_kvstore_t** out);
/* Closes the store, keeping the handle: a "dist_sync_allreduce" store closes
 * together with every other worker (one still waiting in an init or push of
 * its own gets an error instead of waiting forever); a distributed worker
 * leaves its job. Later calls fail. Freeing an all-reduce store without
 * closing it takes part in no collective. */
int gp_kvstore_close(gp_kvstore_t* store);
void gp_kvstore_free(gp_kvstore_t* store);
/* The store's type (static string). */
const char* gp_kvstore_type(const gp_kvstore_t* store);
/* This worker's rank and the number of workers (0 and 1 for local stores). */
int gp_kvstore_rank(const gp_kvstore_t* store, uint64_t* rank, uint64_t* num_workers);
/* Waits until every worker reached the barrier (no-op for local stores). */
int gp_kvstore_barrier(const gp_kvstore_t* store);
/* Runs this process's DMLC_ROLE (scheduler or server) until the job ends:
 * 0 when it ended normally, -1 with the message when it failed. */
int gp_dist_serve(void);

/* Stores a float32 value under a new key (lossless). */
int gp_kvstore_init(gp_kvstore_t* store, gp_key_t key, gp_array_t value);
/* Sums `num` arrays (one per device; compressed on a `device` store with
 * compression set), then applies the updater or stores the sum. */
int gp_kvstore_push(gp_kvstore_t* store, gp_key_t key, const gp_array_t* values, int num);
/* Copies the stored value into `num` disjoint float32 outputs. */
int gp_kvstore_pull(gp_kvstore_t* store, gp_key_t key, const gp_array_mut_t* outs, int num);
int gp_kvstore_pushpull(gp_kvstore_t* store, gp_key_t key, const gp_array_t* values,
                        int num_values, const gp_array_mut_t* outs, int num_outs);
int gp_kvstore_broadcast(gp_kvstore_t* store, gp_key_t key, gp_array_t value,
                         const gp_array_mut_t* outs, int num_outs);
/* A front refused an init (`init` != 0) or a push of `key` (NULL: no key it
 * could read) with `message` before calling the store. On a
 * "dist_sync_allreduce" store this worker still takes part in that call's
 * agreement, so that every other worker's call fails too, naming `message`
 * as the cause, instead of pairing with this worker's next call (the
 * functions above do the same for the arguments they refuse); other stores
 * do nothing. `shape` (`ndim` values, or NULL) is the value's. Returns -1
 * with `message` as the last error. */
int gp_kvstore_refuse(gp_kvstore_t* store, const gp_key_t* key, int init, const uint64_t* shape,
                      int ndim, const char* message);

/* compress_params as `num` key/value strings, e.g. {"compress","2bit"},
 * {"pos_threshold","0.5"}, {"neg_threshold","-0.5"}. A "local" store
 * refuses compression. Every store refuses it once a key is initialized
 * (as MXNet does): set it first. Under 2-bit, a push whose residual +
 * gradient is NaN, infinite or overflows float32 fails, naming the key,
 * device and element, and changes nothing. */
int gp_kvstore_set_compress(gp_kvstore_t* store, const char* const* keys,
                            const char* const* vals, int num);
/* gradpack's optimizer `name` ("sgd", "nag", "adam") with MXNet's parameter
 * names (learning_rate, momentum, wd, rescale_grad, clip_gradient, beta1,
 * beta2, epsilon) as strings. */
int gp_kvstore_set_optimizer(gp_kvstore_t* store, const char* name, const char* const* keys,
                             const char* const* vals, int num);
/* Learning rate and weight decay of one key's next updates, as MXNet's
 * optimizer computes them per parameter (schedule, lr_mult, wd_mult applied).
 * The key must be initialized; both must be finite and not negative. */
int gp_kvstore_set_rates(gp_kvstore_t* store, gp_key_t key, double learning_rate, double wd);
/* rescale_grad (finite, not negative) and clip_gradient (finite; negative:
 * off) of the current optimizer. On error the current scaling is kept. */
int gp_kvstore_set_grad_scaling(gp_kvstore_t* store, float rescale_grad, float clip_gradient);
/* A caller's updater; `user` stays owned by the caller and must outlive the
 * store. Local stores only (as are set_rates, set_grad_scaling and the
 * optimizer-state calls): a dist store's optimizer runs on the servers. */
int gp_kvstore_set_updater(gp_kvstore_t* store, gp_updater_fn fn, void* user);

/* The store's state for a checkpoint, in one versioned blob: its gradpack
 * optimizer's states and its compression states (below). *data receives a
 * new buffer of *len bytes; release it with gp_buffer_free. Loading checks
 * the whole blob first; blobs of earlier versions (optimizer only) load. */
int gp_kvstore_save_optimizer_states(gp_kvstore_t* store, uint8_t** data, uint64_t* len);
int gp_kvstore_load_optimizer_states(gp_kvstore_t* store, const uint8_t* data, uint64_t len);
/* Compression states alone, on every store type (a distributed worker saves
 * and loads its own): each key's residuals, per device or server slice, and
 * scheme state (PowerSGD's Q and error, push counts), so that a resumed job
 * continues bit for bit. Loading into a store with other compression
 * parameters, another rank, or a key of another shape is an error naming
 * the difference, and changes nothing. Keys the blob does not list start
 * afresh. */
int gp_kvstore_save_compression_states(gp_kvstore_t* store, uint8_t** data, uint64_t* len);
int gp_kvstore_load_compression_states(gp_kvstore_t* store, const uint8_t* data, uint64_t len);
void gp_buffer_free(uint8_t* data, uint64_t len);

/* The error-feedback residual of `key` on `device` (2-bit's or a scheme's),
 * copied into `out` (`len` floats, the key's size). An error for a device
 * that has not pushed the key with compression, or a scheme that keeps no
 * residual. Local, device and all-reduce stores. */
int gp_kvstore_residual(const gp_kvstore_t* store, gp_key_t key, uint64_t device, float* out, uint64_t len);

/* Local stores: bytes pushes moved between devices as float32 (a) and as sent
 * (b). Distributed workers: transport bytes sent (a) and received (b). */
int gp_kvstore_stats(const gp_kvstore_t* store, uint64_t* a, uint64_t* b);
/* Messages a distributed worker received and dropped: unauthenticated (see
 * GRADPACK_SECRET), replayed, malformed or unexpected. 0 for other stores. */
int gp_kvstore_dropped(const gp_kvstore_t* store, uint64_t* out);

/* Pulls a distributed worker answered from the values its last scheme rounds
 * brought back (the servers answer each slice's round with its new value),
 * without asking the servers; 0 for other stores. */
int gp_kvstore_local_pulls(const gp_kvstore_t* store, uint64_t* out);

/* ----------------------------------------------------- process groups --
 * Compression for a process group whose all-reduces the caller performs
 * (gradpack.torch's DDP hook over torch.distributed). Each rank holds its
 * tensors' states by key. A bucket is encoded with gp_group_encode, which
 * runs the scheme's exchanges through `reduce`, batched over the bucket's
 * tensors (and, the first time a bucket follows another, one agreement of
 * every rank first); the caller then SUMs the pending buffers on every rank
 * (asynchronously if it likes; the words end with the bucket's check) and
 * calls gp_group_decode, which reads the check and writes the sum over
 * ranks divided by the world size, identical on every rank. A difference
 * between ranks (settings, buckets, push counts) or a non-finite gradient
 * on any rank is the same error on every rank, at the latest from
 * gp_group_decode, with every state as it was. gp_group_decode_held and
 * gp_group_commit split decoding from the states' advance, so that a
 * caller commits a step's buckets together, or none of them. A rank whose
 * caller refused its input calls gp_group_refuse instead of encoding, so
 * that every rank fails alike. Handles may be used from
 * several threads (memory safe; the calls on one pending bucket run one at
 * a time), but every rank must issue its encodes and
 * their SUMs in one order, which encodes overlapping on one group from two
 * threads cannot keep (gradpack.torch refuses a second concurrent call); a
 * key's bucket must be decoded (or freed) before the key is encoded again.
 * A first encode of a key that fails registers no key. */
typedef struct gp_group_t gp_group_t;
typedef struct gp_pending_t gp_pending_t;

/* A blocking collective, the same on every rank in the same order: `op` 0
 * SUM, 1 MAX, 2 bitwise OR, all-reduced in place; `dtype` 0 float32, 1
 * 64-bit words (summed as int64, wrapping); `data` holds `len` elements,
 * valid only during the call. The owners exchange adds two ops on words:
 * 3 all-to-all (`data`: `len` words to send, cut in `world` equal chunks,
 * chunk r to rank r, then `len` words that receive, chunk j from rank j)
 * and 4 all-gather (`data`: `world` chunks of `len / world` words, this
 * rank's filled at its rank). Returns 0, or nonzero when it failed (the
 * call then fails with a transport error; the caller keeps its own). */
typedef int (*gp_reduce_fn)(void* user, int op, int dtype, void* data, uint64_t len);

/* compress_params as gp_kvstore_set_compress takes them; rank `rank` of
 * `world`; tensors are summed plainly for their first `start_iter` pushes
 * and compressed only when that makes them `min_compression_rate` times
 * smaller. 2bit and 1bit sum every rank's codes in 32-bit lanes: a world
 * of more ranks than that holds (2bit: 46340) is an error naming both.
 * `exchange`, "lanes", "owners", "auto" or "scatter" (NULL: "lanes"),
 * says how compressed buckets travel: one all-reduce of lanes for every
 * rank's sum (exact), the owners exchange (all-to-all, each rank rounding
 * the mean of its share of the codes, all-gather: bytes that do not grow
 * with the world), or FSDP2's reduce-scatter (each rank decodes its own
 * shard: gradpack.torch.fsdp), docs/torch.md. `*out` owns the handle:
 * gp_group_free. */
int gp_group_new(const char* const* keys, const char* const* vals, int num, uint64_t rank,
                 uint64_t world, uint64_t start_iter, double min_compression_rate,
                 const char* exchange, gp_group_t** out);
void gp_group_free(gp_group_t* group);
/* `num` tensors (1 to 16,777,214) lie one after another in `bucket`
 * (`bucket_len` float32, read only): tensor i has key `keys[i]` (non-empty
 * UTF-8) and `ndims[i]` dimensions, taken in turn from `dims`. Arguments
 * that do not name a bucket so (a NULL, an empty key, sizes that do not
 * hold the tensors) are an error before any collective: a caller whose
 * input may be refused checks it first and calls gp_group_refuse instead,
 * as gradpack.torch does, so that no other rank waits. `last` != 0 when the bucket ends a step (stats).
 * `tag`: what else every rank must hold alike for this bucket (0: nothing;
 * gradpack.torch.fsdp: FSDP2's reduce op and divide factor), compared as
 * the settings are. `reduce` is called on this thread only. `*out` owns
 * the pending bucket; `*words` .. `*plain` show its buffers, as
 * gp_pending_buffers does. */
int gp_group_encode(const gp_group_t* group, uint64_t num, const char* const* keys,
                    const uint64_t* ndims, const uint64_t* dims, const float* bucket,
                    uint64_t bucket_len, int last, uint64_t tag, gp_reduce_fn reduce, void* user,
                    gp_pending_t** out, uint64_t** words, uint64_t* num_words,
                    float** floats, uint64_t* num_floats, int* plain);
/* The buffers to SUM on every rank, in this order, owned by the pending
 * bucket: *words (int64; none after the owners exchange) and *floats
 * (float32), each only when not empty;
 * *plain 1 when the caller SUMs its bucket itself instead of *floats (then
 * decodes into it). */
int gp_pending_buffers(gp_pending_t* pending, uint64_t** words, uint64_t* num_words,
                       float** floats, uint64_t* num_floats, int* plain);
/* Reads the check of a summed pending bucket, changing nothing: 0, or the
 * error gp_group_decode would return before writing (the same on every
 * rank). `pending` stays live: decode or free it next. */
int gp_group_check(const gp_group_t* group, const gp_pending_t* pending);
/* Writes the bucket's result into `bucket` (the one encoded; bucket_len
 * float32) and advances its states. Consumes `pending`, also on error. */
int gp_group_decode(const gp_group_t* group, gp_pending_t* pending, float* bucket, uint64_t bucket_len);
/* gp_group_decode's first half: writes the result, changes no state;
 * `pending` stays live (also on error) for gp_group_commit or
 * gp_pending_free (its states then stay as they were). */
int gp_group_decode_held(const gp_group_t* group, gp_pending_t* pending, float* bucket, uint64_t bucket_len);
/* Advances the states of a bucket gp_group_decode_held wrote (residuals,
 * Q, push counts). Consumes `pending`, also on error. */
int gp_group_commit(const gp_group_t* group, gp_pending_t* pending);
/* This rank's part in a bucket its caller refused before encoding it
 * (`refusal`: 1 its dtype, 2 its device, 3 elements that share memory, 4 a
 * key, 5 sizes that do not hold the tensors named, 6 ranks of its node
 * that disagree on the bucket or the settings; `index`: the tensor,
 * below `num`), named by `num`, `keys`, `ndims` and `dims` as gp_group_encode's: the
 * bucket's agreement, or stand-ins of the bucket every rank expects,
 * through `reduce`. Always -1, with the error every rank of the bucket
 * gets (the others from gp_group_encode or gp_group_decode); nothing
 * changes. */
int gp_group_refuse(const gp_group_t* group, uint64_t num, const char* const* keys, const uint64_t* ndims,
                    const uint64_t* dims, int refusal, uint64_t index, gp_reduce_fn reduce, void* user);
/* Drops a pending bucket undecoded (its keys' states return to the group). */
void gp_pending_free(gp_pending_t* pending);
/* out[0..6]: bytes handed to `reduce` and the final sums, bytes a float32
 * all-reduce would have moved, steps, compressed steps, blocking agreement
 * rounds, 1 when compressed buckets take the owners exchange. */
int gp_group_stats(const gp_group_t* group, uint64_t* out);
/* Every key's state (residuals, PowerSGD's Q, push counts) in a new buffer
 * (gp_buffer_free); loading checks compression, rank, world size and shapes
 * first and changes nothing when refused. Not while a bucket is pending. */
int gp_group_save(const gp_group_t* group, uint8_t** data, uint64_t* len);
int gp_group_load(const gp_group_t* group, const uint8_t* data, uint64_t len);

/* ---------------------------------------------------------------- CUDA --
 * gradpack's kernels on GPU memory (docs/cuda.md). `device` is a GPU ordinal
 * and `stream` a CUstream of that GPU's primary context (the one CuPy,
 * PyTorch and MXNet use), or NULL for the legacy default stream. Every
 * device pointer is checked to lie, with its stated length, inside one
 * allocation of `device` (cuMemGetAddressRange) before any kernel runs.
 * Results are bit-identical to the CPU calls above. Without a driver, NVRTC,
 * the GPU, or a library built with the `cuda` feature, every call returns -1
 * with "CUDA not available: ..." in gp_error_last(). Gradients of the 2-bit
 * calls may be any gp_dtype_t; everything else is float32 (or int32 codes). */

/* 0 when GPU `device` can run gradpack's kernels, else -1 and the reason. */
int gp_cuda_available(int device);
uint64_t gp_cuda_2bit_compressed_len(uint64_t n);
/* gp_2bit_quantize on the GPU, `grad` of `dtype` (a gp_dtype_t): checks
 * residual + grad is finite first, so on error nothing is written. */
int gp_cuda_2bit_quantize(int device, void* stream, const void* grad, int dtype, uint64_t n,
                          float* residual, float* compr, uint64_t compr_len,
                          float neg_threshold, float pos_threshold);
/* One pass at the memory floor: reads residual, writes the next residual to
 * `next` and `compr`. On error residual is untouched, next/compr garbage. */
int gp_cuda_2bit_quantize_to(int device, void* stream, const void* grad, int dtype, uint64_t n,
                             const float* residual, float* next, float* compr,
                             uint64_t compr_len, float neg_threshold, float pos_threshold);
/* out = decode(compr) (add == 0) or out += decode(compr), after checking the
 * header and every code; on error nothing is written. */
int gp_cuda_2bit_dequantize(int device, void* stream, const float* compr, uint64_t compr_len,
                            float* out, uint64_t n, int add);
/* The device store's compressed Reduce across GPUs: member i (grads[i] and
 * residuals[i], n floats each, on GPU devices[i], stream streams[i])
 * quantizes with error feedback; GPU merge_device decodes and sums every
 * member, in order, into `sum` on merge_stream. Bit-identical to the CPU
 * device store; on error (a non-finite value in any member included) nothing
 * is written. Members on one GPU may not share a residual. */
int gp_cuda_2bit_reduce(uint32_t num, const int* devices, void* const* streams,
                        const void* const* grads, int dtype, float* const* residuals, uint64_t n,
                        int merge_device, void* merge_stream, float* sum,
                        float neg_threshold, float pos_threshold);
/* The GPU that device pointer `ptr` belongs to, into *device. */
int gp_cuda_pointer_device(const void* ptr, int* device);
/* max |x| into *max_abs (host) and whether every element is finite into *finite. */
int gp_cuda_max_abs(int device, void* stream, const float* x, uint64_t n, float* max_abs, int* finite);
/* Max-norm QSGD codes at `scale` (>= max |grad|), noise stream `seed` from
 * element `offset`; added into `codes` when add != 0. */
int gp_cuda_qsgd_quantize(int device, void* stream, const float* grad, uint64_t n, float scale,
                          uint32_t bits, uint64_t seed, uint64_t offset, int32_t* codes, int add);
/* out = codes * scale / (2^bits - 1). */
int gp_cuda_qsgd_decode(int device, void* stream, const int32_t* codes, uint64_t n, float scale,
                        uint32_t bits, float* out);
/* 1-bit quantize with error feedback; bits (0/1) written, or added when add != 0. */
int gp_cuda_1bit_quantize(int device, void* stream, const float* grad, uint64_t n,
                          float* residual, float threshold, int32_t* bits, int add);
/* out = 2 counts - workers. */
int gp_cuda_1bit_decode(int device, void* stream, const int32_t* counts, uint64_t n,
                        uint32_t workers, float* out);
/* Random-K: out[j] = x[idx[j]]; and out = 0, out[idx[j]] = v[j]. Indices checked. */
int gp_cuda_gather(int device, void* stream, const float* x, uint64_t n, const uint64_t* idx,
                   uint64_t k, float* out);
int gp_cuda_scatter(int device, void* stream, const float* v, const uint64_t* idx, uint64_t k,
                    float* out, uint64_t n);

#ifdef __cplusplus
}
#endif

#endif /* GRADPACK_C_API_H_ */
