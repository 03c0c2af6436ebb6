// kivi_decode.cuh — fused dequantize + decode attention, flash-decoding style.
//
// One block = (split of the sequence, KV head, chunk of Cfg::HEADS query
// heads of its GQA group, sequence). It reads the KV head's bytes of its
// split once and serves every query head of the chunk from that pass:
//
//   for each tile of Cfg::TILE tokens:
//     1. scores  a team of K::TEAM lanes per key row; each lane decodes its
//                words (one vector load of Cfg::WIDTH words per step) and
//                dots them with its slice of every query head, scales
//                folded in (see below); a butterfly of shuffles sums the team
//     2. softmax one warp per head: tile max, rescale factor, p = 2^(s - m)
//     3. values  a team of V::TEAM lanes per value row accumulates p * v
//                into registers (each lane owns fixed channels)
//   then the teams' accumulators are summed in shared memory and the split
//   writes its partial (m, l, acc) for the combine kernel.
//
// Scores are kept in base 2: the query is pre-multiplied by
// sm_scale * log2(e), so exp2f replaces expf and the combine kernel merges
// in the same base.
//
// Scale folding: for token-axis keys whose groups cover whole words, one word
// shares (s, z), so q . (c * s + z) = s * (q . c) + z * sum(q): the lane keeps
// sum(q) per word and multiplies by s and z once per word. Channel-axis keys
// have a scale per channel: the lane dequantizes with one FMA per channel.
//
// Integer-domain query (`query: int8(group = QG)`, K::QGROUP > 0): before a
// tile's scores, the block quantizes the query folded with each key group's
// scales that the tile touches, exactly as the oracle does
// (kivi_runtime::quant::quantize_query: per QG channels m = max|w|,
// a = m / 127, rint(w * (127 / m))), into shared memory in the byte order a word's codes unpack
// to; a coded key word then costs one __dp4a per four codes per head and
// one FMA by the block's scale, and the zero points one add per row.

