//! One split of one (sequence, KV head): online-softmax attention of the
//! whole GQA group over tokens `a..z`, one pass over the KV bytes.
//!
//! Tokens are visited in tiles of `tile_tokens`; inside a tile, each tensor
//! is cut into *pieces*: runs of tokens that live in one place (sinks, one
//! block, the window ring without wrapping) and, for channel-axis tensors,
//! share one parameter group. A piece is handed to the inner loops
//! ([`super::simd`]) as a row kind that reads its storage directly.
//!
//! Keys, channel axis (KIVI): for a group with scales `s_d` and zero points
//! `z_d`, `q . k^_t = sum_d (q_d s_d) c_td + sum_d q_d z_d`; the folded query
//! and the constant are computed once per group of `G` tokens and the inner
//! loop multiplies by the integer codes. Everything else is decoded in
//! registers (`c * s + z` with the reference's two roundings, f16/bf16
//! widening) and consumed at once.

use super::codec::CodecRows;
use super::dense;
use super::fused::{self, Fast, Tile, ROWS};
use super::int8::{Ahead, Int8Isa, Int8Keys};
use super::rope::{RopeKeys, RopeScratch};
use super::simd::{self, Bf16Rows, ChanRows, CodeRows, F16Rows, F32Rows, Isa, TokRows};
use super::Partial;
use crate::cache::{Loc, PagedCache, RawRows, SeqView};
use kivi_spec::layout::TensorLayout;
use kivi_spec::{Axis, Codec, Dtype, ScaleDtype, Tensor};

/// How block-resident tokens of one tensor are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Rows in the activation dtype (`full` codec).
    Full,
    /// Channel-axis keys with the scale folded into the query (2/4/8 bits).
    ChanFold { bits: u32, group: usize },
    /// Channel-axis codes dequantized in registers (2/4/8 bits).
    ChanDeq { bits: u32, group: usize },
    /// Token-axis codes dequantized in registers (2/4/8 bits, power-of-two groups).
    Tok { bits: u32, gshift: u32 },
    /// Anything else: the cache's own row reader into an f32 tile.
    Generic,
    /// A codec pipeline (rotation, Lloyd–Max, outliers, centering), consumed
    /// on the query side: rows are decoded in the transformed domain
    /// (`SeqView::coded_row`), keys are scored against the rotated query plus
    /// `q . m`, values accumulate in the rotated domain and the output is
    /// un-rotated (and `sum p * m` added) once per split.
    Codec,
    /// Product vector quantization (`vq.rs`): keys scored by table
    /// lookups, values binned per centroid and expanded once per split.
    Vq { bits: u32 },
}

/// Per-call decisions shared by every task.
pub(crate) struct Plan {
    isa: Isa,
    tile: usize,
    sinks: usize,
    hkv: usize,
    d: usize,
    group: usize,
    block_tokens: usize,
    dtype: Dtype,
    kinds: [Kind; 2],
    layouts: [TensorLayout; 2],
    scale: [ScaleDtype; 2],
    /// The fused fast path's parameters (AVX-512 or AVX2), where the scheme
    /// has its shape.
    fast: Option<Fast>,
    /// Both tensors are `full` and an AVX ISA is on: rows go to the dense
    /// loops (`dense.rs`) instead of the generic ones.
    dense: bool,
    /// f16 rows on the dense loops with groups of four heads: aligned tiles
    /// of block-resident tokens run `dense::tile` end to end (scores,
    /// softmax, values in one call); other tiles take `dense::dot`/`axpy`.
    dense_tile: bool,
    /// Some tensor runs a codec pipeline through the generic row reader.
    codec_rows: bool,
    /// Per tensor, the fused codec decoding (`codec.rs`) where a codec
    /// tensor has its shape (token-axis codes of 1 to 4 bits).
    codec: [Option<CodecRows>; 2],
    /// Pre-RoPE keys (`rope.rs`): every key row is read with the cache's
    /// row reader and turned to its position before scoring.
    pub(crate) rope: Option<RopeKeys>,
    /// `query: int8(group = G)`: the integer loops, the key bits and `G`
    /// (`int8.rs`); key scores of block-resident tokens come from there.
    int8: Option<(Int8Isa, u32, usize)>,
    /// The product codebooks of `vq(...)` tensors.
    vq: [Option<std::sync::Arc<crate::vq::VqBook>>; 2],
}

fn kind_of(codec: &Codec, t: Tensor, isa: Isa) -> Kind {
    let q = match codec {
        Codec::Full => return Kind::Full,
        Codec::Vq(v) => return Kind::Vq { bits: v.code_bits() },
        Codec::Quant(q) => q,
    };
    // Scales are read as little-endian halves of words; elsewhere the
    // generic reader (which shifts) is right by construction.
    if !matches!(q.bits, 2 | 4 | 8) || cfg!(target_endian = "big") {
        return Kind::Generic;
    }
    let g = q.group as usize;
    match (q.axis, t) {
        (Axis::Channel, Tensor::Key) => Kind::ChanFold { bits: q.bits, group: g },
        (Axis::Channel, Tensor::Value) => Kind::ChanDeq { bits: q.bits, group: g },
        (Axis::Token, _) if g.is_power_of_two() && g >= isa.width() => Kind::Tok {
            bits: q.bits,
            gshift: g.trailing_zeros(),
        },
        _ => Kind::Generic,
    }
}

impl Plan {
    pub fn new(cache: &PagedCache, isa: Isa, tile: usize) -> Plan {
        Plan::for_heads(cache, isa, tile, cache.shape().group_size())
    }

