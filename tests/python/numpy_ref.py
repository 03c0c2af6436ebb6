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
    scale: str = "f16"  # dtype of stored scales and zero points


@dataclass(frozen=True)
class Scheme:
    key: Optional[Quant]  # None: kept in the activation dtype ("full")
    value: Optional[Quant]
    residual: int = 0
    sinks: int = 0
    flush: str = "eager"  # or "chunked"
    dtype: str = "f16"  # activation dtype


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


def cache_view(scheme, q, x):
    """What a cache holding x ([T, H, D]) returns for it: the rounded value
    for sink and window tokens, the dequantized value for quantized ones."""
    x = round_to(x, scheme.dtype)
    if not np.all(np.isfinite(x)):
        raise ValueError("non-finite input")
    out = x.copy()
    if q is None:
        return out
    T, H, D = x.shape
    first, n, _ = regions(scheme, q, T)
    G = q.group
    part = x[first:first + n]
    if q.axis == "channel":
        # a group: G consecutive tokens of one channel, counted from the
        # first token after the sinks ([n/G, G, H, D], groups along axis 1)
        assert n % G == 0
        deq = quantize_groups(part.reshape(n // G, G, H, D), q, axis=1)
    else:
        # a group: G consecutive channels of one token ([n, H, D/G, G])
        assert D % G == 0
        deq = quantize_groups(part.reshape(n, H, D // G, G), q, axis=3)
    out[first:first + n] = deq.reshape(n, H, D)
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
    kv = cache_view(scheme, scheme.key, k)
    vv = cache_view(scheme, scheme.value, v)
    return decode_attention(scheme, qry, kv, vv, scale, window), kv, vv
