// Quantized matmuls by integer dot products: int4, int8 or MXFP4 weights times activations quantized to int8 per block
// of 32 inputs (what llama.cpp's CPU backend does with its Q8 activation blocks).
//
// A CPU decode step reads every weight once per step; torch's own packed kernels spend far longer than that takes
// (bench/RESULTS.md#issue-17-cpu-fused-kernels), and the int4 one costs much more at 4 rows than at one
// (bench/RESULTS.md#issue-17-cpu-int8-dot).
// Here AVX-512 VNNI's vpdpbusd multiplies 64 unsigned weight bytes by 64 signed activation bytes and adds them
// into 16 int32 lanes in one instruction, so a row of activations costs little more than the weights' loads.
//
// Weight layout (engine/model/quant/dot.py packs it): output rows in tiles of 16, one int32 lane per row; a lane holds
// 4 consecutive inputs, so one 64-byte vector is 16 rows x 4 inputs and an activation's 4 bytes are broadcast to
// all lanes. Per tile and block of 32 inputs:
//   int4  320 bytes: 4 x 64 bytes of codes (the low nibble holds inputs 4c..4c+3 of the block, the high nibble
//         inputs 16+4c..16+4c+3), then 16 float16 scales d and 16 float16 offsets m (w = code * d + m);
//   int8  512 bytes: 8 x 64 bytes of codes + 128 (unsigned), one float32 scale per row beside them;
//   mxfp4 272 bytes: 4 x 64 bytes of E2M1 codes laid out as int4's, then the 16 rows' E8M0 scale bytes
//         (engine/model/quant/experts.py packs it).
// Dot products within a block are exact integers and blocks are added in order, so a row's result does not
// depend on which other rows share the call (batch-invariant) or on how the tiles are split over threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define EMBERSERVE_X86 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr int64_t kBlock = 32;        // inputs per activation scale
constexpr int64_t kTile = 16;         // output rows per tile (one per int32 lane)
constexpr int64_t kInt4Record = 320;  // bytes per tile and block, int4 weights
constexpr int64_t kInt8Record = 512;  // bytes per tile and block, int8 weights
constexpr int64_t kMxfp4Record = 272; // bytes per tile and block, MXFP4 weights
constexpr int kRowTile = 4;           // activation rows computed together (each needs 3 vector registers)
constexpr int64_t kParallelMacs = 1 << 18;  // below this many multiply-adds a call stays on the calling thread

#if EMBERSERVE_X86

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

// Activations quantized per block: codes (int8), the scale s with x ~ codes * s, and s * sum(codes).
struct QuantizedRows {
  const int8_t* codes;
  const float* scale;
  const float* scaled_sum;
  const int32_t* sum;
  int64_t blocks;
};

VNNI_TARGET inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
VNNI_TARGET inline __m512 load16(const c10::BFloat16* p) {
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

template <typename T>
VNNI_TARGET void quantize_rows(const T* x, int64_t rows, int64_t k, int64_t stride, int8_t* codes, float* scale,
                               float* scaled_sum, int32_t* sum) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const T* in = x + r * stride + b * kBlock;
      __m512 lo = load16(in), hi = load16(in + 16);
      __m512 amax = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
      const float m = _mm512_reduce_max_ps(amax);
      const float s = m / 127.f;
      const float inv = m > 0.f ? 127.f / m : 0.f;
      // round to nearest even (the default MXCSR mode), in -127..127 since |x| * 127 / max <= 127
      __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
      __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
      int8_t* out = codes + (r * blocks + b) * kBlock;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtsepi32_epi8(qlo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtsepi32_epi8(qhi));
      const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
      scale[r * blocks + b] = s;
      sum[r * blocks + b] = total;
      scaled_sum[r * blocks + b] = s * static_cast<float>(total);
    }
  }
}