    /// A plan whose tasks serve `heads` query heads per KV head instead of
    /// the GQA group: many-query attention (`block.rs`) passes the groups
    /// of several queries as one, so that each tile is read once for all.
    pub fn for_heads(cache: &PagedCache, isa: Isa, tile: usize, heads: usize) -> Plan {
        let s = cache.scheme();
        let shape = cache.shape();
        let l = cache.layout();
        // Codec pipelines (rotation, Lloyd–Max levels, outliers, centering)
        // take the generic row reader, which runs the whole pipeline.
        let kind = |t: Tensor| {
            if s.has_pipeline(t) {
                Kind::Codec
            } else {
                kind_of(s.codec(t), t, isa)
            }
        };
        let rope = RopeKeys::of(s, shape.head_dim, tile).map(|r| r.with_key_layout(s, l.key));
        // Pre-RoPE keys are scored by `rope.rs` (no key folding, no fused
        // key loop: the rotation mixes channels per token); its vector path
        // may hand the scores to the fused values below.
        let kinds = [
            if rope.is_some() {
                Kind::Generic
            } else {
                kind(Tensor::Key)
            },
            kind(Tensor::Value),
        ];
        let scale = [
            s.key.quant().map_or(ScaleDtype::F16, |q| q.scale),
            s.value.quant().map_or(ScaleDtype::F16, |q| q.scale),
        ];
        // The fused path: 2/4-bit channel-axis keys (KIVI) or 2/4/8-bit
        // token-axis keys covering whole words per group, with token-axis
        // values of at least 16 channels a group, f16 parameters, GQA groups
        // of a multiple of four heads, tiles and blocks of whole sixteens.
        let keys = match kinds[0] {
            Kind::ChanFold { bits: 2 | 4, group } if group.is_multiple_of(ROWS) => Some(fused::Keys::Channel { group }),
            Kind::Tok { bits, gshift } if gshift >= 4 && ((1usize << gshift) * bits as usize).is_multiple_of(32) => {
                Some(fused::Keys::Token { gshift })
            }
            _ => None,
        };
        let kbits = match kinds[0] {
            Kind::ChanFold { bits, .. } | Kind::Tok { bits, .. } => bits,
            _ => 0,
        };
        let fast = match (keys, kinds[1]) {
            (Some(keys), Kind::Tok { bits: vbits, gshift })
                if fused::values_fit(isa, vbits, gshift, shape.head_dim)
                    && scale == [ScaleDtype::F16; 2]
                    && heads.is_multiple_of(4)
                    && tile.is_multiple_of(ROWS)
                    && l.block_tokens.is_multiple_of(ROWS) =>
            {
                Some(Fast {
                    kbits,
                    keys,
                    vbits,
                    gshift,
                    isa,
                    bw: isa == Isa::Avx512 && simd::avx512bw_available(),
                })
            }
            _ => None,
        };
        // Pre-RoPE keys on the vector path: `rope.rs` scores a tile and the
        // fused path's second half (softmax, values) takes it from there, as
        // for the int8 query; the same conditions on values and tiles.
        let rope_bits = rope.as_ref().filter(|r| r.vector(isa)).and_then(|r| r.vector_bits());
        let fast = match (fast, rope_bits, kinds[1], s.key.quant()) {
            (None, Some(kbits), Kind::Tok { bits: vbits, gshift }, Some(kq))
                if fused::values_fit(isa, vbits, gshift, shape.head_dim)
                    && scale[1] == ScaleDtype::F16
                    && heads.is_multiple_of(4)
                    && tile.is_multiple_of(ROWS)
                    && l.block_tokens.is_multiple_of(ROWS) =>
            {
                Some(Fast {
                    kbits,
                    keys: fused::Keys::Channel {
                        group: kq.group as usize,
                    },
                    vbits,
                    gshift,
                    isa,
                    bw: isa == Isa::Avx512 && simd::avx512bw_available(),
                })
            }
            (fast, ..) => fast,
        };
        let int8 = match (s.query, kinds[0]) {
            (
                Some(qq),
                Kind::ChanFold {
                    bits: bits @ (2 | 4), ..
                },
            ) => Some((Int8Isa::select(isa), bits, qq.group as usize)),
            _ => None,
        };
        let dense = kinds == [Kind::Full; 2] && isa != Isa::Scalar && !super::env_no_dense();
        Plan {
            dense_tile: dense
                && s.dtype == Dtype::F16
                && rope.is_none()
                && int8.is_none()
                && dense::tile_fits(isa, heads, shape.head_dim),
            int8,
            isa,
            tile,
            sinks: s.sinks as usize,
            hkv: shape.kv_heads,
            d: shape.head_dim,
            group: heads,
            block_tokens: l.block_tokens,
            dtype: s.dtype,
            kinds,
            layouts: [l.key, l.value],
            scale,
            fast,
            dense,
            codec_rows: (s.has_pipeline(Tensor::Key) && rope.is_none()) || s.has_pipeline(Tensor::Value),
            codec: [Tensor::Key, Tensor::Value].map(|t| {
                if kinds[ti(t)] == Kind::Codec {
                    let levels = cache.codec(t).map_or(&[][..], |c| &c.levels);
                    CodecRows::of(s, t, *l.tensor(t), shape.head_dim, isa, levels)
                } else {
                    None
                }
            }),
            rope,
            vq: [Tensor::Key, Tensor::Value].map(|t| cache.vq_book(t).cloned()),
        }
    }
}

