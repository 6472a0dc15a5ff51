// specbuild's CPU weight-only linears: int4 (grouped scale + zero) and int8 (per output row),
// with runtime ISA dispatch (AVX-512 BF16 / AVX2 + FMA), and int4 weights with int8 inputs
// (AVX512-VNNI / AVX-VNNI / AVX2), registered as torch ops (specbuild_cpu::int4_mm, int8_mm,
// int4_q8_mm) so eager code and torch.compile graphs call
// them the same way. Built at first use by specbuild/model/cpu_kernels.py; the design and the
// measurements are in docs/cpu-kernels.md.
//
// Row invariance (the project's lossless rule): every output element of every row is computed
// by the same sequence of floating-point operations whatever the number of rows in the call and
// the row's position in it. Rows are processed in tiles of 1/2/4/8 rows and the column blocks in
// tiles of 1..8 blocks (int4: one block per tile), but each (row, column) owns its accumulators and sees the same
// instructions in the same order in every tile shape; nothing reduces across rows. The ISA path
// is chosen by the caller once per weight (an argument), never by the row count.
//
// int4 layout (packed at load, repack_int4 in cpu_kernels.py): per block of 16 output columns,
// per group of G inputs: G/8 "octets" of 64 bytes, then 16 scales and 16 zeros (bf16 or fp32).
// Octet o covers inputs 8o..8o+7 of the group as 32 16-bit words: word 2c holds column c's
// inputs 8o, 8o+2, 8o+4, 8o+6 (nibbles 0..3, low first), word 2c+1 its inputs 8o+1, 8o+3,
// 8o+5, 8o+7. weight = (v - 8) * scale + zero. The AVX-512 BF16 path (bfloat16 inputs) forms
// per group d = sum_k x_k v_k and sx = sum_k x_k (fp32, fixed order) and adds d * scale +
// sx * (zero - 8 * scale) to the output's accumulator (the same value up to fp32 rounding);
// the AVX2 path (also every float32 input) dequantises each weight as the reference does.
//
// int8 layout: per block of 16 output columns, K rows of 16 int8 values, then 16 fp32 scales.
// out = scale * sum_k x_k q_k.
//
// int4_q8_mm (the int4-a8 format): the int4 weights against inputs quantised per row to int8
// blocks of 32 (one fp32 scale per block, as llama.cpp's Q8 blocks), integer dot products
// (AVX512-VNNI / AVX-VNNI vpdpbusd, AVX2 vpmaddubsw) and one fixed fp32 epilogue per block:
// every path gives the same bits. Its layout and arithmetic are described at the kernels.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <cstdint>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <new>
#include <thread>
#include <pthread.h>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int COLS = 16;  // output columns per block
constexpr int PREFETCH = 512;  // bytes ahead in each block's stream (measured: 10-20% off a one-row pass)

// The int4 layouts end each group with its scales (one or two 64-byte lines after G / 8 chunks
// of weights). A tile prefetches PF bytes ahead once per chunk, so without this the prefetch
// front moved 256 bytes a group while the stream moved 320 (fp16 scales): it fell behind after
// 32 groups (2048 bytes ahead), and from the second block of a unit on the weights came in on
// demand. Called once per group: the group's scale lines, PF bytes ahead, so the front keeps
// pace with the stream (perf on a 2-core AMD EPYC had a quarter of the one-row tile's samples on
// the scales' load). Prefetches never change what a tile computes.
inline void prefetch_group_tail(const uint8_t* group, int64_t chunk_bytes, int64_t grp_bytes, int pf) {
  for (int64_t off = chunk_bytes; off < grp_bytes; off += 64) _mm_prefetch((const char*)(group + off + pf), _MM_HINT_T0);
}

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline int32_t load32(const void* p) {  // an unaligned 4-byte load without aliasing questions
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// A group's 16 scales and the constant zero - (8 + 16) * scale, from the group's tail (fp32 or
// bfloat16 values): the per-group update shared by the AVX-512 int4 paths.
template <bool F32S>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"), always_inline)) inline void group_scale(
    const uint8_t* sp, __m512& s, __m512& m) {
  __m512 z;
  if (F32S) {
    s = _mm512_loadu_ps((const float*)sp);
    z = _mm512_loadu_ps((const float*)sp + COLS);
  } else {
    s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)sp)), 16));
    z = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(sp + 32))), 16));
  }
  m = _mm512_fnmadd_ps(_mm512_set1_ps(24.0f), s, z);  // zero - (8 + 16) * scale
}

// ---------------------------------------------------------------- int4, AVX-512 BF16 -------
// A value v (0..15) becomes the bfloat16 16 + v with two integer ops (shift, ternary logic:
// 0x4180 | v << 3 is 16 + v exactly), so no shuffle is needed; the group's dot product of
// x with (16 + v) is corrected by 16 * sum(x) through the per-group constant (zero - 24 *
// scale). The products are exact in fp32 (8-bit mantissas); only the sums round.
// Accumulators per (row, column block): ga/gb (alternate input pairs of a group: two
// chains so one row has parallel work), acc (the output).
template <int R, int C, bool F32S, int PF>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl,fma"))) void int4_tile_bf16(
    const uint8_t* w, int64_t blk_bytes, int64_t grp_bytes, int ngroups, int G, const uint16_t* x, int64_t K,
    const float* sx, float* out /* [R][C * 16] */) {
  const __m512i mask = _mm512_set1_epi16(0x0078), bias = _mm512_set1_epi16(0x4180);
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int octets = G / 8;
  for (int g = 0; g < ngroups; ++g) {
    __m512 ga[R][C], gb[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) ga[r][c] = gb[r][c] = _mm512_setzero_ps();
    for (int o = 0; o < octets; ++o) {
      __m512bh xp[R][4];
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = x + r * K + g * G + 8 * o;
        for (int j = 0; j < 4; ++j) {
          int32_t pair;
          std::memcpy(&pair, xr + 2 * j, 4);
          xp[r][j] = (__m512bh)_mm512_set1_epi32(pair);
        }
      }
      for (int c = 0; c < C; ++c) {
        const uint8_t* p = w + c * blk_bytes + g * grp_bytes + o * 64;
        _mm_prefetch((const char*)(p + PF), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512((const void*)p);
        // (v shifted) & 0x0078 | 0x4180 for the nibble at bits 4j
        const __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), mask, bias, 0xea);
        const __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), mask, bias, 0xea);
        const __m512bh w2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 5), mask, bias, 0xea);
        const __m512bh w3 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 9), mask, bias, 0xea);
        for (int r = 0; r < R; ++r) {
          ga[r][c] = _mm512_dpbf16_ps(ga[r][c], w0, xp[r][0]);
          gb[r][c] = _mm512_dpbf16_ps(gb[r][c], w1, xp[r][1]);
          ga[r][c] = _mm512_dpbf16_ps(ga[r][c], w2, xp[r][2]);
          gb[r][c] = _mm512_dpbf16_ps(gb[r][c], w3, xp[r][3]);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const uint8_t* sp = w + c * blk_bytes + g * grp_bytes + octets * 64;
      __m512 s, m;
      group_scale<F32S>(sp, s, m);
      for (int r = 0; r < R; ++r) {
        const __m512 t = _mm512_add_ps(ga[r][c], gb[r][c]);
        acc[r][c] = _mm512_fmadd_ps(t, s, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * ngroups + g]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * C * COLS + c * COLS, acc[r][c]);
}

// The same arithmetic for 2-8 rows with few registers: the inputs are broadcast from memory as
// each vdpbf16ps's operand (no per-row broadcast array) and the output accumulators live in the
// tile buffer between groups, so 2R chains + 4 decoded weights + 2 constants fit the 32 zmm
// registers at R = 8 (the array form spilled there). Per row the instructions and their order are
// those of int4_tile_bf16<R, 1>, so every row gets the same bits as a one-row call.
template <int R, bool F32S, int PF>
__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl,fma"))) void int4_rows_bf16(
    const uint8_t* w, int64_t grp_bytes, int ngroups, int G, const uint16_t* x, int64_t K, const float* sx,
    float* out /* [R][16] */) {
  const __m512i mask = _mm512_set1_epi16(0x0078), bias = _mm512_set1_epi16(0x4180);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * COLS, _mm512_setzero_ps());
  const int octets = G / 8;
  for (int g = 0; g < ngroups; ++g) {
    __m512 ga[R], gb[R];
    for (int r = 0; r < R; ++r) ga[r] = gb[r] = _mm512_setzero_ps();
    const uint8_t* pg = w + g * grp_bytes;
    const uint16_t* xg = x + g * G;
    for (int o = 0; o < octets; ++o) {
      const uint8_t* p = pg + o * 64;
      _mm_prefetch((const char*)(p + PF), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512((const void*)p);
      const __m512bh w0 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), mask, bias, 0xea);
      const __m512bh w1 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), mask, bias, 0xea);
      const __m512bh w2 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 5), mask, bias, 0xea);
      const __m512bh w3 = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 9), mask, bias, 0xea);
      for (int r = 0; r < R; ++r) {
        const uint16_t* xr = xg + r * K + 8 * o;
        ga[r] = _mm512_dpbf16_ps(ga[r], w0, (__m512bh)_mm512_set1_epi32(load32(xr)));
        gb[r] = _mm512_dpbf16_ps(gb[r], w1, (__m512bh)_mm512_set1_epi32(load32(xr + 2)));
        ga[r] = _mm512_dpbf16_ps(ga[r], w2, (__m512bh)_mm512_set1_epi32(load32(xr + 4)));
        gb[r] = _mm512_dpbf16_ps(gb[r], w3, (__m512bh)_mm512_set1_epi32(load32(xr + 6)));
      }
    }
    const uint8_t* sp = pg + octets * 64;
    __m512 s, m;
    group_scale<F32S>(sp, s, m);
    for (int r = 0; r < R; ++r) {
      const __m512 t = _mm512_add_ps(ga[r], gb[r]);
      __m512 acc = _mm512_loadu_ps(out + r * COLS);
      acc = _mm512_fmadd_ps(t, s, acc);
      acc = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * ngroups + g]), acc);
      _mm512_storeu_ps(out + r * COLS, acc);
    }
  }
}

// ---------------------------------------------------------------- int4, AVX-512 FMA -------
// ISA level 4, for bfloat16 inputs on CPUs whose vdpbf16ps is slow: on a 2-core Intel Xeon
// (Sapphire Rapids class, 2026-12-03) a loop of independent vdpbf16ps zmm ran at 1.0 G/s per core
// against 4.05 G/s for vfmadd231ps zmm, so 32 multiply-adds per instruction lose to 16 at four
// times the rate, and a verify pass of 5-17 rows was bound by it. Here the inputs are
// widened to fp32 once per call (exact) and each weight v becomes the float 16 + v with one shift
// and one ternary-logic op (0x41800000 | v << 19), which an fp32 multiply-add with the input's
// broadcast takes directly. Dword c of an octet holds column c's eight inputs (input 2j at bits
// 4j, input 2j + 1 at bits 16 + 4j). Two chains per (row, group), input k into chain k mod 2,
// summed as c0 + c1; then, as at level 2, acc += d * scale + sx * (zero - 24 * scale). The products are exact (8-bit by 5-bit mantissas); only the sums round, in an order
// fixed per row whatever the tile, so every width gives a row the bits of a one-row call. The
// bits differ from level 2's (another summation order): the level is fixed per weight at load.
constexpr int FMA_CHAINS = 2;  // 4 measured no faster at one row and limits tiles to 4 rows
template <int R, bool F32S, int PF>
__attribute__((target("avx512f,avx512bw,avx512vl,fma"))) void int4_rows_fma(
    const uint8_t* w, int64_t grp_bytes, int ngroups, int G, const float* x, int64_t K, const float* sx,
    float* out /* [R][16] */) {
  const __m512i mask = _mm512_set1_epi32(0x00780000), bias = _mm512_set1_epi32(0x41800000);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int octets = G / 8;
  for (int g = 0; g < ngroups; ++g) {
    __m512 c[R][FMA_CHAINS];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < FMA_CHAINS; ++j) c[r][j] = _mm512_setzero_ps();
    const uint8_t* pg = w + g * grp_bytes;
    const float* xg = x + g * G;
    for (int o = 0; o < octets; ++o) {
      const uint8_t* p = pg + o * 64;
      _mm_prefetch((const char*)(p + PF), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512((const void*)p);
#define SPECBUILD_FMA_INPUT(k, shifted)                                                     \
  {                                                                                         \
    const __m512 wk = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(shifted, mask, bias, 0xea)); \
    for (int r = 0; r < R; ++r)                                                             \
      c[r][(k) % FMA_CHAINS] = _mm512_fmadd_ps(wk, _mm512_set1_ps(xg[r * K + 8 * o + (k)]), c[r][(k) % FMA_CHAINS]); \
  }
      SPECBUILD_FMA_INPUT(0, _mm512_slli_epi32(v, 19))
      SPECBUILD_FMA_INPUT(1, _mm512_slli_epi32(v, 3))
      SPECBUILD_FMA_INPUT(2, _mm512_slli_epi32(v, 15))
      SPECBUILD_FMA_INPUT(3, _mm512_srli_epi32(v, 1))
      SPECBUILD_FMA_INPUT(4, _mm512_slli_epi32(v, 11))
      SPECBUILD_FMA_INPUT(5, _mm512_srli_epi32(v, 5))
      SPECBUILD_FMA_INPUT(6, _mm512_slli_epi32(v, 7))
      SPECBUILD_FMA_INPUT(7, _mm512_srli_epi32(v, 9))
#undef SPECBUILD_FMA_INPUT
    }
    const uint8_t* sp = pg + octets * 64;
    __m512 s, m;
    group_scale<F32S>(sp, s, m);
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_add_ps(c[r][0], c[r][1]);
      acc[r] = _mm512_fmadd_ps(d, s, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[r * ngroups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * COLS, acc[r]);
}

// ---------------------------------------------------------------- int4, AVX2 + FMA ----------
// R rows, one block (two halves of 8 columns), fp32: each weight dequantised as the reference
// does it, (v - 8) * scale + zero in one rounding (so float32 inputs give the reference's
// products), then one multiply-add per row into two chains per (row, half) (even and odd
// inputs). Dword c of an octet's half holds column c's eight inputs: the nibble at bits 4j
// is input 2j, at bits 16 + 4j input 2j + 1.
template <int R, bool F32S>
__attribute__((target("avx2,fma"))) void int4_rows_avx2(const uint8_t* w, int64_t grp_bytes, int ngroups, int G,
                                                        const float* x, int64_t K, float* out /* [R][16] */) {
  const __m256i nib = _mm256_set1_epi32(0xf), eight = _mm256_set1_epi32(8);
  __m256 a0[R][2], a1[R][2];
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) a0[r][h] = a1[r][h] = _mm256_setzero_ps();
  const int octets = G / 8;
  for (int g = 0; g < ngroups; ++g) {
    const uint8_t* sp = w + g * grp_bytes + octets * 64;
    __m256 s[2], z[2];
    for (int h = 0; h < 2; ++h) {
      if (F32S) {
        s[h] = _mm256_loadu_ps((const float*)sp + 8 * h);
        z[h] = _mm256_loadu_ps((const float*)sp + COLS + 8 * h);
      } else {
        s[h] = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(sp + 16 * h))), 16));
        z[h] = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(sp + 32 + 16 * h))), 16));
      }
    }
    for (int o = 0; o < octets; ++o) {
      for (int h = 0; h < 2; ++h) {
        const __m256i d = _mm256_loadu_si256((const __m256i*)(w + g * grp_bytes + o * 64 + h * 32));
        for (int j = 0; j < 4; ++j) {
          const __m256i ie = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(d, 4 * j), nib), eight);
          const __m256i io = _mm256_sub_epi32(_mm256_and_si256(_mm256_srli_epi32(d, 16 + 4 * j), nib), eight);
          const __m256 we = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ie), s[h], z[h]);
          const __m256 wo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(io), s[h], z[h]);
          for (int r = 0; r < R; ++r) {
            const float* xr = x + r * K + g * G + 8 * o + 2 * j;
            a0[r][h] = _mm256_fmadd_ps(we, _mm256_broadcast_ss(xr), a0[r][h]);
            a1[r][h] = _mm256_fmadd_ps(wo, _mm256_broadcast_ss(xr + 1), a1[r][h]);
          }
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(out + r * COLS, _mm256_add_ps(a0[r][0], a1[r][0]));
    _mm256_storeu_ps(out + r * COLS + 8, _mm256_add_ps(a0[r][1], a1[r][1]));
  }
}

// ---------------------------------------------------------------- int8, AVX-512F -------------
// Two chains per (row, block): even and odd inputs, then (even + odd) * scale: per output
// element exactly the operations of the AVX2 code below, so the two give the same bits and a
// call may mix them (one-row tiles run the AVX2 code at level 2, this code at level 3).
template <int R, int C>
__attribute__((target("avx512f,fma"))) void int8_tile_avx512(const int8_t* w, int64_t blk_bytes, int64_t K,
                                                             const float* x, float* out /* [R][C * 16] */) {
  __m512 a0[R][C], a1[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a0[r][c] = a1[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k + 1 < K; k += 2) {
    __m512 xe[R], xo[R];
    for (int r = 0; r < R; ++r) {
      xe[r] = _mm512_set1_ps(x[r * K + k]);
      xo[r] = _mm512_set1_ps(x[r * K + k + 1]);
    }
    for (int c = 0; c < C; ++c) {
      const int8_t* p = w + c * blk_bytes + k * COLS;
      __m512 ve = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
      __m512 vo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + COLS))));
      for (int r = 0; r < R; ++r) {
        a0[r][c] = _mm512_fmadd_ps(ve, xe[r], a0[r][c]);
        a1[r][c] = _mm512_fmadd_ps(vo, xo[r], a1[r][c]);
      }
    }
  }
  if (K % 2) {
    for (int c = 0; c < C; ++c) {
      const int8_t* p = w + c * blk_bytes + (K - 1) * COLS;
      __m512 ve = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
      for (int r = 0; r < R; ++r) a0[r][c] = _mm512_fmadd_ps(ve, _mm512_set1_ps(x[r * K + K - 1]), a0[r][c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    __m512 s = _mm512_loadu_ps((const float*)(w + c * blk_bytes + K * COLS));
    for (int r = 0; r < R; ++r)
      _mm512_storeu_ps(out + r * C * COLS + c * COLS, _mm512_mul_ps(_mm512_add_ps(a0[r][c], a1[r][c]), s));
  }
}

// ---------------------------------------------------------------- int8, AVX2 + FMA ----------
// One row, one block; the same two chains (even / odd inputs) per half.
__attribute__((target("avx2,fma"))) void int8_row_avx2(const int8_t* w, int64_t K, const float* x, float* out) {
  __m256 a0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, a1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t k = 0; k + 1 < K; k += 2) {
    __m256 xe = _mm256_broadcast_ss(x + k), xo = _mm256_broadcast_ss(x + k + 1);
    for (int h = 0; h < 2; ++h) {
      const int8_t* p = w + k * COLS + 8 * h;
      __m256 ve = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
      __m256 vo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + COLS))));
      a0[h] = _mm256_fmadd_ps(ve, xe, a0[h]);
      a1[h] = _mm256_fmadd_ps(vo, xo, a1[h]);
    }
  }
  if (K % 2) {
    __m256 xe = _mm256_broadcast_ss(x + K - 1);
    for (int h = 0; h < 2; ++h) {
      __m256 ve = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + (K - 1) * COLS + 8 * h))));
      a0[h] = _mm256_fmadd_ps(ve, xe, a0[h]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    __m256 s = _mm256_loadu_ps((const float*)(w + K * COLS) + 8 * h);
    _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(_mm256_add_ps(a0[h], a1[h]), s));
  }
}

// R rows of one block, one half (8 columns) at a time: each weight vector is loaded and
// converted once for the R rows, and each row runs exactly int8_row_avx2's chains (even inputs
// in a0, odd in a1, in input order; (a0 + a1) * s), so a row's bits are the one-row code's.
// The one-row code converted every weight again for every row of a verify pass or a batch:
// [49152, 576] lm_head on an AMD EPYC (AVX2, 2 threads) took 0.63-0.73 ms per extra row.
template <int R>
__attribute__((target("avx2,fma"))) void int8_rows_avx2(const int8_t* w, int64_t K, const float* x, float* out) {
  for (int h = 0; h < 2; ++h) {
    __m256 a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 1 < K; k += 2) {
      const int8_t* p = w + k * COLS + 8 * h;
      const __m256 ve = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
      const __m256 vo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(p + COLS))));
      for (int r = 0; r < R; ++r) {
        a0[r] = _mm256_fmadd_ps(ve, _mm256_broadcast_ss(x + r * K + k), a0[r]);
        a1[r] = _mm256_fmadd_ps(vo, _mm256_broadcast_ss(x + r * K + k + 1), a1[r]);
      }
    }
    if (K % 2) {
      const __m256 ve =
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(w + (K - 1) * COLS + 8 * h))));
      for (int r = 0; r < R; ++r) a0[r] = _mm256_fmadd_ps(ve, _mm256_broadcast_ss(x + r * K + K - 1), a0[r]);
    }
    const __m256 s = _mm256_loadu_ps((const float*)(w + K * COLS) + 8 * h);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * COLS + 8 * h, _mm256_mul_ps(_mm256_add_ps(a0[r], a1[r]), s));
  }
}

