// kivi_common.cuh — what every kivi kernel shares: element conversions, the
// block layout of kivi_spec::layout, scale/zero-point access, the window
// regions of DESIGN.md §3 and the quantization math, bit-exact with
// kivi_runtime::quant.
//
// A kernel is instantiated with a configuration struct `Cfg` (written by the
// generator; see the end of the generated source) holding the layout
// constants of the scheme and the launch constants of the variant, and two
// per-tensor structs `Cfg::K`, `Cfg::V` (codec, words per row, offsets).
//
// Only the subset of CUDA that templates/cuda/sim_shim.h implements is used,
// so the same text also runs on the CPU in the `sim` backend.

namespace kivi {

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

enum { ACT_F16 = 0, ACT_BF16 = 1, ACT_F32 = 2 };

#define KIVI_FULL_MASK 0xffffffffu

// Shared arrays are declared with KIVI_SHARED(type, name, dims), never a bare
// __shared__: under NVRTC it is exactly `__shared__ type name dims`; the sim
// shim (which defines KIVI_SIM) also poisons the array at every block start
// and counts it against the block's shared memory, and refuses bare
// __shared__. Vector loads go through KIVI_LOAD_VECTOR, which the sim checks
// for alignment.
#ifndef KIVI_SIM
#define KIVI_SHARED(T, name, dims) __shared__ T name dims
#define KIVI_LOAD_VECTOR(V, p) (*reinterpret_cast<const V*>(p))
#endif

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

__device__ __forceinline__ bool is_finite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) != 0x7f800000u;
}

// Activation element -> f32 (exact for every activation dtype).
template <int ACT> struct Act;
template <> struct Act<ACT_F16> {
  __device__ __forceinline__ static float load(u16 x) { return __half2float(__ushort_as_half(x)); }
};
template <> struct Act<ACT_BF16> {
  __device__ __forceinline__ static float load(u16 x) { return __uint_as_float((u32)x << 16); }
};
template <> struct Act<ACT_F32> {
  __device__ __forceinline__ static float load(float x) { return x; }
};

// 16-bit half `i & 1` of a word.
__device__ __forceinline__ u16 half_of(u32 word, int i) { return (u16)(word >> ((i & 1) * 16)); }

// Scale or zero point `i` of a parameter section (f16 pairs or f32 words).
template <class T> __device__ __forceinline__ float load_param(const u32* sec, int i) {
  if constexpr (T::SCALE_F32) {
    return __uint_as_float(sec[i]);
  } else {
    return __half2float(__ushort_as_half(half_of(sec[i >> 1], i)));
  }
}

// kivi_spec::layout::TensorLayout::param_index: channel axis
// `[token group][channel]`, token axis `[token][channel group]`.
template <class C, class T> __device__ __forceinline__ int param_index(int off, int d) {
  if constexpr (T::TOKEN_AXIS) {
    return off * (C::D / T::GROUP) + d / T::GROUP;
  } else {
    return (off / T::GROUP) * C::D + d;
  }
}

// kivi_spec::layout::regions: how many of `tokens` tokens of tensor T sit in
// blocks (the rest are sinks or in the window ring).
template <class C, class T> __device__ __forceinline__ int quantized_tokens(int tokens) {
  const int p = max(tokens - C::SINKS, 0);
  if constexpr (!T::QUANT) {
    return p;
  } else if constexpr (C::CHUNKED) {
    return (p / C::RESIDUAL) * C::RESIDUAL;
  } else if constexpr (T::TOKEN_AXIS) {
    return max(p - C::RESIDUAL, 0);
  } else {
    return (max(p - C::RESIDUAL, 0) / T::GROUP) * T::GROUP;
  }
}

// Word offset of tensor T of KV head `h` in block `block` of the pool.
template <class C, class T> __device__ __forceinline__ u64 part_offset(u32 block, int h) {
  return (u64)block * C::BLOCK_WORDS + (u64)h * C::HEAD_WORDS + T::PART;
}

// Where token `p` of tensor T of KV head `h` of sequence `b` lives: a block
// (`part` + token offset `off`) or a raw row of the sink buffer / window ring.
template <class C> struct RowRef {
  const u32* part;                 // non-null: quantized (or raw `full`) row in a block
  int off;                         // token offset within the block
  const typename C::act_t* raw;    // non-null: sink or window row, D elements
};

template <class C, class T>
__device__ __forceinline__ RowRef<C> locate(int p, int quantized, const u32* __restrict__ pool,
                                            const u32* __restrict__ table, int b, int h,
                                            const typename C::act_t* __restrict__ sinks,
                                            const typename C::act_t* __restrict__ ring) {
  RowRef<C> r;
  r.part = nullptr;
  r.raw = nullptr;
  r.off = 0;
  if (p < C::SINKS) {
    r.raw = sinks + ((u64)(b * C::SINKS + p) * C::HKV + h) * C::D;
    return r;
  }
  const int j = p - C::SINKS;
  if (j < quantized) {
    r.part = pool + part_offset<C, T>(table[j / C::BLOCK_TOKENS], h);
    r.off = j % C::BLOCK_TOKENS;
  } else {
    // RING is 0 only for tensors whose every non-sink token is in blocks.
    constexpr int slots = T::RING > 0 ? T::RING : 1;
    r.raw = ring + ((u64)(b * slots + j % slots) * C::HKV + h) * C::D;
  }
  return r;
}

