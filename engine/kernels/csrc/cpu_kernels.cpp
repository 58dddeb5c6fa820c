// Fused CPU kernels for the elementwise work and the decode attention between a decoder layer's matmuls.
//
// A CPU decode step of a small model is bound by operator calls, not by memory
// (bench/RESULTS.md#issue-17-cpu-fused-kernels): each
// torch op between the matmuls costs microseconds of dispatch, allocation and OpenMP fork/join around nanoseconds
// of work. These ops do the same maths as engine/kernels/fused_torch.py in one call each, registered with the
// dispatcher as torch.ops.emberserve.* so that the scripted decoder stack (engine/model/decoder.py) calls them too:
//
//   add_rms_norm          the residual add and the next RMS norm (x + residual, then its norm)
//   norm_add_rms_norm     gemma3's sandwich: residual + norm(branch), then the next norm
//   rope_write_kv         optional q/k norms, rotary embedding of q and k, the store of k and v into their slots
//   gated_activation      silu(gate) * up, or tanh-GELU(gate) * up
//   paged_decode_attention  one query per row over its keys read in place through its block table
//   paged_prefill_attention the queries of short chunks over their rows' cached keys, the same way
//
// Both attention kernels take optional attention sinks (gpt-oss): a logit per query head that joins every softmax
// of the head and has no value, so the softmax's max starts at the sink's logit and its sum at exp(sink - max).
//
// Every kernel computes in float32 from float32 or bfloat16 tensors and rounds where the torch ops round (the
// residual sum, a q/k norm, the rotated x * cos term, the activation), so results differ from the torch path only
// by the order of a reduction. A row's result never depends on the other rows (batch-invariant). Work is split over
// torch's intra-op threads only when a call is big enough to pay for the fork/join.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

// Below this many elements of work a call runs on the calling thread: a parallel region costs more.
constexpr int64_t kParallelWork = 1 << 15;

inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) {  // the bits shifted into a float's upper half (inline and vectorizable)
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
template <typename T> inline T store(float v);
template <> inline float store<float>(float v) { return v; }
template <> inline c10::BFloat16 store<c10::BFloat16>(float v) {  // round to nearest even, NaN kept; branch-free
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  u = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc00000u : u + 0x7fffu + ((u >> 16) & 1u);
  return c10::BFloat16(static_cast<uint16_t>(u >> 16), c10::BFloat16::from_bits());
}
template <typename T> inline float rounded(float v) { return load(store<T>(v)); }

// exp(x) in float32 within 2 ulp for |x| < 87, written out so that loops of it vectorize (libm's expf does not):
// x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial, 2^n put into the exponent bits.
inline float fast_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest: 1.5 * 2^23 trick
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;  // ln2 in two parts: r stays exact
  float p = 1.f / 720;
  p = p * r + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

inline int64_t grain(int64_t tasks, int64_t work_per_task) {
  return tasks * work_per_task < kParallelWork ? tasks : std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, work_per_task));
}

template <typename T>
inline void norm_row(const float* x, int64_t d, const float* w, float eps, T* out) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t i = 0; i < d; ++i) out[i] = store<T>(x[i] * inv * w[i]);
}

