//! The oracle: DESIGN.md §3 written plainly, on whole tensors, with no
//! paging, no windows kept incrementally and no fusion. Every other path —
//! the paged cache, the CPU kernels, the simulator, CUDA, every tuning
//! variant — is checked against these functions.

use crate::calib::{CalibError, Calibration};
use crate::error::{Error, Result};
use crate::quant::{channel_mean, quantize_group, round_to_dtype, GroupParams, TensorCodec};
use kivi_spec::layout::regions;
use kivi_spec::{Axis, Scheme, Shape, Tensor};

/// Softmax scale and sliding window in effect for one call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnParams {
    pub softmax_scale: f32,
    /// Attend only to the last `W` tokens.
    pub window: Option<usize>,
}

impl AttnParams {
    /// The scheme's own settings: `softmax_scale` or `1/sqrt(D)`, and its
    /// sliding window.
    pub fn of(s: &Scheme, shape: Shape) -> AttnParams {
        AttnParams {
            softmax_scale: s.effective_softmax_scale(shape.head_dim),
            window: s.sliding_window.map(|w| w as usize),
        }
    }
}

/// The bound shape of a scheme, or a clear error.
pub fn shape_of(s: &Scheme) -> Result<Shape> {
    // An mla scheme is two tensors of other widths: its oracle is `mla::reference`.
    if s.mla().is_some() {
        return Err(Error::Config(crate::mla::NOT_PAGED.into()));
    }
    s.shape().ok_or_else(|| Error::Unbound(s.name.clone()))
}

/// Rounds inputs to the activation dtype, refusing non-finite results.
/// `x` is `[tokens, heads, D]`.
pub fn round_inputs(s: &Scheme, tensor: &'static str, x: &[f32], heads: usize, d: usize) -> Result<Vec<f32>> {
    x.iter()
        .enumerate()
        .map(|(i, &v)| {
            let r = round_to_dtype(v, s.dtype);
            if r.is_finite() {
                Ok(r)
            } else {
                Err(Error::NonFinite {
                    tensor,
                    value: v,
                    token: i / (heads * d),
                    head: (i / d) % heads,
                    channel: i % d,
                    policy: "reject",
                })
            }
        })
        .collect()
}

/// The cache's view of one tensor holding `x` (`[T, Hkv, D]`, f32): the
/// rounded value for sinks and window tokens, the dequantized value for
/// quantized tokens. Returns `[T, Hkv, D]`.
///
/// A quantized token goes through the codec pipeline (DESIGN.md §8), each
/// step a function of `quant.rs`:
/// 1. center: subtract the per-channel mean of the first `N` tokens of its
///    head (a centered scheme quantizes nothing before `N` tokens exist);
/// 2. rotate: `T = H D` (sign flip, then blockwise normalised Hadamard);
/// 3. outliers: the `K` entries of largest magnitude are set aside and
///    replaced by 0;
/// 4. quantize the groups (uniform or Lloyd–Max) and decode them;
/// 5. add each outlier's stored correction `x - x^` (activation dtype) at
///    its channel;
/// 6. un-rotate and add the mean back.
///
/// A `levels = nuq` tensor needs its codebook: use
/// [`cache_view_calibrated`].
pub fn cache_view(s: &Scheme, t: Tensor, x: &[f32]) -> Result<Vec<f32>> {
    cache_view_levels(s, t, x, None)
}

/// [`cache_view`] of layer `layer` with the tables of `calibration` (the
/// `nuq` codebooks; fixed tables stay as they are).
pub fn cache_view_calibrated(
    s: &Scheme,
    t: Tensor,
    x: &[f32],
    calibration: &Calibration,
    layer: usize,
) -> Result<Vec<f32>> {
    // A vq tensor decodes with its product codebooks (crate::vq).
    if s.codec(t).vq().is_some() {
        let book = crate::vq::book(calibration, s, t, layer)?;
        return crate::vq::cache_view(s, t, x, &book);
    }
    let [k, v] = crate::calib::levels_for(s, Some(calibration), layer)?;
    cache_view_levels(s, t, x, if t == Tensor::Key { k } else { v })
}

