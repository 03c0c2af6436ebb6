"""An independent numpy implementation of DESIGN.md section 3.

Written from the design notes, not from the Rust code, so that the two can
check each other: the Rust reference oracle, the paged cache and the CPU
kernel are all compared against these few functions by check_attend.py.

Everything that the design says happens in f32 is done in np.float32
explicitly: numpy 2 promotes float32 mixed with a Python float to float64,
which would round differently from the Rust code's f32 arithmetic.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np

F32 = np.float32


@dataclass(frozen=True)
class Quant:
    bits: int
    axis: str  # "channel" or "token"
    group: int
    scale: str = "f16"  # dtype of stored scales and zero points (or norms)
    levels: str = "uniform"  # or "lloyd_max", or "nuq" (with `table`)
    norm: str = "rms"  # lloyd_max and nuq: "rms" or "l2"
    table: Optional[tuple] = None  # nuq: the calibrated codebook, ascending


@dataclass(frozen=True)
class Scheme:
    key: Optional[Quant]  # None: kept in the activation dtype ("full")
    value: Optional[Quant]
    residual: int = 0
    sinks: int = 0
    flush: str = "eager"  # or "chunked"
    dtype: str = "f16"  # activation dtype
    # The codec pipeline (DESIGN.md section 8), each with the tensors it
    # applies to, e.g. rotation=(256, None, ("key", "value")):
    rotation: Optional[tuple] = None  # (block, signs seed or None, tensors)
    outliers: Optional[tuple] = None  # (per_token, tensors)
    center: Optional[tuple] = None  # (tokens, tensors)
    # rope: pre(...): the cache holds keys before RoPE; attention turns each
    # key to its position. (theta, "half" or "interleaved").
    rope: Optional[tuple] = None


def round_bf16(x):
    """f32 -> nearest bfloat16 (ties to even), returned as f32."""
    x = np.ascontiguousarray(x, dtype=F32)
    u = x.view(np.uint32).astype(np.uint64)
    lsb = (u >> 16) & 1
    r = ((u + 0x7FFF + lsb) >> 16) << 16
    out = (r & 0xFFFFFFFF).astype(np.uint32).view(F32).copy()
    nan = np.isnan(x)
    out[nan] = x[nan]
    return out


def round_to(x, dtype):
    """Round to the activation/scale dtype, round to nearest even, as f32."""
    x = np.asarray(x, dtype=F32)
    if dtype == "f16":
        return x.astype(np.float16).astype(F32)
    if dtype == "bf16":
        return round_bf16(x)
    if dtype == "f32":
        return x.copy()
    raise ValueError(dtype)


def quantize_groups(x, q, axis):
    """Quantize then dequantize groups laid along `axis` of the f32 array x
    (every slice along `axis` is one group of G values).

    lo/hi in f32; s = (hi - lo) / (2^b - 1) and z = lo, each rounded to the
    scale dtype; c = clamp(round_half_even((x - z) / s), 0, 2^b - 1), c = 0
    when s == 0; x^ = c * s + z in f32 (two roundings, no fused multiply-add).
    """
    x = np.asarray(x, dtype=F32)
    maxc = F32(2**q.bits - 1)
    lo = x.min(axis=axis, keepdims=True)
    hi = x.max(axis=axis, keepdims=True)
    s = round_to((hi - lo) / maxc, q.scale)
    z = round_to(lo, q.scale)
    if not (np.all(np.isfinite(s)) and np.all(np.isfinite(z))):
        raise OverflowError("a scale or zero point overflows its dtype")
    safe = np.where(s == 0, F32(1), s)
    c = np.clip(np.rint((x - z) / safe), F32(0), maxc)
    c = np.where(s == 0, F32(0), c).astype(F32)
    return (c * s + z).astype(F32)


# Lloyd-Max levels of N(0, 1) (J. Max, "Quantizing for minimum distortion",
# IRE Trans. Inf. Theory, 1960), the positive half, to 7 digits; the
# negative half mirrors it. lloyd_levels_by_iteration() recomputes them.
MAX_1960 = {
    1: [0.7978846],
    2: [0.4527800, 1.5104176],
    3: [0.2450942, 0.7560053, 1.3439093, 2.1519457],
    4: [0.1283950, 0.3880483, 0.6567591, 0.9423405, 1.2562312, 1.6180464, 2.0690172, 2.7325896],
}


def lloyd_levels(bits):
    half = np.array(MAX_1960[bits], dtype=F32)
    return np.concatenate([-half[::-1], half]).astype(F32)


def lloyd_levels_by_iteration(bits, iters=500):
    """Lloyd's algorithm on the exact unit Gaussian, in float64."""
    from math import erf, exp, pi, sqrt

    def pdf(x):
        return exp(-x * x / 2) / sqrt(2 * pi)

    def cdf(x):
        return 0.5 * (1 + erf(x / sqrt(2)))

    n = 2**bits
    lv = [-2 + 4 * (i + 0.5) / n for i in range(n)]
    for _ in range(iters):
        edges = [-40.0] + [(lv[i] + lv[i + 1]) / 2 for i in range(n - 1)] + [40.0]
        lv = [(pdf(edges[i]) - pdf(edges[i + 1])) / (cdf(edges[i + 1]) - cdf(edges[i])) for i in range(n)]
    return np.array(lv)