// summed = x + residual (rounded to T); normed = rms_norm(summed) * w. residual may be null (summed is x).
// With branch_w: summed = residual + rms_norm(x) * branch_w (rounded), gemma3's post-norm then add.
template <typename T>
void add_norm_rows(const T* x, const T* residual, const float* branch_w, const float* w, float eps, T* normed, T* summed,
                   int64_t rows, int64_t d) {
  at::parallel_for(0, rows, grain(rows, d), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(d);
    std::vector<T> branch(branch_w ? d : 0);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      if (branch_w) {
        for (int64_t i = 0; i < d; ++i) buf[i] = load(xr[i]);
        norm_row<T>(buf.data(), d, branch_w, eps, branch.data());
        xr = branch.data();
      }
      if (residual) {
        const T* rr = residual + r * d;
        T* sr = summed + r * d;
        for (int64_t i = 0; i < d; ++i) {
          sr[i] = store<T>(load(xr[i]) + load(rr[i]));
          buf[i] = load(sr[i]);
        }
      } else {
        for (int64_t i = 0; i < d; ++i) buf[i] = load(xr[i]);
      }
      norm_row<T>(buf.data(), d, w, eps, normed + r * d);
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
}

void check_weight(const at::Tensor& w, int64_t d, const char* name) {
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
  TORCH_CHECK(w.numel() >= d, name, " has ", w.numel(), " elements for rows of ", d);
}

std::tuple<at::Tensor, at::Tensor> norms(const at::Tensor& x_in, const c10::optional<at::Tensor>& residual_in,
                                         const c10::optional<at::Tensor>& branch_weight, const at::Tensor& weight,
                                         double eps) {
  check_rows(x_in, "x");
  const int64_t d = x_in.size(-1);
  check_weight(weight, d, "weight");
  at::Tensor x = x_in.contiguous();
  at::Tensor residual;
  if (residual_in.has_value()) {
    residual = residual_in->contiguous();
    TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
                "residual must match x's shape and dtype");
  }
  at::Tensor normed = at::empty_like(x);
  at::Tensor summed = residual.defined() ? at::empty_like(x) : x;
  const int64_t rows = d ? x.numel() / d : 0;
  TORCH_CHECK(!branch_weight.has_value() || branch_weight->scalar_type() == weight.scalar_type(),
              "branch_weight and weight must share a dtype");
  // the weights in float32 (RMSNorm's own table already is; a bfloat16 weight converts exactly)
  at::Tensor w = weight.to(at::kFloat).contiguous();
  at::Tensor bw = branch_weight.has_value() ? branch_weight->to(at::kFloat).contiguous() : at::Tensor();
  if (bw.defined()) check_weight(bw, d, "branch_weight");
  const float* bw_p = bw.defined() ? bw.data_ptr<float>() : nullptr;
  AT_DISPATCH_SWITCH(x.scalar_type(), "emberserve_norms",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      add_norm_rows<float>(x.data_ptr<float>(), residual.defined() ? residual.data_ptr<float>() : nullptr, bw_p,
                           w.data_ptr<float>(), eps, normed.data_ptr<float>(), summed.data_ptr<float>(), rows, d);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = c10::BFloat16;
      add_norm_rows<T>(x.data_ptr<T>(), residual.defined() ? residual.data_ptr<T>() : nullptr, bw_p,
                       w.data_ptr<float>(), eps, normed.data_ptr<T>(), summed.data_ptr<T>(), rows, d);
    }));
  return {normed, summed};
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  return norms(x, residual, c10::nullopt, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> norm_add_rms_norm(const at::Tensor& branch, const at::Tensor& residual,
                                                     const at::Tensor& branch_weight, const at::Tensor& weight,
                                                     double eps) {
  return norms(branch, residual, branch_weight, weight, eps);
}

// ---- rotary embedding and the KV write ----

template <typename T>
void rope_rows(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
               at::Tensor& keys, at::Tensor& values, const std::vector<int64_t>& slots, const at::Tensor& qw,
               const at::Tensor& kw, float eps, at::Tensor& q_out, at::Tensor* k_out) {
  const int64_t n = qk.size(0), total = qk.size(1), d = qk.size(2), kvh = keys.size(0), heads = total - kvh;
  const int64_t half = d / 2;
  const T* qk_p = qk.data_ptr<T>();
  const T* v_p = v.data_ptr<T>();
  const T* cos_p = cos.data_ptr<T>();
  const T* sin_p = sin.data_ptr<T>();
  T* keys_p = keys.data_ptr<T>();
  T* values_p = values.data_ptr<T>();
  T* q_p = q_out.data_ptr<T>();
  T* ko_p = k_out ? k_out->data_ptr<T>() : nullptr;
  const int64_t qk_s0 = qk.stride(0), qk_s1 = qk.stride(1), v_s0 = v.stride(0), v_s1 = v.stride(1);
  const int64_t cos_s0 = cos.stride(0), sin_s0 = sin.stride(0);
  const int64_t key_s0 = keys.stride(0), key_s1 = keys.stride(1), val_s0 = values.stride(0), val_s1 = values.stride(1);
  const bool normed = qw.defined();
  const float* qw_p = normed ? qw.data_ptr<float>() : nullptr;
  const float* kw_p = normed ? kw.data_ptr<float>() : nullptr;
  at::parallel_for(0, n, grain(n, total * d), [&](int64_t begin, int64_t end) {
    std::vector<float> x(d), buf(d);
    std::vector<T> tmp(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos_p + r * cos_s0;
      const T* s = sin_p + r * sin_s0;
      const int64_t slot = slots[r];
      for (int64_t h = 0; h < total; ++h) {
        const T* src = qk_p + r * qk_s0 + h * qk_s1;
        const bool is_k = h >= heads;
        if (normed) {  // the per-head norm, rounded to T as the torch path's rms_norm returns it
          for (int64_t i = 0; i < d; ++i) buf[i] = load(src[i]);
          const float* w = is_k ? kw_p : qw_p;
          float ss = 0.f;
#pragma omp simd reduction(+ : ss)
          for (int64_t i = 0; i < d; ++i) ss += buf[i] * buf[i];
          const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
          for (int64_t i = 0; i < d; ++i) x[i] = rounded<T>(buf[i] * inv * w[i]);
        } else {
          for (int64_t i = 0; i < d; ++i) x[i] = load(src[i]);
        }
        // x * cos (rounded, as its own op rounds), plus rotate_half(x) * signed sin, rounded once (addcmul).
        T* dst = is_k ? tmp.data() : q_p + (r * heads + h) * d;
        for (int64_t i = 0; i < d; ++i) {
          const float rot = i < half ? x[i + half] : x[i - half];
          dst[i] = store<T>(rounded<T>(x[i] * load(c[i])) + rot * load(s[i]));
        }
        if (is_k) {
          const int64_t kh = h - heads;
          std::memcpy(keys_p + kh * key_s0 + slot * key_s1, tmp.data(), d * sizeof(T));
          if (ko_p) std::memcpy(ko_p + (r * kvh + kh) * d, tmp.data(), d * sizeof(T));
          std::memcpy(values_p + kh * val_s0 + slot * val_s1, v_p + r * v_s0 + kh * v_s1, d * sizeof(T));
        }
      }
    }
  });
}

at::Tensor rope_write_kv(const at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& keys, at::Tensor& values, const at::Tensor& slots,
                         const c10::optional<at::Tensor>& q_norm_weight, const c10::optional<at::Tensor>& k_norm_weight,
                         double eps, c10::optional<at::Tensor> k_out) {
  check_rows(qk, "qk");
  TORCH_CHECK(qk.dim() == 3 && keys.dim() == 3 && keys.sizes() == values.sizes(),
              "qk must be [N, H + KVH, D] and keys/values [KVH, slots, D] alike");
  const int64_t n = qk.size(0), total = qk.size(1), d = qk.size(2), kvh = keys.size(0);
  TORCH_CHECK(total > kvh && d % 2 == 0 && keys.size(2) == d, "qk does not fit the cache's KV heads");
  TORCH_CHECK(v.dim() == 3 && v.size(0) == n && v.size(1) == kvh && v.size(2) == d, "v must be [N, KVH, D]");
  TORCH_CHECK(qk.scalar_type() == v.scalar_type() && qk.scalar_type() == keys.scalar_type() &&
              qk.scalar_type() == values.scalar_type() && cos.scalar_type() == qk.scalar_type() &&
              sin.scalar_type() == qk.scalar_type(), "qk, v, cos, sin, keys and values must share a dtype");
  TORCH_CHECK(qk.stride(2) == 1 && v.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1,
              "qk, v, keys and values must be contiguous along head_dim");
  TORCH_CHECK(cos.numel() == n * d && sin.numel() == n * d, "cos and sin must be [N, 1, D]");
  TORCH_CHECK(slots.numel() == n, "one slot per row");
  TORCH_CHECK(q_norm_weight.has_value() == k_norm_weight.has_value(), "q and k norm weights go together");
  at::Tensor c = cos.contiguous(), s = sin.contiguous();
  at::Tensor slots64 = slots.to(at::kLong).contiguous();
  std::vector<int64_t> slot_list(slots64.data_ptr<int64_t>(), slots64.data_ptr<int64_t>() + n);
  for (int64_t slot : slot_list) TORCH_CHECK(slot >= 0 && slot < keys.size(1), "slot ", slot, " is not in the cache");
  at::Tensor qw, kw;
  if (q_norm_weight.has_value()) {
    qw = q_norm_weight->to(at::kFloat).contiguous();
    kw = k_norm_weight->to(at::kFloat).contiguous();
    TORCH_CHECK(qw.numel() >= d && kw.numel() >= d, "q/k norm weights must have head_dim elements");
  }
  at::Tensor q = at::empty({n, total - kvh, d}, qk.options());
  at::Tensor* ko = nullptr;
  if (k_out.has_value()) {
    TORCH_CHECK(k_out->is_contiguous() && k_out->numel() == n * kvh * d && k_out->scalar_type() == qk.scalar_type(),
                "k_out must be a contiguous [N, KVH, D] tensor of qk's dtype");
    ko = &k_out.value();
  }
  AT_DISPATCH_SWITCH(qk.scalar_type(), "emberserve_rope",
    AT_DISPATCH_CASE(at::kFloat, [&] { rope_rows<float>(qk, v, c, s, keys, values, slot_list, qw, kw, eps, q, ko); })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      rope_rows<c10::BFloat16>(qk, v, c, s, keys, values, slot_list, qw, kw, eps, q, ko);
    }));
  return q;
}

