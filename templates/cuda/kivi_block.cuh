// kivi_block.cuh — attention for a causal block of new queries over the
// quantized cache (chunked prefill, speculative verification), with the
// meaning of docs/semantics.md "Many new queries": query i of a block sees
// what appending the block's tokens up to its own and decoding would show
// it.
//
// The host appends the block first (the prefill/append kernels), so the
// cache holds every stored (sink or quantized) token any query of the block
// reads. What the append quantized away and some queries still read at full
// precision — the window rows before the block and the block's own rows,
// rounded to the activation dtype — the host keeps in a *tail* buffer per
// tensor: tail[b][p - first][Hkv][D], first = stored_tokens(past). Query i
// (its token at position past + i) reads, per tensor, tokens below
// stored_tokens(past + i + 1) from the cache and the rest from the tail,
// within its causal range and sliding window.
//
// One block = (tile of Cfg::QT queries, chunk of Cfg::HB query heads of one
// KV head, sequence): the QT * HB query rows share each tile of Cfg::KT
// tokens, decoded once into shared memory as f32 — the quantized prefix is
// read once per query tile, not once per query. A tile holds the stored form
// of tokens below the highest boundary of the block's queries and the tail
// form above it; the few tokens that a query needs at full precision while
// the tile holds them stored (flushed during the block) are read from the
// tail in global memory.
//
// Per tile: 1. rows (dequantized keys and values into shared memory),
// 2. scores (one dot product per (row, token) pair, masked outside each
// query's range), 3. online softmax (one warp per query row, base 2: the
// query is pre-scaled by sm_scale * log2 e as in kivi_decode.cuh),
// 4. values (each thread owns fixed (row, channel) accumulators).
//
// Codec pipelines: a stored row is brought to the raw domain in the tile as
// the cache's view does it — Lloyd–Max levels and outlier corrections in
// the codes' domain, then the inverse rotation, then the centering mean.
// Undoing a rotation per row, not once per query, is cheap here: every row
// serves all the block's query rows.