def lloyd_groups(x, q, axis):
    """Lloyd-Max quantize then dequantize groups along `axis` of x (f32).

    rms = sqrt(mean(x^2)) (float64, rounded to f32 then the scale dtype);
    codes: the nearest level of x / rms (f32), ties to the lower level,
    i.e. the number of midpoints (L_i + L_{i+1}) / 2 (f32) below it, all
    zero-input groups as 0 / 1; stored s = rms, or for norm = l2
    s = ||x|| / ||L[c]||; x^ = s * L[c] (f32).
    """
    x = np.asarray(x, dtype=F32)
    lv = np.array(q.table, dtype=F32) if q.levels == "nuq" else lloyd_levels(q.bits)
    mids = ((lv[:-1] + lv[1:]) * F32(0.5)).astype(F32)
    ss = np.sum(x.astype(np.float64) ** 2, axis=axis, keepdims=True)
    rms = round_to(np.sqrt(ss / x.shape[axis]).astype(F32), q.scale)
    if not np.all(np.isfinite(rms)):
        raise OverflowError("a norm overflows its dtype")
    y = np.where(rms == 0, F32(0), x / np.where(rms == 0, F32(1), rms)).astype(F32)
    codes = np.sum(y[..., None] > mids, axis=-1)
    levels = lv[codes]
    if q.norm == "rms":
        s = rms
    else:
        lc = np.sum(levels.astype(np.float64) ** 2, axis=axis, keepdims=True)
        ok = (lc != 0) & (ss != 0)
        s = np.where(ok, np.sqrt(ss / np.where(ok, lc, 1.0)), 0.0).astype(F32)
        s = round_to(s, q.scale)
    return (s * levels).astype(F32)