// ---------------------------------------------------------------- int4 x int8 (Q8) -----------
// int4_q8_mm: the int4 weights (w = v * s + m per group, m = zero - 8 * scale) against inputs
// quantised per row, per block of 32 inputs, to int8 with one fp32 scale dx per block
// (q8_quantize below). Per (row, column, block) the integer dot product isum = sum v * q
// (exact int32 in any order and any split) and the block's qsum = sum q (exact) enter the
// fp32 accumulator as
//     t = s * float(isum);  t = fma(m, qsum, t);  acc = fma(t, dx, acc)
// in block order. Every code path below (AVX512-VNNI zmm, AVX-VNNI ymm, the EVEX ymm twin of
// AVX-VNNI, AVX2 vpmaddubsw + vpmaddwd) forms the same integers and runs exactly this
// epilogue, so they give the same bits; each (row, column) owns its accumulators, so a row's
// bits do not depend on the rows beside it.
//
// Layout (repack_int4_q8 in cpu_kernels.py; its own, because vpdpbusd multiplies four
// consecutive bytes of one 32-bit lane by four broadcast input bytes): per block of 16
// columns, per group of G inputs: G/8 chunks of 64 bytes, then 16 scales s and 16 m, fp16 when
// every one of them is an fp16 value (weights carried from GGUF Q4_1, whose d and m are fp16:
// 20 bytes per 32 weights, as the bfloat16 kernel reads) else fp32 (24 bytes); fp16 -> fp32 is
// exact, so the two layouts give the same bits. Byte 4c + j of chunk o: low nibble = column c's input 8o + j, high nibble its input
// 8o + 4 + j (j = 0..3). One AND gives the bytes of inputs 8o..8o+3 for 16 columns, a shift and
// an AND those of 8o+4..8o+7; bytes 0..31 of a chunk are columns 0..7 (the ymm paths' half 0).
constexpr int QB = 32;  // inputs per activation block

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One row's inputs -> int8 per block of 32: d = amax / 127 (fp32 division), q = nearest-even
// (x / d) clamped to [-127, 127] (0 where d is 0), qsum = sum q. One code path for every
// ISA path (AVX2), so the int8 inputs are the same whichever kernel reads them. The block's
// largest |x| passes NaN lanes over (they count as 0), the int8 packing and the integer sum stay
// in vectors (the same bytes, checked on specials and ties; 256 rows of 1,536 0.189 -> 0.143 ms on
// an AMD EPYC Zen 4): the division still sets the pace.
__attribute__((target("avx2,fma"))) void q8_quantize_row(const float* x, int64_t K, int8_t* q, float* dx,
                                                         float* qs) {
  const __m256 sign = _mm256_set1_ps(-0.0f), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs work within 128-bit lanes
  for (int64_t b = 0; b < K / QB; ++b) {
    const float* xb = x + b * QB;
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(xb + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    amax = _mm256_and_ps(amax, _mm256_cmp_ps(amax, amax, _CMP_ORD_Q));  // NaN lanes -> 0
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));  // the maximum is exact in any order
    const float d = _mm_cvtss_f32(m4) / 127.0f;
    if (d > 0.0f) {  // (an amax below 127 * 2^-149 underflows to d = 0: treated as zeros)
      const __m256 dv = _mm256_set1_ps(d);
      __m256i qi[4];
      for (int i = 0; i < 4; ++i) {
        __m256 r = _mm256_round_ps(_mm256_div_ps(v[i], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
        qi[i] = _mm256_cvtps_epi32(r);
      }
      const __m256i s = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
      s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * QB), _mm256_permutevar8x32_epi32(p, order));
      qs[b] = float(_mm_cvtsi128_si32(s4));
    } else {
      std::memset(q + b * QB, 0, QB);
      qs[b] = 0.0f;
    }
    dx[b] = d;
  }
}

// vpdpbusd with the four activation bytes as an embedded broadcast operand ({1to16}): GCC 12
// does not fold _mm512_set1_epi32(load) into it, and a separate vpbroadcastd per product costs
// a uop per product (measured: the same speed or up to 5% faster over SmolLM2's layers).
__attribute__((target("avx512f,avx512vnni"))) inline __m512i dpbusd_bcast(__m512i acc, __m512i v, const int8_t* x4) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*(const int32_t*)x4));
  return acc;
}

// AVX512-VNNI: R rows x C column blocks (the driver uses C = 1), one zmm int32 accumulator per
// (row, block) and block of 32 inputs (two for one row: more independent chains; integer sums,
// so the split changes nothing), the activation bytes broadcast four at a time.
template <int R, int C, bool F16S, int PF = PREFETCH>
__attribute__((target("avx512f,avx512bw,avx512vnni,fma,f16c"))) void q8_tile_vnni512(
    const uint8_t* w, int64_t blk_bytes, int64_t grp_bytes, int ngroups, int G, const int8_t* xq, int64_t K,
    const float* dx, const float* qs, float* out /* [R][C * 16] */) {
  constexpr bool SPLIT = R == 1;
  const __m512i nib = _mm512_set1_epi8(0x0f);
  const int64_t nbk = K / QB;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int chunks = G / 8;
  for (int g = 0; g < ngroups; ++g) {
    if constexpr (PF > 0)
      for (int c = 0; c < C; ++c) prefetch_group_tail(w + c * blk_bytes + g * grp_bytes, chunks * 64, grp_bytes, PF);
    for (int b = 0; b < G / QB; ++b) {
      __m512i ia[R][C], ib[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) ia[r][c] = ib[r][c] = _mm512_setzero_si512();
      for (int o = 0; o < 4; ++o) {
        const int64_t kk = int64_t(g) * G + b * QB + 8 * o;
        for (int c = 0; c < C; ++c) {
          const uint8_t* p = w + c * blk_bytes + g * grp_bytes + (b * 4 + o) * 64;
          if constexpr (PF > 0) _mm_prefetch((const char*)(p + PF), _MM_HINT_T0);
          const __m512i v = _mm512_loadu_si512((const void*)p);
          const __m512i vl = _mm512_and_si512(v, nib), vh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
          for (int r = 0; r < R; ++r) {
            ia[r][c] = dpbusd_bcast(ia[r][c], vl, xq + r * K + kk);
            if (SPLIT) ib[r][c] = dpbusd_bcast(ib[r][c], vh, xq + r * K + kk + 4);
            else ia[r][c] = dpbusd_bcast(ia[r][c], vh, xq + r * K + kk + 4);
          }
        }
      }
      const int64_t blk = int64_t(g) * (G / QB) + b;
      for (int c = 0; c < C; ++c) {
        const uint8_t* sp = w + c * blk_bytes + g * grp_bytes + chunks * 64;
        const __m512 s = F16S ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sp)) : _mm512_loadu_ps((const float*)sp);
        const __m512 m = F16S ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sp + 32)))
                              : _mm512_loadu_ps((const float*)sp + COLS);
        for (int r = 0; r < R; ++r) {
          const __m512i isum = SPLIT ? _mm512_add_epi32(ia[r][c], ib[r][c]) : ia[r][c];
          __m512 t = _mm512_mul_ps(s, _mm512_cvtepi32_ps(isum));
          t = _mm512_fmadd_ps(m, _mm512_set1_ps(qs[r * nbk + blk]), t);
          acc[r][c] = _mm512_fmadd_ps(t, _mm512_set1_ps(dx[r * nbk + blk]), acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * C * COLS + c * COLS, acc[r][c]);
}

// ymm paths: R rows x H halves of 8 columns (H = 2 * blocks). DOT(acc, v, x) adds the four
// products per 32-bit lane: vpdpbusd (AVX-VNNI, or its AVX512-VL encoding), or for plain AVX2
// vpmaddubsw into int16 pairs (2 * 15 * 127 fits; eight of them summed in int16: 30480 fits)
// and one vpmaddwd by ones per block. The same integers and the same epilogue as above.
#define SPECBUILD_Q8_YMM_TILE(NAME, TARGET, INT16)                                                               \
  template <int R, int H, bool F16S, int PF = PREFETCH>                                                          \
  __attribute__((target(TARGET))) void NAME(const uint8_t* w, int64_t blk_bytes, int64_t grp_bytes, int ngroups, \
                                            int G, const int8_t* xq, int64_t K, const float* dx, const float* qs,  \
                                            float* out /* [R][H * 8] */) {                                       \
    const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);                                     \
    (void)ones;                                                                                                  \
    const int64_t nbk = K / QB;                                                                                  \
    __m256 acc[R][H];                                                                                            \
    for (int r = 0; r < R; ++r)                                                                                  \
      for (int h = 0; h < H; ++h) acc[r][h] = _mm256_setzero_ps();                                               \
    const int chunks = G / 8;                                                                                    \
    for (int g = 0; g < ngroups; ++g) {                                                                          \
      for (int c = 0; c < H / 2; ++c)                                                                            \
        prefetch_group_tail(w + c * blk_bytes + g * grp_bytes, chunks * 64, grp_bytes, PF);                      \
      for (int b = 0; b < G / QB; ++b) {                                                                         \
        __m256i ia[R][H];                                                                                        \
        for (int r = 0; r < R; ++r)                                                                              \
          for (int h = 0; h < H; ++h) ia[r][h] = _mm256_setzero_si256();                                         \
        for (int o = 0; o < 4; ++o) {                                                                            \
          const int64_t kk = int64_t(g) * G + b * QB + 8 * o;                                                    \
          for (int h = 0; h < H; ++h) {                                                                          \
            const uint8_t* p = w + (h / 2) * blk_bytes + g * grp_bytes + (b * 4 + o) * 64 + (h % 2) * 32;       \
            if (h % 2 == 0) _mm_prefetch((const char*)(p + PF), _MM_HINT_T0);                                    \
            const __m256i v = _mm256_loadu_si256((const __m256i*)p);                                             \
            const __m256i vl = _mm256_and_si256(v, nib), vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);    \
            for (int r = 0; r < R; ++r) {                                                                        \
              const __m256i xa = _mm256_set1_epi32(load_i32(xq + r * K + kk));                                   \
              const __m256i xb = _mm256_set1_epi32(load_i32(xq + r * K + kk + 4));                               \
              ia[r][h] = SPECBUILD_Q8_DOT_##INT16(ia[r][h], vl, xa);                                             \
              ia[r][h] = SPECBUILD_Q8_DOT_##INT16(ia[r][h], vh, xb);                                             \
            }                                                                                                    \
          }                                                                                                      \
        }                                                                                                        \
        const int64_t blk = int64_t(g) * (G / QB) + b;                                                           \
        for (int h = 0; h < H; ++h) {                                                                            \
          const uint8_t* sp = w + (h / 2) * blk_bytes + g * grp_bytes + chunks * 64;                            \
          const __m256 s = F16S ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 16 * (h % 2))))          \
                                : _mm256_loadu_ps((const float*)sp + 8 * (h % 2));                               \
          const __m256 m = F16S ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 32 + 16 * (h % 2))))     \
                                : _mm256_loadu_ps((const float*)sp + COLS + 8 * (h % 2));                        \
          for (int r = 0; r < R; ++r) {                                                                          \
            const __m256i isum = SPECBUILD_Q8_SUM_##INT16(ia[r][h]);                                             \
            __m256 t = _mm256_mul_ps(s, _mm256_cvtepi32_ps(isum));                                               \
            t = _mm256_fmadd_ps(m, _mm256_set1_ps(qs[r * nbk + blk]), t);                                        \
            acc[r][h] = _mm256_fmadd_ps(t, _mm256_set1_ps(dx[r * nbk + blk]), acc[r][h]);                        \
          }                                                                                                      \
        }                                                                                                        \
      }                                                                                                          \
    }                                                                                                            \
    for (int r = 0; r < R; ++r)                                                                                  \
      for (int h = 0; h < H; ++h) _mm256_storeu_ps(out + r * H * 8 + h * 8, acc[r][h]);                          \
  }

#define SPECBUILD_Q8_DOT_AVX2(acc, v, x) _mm256_add_epi16(acc, _mm256_maddubs_epi16(v, x))
#define SPECBUILD_Q8_SUM_AVX2(acc) _mm256_madd_epi16(acc, ones)
#define SPECBUILD_Q8_DOT_VEX(acc, v, x) _mm256_dpbusd_avx_epi32(acc, v, x)
#define SPECBUILD_Q8_SUM_VEX(acc) (acc)
#define SPECBUILD_Q8_DOT_EVEX(acc, v, x) _mm256_dpbusd_epi32(acc, v, x)
#define SPECBUILD_Q8_SUM_EVEX(acc) (acc)
SPECBUILD_Q8_YMM_TILE(q8_tile_avx2, "avx2,fma,f16c", AVX2)
SPECBUILD_Q8_YMM_TILE(q8_tile_avxvnni, "avx2,fma,f16c,avxvnni", VEX)
SPECBUILD_Q8_YMM_TILE(q8_tile_vnni256, "avx2,fma,f16c,avx512f,avx512vl,avx512vnni", EVEX)

// Plain AVX2 with 2-4 rows where the weights stay in cache across row tiles (prefill, wide
// batches; avx2_tile below chooses): one half (8 columns) of the block at a time, so a tile holds R
// int16 sums and R float accumulators (2R + 7 registers, none spilled), where the two-half tile
// above at 2 rows spills its accumulators to the stack (it still wins where each weight line
// comes from memory once: avx2_tile). Per (row, column) the same integers and the same epilogue, in the
// same block order: the same bits as every path above.
template <int R, bool F16S, int PF = PREFETCH>
__attribute__((target("avx2,fma,f16c"))) void q8_rows_avx2(const uint8_t* w, int64_t grp_bytes, int ngroups, int G,
                                                            const int8_t* xq, int64_t K, const float* dx,
                                                            const float* qs, float* out /* [R][16] */) {
  const __m256i nib = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const int64_t nbk = K / QB;
  const int chunks = G / 8;
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int g = 0; g < ngroups; ++g) {
      const uint8_t* wg = w + g * grp_bytes;
      const uint8_t* sp = wg + chunks * 64;
      if (h == 0) prefetch_group_tail(wg, chunks * 64, grp_bytes, PF);
      for (int b = 0; b < G / QB; ++b) {
        __m256i ia[R];
        for (int r = 0; r < R; ++r) ia[r] = _mm256_setzero_si256();
        for (int o = 0; o < 4; ++o) {
          const int64_t kk = int64_t(g) * G + b * QB + 8 * o;
          const uint8_t* p = wg + (b * 4 + o) * 64 + h * 32;
          if (h == 0) _mm_prefetch((const char*)(p + PF), _MM_HINT_T0);
          const __m256i v = _mm256_loadu_si256((const __m256i*)p);
          const __m256i vl = _mm256_and_si256(v, nib), vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), nib);
          for (int r = 0; r < R; ++r) {
            const __m256i xa = _mm256_set1_epi32(load_i32(xq + r * K + kk));
            const __m256i xb = _mm256_set1_epi32(load_i32(xq + r * K + kk + 4));
            ia[r] = _mm256_add_epi16(ia[r], _mm256_maddubs_epi16(vl, xa));
            ia[r] = _mm256_add_epi16(ia[r], _mm256_maddubs_epi16(vh, xb));
          }
        }
        const int64_t blk = int64_t(g) * (G / QB) + b;
        const __m256 s = F16S ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 16 * h)))
                              : _mm256_loadu_ps((const float*)sp + 8 * h);
        const __m256 m = F16S ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sp + 32 + 16 * h)))
                              : _mm256_loadu_ps((const float*)sp + COLS + 8 * h);
        for (int r = 0; r < R; ++r) {
          __m256 t = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_madd_epi16(ia[r], ones)));
          t = _mm256_fmadd_ps(m, _mm256_set1_ps(qs[r * nbk + blk]), t);
          acc[r] = _mm256_fmadd_ps(t, _mm256_set1_ps(dx[r * nbk + blk]), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * COLS + h * 8, acc[r]);
  }
}

// ---------------------------------------------------------------- the kernels' thread pool ---
// Why a pool of the kernels' own beside torch's OpenMP (at::parallel_for): OpenMP gives each
// thread a fixed share of a region and ends it with a barrier, so the region lasts as long as
// its slowest thread. With another process computing on the same cores, one of our threads is
// often off the CPU for a scheduler slice (milliseconds) and the other waits for it at every
// region; a decode step has hundreds. Here the calling thread publishes a job of fixed chunks,
// takes chunks itself, and waits only for chunks a helper has already started: a helper that
// is off the CPU simply takes none. No library on the registries offers this as a torch-callable
// primitive (torch's own pool, at::launch, has no "take what is left" join), hence this code.
//
// Row invariance: which thread runs a chunk, and how many chunks there are, never changes what
// an item computes (every parallel loop below gives each item its own outputs and accumulators),
// so the bits are OpenMP's; tests/model/test_pool.py checks this for every kernel.
//
// The claim word: [epoch: 24 bits][mine: 20][theirs: 20]. The caller owns the job's first
// chunks [0, split) and claims them in order (`mine`: how many of them are left), the helpers
// own the rest [split, chunks) and claim those in order (`theirs`: how many are left); a thread
// whose own run is used up takes what is left of the other's, from its front. So on free cores
// each thread streams one contiguous run of the weights, while a helper that is off the CPU
// still holds at most the chunk it started. Claims are compare-and-swaps on the whole word, so a
// helper that read an older job's word can never claim in a newer one (the epoch differs). A job
// returns only after every chunk is claimed and every claimed chunk finished, so its description
// is never rewritten while a claim on it can succeed. (Claimed in one interleaved order instead,
// each thread's chunks alternating with the other's: one decode row 2-8% slower, 2-4 rows 3-7%,
// AMD EPYC, pool x2, 24 alternating pairs in one process on two occasions.)
// Helpers spin SPECBUILD_POOL_SPIN_US microseconds for the next job (none while others' load is
// seen), then sleep on a condition variable. Mode (SPECBUILD_POOL, set from cpu_kernels.py):
// 0 OpenMP, 1 the pool always, 2 auto (the pool while the thread governor sees others' load on
// these cores, OpenMP otherwise).
namespace pool {

using RunFn = void (*)(void*, int64_t, int64_t);
constexpr int EPOCH_BITS = 24, COUNT_BITS = 20;
constexpr uint64_t FIELD = (uint64_t(1) << COUNT_BITS) - 1;
constexpr int64_t CHUNKS_PER_THREAD = 8;  // balance under load against one claim per chunk
inline uint64_t word_of(uint64_t epoch, uint64_t mine, uint64_t theirs) {
  return ((epoch & ((uint64_t(1) << EPOCH_BITS) - 1)) << (2 * COUNT_BITS)) | (mine << COUNT_BITS) | theirs;
}
inline uint64_t epoch_of(uint64_t w) { return w >> (2 * COUNT_BITS); }
inline uint64_t mine_of(uint64_t w) { return (w >> COUNT_BITS) & FIELD; }  // the caller's chunks left
inline uint64_t theirs_of(uint64_t w) { return w & FIELD; }  // the helpers' chunks left

struct Pool {
  alignas(64) std::atomic<uint64_t> word{0};
  alignas(64) std::atomic<int64_t> done{0};  // chunks of the current job finished
  alignas(64) std::atomic<RunFn> fn{nullptr};  // the job's description, written before its word
  std::atomic<void*> ctx{nullptr};
  std::atomic<int64_t> begin{0}, end{0}, step{1};
  std::atomic<uint64_t> chunks{0}, split{0};  // the job's chunks; the first of the helpers' run
  std::atomic<int> participants{0};  // helpers 0..participants-1 take part in the job
  std::atomic<int> sleepers{0};
  std::atomic<bool> busy{false};  // one job at a time; a second caller meanwhile uses OpenMP
  std::atomic<bool> failed{false};
  std::exception_ptr error;  // the first exception of a job's chunks (written under m)
  std::mutex m;
  std::condition_variable cv;
  int helpers = 0;  // helper threads started (only the caller holding `busy` starts more)
  std::atomic<int64_t> jobs{0}, helper_chunks{0}, caller_chunks{0};
  std::atomic<int64_t> waits{0}, wait_ns{0}, long_waits{0};  // the caller waiting for helpers' chunks (> 1 ms: long)
};

std::atomic<int> g_mode{2};
std::atomic<bool> g_contended{false};
// the pool's width (the calling thread included); 0: torch's thread count of the calling thread.
// Set where torch's own ops run on one thread while the kernels use the pool (pool_threads), so
// that the step's small ops (argmax over the vocabulary, norms) pay no OpenMP wake-up
std::atomic<int> g_threads{0};
std::atomic<int64_t> g_spin_us{50};
std::atomic<Pool*> g_pool{nullptr};
std::mutex g_make;
thread_local bool t_inside = false;  // a helper, or a caller running chunks: nested loops run inline

void run_chunk(Pool* p, uint64_t i, RunFn fn, void* ctx, int64_t b, int64_t e, int64_t st) {
  const int64_t lo = b + int64_t(i) * st, hi = std::min(e, lo + st);
  try {
    fn(ctx, lo, hi);
  } catch (...) {
    std::lock_guard<std::mutex> g(p->m);
    if (!p->failed.load()) {
      p->error = std::current_exception();
      p->failed.store(true);
    }
  }
  p->done.fetch_add(1, std::memory_order_acq_rel);
}

// Claims and runs chunks of the job whose word was `w` until none is left or the job changed.
void take_chunks(Pool* p, uint64_t w, bool helper) {
  const RunFn fn = p->fn.load(std::memory_order_relaxed);
  void* const ctx = p->ctx.load(std::memory_order_relaxed);
  const int64_t b = p->begin.load(std::memory_order_relaxed), e = p->end.load(std::memory_order_relaxed),
                st = p->step.load(std::memory_order_relaxed);
  const uint64_t n = p->chunks.load(std::memory_order_relaxed), split = p->split.load(std::memory_order_relaxed);
  const uint64_t epoch = epoch_of(w);
  int64_t ran = 0;  // counted here and added once: no second shared write per chunk
  while (epoch_of(w) == epoch && (mine_of(w) || theirs_of(w))) {
    // a thread's own run first, then what is left of the other's (both from their fronts)
    const bool take_mine = helper ? !theirs_of(w) : mine_of(w) != 0;
    const uint64_t next = take_mine ? w - (uint64_t(1) << COUNT_BITS) : w - 1;
    // success means the word was still `w` (this job, this chunk unclaimed): the description read
    // above (split and chunks included) is this job's, since a job is only replaced after all of
    // its chunks were claimed
    if (p->word.compare_exchange_weak(w, next, std::memory_order_acq_rel, std::memory_order_acquire)) {
      run_chunk(p, take_mine ? split - mine_of(w) : n - theirs_of(w), fn, ctx, b, e, st);
      ++ran;
    }
  }
  if (ran) (helper ? p->helper_chunks : p->caller_chunks).fetch_add(ran, std::memory_order_relaxed);
}

void helper_loop(Pool* p, int index) {
  t_inside = true;
  uint64_t seen = epoch_of(p->word.load(std::memory_order_acquire));
  for (;;) {
    uint64_t w = p->word.load(std::memory_order_acquire);
    if (epoch_of(w) == seen) {
      // under others' load a helper sleeps at once: its spinning took CPU time the caller needed
      // (Intel Xeon, 2 cores, compiled int4-a8 beside a 2-thread neighbour, 2026-12-05: 9.8
      // ms/token sleeping at once, 11.5 spinning 50 us, 16.5 spinning 500 us)
      const int64_t spin = g_contended.load(std::memory_order_relaxed) ? 0 : g_spin_us.load();
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(spin);
      for (int n = 0; epoch_of(w) == seen; ++n) {
        _mm_pause();
        w = p->word.load(std::memory_order_acquire);
        if ((n & 63) == 63 && std::chrono::steady_clock::now() >= until) break;
      }
      if (epoch_of(w) == seen) {
        std::unique_lock<std::mutex> lk(p->m);
        p->sleepers.fetch_add(1);
        p->cv.wait(lk, [&] { return epoch_of(p->word.load()) != seen; });
        p->sleepers.fetch_sub(1);
        w = p->word.load(std::memory_order_acquire);
      }
    }
    seen = epoch_of(w);
    if (index < p->participants.load(std::memory_order_relaxed)) take_chunks(p, w, true);
  }
}

Pool* get() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p) return p;
  std::lock_guard<std::mutex> g(g_make);
  p = g_pool.load();
  if (!p) {
    p = new Pool();  // never freed: detached helpers may sleep in it until the process exits
    g_pool.store(p, std::memory_order_release);
  }
  return p;
}

