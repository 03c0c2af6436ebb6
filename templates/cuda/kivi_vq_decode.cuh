// kivi_vq_decode.cuh — decode attention for schemes whose keys and/or values
// are product vector quantized (`vq(dim = M, entries = E)`, kivi_spec::vq).
//
// Same grid, splits, tiles, online softmax and partial outputs as
// kivi_decode.cuh (whose combine kernel merges the splits, and whose
// key_dot / value_acc / teams_to_warp serve the tensor that is not vq), with
// two changes for a vq tensor:
//
//   keys    per step the block builds the query-by-codebook table
//           s_lut[h][j][c] = q_j . c_j,c (asymmetric distance computation)
//           in shared memory, once for the whole split; a coded key row then
//           scores with D / M table lookups and no arithmetic on centroids.
//           A team of K::TEAM lanes shares a row, lane tl summing sub-vectors
//           tl, tl + TEAM, ...; sink and window rows are raw and dot the
//           scaled query kept in shared memory.
//   values  the lane that owns sub-vector j (tl, tl + TEAM, ...) adds
//           p * centroid(j, code) to its M accumulators, reading the centroid
//           from the codebook in global memory (an L1/L2-resident table:
//           8 x 256 x 32 B = 64 KiB per head_dim 128) — the row is expanded
//           at the lane, never in memory.
//
// Why values expand centroids rather than accumulate per-centroid weights
// ("bins": s_bin[j][c] += p, then one D x E expansion per split): the bins of
// one head need as much shared memory as its key table (D / M x E floats,
// 16 KiB at D = 128, E = 256), which would halve the query heads a block can
// serve when both tensors are vq; many lanes adding into one bin need
// shared-memory read-modify-write instructions, whose float order is not
// deterministic (and which the simulator does not model); and the bins only save work when a split
// holds more tokens than E * M / (M - 1) (~290 at M = 8, E = 256) — fewer than
// a split of a short or widely split context has. docs/cuda.md records this
// as a choice to re-measure on a GPU.
//
// The codebooks are kernel arguments (`book_k`, `book_v`: f32
// `[D / M][E][M]`, uploaded once per cache by the device cache), not source
// literals: a 256 KiB table does not belong in a source, and one compiled
// module serves every layer and calibration of a scheme.
//
// Not here (kivi_templates refuses them with a typed error before any source
// is generated): rotations, outliers and centering of the other tensor,
// pre-RoPE keys and the int8 query.