def hadamard_matrix(n):
    """Sylvester's construction: H[i, j] = (-1)^popcount(i & j)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def sign_vector(seed, d):
    """SplitMix64 from state `seed`; -1 where bit 63 of an output is set."""
    mask = (1 << 64) - 1
    state, out = seed, []
    for _ in range(d):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        out.append(-1.0 if z >> 63 else 1.0)
    return np.array(out, dtype=F32)


def rotate_rows(x, block, signs, inverse=False):
    """T = H D (signs, then the normalised blockwise Hadamard) on the last
    axis of x, or its inverse D H. The product in float64, rounded to f32."""
    D = x.shape[-1]
    h = hadamard_matrix(block) / np.sqrt(block)
    out = x.astype(F32).copy()
    if signs is not None and not inverse:
        out = (out * signs).astype(F32)
    blocks = out.reshape(out.shape[:-1] + (D // block, block)).astype(np.float64)
    out = (blocks @ h.T).reshape(x.shape).astype(F32)
    if signs is not None and inverse:
        out = (out * signs).astype(F32)
    return out


def _applies(field, name):
    return field is not None and name in field[-1]


def regions(scheme, q, tokens):
    """(sinks, quantized, window) token counts of one tensor."""
    sinks = min(tokens, scheme.sinks)
    p = tokens - sinks
    r = scheme.residual
    if q is None:
        quantized = p  # stored as is, in blocks
    elif scheme.flush == "chunked":
        quantized = (p // r) * r
    elif q.axis == "token":
        quantized = max(p - r, 0)
    else:
        # G tokens at once, once the window holds R + G
        quantized = (max(p - r, 0) // q.group) * q.group
    return sinks, quantized, p - quantized


def cache_view(scheme, q, x, tensor="key"):
    """What a cache holding x ([T, H, D]) returns for it: the rounded value
    for sink and window tokens, the dequantized value for quantized ones.

    Quantized tokens go through the codec pipeline of `tensor`: subtract the
    per-channel mean of the first N tokens (rounded to the activation
    dtype), rotate, set the K largest-magnitude entries aside (replaced by
    0), quantize, add each outlier's correction (x - x^, rounded to the
    activation dtype), un-rotate, add the mean."""
    x = round_to(x, scheme.dtype)
    if not np.all(np.isfinite(x)):
        raise ValueError("non-finite input")
    out = x.copy()
    if q is None:
        return out
    T, H, D = x.shape
    first, n, _ = regions(scheme, q, T)
    G = q.group
    part = x[first:first + n].copy()
    mean = None
    if _applies(scheme.center, tensor) and n > 0:
        N = scheme.center[0]
        mean = round_to((np.sum(x[:N].astype(np.float64), axis=0) / N).astype(F32), scheme.dtype)
        part = (part - mean).astype(F32)
    rot = None
    if _applies(scheme.rotation, tensor):
        block, seed, _ = scheme.rotation
        rot = (block, None if seed is None else sign_vector(seed, D))
        part = rotate_rows(part, *rot)
    K = scheme.outliers[0] if _applies(scheme.outliers, tensor) else 0
    idx = np.zeros((n, H, K), dtype=np.int64)
    orig = np.zeros((n, H, K), dtype=F32)
    if K:
        order = np.argsort(-np.abs(part), axis=-1, kind="stable")[..., :K]
        idx = np.sort(order, axis=-1)
        orig = np.take_along_axis(part, idx, axis=-1)
        np.put_along_axis(part, idx, F32(0), axis=-1)
    groups = quantize_groups if q.levels == "uniform" else lloyd_groups
    if q.axis == "channel":
        # a group: G consecutive tokens of one channel, counted from the
        # first token after the sinks ([n/G, G, H, D], groups along axis 1)
        assert n % G == 0
        deq = groups(part.reshape(n // G, G, H, D), q, axis=1)
    else:
        # a group: G consecutive channels of one token ([n, H, D/G, G])
        assert D % G == 0
        deq = groups(part.reshape(n, H, D // G, G), q, axis=3)
    deq = deq.reshape(n, H, D)
    if K:
        at = np.take_along_axis(deq, idx, axis=-1)
        corr = round_to((orig - at).astype(F32), scheme.dtype)
        np.put_along_axis(deq, idx, (at + corr).astype(F32), axis=-1)
    if rot is not None:
        deq = rotate_rows(deq, *rot, inverse=True)
    if mean is not None:
        deq = (deq + mean).astype(F32)
    out[first:first + n] = deq
    return out


def rope_keys(k, theta, style):
    """Keys [T, H, D] turned to their positions 0..T-1, in float64: the pair
    (x_a, x_b) of frequency i = theta^(-2i/D) at position t becomes
    (x_a cos - x_b sin, x_b cos + x_a sin), a = i and b = i + D/2 (half) or
    a = 2i and b = 2i + 1 (interleaved); cos and sin rounded to f32 as the
    model's tables hold them."""
    T, H, D = k.shape
    out = k.astype(np.float64).copy()
    i = np.arange(D // 2)
    ang = np.arange(T)[:, None].astype(np.float64) * theta ** (-2.0 * i / D)[None, :]
    c = np.cos(ang).astype(F32).astype(np.float64)[:, None, :]
    s = np.sin(ang).astype(F32).astype(np.float64)[:, None, :]
    a, b = (i, i + D // 2) if style == "half" else (2 * i, 2 * i + 1)
    xa, xb = out[..., a].copy(), out[..., b].copy()
    out[..., a] = xa * c - xb * s
    out[..., b] = xb * c + xa * s
    return out


def decode_attention(scheme, qry, k, v, scale=None, window=None):
    """One decode query qry [Hq, D] over cache views k, v [T, Hkv, D].

    score_t = (q . k_t) * scale (default 1/sqrt(D)) over the last W tokens,
    p = softmax(score), out = sum_t p_t v_t; query head h reads KV head
    h // (Hq / Hkv). Computed in float64 (the oracle's rounding stays far
    below the comparison tolerance); returns f32.
    """
    qry = round_to(qry, scheme.dtype).astype(np.float64)
    Hq, D = qry.shape
    T, Hkv, _ = k.shape
    if scale is None:
        scale = F32(1) / np.sqrt(F32(D))
    scale = float(np.float32(scale))
    start = 0 if window is None else max(T - window, 0)
    out = np.zeros((Hq, D), dtype=np.float64)
    if T - start == 0:
        return out.astype(F32)
    group = Hq // Hkv
    if scheme.rope is not None:
        k = rope_keys(k, *scheme.rope)
    kk = k[start:].astype(np.float64)
    vv = v[start:].astype(np.float64)
    for h in range(Hq):
        hk = h // group
        s = kk[:, hk, :] @ qry[h] * scale
        p = np.exp(s - s.max())
        p /= p.sum()
        out[h] = p @ vv[:, hk, :]
    return out.astype(F32)


def attend(scheme, qry, k, v, scale=None, window=None):
    """Fill a cache with k, v ([T, Hkv, D]) and attend with qry ([Hq, D])."""
    kv = cache_view(scheme, scheme.key, k, "key")
    vv = cache_view(scheme, scheme.value, v, "value")
    return decode_attention(scheme, qry, kv, vv, scale, window), kv, vv