impl Plan {
    /// `avx512-fused` / `avx2-fused` where the fast path applies, `<isa>+codec` where a
    /// codec pipeline (rotation, Lloyd–Max, outliers, centering) sends a
    /// tensor through the generic row reader, `<isa>-vec+rope` / `<isa>+rope`
    /// for pre-RoPE keys (`rope.rs`'s vector path or its row reader), else
    /// the ISA's name.
    pub fn path_name(&self) -> &'static str {
        if let Some(rk) = &self.rope {
            if rk.vector(self.isa) {
                return match self.isa {
                    Isa::Avx512 => "avx512-vec+rope",
                    _ => "avx2-vec+rope",
                };
            }
            return match self.isa {
                Isa::Avx512 => "avx512+rope",
                Isa::Avx2 => "avx2+rope",
                Isa::Scalar => "scalar+rope",
            };
        }
        if let Some((i8isa, ..)) = self.int8 {
            return match (self.fast.map(|f| f.isa), self.isa, i8isa) {
                (Some(Isa::Avx512), _, Int8Isa::Vnni512) => "avx512-fused+vnni-int8",
                (Some(Isa::Avx512), ..) => "avx512-fused+maddubs-int8",
                (Some(_), ..) => "avx2-fused+maddubs-int8",
                (None, Isa::Avx512, Int8Isa::Vnni512) => "avx512+vnni-int8",
                (None, Isa::Avx512, _) => "avx512+maddubs-int8",
                (None, Isa::Avx2, _) => "avx2+maddubs-int8",
                (None, ..) => "scalar+int8",
            };
        }
        if let Some(f) = self.fast {
            match f.isa {
                Isa::Avx512 => "avx512-fused",
                _ => "avx2-fused",
            }
        } else if self.dense_tile {
            match self.isa {
                Isa::Avx512 => "avx512-dense-fused",
                _ => "avx2-dense-fused",
            }
        } else if self.dense {
            match self.isa {
                Isa::Avx512 => "avx512-dense",
                _ => "avx2-dense",
            }
        } else if self.codec_rows {
            // Every codec tensor on the fused codec loops: AVX-512 or the
            // portable ones (`codec.rs`).
            let fused = (0..2).all(|i| self.kinds[i] != Kind::Codec || self.codec[i].is_some());
            if fused {
                return match self.isa {
                    Isa::Avx512 => "avx512-fused+codec",
                    Isa::Avx2 => "avx2-table+codec",
                    Isa::Scalar => "scalar-table+codec",
                };
            }
            match self.isa {
                Isa::Avx512 => "avx512+codec",
                Isa::Avx2 => "avx2+codec",
                Isa::Scalar => "scalar+codec",
            }
        } else {
            self.isa.name()
        }
    }
}

fn ti(t: Tensor) -> usize {
    match t {
        Tensor::Key => 0,
        Tensor::Value => 1,
    }
}

/// The u16 halves of `words` in element order (low half first), as the
/// layout stores f16/bf16 values.
fn halves(words: &[u32]) -> &[u16] {
    // SAFETY: u16 has weaker alignment than u32 and the length doubles; on a
    // little-endian target element `i` is half `i % 2` of word `i / 2`, which
    // is the layout's order (`kind_of` keeps big-endian targets off this path).
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u16, words.len() * 2) }
}

fn as_f32(words: &[u32]) -> &[f32] {
    // SAFETY: same size and alignment; every bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts(words.as_ptr() as *const f32, words.len()) }
}

/// Parameters `i0..i0 + out.len()` of a scale or zero section, as f32.
fn read_params(isa: Isa, section: &[u32], dtype: ScaleDtype, i0: usize, out: &mut [f32]) {
    match dtype {
        ScaleDtype::F16 => simd::f16_to_f32(isa, &halves(section)[i0..i0 + out.len()], out),
        ScaleDtype::F32 => out.copy_from_slice(&as_f32(section)[i0..i0 + out.len()]),
    }
}

/// What one piece of a tile does with its rows.
enum Op<'s> {
    /// `scores[i * group + h] = q_h . row_i` (keys).
    Score { q: &'s [f32], out: &'s mut [f32] },
    /// `acc_h += p[i * group + h] * row_i` (values).
    Accum { p: &'s [f32], acc: &'s mut [f32] },
}

/// Scratch buffers of one task, reused across tiles.
struct Scratch {
    /// Folded query and constants of the current key group, and which group.
    qf: Vec<f32>,
    cst: Vec<f32>,
    key_group: Option<(u32, usize)>,
    /// Key group parameters (only while folding them).
    cs: Vec<f32>,
    cz: Vec<f32>,
    /// Per-channel parameters of the current channel-axis value group.
    vs: Vec<f32>,
    vz: Vec<f32>,
    value_group: Option<(u32, usize)>,
    /// Per-token parameters of a token-axis piece.
    ts: Vec<f32>,
    tz: Vec<f32>,
    /// Dequantized rows for the generic path.
    rows: Vec<f32>,
    /// Codec keys: the rotated query of each head and `q_h . m` (the key
    /// means of this KV head), added to the score of every quantized token.
    qrot: Vec<f32>,
    qm: Vec<f32>,
    /// Fused codec keys with uniform levels: `sum_group qrot` per (head, group).
    qsum: Vec<f32>,
    /// Codec values: the weighted sum of quantized rows in the rotated
    /// domain, and the weight it holds, per head.
    acc_rot: Vec<f32>,
    psum: Vec<f32>,
    /// Pre-RoPE keys: decoded rows, cosines and sines, key group parameters.
    rope: RopeScratch,
    /// The integer-domain query (`query: int8(...)`), where the plan has one.
    int8: Option<Int8Keys>,
    /// vq keys: the query-by-codebook table of every head (`vq.rs`).
    vq_lut: Vec<f32>,
    /// vq values: their sums (`vq.rs`).
    vq_values: Option<super::vq::VqValues>,
    /// vq codes that are not bytes, unpacked per piece.
    vq_offs: Vec<u32>,
}

/// Runs `op` over rows `0..n`, applying the instruction set of the plan.
fn apply<R: simd::Rows>(plan: &Plan, rows: &R, n: usize, op: &mut Op) {
    let (isa, d, g) = (plan.isa, plan.d, plan.group);
    if plan.dense {
        return apply_dense(plan, rows, n, op, &[]);
    }
    match op {
        Op::Score { q, out } => simd::dot(isa, rows, n, d, q, g, out, g),
        Op::Accum { p, acc } => simd::axpy(isa, rows, n, d, p, g, g, acc),
    }
}

