// DeepSeek-V4's small per-token model ops in float32, outside attention: the hyper-connection mixes (mHC pre,
// post, head), the query's weight-free RMSNorm + GPT-J RoPE, the window row's RoPE + FP8 quantisation + store
// into FlashMLA's V4 cache layout, and the RoPE undone on the attention output.  vLLM's CPU V4 model calls
// kernels for these that take bf16 only; dsattn's vLLM plug-in computes them for float32 models
// (dsattn/integrations/vllm/v4_fp32.py holds the same math in PyTorch, the reference these are tested
// against).  In PyTorch each is a few dozen tensor ops on a decode step's one token (mHC's Sinkhorn
// normalisation alone is 80), so a served decode step spent more time dispatching them than computing; here
// each is one call, the token loop parallel.  Only mHC's mixes of many tokens are a real GEMM: at::mm.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

constexpr float kHcPostMult = 2.0f;       // vLLM's CPU kernel fixes the mHC post-mix multiplier at 2
constexpr float kFp8Max = 448.0f;
constexpr float kScaleFloor = 1e-4f;      // FlashMLA's tile-scale floor (amax / 448 below it: this scale)
constexpr float kE4m3MinNormal = 0.015625f;

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

void check_f32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, name, ": expected float32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == dim, name, ": expected ", dim, " dimensions, got ", t.sizes());
  TORCH_CHECK_TYPE(t.device().is_cpu(), name, ": expected a CPU tensor");
}

float inv_rms(const float* x, int64_t n, float eps) {
  double s = 0.0;                          // a double sum: the mean of n squares without order effects
  for (int64_t i = 0; i < n; ++i) s += double(x[i]) * double(x[i]);
  return 1.0f / std::sqrt(float(s / double(n)) + eps);
}

// GPT-J (interleaved pairs) rotation of the last 2·half values of x by cos / sin (the position's row of the
// [cos | sin] table), backwards where inverse.
inline void rotate_pairs(float* x, const float* cs, int64_t half, bool inverse) {
  const float sign = inverse ? -1.0f : 1.0f;
  for (int64_t k = 0; k < half; ++k) {
    const float c = cs[k], s = sign * cs[half + k];
    const float a = x[2 * k], b = x[2 * k + 1];
    x[2 * k] = a * c - b * s;
    x[2 * k + 1] = b * c + a * s;
  }
}

const float* table_row(const at::Tensor& cos_sin, const int64_t* pos, int64_t t) {
  const int64_t p = pos[t];
  TORCH_CHECK_VALUE(p >= 0 && p < cos_sin.size(0), "positions: ", p, " outside the RoPE table's ", cos_sin.size(0),
              " positions");
  return cos_sin.data_ptr<float>() + p * cos_sin.size(1);
}

}  // namespace