fn cache_view_levels(s: &Scheme, t: Tensor, x: &[f32], levels: Option<Vec<f32>>) -> Result<Vec<f32>> {
    if s.low_rank.is_some() {
        return Err(Error::Config(crate::low_rank::NOT_PAGED.into()));
    }
    if s.codec(t).vq().is_some() {
        return Err(CalibError::VqNeeded {
            scheme: s.name.clone(),
            tensor: t.name(),
        }
        .into());
    }
    let shape = shape_of(s)?;
    let (h, d) = (shape.kv_heads, shape.head_dim);
    if !x.len().is_multiple_of(h * d) {
        return Err(Error::Shape {
            what: "tensor length",
            expected: format!("a multiple of {} (heads x head_dim)", h * d),
            got: x.len().to_string(),
        });
    }
    let tokens = x.len() / (h * d);
    let x = round_inputs(s, t.name(), x, h, d)?;
    let mut out = x.clone();
    let Some(mut codec) = TensorCodec::of(s, t, d) else {
        return Ok(out);
    };
    if let Some(l) = levels {
        codec = codec.with_levels(l);
    }
    if codec.needs_levels() {
        return Err(CalibError::Needed {
            scheme: s.name.clone(),
            tensor: t.name(),
        }
        .into());
    }
    let q = codec.quant;
    let r = regions(s, t, tokens);
    let first = r.sinks; // first quantized token
    let n = r.quantized;
    let at = |tok: usize, head: usize, ch: usize| (tok * h + head) * d + ch;
    let check = |p: GroupParams, lo: f32, hi: f32, tok: usize, head: usize, ch: usize| -> Result<()> {
        if p.is_finite() {
            Ok(())
        } else {
            Err(Error::ScaleOverflow {
                tensor: t.name(),
                token: tok,
                head,
                channel: ch,
                lo,
                hi,
                dtype: q.scale.name(),
            })
        }
    };
    // 1. Per-head means of the first N tokens.
    let means: Vec<Option<Vec<f32>>> = (0..h)
        .map(|head| {
            codec
                .center
                .filter(|_| n > 0)
                .map(|c| channel_mean((0..c).map(|tok| &x[at(tok, head, 0)..at(tok, head, d)]), d, s.dtype))
        })
        .collect();
    // 2-3. Transformed rows `y[j, head, :]` of quantized token `first + j`,
    // outliers taken out.
    let mut y = vec![0f32; n * h * d];
    let mut outliers = vec![(Vec::new(), Vec::new()); n * h];
    for j in 0..n {
        for head in 0..h {
            let row = &mut y[(j * h + head) * d..][..d];
            row.copy_from_slice(&x[at(first + j, head, 0)..at(first + j, head, d)]);
            codec.forward(row, means[head].as_deref());
            outliers[j * h + head] = codec.take_outliers(row);
        }
    }
    // 4. Quantize and decode each group, in place.
    let g = q.group as usize;
    let mut vals = vec![0f32; g];
    let mut codes = vec![0u32; g];
    let yi = |j: usize, head: usize, ch: usize| (j * h + head) * d + ch;
    match q.axis {
        // A group: G consecutive tokens of one channel, counted from the
        // first token after the sinks.
        Axis::Channel => {
            for j0 in (0..n).step_by(g) {
                for head in 0..h {
                    for ch in 0..d {
                        for k in 0..g {
                            vals[k] = y[yi(j0 + k, head, ch)];
                        }
                        let (p, lo, hi) = codec.quantize_group(&vals, &mut codes);
                        check(p, lo, hi, first + j0, head, ch)?;
                        for k in 0..g {
                            y[yi(j0 + k, head, ch)] = codec.dequantize(codes[k], p);
                        }
                    }
                }
            }
        }
        // A group: G consecutive channels of one token.
        Axis::Token => {
            for j in 0..n {
                for head in 0..h {
                    for c0 in (0..d).step_by(g) {
                        vals.copy_from_slice(&y[yi(j, head, c0)..yi(j, head, c0 + g)]);
                        let (p, lo, hi) = codec.quantize_group(&vals, &mut codes);
                        check(p, lo, hi, first + j, head, c0)?;
                        for k in 0..g {
                            y[yi(j, head, c0 + k)] = codec.dequantize(codes[k], p);
                        }
                    }
                }
            }
        }
    }
    // 5-6. Outlier corrections, then back to the input's coordinates.
    for j in 0..n {
        for head in 0..h {
            let row = &mut y[(j * h + head) * d..][..d];
            let (idx, orig) = &outliers[j * h + head];
            for (&i, &o) in idx.iter().zip(orig) {
                let c = codec.correction(o, row[i]).ok_or(Error::OutlierOverflow {
                    tensor: t.name(),
                    token: first + j,
                    head,
                    channel: i,
                    value: o - row[i],
                    dtype: s.dtype.name(),
                })?;
                row[i] += c;
            }
            codec.inverse(row, means[head].as_deref());
            out[at(first + j, head, 0)..at(first + j, head, d)].copy_from_slice(row);
        }
    }
    Ok(out)
}

