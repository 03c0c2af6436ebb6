// kivi_mla_decode.cuh — absorbed MLA decode attention (heads: mla(...)),
// after kivi_common.cuh. See kivi_spec::mla and docs/semantics.md, "MLA
// caches":
//
//   score_ht = (q_latent_h . c^_t + q_rope_h . k^rope_t) * scale
//   out_h    = sum_t softmax_t(score_h) c^_t          (latent-wide)
//
// One thread block per sequence serves all HQ query heads from one pass
// over the shared latent and RoPE rows (MQA with a score width of L + R and
// an output width of L): a tile of TILE tokens is decoded into shared
// memory, each warp scores (head, token) pairs with a warp reduction, one
// thread per head runs the online softmax, and every thread accumulates
// its channels of the output for every head in registers.
//
// `Cfg` (generated) holds the activation type, HQ, L, R, the block
// geometry and the launch shape; `Cfg::Lat` and `Cfg::Rope` the codec and
// word offsets of each part (kivi_spec::MlaLayout).

namespace kivi {

// Row `p`, channel `c` of part T of sequence `b`: a sink or window row from
// `raw` (per sequence: the part's sink rows, then its window rows, `raw_cap`
// rows in all) or a stored row decoded from its block, `c * s + z` with two
// roundings like kivi_runtime::quant::decode.
template <class C, class T>
__device__ __forceinline__ float mla_load(const u32* __restrict__ pool, const u32* __restrict__ table,
                                          const typename C::act_t* __restrict__ raw, int raw_cap, int b,
                                          int p, int sinks, int stored, int c) {
  if (p < sinks) {
    return Act<C::ACT>::load(raw[((u64)b * raw_cap + p) * T::D + c]);
  }
  const int j = p - sinks;
  if (j >= stored) {
    return Act<C::ACT>::load(raw[((u64)b * raw_cap + sinks + (j - stored)) * T::D + c]);
  }
  const u32* part = pool + (u64)table[j / C::BLOCK_TOKENS] * C::BLOCK_WORDS + T::PART;
  const int off = j % C::BLOCK_TOKENS;
  const u32* row = part + off * T::WPT;
  if constexpr (!T::QUANT) {
    return raw_word_value<C>(row, c);
  } else {
    const u32 code = (row[c / T::CPW] >> ((c % T::CPW) * T::BITS)) & ((1u << T::BITS) - 1u);
    const int i = T::TOKEN_AXIS ? off * (T::D / T::GROUP) + c / T::GROUP : (off / T::GROUP) * T::D + c;
    const float s = load_param<T>(part + T::SCALES, i);
    const float z = load_param<T>(part + T::ZEROS, i);
    return __fadd_rn(__fmul_rn((float)code, s), z);
  }
}

__device__ __forceinline__ float mla_warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(KIVI_FULL_MASK, x, o);
  return x;
}

// counts[b * 4 + ...]: latent sinks, latent stored, rope sinks, rope stored.
template <class C>
__device__ __forceinline__ void mla_decode_kernel(const u32* __restrict__ pool, const u32* __restrict__ tables,
                                                  int table_stride, const typename C::act_t* __restrict__ lat_raw,
                                                  const typename C::act_t* __restrict__ rope_raw, int raw_cap,
                                                  const int* __restrict__ lens, const int* __restrict__ counts,
                                                  const float* __restrict__ q, float scale, int window,
                                                  float* __restrict__ out) {
  typedef typename C::Lat LatT;
  typedef typename C::Rope RopeT;
  constexpr int L = C::L, R = C::R, HQ = C::HQ, W = L + R, TILE = C::TILE, NT = C::THREADS;
  constexpr int NW = NT / 32;
  constexpr int CPT = (L + NT - 1) / NT;  // output channels per thread
  KIVI_SHARED(float, s_c, [TILE * L]);
  KIVI_SHARED(float, s_k, [TILE * R]);
  KIVI_SHARED(float, s_p, [HQ * TILE]);
  KIVI_SHARED(float, s_m, [HQ]);
  KIVI_SHARED(float, s_l, [HQ]);
  KIVI_SHARED(float, s_a, [HQ]);
  const int b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int tokens = lens[b];
  const int start = window >= 0 ? max(tokens - window, 0) : 0;  // window < 0: none
  const u32* table = tables + (u64)b * table_stride;
  const int lat_sinks = counts[b * 4 + 0], lat_stored = counts[b * 4 + 1];
  const int rope_sinks = counts[b * 4 + 2], rope_stored = counts[b * 4 + 3];
  const float* qb = q + (u64)b * HQ * W;
  for (int h = tid; h < HQ; h += NT) {
    s_m[h] = neg_inf();
    s_l[h] = 0.0f;
  }
  float acc[HQ][CPT];
#pragma unroll
  for (int h = 0; h < HQ; ++h)
#pragma unroll
    for (int k = 0; k < CPT; ++k) acc[h][k] = 0.0f;

  for (int t0 = start; t0 < tokens; t0 += TILE) {
    const int n = min(TILE, tokens - t0);
    __syncthreads();  // the previous tile's rows and weights are consumed
    for (int e = tid; e < n * L; e += NT) {
      s_c[e] = mla_load<C, LatT>(pool, table, lat_raw, raw_cap, b, t0 + e / L, lat_sinks, lat_stored, e % L);
    }
    for (int e = tid; e < n * R; e += NT) {
      s_k[e] = mla_load<C, RopeT>(pool, table, rope_raw, raw_cap, b, t0 + e / R, rope_sinks, rope_stored, e % R);
    }
    __syncthreads();
    // Scores: one warp per (head, token) pair.
    for (int pi = warp; pi < HQ * TILE; pi += NW) {
      const int h = pi / TILE, i = pi % TILE;
      float d = 0.0f;
      if (i < n) {
        for (int c = lane; c < L; c += 32) d += qb[h * W + c] * s_c[i * L + c];
        for (int c = lane; c < R; c += 32) d += qb[h * W + L + c] * s_k[i * R + c];
      }
      d = mla_warp_sum(d);
      if (lane == 0) s_p[pi] = i < n ? d * scale : neg_inf();
    }
    __syncthreads();
    // Online softmax, one thread per head: weights in place, rescale factor.
    for (int h = tid; h < HQ; h += NT) {
      const float m_old = s_m[h];
      float mx = m_old;
      for (int i = 0; i < n; ++i) mx = fmaxf(mx, s_p[h * TILE + i]);
      const float a = expf(m_old - mx);  // 0 on the first tile (m_old = -inf)
      float sum = 0.0f;
      for (int i = 0; i < n; ++i) {
        const float w = expf(s_p[h * TILE + i] - mx);
        s_p[h * TILE + i] = w;
        sum += w;
      }
      s_l[h] = s_l[h] * a + sum;
      s_m[h] = mx;
      s_a[h] = a;
    }
    __syncthreads();
#pragma unroll
    for (int h = 0; h < HQ; ++h) {
      const float a = s_a[h];
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const int c = tid + k * NT;
        if (c < L) {
          float v = acc[h][k] * a;
          for (int i = 0; i < n; ++i) v += s_p[h * TILE + i] * s_c[i * L + c];
          acc[h][k] = v;
        }
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int h = 0; h < HQ; ++h) {
    const float l = s_l[h];
#pragma unroll
    for (int k = 0; k < CPT; ++k) {
      const int c = tid + k * NT;
      if (c < L) out[((u64)b * HQ + h) * L + c] = l > 0.0f ? acc[h][k] / l : 0.0f;
    }
  }
}

}  // namespace kivi