// ---- the gated activation ----

template <typename T, bool Gelu>
void activation_rows(const T* in, T* out, int64_t rows, int64_t in_stride, int64_t f) {
  at::parallel_for(0, rows, grain(rows, f), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * in_stride;
      const T* u = g + f;
      T* o = out + r * f;
#pragma omp simd
      for (int64_t i = 0; i < f; ++i) {
        const float x = load(g[i]);
        float a;
        if constexpr (Gelu) {  // 1 + tanh(y) = 2 - 2 / (exp(2y) + 1)
          const float y = 0.7978845608028654f * (x + 0.044715f * x * x * x);  // sqrt(2 / pi) (x + 0.044715 x^3)
          a = x * (1.f - 1.f / (fast_exp(2.f * y) + 1.f));
        } else {
          a = x / (1.f + fast_exp(-x));
        }
        o[i] = store<T>(rounded<T>(a) * load(u[i]));  // act(gate) rounded, as its own op returns it, then * up
      }
    }
  });
}

at::Tensor gated_activation(const at::Tensor& gate_up, bool gelu) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "gate_up's last dimension must be [gate | up], even");
  at::Tensor x = gate_up.stride(-1) == 1 ? gate_up : gate_up.contiguous();
  const int64_t f = x.size(-1) / 2;
  at::Tensor flat = x.reshape({-1, 2 * f});
  if (flat.stride(-1) != 1 || (flat.size(0) > 1 && flat.stride(0) != 2 * f)) flat = flat.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = f;
  at::Tensor out = at::empty(sizes, x.options());
  const int64_t rows = flat.size(0);
  AT_DISPATCH_SWITCH(x.scalar_type(), "emberserve_activation",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      auto run = gelu ? activation_rows<float, true> : activation_rows<float, false>;
      run(flat.data_ptr<float>(), out.data_ptr<float>(), rows, flat.stride(0), f);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      using T = c10::BFloat16;
      auto run = gelu ? activation_rows<T, true> : activation_rows<T, false>;
      run(flat.data_ptr<T>(), out.data_ptr<T>(), rows, flat.stride(0), f);
    }));
  return out;
}

// ---- decode attention over the paged pool ----

// out[h * out_stride] = q_h . k for the `heads` (1 to 4) query rows q [heads, d]: one pass over k with a separate
// sum per head, so that the vector additions of different heads overlap instead of waiting on one another.
template <int N>
inline void dots_n(const float* q, const float* k, int64_t d, float* out, int64_t out_stride) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  const float *q0 = q, *q1 = q + d, *q2 = q + 2 * d, *q3 = q + 3 * d;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
  for (int64_t i = 0; i < d; ++i) {
    s0 += q0[i] * k[i];
    if constexpr (N > 1) s1 += q1[i] * k[i];
    if constexpr (N > 2) s2 += q2[i] * k[i];
    if constexpr (N > 3) s3 += q3[i] * k[i];
  }
  out[0] = s0;
  if constexpr (N > 1) out[out_stride] = s1;
  if constexpr (N > 2) out[2 * out_stride] = s2;
  if constexpr (N > 3) out[3 * out_stride] = s3;
}

inline void dots(const float* q, int64_t heads, const float* k, int64_t d, float* out, int64_t out_stride) {
  switch (heads) {
    case 1: dots_n<1>(q, k, d, out, out_stride); break;
    case 2: dots_n<2>(q, k, d, out, out_stride); break;
    case 3: dots_n<3>(q, k, d, out, out_stride); break;
    default: dots_n<4>(q, k, d, out, out_stride); break;
  }
}

struct Scratch {
  std::vector<float> q, acc, k, scores;
};

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

