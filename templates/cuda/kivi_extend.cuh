// kivi_extend.cuh — quantize-and-pack: prefill (many tokens) and append (one
// decode step), writing exactly the words kivi_runtime::PagedCache::extend
// writes.
//
// One block = (KV head, tensor, sequence). Adding `n` tokens to a sequence
// of `old` tokens moves the tensor's quantized count from q0 to q1
// (kivi_spec::layout::regions): the tokens q0..q1 (counted after the sinks)
// leave the window and are quantized into their blocks — channel-axis
// tensors G tokens at a time (one scale and zero point per channel), token-
// axis tensors a chunk of tokens at a time (one per G channels), `full` tensors
// stored raw. Their rows come from the window ring (older tokens) or the new
// input. Only then are the new tokens that stay unquantized written to the
// sink buffer or the ring: a ring slot that is flushed now is the slot the
// newest token reuses.
//
// Parameters of a group are computed by one thread per group and staged in
// shared memory; codes are packed by one thread per word, so no two threads
// ever write one word. A scale or zero point that overflows its dtype sets
// status[b] = 1, a non-finite input value status[b] = 2 (PagedCache refuses
// such an append; so must the caller, and undo what the launch wrote), an
// outlier correction the activation dtype cannot hold status[b] = 3.
//
// A tensor with a codec pipeline (T::PIPE) goes through extend_pipe: its
// centering means are taken (once the first CENTER_N tokens exist) into
// the per-sequence `means` buffer, its rows transformed into the `work`
// scratch, and codes, norms and outliers written from there.

namespace kivi {

// Raw element of relative token `j` (position SINKS + j), channel `d`.
template <class C, class T>
__device__ __forceinline__ typename C::act_t extend_src(int j, int d, int b, int h, int old, int max_new,
                                                        const typename C::act_t* __restrict__ fresh,
                                                        const typename C::act_t* ring) {
  const int p = C::SINKS + j;
  if (p >= old) return fresh[((u64)b * max_new + (p - old)) * C::HKV * C::D + (u64)h * C::D + d];
  constexpr int slots = T::RING > 0 ? T::RING : 1;
  return ring[((u64)(b * slots + j % slots) * C::HKV + h) * C::D + d];
}

// Writes parameters `base .. base + count` of a section from s_v (f16 pairs
// share a word: the half that belongs to another group is kept).
template <class T>
__device__ __forceinline__ void store_params(u32* sec, int base, int count, const float* s_v, int tid, int threads) {
  if constexpr (T::SCALE_F32) {
    for (int e = tid; e < count; e += threads) sec[base + e] = __float_as_uint(s_v[e]);
  } else {
    const int w0 = base >> 1, w1 = (base + count - 1) >> 1;
    for (int w = w0 + tid; w <= w1; w += threads) {
      u32 word = sec[w];
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = 2 * w + half;
        if (i >= base && i < base + count) {
          word = (word & ~(0xffffu << (16 * half))) | (scale_bits<T>(s_v[i - base]) << (16 * half));
        }
      }
      sec[w] = word;
    }
  }
}

// The codec pipeline's write steps, defined in kivi_codec_extend.cuh
// (pasted only into sources whose scheme has a pipeline; the call below
// sits in an `if constexpr` branch other schemes never instantiate): the
// centering means once the first CENTER_N tokens exist, then relative
// tokens [q0, q1) centered, rotated, outliers taken out, quantized.
template <class C, class T, class X>
__device__ void extend_codec(u32* __restrict__ pool, const u32* __restrict__ table, int b, int h, int old, int n,
                             int q0, int q1, const X& x_at, int max_new, const typename C::act_t* __restrict__ fresh,
                             const typename C::act_t* sinks, const typename C::act_t* ring,
                             typename C::act_t* __restrict__ means, float* __restrict__ work, int y, float* s_s,
                             float* s_z, int* __restrict__ status, int tid);

