//! Pre-RoPE keys (`rope: pre(...)`, KVQuant) on the CPU: the cache holds
//! keys before rotary embedding and decode turns each cached key to its
//! absolute position before scoring it.
//!
//! Two equivalent ways exist: rotate the dequantized key by `R(t)`, or
//! rotate the query by the opposite angle, `q . R(t) k = (R(-t) q) . k`.
//! Both cost one complex multiply per channel pair and token, but the key's
//! rotation serves every query head of the GQA group while the query's must
//! be done per head, so rotating the key is `group` times cheaper in
//! rotations (measured: `cargo bench -p kivi-runtime --bench rope`,
//! docs/performance.md "Pre-RoPE keys"). [`Strategy::Query`] is kept for
//! that comparison and as a second implementation the tests hold to the
//! oracle.
//!
//! Cosines and sines: per tile, the angle of its first token is computed in
//! f64 and every later token's comes from the angle-addition formula with a
//! per-plan table of `r * f_i` (`r` below the tile size), also in f64, so a
//! tile costs `D/2` sine/cosine pairs rather than `n * D/2`; each result is
//! rounded to f32 once, as [`kivi_spec::Rope::cos_sin`] does.

use super::simd::{self, F32Rows, Isa};
use crate::cache::{params_at, Loc, SeqView};
use crate::quant::{dequantize, unpack_one, GroupParams};
use kivi_spec::layout::TensorLayout;
use kivi_spec::{Axis, Levels, Quant, Rope, Scheme, Tensor};
use std::sync::atomic::{AtomicU8, Ordering};

/// Which side of the dot product turns (`KIVI_CPU_ROPE=query` or
/// [`set_strategy`] picks the query).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Strategy {
    /// Rotate each key row once (the default: shared by the GQA group).
    Key,
    /// Rotate the query of every head by the opposite angle, per token.
    Query,
}

/// The strategy in force: 0 unset (read `KIVI_CPU_ROPE` once), 1 key,
/// 2 query.
static STRATEGY: AtomicU8 = AtomicU8::new(0);

impl Strategy {
    /// [`Strategy::Key`] unless [`set_strategy`] or `KIVI_CPU_ROPE=query`
    /// chose [`Strategy::Query`].
    fn current() -> Strategy {
        let mut v = STRATEGY.load(Ordering::Relaxed);
        if v == 0 {
            v = match std::env::var("KIVI_CPU_ROPE") {
                Ok(x) if x == "query" => 2,
                _ => 1,
            };
            let _ = STRATEGY.compare_exchange(0, v, Ordering::Relaxed, Ordering::Relaxed);
            v = STRATEGY.load(Ordering::Relaxed);
        }
        if v == 2 {
            Strategy::Query
        } else {
            Strategy::Key
        }
    }
}

/// Chooses how the CPU backend applies RoPE to pre-RoPE keys from now on:
/// `true` rotates the query by the opposite angle per token and head,
/// `false` (the default, measured cheaper) rotates each key row once. For
/// benchmarks and tests that hold both to the oracle; the results agree to
/// f32 rounding.
#[doc(hidden)]
pub fn set_strategy(rotate_query: bool) {
    STRATEGY.store(if rotate_query { 2 } else { 1 }, Ordering::Relaxed);
}

/// Per-call RoPE state of a plan.
pub(crate) struct RopeKeys {
    rope: Rope,
    d: usize,
    inv_freq: Vec<f64>,
    /// `(cos, sin)` of `r * f_i` for `r < tile`, `[r][i]`, f64.
    step: Vec<(f64, f64)>,
    tile: usize,
    pub strategy: Strategy,
    /// Channel-axis quantized keys: their quantizer and layout, so that a
    /// block's rows are decoded with each group's parameters read once
    /// (the row reader reads and widens them for every element).
    chan: Option<(Quant, TensorLayout)>,
}

/// Scratch of one task: decoded rows, the tile's cosines and sines, and
/// the parameters of the key group last read.
#[derive(Default)]
pub(crate) struct RopeScratch {
    rows: Vec<f32>,
    cs: Vec<(f32, f32)>,
    params: Vec<GroupParams>,
    group: Option<(u32, usize)>,
}

impl RopeKeys {
    /// The state for `s` when it declares `rope: pre(...)`.
    pub fn of(s: &Scheme, d: usize, tile: usize) -> Option<RopeKeys> {
        let rope = s.rope?;
        let half = d / 2;
        let inv_freq: Vec<f64> = (0..half).map(|i| rope.inv_freq(i, d)).collect();
        let tile = tile.max(1);
        let mut step = Vec::with_capacity(tile * half);
        for r in 0..tile {
            for f in &inv_freq {
                let (s, c) = (r as f64 * f).sin_cos();
                step.push((c, s));
            }
        }
        Some(RopeKeys {
            rope,
            d,
            inv_freq,
            step,
            tile,
            strategy: Strategy::current(),
            chan: None,
        })
    }

    /// Decodes channel-axis quantized keys group-wise (see `chan`); the
    /// values are those of the row reader, bit for bit (the same
    /// `params_at` and `dequantize`).
    pub fn with_key_layout(mut self, s: &Scheme, tl: TensorLayout) -> RopeKeys {
        // A calibrated (`nuq`) table lives in the cache, not the scheme: those
        // keys take the cache's own row reader.
        if let Some(q) = s
            .key
            .quant()
            .filter(|q| q.axis == Axis::Channel && !matches!(q.levels, Levels::Nuq(_)))
        {
            self.chan = Some((*q, tl));
        }
        self
    }