// scores[g * stride] = q_g . key for the `group` float query rows q [group, d]; `k` is scratch for the key in float.
template <typename T>
inline void score_key(const float* q, int64_t group, const T* key, int64_t d, float* k, float* scores,
                      int64_t stride) {
#if defined(__AVX512F__)
  if (d % 16 == 0 && d <= 256) {  // the key held in registers, one vector sum per head
    __m512 kv[16];
    const int64_t chunks = d / 16;
    for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(key + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * d;
      __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qg), kv[0]);
      for (int64_t c = 1; c < chunks; ++c) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), kv[c], sum);
      scores[g * stride] = _mm512_reduce_add_ps(sum);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < d; ++i) k[i] = load(key[i]);
  for (int64_t g = 0; g < group; g += 4)  // up to four heads' dot products at once: independent sums
    dots(q + g * d, std::min<int64_t>(4, group - g), k, d, scores + g * stride, stride);
}

// acc[g] += p[g * stride] * value for the `group` float accumulators acc [group, d].
template <typename T>
inline void add_value(const float* p, int64_t stride, int64_t group, const T* value, int64_t d, float* v,
                      float* acc) {
#if defined(__AVX512F__)
  if (d % 16 == 0 && d <= 256) {
    __m512 vv[16];
    const int64_t chunks = d / 16;
    for (int64_t c = 0; c < chunks; ++c) vv[c] = load16(value + 16 * c);
    for (int64_t g = 0; g < group; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * stride]);
      float* ag = acc + g * d;
      for (int64_t c = 0; c < chunks; ++c)
        _mm512_storeu_ps(ag + 16 * c, _mm512_fmadd_ps(w, vv[c], _mm512_loadu_ps(ag + 16 * c)));
    }
    return;
  }
#endif
  for (int64_t i = 0; i < d; ++i) v[i] = load(value[i]);
  for (int64_t g = 0; g < group; ++g) {
    const float w = p[g * stride];
    float* ag = acc + g * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) ag[i] += w * v[i];
  }
}

// The `group` query heads q (head stride q_hs) sharing one KV head, for one query that sees the keys at positions
// [first, len) of its row (block `table`; k / v: that KV head's slots, slot stride k_s / v_s) → o (head stride o_hs).
// Scores, softmax and the weighted sum in float32; the keys and values read in place, a block's run at a time.
// `sinks`: the group's attention sinks, or null.
template <typename T>
void attend_group(const T* q, int64_t q_hs, const T* k, int64_t k_s, const T* v, int64_t v_s, const int32_t* table,
                  int64_t block_size, int64_t first, int64_t len, int64_t group, int64_t d, float scale,
                  const float* sinks, T* o, int64_t o_hs, Scratch& s) {
  if (len <= first) {  // a padding row
    for (int64_t g = 0; g < group; ++g) std::fill_n(o + g * o_hs, d, store<T>(0.f));
    return;
  }
  const int64_t count = len - first;
  s.q.resize(group * d);
  s.acc.assign(group * d, 0.f);
  s.k.resize(d);
  s.scores.resize(group * count);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) s.q[g * d + i] = load(q[g * q_hs + i]) * scale;
  for (int64_t pos = first; pos < len;) {  // a block's slots are consecutive: no division per key
    const int64_t in_block = pos % block_size, run = std::min(block_size - in_block, len - pos);
    const T* key = k + (static_cast<int64_t>(table[pos / block_size]) * block_size + in_block) * k_s;
    for (int64_t t = 0; t < run; ++t, key += k_s)
      score_key(s.q.data(), group, key, d, s.k.data(), s.scores.data() + pos - first + t, count);
    pos += run;
  }
  for (int64_t g = 0; g < group; ++g) {  // softmax in place
    float* sg = s.scores.data() + g * count;
    float top = sinks ? sinks[g] : -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < count; ++j) top = std::max(top, sg[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < count; ++j) {
      sg[j] = fast_exp(sg[j] - top);
      sum += sg[j];
    }
    if (sinks) sum += fast_exp(sinks[g] - top);
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < count; ++j) sg[j] *= inv;
  }
  for (int64_t pos = first; pos < len;) {
    const int64_t in_block = pos % block_size, run = std::min(block_size - in_block, len - pos);
    const T* val = v + (static_cast<int64_t>(table[pos / block_size]) * block_size + in_block) * v_s;
    for (int64_t t = 0; t < run; ++t, val += v_s)
      add_value(s.scores.data() + pos - first + t, count, group, val, d, s.k.data(), s.acc.data());
    pos += run;
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t i = 0; i < d; ++i) o[g * o_hs + i] = store<T>(s.acc[g * d + i]);
}

// Queries of rows over their cached keys: query `qi` of `queries` [(q row, table row, first key, end key)], one task
// per (query, KV head), split over threads when the work pays for it.
template <typename T>
void attend_queries(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int32_t* tables,
                    int64_t table_stride, const std::vector<std::array<int64_t, 4>>& queries, int64_t block_size,
                    float scale, const float* sinks, at::Tensor& out) {
  const int64_t h = q.size(1), d = q.size(2), kvh = keys.size(0), group = h / kvh;
  const int64_t n = static_cast<int64_t>(queries.size());
  int64_t longest = 1;
  for (const auto& query : queries) longest = std::max<int64_t>(longest, query[3] - query[2]);
  const T* q_p = q.data_ptr<T>();
  const T* k_p = keys.data_ptr<T>();
  const T* v_p = values.data_ptr<T>();
  T* o_p = out.data_ptr<T>();
  at::parallel_for(0, n * kvh, grain(n * kvh, longest * d * group), [&](int64_t begin, int64_t end) {
    static thread_local Scratch scratch;  // one per thread for the process's life: no allocation per call
    for (int64_t task = begin; task < end; ++task) {
      const auto& query = queries[task / kvh];
      const int64_t kh = task % kvh, row = query[0];
      attend_group<T>(q_p + row * q.stride(0) + kh * group * q.stride(1), q.stride(1), k_p + kh * keys.stride(0),
                      keys.stride(1), v_p + kh * values.stride(0), values.stride(1), tables + query[1] * table_stride,
                      block_size, query[2], query[3], group, d, scale, sinks ? sinks + kh * group : nullptr,
                      o_p + row * out.stride(0) + kh * group * out.stride(1), out.stride(1), scratch);
    }
  });
}

