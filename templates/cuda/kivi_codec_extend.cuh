// kivi_codec_extend.cuh — the codec pipeline's write steps (DESIGN.md §8),
// pasted after kivi_extend.cuh into the sources of schemes that have a
// pipeline: kivi_runtime::quant::TensorCodec's center, rotate, take out
// outliers, quantize (uniform or Lloyd–Max), bit for bit.

namespace kivi {

// ---- the codec pipeline on the write side, bit-exact with
// kivi_runtime::quant (every f64 and f32 step an unfused _rn intrinsic) ----

// An f32 rounded to the activation dtype (round to nearest even), as stored.
template <class C> __device__ __forceinline__ typename C::act_t to_act(float x) {
  if constexpr (C::ACT == ACT_F32) {
    return x;
  } else if constexpr (C::ACT == ACT_F16) {
    return __half_as_ushort(__float2half_rn(x));
  } else {
    const u32 u = __float_as_uint(x);  // finite or inf here; NaN is never stored
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

// Storage bits of an activation value in a 32-bit word's half (or the word).
template <class C> __device__ __forceinline__ u32 act_bits(typename C::act_t x) {
  if constexpr (C::ACT == ACT_F32) {
    return __float_as_uint(x);
  } else {
    return (u32)x;
  }
}

// quant::lloyd_encode: how many thresholds (L_i + L_{i+1}) / 2 lie below
// `x / norm` (a norm of 0 encodes 0).
template <class T> __device__ __forceinline__ u32 lloyd_code(float x, float norm) {
  const float y = norm == 0.0f ? 0.0f : __fdiv_rn(x, norm);
  u32 c = 0;
#pragma unroll
  for (int i = 0; i + 1 < (1 << T::BITS); ++i) {
    if (y > __fmul_rn(__fadd_rn(T::level(i), T::level(i + 1)), 0.5f)) ++c;
  }
  return c;
}

// The code of `x` in a group with stored scale `s` and encoding parameter
// `z` (the zero point; the rms a Lloyd–Max group divides by). A table with
// a zero point (quant::minmax_group_in) codes (x - z) / s, and 0 when s == 0.
template <class T> __device__ __forceinline__ u32 pipe_code(float x, float s, float z) {
  if constexpr (MinMax<T>::value) {
    return s == 0.0f ? 0u : lloyd_code<T>(__fsub_rn(x, z), s);
  } else if constexpr (T::LLOYD) {
    return lloyd_code<T>(x, z);
  } else {
    return encode<T>(x, s, z);
  }
}

// The per-channel means of the first CENTER_N tokens of sequence `b`, KV
// head `h` (quant::channel_mean: f64 sums in token order), stored in the
// activation dtype once those tokens exist. Tokens before `old` come from
// the sink buffer and the window ring (no ring slot has wrapped yet: the
// scheme's validation keeps CENTER_N <= sinks + residual).
template <class C, class T>
__device__ __forceinline__ void center_means(int b, int h, int old, int n, int max_new,
                                             const typename C::act_t* __restrict__ fresh,
                                             const typename C::act_t* sinks, const typename C::act_t* ring,
                                             typename C::act_t* means, int tid) {
  if (!(old < T::CENTER_N && old + n >= T::CENTER_N)) return;
  constexpr int slots = T::RING > 0 ? T::RING : 1;
  for (int d = tid; d < C::D; d += C::THREADS) {
    double sum = 0.0;
    for (int p = 0; p < T::CENTER_N; ++p) {
      typename C::act_t x;
      if (p >= old) {
        x = fresh[((u64)b * max_new + (p - old)) * C::HKV * C::D + (u64)h * C::D + d];
      } else if (p < C::SINKS) {
        x = sinks[((u64)(b * C::SINKS + p) * C::HKV + h) * C::D + d];
      } else {
        x = ring[((u64)(b * slots + (p - C::SINKS) % slots) * C::HKV + h) * C::D + d];
      }
      sum = __dadd_rn(sum, (double)Act<C::ACT>::load(x));
    }
    means[((u64)b * C::HKV + h) * C::D + d] = to_act<C>(__double2float_rn(__ddiv_rn(sum, (double)T::CENTER_N)));
  }
}

// Quantizes relative tokens [q0, q1) of a tensor with a codec pipeline
// (kivi_runtime::cache::quantize_range, step for step): per unit of rows
// (a channel group, or up to UNIT tokens inside one block) each row is
// centered, sign-flipped and Hadamard-rotated (f64 butterflies, one
// rounding) by one thread into the scratch `wk`, its OUTL largest entries
// taken out; then one thread per group computes its parameters (min/max,
// or the Lloyd–Max rms / l2 norm), one thread per word packs codes, and
// one thread per row stores its outliers' channels and corrections.
template <class C, class T, class X>
__device__ __forceinline__ void extend_pipe(u32* __restrict__ pool, const u32* __restrict__ table, int b, int h,
                                            int q0, int q1, const X& x_at, const typename C::act_t* mrow,
                                            float* wk, float* s_s, float* s_z, int* __restrict__ status, int tid) {
  constexpr int D = C::D;
  constexpr int G = T::GROUP;
  constexpr int NG = T::TOKEN_AXIS ? D / G : 1;
  constexpr int K = T::OUTL;
  float* rows = wk;                      // [UNIT][D] transformed rows
  float* o_idx = wk + T::UNIT * D;       // [UNIT][K] outlier channels
  float* o_val = o_idx + T::UNIT * K;    // [UNIT][K] their values
  for (int j0 = q0; j0 < q1;) {
    int nt = G;  // channel axis: one group of G tokens (never straddles a block)
    if constexpr (T::TOKEN_AXIS) nt = min(min(T::UNIT, q1 - j0), C::BLOCK_TOKENS - j0 % C::BLOCK_TOKENS);
    // A. one thread per row: center, rotate, take the outliers out. (Loops
    // over a row stay rolled: unrolled, a 256-channel row's butterflies
    // spill thousands of registers; the buffer lives in local memory.)
    for (int r = tid; r < nt; r += C::THREADS) {
      float* y = rows + r * D;
#pragma unroll 1
      for (int d = 0; d < D; ++d) {
        float x = x_at(j0 + r, d);
        if constexpr (T::CENTER) x = __fsub_rn(x, Act<C::ACT>::load(mrow[d]));
        if constexpr (T::ROT && T::SIGNS) {
          if (flip<T>(d)) x = -x;
        }
        y[d] = x;
      }
      if constexpr (T::ROT) {
        constexpr int B = T::ROT_BLOCK;
        const double norm = __ddiv_rn(1.0, __dsqrt_rn((double)B));
        double buf[B];
#pragma unroll 1
        for (int c0 = 0; c0 < D; c0 += B) {
#pragma unroll 1
          for (int i = 0; i < B; ++i) buf[i] = (double)y[c0 + i];
#pragma unroll 1
          for (int len = 1; len < B; len <<= 1) {
#pragma unroll 1
            for (int i = 0; i < B; i += 2 * len) {
#pragma unroll 1
              for (int jj = i; jj < i + len; ++jj) {
                const double a = buf[jj], c = buf[jj + len];
                buf[jj] = __dadd_rn(a, c);
                buf[jj + len] = __dsub_rn(a, c);
              }
            }
          }
#pragma unroll 1
          for (int i = 0; i < B; ++i) y[c0 + i] = __double2float_rn(__dmul_rn(buf[i], norm));
        }
      }
      if constexpr (K > 0) {
        // quant::top_k_abs: largest magnitude first, ties to the lower
        // channel; then listed by channel
        int sel[K];
        for (int k = 0; k < K; ++k) {
          int best = 0;
          float bv = -1.0f;
#pragma unroll 1
          for (int c = 0; c < D; ++c) {
            bool taken = false;
            for (int i = 0; i < k; ++i) taken = taken || sel[i] == c;
            const float a = fabsf(y[c]);
            if (!taken && a > bv) {
              bv = a;
              best = c;
            }
          }
          sel[k] = best;
        }
        for (int k = 1; k < K; ++k) {
          for (int i = k; i > 0 && sel[i - 1] > sel[i]; --i) {
            const int t = sel[i];
            sel[i] = sel[i - 1];
            sel[i - 1] = t;
          }
        }
        for (int k = 0; k < K; ++k) {
          o_idx[r * K + k] = (float)sel[k];
          o_val[r * K + k] = y[sel[k]];
          y[sel[k]] = 0.0f;
        }
      }
    }
    __syncthreads();
    // B. one thread per group: its stored scale (s_s) and encoding parameter (s_z)
    const int ngroups = T::TOKEN_AXIS ? nt * NG : D;
    for (int e = tid; e < ngroups; e += C::THREADS) {
      auto member = [&](int i) -> float {
        if constexpr (T::TOKEN_AXIS) {
          return rows[(e / NG) * D + (e % NG) * G + i];
        } else {
          return rows[i * D + e];
        }
      };
      if constexpr (MinMax<T>::value) {
        // quant::minmax_group_in: s = hi - lo and z = lo, each rounded to
        // the scale dtype; lo and hi as quant::group_lo_hi orders them (-0
        // below +0: the zero point's sign is stored)
        float lo = __int_as_float(0x7f800000), hi = neg_inf();
#pragma unroll 1
        for (int i = 0; i < G; ++i) {
          const float x = member(i);
          const bool neg = (__float_as_uint(x) >> 31) != 0;
          if (x < lo || (x == lo && neg)) lo = x;
          if (x > hi || (x == hi && !neg)) hi = x;
        }
        const float sc = round_scale<T>(__fsub_rn(hi, lo));
        const float zp = round_scale<T>(lo);
        if (!is_finite(sc) || !is_finite(zp)) status[b] = 1;
        s_s[e] = sc;
        s_z[e] = zp;
      } else if constexpr (T::LLOYD) {
        double ss = 0.0;
#pragma unroll 1
        for (int i = 0; i < G; ++i) {
          const double x = (double)member(i);
          ss = __dadd_rn(ss, __dmul_rn(x, x));
        }
        const float rms = round_scale<T>(__double2float_rn(__dsqrt_rn(__ddiv_rn(ss, (double)G))));
        float sc = rms;
        if constexpr (T::L2) {
          // the stored norm keeps the decoded group's L2 norm: ||x|| / ||L[c]||
          double lc = 0.0;
#pragma unroll 1
          for (int i = 0; i < G; ++i) {
            const double l = (double)T::level(lloyd_code<T>(member(i), rms));
            lc = __dadd_rn(lc, __dmul_rn(l, l));
          }
          sc = (lc == 0.0 || ss == 0.0) ? 0.0f : round_scale<T>(__double2float_rn(__dsqrt_rn(__ddiv_rn(ss, lc))));
        }
        if (!is_finite(sc)) status[b] = 1;
        s_s[e] = sc;
        s_z[e] = rms;
      } else {
        constexpr float maxc = (float)((1u << T::BITS) - 1u);
        float lo = __int_as_float(0x7f800000), hi = neg_inf();
#pragma unroll 1
        for (int i = 0; i < G; ++i) {
          lo = fminf(lo, member(i));
          hi = fmaxf(hi, member(i));
        }
        const float sc = round_scale<T>(__fdiv_rn(__fsub_rn(hi, lo), maxc));
        const float zp = round_scale<T>(lo);
        if (!is_finite(sc) || !is_finite(zp)) status[b] = 1;
        s_s[e] = sc;
        s_z[e] = zp;
      }
    }
    __syncthreads();
    // C. parameters (Lloyd–Max and table codes without a zero point: norms only)
    u32* part = pool + part_offset<C, T>(table[j0 / C::BLOCK_TOKENS], h);
    const int off = j0 % C::BLOCK_TOKENS;
    store_params<T>(part + T::SCALES, param_index<C, T>(off, 0), ngroups, s_s, tid, C::THREADS);
    if constexpr (HasZero<T>::value) store_params<T>(part + T::ZEROS, param_index<C, T>(off, 0), ngroups, s_z, tid, C::THREADS);
    // D. codes, one thread per word
    auto group_of = [&](int t, int d) -> int {
      if constexpr (T::TOKEN_AXIS) {
        return t * NG + d / G;
      } else {
        return d;
      }
    };
    for (int e = tid; e < nt * T::WPT; e += C::THREADS) {
      const int t = e / T::WPT, w = e % T::WPT;
      u32 word = 0;
      for (int i = 0; i < T::CPW; ++i) {
        const int d = w * T::CPW + i;
        if (d < D) {
          const int g = group_of(t, d);
          word |= pipe_code<T>(rows[t * D + d], s_s[g], s_z[g]) << (i * T::BITS);
        }
      }
      part[(off + t) * T::WPT + w] = word;
    }
    // E. outliers: channel and correction x - x^ in the activation dtype
    if constexpr (K > 0) {
      for (int t = tid; t < nt; t += C::THREADS) {
        const int o = off + t;
        typename C::act_t corr[K];
        int ch[K];
        for (int k = 0; k < K; ++k) {
          ch[k] = (int)o_idx[t * K + k];
          const int g = group_of(t, ch[k]);
          const u32 code = pipe_code<T>(rows[t * D + ch[k]], s_s[g], s_z[g]);
          float deq;
          if constexpr (MinMax<T>::value) {
            deq = __fadd_rn(__fmul_rn(s_s[g], T::level(code)), s_z[g]);  // quant::dequantize_in
          } else if constexpr (T::LLOYD) {
            deq = __fmul_rn(s_s[g], T::level(code));
          } else {
            deq = __fadd_rn(__fmul_rn((float)code, s_s[g]), s_z[g]);
          }
          const float c = Act<C::ACT>::load(to_act<C>(__fsub_rn(o_val[t * K + k], deq)));
          if (!is_finite(c)) status[b] = 3;
          corr[k] = to_act<C>(c);
        }
        for (int w = 0; w < T::OIW; ++w) {
          const u32 hi = 2 * w + 1 < K ? (u32)ch[2 * w + 1] : 0u;
          part[T::OIDX + o * T::OIW + w] = (u32)ch[2 * w] | (hi << 16);
        }
        for (int w = 0; w < T::OVW; ++w) {
          if constexpr (C::ACT == ACT_F32) {
            part[T::OVAL + o * T::OVW + w] = act_bits<C>(corr[w]);
          } else {
            const u32 hi = 2 * w + 1 < K ? act_bits<C>(corr[2 * w + 1]) : 0u;
            part[T::OVAL + o * T::OVW + w] = act_bits<C>(corr[2 * w]) | (hi << 16);
          }
        }
      }
    }
    __syncthreads();
    j0 += nt;
  }
}

template <class C, class T, class X>
__device__ void extend_codec(u32* __restrict__ pool, const u32* __restrict__ table, int b, int h, int old, int n,
                             int q0, int q1, const X& x_at, int max_new, const typename C::act_t* __restrict__ fresh,
                             const typename C::act_t* sinks, const typename C::act_t* ring,
                             typename C::act_t* __restrict__ means, float* __restrict__ work, int y, float* s_s,
                             float* s_z, int* __restrict__ status, int tid) {
  if constexpr (T::CENTER) {
    center_means<C, T>(b, h, old, n, max_new, fresh, sinks, ring, means, tid);
    __syncthreads();  // the means are read back by every thread below
  }
  extend_pipe<C, T>(pool, table, b, h, q0, q1, x_at, means + ((u64)b * C::HKV + h) * C::D,
                    work + (((u64)b * 2 + y) * C::HKV + h) * C::WORK, s_s, s_z, status, tid);
}

}  // namespace kivi