void after_fork_child() {  // the helpers do not exist in a forked child: a fresh pool on next use
  new (&g_make) std::mutex();
  g_pool.store(nullptr);
}

bool enabled() {
  const int mode = g_mode.load(std::memory_order_relaxed);
  return mode == 1 || (mode == 2 && g_contended.load(std::memory_order_relaxed));
}

// fn(lo, hi) over [b, e): on the pool when it is on (chunks of at least `grain` items, at most
// CHUNKS_PER_THREAD per thread), else at::parallel_for with the same grain.
template <class F>
void run(int64_t b, int64_t e, int64_t grain, F&& f, bool force = false) {
  if (e <= b) return;
  if (t_inside) {  // inside a pool chunk (a helper is no OpenMP thread): no nested parallelism
    f(b, e);
    return;
  }
  if (!force && !enabled()) {
    at::parallel_for(b, e, grain, f);
    return;
  }
  const int width = g_threads.load(std::memory_order_relaxed);
  const int threads = width > 0 ? width : at::get_num_threads();
  const int64_t n = e - b;
  grain = std::max<int64_t>(grain, 1);
  if (threads < 2 || n <= grain || at::in_parallel_region()) {
    f(b, e);
    return;
  }
  Pool* p = get();
  bool expected = false;
  if (!p->busy.compare_exchange_strong(expected, true)) {  // another thread's job is running
    at::parallel_for(b, e, grain, f);
    return;
  }
  int64_t chunks = std::min<int64_t>({(n + grain - 1) / grain, CHUNKS_PER_THREAD * threads, int64_t(FIELD)});
  const int64_t st = (n + chunks - 1) / chunks;
  chunks = (n + st - 1) / st;
  while (p->helpers < threads - 1) {
    std::thread(helper_loop, p, p->helpers).detach();
    ++p->helpers;
  }
  using FD = typename std::decay<F>::type;
  p->fn.store([](void* c, int64_t lo, int64_t hi) { (*static_cast<FD*>(c))(lo, hi); }, std::memory_order_relaxed);
  p->ctx.store(const_cast<void*>(static_cast<const void*>(&f)), std::memory_order_relaxed);
  p->begin.store(b, std::memory_order_relaxed);
  p->end.store(e, std::memory_order_relaxed);
  p->step.store(st, std::memory_order_relaxed);
  p->participants.store(threads - 1, std::memory_order_relaxed);
  p->done.store(0, std::memory_order_relaxed);
  p->failed.store(false, std::memory_order_relaxed);
  const uint64_t split = uint64_t((chunks + threads - 1) / threads);  // the caller's share, in front
  p->chunks.store(uint64_t(chunks), std::memory_order_relaxed);
  p->split.store(split, std::memory_order_relaxed);
  const uint64_t w = word_of(epoch_of(p->word.load()) + 1, split, uint64_t(chunks) - split);
  p->word.store(w);  // seq_cst: ordered before the sleepers read below (no lost wake-up)
  if (p->sleepers.load() > 0) {
    std::lock_guard<std::mutex> g(p->m);
    p->cv.notify_all();
  }
  p->jobs.fetch_add(1, std::memory_order_relaxed);
  t_inside = true;
  take_chunks(p, w, false);
  t_inside = false;
  // every chunk is claimed; wait for those a helper is running (yield after a while: a helper
  // that was preempted mid-chunk may need this core)
  if (p->done.load(std::memory_order_acquire) < chunks) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int spins = 0; p->done.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < 2000) _mm_pause();
      else std::this_thread::yield();
    }
    const int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    p->wait_ns.fetch_add(ns, std::memory_order_relaxed);
    p->waits.fetch_add(1, std::memory_order_relaxed);
    if (ns > 1000000) p->long_waits.fetch_add(1, std::memory_order_relaxed);
  }
  std::exception_ptr err;
  if (p->failed.load()) {
    std::lock_guard<std::mutex> g(p->m);
    err = p->error;
    p->error = nullptr;
  }
  p->busy.store(false, std::memory_order_release);
  if (err) std::rethrow_exception(err);
}

const int g_atfork = pthread_atfork(nullptr, nullptr, after_fork_child);

}  // namespace pool

// The kernels' parallel loop: the pool or OpenMP (pool::run), the same bits either way.
template <class F>
inline void par_for(int64_t b, int64_t e, int64_t grain, F&& f) { pool::run(b, e, grain, f); }

// ---------------------------------------------------------------- drivers --------------------
// Row tiles: 8, 4, 2, 1 rows; the column tile follows from the row tile (registers), never
// changing what a row computes.
inline int row_tile(int64_t left) { return left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1; }
// The int8-input (VNNI-512) tiles take any 1..8 rows: a verify pass of 3, 5, 6 or 7 rows is one
// tile instead of a 2/4-row tile plus a 1-row one that unpacks every weight again for one row.
inline int row_tile_any(int64_t left) { return left >= 8 ? 8 : int(left); }
inline int row_tile_2(int64_t left) { return left >= 2 ? 2 : 1; }  // the ymm int8-input tiles
inline int row_tile_4(int64_t left) { return left >= 4 ? 4 : int(left); }  // plain AVX2's int8 x int8 tiles
// plain AVX2's int4 x int8 tiles: 3 rows (4 only when exactly 4 are left). The 4-row one-half
// tile keeps its float accumulators on the stack (16 ymm registers); 3 rows keep them in
// registers and ran 5-10% faster per row (AMD EPYC, pool x2, N = 3072, K = 576: 64 rows
// 0.94-1.00 ms against 1.02, 16 rows 0.24-0.28 against 0.27-0.32). Calls of up to 4 rows take
// the two-half tile (avx2_tile).
inline int row_tile_avx2(int64_t left) { return left == 4 ? 4 : left >= 3 ? 3 : int(left); }

// Calls fn(std::integral_constant<int, R>) for R = r in 1..8 (a tile template per row count).
template <class Fn>
inline void with_rows(int r, Fn&& fn) {
  switch (r) {
    case 8: fn(std::integral_constant<int, 8>()); break;
    case 7: fn(std::integral_constant<int, 7>()); break;
    case 6: fn(std::integral_constant<int, 6>()); break;
    case 5: fn(std::integral_constant<int, 5>()); break;
    case 4: fn(std::integral_constant<int, 4>()); break;
    case 3: fn(std::integral_constant<int, 3>()); break;
    case 2: fn(std::integral_constant<int, 2>()); break;
    default: fn(std::integral_constant<int, 1>()); break;
  }
}

// An output tensor's storage, resolved once per call: at::Tensor::data_ptr checks the storage
// and the dtype each time, and a tile's write-out ran it per row (about 2% of a one-row decode
// step's samples under perf, AMD EPYC).
struct OutPtr {
  void* base;
  bool bf;
  explicit OutPtr(at::Tensor& t) : base(t.data_ptr()), bf(t.scalar_type() == at::kBFloat16) {}
};

void write_out(const float* tile, int R, int C, int64_t row0, int64_t col0, int64_t N, const OutPtr& out) {
  const int64_t n = std::min<int64_t>(C * COLS, N - col0);
  for (int r = 0; r < R; ++r) {
    const float* src = tile + r * C * COLS;
    if (out.bf) {
      uint16_t* dst = static_cast<uint16_t*>(out.base) + (row0 + r) * N + col0;
      for (int64_t j = 0; j < n; ++j) dst[j] = f32_to_bf16(src[j]);
    } else {
      float* dst = static_cast<float*>(out.base) + (row0 + r) * N + col0;
      std::memcpy(dst, src, n * sizeof(float));
    }
  }
}

// The one-block-at-a-time drivers' loop: units of 4 column blocks (their weights stay in L1/L2
// across a unit's row tiles) shared out to the threads, row tiles of tiles(rows left) rows
// within a unit (row_tile's 8/4/2/1 unless a driver passes another);
// body(b, t0, R, tile) computes rows t0..t0+R-1 of column block b into tile [R][16] and writes
// them out. A row's tile never depends on the rows beside it.
template <class Body>
void block_row_tiles(int64_t nblocks, int64_t T, Body&& body, int (*tiles)(int64_t) = row_tile) {
  constexpr int UNIT = 4;
  const int64_t units = (nblocks + UNIT - 1) / UNIT;
  par_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    alignas(64) float tile[8 * COLS];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b0 = u * UNIT, nb = std::min<int64_t>(UNIT, nblocks - b0);
      for (int64_t t0 = 0; t0 < T;) {
        const int R = tiles(T - t0);
        for (int64_t b = b0; b < b0 + nb; ++b) body(b, t0, R, tile);
        t0 += R;
      }
    }
  });
}

// ISA_AVX512_FAR: the AVX-512 BF16 int4 path with its weight prefetch FAR_PREFETCH bytes ahead
// instead of PREFETCH: the same instructions otherwise, so the same bits (measured on a 2-core
// Intel Xeon, Sapphire Rapids: one row over SmolLM2's layers 6.99 ms against 8.98; chosen per CPU
// at load, cpu_kernels.choose). int8 runs it as ISA_AVX512.
enum Isa : int64_t { ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_FAR = 3, ISA_AVX512_FMA = 4 };
constexpr int FAR_PREFETCH = 2048;

int64_t detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16"))
    return ISA_AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
  return 0;
}

// level 4 needs AVX-512F/BW/VL and FMA only (no BF16: Skylake/Cascade Lake servers have it too)
bool has_avx512_fma() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
}

void check_isa(int64_t isa) {
  TORCH_CHECK(isa == ISA_AVX2 || isa == ISA_AVX512 || isa == ISA_AVX512_FAR || isa == ISA_AVX512_FMA,
              "specbuild_cpu: isa must be 1 (AVX2), 2 (AVX-512 BF16), 3 (AVX-512 BF16, far prefetch) or 4 "
              "(AVX-512 FMA), got ", isa);
  if (isa == ISA_AVX512_FMA) {
    TORCH_CHECK(has_avx512_fma(), "specbuild_cpu: this CPU lacks ISA level 4 (AVX-512F/BW/VL with FMA)");
  } else {
    TORCH_CHECK(std::min<int64_t>(isa, ISA_AVX512) <= detect_isa(), "specbuild_cpu: this CPU lacks ISA level ", isa,
                " (it has ", detect_isa(), ")");
  }
}

// x rows as the kernels read them: bf16 bits (the AVX-512 int4 path) or fp32, plus the per-group
// input sums (int4) in fixed order.
std::vector<float> group_sums(const at::Tensor& xb, int64_t G) {  // xb: bfloat16 [T, K]
  const int64_t T = xb.size(0), K = xb.size(1), ng = K / G;
  std::vector<float> sx(T * ng);
  const uint16_t* p = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  for (int64_t t = 0; t < T; ++t)
    for (int64_t g = 0; g < ng; ++g) {
      float s = 0.0f;
      for (int64_t k = 0; k < G; ++k) s += bf16_to_f32(p[t * K + g * G + k]);
      sx[t * ng + g] = s;
    }
  return sx;
}

template <bool F32S, int PF>
void int4_avx512(const at::Tensor& x, const uint8_t* w, int64_t nblocks, int64_t N, int64_t G, const float* sx,
                 at::Tensor& out) {
  const int64_t T = x.size(0), K = x.size(1), ng = K / G;
  const int64_t grp = G * 8 + COLS * 2 * (F32S ? 4 : 2), blk = grp * ng;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  // one column block per tile: one weight stream at a time measured faster than 2-4
  // interleaved ones (EPYC, 1 thread, SmolLM2's layers: one row 5.0 / 7.7 ms against
  // 6.9 / 9.1, five rows 11.9 / 15.6 against 14.2 / 18.4, 17 rows the same)
  const OutPtr op(out);
  block_row_tiles(nblocks, T, [&](int64_t b, int64_t t0, int R, float* tile) {
    const uint16_t* xr = xb + t0 * K;
    const float* sr = sx + t0 * ng;
    const uint8_t* wb = w + b * blk;
#define TILE(RR) int4_rows_bf16<RR, F32S, PF>(wb, grp, ng, G, xr, K, sr, tile)
    if (R == 8) TILE(8); else if (R == 4) TILE(4); else if (R == 2) TILE(2);
    else int4_tile_bf16<1, 1, F32S, PF>(wb, blk, grp, ng, G, xr, K, sr, tile);
#undef TILE
    write_out(tile, R, 1, t0, b * COLS, N, op);
  });
}

// Level 4: rows in tiles of 8/4/2/1 (two chains per row: 16 of the 32 zmm registers at R = 8),
// each unit's blocks passed once per row tile while they sit in L1/L2.
template <bool F32S>
void int4_fma(const at::Tensor& x, const uint8_t* w, int64_t nblocks, int64_t N, int64_t G, const float* sx,
              at::Tensor& out) {
  const int64_t T = x.size(0), K = x.size(1), ng = K / G;
  const int64_t grp = G * 8 + COLS * 2 * (F32S ? 4 : 2), blk = grp * ng;
  std::vector<float> xf(T * K);  // the inputs widened to fp32 once (exact)
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  for (int64_t i = 0; i < T * K; ++i) xf[i] = bf16_to_f32(xb[i]);
  const OutPtr op(out);
  block_row_tiles(nblocks, T, [&](int64_t b, int64_t t0, int R, float* tile) {
    const float* xr = xf.data() + t0 * K;
    const float* sr = sx + t0 * ng;
    const uint8_t* wb = w + b * blk;
    if (R == 8) int4_rows_fma<8, F32S, FAR_PREFETCH>(wb, grp, ng, G, xr, K, sr, tile);
    else if (R == 4) int4_rows_fma<4, F32S, FAR_PREFETCH>(wb, grp, ng, G, xr, K, sr, tile);
    else if (R == 2) int4_rows_fma<2, F32S, FAR_PREFETCH>(wb, grp, ng, G, xr, K, sr, tile);
    else int4_rows_fma<1, F32S, FAR_PREFETCH>(wb, grp, ng, G, xr, K, sr, tile);
    write_out(tile, R, 1, t0, b * COLS, N, op);
  });
}

void int4_avx512_any(const at::Tensor& x, const uint8_t* w, int64_t nblocks, int64_t N, int64_t G, const float* sx,
                     bool f32s, int64_t isa, at::Tensor& out) {
  if (isa == ISA_AVX512_FMA) {
    f32s ? int4_fma<true>(x, w, nblocks, N, G, sx, out) : int4_fma<false>(x, w, nblocks, N, G, sx, out);
    return;
  }
  const bool far = isa == ISA_AVX512_FAR;
  if (f32s) far ? int4_avx512<true, FAR_PREFETCH>(x, w, nblocks, N, G, sx, out)
            : int4_avx512<true, PREFETCH>(x, w, nblocks, N, G, sx, out);
  else far ? int4_avx512<false, FAR_PREFETCH>(x, w, nblocks, N, G, sx, out)
           : int4_avx512<false, PREFETCH>(x, w, nblocks, N, G, sx, out);
}

template <bool F32S>
void int4_avx2(const at::Tensor& xf, const uint8_t* w, int64_t nblocks, int64_t N, int64_t G, at::Tensor& out) {
  const int64_t T = xf.size(0), K = xf.size(1), ng = K / G;
  const int64_t grp = G * 8 + COLS * 2 * (F32S ? 4 : 2), blk = grp * ng;
  const float* xp = xf.data_ptr<float>();
  const OutPtr op(out);
  par_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) float tile[4 * COLS];
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t t0 = 0; t0 < T; ) {
        const int R = std::min(row_tile(T - t0), 4);
        const float* xr = xp + t0 * K;
        if (R == 4) int4_rows_avx2<4, F32S>(w + b * blk, grp, ng, G, xr, K, tile);
        else if (R == 2) int4_rows_avx2<2, F32S>(w + b * blk, grp, ng, G, xr, K, tile);
        else int4_rows_avx2<1, F32S>(w + b * blk, grp, ng, G, xr, K, tile);
        write_out(tile, R, 1, t0, b * COLS, N, op);
        t0 += R;
      }
  });
}

at::Tensor int4_mm(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, int64_t G, bool f32_scales,
                   int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(x_in.dim() == 2, "int4_mm: x must be [T, K], got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "int4_mm: x must be bfloat16 or float32, got ", x_in.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 1,
              "int4_mm: packed must be a contiguous 1-d uint8 tensor");
  const int64_t T = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(G % 8 == 0 && G > 0 && K % G == 0, "int4_mm: group size ", G, " must divide K = ", K,
              " and be a multiple of 8");
  const int64_t nblocks = (N + COLS - 1) / COLS, ng = K / G;
  const int64_t grp = G * 8 + COLS * 2 * (f32_scales ? 4 : 2);
  TORCH_CHECK(packed.numel() == nblocks * ng * grp, "int4_mm: packed has ", packed.numel(), " bytes, [", N, ", ", K,
              "] with group ", G, " needs ", nblocks * ng * grp);
  at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({T, N}, x.options());
  if (T == 0 || N == 0) return out;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (isa >= ISA_AVX512 && x.scalar_type() == at::kBFloat16) {
    std::vector<float> sx = group_sums(x, G);
    int4_avx512_any(x, w, nblocks, N, G, sx.data(), f32_scales, isa, out);
  } else {
    at::Tensor xf = x.to(at::kFloat).contiguous();
    if (f32_scales) int4_avx2<true>(xf, w, nblocks, N, G, out);
    else int4_avx2<false>(xf, w, nblocks, N, G, out);
  }
  return out;
}