/// Decode attention of one query `q` (`[Hq, D]`, rounded to the activation
/// dtype first) over cache views `k`, `v` (`[T, Hkv, D]`). Returns `[Hq, D]`.
///
/// `score_t = (q . k_t) * scale` over the last `W` tokens (all when no
/// window), `p = softmax(score)`, `out = sum_t p_t v_t`. With
/// `rope: pre(...)` the cache holds pre-RoPE keys and `k_t` is the stored
/// key rotated to position `t` ([`kivi_spec::Rope::rotate`]): a token's
/// position is its index in the sequence, sinks, window and evicted tokens
/// included. Accumulates in f64
/// so that the oracle's own rounding is far below any tolerance.
pub fn decode_attention(s: &Scheme, q: &[f32], k: &[f32], v: &[f32], params: AttnParams) -> Result<Vec<f32>> {
    let shape = shape_of(s)?;
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    if q.len() != hq * d {
        return Err(Error::Shape {
            what: "query length",
            expected: format!("{} (q_heads x head_dim)", hq * d),
            got: q.len().to_string(),
        });
    }
    if k.len() != v.len() || !k.len().is_multiple_of(hkv * d) {
        return Err(Error::Shape {
            what: "key/value length",
            expected: format!("equal multiples of {}", hkv * d),
            got: format!("{} and {}", k.len(), v.len()),
        });
    }
    let q = round_inputs(s, "query", q, hq, d)?;
    let tokens = k.len() / (hkv * d);
    let start = params.window.map_or(0, |w| tokens.saturating_sub(w));
    let group = hq / hkv;
    let mut out = vec![0f32; hq * d];
    for head in 0..hq {
        let kvh = head / group;
        let qh = &q[head * d..(head + 1) * d];
        let scores: Vec<f64> = (start..tokens)
            .map(|t| {
                let mut kt = k[(t * hkv + kvh) * d..][..d].to_vec();
                if let Some(r) = &s.rope {
                    // Pre-RoPE keys: the stored key turned to its position,
                    // which is its absolute index in the sequence.
                    r.rotate(&mut kt, t);
                }
                let dot: f64 = qh.iter().zip(&kt).map(|(a, b)| *a as f64 * *b as f64).sum();
                dot * params.softmax_scale as f64
            })
            .collect();
        // An empty cache attends to nothing: the output stays zero.
        softmax_values(&scores, v, start, hkv, kvh, &mut out[head * d..(head + 1) * d]);
    }
    Ok(out)
}

