// kivi_codec_decode.cuh — the codec pipeline's decode steps (DESIGN.md §8),
// pasted after kivi_decode.cuh into the sources of schemes that have a
// pipeline. The decode kernel never undoes a transform per cached token:
//
//   keys    q . k^ = (T q) . y^ + q . m, T = H D (sign flip, then the
//           blockwise normalised Hadamard), y^ the decoded codes plus the
//           outliers' corrections, m the centering means: the query is
//           rotated once per block (codec_query), `q . m` added per row;
//   values  sum_t p_t (T^-1 y^_t + m) = T^-1 (sum_t p_t y^_t) + (sum_t p_t) m
//           over the quantized tokens: they are summed in the codes' domain
//           and brought back once per split (codec_value_split).

namespace kivi {

// In-place normalised Walsh–Hadamard transform of every block of B
// consecutive values of the N floats at `x` (shared memory), by the whole
// block of threads; the caller synchronizes before (x is written) and this
// returns synchronized. f32: the decode side only needs it to tolerance.
template <int B, int N, int THREADS>
__device__ __forceinline__ void fwht_shared(float* x, int tid) {
  static_assert(N % B == 0 && (B & (B - 1)) == 0, "Hadamard blocks: a power of two dividing the rows");
  for (int len = 1; len < B; len <<= 1) {
    for (int e = tid; e < N / 2; e += THREADS) {
      const int blk = e / (B / 2), i = e % (B / 2);
      const int lo = blk * B + (i / len) * 2 * len + i % len;
      const float a = x[lo], b = x[lo + len];
      x[lo] = a + b;
      x[lo + len] = a - b;
    }
    __syncthreads();
  }
  const float norm = 1.0f / sqrtf((float)B);
  for (int e = tid; e < N; e += THREADS) x[e] *= norm;
  __syncthreads();
}

// The query of this block's heads into shared memory `s_q` ([2][H][D]):
// [0] raw, [1] in the key codes' domain (sign-flipped and Hadamard-rotated
// when the key is), both scaled by `qscale`; and, for centered keys, every
// thread's `qm[h]` = q . m (raw query, this sequence's key means).
template <class C, int H>
__device__ void codec_query(const typename C::act_t* __restrict__ q, const typename C::act_t* __restrict__ means_k,
                            float qscale, float* s_q, float (&qm)[H], int b, int hq0, int hk, int tid) {
  typedef typename C::K K;
  for (int e = tid; e < H * C::D; e += C::THREADS) {
    const int d = e % C::D;
    const float x = Act<C::ACT>::load(q[((u64)b * C::HQ + hq0) * C::D + e]) * qscale;
    s_q[e] = x;
    float y = x;
    if constexpr (K::ROT && K::SIGNS) {
      if (flip<K>(d)) y = -y;
    }
    s_q[H * C::D + e] = y;
  }
  __syncthreads();
  if constexpr (K::CENTER) {
    // every thread, from shared memory: no thread waits for another's sum
    const typename C::act_t* m = means_k + ((u64)b * C::HKV + hk) * C::D;
#pragma unroll
    for (int h = 0; h < H; ++h) {
      float dot = 0.0f;
      for (int d = 0; d < C::D; ++d) dot = fmaf(s_q[h * C::D + d], Act<C::ACT>::load(m[d]), dot);
      qm[h] = dot;
    }
  }
  if constexpr (K::ROT) fwht_shared<K::ROT_BLOCK, H * C::D, C::THREADS>(s_q + H * C::D, tid);
}

// The quantized value tokens' accumulators `accq` (codes' domain) of every
// team summed into `s_rot` ([H][D]), then brought back to the raw domain:
// un-rotated (the Hadamard, then the sign flip) and `s_lq[h] * m` added
// (the split's probability mass on quantized tokens times the means).
// `s_w` ([warps][H][D]) is free again when this returns.
template <class C, int H, int CH>
__device__ void codec_value_split(const float (&accq)[H][CH], float* s_w, float* s_rot, const float* s_lq,
                                  const typename C::act_t* __restrict__ means_v, int b, int hk, int warp, int lane,
                                  int vl, int tid) {
  typedef typename C::V V;
  constexpr int NWARPS = C::THREADS / 32;
  teams_to_warp<C, H, CH>(accq, s_w + warp * H * C::D, lane, vl);
  __syncthreads();
  for (int e = tid; e < H * C::D; e += C::THREADS) {
    float x = 0.0f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) x += s_w[w * H * C::D + e];
    s_rot[e] = x;
  }
  __syncthreads();  // s_w is overwritten by the caller's own sum, s_rot read across threads
  if constexpr (V::ROT) fwht_shared<V::ROT_BLOCK, H * C::D, C::THREADS>(s_rot, tid);
  const typename C::act_t* m = means_v + ((u64)b * C::HKV + hk) * C::D;
  // the same element-to-thread map as fwht_shared's last loop; the caller
  // reads s_rot only after its own barriers
  for (int e = tid; e < H * C::D; e += C::THREADS) {
    const int h = e / C::D, d = e % C::D;
    float x = s_rot[e];
    if constexpr (V::ROT && V::SIGNS) {
      if (flip<V>(d)) x = -x;
    }
    if constexpr (V::CENTER) x = fmaf(s_lq[h], Act<C::ACT>::load(m[d]), x);
    s_rot[e] = x;
  }
}

}  // namespace kivi