at::Tensor int8_mm(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, int64_t isa) {
  check_isa(isa);
  TORCH_CHECK(x_in.dim() == 2, "int8_mm: x must be [T, K], got ", x_in.sizes());
  TORCH_CHECK(x_in.scalar_type() == at::kBFloat16 || x_in.scalar_type() == at::kFloat,
              "int8_mm: x must be bfloat16 or float32, got ", x_in.scalar_type());
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 1,
              "int8_mm: packed must be a contiguous 1-d int8 tensor");
  const int64_t T = x_in.size(0), K = x_in.size(1), nblocks = (N + COLS - 1) / COLS;
  const int64_t blk = K * COLS + COLS * 4;
  TORCH_CHECK(packed.numel() == nblocks * blk, "int8_mm: packed has ", packed.numel(), " bytes, [", N, ", ", K,
              "] needs ", nblocks * blk);
  at::Tensor out = at::empty({T, N}, x_in.options());
  if (T == 0 || N == 0) return out;
  at::Tensor xf = x_in.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const int8_t* w = packed.data_ptr<int8_t>();
  // int8 levels: 2 runs one-row tiles through the AVX2 code, 3 through the AVX-512 code (the same
  // operations per output, so the same bits; measured: AVX2 ahead on an AMD EPYC at one row, the
  // AVX-512 code twice as fast on an Intel Xeon, Sapphire Rapids class: 1.0 against 2.0 ms for a
  // [49152, 576] lm_head; chosen per CPU at load); 4 (an int4 level) runs as the CPU's best.
  if (isa == ISA_AVX512_FMA) isa = detect_isa();
  const bool row512 = isa == ISA_AVX512_FAR;
  const OutPtr op(out);
  if (isa >= ISA_AVX512) {
    constexpr int UNIT = 8;
    const int64_t units = (nblocks + UNIT - 1) / UNIT;
    par_for(0, units, 1, [&](int64_t u0, int64_t u1) {
      alignas(64) float tile[8 * UNIT * COLS];
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t b0 = u * UNIT, nb = std::min<int64_t>(UNIT, nblocks - b0);
        for (int64_t t0 = 0; t0 < T; ) {
          const int R = row_tile(T - t0);
          const int C = nb == UNIT ? UNIT / R : 1;
          if (R == 1 && !row512) {  // one row through the AVX2 code (level 2): the same bits
            for (int64_t b = b0; b < b0 + nb; ++b) {
              int8_row_avx2(w + b * blk, K, xp + t0 * K, tile);
              write_out(tile, 1, 1, t0, b * COLS, N, op);
            }
            t0 += 1;
            continue;
          }
          for (int64_t b = b0; b < b0 + nb; b += C) {
            const int8_t* wb = w + b * blk;
            const float* xr = xp + t0 * K;
#define TILE(RR, CC) int8_tile_avx512<RR, CC>(wb, blk, K, xr, tile)
            if (C == 1) {
              if (R == 8) TILE(8, 1); else if (R == 4) TILE(4, 1); else if (R == 2) TILE(2, 1); else TILE(1, 1);
            } else if (R == 4) TILE(4, 2);
            else if (R == 2) TILE(2, 4);
            else TILE(1, 8);
#undef TILE
            write_out(tile, R, C, t0, b * COLS, N, op);
          }
          t0 += R;
        }
      }
    });
  } else {
    par_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
      alignas(64) float tile[4 * COLS];
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t t = 0; t < T;) {
          const int R = T - t >= 4 ? 4 : int(T - t);
          const int8_t* wb = w + b * blk;
          const float* xr = xp + t * K;
          if (R == 4) int8_rows_avx2<4>(wb, K, xr, tile);
          else if (R == 3) int8_rows_avx2<3>(wb, K, xr, tile);
          else if (R == 2) int8_rows_avx2<2>(wb, K, xr, tile);
          else int8_row_avx2(wb, K, xr, tile);
          write_out(tile, R, 1, t, b * COLS, N, op);
          t += R;
        }
    });
  }
  return out;
}

// int4 x Q8: the ISA paths (an argument, fixed per weight at load like int4_mm's isa).
// Q8_AVX2_FAR: Q8_AVX2's likewise (measured on a 2-core AMD EPYC without AVX-512: a one-row
// forward of SmolLM2-135M 5.4-6.0 -> 4.6-5.0 ms in three interleaved rounds, 2 threads).
// Q8_VNNI512_FAR: Q8_VNNI512's instructions with the weight prefetch FAR_PREFETCH bytes ahead (the
// same bits; a speed choice per CPU, as ISA_AVX512_FAR is for the bfloat16 int4 path).
// Q8_VNNI512_FEW: Q8_VNNI512's instructions with no software prefetch in tiles of up to FEW_ROWS
// rows (wider tiles prefetch PREFETCH ahead): on a 2-core AMD EPYC Zen 4 the hardware streams a
// few rows' weights faster alone. Whole forwards, one engine, alternating with Q8_VNNI512: one
// row 4.76 -> 4.18 ms, two rows 5.78 -> 5.29, four 7.94 -> 7.76, while eight rows without any
// prefetch took 11.45 -> 12.54 (so wider tiles keep it). The same instructions otherwise, so the
// same bits; q8_path() measures it against the others at start-up. int8_q8_mm takes it too.
// Q8_VNNI512_WIDE: no software prefetch in tiles of up to WIDE_FROM - 1 rows, FAR_PREFETCH ahead in
// wider ones. A tile of 3+ rows spends long enough on each weight line that a fetch issued 512
// bytes ahead (or left to the hardware) comes too late: verify forwards of one sequence after 150
// tokens, alternating in one engine (2-core AMD EPYC Zen 4, 21 rounds): 3 rows 5.60 -> 5.01 ms,
// 4 rows 6.49 -> 6.12, 5 rows 8.84 -> 8.13, 6 rows 9.48 -> 8.89, 8 rows 10.53 -> 10.02 against
// Q8_VNNI512_FEW (and on a second run 3 rows -10%, 4 -9%, 8 -5%, 16 -9%), while 2 rows were 4-12%
// slower with it. Chosen over Q8_VNNI512_FEW at start-up by a 4-row measurement (q8_path); the
// lm_head's int8_q8_mm keeps Q8_VNNI512_FEW there (far prefetch slowed its 3-4 row tiles 8-17%).
enum Q8Path : int64_t { Q8_AVX2 = 1, Q8_VNNI512 = 2, Q8_AVXVNNI = 3, Q8_VNNI256 = 4, Q8_VNNI512_FAR = 5,
                       Q8_AVX2_FAR = 6, Q8_VNNI512_FEW = 7, Q8_VNNI512_WIDE = 8 };
constexpr int FEW_ROWS = 4, WIDE_FROM = 3;

int64_t q8_paths() {  // bit p set: path p runs on this CPU
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  const bool v512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  int64_t m = 0;
  if (avx2) m |= (int64_t(1) << Q8_AVX2) | (int64_t(1) << Q8_AVX2_FAR);
  if (avx2 && v512)
    m |= (int64_t(1) << Q8_VNNI512) | (int64_t(1) << Q8_VNNI256) | (int64_t(1) << Q8_VNNI512_FAR) |
         (int64_t(1) << Q8_VNNI512_FEW) | (int64_t(1) << Q8_VNNI512_WIDE);
  if (avx2 && __builtin_cpu_supports("avxvnni")) m |= int64_t(1) << Q8_AVXVNNI;
  return m;
}

struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> dx, qs;
};

Q8Rows q8_rows(const float* x, int64_t T, int64_t K) {  // x: float32 [T, K], contiguous
  const int64_t nbk = K / QB;
  Q8Rows r{std::vector<int8_t>(T * K), std::vector<float>(T * nbk), std::vector<float>(T * nbk)};
  // rows on the threads past 8 (a prefill chunk, a wide batch): each row is quantised alone, so
  // the split never changes a byte; a decode step's few rows stay on the calling thread. Measured
  // (2-core AMD EPYC Zen 4, pool x2, prompts alternating in one process): a 256-token prefill
  // 170-176 ms on one thread against 165 ms split; serial, the quantising was ~9% of it.
  par_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      q8_quantize_row(x + t * K, K, r.q.data() + t * K, r.dx.data() + t * nbk, r.qs.data() + t * nbk);
  });
  return r;
}
Q8Rows q8_rows(const at::Tensor& xf) { return q8_rows(xf.data_ptr<float>(), xf.size(0), xf.size(1)); }

void check_q8_input(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2, op, ": x must be [T, K], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, op,
              ": x must be bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.size(1) % QB == 0, op, ": K = ", x.size(1), " must be a multiple of ", QB, " (the int8 blocks)");
  TORCH_CHECK(q8_paths() & (int64_t(1) << Q8_AVX2), op, ": this CPU lacks AVX2 + FMA + F16C");
}

// The int8 blocks int4_q8_mm multiplies (for tests and references): q int8 [T, K], dx and
// qsum float32 [T, K / 32].
std::tuple<at::Tensor, at::Tensor, at::Tensor> q8_quantize(const at::Tensor& x_in) {
  check_q8_input(x_in, "q8_quantize");
  at::Tensor xf = x_in.to(at::kFloat).contiguous();
  const int64_t T = xf.size(0), K = xf.size(1);
  Q8Rows r = q8_rows(xf);
  at::Tensor q = at::empty({T, K}, xf.options().dtype(at::kChar));
  at::Tensor dx = at::empty({T, K / QB}, xf.options()), qs = at::empty({T, K / QB}, xf.options());
  std::memcpy(q.data_ptr<int8_t>(), r.q.data(), r.q.size());
  std::memcpy(dx.data_ptr<float>(), r.dx.data(), r.dx.size() * 4);
  std::memcpy(qs.data_ptr<float>(), r.qs.data(), r.qs.size() * 4);
  return {q, dx, qs};
}

// Plain AVX2's tile for R rows of one column block. stream (a call of at most 4 rows: a decode
// step, a short verify pass): both halves at once (q8_tile_avx2<R, 2>), each 64-byte line of
// weights used whole when it arrives, one pass over the block; otherwise (prefill, a wide batch:
// the unit's weights stay in cache across its row tiles) one half at a time (q8_rows_avx2), which
// keeps its accumulators in registers. Measured on a 2-core AMD EPYC (AVX2, the kernels' pool x2,
// N = 3072, K = 576, cold weights, two runs each): 2 rows 0.057-0.064 ms against 0.073-0.091, 3
// rows 0.072-0.076 against 0.075-0.095, 4 rows 0.088-0.094 against 0.092-0.105; with the weights
// in cache the one-half tile was up to 4% faster at 16 and 64 rows. One row keeps the two-half
// tile at every width (registers to spare). Every choice gives the same bits.
template <bool F16S, int PF>
void avx2_tile(int R, bool stream, const uint8_t* wb, int64_t blk, int64_t grp, int ng, int G, const int8_t* xt,
               int64_t K, const float* dt, const float* st, float* tile) {
  if (R == 1) q8_tile_avx2<1, 2, F16S, PF>(wb, blk, grp, ng, G, xt, K, dt, st, tile);
  else if (stream && R == 2) q8_tile_avx2<2, 2, F16S, PF>(wb, blk, grp, ng, G, xt, K, dt, st, tile);
  else if (stream && R == 3) q8_tile_avx2<3, 2, F16S, PF>(wb, blk, grp, ng, G, xt, K, dt, st, tile);
  else if (stream) q8_tile_avx2<4, 2, F16S, PF>(wb, blk, grp, ng, G, xt, K, dt, st, tile);
  else if (R == 2) q8_rows_avx2<2, F16S, PF>(wb, grp, ng, G, xt, K, dt, st, tile);
  else if (R == 3) q8_rows_avx2<3, F16S, PF>(wb, grp, ng, G, xt, K, dt, st, tile);
  else q8_rows_avx2<4, F16S, PF>(wb, grp, ng, G, xt, K, dt, st, tile);
}

template <bool F16S>
void int4_q8_run(const uint8_t* w, int64_t nblocks, int64_t N, int64_t K, int64_t G, int64_t T, const Q8Rows& xr,
                 int64_t path, at::Tensor& out) {
  const int64_t ng = K / G, grp = G * 8 + COLS * 2 * (F16S ? 2 : 4), blk = grp * ng;
  const int8_t* xq = xr.q.data();
  const float* dx = xr.dx.data();
  const float* qs = xr.qs.data();
  const int64_t nbk = K / QB;
  // one column block per tile: one weight stream at a time measured faster than 2-4 interleaved
  // ones (EPYC, 1 thread, SmolLM2's layers, AVX512-VNNI: one row 4.5 / 6.0 / 8.4 ms against
  // 6.5 / 7.0 / 9.3 in three A/B runs, wider the same or better; AVX2: one row 8.3 ms against
  // 11.4 with two blocks interleaved). zmm tiles take 1-8 rows, ymm ones 2 or 1 (16 registers).
  const bool zmm = path == Q8_VNNI512 || path == Q8_VNNI512_FAR || path == Q8_VNNI512_FEW || path == Q8_VNNI512_WIDE;
  const bool stream = T <= 4;  // plain AVX2: one row tile per block, its weights read once (avx2_tile)
  const OutPtr op(out);
  block_row_tiles(nblocks, T, [&](int64_t b, int64_t t0, int R, float* tile) {
    const int8_t* xt = xq + t0 * K;
    const float *dt = dx + t0 * nbk, *st = qs + t0 * nbk;
    const uint8_t* wb = w + b * blk;
    if (zmm) {
      with_rows(R, [&](auto rr) {
        constexpr int RR = decltype(rr)::value;
        if (path == Q8_VNNI512_FEW && RR <= FEW_ROWS) q8_tile_vnni512<RR, 1, F16S, 0>(wb, blk, grp, ng, G, xt, K, dt, st, tile);
        else if (path == Q8_VNNI512_WIDE && RR < WIDE_FROM) q8_tile_vnni512<RR, 1, F16S, 0>(wb, blk, grp, ng, G, xt, K, dt, st, tile);
        else if (path == Q8_VNNI512_FAR || path == Q8_VNNI512_WIDE)
          q8_tile_vnni512<RR, 1, F16S, FAR_PREFETCH>(wb, blk, grp, ng, G, xt, K, dt, st, tile);
        else q8_tile_vnni512<RR, 1, F16S, PREFETCH>(wb, blk, grp, ng, G, xt, K, dt, st, tile);
      });
    } else {
#define YTILE(FN)                                                        \
  if (R == 2) FN<2, 2, F16S>(wb, blk, grp, ng, G, xt, K, dt, st, tile); \
  else FN<1, 2, F16S>(wb, blk, grp, ng, G, xt, K, dt, st, tile);
      if (path == Q8_AVX2) avx2_tile<F16S, PREFETCH>(R, stream, wb, blk, grp, ng, G, xt, K, dt, st, tile);
      else if (path == Q8_AVX2_FAR) avx2_tile<F16S, FAR_PREFETCH>(R, stream, wb, blk, grp, ng, G, xt, K, dt, st, tile);
      else if (path == Q8_AVXVNNI) { YTILE(q8_tile_avxvnni) }
      else { YTILE(q8_tile_vnni256) }
#undef YTILE
    }
    write_out(tile, R, 1, t0, b * COLS, N, op);
  }, zmm ? row_tile_any : path == Q8_AVX2 || path == Q8_AVX2_FAR ? row_tile_avx2 : row_tile_2);
}

at::Tensor int4_q8_mm(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, int64_t G, bool f16_scales,
                      int64_t path) {
  TORCH_CHECK(path >= Q8_AVX2 && path <= Q8_VNNI512_WIDE,
              "int4_q8_mm: path must be 1 (AVX2), 2 (AVX512-VNNI), 3 (AVX-VNNI), 4 (AVX512-VL VNNI ymm), 5 "
              "(AVX512-VNNI, far prefetch), 6 (AVX2, far prefetch), 7 (AVX512-VNNI, no prefetch in few-row "
              "tiles) or 8 (AVX512-VNNI, far prefetch in wide tiles), got ", path);
  TORCH_CHECK((q8_paths() >> path) & 1, "int4_q8_mm: this CPU cannot run path ", path, " (runnable paths: bitmask ",
              q8_paths(), ")");
  check_q8_input(x_in, "int4_q8_mm");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 1,
              "int4_q8_mm: packed must be a contiguous 1-d uint8 tensor");
  const int64_t T = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(G > 0 && G % QB == 0 && K % G == 0, "int4_q8_mm: group size ", G, " must divide K = ", K,
              " and be a multiple of ", QB);
  const int64_t nblocks = (N + COLS - 1) / COLS, ng = K / G, grp = G * 8 + COLS * 2 * (f16_scales ? 2 : 4);
  TORCH_CHECK(packed.numel() == nblocks * ng * grp, "int4_q8_mm: packed has ", packed.numel(), " bytes, [", N, ", ",
              K, "] with group ", G, (f16_scales ? " and fp16" : " and fp32"), " scales needs ", nblocks * ng * grp);
  at::Tensor out = at::empty({T, N}, x_in.options());
  if (T == 0 || N == 0) return out;
  at::Tensor xf = x_in.to(at::kFloat).contiguous();
  const Q8Rows xr = q8_rows(xf);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  if (f16_scales) int4_q8_run<true>(w, nblocks, N, K, G, T, xr, path, out);
  else int4_q8_run<false>(w, nblocks, N, K, G, T, xr, path, out);
  return out;
}

// ---------------------------------------------------------------- int8 x int8 (Q8) -----------
// int8_q8_mm (the lm_head's int8-a8 inputs, opt-in): int8 weights with one fp32 scale per output
// column (the int8 format's values) against inputs quantised as for int4_q8_mm (q8_quantize_row:
// blocks of 32, d = amax / 127). vpdpbusd multiplies unsigned by signed bytes, so the weights are
// stored offset, u = w + 128, and per (row, column, block) the exact integer
//     isum = sum u * q - 128 * qsum = sum w * q      (|sum w * q| <= 128 * 127 * 32 < 2^24)
// enters the fp32 accumulator as acc = fma(float(isum), dx, acc) in block order, and the output
// is acc * s. Integer sums are exact in any order and each (row, column) owns its accumulator,
// so a row's bits do not depend on the rows beside it. Layout (repack_int8_q8 in
// cpu_kernels.py): per block of 16 columns, K / 4 chunks of 64 bytes (byte 4c + j: column c's
// input 4o + j, offset by 128), then 16 fp32 scales. This tile needs AVX512-VNNI;
// int8_q8_rows_avx2 below forms the same integers with plain AVX2.
template <int R, int PF = PREFETCH>
__attribute__((target("avx512f,avx512bw,avx512vnni,fma"))) void int8_q8_tile_vnni512(
    const uint8_t* w, int64_t K, const int8_t* xq, const float* dx, const float* qs, float* out /* [R][16] */) {
  const int64_t nbk = K / QB;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nbk; ++b) {
    __m512i ia[R], ib[R];
    for (int r = 0; r < R; ++r) ia[r] = ib[r] = _mm512_setzero_si512();
    for (int o = 0; o < 8; o += 2) {
      const uint8_t* p = w + (b * 8 + o) * 64;
      if constexpr (PF > 0) _mm_prefetch((const char*)(p + PF), _MM_HINT_T0);
      const __m512i v0 = _mm512_loadu_si512((const void*)p), v1 = _mm512_loadu_si512((const void*)(p + 64));
      for (int r = 0; r < R; ++r) {
        const int8_t* x4 = xq + r * K + b * QB + 4 * o;
        ia[r] = dpbusd_bcast(ia[r], v0, x4);
        ib[r] = dpbusd_bcast(ib[r], v1, x4 + 4);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i off = _mm512_set1_epi32(128 * int32_t(qs[r * nbk + b]));
      const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(ia[r], ib[r]), off);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(dx[r * nbk + b]), acc[r]);
    }
  }
  const __m512 s = _mm512_loadu_ps((const float*)(w + K * COLS));
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * COLS, _mm512_mul_ps(acc[r], s));
}