template <class C, class T>
__device__ __forceinline__ void extend_tensor(u32* __restrict__ pool, const u32* __restrict__ table, int b, int h,
                                              int old, int n, const typename C::act_t* __restrict__ fresh,
                                              int max_new, typename C::act_t* __restrict__ sinks,
                                              typename C::act_t* __restrict__ ring, typename C::act_t* __restrict__ means,
                                              float* __restrict__ work, int y, int* __restrict__ status) {
  typedef typename C::act_t act_t;
  KIVI_SHARED(float, s_s, [C::D]);  // scales of the group(s) being quantized
  KIVI_SHARED(float, s_z, [C::D]);  // zero points
  const int tid = threadIdx.x;
  const int q0 = quantized_tokens<C, T>(old);
  const int q1 = quantized_tokens<C, T>(old + n);
  auto x_at = [&](int j, int d) -> float {
    return Act<C::ACT>::load(extend_src<C, T>(j, d, b, h, old, max_new, fresh, ring));
  };
  // Non-finite input is refused here too, whatever the host checked: the
  // caller restores what this launch wrote (status 2).
  for (int e = tid; e < n * C::D; e += C::THREADS) {
    const float x = Act<C::ACT>::load(fresh[((u64)b * max_new + e / C::D) * C::HKV * C::D + (u64)h * C::D + e % C::D]);
    if (!is_finite(x)) status[b] = 2;
  }

  if constexpr (T::PIPE) {
    extend_codec<C, T>(pool, table, b, h, old, n, q0, q1, x_at, max_new, fresh, sinks, ring, means, work, y, s_s, s_z,
                       status, tid);
  } else if constexpr (!T::QUANT) {
    // `full`: the rows go to the blocks as they are, two 16-bit values or
    // one f32 per word (the upper half of an odd row's last word is zero).
    for (int e = tid; e < (q1 - q0) * T::WPT; e += C::THREADS) {
      const int j = q0 + e / T::WPT, w = e % T::WPT;
      u32* part = pool + part_offset<C, T>(table[j / C::BLOCK_TOKENS], h);
      u32 word;
      if constexpr (C::ACT == ACT_F32) {
        word = __float_as_uint(extend_src<C, T>(j, w, b, h, old, max_new, fresh, ring));
      } else {
        const u32 lo = extend_src<C, T>(j, 2 * w, b, h, old, max_new, fresh, ring);
        const u32 hi = 2 * w + 1 < C::D ? (u32)extend_src<C, T>(j, 2 * w + 1, b, h, old, max_new, fresh, ring) : 0u;
        word = lo | (hi << 16);
      }
      part[(j % C::BLOCK_TOKENS) * T::WPT + w] = word;
    }
  } else if constexpr (!T::TOKEN_AXIS) {
    // channel axis: G tokens at a time, a scale and zero point per channel
    constexpr float maxc = (float)((1u << T::BITS) - 1u);
    for (int j0 = q0; j0 < q1; j0 += T::GROUP) {
      for (int d = tid; d < C::D; d += C::THREADS) {
        float lo = __int_as_float(0x7f800000), hi = neg_inf();
        for (int k = 0; k < T::GROUP; ++k) {
          const float x = x_at(j0 + k, d);
          lo = fminf(lo, x);
          hi = fmaxf(hi, x);
        }
        const float sc = round_scale<T>(__fdiv_rn(__fsub_rn(hi, lo), maxc));
        const float zp = round_scale<T>(lo);
        if (!is_finite(sc) || !is_finite(zp)) status[b] = 1;
        s_s[d] = sc;
        s_z[d] = zp;
      }
      __syncthreads();
      u32* part = pool + part_offset<C, T>(table[j0 / C::BLOCK_TOKENS], h);
      const int base = param_index<C, T>(j0 % C::BLOCK_TOKENS, 0);
      store_params<T>(part + T::SCALES, base, C::D, s_s, tid, C::THREADS);
      store_params<T>(part + T::ZEROS, base, C::D, s_z, tid, C::THREADS);
      for (int e = tid; e < T::GROUP * T::WPT; e += C::THREADS) {
        const int k = e / T::WPT, w = e % T::WPT;
        u32 word = 0;
        for (int i = 0; i < T::CPW; ++i) {
          const int d = w * T::CPW + i;
          if (d < C::D) word |= encode<T>(x_at(j0 + k, d), s_s[d], s_z[d]) << (i * T::BITS);
        }
        part[((j0 + k) % C::BLOCK_TOKENS) * T::WPT + w] = word;
      }
      __syncthreads();
    }
  } else {
    // token axis: a scale and zero point per G channels of each token; a
    // chunk of tokens (inside one block) at a time, so that every thread has
    // a group to reduce even when a token has few groups.
    constexpr float maxc = (float)((1u << T::BITS) - 1u);
    constexpr int NG = C::D / T::GROUP;
    // tokens per chunk: a group per thread, at most G (so CHUNK * NG <= D
    // fits the staging arrays)
    constexpr int BY_THREADS = C::THREADS / NG;
    constexpr int CHUNK = BY_THREADS < 1 ? 1 : (BY_THREADS < T::GROUP ? BY_THREADS : T::GROUP);
    for (int j0 = q0; j0 < q1;) {
      const int nt = min(min(CHUNK, q1 - j0), C::BLOCK_TOKENS - j0 % C::BLOCK_TOKENS);
      for (int e = tid; e < nt * NG; e += C::THREADS) {
        const int t = e / NG, g = e % NG;
        float lo = __int_as_float(0x7f800000), hi = neg_inf();
        for (int c = 0; c < T::GROUP; ++c) {
          const float x = x_at(j0 + t, g * T::GROUP + c);
          lo = fminf(lo, x);
          hi = fmaxf(hi, x);
        }
        const float sc = round_scale<T>(__fdiv_rn(__fsub_rn(hi, lo), maxc));
        const float zp = round_scale<T>(lo);
        if (!is_finite(sc) || !is_finite(zp)) status[b] = 1;
        s_s[e] = sc;
        s_z[e] = zp;
      }
      __syncthreads();
      u32* part = pool + part_offset<C, T>(table[j0 / C::BLOCK_TOKENS], h);
      const int off = j0 % C::BLOCK_TOKENS;
      store_params<T>(part + T::SCALES, param_index<C, T>(off, 0), nt * NG, s_s, tid, C::THREADS);
      store_params<T>(part + T::ZEROS, param_index<C, T>(off, 0), nt * NG, s_z, tid, C::THREADS);
      for (int e = tid; e < nt * T::WPT; e += C::THREADS) {
        const int t = e / T::WPT, w = e % T::WPT;
        u32 word = 0;
        for (int i = 0; i < T::CPW; ++i) {
          const int d = w * T::CPW + i;
          if (d < C::D) {
            const int g = t * NG + d / T::GROUP;
            word |= encode<T>(x_at(j0 + t, d), s_s[g], s_z[g]) << (i * T::BITS);
          }
        }
        part[(off + t) * T::WPT + w] = word;
      }
      __syncthreads();
      j0 += nt;
    }
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

// Grid (HKV, 2, batch): blockIdx.y picks the key (0) or the value (1).
template <class C>
__device__ __forceinline__ void extend_kernel(u32* __restrict__ pool, const u32* __restrict__ tables, int table_stride,
                                              const int* __restrict__ old_lens, const int* __restrict__ new_counts,
                                              const typename C::act_t* __restrict__ k_new,
                                              const typename C::act_t* __restrict__ v_new, int max_new,
                                              typename C::act_t* __restrict__ sinks_k,
                                              typename C::act_t* __restrict__ sinks_v,
                                              typename C::act_t* __restrict__ ring_k,
                                              typename C::act_t* __restrict__ ring_v,
                                              typename C::act_t* __restrict__ means_k,
                                              typename C::act_t* __restrict__ means_v, float* __restrict__ work,
                                              int* __restrict__ status) {
  const int h = blockIdx.x;
  const int b = blockIdx.z;
  const u32* table = tables + (u64)b * table_stride;
  if (blockIdx.y == 0) {
    extend_tensor<C, typename C::K>(pool, table, b, h, old_lens[b], new_counts[b], k_new, max_new, sinks_k, ring_k,
                                    means_k, work, 0, status);
  } else {
    extend_tensor<C, typename C::V>(pool, table, b, h, old_lens[b], new_counts[b], v_new, max_new, sinks_v, ring_v,
                                    means_v, work, 1, status);
  }
}

}  // namespace kivi