/// As [`apply`] on the dense loops, which prefetch `ahead` (the matching
/// rows of the head's next block, or nothing) row by row as they go.
fn apply_dense<R: simd::Rows>(plan: &Plan, rows: &R, n: usize, op: &mut Op, ahead: &[u32]) {
    let (isa, d, g) = (plan.isa, plan.d, plan.group);
    match op {
        Op::Score { q, out } => dense::dot(isa, rows, n, d, q, g, out, g, ahead),
        Op::Accum { p, acc } => dense::axpy(isa, rows, n, d, p, g, g, acc, ahead),
    }
}

/// Raw sink or window rows `slot..slot + n` of KV head `h`.
fn raw_rows(plan: &Plan, raw: RawRows, slot: usize, h: usize, n: usize, op: &mut Op) {
    let (d, stride) = (plan.d, plan.hkv * plan.d);
    let base = (slot * plan.hkv + h) * d;
    match raw {
        RawRows::Bits16(data) if plan.dtype == Dtype::Bf16 => apply(plan, &Bf16Rows { data, base, stride }, n, op),
        RawRows::Bits16(data) => apply(plan, &F16Rows { data, base, stride }, n, op),
        RawRows::F32(data) => apply(plan, &F32Rows { data, base, stride }, n, op),
    }
}

/// Calls `f(p, n, loc)` for consecutive pieces covering tokens `p0..p1` of `t`.
fn pieces(plan: &Plan, view: &SeqView, t: Tensor, p0: usize, p1: usize, mut f: impl FnMut(usize, usize, Loc)) {
    let quantized = view.quantized(t);
    let cap = view.ring_capacity(t);
    let chan_group = match plan.kinds[ti(t)] {
        Kind::ChanFold { group, .. } | Kind::ChanDeq { group, .. } => group,
        _ => usize::MAX,
    };
    let mut p = p0;
    while p < p1 {
        let loc = view.locate(t, p);
        let n = match loc {
            Loc::Sink(s) => (plan.sinks - s).min(p1 - p),
            Loc::Block(_, off) => {
                let j = p - plan.sinks;
                let mut n = (quantized - j).min(plan.block_tokens - off).min(p1 - p);
                if chan_group != usize::MAX {
                    n = n.min(chan_group - off % chan_group);
                }
                n
            }
            Loc::Window(slot) => (cap - slot).min(p1 - p),
        };
        f(p, n, loc);
        p += n;
    }
}