/// `out = sum_t softmax(scores)_t v_t` over tokens `start..` of KV head
/// `kvh` of the views `v` (`[T, Hkv, D]`), in f64; `out` untouched when
/// there are no scores.
fn softmax_values(scores: &[f64], v: &[f32], start: usize, hkv: usize, kvh: usize, out: &mut [f32]) {
    if scores.is_empty() {
        return;
    }
    let d = out.len();
    let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
    let sum: f64 = weights.iter().sum();
    let mut acc = vec![0f64; d];
    for (i, w) in weights.iter().enumerate() {
        let vt = &v[((start + i) * hkv + kvh) * d..][..d];
        let p = w / sum;
        for (a, x) in acc.iter_mut().zip(vt) {
            *a += p * *x as f64;
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        *o = a as f32;
    }
}

/// The whole oracle for one sequence: fill a cache with `k`, `v`
/// (`[T, Hkv, D]`) and attend with `q` (`[Hq, D]`).
pub fn attend(s: &Scheme, q: &[f32], k: &[f32], v: &[f32], params: AttnParams) -> Result<Vec<f32>> {
    let vv = cache_view(s, Tensor::Value, v)?;
    if s.query.is_some() {
        let keys = KeyCodes::of(s, k)?;
        return decode_attention_int8(s, q, &keys, &vv, params);
    }
    let kv = cache_view(s, Tensor::Key, k)?;
    decode_attention(s, q, &kv, &vv, params)
}

/// The keys as the integer-domain decode (`query: int8(group = G)`) reads
/// them: per token and KV head, either the stored codes with their
/// channel's scale and zero point, or (sinks, window) the full-precision
/// row. All arrays are `[T, Hkv, D]`; `coded` is `[T]`.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyCodes {
    pub coded: Vec<bool>,
    pub codes: Vec<u8>,
    pub scale: Vec<f32>,
    pub zero: Vec<f32>,
    /// Full-precision rows (rounded to the activation dtype) where not
    /// coded; zeros where coded.
    pub rows: Vec<f32>,
}

impl KeyCodes {
    /// Quantizes the keys `k` (`[T, Hkv, D]`) as the cache stores them:
    /// DESIGN.md §3 channel-axis groups of `G` tokens after the sinks
    /// (`validate` admits only plain uniform channel-axis keys here).
    pub fn of(s: &Scheme, k: &[f32]) -> Result<KeyCodes> {
        let shape = shape_of(s)?;
        let (h, d) = (shape.kv_heads, shape.head_dim);
        let q = match s.key.quant() {
            Some(q) if q.axis == Axis::Channel => *q,
            _ => {
                return Err(Error::Scheme(
                    kivi_spec::validate(s).err().unwrap_or_else(not_int8_keys),
                ))
            }
        };
        if !k.len().is_multiple_of(h * d) {
            return Err(Error::Shape {
                what: "key length",
                expected: format!("a multiple of {} (heads x head_dim)", h * d),
                got: k.len().to_string(),
            });
        }
        let tokens = k.len() / (h * d);
        let x = round_inputs(s, "key", k, h, d)?;
        let r = regions(s, Tensor::Key, tokens);
        let n = tokens * h * d;
        let mut kc = KeyCodes {
            coded: (0..tokens).map(|t| t >= r.sinks && t < r.sinks + r.quantized).collect(),
            codes: vec![0; n],
            scale: vec![0.0; n],
            zero: vec![0.0; n],
            rows: x.clone(),
        };
        let g = q.group as usize;
        let (mut vals, mut codes) = (vec![0f32; g], vec![0u32; g]);
        let at = |tok: usize, head: usize, ch: usize| (tok * h + head) * d + ch;
        for t0 in (r.sinks..r.sinks + r.quantized).step_by(g) {
            for head in 0..h {
                for ch in 0..d {
                    for i in 0..g {
                        vals[i] = x[at(t0 + i, head, ch)];
                    }
                    let (p, lo, hi) = quantize_group(&vals, &q, &mut codes);
                    if !p.is_finite() {
                        return Err(Error::ScaleOverflow {
                            tensor: "key",
                            token: t0,
                            head,
                            channel: ch,
                            lo,
                            hi,
                            dtype: q.scale.name(),
                        });
                    }
                    for (i, &c) in codes.iter().enumerate() {
                        let j = at(t0 + i, head, ch);
                        (kc.codes[j], kc.scale[j], kc.zero[j]) = (c as u8, p.scale, p.zero);
                        kc.rows[j] = 0.0;
                    }
                }
            }
        }
        Ok(kc)
    }