// ---- chunk attention: many queries of one row over its cached keys ----
//
// A chunk over a long cache (a question after a cached 2k-token prefix) made the per-query kernel above read every
// key once per query and sum each dot product across a vector. Here a block of a row's consecutive queries and the
// `group` query heads of one KV head form R = queries x group rows (row i: query i / group, head i % group) that
// share one pass over the keys: 16 keys at a time are transposed into a tile, so each row's 16 scores are one vector
// of fused multiply-adds with no horizontal sums; then each row's softmax over its own keys (the rest weigh 0), then
// the weighted values added for a few rows at a time with their accumulators in registers.
constexpr int64_t kChunkQueries = 16;  // queries a task takes: enough rows to spread a tile's transposition over
// Where it serves, the chunk kernel takes every query, decode rows' included: a speculative verification row (the
// drafts and the last token) must give each token the logits a decode step gives it, or greedy outputs would change
// with speculation; and a query's arithmetic here is its own, whatever other queries share its task.

#if defined(__AVX512F__)
struct ChunkScratch {
  std::vector<float> q, scores, tile;
  std::vector<uint32_t> qw, tile_words;
};

// tile[16 * i + j] = convert(element i of key j) for the 16 keys from position p (zeros past `hi`): keys transposed,
// `width` elements of `key_stride` apart per key, found through the row's block table.
template <typename E, typename S, typename Convert>
inline void transpose_keys(E* tile, int64_t width, const S* keys, int64_t key_stride, const int32_t* table,
                           int64_t block_size, int64_t p, int64_t hi, Convert convert) {
  const int64_t count = std::min<int64_t>(16, hi - p);
  for (int64_t j = 0; j < 16; ++j) {
    if (j >= count) {
      for (int64_t i = 0; i < width; ++i) tile[16 * i + j] = E(0);
      continue;
    }
    const int64_t pos = p + j;
    const S* key = keys + (static_cast<int64_t>(table[pos / block_size]) * block_size + pos % block_size) * key_stride;
    for (int64_t i = 0; i < width; ++i) tile[16 * i + j] = convert(key[i]);
  }
}

// scores[r * stride + 0..15] = q_r . tile for N rows q [N, d] against `tile` [d, 16] (16 keys transposed).
template <int N>
inline void score_tile(const float* q, int64_t d, const float* tile, float* scores, int64_t stride) {
  __m512 acc[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m512 col = _mm512_loadu_ps(tile + 16 * i);
    for (int r = 0; r < N; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r * d + i]), col, acc[r]);
  }
  for (int r = 0; r < N; ++r) _mm512_storeu_ps(scores + r * stride, acc[r]);
}

inline void score_rows(const float* q, int64_t rows, int64_t d, const float* tile, float* scores, int64_t stride) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) score_tile<8>(q + r * d, d, tile, scores + r * stride, stride);
  for (; r < rows; ++r) score_tile<1>(q + r * d, d, tile, scores + r * stride, stride);
}

// The same for bfloat16 queries and keys on a CPU with AVX512_BF16: `tile` holds 16 keys as pairs of bfloat16 (32-bit
// words: word w of key j at tile[16 * w + j]), `q` the rows' words likewise ([rows, d / 2]); `vdpbf16ps` multiplies
// a pair per lane and adds both products in float32, so a tile costs half the instructions. Scores come unscaled.
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
template <int N>
BF16_TARGET inline void score_tile_bf16(const uint32_t* q, int64_t words, const uint32_t* tile, float* scores,
                                        int64_t stride) {
  __m512 acc[N];
  for (int r = 0; r < N; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t w = 0; w < words; ++w) {
    const __m512bh col = (__m512bh)_mm512_loadu_si512(tile + 16 * w);
    for (int r = 0; r < N; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * words + w])), col);
  }
  for (int r = 0; r < N; ++r) _mm512_storeu_ps(scores + r * stride, acc[r]);
}

BF16_TARGET void score_rows_bf16(const uint32_t* q, int64_t rows, int64_t words, const uint32_t* tile, float* scores,
                                 int64_t stride) {
  int64_t r = 0;
  for (; r + 8 <= rows; r += 8) score_tile_bf16<8>(q + r * words, words, tile, scores + r * stride, stride);
  for (; r < rows; ++r) score_tile_bf16<1>(q + r * words, words, tile, scores + r * stride, stride);
}

inline bool has_bf16_dot() {
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
}