namespace kivi {

template <class C, class T> struct Lanes {
  static constexpr int TEAMS = C::THREADS / T::TEAM;         // rows in flight per block
  static constexpr int SLOTS = T::STEPS * C::WIDTH;          // words a lane owns per row
  static constexpr int CH = SLOTS * T::CPW;                  // values a lane owns per row
  static_assert(T::TEAM >= 1 && T::TEAM <= 32 && (T::TEAM & (T::TEAM - 1)) == 0, "team: power of two <= 32");
  static_assert(C::THREADS % 32 == 0, "threads per block: a multiple of the warp");
  static_assert(T::TEAM * T::STEPS * C::WIDTH >= T::WPT, "a team covers a whole row");
  static_assert(T::WPT % C::WIDTH == 0, "rows are whole vector loads");
  // First word of load `k` of lane `tl`.
  __device__ __forceinline__ static int word(int k, int tl) { return (k * T::TEAM + tl) * C::WIDTH; }
};

// Code `i` of a word of tensor T.
template <class T> __device__ __forceinline__ u32 code_at(u32 word, int i) {
  return (word >> (i * T::BITS)) & ((1u << T::BITS) - 1u);
}

// q . k for the row `r` of a key, this lane's share, every head of the block.
// `qr` is the query in the domain the key's codes live in (rotated when the
// key is); sink and window rows are raw, so a rotated key scores them
// against the raw query kept in shared memory (`sq_raw`, [H][D], scaled).
template <class C, int H>
__device__ __forceinline__ void key_dot(const RowRef<C>& r, int tl,
                                        const float (&qr)[H][Lanes<C, typename C::K>::CH],
                                        const float (&qsum)[H][Lanes<C, typename C::K>::SLOTS],
                                        const float* sq_raw, float (&s)[H],
                                        const int* i8q = nullptr, const float* i8a = nullptr) {
  typedef typename C::K K;
  typedef Lanes<C, K> L;
#pragma unroll
  for (int k = 0; k < K::STEPS; ++k) {
    const int w0 = L::word(k, tl);
    if (w0 >= K::WPT) break;
    if (r.part != nullptr) {
      u32 wv[C::WIDTH];
      load_words<C::WIDTH>(r.part + r.off * K::WPT + w0, wv);
#pragma unroll
      for (int j = 0; j < C::WIDTH; ++j) {
        const int slot = k * C::WIDTH + j;
        const int d0 = (w0 + j) * K::CPW;
        if constexpr (!K::QUANT) {
#pragma unroll
          for (int i = 0; i < K::CPW; ++i) {
            const float x = word_value<C, K>(wv[j], i);
#pragma unroll
            for (int h = 0; h < H; ++h) s[h] = fmaf(qr[h][slot * K::CPW + i], x, s[h]);
          }
        } else if constexpr (K::TOKEN_AXIS && K::GROUP % K::CPW == 0) {
          // one (s, z) per word: fold them in after the code dot product
          // (table codes: s * (q . L[c]), plus z * sum(q) with a zero point)
          const int pi = param_index<C, K>(r.off, d0);
          const float sc = load_param<K>(r.part + K::SCALES, pi);
          float dot[H];
#pragma unroll
          for (int h = 0; h < H; ++h) dot[h] = 0.0f;
#pragma unroll
          for (int i = 0; i < K::CPW; ++i) {
            const float c = code_level<K>(code_at<K>(wv[j], i));
#pragma unroll
            for (int h = 0; h < H; ++h) dot[h] = fmaf(qr[h][slot * K::CPW + i], c, dot[h]);
          }
          if constexpr (!HasZero<K>::value) {
#pragma unroll
            for (int h = 0; h < H; ++h) s[h] += sc * dot[h];
          } else {
            const float zp = load_param<K>(r.part + K::ZEROS, pi);
#pragma unroll
            for (int h = 0; h < H; ++h) s[h] += sc * dot[h] + zp * qsum[h][slot];
          }
        } else if constexpr (K::QGROUP > 0) {
          // int8 query: four codes (one per byte after the shift and mask)
          // times four query bytes per __dp4a, exact in int; the block's
          // scale (times log2 e) once per word
          constexpr int SL = K::CPW / 4;
          constexpr u32 M8 = K::BITS == 2 ? 0x03030303u : 0x0f0f0f0fu;
          const int wi = w0 + j;
          const int qb = wi * K::CPW / K::QGROUP;
#pragma unroll
          for (int h = 0; h < H; ++h) {
            int dot = 0;
#pragma unroll
            for (int k = 0; k < SL; ++k)
              dot = __dp4a((int)((wv[j] >> (k * K::BITS)) & M8), i8q[h * (C::D / 4) + wi * SL + k], dot);
            s[h] = fmaf(i8a[h * (C::D / K::QGROUP) + qb], (float)dot, s[h]);
          }
        } else {
#pragma unroll
          for (int i = 0; i < K::CPW; ++i) {
            const int d = d0 + i;
            if (d < C::D) {
              const int pi = param_index<C, K>(r.off, d);
              float zp = 0.0f;
              if constexpr (HasZero<K>::value) zp = load_param<K>(r.part + K::ZEROS, pi);
              const float x = dequant<K>(code_at<K>(wv[j], i), load_param<K>(r.part + K::SCALES, pi), zp);
#pragma unroll
              for (int h = 0; h < H; ++h) s[h] = fmaf(qr[h][slot * K::CPW + i], x, s[h]);
            }
          }
        }
      }
    } else {
      // a sink or window row: raw activations, same channel ownership
#pragma unroll
      for (int j = 0; j < C::WIDTH; ++j) {
#pragma unroll
        for (int i = 0; i < K::CPW; ++i) {
          const int d = (w0 + j) * K::CPW + i;
          if (d < C::D) {
            const float x = Act<C::ACT>::load(r.raw[d]);
#pragma unroll
            for (int h = 0; h < H; ++h) {
              float qv;
              if constexpr (K::ROT) {
                qv = sq_raw[h * C::D + d];
              } else {
                qv = qr[h][(k * C::WIDTH + j) * K::CPW + i];
              }
              s[h] = fmaf(qv, x, s[h]);
            }
          }
        }
      }
    }
  }
}

// acc += p * v for the row `r` of a value, this lane's channels. Quantized
// rows go to `tq`: for a value with a rotation or centering, a second
// accumulator in the codec's domain (the split brings it back once at the
// end); otherwise the caller passes `acc` itself. Raw rows go to `acc`. Outlier corrections are
// added by the lane that owns their channel.
template <class C, int H, int QCH>
__device__ __forceinline__ void value_acc(const RowRef<C>& r, int tl, const float (&p)[H],
                                          float (&acc)[H][Lanes<C, typename C::V>::CH], float (&tq)[H][QCH]) {
  typedef typename C::V V;
  typedef Lanes<C, V> L;
  static_assert(QCH == L::CH, "the quantized rows' accumulator has the lane's channels");
#pragma unroll
  for (int k = 0; k < V::STEPS; ++k) {
    const int w0 = L::word(k, tl);
    if (w0 >= V::WPT) break;
    if (r.part != nullptr) {
      u32 wv[C::WIDTH];
      load_words<C::WIDTH>(r.part + r.off * V::WPT + w0, wv);
#pragma unroll
      for (int j = 0; j < C::WIDTH; ++j) {
        const int slot = k * C::WIDTH + j;
        const int d0 = (w0 + j) * V::CPW;
        float sc = 1.0f, zp = 0.0f;
        if constexpr (V::QUANT && V::TOKEN_AXIS && V::GROUP % V::CPW == 0) {
          const int pi = param_index<C, V>(r.off, d0);
          sc = load_param<V>(r.part + V::SCALES, pi);
          if constexpr (HasZero<V>::value) zp = load_param<V>(r.part + V::ZEROS, pi);
        }
#pragma unroll
        for (int i = 0; i < V::CPW; ++i) {
          const int d = d0 + i;
          float x;
          if constexpr (V::QUANT) {
            if constexpr (V::TOKEN_AXIS && V::GROUP % V::CPW == 0) {
              x = dequant<V>(code_at<V>(wv[j], i), sc, zp);
            } else {
              if (d >= C::D) continue;
              const int pi = param_index<C, V>(r.off, d);
              float z = 0.0f;
              if constexpr (HasZero<V>::value) z = load_param<V>(r.part + V::ZEROS, pi);
              x = dequant<V>(code_at<V>(wv[j], i), load_param<V>(r.part + V::SCALES, pi), z);
            }
          } else {
            x = word_value<C, V>(wv[j], i);
          }
#pragma unroll
          for (int h = 0; h < H; ++h) tq[h][slot * V::CPW + i] = fmaf(p[h], x, tq[h][slot * V::CPW + i]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < C::WIDTH; ++j) {
#pragma unroll
        for (int i = 0; i < V::CPW; ++i) {
          const int d = (w0 + j) * V::CPW + i;
          if (d < C::D) {
            const float x = Act<C::ACT>::load(r.raw[d]);
            const int c = (k * C::WIDTH + j) * V::CPW + i;
#pragma unroll
            for (int h = 0; h < H; ++h) acc[h][c] = fmaf(p[h], x, acc[h][c]);
          }
        }
      }
    }
  }
  if constexpr (V::OUTL > 0) {
    if (r.part != nullptr) {
      for (int o = 0; o < V::OUTL; ++o) {
        const int ch = outlier_channel<C, V>(r.part, r.off, o);
        const float corr = outlier_value<C, V>(r.part, r.off, o);
        // the owning lane, found by comparing against its fixed channels
        // (a run-time index would move the accumulators to local memory)
#pragma unroll
        for (int k = 0; k < V::STEPS; ++k) {
#pragma unroll
          for (int j = 0; j < C::WIDTH; ++j) {
#pragma unroll
            for (int i = 0; i < V::CPW; ++i) {
              if ((L::word(k, tl) + j) * V::CPW + i == ch) {
#pragma unroll
                for (int h = 0; h < H; ++h) {
                  float& a = tq[h][(k * C::WIDTH + j) * V::CPW + i];
                  a = fmaf(p[h], corr, a);
                }
              }
            }
          }
        }
      }
    }
  }
}

// The value accumulators `acc` of the teams of one warp summed into that
// warp's slice `w_mine` of shared memory ([H][D]): the teams take turns
// adding (no shuffles: a lane may own 100+ accumulators). Shared by the
// raw-domain sum below and the codes'-domain one of a rotated or centered
// value (codec_value_split, kivi_codec_decode.cuh), so both add in one order.
template <class C, int H, int CH>
__device__ __forceinline__ void teams_to_warp(const float (&acc)[H][CH], float* w_mine, int lane, int vl) {
  typedef typename C::V V;
  typedef Lanes<C, V> LV;
  constexpr int TEAMS_PER_WARP = 32 / V::TEAM;
  const int team_in_warp = lane / V::TEAM;
#pragma unroll 1
  for (int r = 0; r < TEAMS_PER_WARP; ++r) {
    if (team_in_warp == r) {
#pragma unroll
      for (int k = 0; k < V::STEPS; ++k) {
#pragma unroll
        for (int j = 0; j < C::WIDTH; ++j) {
#pragma unroll
          for (int i = 0; i < V::CPW; ++i) {
            const int d = (LV::word(k, vl) + j) * V::CPW + i;
            if (LV::word(k, vl) < V::WPT && d < C::D) {
#pragma unroll
              for (int h = 0; h < H; ++h) {
                const float x = acc[h][(k * C::WIDTH + j) * V::CPW + i];
                w_mine[h * C::D + d] = r == 0 ? x : w_mine[h * C::D + d] + x;
              }
            }
          }
        }
      }
    }
    __syncwarp();
  }
}

// Pre-RoPE keys (`rope: pre(...)`): the cache holds keys before RoPE and
// each must be turned to its position p (its index in the sequence). A lane
// owns fixed channels of a key row but a RoPE pair spans two channels that
// other lanes may own, so the query turns instead, by the opposite angle:
// q . R(p) k = (R(-p) q) . k. For a pair (a, b) at angle t,
// (R(-p) q)_a = q_a cos t + q_b sin t and (R(-p) q)_b = q_b cos t - q_a sin t,
// so a lane keeps its channels' query `qr` and its partners' query, signed,
// `qp`, and per row forms qr * cos + qp * sin. Angles: p times the pair's
// inverse frequency (host-computed f64 table, the oracle's), cos and sin in
// f64 rounded to f32 once, as the oracle does.
template <class C> __device__ __forceinline__ int rope_pair(int d) {
  return C::ROPE_HALF ? d % (C::D / 2) : d >> 1;
}
template <class C> __device__ __forceinline__ int rope_partner(int d) {
  return C::ROPE_HALF ? (d < C::D / 2 ? d + C::D / 2 : d - C::D / 2) : d ^ 1;
}
template <class C> __device__ __forceinline__ float rope_sign(int d) {
  return (C::ROPE_HALF ? d < C::D / 2 : (d & 1) == 0) ? 1.0f : -1.0f;
}

// This lane's slice of every head's query turned to -pos, and its per-slot
// sums (for keys that fold a word's scale and zero point).
template <class C, int H>
__device__ __forceinline__ void rope_query(int pos, int tl, const float (&qr)[H][Lanes<C, typename C::K>::CH],
                                           const float (&qp)[H][Lanes<C, typename C::K>::CH],
                                           float (&qt)[H][Lanes<C, typename C::K>::CH],
                                           float (&qts)[H][Lanes<C, typename C::K>::SLOTS]) {
  typedef typename C::K K;
  typedef Lanes<C, K> L;
#pragma unroll
  for (int k = 0; k < K::STEPS; ++k) {
#pragma unroll
    for (int j = 0; j < C::WIDTH; ++j) {
      const int slot = k * C::WIDTH + j;
#pragma unroll
      for (int h = 0; h < H; ++h) qts[h][slot] = 0.0f;
#pragma unroll
      for (int i = 0; i < K::CPW; ++i) {
        const int d = (L::word(k, tl) + j) * K::CPW + i;
        const int c = slot * K::CPW + i;
        float co = 1.0f, sn = 0.0f;
        if (d < C::D) {
          const double a = (double)pos * C::rope_freq(rope_pair<C>(d));
          co = (float)cos(a);
          sn = (float)sin(a);
        }
#pragma unroll
        for (int h = 0; h < H; ++h) {
          qt[h][c] = fmaf(qp[h][c], sn, qr[h][c] * co);
          qts[h][slot] += qt[h][c];
        }
      }
    }
  }
}

// The codec pipeline's decode steps, defined in kivi_codec_decode.cuh
// (pasted only into sources whose scheme has a pipeline; the calls below
// sit in `if constexpr` branches that other schemes never instantiate).
template <class C, int H>
__device__ void codec_query(const typename C::act_t* __restrict__ q, const typename C::act_t* __restrict__ means_k,
                            float qscale, float* s_q, float (&qm)[H], int b, int hq0, int hk, int tid);
template <class C, int H, int CH>
__device__ void codec_value_split(const float (&accq)[H][CH], float* s_w, float* s_rot, const float* s_lq,
                                  const typename C::act_t* __restrict__ means_v, int b, int hk, int warp, int lane,
                                  int vl, int tid);

template <class C>
__device__ __forceinline__ void decode_kernel(
    const u32* __restrict__ pool, const u32* __restrict__ tables, int table_stride,
    const int* __restrict__ seq_lens, const typename C::act_t* __restrict__ q,
    const typename C::act_t* __restrict__ sinks_k, const typename C::act_t* __restrict__ sinks_v,
    const typename C::act_t* __restrict__ ring_k, const typename C::act_t* __restrict__ ring_v,
    const typename C::act_t* __restrict__ means_k, const typename C::act_t* __restrict__ means_v,
    float sm_scale, int window, float* __restrict__ part_ml, float* __restrict__ part_acc) {
  typedef typename C::K K;
  typedef typename C::V V;
  typedef Lanes<C, K> LK;
  typedef Lanes<C, V> LV;
  constexpr int H = C::HEADS;
  constexpr int NWARPS = C::THREADS / 32;
  static_assert(C::GROUP_Q % H == 0, "heads per block divide the GQA group");

  KIVI_SHARED(float, s_p, [H][C::TILE]);   // scores, then probabilities, of one tile
  KIVI_SHARED(float, s_m, [H]);            // running max (base 2)
  KIVI_SHARED(float, s_l, [H]);            // running sum of probabilities
  KIVI_SHARED(float, s_corr, [H]);         // rescale of the accumulators for this tile
  KIVI_SHARED(float, s_w, [NWARPS][H][C::D]);  // each warp's summed accumulators
  // The codec pipeline (each array one float when unused): keys with a
  // rotation, outliers or centering keep the query in shared memory, raw
  // [0] and in the key codes' domain [1]; values with a rotation or
  // centering sum their quantized tokens apart (probability sum s_lq,
  // accumulator brought back to the raw domain in s_rot).
  constexpr bool KQ = K::ROT || K::OUTL > 0 || K::CENTER;
  constexpr bool SPLIT = V::ROT || V::CENTER;
  KIVI_SHARED(float, s_q, [KQ ? 2 : 1][KQ ? H : 1][KQ ? C::D : 1]);
  KIVI_SHARED(float, s_lq, [SPLIT ? H : 1]);
  KIVI_SHARED(float, s_rot, [SPLIT ? H : 1][SPLIT ? C::D : 1]);
  // The int8 query (K::QGROUP > 0) of each key group a tile touches (at
  // most TILE / G + 2): dwords of four query bytes [H][D / 4], block scales
  // times log2 e [H][D / QG], sum_d qs_d z_d times log2 e [H].
  constexpr int QG = K::QGROUP;
  constexpr int NG = QG > 0 ? C::TILE / K::GROUP + 2 : 1;
  KIVI_SHARED(int, s_qd, [NG][QG > 0 ? H : 1][QG > 0 ? C::D / 4 : 1]);
  KIVI_SHARED(float, s_qa, [NG][QG > 0 ? H : 1][QG > 0 ? C::D / QG : 1]);
  KIVI_SHARED(float, s_qc, [NG][QG > 0 ? H : 1]);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int split = blockIdx.x;
  constexpr int CHUNKS = C::GROUP_Q / H;
  const int hk = blockIdx.y / CHUNKS;
  const int hq0 = hk * C::GROUP_Q + (blockIdx.y % CHUNKS) * H;
  const int b = blockIdx.z;

  // This split's tokens: [a, z) of the attended range [start, T).
  const int T = seq_lens[b];
  const int start = window >= 0 ? max(T - window, 0) : 0;  // window < 0: no sliding window
  const int len = T - start;
  const int a = start + (int)((long long)len * split / C::SPLITS);
  const int z = start + (int)((long long)len * (split + 1) / C::SPLITS);
  const int qk = quantized_tokens<C, K>(T);
  const int qv = quantized_tokens<C, V>(T);
  const u32* table = tables + (u64)b * table_stride;

  // This lane's slice of every query head, scaled into base-2 logits.
  const int kteam = tid / K::TEAM, kl = tid % K::TEAM;
  const int vteam = tid / V::TEAM, vl = tid % V::TEAM;
  const float qscale = sm_scale * 1.4426950408889634f;
  float qm[H];  // q . m per head (centered keys)
  if constexpr (KQ) codec_query<C, H>(q, means_k, qscale, &s_q[0][0][0], qm, b, hq0, hk, tid);
  float qr[H][LK::CH];
  float qsum[H][LK::SLOTS];
  float qp[H][C::ROPE ? LK::CH : 1];  // pre-RoPE keys: partners' query, signed
#pragma unroll
  for (int h = 0; h < H; ++h) {
    const typename C::act_t* qh = q + ((u64)b * C::HQ + hq0 + h) * C::D;
#pragma unroll
    for (int k = 0; k < K::STEPS; ++k) {
#pragma unroll
      for (int j = 0; j < C::WIDTH; ++j) {
        const int slot = k * C::WIDTH + j;
        qsum[h][slot] = 0.0f;
#pragma unroll
        for (int i = 0; i < K::CPW; ++i) {
          const int d = (LK::word(k, kl) + j) * K::CPW + i;
          float x = 0.0f;
          if (d < C::D) {
            if constexpr (KQ) {
              x = s_q[1][h][d];  // rotated when the key is
            } else {
              x = Act<C::ACT>::load(qh[d]) * qscale;
            }
          }
          qr[h][slot * K::CPW + i] = x;
          qsum[h][slot] += x;
          if constexpr (C::ROPE) {
            qp[h][slot * K::CPW + i] =
                d < C::D ? rope_sign<C>(d) * Act<C::ACT>::load(qh[rope_partner<C>(d)]) * qscale : 0.0f;
          }
        }
      }
    }
  }
  float acc[H][LV::CH];
  float accq[H][SPLIT ? LV::CH : 1];
#pragma unroll
  for (int h = 0; h < H; ++h) {
#pragma unroll
    for (int c = 0; c < LV::CH; ++c) acc[h][c] = 0.0f;
#pragma unroll
    for (int c = 0; c < (SPLIT ? LV::CH : 1); ++c) accq[h][c] = 0.0f;
  }
  if (tid < H) {
    s_m[tid] = neg_inf();
    s_l[tid] = 0.0f;
    if constexpr (SPLIT) s_lq[tid] = 0.0f;
  }
  __syncthreads();

  for (int t0 = a; t0 < z; t0 += C::TILE) {
    const int n = min(C::TILE, z - t0);
    int g0 = 0;  // the tile's first key group (int8 query)
    if constexpr (QG > 0) {
      // 0. the int8 query of the key groups of the tile's coded rows
      const int j0 = max(t0, C::SINKS) - C::SINKS;
      const int j1 = min(t0 + n, C::SINKS + qk) - C::SINKS;
      g0 = j0 / K::GROUP;
      const int ng = j1 > j0 ? (j1 - 1) / K::GROUP - g0 + 1 : 0;
      constexpr int NB = C::D / QG;
      constexpr int SL = K::CPW / 4;
      for (int e = tid; e < ng * H * NB; e += C::THREADS) {
        const int gi = e / (H * NB), h = (e / NB) % H, qb = e % NB;
        const RowRef<C> r = locate<C, K>(C::SINKS + (g0 + gi) * K::GROUP, qk, pool, table, b, hk, sinks_k, ring_k);
        const typename C::act_t* qh = q + ((u64)b * C::HQ + hq0 + h) * C::D;
        // w = (q * scale) * s, its block maximum, then the codes
        float m = 0.0f;
        for (int c = 0; c < QG; ++c) {
          const int d = qb * QG + c;
          const float w = __fmul_rn(__fmul_rn(Act<C::ACT>::load(qh[d]), sm_scale),
                                    load_param<K>(r.part + K::SCALES, param_index<C, K>(r.off, d)));
          m = fmaxf(m, fabsf(w));
        }
        const float qa = __fdiv_rn(m, 127.0f);
        const float inv = __fdiv_rn(127.0f, m);
        s_qa[gi][h][qb] = qa * 1.4426950408889634f;
        signed char* qd = reinterpret_cast<signed char*>(&s_qd[gi][h][0]);
        for (int c = 0; c < QG; ++c) {
          const int d = qb * QG + c;
          const float w = __fmul_rn(__fmul_rn(Act<C::ACT>::load(qh[d]), sm_scale),
                                    load_param<K>(r.part + K::SCALES, param_index<C, K>(r.off, d)));
          const int v = m == 0.0f ? 0 : (int)fminf(fmaxf(rintf(__fmul_rn(w, inv)), -127.0f), 127.0f);
          const int i = d % K::CPW;  // code i of its word: byte i / SL after shifting by slot i % SL
          qd[((d / K::CPW) * SL + i % SL) * 4 + i / SL] = (signed char)v;
        }
      }
      for (int e = tid; e < ng * H; e += C::THREADS) {
        const int gi = e / H, h = e % H;
        const RowRef<C> r = locate<C, K>(C::SINKS + (g0 + gi) * K::GROUP, qk, pool, table, b, hk, sinks_k, ring_k);
        const typename C::act_t* qh = q + ((u64)b * C::HQ + hq0 + h) * C::D;
        // in double, rounded once (as the CPU backend): D products of both signs
        double c = 0.0;
        for (int d = 0; d < C::D; ++d)
          c += (double)__fmul_rn(Act<C::ACT>::load(qh[d]), sm_scale) *
               (double)load_param<K>(r.part + K::ZEROS, param_index<C, K>(r.off, d));
        s_qc[gi][h] = (float)c * 1.4426950408889634f;
      }
      __syncthreads();
    }
    // 1. scores. Every team runs the same trip count: the shuffles need
    //    whole warps, so lanes past the tile still take part.
#pragma unroll 1
    for (int i0 = 0; i0 < C::TILE; i0 += LK::TEAMS) {
      const int i = i0 + kteam;
      float s[H];
#pragma unroll
      for (int h = 0; h < H; ++h) s[h] = 0.0f;
      if (i < n) {
        const RowRef<C> r = locate<C, K>(t0 + i, qk, pool, table, b, hk, sinks_k, ring_k);
        if constexpr (C::ROPE) {
          float qt[H][LK::CH];
          float qts[H][LK::SLOTS];
          rope_query<C, H>(t0 + i, kl, qr, qp, qt, qts);
          key_dot<C, H>(r, kl, qt, qts, &s_q[0][0][0], s);
        } else {
          const int gi = QG > 0 && r.part != nullptr ? (t0 + i - C::SINKS) / K::GROUP - g0 : 0;
          key_dot<C, H>(r, kl, qr, qsum, &s_q[0][0][0], s, &s_qd[gi][0][0], &s_qa[gi][0][0]);
          if constexpr (QG > 0) {
            if (r.part != nullptr && kl == 0) {
#pragma unroll
              for (int h = 0; h < H; ++h) s[h] += s_qc[gi][h];
            }
          }
        }
        if constexpr (KQ) {
          // once per quantized row (one lane of the team): q . m and the
          // outliers' corrections against the query in the codes' domain
          // (pre-RoPE keys: the query turned to -p at the outlier's
          // channel, as rope_query turns it for the codes, since the oracle
          // adds each correction to the row before turning it)
          if (r.part != nullptr && kl == 0) {
            float extra[H];
#pragma unroll
            for (int h = 0; h < H; ++h) {
              extra[h] = 0.0f;
              if constexpr (K::CENTER) extra[h] = qm[h];
            }
            for (int o = 0; o < K::OUTL; ++o) {
              const int ch = outlier_channel<C, K>(r.part, r.off, o);
              const float ov = outlier_value<C, K>(r.part, r.off, o);
              if constexpr (C::ROPE) {
                const double ang = (double)(t0 + i) * C::rope_freq(rope_pair<C>(ch));
                const float co = (float)cos(ang), sn = (float)sin(ang);
                const int pc = rope_partner<C>(ch);
#pragma unroll
                for (int h = 0; h < H; ++h) {
                  const float qt = fmaf(rope_sign<C>(ch) * s_q[0][h][pc], sn, s_q[1][h][ch] * co);
                  extra[h] = fmaf(qt, ov, extra[h]);
                }
              } else {
#pragma unroll
                for (int h = 0; h < H; ++h) extra[h] = fmaf(s_q[1][h][ch], ov, extra[h]);
              }
            }
#pragma unroll
            for (int h = 0; h < H; ++h) s[h] += extra[h];
          }
        }
      }
#pragma unroll
      for (int o = K::TEAM / 2; o > 0; o >>= 1)
#pragma unroll
        for (int h = 0; h < H; ++h) s[h] += __shfl_xor_sync(KIVI_FULL_MASK, s[h], o);
      if (i < n && kl == 0) {
#pragma unroll
        for (int h = 0; h < H; ++h) s_p[h][i] = s[h];
      }
    }
    __syncthreads();
    // 2. online softmax, one warp per head.
    for (int h = warp; h < H; h += NWARPS) {
      float mt = neg_inf();
      for (int i = lane; i < n; i += 32) mt = fmaxf(mt, s_p[h][i]);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mt = fmaxf(mt, __shfl_xor_sync(KIVI_FULL_MASK, mt, o));
      const float m_old = s_m[h];
      const float m_new = fmaxf(m_old, mt);
      float sum = 0.0f, sumq = 0.0f;
      for (int i = lane; i < n; i += 32) {
        const float e = exp2f(s_p[h][i] - m_new);
        s_p[h][i] = e;
        sum += e;
        if constexpr (SPLIT) {
          const int j = t0 + i - C::SINKS;  // a quantized value token?
          if (j >= 0 && j < qv) sumq += e;
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(KIVI_FULL_MASK, sum, o);
      if constexpr (SPLIT) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sumq += __shfl_xor_sync(KIVI_FULL_MASK, sumq, o);
      }
      if (lane == 0) {
        const float corr = exp2f(m_old - m_new);  // 0 on the first tile (m_old = -inf)
        s_corr[h] = corr;
        s_l[h] = s_l[h] * corr + sum;
        s_m[h] = m_new;
        if constexpr (SPLIT) s_lq[h] = s_lq[h] * corr + sumq;
      }
    }
    __syncthreads();
    // 3. values.
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const float corr = s_corr[h];
#pragma unroll
      for (int c = 0; c < LV::CH; ++c) acc[h][c] *= corr;
      if constexpr (SPLIT) {
#pragma unroll
        for (int c = 0; c < LV::CH; ++c) accq[h][c] *= corr;
      }
    }
#pragma unroll C::UNROLL
    for (int i = vteam; i < n; i += LV::TEAMS) {
      float pr[H];
#pragma unroll
      for (int h = 0; h < H; ++h) pr[h] = s_p[h][i];
      const RowRef<C> r = locate<C, V>(t0 + i, qv, pool, table, b, hk, sinks_v, ring_v);
      if constexpr (SPLIT) {
        value_acc<C, H, LV::CH>(r, vl, pr, acc, accq);
      } else {
        value_acc<C, H, LV::CH>(r, vl, pr, acc, acc);
      }
    }
    __syncthreads();  // s_p is overwritten by the next tile
  }

  // A rotated or centered value's quantized tokens first: summed into
  // s_rot and brought back to the raw domain (kivi_codec_decode.cuh).
  if constexpr (SPLIT) codec_value_split<C, H, LV::CH>(accq, &s_w[0][0][0], &s_rot[0][0], s_lq, means_v, b, hk, warp, lane, vl, tid);
  // Sum the value teams into each warp's slice of shared memory, then one
  // pass sums the warps while writing the partial.
  teams_to_warp<C, H, LV::CH>(acc, &s_w[warp][0][0], lane, vl);
  __syncthreads();
  const u64 row0 = ((u64)b * C::HQ + hq0) * C::SPLITS + split;
  for (int e = tid; e < H * C::D; e += C::THREADS) {
    const int h = e / C::D, d = e % C::D;
    float x = 0.0f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) x += s_w[w][h][d];
    if constexpr (SPLIT) x += s_rot[h][d];
    part_acc[(row0 + (u64)h * C::SPLITS) * C::D + d] = x;
  }
  if (tid < H) {
    part_ml[(row0 + (u64)tid * C::SPLITS) * 2 + 0] = s_m[tid];
    part_ml[(row0 + (u64)tid * C::SPLITS) * 2 + 1] = s_l[tid];
  }
}

// Merges the splits of one (sequence, query head): grid (HQ, 1, batch).
template <class C>
__device__ __forceinline__ void combine_kernel(const float* __restrict__ part_ml,
                                               const float* __restrict__ part_acc,
                                               float* __restrict__ out) {
  const int hq = blockIdx.x;
  const int b = blockIdx.z;
  const u64 row0 = ((u64)b * C::HQ + hq) * C::SPLITS;
  float m = neg_inf();
  for (int s = 0; s < C::SPLITS; ++s) m = fmaxf(m, part_ml[(row0 + s) * 2]);
  float* o = out + ((u64)b * C::HQ + hq) * C::D;
  if (m == neg_inf()) {  // nothing attended (empty sequence): the output is zero
    for (int d = threadIdx.x; d < C::D; d += blockDim.x) o[d] = 0.0f;
    return;
  }
  float l = 0.0f;
  for (int s = 0; s < C::SPLITS; ++s) {
    const float ms = part_ml[(row0 + s) * 2];
    if (ms != neg_inf()) l += exp2f(ms - m) * part_ml[(row0 + s) * 2 + 1];
  }
  const float inv = 1.0f / l;
  for (int d = threadIdx.x; d < C::D; d += blockDim.x) {
    float x = 0.0f;
    for (int s = 0; s < C::SPLITS; ++s) {
      const float ms = part_ml[(row0 + s) * 2];
      if (ms != neg_inf()) x = fmaf(exp2f(ms - m), part_acc[(row0 + s) * C::D + d], x);
    }
    o[d] = x * inv;
  }
}

}  // namespace kivi