// Plain AVX2 (no VNNI): vpmaddubsw multiplies unsigned by signed bytes into saturating int16
// pairs, and u * q pairs (255 * 127 * 2) would saturate. So the stored u = w + 128 goes back to
// the signed w (xor 0x80), the unsigned operand is |w| (<= 128) and the signed one q with w's
// sign (vpsignb): each pair |w| * +-q sums to at most 2 * 128 * 127 = 32512, exact in int16,
// and vpmaddwd by ones gives each 32-bit lane column c's exact sum of four w * q. Per (row,
// column, block) that is the VNNI tile's isum, entering the same epilogue in the same block
// order: the same bits as int8_q8_tile_vnni512. R rows, one half (8 columns) at a time so that R
// int32 sums and R float accumulators stay in registers (2R + 5 of 16).
template <int R, int PF = PREFETCH>
__attribute__((target("avx2,fma"))) void int8_q8_rows_avx2(const uint8_t* w, int64_t K, const int8_t* xq,
                                                            const float* dx, float* out /* [R][16] */) {
  const int64_t nbk = K / QB;
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  for (int h = 0; h < 2; ++h) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nbk; ++b) {
      __m256i ia[R];
      for (int r = 0; r < R; ++r) ia[r] = _mm256_setzero_si256();
      for (int o = 0; o < 8; ++o) {
        const uint8_t* p = w + (b * 8 + o) * 64 + h * 32;
        if (h == 0) _mm_prefetch((const char*)(p + PF), _MM_HINT_T0);
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)p), flip);
        const __m256i av = _mm256_abs_epi8(v);
        for (int r = 0; r < R; ++r) {
          const __m256i x = _mm256_set1_epi32(load_i32(xq + r * K + b * QB + 4 * o));
          ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(x, v)), ones));
        }
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]), _mm256_set1_ps(dx[r * nbk + b]), acc[r]);
    }
    const __m256 s = _mm256_loadu_ps((const float*)(w + K * COLS) + 8 * h);
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * COLS + 8 * h, _mm256_mul_ps(acc[r], s));
  }
}

// One row: both halves in one pass over the block (2 int32 sums and 2 float accumulators), so
// the weights stream once with the prefetch running throughout; the same integers and epilogue.
// The AVX2 tiles prefetch FAR_PREFETCH bytes ahead: [49152, 576] on a 2-core AMD EPYC with the
// caches flushed between calls, 1 / 2 / 4 / 8 rows 1.15-1.17 / 1.32 / 1.63 / 2.88 ms, against
// 1.33 / 1.99 / 2.30 / 4.37 with float32 inputs (int8_rows_avx2); one row is then at the machine's
// streaming rate (a torch sum over 28 MB took 1.10 ms in the same minutes).
template <int PF = PREFETCH>
__attribute__((target("avx2,fma"))) void int8_q8_row_avx2(const uint8_t* w, int64_t K, const int8_t* xq,
                                                           const float* dx, float* out /* [16] */) {
  const int64_t nbk = K / QB;
  const __m256i flip = _mm256_set1_epi8(char(0x80)), ones = _mm256_set1_epi16(1);
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (int64_t b = 0; b < nbk; ++b) {
    __m256i i0 = _mm256_setzero_si256(), i1 = _mm256_setzero_si256();
    for (int o = 0; o < 8; ++o) {
      const uint8_t* p = w + (b * 8 + o) * 64;
      _mm_prefetch((const char*)(p + PF), _MM_HINT_T0);
      const __m256i v0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)p), flip);
      const __m256i v1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 32)), flip);
      const __m256i x = _mm256_set1_epi32(load_i32(xq + b * QB + 4 * o));
      i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v0), _mm256_sign_epi8(x, v0)), ones));
      i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(v1), _mm256_sign_epi8(x, v1)), ones));
    }
    const __m256 d = _mm256_set1_ps(dx[b]);
    acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i0), d, acc0);
    acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i1), d, acc1);
  }
  const float* s = (const float*)(w + K * COLS);
  _mm256_storeu_ps(out, _mm256_mul_ps(acc0, _mm256_loadu_ps(s)));
  _mm256_storeu_ps(out + 8, _mm256_mul_ps(acc1, _mm256_loadu_ps(s + 8)));
}

// int8_q8_mm's paths: Q8_VNNI512 where it runs, else Q8_AVX2 (the same bits). `path` 0: the best here.
int64_t int8_q8_path(int64_t path) {
  const int64_t runs = q8_paths();
  if (path == 0) return (runs >> Q8_VNNI512) & 1 ? Q8_VNNI512 : (runs >> Q8_AVX2) & 1 ? Q8_AVX2 : 0;
  TORCH_CHECK(path == Q8_AVX2 || path == Q8_VNNI512 || path == Q8_VNNI512_FEW, "int8_q8_mm: path must be 0 (the "
              "best here), 1 (AVX2), 2 (AVX512-VNNI) or 7 (AVX512-VNNI, no prefetch in few-row tiles), got ", path);
  TORCH_CHECK((runs >> path) & 1, "int8_q8_mm: path ", path, (path == Q8_AVX2 ? " (AVX2)" : " (AVX512-VNNI)"),
              " cannot run on this CPU");
  return path;
}

bool int8_q8_available() { return int8_q8_path(0) != 0; }

void int8_q8_into(const uint8_t* w, int64_t N, int64_t K, int64_t path, const Q8Rows& xr, int64_t T,
                  const OutPtr& op);

at::Tensor int8_q8_mm(const at::Tensor& x_in, const at::Tensor& packed, int64_t N, int64_t path_in) {
  const int64_t path = int8_q8_path(path_in);
  TORCH_CHECK(path != 0, "int8_q8_mm: this CPU lacks AVX2 + FMA (the int8-a8 lm_head's paths: AVX2, AVX512-VNNI)");
  check_q8_input(x_in, "int8_q8_mm");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 1,
              "int8_q8_mm: packed must be a contiguous 1-d uint8 tensor");
  const int64_t T = x_in.size(0), K = x_in.size(1), nblocks = (N + COLS - 1) / COLS, blk = K * COLS + COLS * 4;
  TORCH_CHECK(packed.numel() == nblocks * blk, "int8_q8_mm: packed has ", packed.numel(), " bytes, [", N, ", ", K,
              "] needs ", nblocks * blk);
  at::Tensor out = at::empty({T, N}, x_in.options().dtype(at::kFloat));
  if (T == 0 || N == 0) return out;
  at::Tensor xf = x_in.to(at::kFloat).contiguous();
  int8_q8_into(packed.data_ptr<uint8_t>(), N, K, path, q8_rows(xf), T, OutPtr(out));
  return out;
}

// the int8 x int8 product over rows already rounded to int8 blocks (xr) into op's [T, N] rows
void int8_q8_into(const uint8_t* w, int64_t N, int64_t K, int64_t path, const Q8Rows& xr, int64_t T,
                  const OutPtr& op) {
  const int64_t nblocks = (N + COLS - 1) / COLS, blk = K * COLS + COLS * 4;
  const int64_t nbk = K / QB;
  block_row_tiles(nblocks, T, [&](int64_t b, int64_t t0, int R, float* tile) {
    const int8_t* xt = xr.q.data() + t0 * K;
    const float *dt = xr.dx.data() + t0 * nbk, *st = xr.qs.data() + t0 * nbk;
    const uint8_t* wb = w + b * blk;
    if (path == Q8_VNNI512 || path == Q8_VNNI512_FEW) {
      with_rows(R, [&](auto rr) {
        if (path == Q8_VNNI512_FEW && decltype(rr)::value <= FEW_ROWS) int8_q8_tile_vnni512<decltype(rr)::value, 0>(wb, K, xt, dt, st, tile);
        else int8_q8_tile_vnni512<decltype(rr)::value>(wb, K, xt, dt, st, tile);
      });
    } else if (R == 4) int8_q8_rows_avx2<4, FAR_PREFETCH>(wb, K, xt, dt, tile);
    else if (R == 3) int8_q8_rows_avx2<3, FAR_PREFETCH>(wb, K, xt, dt, tile);
    else if (R == 2) int8_q8_rows_avx2<2, FAR_PREFETCH>(wb, K, xt, dt, tile);
    else int8_q8_row_avx2<FAR_PREFETCH>(wb, K, xt, dt, tile);
    write_out(tile, R, 1, t0, b * COLS, N, op);
  }, path == Q8_VNNI512 || path == Q8_VNNI512_FEW ? row_tile_any : row_tile_4);
}

// ---------------------------------------------------------------- attention rows (AVX2 + FMA) --
// rows_attention: each query row over its own list of cache slots (a decode step's keys, a
// verify row's prefix, a tree node's ancestors), float32 throughout. Each (row, kv head) is
// computed by one thread with instructions that depend only on that row's query, its keys in
// their order and their count, never on the other rows of the call or the thread count: the
// decode step and every row of a verify pass call this same kernel, so a row gives the decode
// step's bits by construction (no per-row SDPA calls and the Python around them). Scores: 4 keys
// at a time (one accumulator each, the D/8 vectors of the query in order), reduced pairwise
// within the vector; softmax: max, exp (exp8 below, a Cephes-style polynomial) and their sum
// in fixed order; output: sum_j p_j v_j in key order, divided by the sum.
__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.37f)), _mm256_set1_ps(-87.33f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 a) {  // ((a0+a1)+(a2+a3))+((a4+a5)+(a6+a7))
  const __m256 h = _mm256_hadd_ps(a, a);
  const __m256 h2 = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
}

__attribute__((target("avx2,fma"))) inline __m128 hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d) {
  // the same pairwise order as hsum8 for each of the four
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 h = _mm256_hadd_ps(ab, cd);
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

__attribute__((target("avx2,fma"))) inline __m256i tail_mask(int64_t left) {  // lanes < left set
  alignas(32) int32_t m[8];
  for (int i = 0; i < 8; ++i) m[i] = i < left ? -1 : 0;
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(m));
}

// Scores of GT heads (q: GT * D floats) against four keys, every key chunk loaded once for the GT
// heads (the heads' chunks stay in registers: 4 * GT accumulators + GT + 1 <= 16 ymm). Per (head,
// key) the operations are attend_group's one-head loop's: a multiply at chunk 0, then a multiply-add
// per chunk in order, then hsum8x4, so the scores are the same bits. The one-head loop loaded each
// key chunk again for every head of the group and was bound by those loads from L1.
// A cache row's eight values as float32: float32 caches as they are, float16 caches (kv_cache.py's
// kv_dtype float16) widened exactly by F16C (every float16 is a float32), so an attention item
// computes the same arithmetic on either, over the values the cache holds.
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 kv8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 kv8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

template <int DV, int GT, class KT>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void scores4(const float* q, const KT* k0, const KT* k1,
                                                                            const KT* k2, const KT* k3, float* s,
                                                                            int64_t n, float scale) {
  constexpr int64_t D = 8 * DV;
  const KT* ks[4] = {k0, k1, k2, k3};
  __m256 a[GT][4];
  {
    __m256 qv[GT];
    for (int hh = 0; hh < GT; ++hh) qv[hh] = _mm256_loadu_ps(q + hh * D);
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = kv8(ks[i]);
      for (int hh = 0; hh < GT; ++hh) a[hh][i] = _mm256_mul_ps(qv[hh], kv);
    }
  }
  for (int c = 1; c < DV; ++c) {
    __m256 qv[GT];
    for (int hh = 0; hh < GT; ++hh) qv[hh] = _mm256_loadu_ps(q + hh * D + 8 * c);
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = kv8(ks[i] + 8 * c);
      for (int hh = 0; hh < GT; ++hh) a[hh][i] = _mm256_fmadd_ps(qv[hh], kv, a[hh][i]);
    }
  }
  for (int hh = 0; hh < GT; ++hh)
    _mm_storeu_ps(s + hh * n, _mm_mul_ps(hsum8x4(a[hh][0], a[hh][1], a[hh][2], a[hh][3]), _mm_set1_ps(scale)));
}

// Values of keys j0..j1 into GT heads' outputs, four chunks (32 floats) of each at a time: each
// value chunk loaded once for the GT heads (4 * GT accumulators + GT weights + 1 <= 16 ymm). Per
// (head, chunk) the accumulation runs over the keys in order from `out` (zero at j0 == 0), as
// attend_group's one-head loop does, so the outputs are the same bits.
template <int GT, class KT>
__attribute__((target("avx2,fma,f16c"), always_inline)) inline void values4(const float* s, int64_t n, const KT* vc,
                                                                       int64_t vs, const int64_t* slots, int64_t j0,
                                                                       int64_t j1, int64_t D, int64_t c0, float* out) {
  __m256 acc[GT][4];
  for (int hh = 0; hh < GT; ++hh)
    for (int c = 0; c < 4; ++c)
      acc[hh][c] = j0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(out + hh * D + 8 * (c0 + c));
  for (int64_t j = j0; j < j1; ++j) {
    const KT* v0 = vc + slots[j] * vs + 8 * c0;
    __m256 p[GT];
    for (int hh = 0; hh < GT; ++hh) p[hh] = _mm256_broadcast_ss(s + hh * n + j);
    for (int c = 0; c < 4; ++c) {
      const __m256 v = kv8(v0 + 8 * c);
      for (int hh = 0; hh < GT; ++hh) acc[hh][c] = _mm256_fmadd_ps(p[hh], v, acc[hh][c]);
    }
  }
  for (int hh = 0; hh < GT; ++hh)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + hh * D + 8 * (c0 + c), acc[hh][c]);
}

// the G query heads of one kv head (q and out: G * D floats, head after head) over n keys;
// s: G * n floats of scratch. Every key and value row is read from memory once for the group
// (the group's other heads find it in L1), and each key or value chunk loaded once for three
// heads at a time (scores4, values4), while each head's arithmetic is what it would be alone:
// its scores 4 keys at a time, its softmax, its values summed in key order (the accumulators go
// through `out` between blocks of keys: exact). Loading each chunk once per head instead took
// 21-22 us against 19.7 a layer for one row after 300 keys, 57-63 against 53-57 after 1,000,
// and 179-182 ms against 170-175 for 30 layers over a 640-row prompt (AMD EPYC, pool x2,
// alternating builds; the same bits on 27 shapes).
template <int DV, class KT>
__attribute__((target("avx2,fma,f16c"))) void attend_group(const float* q, int64_t G, const KT* kc, int64_t ks,
                                                            const KT* vc, int64_t vs, const int64_t* slots, int64_t n,
                                                            float scale, float* s, float* out, float* ml) {
  constexpr int64_t D = 8 * DV;
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    const KT* k0 = kc + slots[j] * ks;
    const KT* k1 = kc + slots[j + 1] * ks;
    const KT* k2 = kc + slots[j + 2] * ks;
    const KT* k3 = kc + slots[j + 3] * ks;
    // the heads three at a time (scores4: each key chunk loaded once for them), the same bits
    int64_t h0 = 0;
    for (; h0 + 3 <= G; h0 += 3) scores4<DV, 3, KT>(q + h0 * D, k0, k1, k2, k3, s + h0 * n + j, n, scale);
    if (G - h0 == 2) scores4<DV, 2, KT>(q + h0 * D, k0, k1, k2, k3, s + h0 * n + j, n, scale);
    else if (G - h0 == 1) scores4<DV, 1, KT>(q + h0 * D, k0, k1, k2, k3, s + h0 * n + j, n, scale);
  }
  for (; j < n; ++j) {
    const KT* k0 = kc + slots[j] * ks;
    for (int64_t hh = 0; hh < G; ++hh) {
      const float* qh = q + hh * D;
      __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qh), kv8(k0));
      for (int c = 1; c < DV; ++c) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qh + 8 * c), kv8(k0 + 8 * c), a0);
      s[hh * n + j] = hsum8(a0) * scale;
    }
  }
  for (int64_t hh = 0; hh < G; ++hh) {  // softmax numerators in place; the sums after the G score rows
    float* sh = s + hh * n;
    // the row's largest score: eight lanes of vmaxps (max(new, lane): a NaN score is passed over
    // as the scalar `sh[i] > m ? sh[i] : m` passes it, a NaN first score stays in every lane),
    // then the lanes, then the tail. The maximum is exact whatever the order, and exp(s - m) is
    // the same for either zero, so the numerators are the scalar loop's bits; the scalar chain
    // (a compare and select per key, each waiting on the last): 30 layers over a 640-row prompt
    // 161-167 ms against 173-205 with it (AMD EPYC, pool x2, alternating builds).
    float m = sh[0];
    int64_t i = 1;
    if (n >= 9) {
      __m256 mv8 = _mm256_set1_ps(sh[0]);
      for (; i + 8 <= n; i += 8) mv8 = _mm256_max_ps(_mm256_loadu_ps(sh + i), mv8);
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, mv8);
      for (int l = 0; l < 8; ++l) m = lanes[l] > m ? lanes[l] : m;
    }
    for (; i < n; ++i) m = sh[i] > m ? sh[i] : m;
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
      const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + j), mv));
      _mm256_storeu_ps(sh + j, p);
      sum = _mm256_add_ps(sum, p);
    }
    if (j < n) {
      const __m256i mk = tail_mask(n - j);
      const __m256 p =
          _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(sh + j, mk), mv)), _mm256_castsi256_ps(mk));
      _mm256_maskstore_ps(sh + j, mk, p);
      sum = _mm256_add_ps(sum, p);
    }
    s[G * n + hh] = hsum8(sum);
    if (ml) ml[2 * hh] = m;
  }
  constexpr int64_t VB = 32;  // keys per block of values: 32 rows of a kv head stay in L1 for the group
  for (int64_t j0 = 0; j0 < n; j0 += VB) {
    const int64_t j1 = std::min(n, j0 + VB);
    if constexpr (DV % 4 == 0) {  // values4: each value chunk loaded once for three heads, the same bits
      for (int64_t c0 = 0; c0 < DV; c0 += 4) {
        int64_t h0 = 0;
        for (; h0 + 3 <= G; h0 += 3) values4<3, KT>(s + h0 * n, n, vc, vs, slots, j0, j1, D, c0, out + h0 * D);
        if (G - h0 == 2) values4<2, KT>(s + h0 * n, n, vc, vs, slots, j0, j1, D, c0, out + h0 * D);
        else if (G - h0 == 1) values4<1, KT>(s + h0 * n, n, vc, vs, slots, j0, j1, D, c0, out + h0 * D);
      }
    } else for (int64_t hh = 0; hh < G; ++hh) {  // head by head, all D at once
      const float* sh = s + hh * n;
      float* oh = out + hh * D;
      __m256 acc[DV];
      for (int c = 0; c < DV; ++c) acc[c] = j0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(oh + 8 * c);
      for (j = j0; j < j1; ++j) {
        const KT* v0 = vc + slots[j] * vs;
        const __m256 p = _mm256_broadcast_ss(sh + j);
        for (int c = 0; c < DV; ++c) acc[c] = _mm256_fmadd_ps(p, kv8(v0 + 8 * c), acc[c]);
      }
      for (int c = 0; c < DV; ++c) _mm256_storeu_ps(oh + 8 * c, acc[c]);
    }
  }
  if (ml) {  // a segment of a long row: its values unnormalised, its largest score and its sum
    for (int64_t hh = 0; hh < G; ++hh) ml[2 * hh + 1] = s[G * n + hh];
    return;
  }
  for (int64_t hh = 0; hh < G; ++hh) {
    const __m256 total = _mm256_set1_ps(s[G * n + hh]);
    float* oh = out + hh * D;
    for (int c = 0; c < DV; ++c) _mm256_storeu_ps(oh + 8 * c, _mm256_div_ps(_mm256_loadu_ps(oh + 8 * c), total));
  }
}

template <class KT>
using GroupFnT = void (*)(const float*, int64_t, const KT*, int64_t, const KT*, int64_t, const int64_t*, int64_t,
                          float, float*, float*, float*);
using GroupFn = GroupFnT<float>;
using GroupFnH = GroupFnT<at::Half>;

template <int DV, class KT>
GroupFnT<KT> group_fn_for() { return &attend_group<DV, KT>; }

template <class KT>
GroupFnT<KT> group_fn_t(int64_t D) {  // every multiple of 8 up to 128, and 256
  switch (D) {
#define CASE(DV) case 8 * DV: return group_fn_for<DV, KT>();
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12) CASE(13)
    CASE(14) CASE(15) CASE(16) CASE(32)
#undef CASE
    default: return nullptr;
  }
}
GroupFn group_fn(int64_t D) { return group_fn_t<float>(D); }

// A row over more than SEG keys is attended in segments (ceil(n / SEG) runs of its keys, as equal
// as can be), each an item of its own, and the segments are then combined in order. Only the row's
// number of keys decides this, never the rows beside it or the threads, so a row gives the same
// bits in a decode step, a verify pass or a prompt (what the prefix cache reuses); a row over SEG
// keys or fewer is attended whole, as before segments existed. Why: a decode step has one item per
// kv head (3 for SmolLM2) on 2 threads, so one thread attended two heads' keys while the other
// idled after one, and past a few hundred keys attention is the step's largest part after the
// weights (one row after 1,000 keys, AMD EPYC, pool x2: 2.05 ms of a 4.9 ms layer stack).
constexpr int64_t SEG = 512;
// keys per segment of a row over n > SEG keys: ceil(n / SEG) segments as equal as can be (the last
// may be shorter), so a row just past SEG splits into two halves, not SEG keys and a few
inline int64_t seg_len(int64_t n) {
  const int64_t ns = (n + SEG - 1) / SEG;
  return (n + ns - 1) / ns;
}