template <typename T>
VNNI_TARGET inline void store_tile(const __m512& acc, T* out, int64_t count) {
  alignas(64) float v[kTile];
  _mm512_store_ps(v, acc);
  for (int64_t i = 0; i < count; ++i) out[i] = static_cast<T>(v[i]);  // bfloat16: round to nearest even
}

VNNI_TARGET inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return _mm512_set1_epi32(v);
}

// One tile of 16 output rows for R activation rows (R <= kRowTile), int4 weights.
template <int R, typename T>
VNNI_TARGET void int4_tile(const uint8_t* tile, const QuantizedRows& a, int64_t row0, T* out, int64_t out_stride,
                           int64_t count) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec = tile + b * kInt4Record;
    __m512i lo_sum[R], hi_sum[R];  // two chains per row: vpdpbusd's latency is not on one chain of eight
    for (int r = 0; r < R; ++r) lo_sum[r] = hi_sum[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_loadu_si512(rec + 64 * c);
      const __m512i lo = _mm512_and_si512(w, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.codes + ((row0 + r) * a.blocks + b) * kBlock;
        lo_sum[r] = _mm512_dpbusd_epi32(lo_sum[r], lo, broadcast4(x + 4 * c));
        hi_sum[r] = _mm512_dpbusd_epi32(hi_sum[r], hi, broadcast4(x + 16 + 4 * c));
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 256)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288)));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * a.blocks + b;
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(lo_sum[r], hi_sum[r]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.scale[i])), dot, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(a.scaled_sum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_tile(acc[r], out + r * out_stride, count);
}

// The same for int8 weights (stored + 128): a block's dot product is sum(u * x) - 128 * sum(x), exact in int32.
template <int R, typename T>
VNNI_TARGET void int8_tile(const uint8_t* tile, const float* row_scale, const QuantizedRows& a, int64_t row0, T* out,
                           int64_t out_stride, int64_t count) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec = tile + b * kInt8Record;
    __m512i even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
      const __m512i w0 = _mm512_loadu_si512(rec + 64 * j), w1 = _mm512_loadu_si512(rec + 64 * (j + 1));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.codes + ((row0 + r) * a.blocks + b) * kBlock;
        even[r] = _mm512_dpbusd_epi32(even[r], w0, broadcast4(x + 4 * j));
        odd[r] = _mm512_dpbusd_epi32(odd[r], w1, broadcast4(x + 4 * (j + 1)));
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * a.blocks + b;
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(even[r], odd[r]), _mm512_set1_epi32(128 * a.sum[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(a.scale[i]), acc[r]);
    }
  }
  const __m512 s = _mm512_loadu_ps(row_scale);
  for (int r = 0; r < R; ++r) store_tile(_mm512_mul_ps(acc[r], s), out + r * out_stride, count);
}

// The same for MXFP4 weights: a nibble is an E2M1 code, looked up (vpshufb) as twice its value plus 12, unsigned
// 0..24, so a block's dot product is sum(u * x) - 12 * sum(x), exact in int32, and its scale is half the E8M0
// one, 2^(e - 128) (ggml's GGML_E8M0_TO_FP32_HALF: a float32 for every byte), built from the byte's bits.
template <int R, typename T>
VNNI_TARGET void mxfp4_tile(const uint8_t* tile, const QuantizedRows& a, int64_t row0, T* out, int64_t out_stride,
                            int64_t count) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i doubled = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24,
                                                               12, 11, 10, 9, 8, 6, 4, 0));
  const __m512i two = _mm512_set1_epi32(2), one = _mm512_set1_epi32(1);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.blocks; ++b) {
    const uint8_t* rec = tile + b * kMxfp4Record;
    __m512i lo_sum[R], hi_sum[R];
    for (int r = 0; r < R; ++r) lo_sum[r] = hi_sum[r] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const __m512i w = _mm512_loadu_si512(rec + 64 * c);
      const __m512i lo = _mm512_shuffle_epi8(doubled, _mm512_and_si512(w, nibble));
      const __m512i hi = _mm512_shuffle_epi8(doubled, _mm512_and_si512(_mm512_srli_epi16(w, 4), nibble));
      for (int r = 0; r < R; ++r) {
        const int8_t* x = a.codes + ((row0 + r) * a.blocks + b) * kBlock;
        lo_sum[r] = _mm512_dpbusd_epi32(lo_sum[r], lo, broadcast4(x + 4 * c));
        hi_sum[r] = _mm512_dpbusd_epi32(hi_sum[r], hi, broadcast4(x + 16 + 4 * c));
      }
    }
    // 2^(e - 128): the exponent field e - 1 for e >= 2, the subnormals 2^-127 (e = 1) and 2^-128 (e = 0) below
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 256)));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, one), 23);
    const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), _mm512_min_epu32(e, one));
    const __m512 half = _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmpge_epu32_mask(e, two), subnormal,
                                                                    normal));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (row0 + r) * a.blocks + b;
      const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(lo_sum[r], hi_sum[r]), _mm512_set1_epi32(12 * a.sum[i]));
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(half, _mm512_set1_ps(a.scale[i])), _mm512_cvtepi32_ps(dot), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store_tile(acc[r], out + r * out_stride, count);
}