/// Runs `op` over tokens `p0..p0 + n` of tensor `t` (one tile).
#[allow(clippy::too_many_arguments)]
fn run_tensor(plan: &Plan, view: &SeqView, t: Tensor, h: usize, p0: usize, n: usize, op: &mut Op, sc: &mut Scratch) {
    let (d, g) = (plan.d, plan.group);
    let i = ti(t);
    if let (Some(rk), Op::Score { q, out }) = (&plan.rope, &mut *op) {
        // Pre-RoPE keys: every piece (sinks, blocks, window) alike.
        rk.score(plan.isa, view, h, p0, n, q, g, out, &mut sc.rope);
        return;
    }
    pieces(plan, view, t, p0, p0 + n, |p, len, loc| {
        // The slice of the op's output or input for this piece.
        let at = (p - p0) * g;
        let mut sub = match op {
            Op::Score { q, out } => Op::Score {
                q: &q[..],
                out: &mut out[at..],
            },
            Op::Accum { p: pr, acc } => Op::Accum {
                p: &pr[at..],
                acc: &mut acc[..],
            },
        };
        match loc {
            Loc::Sink(s) => raw_rows(plan, view.sinks_raw(t), s, h, len, &mut sub),
            Loc::Window(w) => raw_rows(plan, view.ring_raw(t), w, h, len, &mut sub),
            Loc::Block(b, off) => {
                if t == Tensor::Key && off == 0 && !plan.dense {
                    prefetch_next_block(plan, view, h, p, 0, plan.block_tokens);
                }
                let part = view.block_part(b, h, t);
                let tl = &plan.layouts[i];
                let wpt = tl.words_per_token;
                let scales = &part[tl.scales_offset..tl.scales_offset + tl.param_words];
                let zeros = &part[tl.zeros_offset..tl.zeros_offset + tl.zero_words];
                let base = off * wpt;
                match plan.kinds[i] {
                    Kind::Full if plan.dense => {
                        // The same rows of the head's next block, prefetched
                        // a row at a time while these are computed: spread
                        // over the tile, the requests keep the memory system
                        // busy without queueing behind each other (a whole
                        // block at once, as `prefetch_next_block` asks for,
                        // stalls the loads of the tile being computed).
                        let next = (p - plan.sinks) / plan.block_tokens + 1;
                        let ahead = view
                            .block_at(next)
                            .and_then(|nb| view.block_part(nb, h, t).get(base..base + len * wpt))
                            .unwrap_or(&[]);
                        let rows = &part[..tl.codes_words()];
                        match plan.dtype {
                            Dtype::F32 => {
                                let r = F32Rows {
                                    data: as_f32(rows),
                                    base,
                                    stride: wpt,
                                };
                                apply_dense(plan, &r, len, &mut sub, ahead)
                            }
                            Dtype::Bf16 => {
                                let r = Bf16Rows {
                                    data: halves(rows),
                                    base: 2 * base,
                                    stride: 2 * wpt,
                                };
                                apply_dense(plan, &r, len, &mut sub, ahead)
                            }
                            Dtype::F16 => {
                                let r = F16Rows {
                                    data: halves(rows),
                                    base: 2 * base,
                                    stride: 2 * wpt,
                                };
                                apply_dense(plan, &r, len, &mut sub, ahead)
                            }
                        }
                    }
                    Kind::Full => {
                        let rows = &part[..tl.codes_words()];
                        match plan.dtype {
                            Dtype::F32 => apply(
                                plan,
                                &F32Rows {
                                    data: as_f32(rows),
                                    base,
                                    stride: wpt,
                                },
                                len,
                                &mut sub,
                            ),
                            Dtype::Bf16 => {
                                let r = Bf16Rows {
                                    data: halves(rows),
                                    base: 2 * base,
                                    stride: 2 * wpt,
                                };
                                apply(plan, &r, len, &mut sub)
                            }
                            Dtype::F16 => {
                                let r = F16Rows {
                                    data: halves(rows),
                                    base: 2 * base,
                                    stride: 2 * wpt,
                                };
                                apply(plan, &r, len, &mut sub)
                            }
                        }
                    }
                    Kind::ChanFold { group, .. } if sc.int8.is_some() => {
                        let k8 = sc.int8.as_mut().expect("checked");
                        k8.fold(part, tl, plan.scale[i], (b, off / group), off);
                        let Op::Score { out, .. } = &mut sub else {
                            unreachable!("an int8 query scores keys")
                        };
                        k8.scores(part, base, wpt, len, out, g, 1);
                    }
                    Kind::ChanFold { bits, group } => {
                        let key = (b, off / group);
                        if sc.key_group != Some(key) {
                            // Fold this group's scales into the query, its
                            // zero points into one constant per head.
                            let i0 = tl.param_index(off, 0);
                            read_params(plan.isa, scales, plan.scale[i], i0, &mut sc.cs);
                            read_params(plan.isa, zeros, plan.scale[i], i0, &mut sc.cz);
                            let Op::Score { q, .. } = &sub else {
                                unreachable!("folding is for keys")
                            };
                            for hh in 0..g {
                                let qh = &q[hh * d..(hh + 1) * d];
                                for ((f, x), s) in sc.qf[hh * d..(hh + 1) * d].iter_mut().zip(qh).zip(&sc.cs) {
                                    *f = x * s;
                                }
                            }
                            // sum_d q_d z_d for every head: the zero points as one row.
                            let zrow = F32Rows {
                                data: &sc.cz,
                                base: 0,
                                stride: d,
                            };
                            simd::dot(plan.isa, &zrow, 1, d, q, g, &mut sc.cst, g);
                            sc.key_group = Some(key);
                        }
                        let Op::Score { out, .. } = &mut sub else {
                            unreachable!("folding is for keys")
                        };
                        let qf = &sc.qf;
                        let mut folded = Op::Score {
                            q: qf,
                            out: &mut out[..],
                        };
                        match bits {
                            2 => apply(plan, &CodeRows::<2> { words: part, base, wpt }, len, &mut folded),
                            4 => apply(plan, &CodeRows::<4> { words: part, base, wpt }, len, &mut folded),
                            _ => apply(plan, &CodeRows::<8> { words: part, base, wpt }, len, &mut folded),
                        }
                        if let Op::Score { out, .. } = folded {
                            for r in 0..len {
                                for (o, c) in out[r * g..(r + 1) * g].iter_mut().zip(&sc.cst) {
                                    *o += c;
                                }
                            }
                        }
                    }
                    Kind::ChanDeq { bits, group } => {
                        let key = (b, off / group);
                        if sc.value_group != Some(key) {
                            let i0 = tl.param_index(off, 0);
                            read_params(plan.isa, scales, plan.scale[i], i0, &mut sc.vs);
                            read_params(plan.isa, zeros, plan.scale[i], i0, &mut sc.vz);
                            sc.value_group = Some(key);
                        }
                        let (s, z) = (&sc.vs[..], &sc.vz[..]);
                        match bits {
                            2 => apply(
                                plan,
                                &ChanRows::<2> {
                                    codes: CodeRows { words: part, base, wpt },
                                    s,
                                    z,
                                },
                                len,
                                &mut sub,
                            ),
                            4 => apply(
                                plan,
                                &ChanRows::<4> {
                                    codes: CodeRows { words: part, base, wpt },
                                    s,
                                    z,
                                },
                                len,
                                &mut sub,
                            ),
                            _ => apply(
                                plan,
                                &ChanRows::<8> {
                                    codes: CodeRows { words: part, base, wpt },
                                    s,
                                    z,
                                },
                                len,
                                &mut sub,
                            ),
                        }
                    }
                    Kind::Tok { bits, gshift } => {
                        let ng = d >> gshift;
                        let i0 = tl.param_index(off, 0);
                        sc.ts.resize(len * ng, 0.0);
                        sc.tz.resize(len * ng, 0.0);
                        read_params(plan.isa, scales, plan.scale[i], i0, &mut sc.ts);
                        read_params(plan.isa, zeros, plan.scale[i], i0, &mut sc.tz);
                        let (s, z) = (&sc.ts[..], &sc.tz[..]);
                        match bits {
                            2 => apply(
                                plan,
                                &TokRows::<2> {
                                    codes: CodeRows { words: part, base, wpt },
                                    s,
                                    z,
                                    ng,
                                    gshift,
                                },
                                len,
                                &mut sub,
                            ),
                            4 => apply(
                                plan,
                                &TokRows::<4> {
                                    codes: CodeRows { words: part, base, wpt },
                                    s,
                                    z,
                                    ng,
                                    gshift,
                                },
                                len,
                                &mut sub,
                            ),
                            _ => apply(
                                plan,
                                &TokRows::<8> {
                                    codes: CodeRows { words: part, base, wpt },
                                    s,
                                    z,
                                    ng,
                                    gshift,
                                },
                                len,
                                &mut sub,
                            ),
                        }
                    }
                    Kind::Codec if plan.codec[i].is_some() => {
                        let cr = plan.codec[i].as_ref().expect("matched");
                        match &mut sub {
                            Op::Score { out, .. } => {
                                cr.score(part, off, len, &sc.qrot, &sc.qsum, g, out);
                                for r in 0..len {
                                    for (o, m) in out[r * g..(r + 1) * g].iter_mut().zip(&sc.qm) {
                                        *o += m;
                                    }
                                }
                            }
                            Op::Accum { p: pr, .. } => {
                                cr.accum(part, off, len, pr, g, &mut sc.acc_rot, &mut sc.rows);
                                for r in 0..len {
                                    for (s, w) in sc.psum.iter_mut().zip(&pr[r * g..(r + 1) * g]) {
                                        *s += w;
                                    }
                                }
                            }
                        }
                    }
                    Kind::Codec => {
                        sc.rows.resize(len * d, 0.0);
                        for r in 0..len {
                            view.coded_row(t, p + r, h, &mut sc.rows[r * d..(r + 1) * d]);
                        }
                        let rows = F32Rows {
                            data: &sc.rows,
                            base: 0,
                            stride: d,
                        };
                        match &mut sub {
                            Op::Score { out, .. } => {
                                let mut rotated = Op::Score {
                                    q: &sc.qrot,
                                    out: &mut out[..],
                                };
                                apply(plan, &rows, len, &mut rotated);
                                for r in 0..len {
                                    for (o, m) in out[r * g..(r + 1) * g].iter_mut().zip(&sc.qm) {
                                        *o += m;
                                    }
                                }
                            }
                            Op::Accum { p: pr, .. } => {
                                let mut rotated = Op::Accum {
                                    p: &pr[..],
                                    acc: &mut sc.acc_rot,
                                };
                                apply(plan, &rows, len, &mut rotated);
                                for r in 0..len {
                                    for (s, w) in sc.psum.iter_mut().zip(&pr[r * g..(r + 1) * g]) {
                                        *s += w;
                                    }
                                }
                            }
                        }
                    }
                    Kind::Vq { bits } => {
                        let book = plan.vq[i].as_deref().expect("a vq kind has its codebooks");
                        let piece = super::vq::Piece {
                            book,
                            bits,
                            words: part,
                            base,
                            wpt,
                            len,
                            g,
                        };
                        let job = match &mut sub {
                            Op::Score { out, .. } => super::vq::Job::Score { lut: &sc.vq_lut, out },
                            Op::Accum { p: pr, .. } => super::vq::Job::Accum {
                                p: pr,
                                values: sc.vq_values.as_mut().expect("vq values have their sums"),
                            },
                        };
                        super::vq::run(plan.isa, &piece, job, &mut sc.vq_offs);
                    }
                    Kind::Generic => {
                        sc.rows.resize(len * d, 0.0);
                        for r in 0..len {
                            view.row(t, p + r, h, &mut sc.rows[r * d..(r + 1) * d]);
                        }
                        apply(
                            plan,
                            &F32Rows {
                                data: &sc.rows,
                                base: 0,
                                stride: d,
                            },
                            len,
                            &mut sub,
                        );
                    }
                }
            }
        }
    });
}