// mHC pre: streams x [T, hc, D] -> (layer input [T, D], post [T, hc], comb [T, hc, hc]).  mixes = (flat ·
// fn^T) · rsqrt(mean(flat^2) + rms_eps) with flat = x[t] flattened; pre = sigmoid(mix·s0 + b) + hc_eps; post =
// 2·sigmoid(mix·s1 + b); comb = Sinkhorn(softmax_j(mix·s2 + b)) with sinkhorn_repeat normalisations.
std::vector<at::Tensor> v4_hc_pre(const at::Tensor& x, const at::Tensor& fn, const at::Tensor& hc_scale,
                                  const at::Tensor& hc_base, int64_t hc, int64_t sinkhorn_repeat, double rms_eps,
                                  double hc_eps) {
  check_f32(x, "x", 3);
  TORCH_CHECK_VALUE(x.size(1) == hc, "x: expected ", hc, " streams, got ", x.sizes());
  const int64_t T = x.size(0), D = x.size(2), M = (2 + hc) * hc;
  TORCH_CHECK_VALUE(fn.dim() == 2 && fn.size(0) == M && fn.size(1) == hc * D, "fn: expected [", M, ", ", hc * D,
              "], got ", fn.sizes());
  TORCH_CHECK_VALUE(hc_scale.numel() == 3 && hc_base.numel() == M, "hc_scale / hc_base: expected 3 / ", M,
              " values, got ", hc_scale.numel(), " / ", hc_base.numel());
  const at::Tensor xc = x.contiguous();
  const at::Tensor mixes = at::mm(xc.view({T, hc * D}), fn.to(at::kFloat).t());     // [T, M]
  const at::Tensor sc = hc_scale.to(at::kFloat).contiguous(), bs = hc_base.to(at::kFloat).contiguous();
  at::Tensor layer_input = at::empty({T, D}, x.options()), post = at::empty({T, hc}, x.options()),
             comb = at::empty({T, hc, hc}, x.options());
  const float *X = xc.data_ptr<float>(), *MX = mixes.data_ptr<float>(), *S = sc.data_ptr<float>(),
              *B = bs.data_ptr<float>();
  float *LI = layer_input.data_ptr<float>(), *P = post.data_ptr<float>(), *C = comb.data_ptr<float>();
  const float eps = float(hc_eps);
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> pre(hc);
    for (int64_t t = t0; t < t1; ++t) {
      const float* xt = X + t * hc * D;
      const float r = inv_rms(xt, hc * D, float(rms_eps));
      const float* m = MX + t * M;
      for (int64_t i = 0; i < hc; ++i) {
        pre[i] = sigmoid(m[i] * r * S[0] + B[i]) + eps;
        P[t * hc + i] = sigmoid(m[hc + i] * r * S[1] + B[hc + i]) * kHcPostMult;
      }
      float* c = C + t * hc * hc;
      for (int64_t i = 0; i < hc; ++i) {                 // softmax over j of each row i
        float mx = -INFINITY;
        for (int64_t j = 0; j < hc; ++j) {
          c[i * hc + j] = m[2 * hc + i * hc + j] * r * S[2] + B[2 * hc + i * hc + j];
          mx = std::max(mx, c[i * hc + j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < hc; ++j) sum += (c[i * hc + j] = std::exp(c[i * hc + j] - mx));
        for (int64_t j = 0; j < hc; ++j) c[i * hc + j] = c[i * hc + j] / sum + eps;
      }
      auto normalise_columns = [&] {
        for (int64_t j = 0; j < hc; ++j) {
          float sum = 0.0f;
          for (int64_t i = 0; i < hc; ++i) sum += c[i * hc + j];
          for (int64_t i = 0; i < hc; ++i) c[i * hc + j] /= sum + eps;
        }
      };
      normalise_columns();
      for (int64_t it = 1; it < sinkhorn_repeat; ++it) {
        for (int64_t i = 0; i < hc; ++i) {
          float sum = 0.0f;
          for (int64_t j = 0; j < hc; ++j) sum += c[i * hc + j];
          for (int64_t j = 0; j < hc; ++j) c[i * hc + j] /= sum + eps;
        }
        normalise_columns();
      }
      float* li = LI + t * D;
      for (int64_t d = 0; d < D; ++d) li[d] = pre[0] * xt[d];
      for (int64_t i = 1; i < hc; ++i)
        for (int64_t d = 0; d < D; ++d) li[d] += pre[i] * xt[i * D + d];
    }
  });
  return {layer_input, post, comb};
}

// mHC post: out[t, j] = sum_i comb[t, i, j] residual[t, i] + post[t, j] x[t]   ([T, hc, D]).
at::Tensor v4_hc_post(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& post,
                      const at::Tensor& comb) {
  check_f32(x, "x", 2);
  check_f32(residual, "residual", 3);
  const int64_t T = residual.size(0), hc = residual.size(1), D = residual.size(2);
  TORCH_CHECK_VALUE(x.size(0) == T && x.size(1) == D, "x: expected [", T, ", ", D, "], got ", x.sizes());
  TORCH_CHECK_VALUE(post.numel() == T * hc && comb.numel() == T * hc * hc, "post / comb: expected [", T, ", ", hc,
              "] / [", T, ", ", hc, ", ", hc, "]");
  const at::Tensor xc = x.contiguous(), rc = residual.contiguous(), pc = post.to(at::kFloat).contiguous(),
                   cc = comb.to(at::kFloat).contiguous();
  at::Tensor out = at::empty({T, hc, D}, residual.options());
  const float *X = xc.data_ptr<float>(), *R = rc.data_ptr<float>(), *P = pc.data_ptr<float>(),
              *C = cc.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, T * hc, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t t = row / hc, j = row % hc;
      const float* c = C + t * hc * hc;
      const float* res = R + t * hc * D;
      const float p = P[t * hc + j];
      float* o = O + row * D;
      for (int64_t d = 0; d < D; ++d) o[d] = c[j] * res[d];
      for (int64_t i = 1; i < hc; ++i) {
        const float w = c[i * hc + j];
        for (int64_t d = 0; d < D; ++d) o[d] += w * res[i * D + d];
      }
      const float* xt = X + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] += p * xt[d];
    }
  });
  return out;
}