    /// The codes a paged cache holds for sequence `seq`, read from its
    /// blocks (for the reference backend; agrees with [`KeyCodes::of`] on
    /// the same inputs, which a test checks).
    pub fn from_cache(cache: &crate::cache::PagedCache, seq: crate::cache::SeqId) -> Result<KeyCodes> {
        let s = cache.scheme();
        let (h, d) = (cache.shape().kv_heads, cache.shape().head_dim);
        let Some(q) = s.key.quant().copied() else {
            return Err(Error::Scheme(not_int8_keys()));
        };
        let rows = cache.dequantize(seq, Tensor::Key)?;
        let view = cache.view(seq)?;
        let tl = cache.layout().key;
        let tokens = view.tokens();
        let mut kc = KeyCodes {
            coded: vec![false; tokens],
            codes: vec![0; rows.len()],
            scale: vec![0.0; rows.len()],
            zero: vec![0.0; rows.len()],
            rows,
        };
        for p in 0..tokens {
            let crate::cache::Loc::Block(b, off) = view.locate(Tensor::Key, p) else {
                continue;
            };
            kc.coded[p] = true;
            for head in 0..h {
                let part = view.block_part(b, head, Tensor::Key);
                let row = &part[off * tl.words_per_token..][..tl.words_per_token];
                for ch in 0..d {
                    let j = (p * h + head) * d + ch;
                    let gp = crate::cache::params_at(&tl, part, &q, off, ch);
                    kc.codes[j] = crate::quant::unpack_one(row, q.bits, ch) as u8;
                    (kc.scale[j], kc.zero[j], kc.rows[j]) = (gp.scale, gp.zero, 0.0);
                }
            }
        }
        Ok(kc)
    }
}

fn not_int8_keys() -> kivi_spec::Invalid {
    kivi_spec::Invalid::new(
        kivi_spec::Field::Query,
        "query: int8(...) needs channel-axis uniform keys of 2 or 4 bits",
    )
}