/// `out[h] = max(out[h], max_r s[r * G + h])` with the `G` maxima in
/// registers: over a runtime group size the generic tile loop kept them in
/// memory, a store per score (a quarter of the loop's time at GQA 32:8
/// with lookup-table schemes). Maxima are exact in any order.
fn col_max<const G: usize>(s: &[f32], out: &mut [f32]) {
    let mut m = [f32::NEG_INFINITY; G];
    m.copy_from_slice(&out[..G]);
    for row in s.chunks_exact(G) {
        for (t, &x) in m.iter_mut().zip(row) {
            *t = if x > *t { x } else { *t };
        }
    }
    out[..G].copy_from_slice(&m);
}

/// `l[h] += sum_r s[r * G + h]`, rows in order (the generic loop's sums),
/// the `G` sums in registers (see [`col_max`]).
fn col_add<const G: usize>(s: &[f32], l: &mut [f32]) {
    let mut a = [0f32; G];
    a.copy_from_slice(&l[..G]);
    for row in s.chunks_exact(G) {
        for (t, &x) in a.iter_mut().zip(row) {
            *t += x;
        }
    }
    l[..G].copy_from_slice(&a);
}

/// Asks for the share of the next block's K and V bytes of head `h` that
/// matches rows `off..off + n` of this one, while this block is computed: a
/// head's parts of consecutive blocks are a block apart in the pool, a
/// stride the hardware prefetchers do not follow. Spreading the requests
/// over the tiles keeps them from queueing behind each other.
fn prefetch_next_block(plan: &Plan, view: &SeqView, h: usize, p: usize, off: usize, n: usize) {
    let next = (p - plan.sinks) / plan.block_tokens + 1;
    let Some(b) = view.block_at(next) else {
        return;
    };
    let bt = plan.block_tokens;
    for t in [Tensor::Key, Tensor::Value] {
        let part = view.block_part(b, h, t);
        let part = &part[part.len() * off / bt..part.len() * (off + n).min(bt) / bt];
        #[cfg(target_arch = "x86_64")]
        for line in part.chunks(16) {
            // SAFETY: a prefetch is a hint; the address is inside `part`.
            // Into L2 (T1): measured at least as fast as T0 here, and it
            // leaves L1 to the tile being computed.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(line.as_ptr() as *const i8)
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = part;
    }
}

impl Scratch {
    fn new(plan: &Plan) -> Scratch {
        let (d, g) = (plan.d, plan.group);
        Scratch {
            qf: vec![0.0; g * d],
            cst: vec![0.0; g],
            key_group: None,
            cs: vec![0.0; d],
            cz: vec![0.0; d],
            vs: vec![0.0; d],
            vz: vec![0.0; d],
            value_group: None,
            ts: Vec::new(),
            tz: Vec::new(),
            rows: Vec::new(),
            qrot: Vec::new(),
            qm: vec![0.0; g],
            qsum: Vec::new(),
            acc_rot: vec![0.0; g * d],
            psum: vec![0.0; g],
            rope: RopeScratch::default(),
            int8: None,
            vq_lut: Vec::new(),
            vq_values: None,
            vq_offs: Vec::new(),
        }
    }
}

/// Online-softmax attention of the `group` query heads in `q` (already
/// scaled by the softmax scale) over tokens `a..z` of KV head `h`.
pub(crate) fn split_attention(plan: &Plan, view: &SeqView, h: usize, q: &[f32], a: usize, z: usize) -> Partial {
    let (d, g) = (plan.d, plan.group);
    let mut m = vec![f32::NEG_INFINITY; g];
    let mut l = vec![0f32; g];
    let mut acc = vec![0f32; g * d];
    let tile = plan.tile.max(1);
    let mut scores = vec![0f32; tile * g];
    let mut sc = Scratch::new(plan);
    sc.int8 = plan
        .int8
        .map(|(isa, bits, qg)| Int8Keys::new(isa, plan.isa, bits, g, d, qg, q));
    if plan.kinds[0] == Kind::Codec {
        // The query, rotated once per split like the keys were; the key
        // means' contribution `q . m` once per head.
        sc.qrot = q.to_vec();
        let codec = view.codec(Tensor::Key).expect("a codec kind has a codec");
        let mean = view.mean(Tensor::Key, h);
        for hh in 0..g {
            let qh = &mut sc.qrot[hh * d..(hh + 1) * d];
            codec.forward(qh, None);
            sc.qm[hh] = mean.map_or(0.0, |m| q[hh * d..(hh + 1) * d].iter().zip(m).map(|(a, b)| a * b).sum());
        }
        if let Some(cr) = plan.codec[0].as_ref().filter(|c| c.uniform()) {
            sc.qsum = cr.group_sums(&sc.qrot, g);
        }
    }
    if let Some(book) = plan.vq[0].as_deref() {
        super::vq::build_lut(plan.isa, book, q, g, &mut sc.vq_lut);
    }
    sc.vq_values = plan.vq[1].as_deref().map(|b| super::vq::VqValues::new(plan.isa, b, g));
    let mut fs = plan.fast.map(|f| fused::State::new(f, g, d, tile, q));
    let mut ds = plan.dense_tile.then(|| dense::TileState::new(g, d, tile));
    let mut vq_corr = vec![1f32; g];
    let mut t0 = a;
    while t0 < z {
        // Tiles after the sinks start at multiples of `tile` (counted from
        // the first quantized token), so that they line up with blocks and
        // key groups whatever the split's first token.
        let end = if t0 < plan.sinks {
            plan.sinks.min(t0 + tile)
        } else {
            plan.sinks + ((t0 - plan.sinks) / tile + 1) * tile
        };
        let n = end.min(z) - t0;
        if let (Some(f), Some(st)) = (plan.fast, fs.as_mut()) {
            if let Some(t) = fast_tile(plan, view, h, t0, n) {
                if let Some(rk) = &plan.rope {
                    let rs = &mut sc.rope;
                    fused::tile_scored(f, st, &t, &mut m, &mut l, &mut acc, |p| {
                        rk.score_heads_major(plan.isa, view, h, t0, n, q, g, p, rs)
                    });
                    t0 += n;
                    continue;
                }
                if let (Some(k8), fused::Keys::Channel { group }) = (sc.int8.as_mut(), f.keys) {
                    fused::tile_scored(f, st, &t, &mut m, &mut l, &mut acc, |p| int8_tile(k8, &t, group, p));
                    t0 += n;
                    continue;
                }
                fused::tile(f, st, &t, &mut m, &mut l, &mut acc);
                t0 += n;
                continue;
            }
        }
        if let Some(st) = ds.as_mut() {
            if let Some(t) = fast_tile(plan, view, h, t0, n) {
                dense::tile(plan.isa, st, &t, q, &mut m, &mut l, &mut acc);
                t0 += n;
                continue;
            }
        }
        let s = &mut scores[..n * g];
        run_tensor(plan, view, Tensor::Key, h, t0, n, &mut Op::Score { q, out: s }, &mut sc);
        // Tile maxima, one pass over the rows (scores are finite: the inputs are).
        let mut tmax = [f32::NEG_INFINITY; 64];
        let tmax = &mut tmax[..g.min(64)];
        match g {
            4 => col_max::<4>(s, tmax),
            8 => col_max::<8>(s, tmax),
            _ => {
                for row in s.chunks_exact(g) {
                    for (t, &x) in tmax.iter_mut().zip(row) {
                        *t = if x > *t { x } else { *t };
                    }
                }
            }
        }
        for hh in 0..g {
            let tm = if hh < 64 {
                tmax[hh]
            } else {
                (0..n).map(|i| s[i * g + hh]).fold(f32::NEG_INFINITY, f32::max)
            };
            let new_m = m[hh].max(tm);
            let corr = if m[hh] == f32::NEG_INFINITY {
                0.0
            } else {
                (m[hh] - new_m).exp()
            };
            vq_corr[hh] = corr;
            if corr != 1.0 {
                l[hh] *= corr;
                for x in &mut acc[hh * d..(hh + 1) * d] {
                    *x *= corr;
                }
                if plan.kinds[1] == Kind::Codec {
                    sc.psum[hh] *= corr;
                    for x in &mut sc.acc_rot[hh * d..(hh + 1) * d] {
                        *x *= corr;
                    }
                }
                if let Some(st) = fs.as_mut() {
                    st.rescale(hh, corr);
                }
            }
            m[hh] = new_m;
        }
        if let (Some(book), Some(v)) = (plan.vq[1].as_deref(), sc.vq_values.as_mut()) {
            // One pass for every head: the sums interleave them.
            v.rescale(book, &vq_corr);
        }
        for row in s.chunks_exact_mut(g) {
            for (x, mm) in row.iter_mut().zip(&m) {
                *x -= mm;
            }
        }
        simd::exp_le0(plan.isa, s);
        match g {
            4 => col_add::<4>(s, &mut l),
            8 => col_add::<8>(s, &mut l),
            _ => {
                for row in s.chunks_exact(g) {
                    for (li, p) in l.iter_mut().zip(row) {
                        *li += p;
                    }
                }
            }
        }
        run_tensor(
            plan,
            view,
            Tensor::Value,
            h,
            t0,
            n,
            &mut Op::Accum { p: s, acc: &mut acc },
            &mut sc,
        );
        t0 += n;
    }
    if let Some(st) = fs.as_mut() {
        st.flush(&mut l, &mut acc);
    }
    if let (Some(book), Some(v)) = (plan.vq[1].as_deref(), sc.vq_values.as_ref()) {
        // The value sums into the head-major output, once per split.
        v.fold(book, &mut acc);
    }
    if plan.kinds[1] == Kind::Codec {
        // Back from the rotated domain once: T^-1 (sum p v') + (sum p) m.
        let codec = view.codec(Tensor::Value).expect("a codec kind has a codec");
        let mean = view.mean(Tensor::Value, h);
        for hh in 0..g {
            let v = &mut sc.acc_rot[hh * d..(hh + 1) * d];
            codec.inverse(v, None);
            let w = sc.psum[hh];
            for (c, (a, x)) in acc[hh * d..(hh + 1) * d].iter_mut().zip(v.iter()).enumerate() {
                *a += x + mean.map_or(0.0, |m| w * m[c]);
            }
        }
    }
    Partial { m, l, acc }
}

/// The tile `t0..t0 + n` as the fast path takes it, if it can: whole
/// sixteens of rows of one block, quantized in both tensors.
fn fast_tile<'v>(plan: &Plan, view: &SeqView<'v>, h: usize, t0: usize, n: usize) -> Option<Tile<'v>> {
    if !n.is_multiple_of(ROWS) || n == 0 || t0 < plan.sinks {
        return None;
    }
    let j = t0 - plan.sinks;
    if j + n > view.quantized(Tensor::Key) || j + n > view.quantized(Tensor::Value) {
        return None;
    }
    let (Loc::Block(b, off), Loc::Block(b2, off2)) = (view.locate(Tensor::Key, t0), view.locate(Tensor::Value, t0))
    else {
        return None;
    };
    if b != b2 || off != off2 || !off.is_multiple_of(ROWS) || off + n > plan.block_tokens {
        return None;
    }
    // The matching rows of the head's next block, fetched while this tile
    // computes (see `prefetch_next_block`).
    let ahead = match view.block_at(j / plan.block_tokens + 1) {
        Some(nb) => [Tensor::Key, Tensor::Value].map(|t| {
            let part = view.block_part(nb, h, t);
            &part[part.len() * off / plan.block_tokens..part.len() * (off + n) / plan.block_tokens]
        }),
        None => [&[][..], &[][..]],
    };
    Some(Tile {
        kpart: view.block_part(b, h, Tensor::Key),
        vpart: view.block_part(b, h, Tensor::Value),
        ahead,
        block: b,
        off,
        n,
        klayout: plan.layouts[0],
        vlayout: plan.layouts[1],
    })
}