// mHC head: the final collapse of the streams [T, hc, D] -> [T, D]: mixes = (flat · rsqrt(mean(flat^2) +
// norm_eps)) · hc_fn^T, pre = sigmoid(mix·scale + base) + hc_eps, out = sum_i pre_i x_i.
at::Tensor v4_hc_head(const at::Tensor& x, const at::Tensor& hc_fn, const at::Tensor& hc_scale,
                      const at::Tensor& hc_base, double hc_eps, double norm_eps) {
  check_f32(x, "x", 3);
  const int64_t T = x.size(0), hc = x.size(1), D = x.size(2);
  TORCH_CHECK_VALUE(hc_fn.dim() == 2 && hc_fn.size(0) == hc && hc_fn.size(1) == hc * D, "hc_fn: expected [", hc, ", ",
              hc * D, "], got ", hc_fn.sizes());
  TORCH_CHECK_VALUE(hc_base.numel() == hc && hc_scale.numel() >= 1, "hc_scale / hc_base: expected 1 / ", hc, " values");
  const at::Tensor xc = x.contiguous();
  const at::Tensor mixes = at::mm(xc.view({T, hc * D}), hc_fn.to(at::kFloat).t());  // [T, hc]
  const at::Tensor bs = hc_base.to(at::kFloat).contiguous();
  const at::Tensor sc = hc_scale.to(at::kFloat).contiguous();
  const float scale = sc.data_ptr<float>()[0];
  at::Tensor out = at::empty({T, D}, x.options());
  const float *X = xc.data_ptr<float>(), *MX = mixes.data_ptr<float>(), *B = bs.data_ptr<float>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> pre(hc);
    for (int64_t t = t0; t < t1; ++t) {
      const float* xt = X + t * hc * D;
      const float r = inv_rms(xt, hc * D, float(norm_eps));
      for (int64_t i = 0; i < hc; ++i) pre[i] = sigmoid(MX[t * hc + i] * r * scale + B[i]) + float(hc_eps);
      float* o = O + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] = pre[0] * xt[d];
      for (int64_t i = 1; i < hc; ++i)
        for (int64_t d = 0; d < D; ++d) o[d] += pre[i] * xt[i * D + d];
    }
  });
  return out;
}

// GPT-J RoPE of the last cos_sin.size(1) values of every row of x [T, ..., D] (a new tensor), backwards where
// inverse: the attention output's RoPE undone before the output projection.
at::Tensor v4_gptj_rope(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin, bool inverse) {
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat && x.dim() >= 2, "x: expected float32 [T, ..., D], got ",
              x.scalar_type(), " ", x.sizes());
  check_f32(cos_sin, "cos_sin_cache", 2);
  const int64_t T = x.size(0), D = x.size(-1), R = cos_sin.size(1), rows = T ? x.numel() / D / T : 0;
  TORCH_CHECK_VALUE(R % 2 == 0 && R <= D, "cos_sin_cache: ", R, " RoPE dims for rows of ", D);
  TORCH_CHECK_VALUE(positions.scalar_type() == at::kLong && positions.numel() >= T, "positions: expected int64 [>= ",
              T, "]");
  at::Tensor out = x.contiguous().clone();
  const at::Tensor pos = positions.contiguous(), cs = cos_sin.contiguous();
  const int64_t* P = pos.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = table_row(cs, P, t);
      for (int64_t h = 0; h < rows; ++h) rotate_pairs(O + (t * rows + h) * D + D - R, c, R / 2, inverse);
    }
  });
  return out;
}