/// Decode attention with the integer-domain query of `query: int8(group =
/// G)` ([`kivi_spec::QueryQuant`]). As [`decode_attention`], except that
/// the score of a coded key token is
/// `sum_blocks a * (sum_d qi_d c_td) + sum_d qs_d z_d`, where `qs` is the
/// query rounded to the activation dtype times the softmax scale (in f32),
/// `w_d = qs_d s_td` and `qi`, `a` = [`quantize_query`](crate::quant::quantize_query)
/// of `w`. Sinks and window tokens are scored exactly, `(q . k) * scale`.
pub fn decode_attention_int8(
    s: &Scheme,
    q: &[f32],
    keys: &KeyCodes,
    v: &[f32],
    params: AttnParams,
) -> Result<Vec<f32>> {
    let shape = shape_of(s)?;
    let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
    let Some(qq) = s.query else {
        return decode_attention(s, q, &keys.rows, v, params);
    };
    let gq = qq.group as usize;
    if q.len() != hq * d {
        return Err(Error::Shape {
            what: "query length",
            expected: format!("{} (q_heads x head_dim)", hq * d),
            got: q.len().to_string(),
        });
    }
    if keys.rows.len() != v.len() || keys.coded.len() * hkv * d != v.len() {
        return Err(Error::Shape {
            what: "key/value length",
            expected: format!("equal multiples of {}", hkv * d),
            got: format!("{} and {}", keys.rows.len(), v.len()),
        });
    }
    let q = round_inputs(s, "query", q, hq, d)?;
    let tokens = keys.coded.len();
    let start = params.window.map_or(0, |w| tokens.saturating_sub(w));
    let group = hq / hkv;
    let sm = params.softmax_scale;
    let mut out = vec![0f32; hq * d];
    let (mut w, mut qi, mut a) = (vec![0f32; d], vec![0i8; d], vec![0f32; d / gq]);
    for head in 0..hq {
        let kvh = head / group;
        let qh = &q[head * d..(head + 1) * d];
        // The scaled query exactly as the kernels form it: one f32 product.
        let qs: Vec<f32> = qh.iter().map(|x| x * sm).collect();
        let scores: Vec<f64> = (start..tokens)
            .map(|t| {
                let j = (t * hkv + kvh) * d;
                if !keys.coded[t] {
                    let kt = &keys.rows[j..j + d];
                    let dot: f64 = qh.iter().zip(kt).map(|(a, b)| *a as f64 * *b as f64).sum();
                    return dot * sm as f64;
                }
                for c in 0..d {
                    w[c] = qs[c] * keys.scale[j + c];
                }
                crate::quant::quantize_query(&w, gq, &mut qi, &mut a);
                let mut score = 0f64;
                for (b, ab) in a.iter().enumerate() {
                    let dot: i64 = (b * gq..(b + 1) * gq)
                        .map(|c| qi[c] as i64 * keys.codes[j + c] as i64)
                        .sum();
                    score += *ab as f64 * dot as f64;
                }
                score + (0..d).map(|c| qs[c] as f64 * keys.zero[j + c] as f64).sum::<f64>()
            })
            .collect();
        softmax_values(&scores, v, start, hkv, kvh, &mut out[head * d..(head + 1) * d]);
    }
    Ok(out)
}

/// Tokens a cache of `tokens` tokens holds *stored* for tensor `t`: its
/// sinks (exact) and its quantized tokens. The tokens after them are the
/// full-precision window (docs/semantics.md, "Many new queries").
///
/// A stored token never changes afterwards (streaming ≡ prefill: the
/// quantized groups, centering means and codebooks of a prefix are those of
/// any longer sequence), and the count only grows with `tokens`.
pub fn stored_tokens(s: &Scheme, t: Tensor, tokens: usize) -> usize {
    let r = regions(s, t, tokens);
    r.sinks + r.quantized
}

/// What the query at position `tokens - 1` of a block reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueryView {
    /// First token it attends to (the sliding window's start, else 0).
    pub start: usize,
    /// One past the last: the query's own token, `past + i + 1`.
    pub end: usize,
    /// Per tensor (key, value): tokens `start..stored[t]` come from the
    /// cache as stored ([`stored_tokens`] at `end`); `stored[t]..end` at
    /// full precision, rounded to the activation dtype.
    pub stored: [usize; 2],
}

impl QueryView {
    /// The view of the query whose token makes the sequence `tokens` long.
    pub fn at(s: &Scheme, params: AttnParams, tokens: usize) -> QueryView {
        QueryView {
            start: params.window.map_or(0, |w| tokens.saturating_sub(w)),
            end: tokens,
            stored: [Tensor::Key, Tensor::Value].map(|t| stored_tokens(s, t, tokens).min(tokens)),
        }
    }
}