// Combines a long row's segments for the G heads of one kv head: part holds, per segment, G * D
// unnormalised value sums and then G (largest score, sum of exponentials) pairs. The largest
// score over the segments is exact in any order; each segment's sums are scaled by
// exp(its largest - the largest) and added in segment order, then divided as attend_group divides.
__attribute__((target("avx2,fma"))) void combine_segments(const float* part, int64_t nseg, int64_t G, int64_t D,
                                                          float* out) {
  const int64_t stride = G * (D + 2);
  for (int64_t hh = 0; hh < G; ++hh) {
    float m = part[G * D + 2 * hh];
    for (int64_t sg = 1; sg < nseg; ++sg) {
      const float ms = part[sg * stride + G * D + 2 * hh];
      m = ms > m ? ms : m;
    }
    float total = 0.0f;
    float* oh = out + hh * D;
    for (int64_t sg = 0; sg < nseg; ++sg) {
      const float* ps = part + sg * stride;
      const float e = std::exp(ps[G * D + 2 * hh] - m);
      total += ps[G * D + 2 * hh + 1] * e;
      const __m256 ev = _mm256_set1_ps(e);
      for (int64_t c = 0; c < D; c += 8) {
        const __m256 v = _mm256_loadu_ps(ps + hh * D + c);
        _mm256_storeu_ps(oh + c, sg == 0 ? _mm256_mul_ps(v, ev) : _mm256_fmadd_ps(v, ev, _mm256_loadu_ps(oh + c)));
      }
    }
    const __m256 tv = _mm256_set1_ps(total);
    for (int64_t c = 0; c < D; c += 8) _mm256_storeu_ps(oh + c, _mm256_div_ps(_mm256_loadu_ps(oh + c), tv));
  }
}

// rows_attention's work on checked inputs: q [T, H, D] contiguous, out [T, H, D] zeroed; off the
// index (offsets, then slots); nmax the most keys of any row; the caches' rows at kp / vp + slot *
// ks / vs + kv head * hs (slot-major: ks = vs = KV * D, hs = D; head-major: ks = vs = D, hs =
// slots * D, so an item's keys are runs of whole 256-byte rows instead of a quarter of every
// 768-byte row, which the hardware fetched whole: see cache_layout). The layout never changes
// what an item computes.
template <class KT>
void rows_attention_run(const float* qp, int64_t T, int64_t H, int64_t D, int64_t KV, const KT* kp, int64_t ks,
                        const KT* vp, int64_t vs, const int64_t* off, int64_t nmax, float sc, GroupFnT<KT> fn,
                        float* op, int64_t hs) {
  if (T == 0 || nmax == 0) return;
  const int64_t* slots = off + T + 1;
  const int64_t G = H / KV;
  // items are (kv head, row, segment): the group's query heads share each key and value read;
  // how many items a thread takes is chosen from the work only (never what an item computes).
  // Items run kv head by kv head, so a thread's consecutive items read one head's keys and
  // values, which stay in L2; row by
  // row, three heads' (a 640-token prompt: ~1 MB) may not (30 layers of causal attention over
  // 640 rows, AMD EPYC, pool x2, alternating processes: 175-209 ms against 190-207, inside the
  // host's noise: the score loop was bound by its loads from L1 then, before scores4). The order
  // never changes what an item computes.
  // the segment table only where some row is long (a decode step over few keys builds nothing)
  const bool any_long = nmax > SEG;
  std::vector<int64_t> segs;  // per row and segment: row * 2^20 + segment, rows in order
  std::vector<int64_t> part_at(any_long ? T + 1 : 0, 0);  // a long row's first segment in the partial sums
  if (any_long) {
    segs.reserve(T);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = off[t + 1] - off[t], ns = n > SEG ? (n + seg_len(n) - 1) / seg_len(n) : 1;
      for (int64_t sg = 0; sg < ns; ++sg) segs.push_back((t << 20) | sg);
      part_at[t + 1] = part_at[t] + (n > SEG ? ns : 0);
    }
  }
  const int64_t per_head = any_long ? static_cast<int64_t>(segs.size()) : T, longs = any_long ? part_at[T] : 0;
  const int64_t stride = G * (D + 2);
  std::vector<float> part(KV * longs * stride);
  const int64_t items = KV * per_head;
  const int64_t work = std::max<int64_t>(1, off[T] * G * D / per_head);
  // On the kernels' pool every item may go to a thread of its own: inside the fused stack the
  // keys and values come from memory (the step's weights have just streamed through the caches),
  // so even a decode step's three items wait on loads far longer than a hand-off takes (one row,
  // 30 layers, AMD EPYC, pool x2, alternating in one process: 16 keys 0.165 -> 0.111 ms, 64 keys
  // 0.49 -> 0.32, 100 keys 0.80 -> 0.50; the same bits). Under OpenMP, whose regions cost a
  // wake-up, small calls stay on one thread.
  const int64_t grain = pool::enabled() ? 1 : std::max<int64_t>(1, (int64_t(1) << 16) / work);
  const int64_t smax = std::min(nmax, SEG);  // a whole row or a segment: SEG keys at most
  par_for(0, items, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> s(G * (smax + 1) + 8);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / per_head, rs = any_long ? segs[i % per_head] : (i % per_head) << 20;
      const int64_t t = rs >> 20, sg = rs & ((1 << 20) - 1);
      const int64_t n = off[t + 1] - off[t];
      if (n == 0) continue;
      const float* q = qp + (t * H + g * G) * D;
      if (n <= SEG) {
        fn(q, G, kp + g * hs, ks, vp + g * hs, vs, slots + off[t], n, sc, s.data(), op + (t * H + g * G) * D, nullptr);
      } else {
        float* ps = part.data() + ((g * longs) + part_at[t] + sg) * stride;
        const int64_t len = seg_len(n), j0 = sg * len;
        fn(q, G, kp + g * hs, ks, vp + g * hs, vs, slots + off[t] + j0, std::min(len, n - j0), sc, s.data(), ps,
           ps + G * D);
      }
    }
  });
  if (longs == 0) return;
  // the long rows' segments, combined per (kv head, row)
  const int64_t cwork = std::max<int64_t>(1, longs * G * D / T);
  par_for(0, KV * T, std::max<int64_t>(1, (int64_t(1) << 16) / cwork), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / T, t = i % T, ns = part_at[t + 1] - part_at[t];
      if (ns == 0) continue;
      combine_segments(part.data() + ((g * longs) + part_at[t]) * stride, ns, G, D, op + (t * H + g * G) * D);
    }
  });
}

// A cache tensor's layout: [slots, KV, D] float32 with unit stride along D, either slot-major (each
// slot's KV rows together: strides KV * D, D, 1) or head-major (each kv head's slots together:
// strides D, slots * D, 1; kv_cache.py's default). 1 / 2, or 0 for anything else. Why head-major:
// an attention item reads one kv head's rows of its slots; slot-major, that is 256 bytes of every
// 768, and the hardware fetched the whole span (a 2-thread read of 256 of every 768 bytes gave
// 7.6 GB/s of wanted bytes against 22.8 for a contiguous read, AMD EPYC Zen 4). The decode
// steps' attention, in one process alternating two engines: 8 sequences 4.90 -> 3.84 ms a
// forward (the step 16.3 -> 14.5 ms), one sequence after ~190 tokens 1.03 -> 0.79 ms; a
// 646-token prefill the same within the noise. The bits are the same either way.
int cache_layout(const at::Tensor& c) {
  const int64_t N = c.size(0), KV = c.size(1), D = c.size(2);
  if (c.stride(2) != 1) return 0;
  if (c.stride(1) == D && c.stride(0) == KV * D) return 1;
  if (c.stride(0) == D && c.stride(1) == N * D) return 2;
  return 0;
}

// the most keys of any row of a rows_attention index for T rows over a cache of N slots, after
// checking that it is well formed (offsets from 0, not decreasing, every slot inside the cache)
int64_t checked_index(const at::Tensor& index, int64_t T, int64_t N, const char* op) {
  TORCH_CHECK(index.dim() == 1 && index.numel() >= T + 1, op, ": index must be 1-d with at least T + 1 = ", T + 1,
              " entries, got ", index.sizes());
  const int64_t* off = index.data_ptr<int64_t>();
  const int64_t* slots = off + T + 1;
  TORCH_CHECK(off[0] == 0 && index.numel() == T + 1 + off[T], op, ": index holds ", index.numel(),
              " entries, its offsets say ", T + 1, " + ", off[T]);
  int64_t nmax = 0;
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(off[t + 1] >= off[t], op, ": offsets must not decrease (row ", t, ")");
    nmax = std::max(nmax, off[t + 1] - off[t]);
  }
  for (int64_t i = 0; i < off[T]; ++i)
    TORCH_CHECK(slots[i] >= 0 && slots[i] < N, op, ": slot ", slots[i], " outside the cache's ", N, " rows");
  return nmax;
}

// q [T, H, D] float32; k_cache, v_cache [slots, KV, D] float32 (last dim contiguous); index int64
// [T + 1 + total]: row t's keys are the slots index[T + 1 + index[t] .. T + 1 + index[t + 1]].
at::Tensor rows_attention(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const at::Tensor& index_in, double scale) {
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
              "rows_attention: this CPU lacks AVX2 + FMA");
  TORCH_CHECK(q_in.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "rows_attention: q must be [T, H, D] and the caches two equal [slots, KV, D], got ", q_in.sizes(), ", ",
              k_cache.sizes(), ", ", v_cache.sizes());
  const bool half = k_cache.scalar_type() == at::kHalf;
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && (half || k_cache.scalar_type() == at::kFloat) &&
              v_cache.scalar_type() == k_cache.scalar_type(),
              "rows_attention: q must be float32 and the caches two float32 or two float16");
  const int64_t T = q_in.size(0), H = q_in.size(1), D = q_in.size(2), KV = k_cache.size(1), N = k_cache.size(0);
  TORCH_CHECK(k_cache.size(2) == D && KV > 0 && H % KV == 0, "rows_attention: head_dim ", D, " vs cache ",
              k_cache.size(2), ", heads ", H, " must be a multiple of kv heads ", KV);
  const GroupFn fn = group_fn(D);
  TORCH_CHECK(fn != nullptr, "rows_attention: head_dim ", D, " is not a multiple of 8 up to 128, or 256");
  TORCH_CHECK(cache_layout(k_cache) != 0 && k_cache.strides() == v_cache.strides(),
              "rows_attention: the caches must be slot-major [slots, KV, D] contiguous or head-major (strides D, "
              "slots * D, 1), both alike; got strides ", k_cache.strides(), " / ", v_cache.strides());
  at::Tensor index = index_in.to(at::kLong).contiguous();
  const int64_t nmax = checked_index(index, T, N, "rows_attention");
  const int64_t* off = index.data_ptr<int64_t>();
  at::Tensor q = q_in.contiguous();
  at::Tensor out = at::zeros({T, H, D}, q.options());
  if (half)
    rows_attention_run(q.data_ptr<float>(), T, H, D, KV, k_cache.data_ptr<at::Half>(), k_cache.stride(0),
                       v_cache.data_ptr<at::Half>(), v_cache.stride(0), off, nmax, static_cast<float>(scale),
                       group_fn_t<at::Half>(D), out.data_ptr<float>(), k_cache.stride(1));
  else
    rows_attention_run(q.data_ptr<float>(), T, H, D, KV, k_cache.data_ptr<float>(), k_cache.stride(0),
                       v_cache.data_ptr<float>(), v_cache.stride(0), off, nmax, static_cast<float>(scale), fn,
                       out.data_ptr<float>(), k_cache.stride(1));
  return out;
}

// ---------------------------------------------------------------- the whole layer stack ------
// int4_stack: every decoder layer of a model with float32 hidden states whose four linears per
// layer (qkv, o, gate_up, down) are int4 on this file's kernel with bfloat16 inputs and whose
// attention is rows_attention, in one call. It computes what the Python layer stack computes
// (decoder.Decoder.layer_stack with those weights): per row, RMSNorm in float32 scaled by the
// weight, the input rounded to bfloat16, the int4 kernel, its bfloat16 output widened (plus the
// qkv bias), rope with the signed sine table, the new K/V written at the row's slot,
// rows_attention, the residual adds, SiLU(gate) * up rounded to bfloat16. No library offers
// this: torch.compile fuses the same glue into ~150 generated kernels a step (about 2 ms of a
// 5.3 ms graph on 2 cores: buffers, OpenMP regions, the wrapper) around these same kernels;
// here the glue of a layer is a few loops over the row's 576-1536 floats between the five
// parallel kernel calls. Row invariance: the glue is per row with a fixed instruction sequence
// (nothing reduces across rows; the thread split is by whole rows), the int4 kernel and
// rows_attention are row-invariant, so every row of a w-row call gets the bits it gets alone.
// The glue needs AVX2 + FMA (rows_attention does too).

__attribute__((target("avx2,fma"))) void bf16_from_f32(const float* x, uint16_t* y, int64_t n) {
  int64_t i = 0;
  const __m256i abs = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i half = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1), quiet = _mm256_set1_epi32(0x400000);
  for (; i + 8 <= n; i += 8) {  // f32_to_bf16 in every lane: round to nearest even, NaN stays NaN
    const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i));
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(half, _mm256_and_si256(_mm256_srli_epi32(u, 16), one)));
    r = _mm256_srli_epi32(_mm256_blendv_epi8(r, _mm256_or_si256(u, quiet), nan), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
  for (; i < n; ++i) y[i] = f32_to_bf16(x[i]);
}

__attribute__((target("avx2,fma"))) inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// eight of a linear's outputs as float32: bfloat16 ones widened (the int4 kernel's), float32 ones
// as they are (the int4 x int8 kernel's)
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) { return widen8(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

// w * (x * (1 / sqrt(mean(x^2) + eps))) of one row (n a multiple of 8), into f (float32 scratch)
__attribute__((target("avx2,fma"))) void norm_row(const float* x, const float* w, int64_t n, float eps, float* f) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    a = _mm256_fmadd_ps(v, v, a);
  }
  const float r = 1.0f / std::sqrt(hsum8(a) / static_cast<float>(n) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(f + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), rv)));
}

// x += the values d (a linear's output: bfloat16 or float32), n a multiple of 8
template <class O>
__attribute__((target("avx2,fma"))) void add_row(float* x, const O* d, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(x + i, _mm256_add_ps(_mm256_loadu_ps(x + i), load8(d + i)));
}

// SiLU(gate) * up of one row: gate_up holds the gate's F values and then the up's
template <class O>
__attribute__((target("avx2,fma"))) void silu_row(const O* gu, int64_t F, float* f) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for (int64_t i = 0; i < F; i += 8) {
    const __m256 g = load8(gu + i), u = load8(gu + F + i);
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
    _mm256_storeu_ps(f + i, _mm256_mul_ps(s, u));
  }
}

// n float32 values (a multiple of 8) into a float16 cache row, rounded to nearest even (F16C)
__attribute__((target("avx2,fma,f16c"))) inline void half_row(const float* src, at::Half* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// one row's qkv output (bfloat16 or float32, plus the bias when given) into q (float32 [H, D],
// roped), and its K (roped) and V into the caches' rows kr, vr ([KV, D] each; float32, or float16
// rounded from the same float32 values); cos, sn: the row's tables [D]
template <class O, class KT>
__attribute__((target("avx2,fma,f16c"))) void qkv_row(const O* qkv, const float* bias, int64_t H, int64_t KV,
                                                       int64_t D, const float* cos, const float* sn, float* q, KT* kr,
                                                       KT* vr, float* f, int64_t hs) {
  constexpr bool F32 = std::is_same_v<KT, float>;
  const int64_t n = (H + 2 * KV) * D, half = D / 2;
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = load8(qkv + i);
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i));
    _mm256_storeu_ps(f + i, v);
  }
  alignas(32) float tmp[256];  // a roped K row before a float16 cache takes it (D <= 256)
  for (int64_t h = 0; h < H + KV; ++h) {
    const float* xh = f + h * D;
    float* dst = h < H ? q + h * D : F32 ? reinterpret_cast<float*>(kr + (h - H) * hs) : tmp;
    for (int64_t d = 0; d < D; ++d) {  // x * cos + rotate_half(x) * signed sin, as two products and a sum
      const float a = xh[d] * cos[d], b = xh[d < half ? d + half : d - half] * sn[d];
      dst[d] = a + b;
    }
    if constexpr (!F32)
      if (h >= H) half_row(tmp, kr + (h - H) * hs, D);
  }
  for (int64_t g = 0; g < KV; ++g) {
    if constexpr (F32) std::memcpy(vr + g * hs, f + (H + KV + g) * D, D * sizeof(float));
    else half_row(f + (H + KV + g) * D, vr + g * hs, D);
  }
}

struct Int4Linear {
  const uint8_t* w;
  int64_t N, K, G, nblocks;
  bool f32s;
};

// out [T, N] bfloat16 = the int4 kernel over xb [T, K] bfloat16 (the path int4_mm takes for isa)
void int4_into(const Int4Linear& l, int64_t isa, const at::Tensor& xb, at::Tensor& out) {
  if (isa >= ISA_AVX512) {
    std::vector<float> sx = group_sums(xb, l.G);
    int4_avx512_any(xb, l.w, l.nblocks, l.N, l.G, sx.data(), l.f32s, isa, out);
  } else {
    at::Tensor xf = xb.to(at::kFloat).contiguous();
    if (l.f32s) int4_avx2<true>(xf, l.w, l.nblocks, l.N, l.G, out);
    else int4_avx2<false>(xf, l.w, l.nblocks, l.N, l.G, out);
  }
}

// out [T, N] float32 = the int4 x int8 kernel (int4_q8_mm's `path`) over x [T, K] float32, each
// row rounded to int8 blocks as int4_q8_mm rounds it
void q8_into(const Int4Linear& l, int64_t path, const float* x, int64_t T, at::Tensor& out) {
  const Q8Rows xr = q8_rows(x, T, l.K);
  if (l.f32s) int4_q8_run<false>(l.w, l.nblocks, l.N, l.K, l.G, T, xr, path, out);
  else int4_q8_run<true>(l.w, l.nblocks, l.N, l.K, l.G, T, xr, path, out);
}

// rows t0..t1 of fn(t) on torch's threads: whole rows per thread, so the split never changes a
// row's bits; up to 8 rows (a decode step, a verify window) stay on the calling thread
template <class Fn>
void each_row(int64_t T, const Fn& fn) {
  par_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(t);
  });
}

// numpy's argmax of one row of n floats: the first NaN's index if there is one, else the first
// maximum's (an all -inf row: 0). Vectorised: one pass for the maximum and whether a NaN is
// there, one for the first entry equal to it (-0.0 == 0.0: the first of either, as numpy's `>`
// scan keeps the first).
__attribute__((target("avx2,fma"))) int64_t argmax_row(const float* x, int64_t n) {
  const int64_t body = n - n % 8;
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    m = _mm256_max_ps(m, v);
  }
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (int64_t i = body; i < n && !any_nan; ++i) any_nan = std::isnan(x[i]);
  if (any_nan) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(x[i])) return i;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = lanes[0];
  for (int l = 1; l < 8; ++l) mx = lanes[l] > mx ? lanes[l] : mx;
  for (int64_t i = body; i < n; ++i) mx = x[i] > mx ? x[i] : mx;
  const __m256 mv = _mm256_set1_ps(mx);
  for (int64_t i = 0; i < body; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (int64_t i = body; i < n; ++i)
    if (x[i] == mx) return i;
  return 0;
}