namespace kivi {

// Code of sub-vector `j` of the vq row at token offset `off` of a block part.
template <class T> __device__ __forceinline__ u32 vq_code(const u32* part, int off, int j) {
  const u32 w = part[off * T::WPT + j / T::CPW];
  return (w >> ((j % T::CPW) * T::BITS)) & ((1u << T::BITS) - 1u);
}

// Scores of key row `r` for every head of the block, this lane's share:
// table lookups for a coded row, the scaled query against a raw one.
template <class C, int H>
__device__ __forceinline__ void vq_key_dot(const RowRef<C>& r, int tl, const float* s_q, const float* lut,
                                           float (&s)[H]) {
  typedef typename C::K K;
  if (r.part != nullptr) {
    for (int j = tl; j < K::VSUB; j += K::TEAM) {
      const u32 c = vq_code<K>(r.part, r.off, j);
#pragma unroll
      for (int h = 0; h < H; ++h) s[h] += lut[(h * K::VSUB + j) * K::VENT + c];
    }
  } else {
    for (int d = tl; d < C::D; d += K::TEAM) {
      const float x = Act<C::ACT>::load(r.raw[d]);
#pragma unroll
      for (int h = 0; h < H; ++h) s[h] = fmaf(s_q[h * C::D + d], x, s[h]);
    }
  }
}

// Sub-vectors a value lane owns: tl, tl + TEAM, ... (NJ of them at most).
template <class C> struct VqLanes {
  typedef typename C::V V;
  static constexpr int NJ = (V::VSUB + V::TEAM - 1) / V::TEAM;
  static constexpr int CH = NJ * V::VDIM;  // accumulators per head
};

// acc += p * v for value row `r`, this lane's sub-vectors.
template <class C, int H>
__device__ __forceinline__ void vq_value_acc(const RowRef<C>& r, int tl, const float (&p)[H],
                                             float (&acc)[H][VqLanes<C>::CH], const float* __restrict__ book) {
  typedef typename C::V V;
  constexpr int M = V::VDIM;
#pragma unroll
  for (int u = 0; u < VqLanes<C>::NJ; ++u) {
    const int j = tl + u * V::TEAM;
    if (j >= V::VSUB) break;
    if (r.part != nullptr) {
      const u32 c = vq_code<V>(r.part, r.off, j);
      const float* cent = book + ((u64)j * V::VENT + c) * M;
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float x = cent[i];
#pragma unroll
        for (int h = 0; h < H; ++h) acc[h][u * M + i] = fmaf(p[h], x, acc[h][u * M + i]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < M; ++i) {
        const float x = Act<C::ACT>::load(r.raw[j * M + i]);
#pragma unroll
        for (int h = 0; h < H; ++h) acc[h][u * M + i] = fmaf(p[h], x, acc[h][u * M + i]);
      }
    }
  }
}

// The value teams of one warp summed into the warp's slice of shared memory
// ([H][D]), teams taking turns as teams_to_warp does (a fixed order: the
// output does not depend on the schedule).
template <class C, int H>
__device__ __forceinline__ void vq_teams_to_warp(const float (&acc)[H][VqLanes<C>::CH], float* w_mine, int lane,
                                                 int vl) {
  typedef typename C::V V;
  constexpr int M = V::VDIM;
  constexpr int TEAMS_PER_WARP = 32 / V::TEAM;
  const int team_in_warp = lane / V::TEAM;
#pragma unroll 1
  for (int r = 0; r < TEAMS_PER_WARP; ++r) {
    if (team_in_warp == r) {
#pragma unroll
      for (int u = 0; u < VqLanes<C>::NJ; ++u) {
        const int j = vl + u * V::TEAM;
        if (j < V::VSUB) {
#pragma unroll
          for (int i = 0; i < M; ++i) {
#pragma unroll
            for (int h = 0; h < H; ++h) {
              const int d = j * M + i;
              const float x = acc[h][u * M + i];
              w_mine[h * C::D + d] = r == 0 ? x : w_mine[h * C::D + d] + x;
            }
          }
        }
      }
    }
    __syncwarp();
  }
}

template <class C>
__device__ __forceinline__ void vq_decode_kernel(
    const u32* __restrict__ pool, const u32* __restrict__ tables, int table_stride,
    const int* __restrict__ seq_lens, const typename C::act_t* __restrict__ q,
    const typename C::act_t* __restrict__ sinks_k, const typename C::act_t* __restrict__ sinks_v,
    const typename C::act_t* __restrict__ ring_k, const typename C::act_t* __restrict__ ring_v,
    const float* __restrict__ book_k, const float* __restrict__ book_v,
    float sm_scale, int window, float* __restrict__ part_ml, float* __restrict__ part_acc) {
  typedef typename C::K K;
  typedef typename C::V V;
  typedef Lanes<C, K> LK;
  typedef Lanes<C, V> LV;
  constexpr int H = C::HEADS;
  constexpr int NWARPS = C::THREADS / 32;
  constexpr bool KVQ = K::VQ, VVQ = V::VQ;
  static_assert(KVQ || VVQ, "the vq decode kernel is for schemes with a vq tensor");
  static_assert(C::GROUP_Q % H == 0, "heads per block divide the GQA group");
  // Level tables (Lloyd–Max, nuq) of the other tensor are key_dot's and
  // value_acc's own; the rest of the pipeline is refused upstream.
  static_assert(!K::ROT && !V::ROT && K::OUTL == 0 && V::OUTL == 0 && !K::CENTER && !V::CENTER && !C::ROPE &&
                    K::QGROUP == 0,
                "no rotation, outliers, centering, pre-RoPE keys or int8 query with vq (refused upstream)");
  constexpr int KTEAMS = C::THREADS / K::TEAM;
  constexpr int VTEAMS = C::THREADS / V::TEAM;

  KIVI_SHARED(float, s_p, [H][C::TILE]);
  KIVI_SHARED(float, s_m, [H]);
  KIVI_SHARED(float, s_l, [H]);
  KIVI_SHARED(float, s_corr, [H]);
  KIVI_SHARED(float, s_w, [NWARPS][H][C::D]);
  // vq keys: the scaled query (for raw rows and the table) and the table.
  KIVI_SHARED(float, s_q, [KVQ ? H : 1][KVQ ? C::D : 1]);
  KIVI_SHARED(float, s_lut, [KVQ ? H : 1][KVQ ? K::VSUB : 1][KVQ ? K::VENT : 1]);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int split = blockIdx.x;
  constexpr int CHUNKS = C::GROUP_Q / H;
  const int hk = blockIdx.y / CHUNKS;
  const int hq0 = hk * C::GROUP_Q + (blockIdx.y % CHUNKS) * H;
  const int b = blockIdx.z;

  const int T = seq_lens[b];
  const int start = window >= 0 ? max(T - window, 0) : 0;
  const int len = T - start;
  const int a = start + (int)((long long)len * split / C::SPLITS);
  const int z = start + (int)((long long)len * (split + 1) / C::SPLITS);
  const int qk = quantized_tokens<C, K>(T);
  const int qv = quantized_tokens<C, V>(T);
  const u32* table = tables + (u64)b * table_stride;

  const int kteam = tid / K::TEAM, kl = tid % K::TEAM;
  const int vteam = tid / V::TEAM, vl = tid % V::TEAM;
  const float qscale = sm_scale * 1.4426950408889634f;

  // The query: in shared memory with its lookup table (vq keys), or this
  // lane's slice in registers as kivi_decode.cuh keeps it.
  float qr[H][KVQ ? 1 : LK::CH];
  float qsum[H][KVQ ? 1 : LK::SLOTS];
  if constexpr (KVQ) {
    for (int e = tid; e < H * C::D; e += C::THREADS) {
      const int h = e / C::D, d = e % C::D;
      s_q[h][d] = Act<C::ACT>::load(q[((u64)b * C::HQ + hq0 + h) * C::D + d]) * qscale;
    }
    __syncthreads();
    constexpr int M = K::VDIM;
    for (int e = tid; e < H * K::VSUB * K::VENT; e += C::THREADS) {
      const int h = e / (K::VSUB * K::VENT), j = (e / K::VENT) % K::VSUB, c = e % K::VENT;
      const float* cent = book_k + ((u64)j * K::VENT + c) * M;
      float x = 0.0f;
#pragma unroll
      for (int i = 0; i < M; ++i) x = fmaf(s_q[h][j * M + i], cent[i], x);
      s_lut[h][j][c] = x;
    }
  } else {
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
            const float x = d < C::D ? Act<C::ACT>::load(qh[d]) * qscale : 0.0f;
            qr[h][slot * K::CPW + i] = x;
            qsum[h][slot] += x;
          }
        }
      }
    }
  }
  constexpr int VCH = VVQ ? VqLanes<C>::CH : LV::CH;
  float acc[H][VCH];
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int c = 0; c < VCH; ++c) acc[h][c] = 0.0f;
  if (tid < H) {
    s_m[tid] = neg_inf();
    s_l[tid] = 0.0f;
  }
  __syncthreads();

  for (int t0 = a; t0 < z; t0 += C::TILE) {
    const int n = min(C::TILE, z - t0);
    // 1. scores (every team runs the same trip count for the shuffles).
#pragma unroll 1
    for (int i0 = 0; i0 < C::TILE; i0 += KTEAMS) {
      const int i = i0 + kteam;
      float s[H];
#pragma unroll
      for (int h = 0; h < H; ++h) s[h] = 0.0f;
      if (i < n) {
        const RowRef<C> r = locate<C, K>(t0 + i, qk, pool, table, b, hk, sinks_k, ring_k);
        if constexpr (KVQ) {
          vq_key_dot<C, H>(r, kl, &s_q[0][0], &s_lut[0][0][0], s);
        } else {
          key_dot<C, H>(r, kl, qr, qsum, nullptr, s);
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
      float sum = 0.0f;
      for (int i = lane; i < n; i += 32) {
        const float e = exp2f(s_p[h][i] - m_new);
        s_p[h][i] = e;
        sum += e;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(KIVI_FULL_MASK, sum, o);
      if (lane == 0) {
        const float corr = exp2f(m_old - m_new);
        s_corr[h] = corr;
        s_l[h] = s_l[h] * corr + sum;
        s_m[h] = m_new;
      }
    }
    __syncthreads();
    // 3. values.
#pragma unroll
    for (int h = 0; h < H; ++h) {
      const float corr = s_corr[h];
#pragma unroll
      for (int c = 0; c < VCH; ++c) acc[h][c] *= corr;
    }
#pragma unroll C::UNROLL
    for (int i = vteam; i < n; i += VTEAMS) {
      float pr[H];
#pragma unroll
      for (int h = 0; h < H; ++h) pr[h] = s_p[h][i];
      const RowRef<C> r = locate<C, V>(t0 + i, qv, pool, table, b, hk, sinks_v, ring_v);
      if constexpr (VVQ) {
        vq_value_acc<C, H>(r, vl, pr, acc, book_v);
      } else {
        value_acc<C, H, LV::CH>(r, vl, pr, acc, acc);
      }
    }
    __syncthreads();  // s_p is overwritten by the next tile
  }

  if constexpr (VVQ) {
    vq_teams_to_warp<C, H>(acc, &s_w[warp][0][0], lane, vl);
  } else {
    teams_to_warp<C, H, LV::CH>(acc, &s_w[warp][0][0], lane, vl);
  }
  __syncthreads();
  const u64 row0 = ((u64)b * C::HQ + hq0) * C::SPLITS + split;
  for (int e = tid; e < H * C::D; e += C::THREADS) {
    const int h = e / C::D, d = e % C::D;
    float x = 0.0f;
#pragma unroll
    for (int w = 0; w < NWARPS; ++w) x += s_w[w][h][d];
    part_acc[(row0 + (u64)h * C::SPLITS) * C::D + d] = x;
  }
  if (tid < H) {
    part_ml[(row0 + (u64)tid * C::SPLITS) * 2 + 0] = s_m[tid];
    part_ml[(row0 + (u64)tid * C::SPLITS) * 2 + 1] = s_l[tid];
  }
}

}  // namespace kivi
