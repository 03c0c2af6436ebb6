// kivi_vq_extend.cuh — prefill and append for schemes with a vq(...) tensor:
// the vq tensor's tokens that leave the window are coded on the device,
// bit for bit as kivi_runtime::vq::VqBook::encode codes them; the other
// tensor goes through kivi_extend.cuh's extend_tensor unchanged.
//
// Exactness. A code is the index of the centroid at the least squared L2
// distance, the distance summed in f32 in channel order, the first index
// among equal distances. A near-tie is decided by the last bit of that sum,
// so the sum is spelled with __fsub_rn / __fmul_rn / __fadd_rn (never
// contracted into an FMA, whatever --fmad says) and compared with a strict
// `<` in centroid order: the same operations in the same order as the
// oracle's loop, so the same codes.
//
// Work. One thread per (token, code word) codes the word's sub-vectors:
// E x M multiply-adds each, reading the codebook (a kernel argument,
// f32 [D / M][E][M]) from global memory. An append of one token keeps only
// D / M / CPW threads of a block busy (4 at D = 128, M = 8, E = 256), which
// is enough for a decode step's few rows; a wider split (threads over
// centroids, then an arg-min reduction in shared memory) is the next step
// if prefill throughput matters.

namespace kivi {

template <class C, class T>
__device__ __forceinline__ void vq_extend_tensor(u32* __restrict__ pool, const u32* __restrict__ table, int b, int h,
                                                 int old, int n, const typename C::act_t* __restrict__ fresh,
                                                 int max_new, typename C::act_t* __restrict__ sinks,
                                                 typename C::act_t* __restrict__ ring, const float* __restrict__ book,
                                                 int* __restrict__ status) {
  typedef typename C::act_t act_t;
  constexpr int M = T::VDIM;
  const int tid = threadIdx.x;
  const int q0 = quantized_tokens<C, T>(old);
  const int q1 = quantized_tokens<C, T>(old + n);
  // Non-finite input is refused here too, whatever the host checked (status 2).
  for (int e = tid; e < n * C::D; e += C::THREADS) {
    const float x = Act<C::ACT>::load(fresh[((u64)b * max_new + e / C::D) * C::HKV * C::D + (u64)h * C::D + e % C::D]);
    if (!is_finite(x)) status[b] = 2;
  }
  for (int e = tid; e < (q1 - q0) * T::WPT; e += C::THREADS) {
    const int j = q0 + e / T::WPT, w = e % T::WPT;
    u32 word = 0;
    for (int i = 0; i < T::CPW; ++i) {
      const int s = w * T::CPW + i;
      if (s >= T::VSUB) break;
      float x[M];
#pragma unroll
      for (int m = 0; m < M; ++m)
        x[m] = Act<C::ACT>::load(extend_src<C, T>(j, s * M + m, b, h, old, max_new, fresh, ring));
      float best = __int_as_float(0x7f800000);  // +inf, as the oracle starts
      u32 bi = 0;
      for (int c = 0; c < T::VENT; ++c) {
        const float* cent = book + ((u64)s * T::VENT + c) * M;
        float d = 0.0f;
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float df = __fsub_rn(x[m], cent[m]);
          d = __fadd_rn(d, __fmul_rn(df, df));
        }
        if (d < best) {
          best = d;
          bi = (u32)c;
        }
      }
      word |= bi << (i * T::BITS);
    }
    u32* part = pool + part_offset<C, T>(table[j / C::BLOCK_TOKENS], h);
    part[(j % C::BLOCK_TOKENS) * T::WPT + w] = word;
  }
  __syncthreads();  // every ring row is read before any is overwritten

  // The new tokens that stay unquantized: sinks, then the window ring.
  constexpr int slots = T::RING > 0 ? T::RING : 1;
  for (int e = tid; e < n * C::D; e += C::THREADS) {
    const int t = e / C::D, d = e % C::D;
    const int p = old + t;
    const act_t x = fresh[((u64)b * max_new + t) * C::HKV * C::D + (u64)h * C::D + d];
    if (p < C::SINKS) {
      sinks[((u64)(b * C::SINKS + p) * C::HKV + h) * C::D + d] = x;
    } else if (p - C::SINKS >= q1) {
      ring[((u64)(b * slots + (p - C::SINKS) % slots) * C::HKV + h) * C::D + d] = x;
    }
  }
}

// Grid (HKV, 2, batch), as extend_kernel: blockIdx.y picks the key (0) or
// the value (1); a vq tensor is coded here, the other by extend_tensor.
template <class C>
__device__ __forceinline__ void vq_extend_kernel(
    u32* __restrict__ pool, const u32* __restrict__ tables, int table_stride, const int* __restrict__ old_lens,
    const int* __restrict__ new_counts, const typename C::act_t* __restrict__ k_new,
    const typename C::act_t* __restrict__ v_new, int max_new, typename C::act_t* __restrict__ sinks_k,
    typename C::act_t* __restrict__ sinks_v, typename C::act_t* __restrict__ ring_k,
    typename C::act_t* __restrict__ ring_v, const float* __restrict__ book_k, const float* __restrict__ book_v,
    float* __restrict__ work, int* __restrict__ status) {
  typedef typename C::K K;
  typedef typename C::V V;
  const int h = blockIdx.x;
  const int b = blockIdx.z;
  const u32* table = tables + (u64)b * table_stride;
  if (blockIdx.y == 0) {
    if constexpr (K::VQ) {
      vq_extend_tensor<C, K>(pool, table, b, h, old_lens[b], new_counts[b], k_new, max_new, sinks_k, ring_k, book_k,
                             status);
    } else {
      // (no centering with vq: the means pointer is never read)
      extend_tensor<C, K>(pool, table, b, h, old_lens[b], new_counts[b], k_new, max_new, sinks_k, ring_k, nullptr,
                          work, 0, status);
    }
  } else {
    if constexpr (V::VQ) {
      vq_extend_tensor<C, V>(pool, table, b, h, old_lens[b], new_counts[b], v_new, max_new, sinks_v, ring_v, book_v,
                             status);
    } else {
      extend_tensor<C, V>(pool, table, b, h, old_lens[b], new_counts[b], v_new, max_new, sinks_v, ring_v, nullptr,
                          work, 1, status);
    }
  }
}

}  // namespace kivi