// each row's argmax_row of x [rows, n] float32 (what the fused stack's end returns)
at::Tensor row_argmax(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat && x_in.size(1) > 0,
              "row_argmax: x must be float32 [rows, n > 0], got ", x_in.scalar_type(), " ", x_in.sizes());
  TORCH_CHECK(__builtin_cpu_supports("avx2"), "row_argmax: this CPU lacks AVX2");
  at::Tensor x = x_in.contiguous();
  const int64_t R = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({R}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  par_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

// Where the fused stack's time goes (diagnostics, off by default: stack_profile(1) turns it on):
// nanoseconds per phase summed over calls, read and reset by stack_profile.
constexpr int STACK_PHASES = 12;  // norm, qkv, rope+kv, attention, o, add, norm, gate_up, silu, down, add, prologue
std::atomic<bool> g_stack_prof{false};
std::atomic<int64_t> g_stack_ns[STACK_PHASES + 1];  // + calls
inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
constexpr int STACK_WEIGHTS = 7;  // per layer: attn_norm, qkv, qkv_bias (empty: none), o, mlp_norm, gate_up, down
constexpr int STACK_DIMS = 7;  // meta: hidden, heads, kv heads, head_dim, intermediate, isa, q8 path; then per
                               // layer and linear (qkv, o, gate_up, down): group size, f32 scales (0/1)
// q8 path 0: the linears are the int4 kernel at `isa` with bfloat16 inputs and outputs (the int4
// format); 1-4: int4_q8_mm's path with float32 inputs rounded to int8 blocks and float32
// outputs (the int4-a8 format: what decoder.Decoder.layer_stack computes with those weights,
// nothing rounded to bfloat16)

std::vector<at::Tensor> int4_stack(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                                   const at::Tensor& write_slots_in, at::TensorList k_caches, at::TensorList v_caches,
                                   const at::Tensor& index_in, at::TensorList weights, at::IntArrayRef meta,
                                   double scale, double eps, at::IntArrayRef aux_layers,
                                   const std::optional<at::Tensor>& final_norm, const std::optional<at::Tensor>& logit_rows,
                                   const std::optional<at::Tensor>& head, int64_t head_n, int64_t head_path) {
  const int64_t entry_ns = g_stack_prof.load(std::memory_order_relaxed) ? now_ns() : 0;
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"), "int4_stack: this CPU lacks AVX2 + FMA");
  TORCH_CHECK(meta.size() >= STACK_DIMS, "int4_stack: meta needs ", STACK_DIMS, " model sizes first");
  const int64_t Hd = meta[0], H = meta[1], KV = meta[2], D = meta[3], F = meta[4], isa = meta[5], q8 = meta[6];
  if (q8) {
    TORCH_CHECK(q8 >= Q8_AVX2 && q8 <= Q8_VNNI512_WIDE && ((q8_paths() >> q8) & 1), "int4_stack: q8 path ", q8,
                " is not one this CPU runs (bitmask ", q8_paths(), ")");
  } else {
    check_isa(isa);
  }
  const int64_t L = static_cast<int64_t>(k_caches.size());
  TORCH_CHECK(static_cast<int64_t>(v_caches.size()) == L && static_cast<int64_t>(weights.size()) == L * STACK_WEIGHTS &&
              static_cast<int64_t>(meta.size()) == STACK_DIMS + 8 * L,
              "int4_stack: ", L, " layers need as many v caches, ", L * STACK_WEIGHTS, " weights and ",
              STACK_DIMS + 8 * L, " meta entries; got ", v_caches.size(), ", ", weights.size(), ", ", meta.size());
  TORCH_CHECK(Hd % 8 == 0 && F % 8 == 0 && D % 8 == 0 && KV > 0 && H % KV == 0 && H * D % 8 == 0,
              "int4_stack: hidden ", Hd, ", intermediate ", F, " and head_dim ", D,
              " must be multiples of 8, heads ", H, " a multiple of kv heads ", KV);
  const GroupFn fn = group_fn(D);
  const GroupFnH fnh = group_fn_t<at::Half>(D);
  TORCH_CHECK(fn != nullptr, "int4_stack: head_dim ", D, " is not a multiple of 8 up to 128, or 256");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == Hd && x_in.scalar_type() == at::kFloat,
              "int4_stack: x must be float32 [T, ", Hd, "], got ", x_in.scalar_type(), " ", x_in.sizes());
  const int64_t T = x_in.size(0);
  at::Tensor cosv = cos_in.reshape({T, D}).to(at::kFloat).contiguous();
  at::Tensor sinv = sin_in.reshape({T, D}).to(at::kFloat).contiguous();
  at::Tensor ws = write_slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(ws.dim() == 1 && ws.numel() == T, "int4_stack: write_slots must be [", T, "], got ", ws.sizes());
  const int64_t qkvn = (H + 2 * KV) * D, qn = H * D;
  std::vector<Int4Linear> lin(4 * L);
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor& kc = k_caches[l];
    const at::Tensor& vc = v_caches[l];
    TORCH_CHECK(kc.dim() == 3 && kc.size(1) == KV && kc.size(2) == D && vc.sizes() == kc.sizes() &&
                (kc.scalar_type() == at::kFloat || kc.scalar_type() == at::kHalf) &&
                vc.scalar_type() == kc.scalar_type() && cache_layout(kc) != 0 &&
                kc.strides() == vc.strides() && kc.strides() == k_caches[0].strides(),
                "int4_stack: layer ", l, "'s caches must be two float32 or two float16 [slots, ", KV, ", ", D,
                "], slot-major or head-major (kv_cache.py), with layer 0's strides; got ", kc.sizes(), " / ",
                vc.sizes(), ", strides ", kc.strides(), " / ", vc.strides());
    const int64_t shapes[4][2] = {{qkvn, Hd}, {Hd, qn}, {2 * F, Hd}, {Hd, F}};
    const int64_t widx[4] = {1, 3, 5, 6};
    for (int j = 0; j < 4; ++j) {
      const at::Tensor& p = weights[l * STACK_WEIGHTS + widx[j]];
      const int64_t N = shapes[j][0], K = shapes[j][1], G = meta[STACK_DIMS + 8 * l + 2 * j];
      const bool f32s = meta[STACK_DIMS + 8 * l + 2 * j + 1] != 0;
      TORCH_CHECK(G > 0 && G % (q8 ? QB : 8) == 0 && K % G == 0, "int4_stack: layer ", l, " linear ", j,
                  ": group size ", G, " must divide ", K, " and be a multiple of ", (q8 ? QB : 8));
      const int64_t nblocks = (N + COLS - 1) / COLS, grp = G * 8 + COLS * 2 * (f32s ? 4 : 2);
      TORCH_CHECK(p.scalar_type() == at::kByte && p.is_contiguous() && p.dim() == 1 &&
                  p.numel() == nblocks * (K / G) * grp, "int4_stack: layer ", l, " linear ", j, " [", N, ", ", K,
                  "] needs ", nblocks * (K / G) * grp, " packed bytes, got ", p.numel());
      lin[4 * l + j] = Int4Linear{p.data_ptr<uint8_t>(), N, K, G, nblocks, f32s};
    }
    const at::Tensor& bias = weights[l * STACK_WEIGHTS + 2];
    TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == qkvn),
                "int4_stack: layer ", l, "'s qkv bias must be empty or float32 [", qkvn, "]");
    for (int j : {0, 4}) {
      const at::Tensor& nw = weights[l * STACK_WEIGHTS + j];
      TORCH_CHECK(nw.scalar_type() == at::kFloat && nw.is_contiguous() && nw.numel() == Hd, "int4_stack: layer ", l,
                  "'s norm weights must be float32 [", Hd, "]");
    }
  }
  const int64_t N = L ? k_caches[0].size(0) : 0;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ws.data_ptr<int64_t>()[t] >= 0 && ws.data_ptr<int64_t>()[t] < N, "int4_stack: write slot ",
                ws.data_ptr<int64_t>()[t], " outside the cache's ", N, " rows");
  at::Tensor index = index_in.to(at::kLong).contiguous();
  const int64_t nmax = checked_index(index, T, N, "int4_stack");
  for (int64_t a : aux_layers)
    TORCH_CHECK(a >= 0 && a < L, "int4_stack: aux layer ", a, " outside the stack's ", L, " layers");
  // the forward's end in the same call (optional): the final norm of the logit rows, and the
  // lm_head (int8_q8_mm) over them, so the step pays no separate ops after the weights have
  // passed through the caches
  const bool fin = final_norm.has_value();
  TORCH_CHECK(fin == logit_rows.has_value() && (fin || !head.has_value()),
              "int4_stack: final_norm and logit_rows come together, and head needs them");
  at::Tensor rows_idx;
  if (fin) {
    TORCH_CHECK(final_norm->scalar_type() == at::kFloat && final_norm->is_contiguous() && final_norm->numel() == Hd,
                "int4_stack: final_norm must be float32 [", Hd, "], got ", final_norm->scalar_type(), " ",
                final_norm->sizes());
    rows_idx = logit_rows->to(at::kLong).contiguous();
    TORCH_CHECK(rows_idx.dim() == 1, "int4_stack: logit_rows must be 1-d, got ", rows_idx.sizes());
    for (int64_t r = 0; r < rows_idx.numel(); ++r)
      TORCH_CHECK(rows_idx.data_ptr<int64_t>()[r] >= 0 && rows_idx.data_ptr<int64_t>()[r] < T, "int4_stack: logit row ",
                  rows_idx.data_ptr<int64_t>()[r], " outside the ", T, " rows");
    TORCH_CHECK(!head.has_value() || head_n > 0, "int4_stack: head_n must be > 0, got ", head_n);
  }

  at::Tensor x = x_in.contiguous().clone();
  std::vector<at::Tensor> outs{x};
  const auto bf = x.options().dtype(at::kBFloat16);
  const int64_t kmax = std::max(Hd, std::max(qn, F)), nout = std::max(qkvn, 2 * F);
  // a linear's input: bfloat16 (int4) or float32 (int4-a8) [T, K] at the front of hb / hf; its
  // output: bfloat16 or float32 [T, n] at the front of ob / of
  at::Tensor hb = at::empty({q8 ? 0 : T, kmax}, bf), ob = at::empty({q8 ? 0 : T, nout}, bf);
  at::Tensor hf = at::empty({q8 ? T : 0, kmax}, x.options()), of = at::empty({q8 ? T : 0, nout}, x.options());
  at::Tensor q = at::empty({T, H, D}, x.options());
  at::Tensor att = at::empty({T, H, D}, x.options());
  at::Tensor scratch = at::empty({T, std::max(qkvn, std::max(F, Hd))}, x.options());
  float* xp = x.data_ptr<float>();
  uint16_t* hp = reinterpret_cast<uint16_t*>(hb.data_ptr<at::BFloat16>());
  float* hfp = hf.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* ap = att.data_ptr<float>();
  float* fp = scratch.data_ptr<float>();
  const int64_t fs = scratch.size(1);
  const float* cp = cosv.data_ptr<float>();
  const float* sp = sinv.data_ptr<float>();
  const int64_t* slot = ws.data_ptr<int64_t>();
  const float e = static_cast<float>(eps), sc = static_cast<float>(scale);
  // linear j of layer l over the rows' K inputs in the input buffer (`from`: float32 inputs
  // elsewhere, int4-a8 only) into n outputs at the front of the output buffer
  auto run_linear = [&](int64_t idx, int64_t K, int64_t n, const float* from) {
    if (q8) {
      at::Tensor o = at::from_blob(of.data_ptr(), {T, n}, x.options());
      q8_into(lin[idx], q8, from ? from : hfp, T, o);
    } else {
      at::Tensor o = at::from_blob(ob.data_ptr(), {T, n}, bf);
      int4_into(lin[idx], isa, at::from_blob(hb.data_ptr(), {T, K}, bf), o);
    }
  };
  // the layers with the outputs' element type O (uint16_t: bfloat16; float)
  auto layers = [&](const auto* op) {
    using O = std::remove_const_t<std::remove_pointer_t<decltype(op)>>;
    constexpr bool F32 = std::is_same_v<O, float>;
    // where row t's n float32 inputs of the next linear are computed: in hf itself (int4-a8
    // rounds them to int8 inside its kernel), or in the scratch row, then rounded to bfloat16
    // into hb by stage
    auto in_row = [&](int64_t t, int64_t n) -> float* {
      if constexpr (F32) return hfp + t * n;
      else return fp + t * fs;
    };
    auto stage = [&](int64_t t, int64_t n) {
      if constexpr (!F32) bf16_from_f32(fp + t * fs, hp + t * n, n);
    };
    const bool prof = g_stack_prof.load(std::memory_order_relaxed);
    int64_t tick = prof ? now_ns() : 0;
    auto mark = [&](int k) {
      if (!prof) return;
      const int64_t t1 = now_ns();
      g_stack_ns[k].fetch_add(t1 - tick, std::memory_order_relaxed);
      tick = t1;
    };
    if (prof) g_stack_ns[STACK_PHASES].fetch_add(1, std::memory_order_relaxed);
    if (prof) g_stack_ns[STACK_PHASES - 1].fetch_add(tick - entry_ns, std::memory_order_relaxed);  // the set-up
    for (int64_t l = 0; l < L; ++l) {
      if (std::find(aux_layers.begin(), aux_layers.end(), l) != aux_layers.end()) outs.push_back(x.clone());
      const at::Tensor* w = &weights[l * STACK_WEIGHTS];
      const float* bias = w[2].numel() ? w[2].data_ptr<float>() : nullptr;
      const bool half = k_caches[l].scalar_type() == at::kHalf;  // a float16 cache (kv_cache.py's kv_dtype)
      float* kc = half ? nullptr : k_caches[l].data_ptr<float>();
      float* vc = half ? nullptr : v_caches[l].data_ptr<float>();
      at::Half* kh = half ? k_caches[l].data_ptr<at::Half>() : nullptr;
      at::Half* vh = half ? v_caches[l].data_ptr<at::Half>() : nullptr;
      const int64_t cs = k_caches[l].stride(0), hs = k_caches[l].stride(1);  // slot and head strides
      // attention half
      each_row(T, [&](int64_t t) {
        norm_row(xp + t * Hd, w[0].data_ptr<float>(), Hd, e, in_row(t, Hd));
        stage(t, Hd);
      });
      mark(0);
      run_linear(4 * l, Hd, qkvn, nullptr);
      mark(1);
      each_row(T, [&](int64_t t) {
        if (half)
          qkv_row<O, at::Half>(op + t * qkvn, bias, H, KV, D, cp + t * D, sp + t * D, qp + t * qn, kh + slot[t] * cs,
                               vh + slot[t] * cs, fp + t * fs, hs);
        else
          qkv_row<O, float>(op + t * qkvn, bias, H, KV, D, cp + t * D, sp + t * D, qp + t * qn, kc + slot[t] * cs,
                            vc + slot[t] * cs, fp + t * fs, hs);
      });
      mark(2);
      att.zero_();
      if (half) rows_attention_run(qp, T, H, D, KV, kh, cs, vh, cs, index.data_ptr<int64_t>(), nmax, sc, fnh, ap, hs);
      else rows_attention_run(qp, T, H, D, KV, kc, cs, vc, cs, index.data_ptr<int64_t>(), nmax, sc, fn, ap, hs);
      if constexpr (!F32) each_row(T, [&](int64_t t) { bf16_from_f32(ap + t * qn, hp + t * qn, qn); });
      mark(3);
      run_linear(4 * l + 1, qn, Hd, F32 ? ap : nullptr);  // int4-a8: the attention rows are its input
      mark(4);
      each_row(T, [&](int64_t t) { add_row<O>(xp + t * Hd, op + t * Hd, Hd); });
      mark(5);
      // MLP half
      each_row(T, [&](int64_t t) {
        norm_row(xp + t * Hd, w[4].data_ptr<float>(), Hd, e, in_row(t, Hd));
        stage(t, Hd);
      });
      mark(6);
      run_linear(4 * l + 2, Hd, 2 * F, nullptr);
      mark(7);
      each_row(T, [&](int64_t t) {
        silu_row<O>(op + t * 2 * F, F, in_row(t, F));
        stage(t, F);
      });
      mark(8);
      run_linear(4 * l + 3, F, Hd, nullptr);
      mark(9);
      each_row(T, [&](int64_t t) { add_row<O>(xp + t * Hd, op + t * Hd, Hd); });
      mark(10);
    }
  };
  if (q8) layers(static_cast<const float*>(of.data_ptr<float>()));
  else layers(reinterpret_cast<const uint16_t*>(ob.data_ptr<at::BFloat16>()));
  if (fin) {  // outs[0]: the logit rows after the final norm (norm_row: the stack's own norm)
    const int64_t R = rows_idx.numel();
    at::Tensor hidden = at::empty({R, Hd}, x.options());
    const int64_t* ri = rows_idx.data_ptr<int64_t>();
    float* hp2 = hidden.data_ptr<float>();
    const float* nw = final_norm->data_ptr<float>();
    each_row(R, [&](int64_t r) { norm_row(xp + ri[r] * Hd, nw, Hd, e, hp2 + r * Hd); });
    outs[0] = hidden;
    if (head.has_value()) {
      at::Tensor logits = int8_q8_mm(hidden, *head, head_n, head_path);
      outs.push_back(logits);
      // each row's argmax while its logits are still in the caches: the first maximum, or the
      // first NaN (numpy's argmax, which params.argmax_rows takes otherwise)
      outs.push_back(row_argmax(logits));
    }
  }
  return outs;
}

// The fused stack's inputs in one call (the forward's start, where each separate op ran with
// the last step's weights just through the caches): the embedding rows of `ids` (int8 rows times
// their float32 scales, as qlinear.dequantize_int8 computes them, or float32 rows as they are),
// the rope tables' rows at `positions` as [T, 1, D], and rows_attention's index (attention.py
// rows_index: the rows' offsets, then each row's visible read slots in order; every slot for
// every row when there is no mask).
std::vector<at::Tensor> stack_prelude(const at::Tensor& ids_in, const at::Tensor& embed,
                                      const std::optional<at::Tensor>& embed_scales, const at::Tensor& positions_in,
                                      const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& read_slots_in,
                                      const std::optional<at::Tensor>& mask_in) {
  at::Tensor ids = ids_in.to(at::kLong).contiguous(), pos = positions_in.to(at::kLong).contiguous();
  at::Tensor rs = read_slots_in.to(at::kLong).contiguous();
  TORCH_CHECK(ids.dim() == 1 && pos.dim() == 1 && pos.numel() == ids.numel() && rs.dim() == 1,
              "stack_prelude: ids and positions must be 1-d of one length, read_slots 1-d; got ", ids.sizes(), ", ",
              pos.sizes(), ", ", rs.sizes());
  TORCH_CHECK(embed.dim() == 2 && embed.is_contiguous(), "stack_prelude: embed must be a contiguous [vocab, hidden]");
  const bool q = embed_scales.has_value();
  TORCH_CHECK(q ? (embed.scalar_type() == at::kChar && embed_scales->scalar_type() == at::kFloat &&
                   embed_scales->is_contiguous() && embed_scales->numel() == embed.size(0))
                : embed.scalar_type() == at::kFloat,
              "stack_prelude: embed must be int8 with float32 scales [vocab], or float32 without");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
              "stack_prelude: cos and sin must be contiguous float32 [positions, head_dim] of one shape");
  const int64_t T = ids.numel(), V = embed.size(0), K = embed.size(1), P = cos.size(0), D = cos.size(1);
  const int64_t S = rs.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(id[t] >= 0 && id[t] < V, "stack_prelude: token id ", id[t], " outside the vocabulary's ", V);
    TORCH_CHECK(ps[t] >= 0 && ps[t] < P, "stack_prelude: position ", ps[t], " outside the rope tables' ", P);
  }
  at::Tensor x = at::empty({T, K}, cos.options());
  float* xp = x.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    if (q) {
      const int8_t* row = embed.data_ptr<int8_t>() + id[t] * K;
      const float sc = embed_scales->data_ptr<float>()[id[t]];
      for (int64_t k = 0; k < K; ++k) xp[t * K + k] = static_cast<float>(row[k]) * sc;
    } else {
      std::memcpy(xp + t * K, embed.data_ptr<float>() + id[t] * K, K * sizeof(float));
    }
  }
  at::Tensor cu = at::empty({T, 1, D}, cos.options()), su = at::empty({T, 1, D}, cos.options());
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(cu.data_ptr<float>() + t * D, cos.data_ptr<float>() + ps[t] * D, D * sizeof(float));
    std::memcpy(su.data_ptr<float>() + t * D, sin.data_ptr<float>() + ps[t] * D, D * sizeof(float));
  }
  const int64_t* slots = rs.data_ptr<int64_t>();
  at::Tensor index;
  if (!mask_in.has_value()) {
    index = at::empty({T + 1 + T * S}, ids.options());
    int64_t* o = index.data_ptr<int64_t>();
    for (int64_t t = 0; t <= T; ++t) o[t] = t * S;
    for (int64_t t = 0; t < T; ++t) std::memcpy(o + T + 1 + t * S, slots, S * sizeof(int64_t));
  } else {
    at::Tensor m = mask_in->contiguous();
    TORCH_CHECK(m.scalar_type() == at::kBool && m.dim() == 2 && m.size(0) == T && m.size(1) == S,
                "stack_prelude: mask must be bool [", T, ", ", S, "], got ", m.scalar_type(), " ", m.sizes());
    const bool* mp = m.data_ptr<bool>();
    int64_t total = 0;
    for (int64_t i = 0; i < T * S; ++i) total += mp[i];
    index = at::empty({T + 1 + total}, ids.options());
    int64_t* o = index.data_ptr<int64_t>();
    int64_t at_ = T + 1;
    o[0] = 0;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < S; ++j)
        if (mp[t * S + j]) o[at_++] = slots[j];
      o[t + 1] = at_ - (T + 1);
    }
  }
  return {x, cu, su, index};
}