// Scores [rows, stride] of the chunk's query rows (rows as in attend_chunk) over keys [lo, hi): float32 products,
// or on a CPU with AVX512_BF16 bfloat16 pairs through vdpbf16ps (the queries and keys as they are, scaled after).
template <typename T>
void score_chunk(const T* q, int64_t q_ts, int64_t q_hs, int64_t group, int64_t rows, const T* k, int64_t k_s,
                 const int32_t* table, int64_t block_size, int64_t lo, int64_t hi, int64_t d, float scale,
                 ChunkScratch& s, float* scores, int64_t stride) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (has_bf16_dot()) {
      const int64_t words = d / 2;  // the keys' slot stride is d: even, so a key is whole 32-bit words
      s.qw.resize(rows * words);
      s.tile_words.resize(16 * words);
      for (int64_t i = 0; i < rows; ++i)
        std::memcpy(s.qw.data() + i * words, q + (i / group) * q_ts + (i % group) * q_hs, d * sizeof(T));
      const auto* key_words = reinterpret_cast<const uint32_t*>(k);
      for (int64_t p = lo; p < hi; p += 16) {
        transpose_keys(s.tile_words.data(), words, key_words, k_s / 2, table, block_size, p, hi,
                       [](uint32_t w) { return w; });
        score_rows_bf16(s.qw.data(), rows, words, s.tile_words.data(), scores + (p - lo), stride);
      }
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < hi - lo; ++j) scores[i * stride + j] *= scale;
      return;
    }
  }
  s.q.resize(rows * d);
  s.tile.resize(16 * d);
  for (int64_t i = 0; i < rows; ++i) {
    const T* qi = q + (i / group) * q_ts + (i % group) * q_hs;
    for (int64_t j = 0; j < d; ++j) s.q[i * d + j] = load(qi[j]) * scale;
  }
  for (int64_t p = lo; p < hi; p += 16) {
    transpose_keys(s.tile.data(), d, k, k_s, table, block_size, p, hi, [](T x) { return load(x); });
    score_rows(s.q.data(), rows, d, s.tile.data(), scores + (p - lo), stride);
  }
}

// o_r += sum over keys j of p_r[j] * value_j for N rows at once (C vectors of 16 per head), keys [lo, hi) of the
// row's block table; p [N] rows of `stride` scores, indexed from key `base`.
template <typename T, int N, int C>
inline void add_values(const float* p, int64_t stride, int64_t base, int64_t lo, int64_t hi, const T* v, int64_t v_s,
                       const int32_t* table, int64_t block_size, float* out, int64_t d) {
  __m512 acc[N][C];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t pos = lo; pos < hi;) {
    const int64_t in_block = pos % block_size, run = std::min(block_size - in_block, hi - pos);
    const T* val = v + (static_cast<int64_t>(table[pos / block_size]) * block_size + in_block) * v_s;
    for (int64_t t = 0; t < run; ++t, val += v_s) {
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = load16(val + 16 * c);
      const int64_t j = pos + t - base;
      for (int r = 0; r < N; ++r) {
        const __m512 w = _mm512_set1_ps(p[r * stride + j]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w, vv[c], acc[r][c]);
      }
    }
    pos += run;
  }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * d + 16 * c, acc[r][c]);
}

template <typename T, int C>
void add_values_rows(const float* p, int64_t stride, int64_t base, const int64_t* row_lo, const int64_t* row_hi,
                     int64_t rows, const T* v, int64_t v_s, const int32_t* table, int64_t block_size, float* out) {
  constexpr int N = C <= 4 ? 4 : (C <= 8 ? 2 : 1);  // the accumulators of N rows fill at most 16 registers
  const int64_t d = 16 * C;
  int64_t r = 0;
  for (; r + N <= rows; r += N) {
    int64_t lo = row_lo[r], hi = row_hi[r];
    for (int i = 1; i < N; ++i) lo = std::min(lo, row_lo[r + i]), hi = std::max(hi, row_hi[r + i]);
    add_values<T, N, C>(p + r * stride, stride, base, lo, hi, v, v_s, table, block_size, out + r * d, d);
  }
  for (; r < rows; ++r)
    add_values<T, 1, C>(p + r * stride, stride, base, row_lo[r], row_hi[r], v, v_s, table, block_size, out + r * d, d);
}

// x[0] + ... + x[n - 1] in one order whatever x's alignment (16 lanes, their sum, then the lanes' total), so that
// a query's softmax does not depend on where in the scratch its scores lie.
inline float ordered_sum(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) acc = _mm512_add_ps(acc, _mm512_loadu_ps(x + j));
  if (j < n) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n - j)) - 1), x + j));
  return _mm512_reduce_add_ps(acc);
}

// Queries [0, n) of one row (q: the first query's first head of this KV head, token stride q_ts, head stride q_hs),
// query i seeing keys [firsts[i], ends[i]) through `table` → o likewise; `sinks`: the group's sinks, or null.
template <typename T>
void attend_chunk(const T* q, int64_t q_ts, int64_t q_hs, const T* k, int64_t k_s, const T* v, int64_t v_s,
                  const int32_t* table, int64_t block_size, const int64_t* firsts, const int64_t* ends, int64_t n,
                  int64_t group, int64_t d, float scale, const float* sinks, T* o, int64_t o_ts, int64_t o_hs,
                  ChunkScratch& s) {
  const int64_t rows = n * group, lo = *std::min_element(firsts, firsts + n), hi = *std::max_element(ends, ends + n);
  const int64_t count = std::max<int64_t>(0, hi - lo), stride = (count + 15) / 16 * 16;
  std::vector<int64_t> row_lo(rows), row_hi(rows);
  for (int64_t i = 0; i < rows; ++i) {
    row_lo[i] = firsts[i / group];
    row_hi[i] = std::max(firsts[i / group], ends[i / group]);
  }
  s.scores.resize(rows * stride);
  score_chunk(q, q_ts, q_hs, group, rows, k, k_s, table, block_size, lo, hi, d, scale, s, s.scores.data(), stride);
  for (int64_t i = 0; i < rows; ++i) {  // softmax over the row's own keys; the others weigh nothing
    float* si = s.scores.data() + i * stride;
    const int64_t a = row_lo[i] - lo, b = row_hi[i] - lo;
    std::fill(si, si + a, 0.f);
    std::fill(si + b, si + stride, 0.f);
    if (a >= b) continue;
    float top = sinks ? sinks[i % group] : -std::numeric_limits<float>::infinity();
    for (int64_t j = a; j < b; ++j) top = std::max(top, si[j]);
    for (int64_t j = a; j < b; ++j) si[j] = fast_exp(si[j] - top);
    float sum = ordered_sum(si + a, b - a);
    if (sinks) sum += fast_exp(sinks[i % group] - top);
    const float inv = 1.f / sum;
    for (int64_t j = a; j < b; ++j) si[j] *= inv;
  }
  s.q.resize(rows * d);
  float* acc = s.q.data();  // the float queries (if any) are done with: their rows take the outputs
  switch (d / 16) {
    case 4: add_values_rows<T, 4>(s.scores.data(), stride, lo, row_lo.data(), row_hi.data(), rows, v, v_s, table, block_size, acc); break;
    case 8: add_values_rows<T, 8>(s.scores.data(), stride, lo, row_lo.data(), row_hi.data(), rows, v, v_s, table, block_size, acc); break;
    default: add_values_rows<T, 16>(s.scores.data(), stride, lo, row_lo.data(), row_hi.data(), rows, v, v_s, table, block_size, acc); break;
  }
  for (int64_t i = 0; i < rows; ++i) {
    T* oi = o + (i / group) * o_ts + (i % group) * o_hs;
    if (row_lo[i] >= row_hi[i]) {  // no key: a padding query
      std::fill_n(oi, d, store<T>(0.f));
      continue;
    }
    for (int64_t j = 0; j < d; ++j) oi[j] = store<T>(acc[i * d + j]);
  }
}