namespace kivi {

// kivi_runtime::reference::stored_tokens: sinks + quantized tokens of a
// sequence `tokens` long (never more than `tokens`).
template <class C, class T> __device__ __forceinline__ int stored_tokens(int tokens) {
  return min(tokens, C::SINKS) + quantized_tokens<C, T>(tokens);
}

// Code `i` of a word of tensor T (kivi_decode.cuh's code_at, which this
// file does not include).
template <class T> __device__ __forceinline__ u32 code_at_block(u32 word, int i) {
  return (word >> (i * T::BITS)) & ((1u << T::BITS) - 1u);
}

// Channel `d` of a stored row (a sink row, or a row in a block) as f32.
template <class C, class T> __device__ __forceinline__ float stored_value(const RowRef<C>& r, int d) {
  if (r.part == nullptr) return Act<C::ACT>::load(r.raw[d]);
  const u32* row = r.part + r.off * T::WPT;
  if constexpr (!T::QUANT) {
    return raw_word_value<C>(row, d);
  } else {
    const u32 c = code_at_block<T>(row[d / T::CPW], d % T::CPW);
    const int pi = param_index<C, T>(r.off, d);
    float z = 0.0f;
    if constexpr (HasZero<T>::value) z = load_param<T>(r.part + T::ZEROS, pi);
    return dequant<T>(c, load_param<T>(r.part + T::SCALES, pi), z);
  }
}

// Adds the sparse outlier corrections of a stored row to its decoded
// channels (one thread per row: a row's outliers may share a channel).
template <class C, class T> __device__ __forceinline__ void add_outliers(const RowRef<C>& r, float* row) {
  if constexpr (T::OUTL > 0) {
    if (r.part != nullptr) {
      for (int o = 0; o < T::OUTL; ++o) {
        const int ch = outlier_channel<C, T>(r.part, r.off, o);
        row[ch] += outlier_value<C, T>(r.part, r.off, o);
      }
    }
  }
}

// Undoes the rotation of the tile's stored rows that sit in blocks (tokens
// t0 + r with SINKS <= t0 + r < hi; sink and tail rows are raw): the
// blockwise normalised Walsh–Hadamard transform, then the seeded sign flip
// (kivi_runtime::quant::unrotate; f32 butterflies here, f64 there).
template <class C, class T>
__device__ __forceinline__ void unrotate_tile(float* tile, int t0, int nt, int hi, int tid) {
  constexpr int B = T::ROT_BLOCK;
  constexpr int D = C::D;
  static_assert(D % B == 0 && (B & (B - 1)) == 0, "Hadamard blocks are powers of two that divide D");
  for (int h = 1; h < B; h <<= 1) {
    for (int e = tid; e < C::KT * (D / 2); e += C::THREADS) {
      const int r = e / (D / 2), k = e % (D / 2);
      const int p = t0 + r;
      if (r < nt && p >= C::SINKS && p < hi) {
        // pair k of the row: block k / (B/2), then the butterfly's pair j
        const int j = k % (B / 2);
        const int i = (k / (B / 2)) * B + (j / h) * 2 * h + (j % h);
        float* x = tile + r * D;
        const float a = x[i], b = x[i + h];
        x[i] = a + b;
        x[i + h] = a - b;
      }
    }
    __syncthreads();
  }
  const float norm = (float)(1.0 / sqrt((double)B));
  for (int e = tid; e < C::KT * D; e += C::THREADS) {
    const int r = e / D, d = e % D;
    const int p = t0 + r;
    if (r < nt && p >= C::SINKS && p < hi) {
      float x = tile[e] * norm;
      if constexpr (T::SIGNS) {
        if (flip<T>(d)) x = -x;
      }
      tile[e] = x;
    }
  }
}

// Adds the centering means back to the tile's rows in blocks.
template <class C, class T>
__device__ __forceinline__ void add_means(float* tile, const typename C::act_t* __restrict__ mean, int t0, int nt,
                                          int hi, int tid) {
  for (int e = tid; e < C::KT * C::D; e += C::THREADS) {
    const int r = e / C::D, d = e % C::D;
    const int p = t0 + r;
    if (r < nt && p >= C::SINKS && p < hi) tile[e] += Act<C::ACT>::load(mean[d]);
  }
}

// The first token query `i` attends to: its sliding window's start.
__device__ __forceinline__ int block_start(int end, int window) {
  return window >= 0 ? max(end - window, 0) : 0;
}

template <class C>
__device__ __forceinline__ void block_kernel(
    const u32* __restrict__ pool, const u32* __restrict__ tables, int table_stride,
    const int* __restrict__ past_lens, const int* __restrict__ counts, const typename C::act_t* __restrict__ q,
    int max_n, const typename C::act_t* __restrict__ sinks_k, const typename C::act_t* __restrict__ sinks_v,
    const typename C::act_t* __restrict__ means_k, const typename C::act_t* __restrict__ means_v,
    const typename C::act_t* __restrict__ tail_k, const typename C::act_t* __restrict__ tail_v, int tail_stride,
    float sm_scale, int window, float* __restrict__ out) {
  typedef typename C::K K;
  typedef typename C::V V;
  typedef typename C::act_t act_t;
  constexpr int QT = C::QT;
  constexpr int HB = C::HB;
  constexpr int ROWS = QT * HB;
  constexpr int KT = C::KT;
  constexpr int D = C::D;
  constexpr int NWARPS = C::THREADS / 32;
  constexpr int EPT = (ROWS * D + C::THREADS - 1) / C::THREADS;  // accumulators per thread
  static_assert(C::GROUP_Q % HB == 0, "heads per block divide the GQA group");
  static_assert(C::THREADS % 32 == 0, "threads per block: a multiple of the warp");

  KIVI_SHARED(float, s_q, [ROWS][D]);   // the block's query rows, scaled into base-2 logits
  KIVI_SHARED(float, s_k, [KT][D]);     // one tile of keys, decoded
  KIVI_SHARED(float, s_v, [KT][D]);     // ... and of values
  KIVI_SHARED(float, s_p, [ROWS][KT]);  // scores, then probabilities
  KIVI_SHARED(float, s_m, [ROWS]);      // running max (base 2)
  KIVI_SHARED(float, s_l, [ROWS]);      // running sum of probabilities
  KIVI_SHARED(float, s_corr, [ROWS]);   // rescale of the accumulators for this tile

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int b = blockIdx.z;
  constexpr int CHUNKS = C::GROUP_Q / HB;
  const int hk = blockIdx.y / CHUNKS;
  const int hq0 = hk * C::GROUP_Q + (blockIdx.y % CHUNKS) * HB;
  const int n = counts[b];
  const int i0 = blockIdx.x * QT;
  if (i0 >= n) return;  // the whole block leaves together: no barrier is split
  const int i1 = min(i0 + QT, n);
  const int past = past_lens[b];
  const int total = past + n;
  // What the cache holds after the append, and where each tail starts.
  const int qk = quantized_tokens<C, K>(total);
  const int qv = quantized_tokens<C, V>(total);
  const int first_k = stored_tokens<C, K>(past);
  const int first_v = stored_tokens<C, V>(past);
  // A tile holds the stored form below these (the last query's boundaries).
  const int hi_k = stored_tokens<C, K>(past + i1);
  const int hi_v = stored_tokens<C, V>(past + i1);
  const u32* table = tables + (u64)b * table_stride;
  const act_t* tk = tail_k + ((u64)b * tail_stride * C::HKV + hk) * D;
  const act_t* tv = tail_v + ((u64)b * tail_stride * C::HKV + hk) * D;
  constexpr u64 TROW = (u64)C::HKV * D;  // tail row stride

  const float qscale = sm_scale * 1.4426950408889634f;
  for (int e = tid; e < ROWS * D; e += C::THREADS) {
    const int r = e / D, d = e % D;
    const int i = i0 + r / HB, h = r % HB;
    s_q[r][d] = i < i1 ? Act<C::ACT>::load(q[(((u64)b * max_n + i) * C::HQ + hq0 + h) * D + d]) * qscale : 0.0f;
  }
  if (tid < ROWS) {
    s_m[tid] = neg_inf();
    s_l[tid] = 0.0f;
  }
  float acc[EPT];
#pragma unroll
  for (int k = 0; k < EPT; ++k) acc[k] = 0.0f;
  __syncthreads();

  // Tokens some query of the block attends to, in tiles aligned to
  // multiples of KT: a query's tiles are then the same however the prompt
  // was cut into blocks, and a tile where it sees nothing leaves its state
  // exactly as it was (corr = 1, sum = 0), so chunked prefill gives the
  // outputs of one block bit for bit.
  const int lo = block_start(past + i0 + 1, window) / KT * KT;
  const int hi = past + i1;
#pragma unroll 1
  for (int t0 = lo; t0 < hi; t0 += KT) {
    const int nt = min(KT, hi - t0);
    // 1. rows: stored form below the block's highest boundary, else the tail.
    for (int e = tid; e < KT * D; e += C::THREADS) {
      const int r = e / D, d = e % D;
      const int p = t0 + r;
      float xk = 0.0f, xv = 0.0f;
      if (r < nt) {
        // A token below a boundary is a sink or in a block (stored tokens
        // never leave), so the ring argument of `locate` is never read.
        xk = p < hi_k ? stored_value<C, K>(locate<C, K>(p, qk, pool, table, b, hk, sinks_k, sinks_k), d)
                      : Act<C::ACT>::load(tk[(u64)(p - first_k) * TROW + d]);
        xv = p < hi_v ? stored_value<C, V>(locate<C, V>(p, qv, pool, table, b, hk, sinks_v, sinks_v), d)
                      : Act<C::ACT>::load(tv[(u64)(p - first_v) * TROW + d]);
      }
      s_k[r][d] = xk;
      s_v[r][d] = xv;
    }
    if constexpr (K::OUTL > 0 || V::OUTL > 0) {
      __syncthreads();
      if (tid < nt) {
        const int p = t0 + tid;
        if (p < hi_k) add_outliers<C, K>(locate<C, K>(p, qk, pool, table, b, hk, sinks_k, sinks_k), &s_k[tid][0]);
        if (p < hi_v) add_outliers<C, V>(locate<C, V>(p, qv, pool, table, b, hk, sinks_v, sinks_v), &s_v[tid][0]);
      }
    }
    // Rotated or centered tensors: back to the raw domain, row by row (the
    // inverse of kivi_runtime::quant's forward step, as the cache's view).
    if constexpr (K::ROT || V::ROT) {
      __syncthreads();
      if constexpr (K::ROT) unrotate_tile<C, K>(&s_k[0][0], t0, nt, hi_k, tid);
      if constexpr (V::ROT) unrotate_tile<C, V>(&s_v[0][0], t0, nt, hi_v, tid);
    }
    if constexpr (K::CENTER || V::CENTER) {
      __syncthreads();
      const u64 mrow = ((u64)b * C::HKV + hk) * D;
      if constexpr (K::CENTER) add_means<C, K>(&s_k[0][0], means_k + mrow, t0, nt, hi_k, tid);
      if constexpr (V::CENTER) add_means<C, V>(&s_v[0][0], means_v + mrow, t0, nt, hi_v, tid);
    }
    __syncthreads();
    // 2. scores, -inf outside each query's causal range and window.
    for (int e = tid; e < ROWS * KT; e += C::THREADS) {
      const int r = e / KT, j = e % KT;
      const int i = i0 + r / HB;
      const int p = t0 + j;
      float s = neg_inf();
      const int end = past + i + 1;
      if (j < nt && i < i1 && p < end && p >= block_start(end, window)) {
        float dot = 0.0f;
        if (p < stored_tokens<C, K>(end) || p >= hi_k) {
          for (int d = 0; d < D; ++d) dot = fmaf(s_q[r][d], s_k[j][d], dot);
        } else {
          // flushed during the block: this query still sees it at full precision
          const act_t* row = tk + (u64)(p - first_k) * TROW;
          for (int d = 0; d < D; ++d) dot = fmaf(s_q[r][d], Act<C::ACT>::load(row[d]), dot);
        }
        s = dot;
      }
      s_p[r][j] = s;
    }
    __syncthreads();
    // 3. online softmax, one warp per query row.
    for (int r = warp; r < ROWS; r += NWARPS) {
      float mt = neg_inf();
      for (int j = lane; j < nt; j += 32) mt = fmaxf(mt, s_p[r][j]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(KIVI_FULL_MASK, mt, o));
      const float m_old = s_m[r];
      const float m_new = fmaxf(m_old, mt);
      float sum = 0.0f;
      for (int j = lane; j < nt; j += 32) {
        const float x = s_p[r][j];
        const float e = x == neg_inf() ? 0.0f : exp2f(x - m_new);  // masked: 0 (also while m_new is -inf)
        s_p[r][j] = e;
        sum += e;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(KIVI_FULL_MASK, sum, o);
      if (lane == 0) {
        const float corr = m_old == m_new ? 1.0f : exp2f(m_old - m_new);  // 0 on the first scored tile
        s_corr[r] = corr;
        s_l[r] = s_l[r] * corr + sum;
        s_m[r] = m_new;
      }
    }
    __syncthreads();
    // 4. values: each thread its (row, channel) accumulators.
#pragma unroll
    for (int k = 0; k < EPT; ++k) {
      const int e = tid + k * C::THREADS;
      if (e < ROWS * D) {
        const int r = e / D, d = e % D;
        const int i = i0 + r / HB;
        float a = acc[k] * s_corr[r];
        if (i < i1) {
          const int bv = stored_tokens<C, V>(past + i + 1);
          for (int j = 0; j < nt; ++j) {
            const float pj = s_p[r][j];
            if (pj != 0.0f) {  // masked tokens (and underflows, which add nothing)
              const int p = t0 + j;
              const float x = (p < bv || p >= hi_v) ? s_v[j][d] : Act<C::ACT>::load(tv[(u64)(p - first_v) * TROW + d]);
              a = fmaf(pj, x, a);
            }
          }
        }
        acc[k] = a;
      }
    }
    __syncthreads();  // the tile's shared arrays are overwritten next
  }

  // out[b][i][hq][d] = acc / l; a query that attended to nothing gives zeros.
#pragma unroll
  for (int k = 0; k < EPT; ++k) {
    const int e = tid + k * C::THREADS;
    if (e < ROWS * D) {
      const int r = e / D, d = e % D;
      const int i = i0 + r / HB, h = r % HB;
      if (i < i1) {
        const float l = s_l[r];
        out[(((u64)b * max_n + i) * C::HQ + hq0 + h) * D + d] = l > 0.0f ? acc[k] * (1.0f / l) : 0.0f;
      }
    }
  }
}

}  // namespace kivi
