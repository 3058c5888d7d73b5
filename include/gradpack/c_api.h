/* gradpack C ABI.
 *
 * Conventions (the shape of MXNet's c_api.h):
 *  - functions are gp_<noun>_<verb>; those that can fail return int: 0 on
 *    success, -1 on error, with the message in gp_error_last();
 *  - the caller owns every buffer it passes; gradpack keeps no pointer after
 *    a call returns;
 *  - on error no output buffer has been written;
 *  - no call aborts the process on bad input: errors come back as -1.
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

#ifdef __cplusplus
}
#endif

#endif /* GRADPACK_C_API_H_ */