/// Many-query attention by its definition: streaming. `k`, `v` are a whole
/// sequence (`[past + n, Hkv, D]`), `q` the queries of its last `n` tokens
/// (`[n, Hq, D]`). Row `i` of the result (`[n, Hq, D]`) is
/// [`attend`] over the first `past + i + 1` tokens — what appending token
/// `past + i` and decoding its query gives. Quantizes the sequence `n`
/// times: for tests of [`block_attention`], which gives the same bits.
pub fn block_attention_streaming(
    s: &Scheme,
    past: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    params: AttnParams,
) -> Result<Vec<f32>> {
    let (n, qrow, kvrow) = block_dims(s, past, q, k, v)?;
    let mut out = Vec::with_capacity(q.len());
    for i in 0..n {
        let t = past + i + 1;
        out.extend(attend(
            s,
            &q[i * qrow..(i + 1) * qrow],
            &k[..t * kvrow],
            &v[..t * kvrow],
            params,
        )?);
    }
    Ok(out)
}

/// Many-query attention from one view of the whole sequence: the same
/// numbers as [`block_attention_streaming`], bit for bit, because a stored
/// token never changes ([`stored_tokens`]). Arguments and result as there.
pub fn block_attention(
    s: &Scheme,
    past: usize,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    params: AttnParams,
) -> Result<Vec<f32>> {
    let shape = shape_of(s)?;
    let (h, d) = (shape.kv_heads, shape.head_dim);
    block_dims(s, past, q, k, v)?;
    let kf = cache_view(s, Tensor::Key, k)?;
    let vf = cache_view(s, Tensor::Value, v)?;
    let kr = round_inputs(s, "key", k, h, d)?;
    let vr = round_inputs(s, "value", v, h, d)?;
    block_attention_views(s, past, q, [&kf, &vf], [&kr, &vr], params)
}

/// The core of [`block_attention`], shared with the paged cache's
/// reference backend: `stored` are the cache views of key and value after
/// the block (`[past + n, Hkv, D]`), `full` the same tokens at full
/// precision (rounded); only the rows of `full` past
/// `stored_tokens(past)` are read. Query `i` sees, per tensor, `stored`
/// before [`QueryView::stored`] and `full` from there to its own token.
pub fn block_attention_views(
    s: &Scheme,
    past: usize,
    q: &[f32],
    stored: [&[f32]; 2],
    full: [&[f32]; 2],
    params: AttnParams,
) -> Result<Vec<f32>> {
    let (n, qrow, kvrow) = block_dims(s, past, q, stored[0], stored[1])?;
    if full.iter().any(|f| f.len() != stored[0].len()) {
        return Err(Error::Shape {
            what: "full-precision rows",
            expected: format!("{} values, like the stored view", stored[0].len()),
            got: format!("{} and {}", full[0].len(), full[1].len()),
        });
    }
    let mut out = Vec::with_capacity(q.len());
    for i in 0..n {
        let qv = QueryView::at(s, params, past + i + 1);
        // This query's view of each tensor, up to its own token.
        let [kv, vv] = [0, 1].map(|t| {
            let mut x = stored[t][..qv.end * kvrow].to_vec();
            x[qv.stored[t] * kvrow..].copy_from_slice(&full[t][qv.stored[t] * kvrow..qv.end * kvrow]);
            x
        });
        out.extend(decode_attention(s, &q[i * qrow..(i + 1) * qrow], &kv, &vv, params)?);
    }
    Ok(out)
}

/// Checks a block's shapes: returns `n` and the values per query and per
/// key row.
fn block_dims(s: &Scheme, past: usize, q: &[f32], k: &[f32], v: &[f32]) -> Result<(usize, usize, usize)> {
    let shape = shape_of(s)?;
    let (qrow, kvrow) = (shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim);
    let tokens = k.len() / kvrow;
    let n = q.len() / qrow;
    if k.len() != v.len() || k.len() != tokens * kvrow || q.len() != n * qrow || tokens != past + n {
        return Err(Error::Shape {
            what: "block of queries",
            expected: format!(
                "q = [n, {}, {}] and k, v = [{past} + n, {}, {}]",
                shape.q_heads, shape.head_dim, shape.kv_heads, shape.head_dim
            ),
            got: format!("{}, {} and {} values", q.len(), k.len(), v.len()),
        });
    }
    Ok((n, qrow, kvrow))
}