// stack_profile(on): the phases' nanoseconds so far (and calls, last), reset; then on (1) or off (0)
std::vector<int64_t> stack_profile(int64_t on) {
  std::vector<int64_t> out(STACK_PHASES + 1);
  for (int k = 0; k <= STACK_PHASES; ++k) out[k] = g_stack_ns[k].exchange(0);
  g_stack_prof.store(on != 0);
  return out;
}

int64_t isa_level() { return detect_isa(); }

// ---------------------------------------------------------------- dot-product rates ----------
// Multiply-adds per nanosecond of one core through vdpbf16ps zmm (32 per instruction) and
// vfmadd231ps zmm (16), eight independent chains each, best of `reps` short runs: a property of
// the core's execution ports, not of the memory system or the load, so the choice between the
// int4 paths with different bits (levels 2/3 against 4) comes out the same in every process on
// a machine. (Measured on 2-core Intel Xeons with the same name and flags: 30-39 against 63-80
// per ns on 2026-12-03; on 2026-12-02 vdpbf16ps ran at the vfmadd instruction rate, i.e. twice
// the multiply-adds. Hence a measurement and not a table of CPU models.)
//
// ns for one run of `step`
template <class Step>
double run_ns(Step step) {
  const auto t0 = std::chrono::steady_clock::now();
  step();
  return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
}
constexpr int64_t RATE_ITERS = 20000;

__attribute__((target("avx512f,avx512bw,avx512bf16,avx512vl"), noinline)) float dp_loop(int64_t iters) {
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0);
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  for (int64_t i = 0; i < iters; ++i) {
    c0 = _mm512_dpbf16_ps(c0, a, b); c1 = _mm512_dpbf16_ps(c1, a, b);
    c2 = _mm512_dpbf16_ps(c2, a, b); c3 = _mm512_dpbf16_ps(c3, a, b);
    c4 = _mm512_dpbf16_ps(c4, a, b); c5 = _mm512_dpbf16_ps(c5, a, b);
    c6 = _mm512_dpbf16_ps(c6, a, b); c7 = _mm512_dpbf16_ps(c7, a, b);
    asm volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                                            _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7))));
}

__attribute__((target("avx512f,fma"), noinline)) float fma_loop(int64_t iters) {
  const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_setzero_ps();
  __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
  for (int64_t i = 0; i < iters; ++i) {
    c0 = _mm512_fmadd_ps(c0, a, b); c1 = _mm512_fmadd_ps(c1, a, b);
    c2 = _mm512_fmadd_ps(c2, a, b); c3 = _mm512_fmadd_ps(c3, a, b);
    c4 = _mm512_fmadd_ps(c4, a, b); c5 = _mm512_fmadd_ps(c5, a, b);
    c6 = _mm512_fmadd_ps(c6, a, b); c7 = _mm512_fmadd_ps(c7, a, b);
    asm volatile("" : "+v"(c0), "+v"(c1), "+v"(c2), "+v"(c3), "+v"(c4), "+v"(c5), "+v"(c6), "+v"(c7));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                                            _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7))));
}

// [vdpbf16ps rate, vfmadd rate] in multiply-adds per ns (0 where the CPU lacks the instruction):
// one warm-up run each (the upper halves of the vector units wake up), then `reps` runs of each
// interleaved, the best of each
std::vector<double> dot_rates(int64_t reps) {
  TORCH_CHECK(reps >= 1 && reps <= 1000, "dot_rates: reps must be 1..1000, got ", reps);
  volatile float sink = 0.0f;
  const bool dp_ok = detect_isa() >= ISA_AVX512, fm_ok = has_avx512_fma();
  double dp = 0.0, fm = 0.0;
  for (int64_t r = 0; r <= reps; ++r) {
    if (dp_ok) {
      const double ns = run_ns([&] { sink = sink + dp_loop(RATE_ITERS); });
      if (r) dp = std::max(dp, RATE_ITERS * 8 * 32.0 / std::max(ns, 1.0));
    }
    if (fm_ok) {
      const double ns = run_ns([&] { sink = sink + fma_loop(RATE_ITERS); });
      if (r) fm = std::max(fm, RATE_ITERS * 8 * 16.0 / std::max(ns, 1.0));
    }
  }
  return {dp, fm};
}
bool has_isa4() { return has_avx512_fma(); }

// ---------------------------------------------------------------- the pool's controls --------
// mode: 0 OpenMP, 1 the pool always, 2 auto, -1 unchanged; spin_us: a helper's spin before it
// sleeps (-1 unchanged)
void pool_config(int64_t mode, int64_t spin_us) {
  TORCH_CHECK(mode >= -1 && mode <= 2, "pool_config: mode must be -1..2, got ", mode);
  TORCH_CHECK(spin_us >= -1 && spin_us <= 100000, "pool_config: spin_us must be -1..100000, got ", spin_us);
  if (mode >= 0) pool::g_mode.store(int(mode));
  if (spin_us >= 0) pool::g_spin_us.store(spin_us);
}

void pool_contended(bool on) { pool::g_contended.store(on); }

void pool_threads(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= 1024, "pool_threads: n must be 0..1024 (0: torch's thread count), got ", n);
  pool::g_threads.store(int(n));
}

// [mode, contended, on the pool now, helpers started, jobs, chunks run by helpers, by callers,
//  spin_us, waits for a helper's chunk, their total ns, those over 1 ms]
std::vector<int64_t> pool_stats() {
  pool::Pool* p = pool::g_pool.load();
  return {pool::g_mode.load(), pool::g_contended.load(), pool::enabled(), p ? p->helpers : 0,
          p ? p->jobs.load() : 0, p ? p->helper_chunks.load() : 0, p ? p->caller_chunks.load() : 0,
          pool::g_spin_us.load(), p ? p->waits.load() : 0, p ? p->wait_ns.load() : 0,
          p ? p->long_waits.load() : 0};
}

// The pool's contract, for tests: `reps` jobs over `items` items (grain `grain`) on the pool
// whatever its mode, each item adding 1 to its own counter. Every counter must be 1 when its job
// returns, and still 1 after all jobs (a chunk run after its job returned would make it 2).
// Returns [counters wrong when their job returned, counters wrong at the end, chunks helpers ran].
std::vector<int64_t> pool_check(int64_t items, int64_t grain, int64_t reps) {
  TORCH_CHECK(items >= 1 && items <= (int64_t(1) << 20), "pool_check: items must be 1..2^20, got ", items);
  TORCH_CHECK(grain >= 1 && reps >= 1 && reps <= 100000, "pool_check: grain >= 1 and reps 1..100000");
  TORCH_CHECK(items * reps <= (int64_t(1) << 26), "pool_check: items * reps must be at most 2^26 (the counters ",
              "of every job are kept to the end), got ", items, " * ", reps);
  std::vector<std::vector<std::atomic<int>>> counts;
  counts.reserve(reps);
  int64_t early = 0, late = 0;
  pool::Pool* p = pool::get();
  const int64_t before = p->helper_chunks.load();
  for (int64_t r = 0; r < reps; ++r) {
    counts.emplace_back(items);
    auto& c = counts.back();
    for (auto& v : c) v.store(0);
    pool::run(0, items, grain, [&c](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) c[i].fetch_add(1);
    }, true);
    for (auto& v : c) early += v.load() != 1;
  }
  for (auto& c : counts)
    for (auto& v : c) late += v.load() != 1;
  return {early, late, p->helper_chunks.load() - before};
}

}  // namespace

// ---------------------------------------------------------------- an EAGLE head's level ------
// eagle_level: one drafting level of an EAGLE-3 head (speculation/eagle_head.py, layer_rows), its
// ~30 eager torch ops in one call: each of them ran cold after the target's forward had passed
// ~95 MB through the caches. Per row: RMSNorm of the token's embedding and of the hidden input,
// side by side; q|k|v (int8 x int8 input blocks); rope on q and k (x * cos + rotate_half(x) *
// signed sin, as qkv_row); the K/V rows written into the head's buffers at rows at..at+T-1;
// attention through rows_attention over `index` (the rows' slots); o, the residual (the hidden
// input), RMSNorm, gate|up, SiLU(gate) * up, down, the residual; then for the last `last` rows
// the final RMSNorm and the output layer over the draft vocabulary. Drafts only: the target's
// output never depends on these numbers. norms: input_layernorm, hidden_norm,
// post_attention_layernorm, norm (float32 [H]); packed: qkv, o, gate_up, down, lm_head
// (repack_int8_q8); dims: H, heads, kv heads, head_dim, intermediate, draft vocabulary. With fc
// (its pack) hid is the target's features [T, 3H] and fc's product the hidden input; an empty
// index means causal rows after the `at` cached ones.
std::vector<at::Tensor> eagle_level(const at::Tensor& emb, const at::Tensor& hid_in, const at::Tensor& cos_in,
                                    const at::Tensor& sin_in, at::Tensor kb, at::Tensor vb, int64_t at,
                                    const at::Tensor& index_in, at::TensorList norms, at::TensorList packed,
                                    at::IntArrayRef dims, double eps, double scale, int64_t path_in, int64_t last,
                                    const c10::optional<at::Tensor>& fc) {
  const int64_t path = int8_q8_path(path_in);
  TORCH_CHECK(path != 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
              __builtin_cpu_supports("f16c"), "eagle_level: this CPU lacks AVX2 + FMA + F16C");
  TORCH_CHECK(dims.size() == 6 && norms.size() == 4 && packed.size() == 5,
              "eagle_level: dims must be [H, heads, kv heads, head_dim, intermediate, vocab], norms 4 and packed 5");
  const int64_t H = dims[0], HQ = dims[1], HK = dims[2], D = dims[3], I = dims[4], NV = dims[5];
  TORCH_CHECK(H % QB == 0 && I % QB == 0 && D % 8 == 0 && HK > 0 && HQ % HK == 0 && (HQ * D) % QB == 0,
              "eagle_level: hidden ", H, ", intermediate ", I, " and heads * head_dim ", HQ * D,
              " must be multiples of ", QB, ", head_dim of 8");
  const GroupFn fn = group_fn(D);
  TORCH_CHECK(fn != nullptr, "eagle_level: head_dim ", D, " is not a multiple of 8 up to 128, or 256");
  const int64_t T = emb.size(0);
  // with fc: hid_in holds the target's features [T, 3H] and the hidden input is fc's product
  at::Tensor hid = hid_in;
  if (fc.has_value()) {
    TORCH_CHECK(hid_in.dim() == 2 && hid_in.size(0) == T && hid_in.size(1) == 3 * H &&
                hid_in.scalar_type() == at::kFloat && fc->scalar_type() == at::kByte && fc->is_contiguous() &&
                fc->numel() == (H + COLS - 1) / COLS * (3 * H * COLS + COLS * 4),
                "eagle_level: with fc, hid must be the features float32 [T, ", 3 * H, "] and fc repack_int8_q8's [",
                H, ", ", 3 * H, "]");
    at::Tensor feats = hid_in.contiguous();
    hid = at::empty({T, H}, feats.options());
    int8_q8_into(fc->data_ptr<uint8_t>(), H, 3 * H, path, q8_rows(feats.data_ptr<float>(), T, 3 * H),
                 T, OutPtr(hid));
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&emb, &hid})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == T && t->size(1) == H && t->scalar_type() == at::kFloat,
                "eagle_level: emb and hid must be float32 [T, ", H, "]");
  TORCH_CHECK(cos_in.numel() == T * D && sin_in.numel() == T * D, "eagle_level: cos and sin must be [T, ", D, "]");
  TORCH_CHECK(kb.dim() == 3 && kb.size(1) == HK && kb.size(2) == D && kb.is_contiguous() && vb.sizes() == kb.sizes() &&
              vb.is_contiguous() && kb.scalar_type() == at::kFloat && vb.scalar_type() == at::kFloat,
              "eagle_level: the K/V buffers must be two contiguous float32 [rows, ", HK, ", ", D, "]");
  TORCH_CHECK(at >= 0 && at + T <= kb.size(0), "eagle_level: rows ", at, "..", at + T, " outside the buffers' ",
              kb.size(0));
  TORCH_CHECK(last >= 1 && last <= T, "eagle_level: last ", last, " must be 1..", T);
  const int64_t shapes[5][2] = {{(HQ + 2 * HK) * D, 2 * H}, {H, HQ * D}, {2 * I, H}, {H, I}, {NV, H}};
  for (int j = 0; j < 5; ++j) {
    const int64_t N = shapes[j][0], K = shapes[j][1], nblocks = (N + COLS - 1) / COLS;
    TORCH_CHECK(packed[j].scalar_type() == at::kByte && packed[j].is_contiguous() &&
                packed[j].numel() == nblocks * (K * COLS + COLS * 4),
                "eagle_level: packed weight ", j, " must be repack_int8_q8's [", N, ", ", K, "]");
  }
  for (int j = 0; j < 4; ++j)
    TORCH_CHECK(norms[j].scalar_type() == at::kFloat && norms[j].is_contiguous() && norms[j].numel() == H,
                "eagle_level: norm weight ", j, " must be float32 [", H, "]");
  // an empty index: causal rows after `at` cached ones (row t sees slots 0 .. at + t)
  at::Tensor index = index_in.numel() ? index_in.to(at::kLong).contiguous()
                                      : at::empty({T + 1 + T * (at + 1) + T * (T - 1) / 2}, at::TensorOptions().dtype(at::kLong));
  if (!index_in.numel()) {
    int64_t* ix = index.data_ptr<int64_t>();
    int64_t* sl = ix + T + 1;
    ix[0] = 0;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j <= at + t; ++j) *sl++ = j;
      ix[t + 1] = ix[t] + at + t + 1;
    }
  }
  const int64_t nmax = checked_index(index, T, kb.size(0), "eagle_level");
  at::Tensor e = emb.contiguous(), h = hid.contiguous();
  at::Tensor cosv = cos_in.reshape({T, D}).to(at::kFloat).contiguous(), sinv = sin_in.reshape({T, D}).to(at::kFloat).contiguous();
  const auto f = at::TensorOptions().dtype(at::kFloat);
  const float ep = static_cast<float>(eps);
  auto lin = [&](int j, const at::Tensor& x, int64_t rows) {  // x [rows, K] float32 -> [rows, N]
    const int64_t N = shapes[j][0], K = shapes[j][1];
    at::Tensor out = at::empty({rows, N}, f);
    int8_q8_into(packed[j].data_ptr<uint8_t>(), N, K, path, q8_rows(x.data_ptr<float>(), rows, K), rows, OutPtr(out));
    return out;
  };
  const float* n0 = norms[0].data_ptr<float>();
  const float* n1 = norms[1].data_ptr<float>();
  at::Tensor xcat = at::empty({T, 2 * H}, f);
  for (int64_t t = 0; t < T; ++t) {
    norm_row(e.data_ptr<float>() + t * H, n0, H, ep, xcat.data_ptr<float>() + t * 2 * H);
    norm_row(h.data_ptr<float>() + t * H, n1, H, ep, xcat.data_ptr<float>() + t * 2 * H + H);
  }
  at::Tensor qkv = lin(0, xcat, T);
  at::Tensor q = at::empty({T, HQ, D}, f), scratch = at::empty({(HQ + 2 * HK) * D}, f);
  const int64_t cs = kb.stride(0), hs = kb.stride(1);
  float* kp = kb.data_ptr<float>();
  float* vp = vb.data_ptr<float>();
  const int64_t qkvn = (HQ + 2 * HK) * D;
  for (int64_t t = 0; t < T; ++t)
    qkv_row<float, float>(qkv.data_ptr<float>() + t * qkvn, nullptr, HQ, HK, D, cosv.data_ptr<float>() + t * D,
                          sinv.data_ptr<float>() + t * D, q.data_ptr<float>() + t * HQ * D, kp + (at + t) * cs,
                          vp + (at + t) * cs, scratch.data_ptr<float>(), hs);
  at::Tensor att = at::zeros({T, HQ, D}, f);
  rows_attention_run(q.data_ptr<float>(), T, HQ, D, HK, static_cast<const float*>(kp), cs,
                     static_cast<const float*>(vp), cs, index.data_ptr<int64_t>(), nmax, static_cast<float>(scale), fn,
                     att.data_ptr<float>(), hs);
  at::Tensor out = h.clone();  // the residual stream: the hidden input, then + o, + the MLP
  at::Tensor o = lin(1, att, T);
  for (int64_t t = 0; t < T; ++t) add_row<float>(out.data_ptr<float>() + t * H, o.data_ptr<float>() + t * H, H);
  at::Tensor hn = at::empty({T, H}, f);
  for (int64_t t = 0; t < T; ++t)
    norm_row(out.data_ptr<float>() + t * H, norms[2].data_ptr<float>(), H, ep, hn.data_ptr<float>() + t * H);
  at::Tensor gu = lin(2, hn, T);
  at::Tensor m = at::empty({T, I}, f);
  for (int64_t t = 0; t < T; ++t) silu_row<float>(gu.data_ptr<float>() + t * 2 * I, I, m.data_ptr<float>() + t * I);
  at::Tensor dn = lin(3, m, T);
  for (int64_t t = 0; t < T; ++t) add_row<float>(out.data_ptr<float>() + t * H, dn.data_ptr<float>() + t * H, H);
  at::Tensor fin = at::empty({last, H}, f);
  for (int64_t t = 0; t < last; ++t)
    norm_row(out.data_ptr<float>() + (T - last + t) * H, norms[3].data_ptr<float>(), H, ep, fin.data_ptr<float>() + t * H);
  return {out, lin(4, fin, last)};
}

TORCH_LIBRARY(specbuild_cpu, m) {
  m.def("int4_mm(Tensor x, Tensor packed, int n, int group_size, bool f32_scales, int isa) -> Tensor");
  m.def("int8_mm(Tensor x, Tensor packed, int n, int isa) -> Tensor");
  m.def("isa_level() -> int");
  m.def("has_isa4() -> bool");
  m.def("dot_rates(int reps) -> float[]");
  m.def("int4_q8_mm(Tensor x, Tensor packed, int n, int group_size, bool f16_scales, int path) -> Tensor");
  m.def("q8_quantize(Tensor x) -> (Tensor, Tensor, Tensor)");
  m.def("q8_paths() -> int");
  m.def("int8_q8_mm(Tensor x, Tensor packed, int n, int path=0) -> Tensor");
  m.def("int8_q8_available() -> bool");
  m.def("pool_config(int mode, int spin_us) -> ()");
  m.def("pool_contended(bool on) -> ()");
  m.def("pool_threads(int n) -> ()");
  m.def("pool_stats() -> int[]");
  m.def("stack_profile(int on) -> int[]");
  m.def("row_argmax(Tensor x) -> Tensor");
  m.def("stack_prelude(Tensor ids, Tensor embed, Tensor? embed_scales, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor read_slots, Tensor? mask) -> Tensor[]");
  m.def("pool_check(int items, int grain, int reps) -> int[]");
  m.def("rows_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor index, float scale) -> Tensor");
  m.def("eagle_level(Tensor emb, Tensor hid, Tensor cos, Tensor sin, Tensor(a!) kb, Tensor(b!) vb, int at, "
        "Tensor index, Tensor[] norms, Tensor[] packed, int[] dims, float eps, float scale, int path, int last, "
        "Tensor? fc=None) -> Tensor[]");
  m.def("int4_stack(Tensor x, Tensor cos, Tensor sin, Tensor write_slots, Tensor(a!)[] k_caches, "
        "Tensor(b!)[] v_caches, Tensor index, Tensor[] weights, int[] meta, float scale, float eps, "
        "int[] aux_layers, Tensor? final_norm=None, Tensor? logit_rows=None, Tensor? head=None, int head_n=0, "
        "int head_path=0) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(specbuild_cpu, CPU, m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int8_mm", &int8_mm);
  m.impl("int4_q8_mm", &int4_q8_mm);
  m.impl("int8_q8_mm", &int8_q8_mm);
  m.impl("q8_quantize", &q8_quantize);
  m.impl("rows_attention", &rows_attention);
  m.impl("eagle_level", &eagle_level);
  m.impl("int4_stack", &int4_stack);
  m.impl("stack_prelude", &stack_prelude);
  m.impl("row_argmax", &row_argmax);
}

TORCH_LIBRARY_IMPL(specbuild_cpu, CompositeExplicitAutograd, m) {
  m.impl("isa_level", &isa_level);
  m.impl("has_isa4", &has_isa4);
  m.impl("dot_rates", &dot_rates);
  m.impl("q8_paths", &q8_paths);
  m.impl("int8_q8_available", &int8_q8_available);
  m.impl("pool_config", &pool_config);
  m.impl("pool_contended", &pool_contended);
  m.impl("pool_threads", &pool_threads);
  m.impl("pool_stats", &pool_stats);
  m.impl("stack_profile", &stack_profile);
  m.impl("pool_check", &pool_check);
}