template <typename TileFn>
void for_each_tile(int64_t rows, int64_t tiles, int64_t n, int64_t k, TileFn&& tile_fn) {
  const int64_t macs = rows * tiles * kTile * k;
  const int64_t threads = macs < kParallelMacs ? 1 : at::get_num_threads();
  const int64_t grain = std::max<int64_t>(1, (tiles + threads - 1) / threads);
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t count = std::min<int64_t>(kTile, n - t * kTile);
      for (int64_t r = 0; r < rows; r += kRowTile) tile_fn(t, r, std::min<int64_t>(kRowTile, rows - r), count);
    }
  });
}

void check_input(const at::Tensor& x, const at::Tensor& packed, int64_t record, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be a [rows, in] matrix with contiguous rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  TORCH_CHECK(x.size(1) % kBlock == 0, "the input size must be a multiple of ", kBlock);
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) / kBlock && packed.size(2) == record,
              "packed weights must be uint8 [tiles, in / 32, ", record, "]");
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kTile && out_features <= packed.size(0) * kTile,
              "out_features does not match the packed tiles");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "CPU tensors only");
}

// Calls fn with x's data as float* or c10::BFloat16* (the two activation types check_input admits).
template <typename Fn>
void with_activation_type(const at::Tensor& x, Fn&& fn) {
  if (x.scalar_type() == at::kFloat) {
    fn(x.data_ptr<float>());
  } else {
    fn(x.data_ptr<c10::BFloat16>());
  }
}

struct Quantized {
  at::Tensor codes, scale, scaled_sum, sum;
  QuantizedRows rows() const {
    return {codes.data_ptr<int8_t>(), scale.data_ptr<float>(), scaled_sum.data_ptr<float>(),
            sum.data_ptr<int32_t>(), scale.size(1)};
  }
};

Quantized quantize(const at::Tensor& x) {
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / kBlock;
  Quantized q{at::empty({rows, k}, x.options().dtype(at::kChar)), at::empty({rows, blocks}, x.options().dtype(at::kFloat)),
              at::empty({rows, blocks}, x.options().dtype(at::kFloat)), at::empty({rows, blocks}, x.options().dtype(at::kInt))};
  with_activation_type(x, [&](auto* typed) {
    quantize_rows(typed, rows, k, x.stride(0), q.codes.data_ptr<int8_t>(), q.scale.data_ptr<float>(),
                  q.scaled_sum.data_ptr<float>(), q.sum.data_ptr<int32_t>());
  });
  return q;
}

template <int R, typename Fn>
void dispatch_rows(int64_t r, Fn&& fn) {
  if constexpr (R > 1) {
    if (r < R) return dispatch_rows<R - 1>(r, fn);
  }
  fn(std::integral_constant<int, R>{});
}

