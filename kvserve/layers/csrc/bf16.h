/* bfloat16 <-> float32 scalar conversions shared by the kernels (bfloat16 is the top half of a float32).
 *
 *   bf16_widen(h)    exact: the 16 bits become the high half of the float32
 *   bf16_narrow(f)   round to nearest even, as torch's `.to(torch.bfloat16)`; a NaN stays a quiet NaN
 *   bf16_round(f)    bf16_narrow then widen: the float32 value a bfloat16 tensor would hold
 */
#ifndef KVSERVE_BF16_H
#define KVSERVE_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_round(float f) { return bf16_widen(bf16_narrow(f)); }

#endif