// `W` consecutive words with one vector load (`W` words aligned; the
// generator only offers widths every row and part offset is a multiple of).
template <int W> __device__ __forceinline__ void load_words(const u32* p, u32 (&w)[W]) {
  if constexpr (W == 4) {
    const uint4 v = KIVI_LOAD_VECTOR(uint4, p);
    w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
  } else if constexpr (W == 2) {
    const uint2 v = KIVI_LOAD_VECTOR(uint2, p);
    w[0] = v.x; w[1] = v.y;
  } else {
    static_assert(W == 1, "load width must be 1, 2 or 4 words");
    w[0] = *p;
  }
}

// Value `i` of a word of tensor T: a code (quantized) or a raw element.
template <class C, class T> __device__ __forceinline__ float word_value(u32 word, int i) {
  if constexpr (T::QUANT) {
    return (float)((word >> (i * T::BITS)) & ((1u << T::BITS) - 1u));
  } else if constexpr (C::ACT == ACT_F32) {
    return __uint_as_float(word);
  } else {
    return Act<C::ACT>::load(half_of(word, i));
  }
}

// ---- quantization (DESIGN.md §3), bit-exact with kivi_runtime::quant ----

// A value rounded to the scale dtype, as stored.
template <class T> __device__ __forceinline__ float round_scale(float x) {
  if constexpr (T::SCALE_F32) {
    return x;
  } else {
    return __half2float(__float2half_rn(x));
  }
}

// Storage bits of a parameter (f16 in the low 16 bits, or the f32 word).
template <class T> __device__ __forceinline__ u32 scale_bits(float x) {
  if constexpr (T::SCALE_F32) {
    return __float_as_uint(x);
  } else {
    return (u32)__half_as_ushort(__float2half_rn(x));
  }
}

// c = clamp(round_ties_even((x - z) / s), 0, 2^b - 1); 0 when s == 0.
template <class T> __device__ __forceinline__ u32 encode(float x, float s, float z) {
  if (s == 0.0f) return 0u;
  const float c = rintf(__fdiv_rn(__fsub_rn(x, z), s));
  const float hi = (float)((1u << T::BITS) - 1u);
  return (u32)fminf(fmaxf(c, 0.0f), hi);
}

// ---- the codec pipeline (kivi_runtime::quant, DESIGN.md §8) ----

// Whether the seeded sign flip negates channel `d`: bit 63 of the (d+1)-th
// SplitMix64 output from state T::SEED (kivi_runtime::quant::sign_vector,
// re-derived here rather than shipped as a table).
template <class T> __device__ __forceinline__ bool flip(int d) {
  u64 z = T::SEED + (u64)(d + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return (z >> 63) != 0;
}

// Whether tensor T's groups store a zero point: uniform levels, and table
// codes with `norm = minmax` or `minmax_pinned` (a table over [0, 1]: x^ =
// z + s * L[c]). The generator writes `MINMAX` only into the configuration
// of such a table-coded tensor, so every other source's configuration stays
// as it was; its absence reads as false here.
template <class T, class = void> struct MinMax {
  static constexpr bool value = false;
};
template <class T> struct MinMax<T, decltype(void(T::MINMAX))> {
  static constexpr bool value = T::MINMAX;
};
template <class T> struct HasZero {
  static constexpr bool value = !T::LLOYD || MinMax<T>::value;
};

// What code `c` of tensor T stands for before its group's parameters: the
// code itself (uniform: x^ = c * s + z) or its table level (x^ = s * L[c],
// or z + s * L[c] with a zero point).
template <class T> __device__ __forceinline__ float code_level(u32 c) {
  if constexpr (T::LLOYD) {
    return T::level(c);
  } else {
    return (float)c;
  }
}

// Decoded value of code `c` with its group's scale (or norm) and zero point.
template <class T> __device__ __forceinline__ float dequant(u32 c, float s, float z) {
  if constexpr (MinMax<T>::value) {
    return fmaf(T::level(c), s, z);
  } else if constexpr (T::LLOYD) {
    return T::level(c) * s;
  } else {
    return fmaf((float)c, s, z);
  }
}

// Element `k` of a row stored raw in the activation dtype (16-bit pairs or f32 words).
template <class C> __device__ __forceinline__ float raw_word_value(const u32* w, int k) {
  if constexpr (C::ACT == ACT_F32) {
    return __uint_as_float(w[k]);
  } else {
    return Act<C::ACT>::load(half_of(w[k >> 1], k));
  }
}

// Outlier `k` of token `off` of a block part: its channel and stored correction.
template <class C, class T> __device__ __forceinline__ int outlier_channel(const u32* part, int off, int k) {
  return (int)half_of(part[T::OIDX + off * T::OIW + (k >> 1)], k);
}
template <class C, class T> __device__ __forceinline__ float outlier_value(const u32* part, int off, int k) {
  return raw_word_value<C>(part + T::OVAL + off * T::OVW, k);
}

}  // namespace kivi