    /// Key row of token `p`, KV head `h`, into `out`.
    fn key_row(
        &self,
        view: &SeqView,
        p: usize,
        h: usize,
        out: &mut [f32],
        sc_params: &mut Vec<GroupParams>,
        sc_group: &mut Option<(u32, usize)>,
    ) {
        if let (Some((q, tl)), Loc::Block(b, off)) = (&self.chan, view.locate(Tensor::Key, p)) {
            let part = view.block_part(b, h, Tensor::Key);
            let key = (b, off / q.group as usize);
            if *sc_group != Some(key) {
                sc_params.clear();
                sc_params.extend((0..self.d).map(|c| params_at(tl, part, q, off, c)));
                *sc_group = Some(key);
            }
            let row = &part[off * tl.words_per_token..][..tl.words_per_token];
            for (c, (o, gp)) in out.iter_mut().zip(sc_params.iter()).enumerate() {
                *o = dequantize(unpack_one(row, q.bits, c), *gp, q);
            }
        } else {
            view.row(Tensor::Key, p, h, out);
        }
    }

    /// `(cos, sin)` as f32 for positions `p0..p0 + n` (`n <= tile`), `[r][i]`.
    fn table(&self, p0: usize, n: usize, cs: &mut Vec<(f32, f32)>) {
        let half = self.d / 2;
        cs.clear();
        let base: Vec<(f64, f64)> = self
            .inv_freq
            .iter()
            .map(|f| {
                let (s, c) = (p0 as f64 * f).sin_cos();
                (c, s)
            })
            .collect();
        for r in 0..n {
            if r >= self.tile {
                // Not reached by the kernel (tiles are at most `tile`); exact.
                cs.extend((0..half).map(|i| self.rope.cos_sin(p0 + r, i, self.d)));
                continue;
            }
            for (i, &(cb, sb)) in base.iter().enumerate() {
                let (cr, sr) = self.step[r * half + i];
                cs.push(((cb * cr - sb * sr) as f32, (sb * cr + cb * sr) as f32));
            }
        }
    }

    /// `out[r * g + h] = q_h . R(p0 + r) k_{p0 + r}` for the `g` query heads
    /// in `q` (`[g][D]`, already scaled) over tokens `p0..p0 + n` of KV
    /// head `h` of `view`. `rows` and `cs` are scratch.
    #[allow(clippy::too_many_arguments)]
    pub fn score(
        &self,
        isa: Isa,
        view: &SeqView,
        h: usize,
        p0: usize,
        n: usize,
        q: &[f32],
        g: usize,
        out: &mut [f32],
        sc: &mut RopeScratch,
    ) {
        let d = self.d;
        let RopeScratch {
            rows,
            cs,
            params,
            group,
        } = sc;
        rows.resize(n * d, 0.0);
        for r in 0..n {
            self.key_row(view, p0 + r, h, &mut rows[r * d..(r + 1) * d], params, group);
        }
        self.table(p0, n, cs);
        match self.strategy {
            Strategy::Key => {
                for r in 0..n {
                    self.turn(&mut rows[r * d..(r + 1) * d], &cs[r * d / 2..(r + 1) * d / 2], false);
                }
                let kr = F32Rows {
                    data: rows,
                    base: 0,
                    stride: d,
                };
                simd::dot(isa, &kr, n, d, q, g, out, g);
            }
            Strategy::Query => {
                let mut qt = vec![0f32; g * d];
                for r in 0..n {
                    qt.copy_from_slice(&q[..g * d]);
                    for hh in 0..g {
                        self.turn(&mut qt[hh * d..(hh + 1) * d], &cs[r * d / 2..(r + 1) * d / 2], true);
                    }
                    let kr = F32Rows {
                        data: rows,
                        base: r * d,
                        stride: d,
                    };
                    simd::dot(isa, &kr, 1, d, &qt, g, &mut out[r * g..(r + 1) * g], g);
                }
            }
        }
    }

    /// Rotates one row by the angles of `cs` (`D/2` pairs), or by their
    /// opposites when `back`.
    fn turn(&self, x: &mut [f32], cs: &[(f32, f32)], back: bool) {
        let d = self.d;
        for (i, &(c, s)) in cs.iter().enumerate() {
            let s = if back { -s } else { s };
            let (a, b) = self.rope.style.pair(i, d);
            let (xa, xb) = (x[a], x[b]);
            // Plain products: `mul_add` is a library call where the target
            // has no FMA.
            x[a] = xa * c - xb * s;
            x[b] = xb * c + xa * s;
        }
    }

    /// Rotates rows `[tokens][Hkv][D]` whose first token is at position
    /// `first` in place (many-query attention's full-precision tails and
    /// stored rows, read once per unit).
    pub fn rotate_rows(&self, rows: &mut [f32], first: usize, hkv: usize) {
        let d = self.d;
        let per = hkv * d;
        let mut cs = Vec::new();
        for (c0, chunk) in rows.chunks_mut(self.tile * per).enumerate() {
            let n = chunk.len() / per;
            self.table(first + c0 * self.tile, n, &mut cs);
            for r in 0..n {
                for hh in 0..hkv {
                    let x = &mut chunk[(r * hkv + hh) * d..][..d];
                    self.turn(x, &cs[r * d / 2..(r + 1) * d / 2], false);
                }
            }
        }
    }
}