/// The scores `[g][n]` of a fused tile from the integer-domain query,
/// sixteen rows at a time (tiles and key groups are multiples of sixteen
/// rows, so the vector loops cover every row). Meanwhile it asks for the
/// tile's rows of the head's next block, K and V, a few lines per word of
/// the integer loops, as the f32 key loops of the fused path do
/// (`fused.rs`): without it the next tiles' rows wait on DRAM, measured as
/// most of the integer path's time with the KV cold; a tile's worth per
/// sixteen rows (bursts of 16 + 16 lines at MQA d256) stalled on the fill
/// buffers.
fn int8_tile(k8: &mut Int8Keys, t: &Tile, group: usize, p: &mut [f32]) {
    let wpt = t.klayout.words_per_token;
    let chunks = t.n / ROWS;
    // Lines per sixteen rows; pieces: (vector of rows, word) of the
    // integer loops.
    let burst = t.ahead.map(|a| a.len().div_ceil(16).div_ceil(chunks.max(1)));
    let per_chunk = ROWS / k8.rows() * wpt;
    let step = t
        .ahead
        .map(|a| a.len().div_ceil(16).div_ceil((chunks * per_chunk).max(1)));
    // Up to eight lines a part (GQA d128: 8 + 8) go out at once per
    // sixteen rows, measured ~10% cheaper there than spread over the words;
    // more (MQA d256: 16 + 16) stalled on the fill buffers, and spread
    // over the words the integer keys went from 1.2x the f32 path's CPU
    // time to parity.
    let spread = burst.iter().any(|&b| b > 8);
    for c in 0..chunks {
        if !spread {
            #[cfg(target_arch = "x86_64")]
            for (part, step) in t.ahead.iter().zip(burst) {
                let lines = part.len().div_ceil(16);
                for l in (c * step).min(lines)..((c + 1) * step).min(lines) {
                    // SAFETY: a prefetch is a hint; the address is inside `part`.
                    unsafe {
                        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(
                            part.as_ptr().add(16 * l) as *const i8
                        )
                    };
                }
            }
        }
        let r = c * ROWS;
        let off = t.off + r;
        let ahead = spread.then_some(Ahead {
            parts: t.ahead,
            step,
            piece: c * per_chunk,
        });
        // Fused tiles take f16 parameters only (`Plan::for_heads`).
        k8.fold(t.kpart, &t.klayout, ScaleDtype::F16, (t.block, off / group), off);
        k8.scores_ahead(t.kpart, off * wpt, wpt, ROWS, &mut p[r..], 1, t.n, ahead);
    }
}