bool supported() {  // asked once (every matmul checks it)
  static const bool vnni = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
  }();
  return vnni;
}

// The driver both weight formats share: x quantized once, then tile(rows, a, tile index, first row, out, valid
// outputs) for every tile of 16 outputs and every run of up to kRowTile rows (rows: a compile-time count).
template <typename Tile>
at::Tensor dot_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t record, int64_t out_features,
                      Tile&& tile) {
  TORCH_CHECK(supported(), "this CPU has no AVX-512 VNNI");
  check_input(x, packed, record, out_features);
  const Quantized q = quantize(x);
  const QuantizedRows a = q.rows();
  at::Tensor y = at::empty({x.size(0), out_features}, x.options());
  with_activation_type(y, [&](auto* out) {
    for_each_tile(x.size(0), packed.size(0), out_features, x.size(1), [&](int64_t t, int64_t r, int64_t n, int64_t count) {
      dispatch_rows<kRowTile>(n, [&](auto rows) { tile(rows, a, t, r, out + r * out_features + t * kTile, count); });
    });
  });
  return y;
}

at::Tensor int4_dot_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t tile_bytes = packed.size(1) * kInt4Record;
  return dot_matmul(x, packed, kInt4Record, out_features, [&](auto rows, const QuantizedRows& a, int64_t t, int64_t r,
                                                              auto* out, int64_t count) {
    int4_tile<decltype(rows)::value>(w + t * tile_bytes, a, r, out, out_features, count);
  });
}

at::Tensor int8_dot_matmul(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& row_scale,
                           int64_t out_features) {
  TORCH_CHECK(row_scale.scalar_type() == at::kFloat && row_scale.is_contiguous() &&
                  row_scale.numel() == packed.size(0) * kTile, "row_scale must be float32 [tiles * 16]");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* s = row_scale.data_ptr<float>();
  const int64_t tile_bytes = packed.size(1) * kInt8Record;
  return dot_matmul(x, packed, kInt8Record, out_features, [&](auto rows, const QuantizedRows& a, int64_t t, int64_t r,
                                                              auto* out, int64_t count) {
    int8_tile<decltype(rows)::value>(w + t * tile_bytes, s + t * kTile, a, r, out, out_features, count);
  });
}

at::Tensor mxfp4_dot_matmul(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t tile_bytes = packed.size(1) * kMxfp4Record;
  return dot_matmul(x, packed, kMxfp4Record, out_features, [&](auto rows, const QuantizedRows& a, int64_t t, int64_t r,
                                                               auto* out, int64_t count) {
    mxfp4_tile<decltype(rows)::value>(w + t * tile_bytes, a, r, out, out_features, count);
  });
}

#else  // not x86-64: no VNNI; the ops exist (the library builds everywhere) and refuse, as on an x86 CPU without it

bool supported() { return false; }

at::Tensor int4_dot_matmul(const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "this CPU has no AVX-512 VNNI");
}

at::Tensor int8_dot_matmul(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "this CPU has no AVX-512 VNNI");
}

at::Tensor mxfp4_dot_matmul(const at::Tensor&, const at::Tensor&, int64_t) {
  TORCH_CHECK(false, "this CPU has no AVX-512 VNNI");
}

#endif

bool int8_dot_supported() { return supported(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(emberserve, m) {
  m.def("int8_dot_supported() -> bool", &int8_dot_supported);
  m.def("int4_dot_matmul(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("int8_dot_matmul(Tensor x, Tensor packed, Tensor row_scale, int out_features) -> Tensor");
  m.def("mxfp4_dot_matmul(Tensor x, Tensor packed, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(emberserve, CPU, m) {
  m.impl("int4_dot_matmul", &int4_dot_matmul);
  m.impl("int8_dot_matmul", &int8_dot_matmul);
  m.impl("mxfp4_dot_matmul", &mxfp4_dot_matmul);
}