#endif

inline bool chunk_kernel_serves(int64_t d) {
#if defined(__AVX512F__)
  return d == 64 || d == 128 || d == 256;
#else
  return false;
#endif
}

#if defined(__AVX512F__)

// The chunk rows of a prefill call: tasks of (row, block of kChunkQueries consecutive queries, KV head).
template <typename T>
void attend_chunks(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int32_t* tables,
                   int64_t table_stride, const std::vector<std::array<int64_t, 4>>& queries, int64_t block_size,
                   float scale, const float* sinks, at::Tensor& out) {
  const int64_t h = q.size(1), d = q.size(2), kvh = keys.size(0), group = h / kvh;
  std::vector<std::array<int64_t, 2>> blocks;  // [first query, end query) of `queries`, one row's consecutive ones
  int64_t longest = 1;
  for (int64_t i = 0; i < static_cast<int64_t>(queries.size());) {
    int64_t j = i + 1;
    while (j < static_cast<int64_t>(queries.size()) && j - i < kChunkQueries && queries[j][1] == queries[i][1] &&
           queries[j][0] == queries[j - 1][0] + 1)
      ++j;
    blocks.push_back({i, j});
    longest = std::max<int64_t>(longest, queries[j - 1][3] - queries[i][2]);
    i = j;
  }
  const int64_t n = static_cast<int64_t>(blocks.size());
  const T* q_p = q.data_ptr<T>();
  const T* k_p = keys.data_ptr<T>();
  const T* v_p = values.data_ptr<T>();
  T* o_p = out.data_ptr<T>();
  at::parallel_for(0, n * kvh, grain(n * kvh, longest * d * group * kChunkQueries), [&](int64_t begin, int64_t end) {
    static thread_local ChunkScratch scratch;
    std::vector<int64_t> firsts, ends;
    for (int64_t task = begin; task < end; ++task) {
      const auto& block = blocks[task / kvh];
      const int64_t kh = task % kvh, first = queries[block[0]][0], table_row = queries[block[0]][1];
      firsts.clear();
      ends.clear();
      for (int64_t i = block[0]; i < block[1]; ++i) {
        firsts.push_back(queries[i][2]);
        ends.push_back(queries[i][3]);
      }
      attend_chunk<T>(q_p + first * q.stride(0) + kh * group * q.stride(1), q.stride(0), q.stride(1),
                      k_p + kh * keys.stride(0), keys.stride(1), v_p + kh * values.stride(0), values.stride(1),
                      tables + table_row * table_stride, block_size, firsts.data(), ends.data(), block[1] - block[0],
                      group, d, scale, sinks ? sinks + kh * group : nullptr,
                      o_p + first * out.stride(0) + kh * group * out.stride(1), out.stride(0), out.stride(1), scratch);
    }
  });
}
#else
template <typename T>  // never called: chunk_kernel_serves is false without AVX-512
void attend_chunks(const at::Tensor&, const at::Tensor&, const at::Tensor&, const int32_t*, int64_t,
                   const std::vector<std::array<int64_t, 4>>&, int64_t, float, const float*, at::Tensor&) {
  TORCH_CHECK(false, "the chunk attention kernel needs an AVX-512 build");
}
#endif

void check_pool(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, int64_t block_size) {
  check_rows(q, "q");
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && keys.sizes() == values.sizes(),
              "q must be [N, H, D] and keys/values [KVH, slots, D] alike");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && q.scalar_type() == values.scalar_type(),
              "q, keys and values must share a dtype");
  TORCH_CHECK(keys.size(2) == q.size(2) && q.size(1) % keys.size(0) == 0,
              "q's heads must be a multiple of the cache's KV heads of dim ", keys.size(2));
  TORCH_CHECK(q.stride(2) == 1 && keys.stride(2) == 1 && values.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(block_size >= 1 && keys.size(1) % block_size == 0, "the pool is not whole blocks");
}

// Every block a row reads (its first `keys` positions) must be in the pool.
void check_table(const int32_t* table, int64_t width, int64_t keys, int64_t block_size, int64_t pool_blocks,
                 int64_t row) {
  TORCH_CHECK(keys <= width * block_size, "row ", row, " has more keys than its block table holds");
  for (int64_t i = 0; i < (keys + block_size - 1) / block_size; ++i)
    TORCH_CHECK(table[i] >= 0 && table[i] < pool_blocks, "block ", table[i], " is not in the pool");
}