// The query's per-head weight-free RMSNorm and RoPE, padded to q_head_padded heads with zeros; the window KV
// rows kv[:n] (n = slots.numel()) rotated, rounded to bf16 and stored at their slots of a V4 cache
// cache_2d [num_blocks, page bytes] in FlashMLA's layout: per block, block_size rows of 448 e4m3 codes + 64 bf16
// RoPE values, then their 8 scale bytes (7 UE8M0 tile scales of 64 values, one zero).  A tile's scale is
// 2^ceil(log2(max(amax / 448, 1e-4))); a scaled value below e4m3's smallest normal is flushed to a signed zero
// where flush_subnormals (vLLM's CPU window insert).  Slot -1: not stored.
at::Tensor v4_qnorm_rope_kv_insert(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& positions,
                                   at::Tensor cache_2d, const at::Tensor& slots, const at::Tensor& cos_sin,
                                   int64_t q_head_padded, double eps, int64_t block_size, bool flush_subnormals) {
  check_f32(q, "q", 3);
  check_f32(kv, "kv", 2);
  check_f32(cos_sin, "cos_sin_cache", 2);
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), R = cos_sin.size(1), n = slots.numel();
  constexpr int64_t kNope = 448, kTile = 64, kRowBody = 576, kScaleBytes = 8;
  TORCH_CHECK_VALUE(D == 512 && kv.size(1) == 512 && R == 64,
                    "q / kv / cos_sin_cache: expected V4's 512-wide rows with 64 RoPE dims, got q ", q.sizes(),
                    ", kv ", kv.sizes(), ", cos_sin_cache ", cos_sin.sizes());
  TORCH_CHECK_VALUE(q_head_padded >= H, "q_head_padded: ", q_head_padded, " is below the ", H, " heads");
  TORCH_CHECK_VALUE(kv.size(0) >= n && positions.numel() >= std::max(T, n) && positions.scalar_type() == at::kLong,
              "kv / positions: expected >= ", n, " rows and int64 positions for every token");
  TORCH_CHECK_TYPE(slots.scalar_type() == at::kLong, "slot_mapping: expected int64");
  TORCH_CHECK_VALUE(cache_2d.dim() == 2 && cache_2d.element_size() == 1 && cache_2d.stride(1) == 1 &&
                  cache_2d.size(1) >= block_size * (kRowBody + kScaleBytes),
              "cache: expected [num_blocks, >= ", block_size * (kRowBody + kScaleBytes), " bytes] of one-byte "
              "elements, got ", cache_2d.sizes(), " ", cache_2d.scalar_type());
  at::Tensor out = at::empty({T, q_head_padded, D}, q.options());
  if (q_head_padded > H) out.narrow(1, H, q_head_padded - H).zero_();
  const at::Tensor qc = q.contiguous(), kc = kv.contiguous(), pos = positions.contiguous(),
                   sl = slots.contiguous(), cs = cos_sin.contiguous();
  const float *Q = qc.data_ptr<float>(), *K = kc.data_ptr<float>();
  const int64_t *P = pos.data_ptr<int64_t>(), *SL = sl.data_ptr<int64_t>();
  float* O = out.data_ptr<float>();
  const float e = float(eps);
  at::parallel_for(0, T * H, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t row = r0; row < r1; ++row) {
      const int64_t t = row / H, h = row % H;
      const float* x = Q + row * D;
      float* o = O + (t * q_head_padded + h) * D;
      const float r = inv_rms(x, D, e);
      for (int64_t d = 0; d < D; ++d) o[d] = x[d] * r;
      rotate_pairs(o + D - R, table_row(cs, P, t), R / 2, false);
    }
  });
  uint8_t* base = static_cast<uint8_t*>(cache_2d.data_ptr());
  const int64_t page = cache_2d.stride(0), num_blocks = cache_2d.size(0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = SL[i];
    TORCH_CHECK_VALUE(s < num_blocks * block_size, "slot_mapping: slot ", s, " outside the cache's ",
                num_blocks * block_size, " rows");
  }
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    float row[512];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = SL[i];
      if (s < 0) continue;
      for (int64_t d = 0; d < 512; ++d) row[d] = K[i * 512 + d];
      rotate_pairs(row + 512 - R, table_row(cs, P, i), R / 2, false);
      for (int64_t d = 0; d < 512; ++d) row[d] = float(c10::BFloat16(row[d]));    // the row is bf16 first
      uint8_t* block = base + (s / block_size) * page;
      uint8_t* body = block + (s % block_size) * kRowBody;
      uint8_t* scale_bytes = block + block_size * kRowBody + (s % block_size) * kScaleBytes;
      for (int64_t tile = 0; tile < kNope / kTile; ++tile) {
        const float* v = row + tile * kTile;
        float amax = 0.0f;
        for (int64_t d = 0; d < kTile; ++d) amax = std::max(amax, std::fabs(v[d]));
        const float exponent = std::ceil(std::log2(std::max(amax / kFp8Max, kScaleFloor)));
        const float scale = std::exp2(exponent);
        for (int64_t d = 0; d < kTile; ++d) {
          float y = v[d] / scale;
          if (flush_subnormals && std::fabs(y) < kE4m3MinNormal) y = y * 0.0f;
          y = std::min(std::max(y, -kFp8Max), kFp8Max);
          body[tile * kTile + d] = c10::Float8_e4m3fn(y).x;
        }
        scale_bytes[tile] = static_cast<uint8_t>(int(exponent) + 127);
      }
      scale_bytes[kScaleBytes - 1] = 0;
      for (int64_t d = 0; d < R; ++d) {
        const uint16_t bits = c10::BFloat16(row[kNope + d]).x;
        std::memcpy(body + kNope + 2 * d, &bits, 2);
      }
    }
  });
  return out;
}