// The attention sinks [H] as float32 (null without), held in `held` while the call runs.
const float* sink_logits(const c10::optional<at::Tensor>& sinks, const at::Tensor& q, at::Tensor& held) {
  if (!sinks.has_value()) return nullptr;
  TORCH_CHECK(sinks->dim() == 1 && sinks->size(0) == q.size(1), "sinks must be [", q.size(1), "], one per query head");
  held = sinks->to(at::kFloat).contiguous();
  return held.data_ptr<float>();
}

// Every query of a decode or prefill call through one kernel: the chunk kernel where it serves, else one at a time.
void attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int32_t* tables,
            int64_t table_stride, const std::vector<std::array<int64_t, 4>>& queries, int64_t block_size, double scale,
            const float* sinks, at::Tensor& out) {
  const bool chunks = chunk_kernel_serves(q.size(2));
  AT_DISPATCH_SWITCH(q.scalar_type(), "emberserve_paged_attention",
    AT_DISPATCH_CASE(at::kFloat, [&] {
      if (chunks) attend_chunks<float>(q, keys, values, tables, table_stride, queries, block_size, scale, sinks, out);
      else attend_queries<float>(q, keys, values, tables, table_stride, queries, block_size, scale, sinks, out);
    })
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      if (chunks)
        attend_chunks<c10::BFloat16>(q, keys, values, tables, table_stride, queries, block_size, scale, sinks, out);
      else
        attend_queries<c10::BFloat16>(q, keys, values, tables, table_stride, queries, block_size, scale, sinks, out);
    }));
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                                  double scale, int64_t window, const c10::optional<at::Tensor>& sinks) {
  check_pool(q, keys, values, block_size);
  at::Tensor held;
  const float* sink_p = sink_logits(sinks, q, held);
  const int64_t b = q.size(0);
  at::Tensor tables = block_tables.to(at::kInt).contiguous();
  at::Tensor lens = seq_lens.to(at::kInt).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == b && lens.numel() == b, "one block table and length per row");
  const int32_t* lp = lens.data_ptr<int32_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t width = tables.size(1), pool_blocks = keys.size(1) / block_size;
  std::vector<std::array<int64_t, 4>> queries(b);
  for (int64_t r = 0; r < b; ++r) {
    check_table(tp + r * width, width, lp[r], block_size, pool_blocks, r);
    const int64_t len = std::max<int64_t>(0, lp[r]);
    queries[r] = {r, r, window > 0 ? std::max<int64_t>(0, len - window) : 0, len};
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  attend(q, keys, values, tp, width, queries, block_size, scale, sink_p, out);
  return out;
}

// Chunks of several rows packed as q [T, H, D]: row r's queries are q[query_starts[r] : + query_lens[r]] at
// positions seq_lens[r] - query_lens[r] ... seq_lens[r] - 1, each seeing its row's keys up to its own position
// (the chunk's own keys already written), the last `window` of them with a window. Tokens of q no row claims
// are left as they are in `out`. The CPU form of engine/kernels/paged_attention.py's paged_prefill_attention.
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                                   const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                   const at::Tensor& query_lens, const at::Tensor& query_starts, int64_t block_size,
                                   double scale, int64_t window, at::Tensor out,
                                   const c10::optional<at::Tensor>& sinks) {
  check_pool(q, keys, values, block_size);
  at::Tensor held;
  const float* sink_p = sink_logits(sinks, q, held);
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.stride(2) == 1,
              "out must be like q");
  at::Tensor tables = block_tables.to(at::kInt).contiguous();
  at::Tensor lens = seq_lens.to(at::kInt).contiguous(), qlens = query_lens.to(at::kInt).contiguous();
  at::Tensor starts = query_starts.to(at::kInt).contiguous();
  const int64_t rows = tables.size(0);
  TORCH_CHECK(tables.dim() == 2 && lens.numel() == rows && qlens.numel() == rows && starts.numel() == rows,
              "one block table, length, query count and query start per row");
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t width = tables.size(1), pool_blocks = keys.size(1) / block_size;
  std::vector<std::array<int64_t, 4>> queries;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lens.data_ptr<int32_t>()[r], n = qlens.data_ptr<int32_t>()[r];
    const int64_t start = starts.data_ptr<int32_t>()[r];
    TORCH_CHECK(n >= 0 && n <= len && start >= 0 && start + n <= q.size(0), "row ", r, "'s queries do not fit");
    check_table(tp + r * width, width, len, block_size, pool_blocks, r);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t end = len - n + t + 1;  // keys 0 .. the query's own position
      queries.push_back({start + t, r, window > 0 ? std::max<int64_t>(0, end - window) : 0, end});
    }
  }
  attend(q, keys, values, tp, width, queries, block_size, scale, sink_p, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(emberserve, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("norm_add_rms_norm(Tensor branch, Tensor residual, Tensor branch_weight, Tensor weight, float eps) "
        "-> (Tensor, Tensor)");
  m.def("rope_write_kv(Tensor qk, Tensor v, Tensor cos, Tensor sin, Tensor(a!) keys, Tensor(b!) values, "
        "Tensor slots, Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, Tensor(c!)? k_out) -> Tensor");
  m.def("gated_activation(Tensor gate_up, bool gelu) -> Tensor");
  m.def("paged_decode_attention(Tensor q, Tensor keys, Tensor values, Tensor block_tables, Tensor seq_lens, "
        "int block_size, float scale, int window, Tensor? sinks=None) -> Tensor");
  m.def("paged_prefill_attention(Tensor q, Tensor keys, Tensor values, Tensor block_tables, Tensor seq_lens, "
        "Tensor query_lens, Tensor query_starts, int block_size, float scale, int window, Tensor(a!) out, "
        "Tensor? sinks=None) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(emberserve, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("norm_add_rms_norm", &norm_add_rms_norm);
  m.impl("rope_write_kv", &rope_write_kv);
  m.impl("gated_activation", &gated_activation);
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
