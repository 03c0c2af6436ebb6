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
//! table of `r * f_i` (`r` below the tile size, [`Tables`]), also in f64, so a
//! tile costs `D/2` sine/cosine pairs rather than `n * D/2`; each result is
//! rounded to f32 once, as [`kivi_spec::Rope::cos_sin`] does.
//!
//! Key outliers (`outliers: sparse(..., apply = [key])`, KVQuant's
//! dense-and-sparse keys) live in the pre-RoPE domain like the codes: the
//! row reader and the channel-group decode add each stored correction to
//! the decoded pre-RoPE row, which is then turned like any other.
//!
//! The vector path (`avx512-vec+rope` / `avx2-vec+rope`: channel-axis
//! 1/2/4-bit keys with uniform, Lloyd–Max or calibrated `nuq` levels, no
//! codec pipeline (so no key outliers), `D % 16 == 0`, key strategy) splits
//! the turn between the two sides: `q . R(p0 + r) k = (R(-(p0 + r0)) q) .
//! (R(r - r0) k)` over sub-tiles of [`SUB`] rows starting at `r0`, each loop
//! written once over the vector width ([`super::width::Width`]) and compiled
//! per ISA:
//! - the query of every head is turned once per sub-tile by the angles of
//!   `p0 + r0` (the tile's first angles, carried from the previous tile by
//!   one more angle addition, a fresh `sin_cos` every [`CHAIN`] tiles,
//!   advanced by the step table's row `r0`, all in f64, rounded to f32 once);
//! - each key row is turned by `R(r - r0)` from a fixed table of `SUB` rows
//!   ([`Tables`], made once per process: 32 KiB at `D = 256`, in L1), stored
//!   expanded, one cosine and one signed sine per channel, so that a row
//!   turns as `x * cos + partner(x) * sin`, `partner` being the other half
//!   (`half`) or the neighbour in the pair (`interleaved`, a lane swap).
//!   This replaced a table of every token's angles per tile (built in f64,
//!   `2 * tile * D` floats written and read back from L2), which with its
//!   `sin_cos` calls was a fifth of a 32k-token decode; the query turns cost
//!   about a sixth of the key turns at four heads;
//! - a key row is decoded and turned eight (AVX2) or sixteen (AVX-512,
//!   `interleaved` or `D % 32 == 0`) channels at a time without leaving
//!   registers: its word broadcast, shifted per lane, masked and
//!   converted, then `c * s + z` with the group's per-channel parameters (a
//!   multiply and an add, as [`crate::quant::decode`]: bit for bit the row
//!   reader's values), read once per run of rows in one block and key group;
//!   table levels look the code up in a register instead (`vpermps`, two
//!   and a blend for 16 entries on AVX2) and take `s * table[c] + 0`, the
//!   row reader's `s * table[c]` ([`crate::quant::dequantize_in`]);
//! - a sub-tile's turned rows (in L1) are scored by the ISA's dot product
//!   against the turned queries; where the plan allows the fused path's
//!   value coding (`kernel.rs`), its softmax and value half takes the
//!   scores; a tile that starts a block prefetches the next block of both
//!   tensors into L2, as the kernel's generic loop does for its own keys.
//!
//! Rounding: the oracle turns each key by the f32 cosines and sines of
//! `p0 + r`; here the query and the key are each turned by f32 rounded
//! angles whose sum is that angle, so scores differ by a few f32 ulps of
//! `|q| |k|` (the 1e-5 contract holds with orders of magnitude to spare).
//!
//! The row reader took a bounds-checked unpack, a parameter read and a call
//! per element, and the scalar turn a match per pair: that was the 13-35x.

use super::simd::{self, F32Rows, Isa};
use crate::cache::{params_at, Loc, SeqView};
use crate::quant::{dequantize_in, unpack_one, GroupParams};
use kivi_spec::layout::TensorLayout;
use kivi_spec::{Axis, Levels, Quant, Rope, RopeStyle, ScaleDtype, Scheme, Tensor};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

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

/// `false` turns the vector path off for plans made from now on (the row
/// reader's path, kept as the benchmark's baseline).
static VECTOR: AtomicBool = AtomicBool::new(true);

/// Whether plans made from now on may take the vector path (default
/// `true`); `false` keeps the row reader's key path, for the benchmark that
/// compares the two. Results agree to f32 rounding either way.
#[doc(hidden)]
pub fn set_vector(on: bool) {
    VECTOR.store(on, Ordering::Relaxed);
}

/// Per-call RoPE state of a plan.
pub(crate) struct RopeKeys {
    rope: Rope,
    d: usize,
    /// Frequencies and angle tables, shared by every plan of the same RoPE,
    /// head size and tile.
    t: Arc<Tables>,
    tile: usize,
    /// The scheme's sinks (blocks are counted from the first token after them).
    sinks: usize,
    pub strategy: Strategy,
    /// Channel-axis quantized keys: their quantizer and layout, so that a
    /// block's rows are decoded with each group's parameters read once
    /// (the row reader reads and widens them for every element).
    chan: Option<(Quant, TensorLayout)>,
    /// Code bits of keys the vector path decodes (see the module comment).
    vec_bits: Option<u32>,
    /// Whether those codes index a table (Lloyd–Max or a calibrated `nuq`
    /// codebook, read from the cache's codec at decode time) rather than
    /// being uniform levels.
    vec_table: bool,
}

/// The angle tables of one RoPE, head size and tile: a plan is made per
/// decode call, and computing them there cost `(tile + SUB) * D/2` `sin_cos`
/// calls each time (~3 % of a 32k-token decode at `D = 256`), so they are
/// made once per process and key ([`Tables::get`]).
pub(crate) struct Tables {
    inv_freq: Vec<f64>,
    /// `(cos, sin)` of `r * f_i` for `r < tile`, `[r][i]`, f64.
    step: Vec<(f64, f64)>,
    /// `step` split into cosines and sines (`[r][i]`, `r <= tile`), for
    /// vector loads.
    step_c: Vec<f64>,
    step_s: Vec<f64>,
    /// The vector path's key table: `R(r)` for `r < SUB`, expanded, one
    /// cosine and one signed sine per channel (`[r][D]`, see the module
    /// comment), each the f64 value rounded to f32 once.
    fixed_c: Vec<f32>,
    fixed_s: Vec<f32>,
}

/// The tables made so far, with their keys (theta and scaling bits, style,
/// `D`, tile); a handful in practice (a model's one or two RoPE bases),
/// capped at [`TABLES_KEPT`], the oldest dropped first.
type TableKey = (u64, u64, bool, usize, usize);
static TABLES: Mutex<Vec<(TableKey, Arc<Tables>)>> = Mutex::new(Vec::new());
const TABLES_KEPT: usize = 16;

impl Tables {
    /// The tables for `rope` at head size `d` and tile `tile`, made on
    /// first use.
    fn get(rope: Rope, d: usize, tile: usize) -> Arc<Tables> {
        let key = (
            rope.theta.to_bits(),
            rope.scaling.to_bits(),
            rope.style == RopeStyle::Interleaved,
            d,
            tile,
        );
        // A poisoned lock only means another thread panicked while holding
        // it; the list is valid at every step.
        let mut kept = TABLES.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, t)) = kept.iter().find(|(k, _)| *k == key) {
            return t.clone();
        }
        let t = Arc::new(Tables::new(rope, d, tile));
        if kept.len() >= TABLES_KEPT {
            kept.remove(0);
        }
        kept.push((key, t.clone()));
        t
    }

    fn new(rope: Rope, d: usize, tile: usize) -> Tables {
        let half = d / 2;
        let inv_freq: Vec<f64> = (0..half).map(|i| rope.inv_freq(i, d)).collect();
        let mut step = Vec::with_capacity(tile * half);
        for r in 0..tile {
            for f in &inv_freq {
                let (s, c) = (r as f64 * f).sin_cos();
                step.push((c, s));
            }
        }
        // The vector path's step table has one more row, `r = tile`, which
        // carries a tile's first angles to the next tile's.
        let last = inv_freq.iter().map(|f| {
            let (s, c) = (tile as f64 * f).sin_cos();
            (c, s)
        });
        let (step_c, step_s) = step.iter().copied().chain(last).unzip();
        let (fixed_c, fixed_s) = fixed_table(&inv_freq, rope.style);
        Tables {
            inv_freq,
            step,
            step_c,
            step_s,
            fixed_c,
            fixed_s,
        }
    }
}

/// Scratch of one task: decoded rows, the tile's cosines and sines, and
/// the parameters of the key group last read.
#[derive(Default)]
pub(crate) struct RopeScratch {
    rows: Vec<f32>,
    cs: Vec<(f32, f32)>,
    params: Vec<GroupParams>,
    group: Option<(u32, usize)>,
    /// Vector path: the group's scales and zero points per channel, one
    /// decoded row, the key group they belong to.
    scales: Vec<f32>,
    zeros: Vec<f32>,
    tmp: Vec<f32>,
    vgroup: Option<(u32, usize)>,
    /// The f64 cosines and sines of the last tile's first angles, that
    /// tile (`p0`, `n`) and how many tiles carried them since a `sin_cos`.
    bc: Vec<f64>,
    bs: Vec<f64>,
    base: Option<(usize, usize, u32)>,
    /// A sub-tile's turned query `[g][D]` and its f32 cosines and sines
    /// (`[D/2]`).
    qt: Vec<f32>,
    qc: Vec<f32>,
    qs: Vec<f32>,
    /// `[n][g]` scores on their way to `[g][n]`.
    scores: Vec<f32>,
}

/// Rows of a vector-path sub-tile: the query is turned once per sub-tile and
/// each key row by the fixed `R(r)`, `r < SUB` (`2 * SUB * D` floats: 32 KiB
/// at `D = 256`, in L1). A query turn costs about what `SUB / 4` key turns
/// do at four heads; 16 makes it a sixth of the rows' turning.
const SUB: usize = 16;

/// Tiles whose first angles are carried by angle addition before they are
/// computed afresh: each addition adds a few f64 ulps, so after `CHAIN` the
/// angles are still ~1e-13 from exact, far below an f32 ulp (6e-8). At 16
/// the fresh `sin_cos` calls were ~1.5 % of a 32k-token decode at `D = 256`.
const CHAIN: u32 = 128;

impl RopeKeys {
    /// The state for `s` when it declares `rope: pre(...)`.
    pub fn of(s: &Scheme, d: usize, tile: usize) -> Option<RopeKeys> {
        let rope = s.rope?;
        let tile = tile.max(1);
        let t = Tables::get(rope, d, tile);
        Some(RopeKeys {
            rope,
            d,
            t,
            tile,
            sinks: s.sinks as usize,
            strategy: Strategy::current(),
            chan: None,
            vec_bits: None,
            vec_table: false,
        })
    }

    /// Decodes channel-axis quantized keys group-wise (see `chan`); the
    /// values are those of the row reader, bit for bit (the same
    /// `params_at` and `dequantize`).
    pub fn with_key_layout(mut self, s: &Scheme, tl: TensorLayout) -> RopeKeys {
        // Table-driven keys (Lloyd–Max, or a calibrated `nuq` codebook, which
        // lives in the cache, not the scheme) decode with the cache codec's
        // own table, read when a tile is scored (`key_row`, `score_vec`).
        if let Some(q) = s.key.quant().filter(|q| q.axis == Axis::Channel) {
            self.chan = Some((*q, tl));
            // The vector decode: eight channels lie in one word (1, 2, 4
            // bits), `c * s + z` or `s * table[c]` levels (at most 16, one
            // or two register permutes), halves of whole vectors.
            self.vec_table = q.levels != Levels::Uniform;
            if matches!(q.bits, 1 | 2 | 4)
                && s.rotation_of(Tensor::Key).is_none()
                && s.outliers_of(Tensor::Key) == 0
                && s.center_of(Tensor::Key).is_none()
                && self.d.is_multiple_of(16)
                && VECTOR.load(Ordering::Relaxed)
            {
                self.vec_bits = Some(q.bits);
            }
        }
        self
    }

    /// Whether [`RopeKeys::score`] takes the vector path on `isa`.
    pub fn vector(&self, isa: Isa) -> bool {
        self.vec_bits.is_some() && self.strategy == Strategy::Key && isa != Isa::Scalar && simd_ok()
    }

    /// Code bits of the keys the vector path decodes, where it may.
    pub fn vector_bits(&self) -> Option<u32> {
        self.vec_bits
    }

    /// [`RopeKeys::score`] with the scores laid out `[g][n]` (head-major, as
    /// the fused path's softmax reads them) rather than `[n][g]`.
    #[allow(clippy::too_many_arguments)]
    pub fn score_heads_major(
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
        let mut s = std::mem::take(&mut sc.scores);
        s.resize(n * g, 0.0);
        self.score(isa, view, h, p0, n, q, g, &mut s, sc);
        for (r, row) in s.chunks_exact(g).enumerate() {
            for (hh, &x) in row.iter().enumerate() {
                out[hh * n + r] = x;
            }
        }
        sc.scores = s;
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
            // The cache's codec holds the table its writes coded against
            // (the fixed one, or the calibration's): the row reader's values.
            let levels = view.codec(Tensor::Key).map_or(&[][..], |c| &c.levels[..]);
            for (c, (o, gp)) in out.iter_mut().zip(sc_params.iter()).enumerate() {
                *o = dequantize_in(unpack_one(row, q.bits, c), *gp, q, levels);
            }
            // Key outliers (dense-and-sparse): corrections stored before
            // RoPE, added before the row is turned, as the row reader does
            // (pre-RoPE keys have no rotation or centering to undo).
            if tl.outliers > 0 {
                view.add_outliers(tl, part, off, out);
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
            .t
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
                let (cr, sr) = self.t.step[r * half + i];
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
        #[cfg(target_arch = "x86_64")]
        if n <= self.tile && self.vector(isa) {
            self.score_vec(isa, view, h, p0, n, q, g, out, sc);
            return;
        }
        let d = self.d;
        let RopeScratch {
            rows,
            cs,
            params,
            group,
            ..
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

    /// The vector path of [`RopeKeys::score`] (its conditions: [`RopeKeys::vector`], `n <= tile`):
    /// `q . R(p0 + r) k = (R(-(p0 + r0)) q) . (R(r - r0) k)` in sub-tiles of
    /// [`SUB`] rows from `r0`: the query of every head turned once per
    /// sub-tile, each key row by the plan's fixed table of `R(0..SUB)` (in
    /// L1 for good, where a table per tile cost as much to build and read as
    /// the rest of the key side), the sub-tile's rows scored from L1.
    #[cfg(target_arch = "x86_64")]
    #[allow(clippy::too_many_arguments)]
    fn score_vec(
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
        let half = d / 2;
        let (Some(bits), Some((qz, tl))) = (self.vec_bits, &self.chan) else {
            unreachable!("checked by `vector`")
        };
        let interleaved = self.rope.style == RopeStyle::Interleaved;
        if let Loc::Block(_, 0) = view.locate(Tensor::Key, p0) {
            self.prefetch_next_block(view, h, p0, tl.block_tokens);
        }
        self.base_angles(p0, n, sc);
        sc.rows.resize(SUB * d, 0.0);
        sc.tmp.resize(d, 0.0);
        sc.scales.resize(d, 0.0);
        sc.zeros.resize(d, 0.0);
        sc.qt.resize(g * d, 0.0);
        sc.qc.resize(half, 0.0);
        sc.qs.resize(half, 0.0);
        let (gsz, wpt) = (qz.group as usize, tl.words_per_token);
        let table = self.vec_table;
        // Table levels: the cache codec's table, zero-padded to 16 entries
        // (a code past the end of the table decodes to 0, as in
        // `dequantize_in`: `0 * s + 0`).
        let mut levels = [0f32; 16];
        if table {
            let t = view.codec(Tensor::Key).map_or(&[][..], |c| &c.levels[..]);
            for (l, x) in levels.iter_mut().zip(t) {
                *l = *x;
            }
        }
        let wide = isa == Isa::Avx512 && avx512_ok() && (interleaved || d.is_multiple_of(32));
        assert!(matches!(bits, 1 | 2 | 4), "checked by `with_key_layout`");
        let decode_turn = vecs::decode_turn(wide, table, bits);
        assert!(wpt * (32 / bits as usize) >= d);
        let qturn = if isa == Isa::Avx512 && avx512_ok() {
            vecs::qturn512
        } else {
            vecs::qturn
        };
        let mut r0 = 0;
        while r0 < n {
            let m = (n - r0).min(SUB);
            // The query of every head turned back by the angles of
            // `p0 + r0`: the tile's (f64) advanced by `r0` (the step table's
            // row `r0 < n <= tile`), rounded to f32 once, as the table was.
            assert!(self.t.step_c.len() >= (r0 + 1) * half && self.t.step_s.len() >= (r0 + 1) * half);
            assert!(q.len() >= g * d && sc.bc.len() == half && sc.bs.len() == half);
            // SAFETY: `vector` checked AVX2 + FMA, AVX-512F just above; the
            // slices' lengths are asserted or resized above.
            unsafe {
                qturn(
                    &sc.bc,
                    &sc.bs,
                    &self.t.step_c[r0 * half..(r0 + 1) * half],
                    &self.t.step_s[r0 * half..(r0 + 1) * half],
                    &q[..g * d],
                    interleaved,
                    &mut sc.qc,
                    &mut sc.qs,
                    &mut sc.qt,
                )
            };
            let mut r = r0;
            while r < r0 + m {
                let p = p0 + r;
                match view.locate(Tensor::Key, p) {
                    Loc::Block(b, off) => {
                        // A run of rows in one block and key group: located,
                        // sliced and given their parameters once. Its last row in
                        // the same block at the matching offset means every row
                        // between is (a block holds consecutive positions); else
                        // (a block or window boundary inside) one row at a time.
                        let mut len = (r0 + m - r).min(gsz - off % gsz);
                        if len > 1
                            && !matches!(view.locate(Tensor::Key, p + len - 1), Loc::Block(b2, o2) if b2 == b && o2 == off + len - 1)
                        {
                            len = 1;
                        }
                        let part = view.block_part(b, h, Tensor::Key);
                        let key = (b, off / gsz);
                        if sc.vgroup != Some(key) {
                            // f16 parameters of a channel-axis group lie side by
                            // side: eight widened per instruction (exact, as
                            // `params_at`'s one at a time, which cost a division
                            // per channel: a tenth of the path).
                            // Table levels have no zero point (`s * table[c]`)
                            // unless their norm is `minmax` (`s * table[c] + z`).
                            let i0 = tl.param_index(off, 0);
                            let halves = |at: usize| part.get(at..).filter(|w| 2 * w.len() >= i0 + d);
                            let run = qz.scale == ScaleDtype::F16 && tl.param_index(off, d - 1) == i0 + d - 1;
                            let zw = if table && !qz.has_zeros() {
                                None
                            } else {
                                halves(tl.zeros_offset)
                            };
                            match (halves(tl.scales_offset), zw) {
                                (Some(sw), Some(zw)) if run && qz.has_zeros() => {
                                    // SAFETY: AVX2 + F16C checked by `vector`;
                                    // `halves` checked halves `i0..i0 + d` are
                                    // in both slices, `d` floats in the outputs.
                                    unsafe {
                                        vecs::f16_run(sw, i0, &mut sc.scales[..d]);
                                        vecs::f16_run(zw, i0, &mut sc.zeros[..d]);
                                    }
                                }
                                (Some(sw), _) if run && table => {
                                    // SAFETY: as above, for the scales.
                                    unsafe { vecs::f16_run(sw, i0, &mut sc.scales[..d]) };
                                    sc.zeros.fill(0.0);
                                }
                                _ => {
                                    for c in 0..d {
                                        let gp = params_at(tl, part, qz, off, c);
                                        sc.scales[c] = gp.scale;
                                        sc.zeros[c] = if table && !qz.has_zeros() { 0.0 } else { gp.zero };
                                    }
                                }
                            }
                            sc.vgroup = Some(key);
                        }
                        // Rows `rr..rr + len` of the sub-tile, row `i` turned
                        // by `R(i)`: one call for the run.
                        let rr = r - r0;
                        // SAFETY: AVX2 checked by `vector`, AVX-512F above;
                        // each row holds `d` codes (assert above), the other
                        // slices `d` floats a row; `D % 32` for AVX-512 `half`.
                        unsafe {
                            decode_turn(
                                &part[off * wpt..(off + len) * wpt],
                                wpt,
                                &levels,
                                &sc.scales[..d],
                                &sc.zeros[..d],
                                &self.t.fixed_c[rr * d..(rr + len) * d],
                                &self.t.fixed_s[rr * d..(rr + len) * d],
                                interleaved,
                                &mut sc.rows[rr * d..(rr + len) * d],
                            )
                        };
                        r += len;
                    }
                    _ => {
                        view.row(Tensor::Key, p, h, &mut sc.tmp);
                        // SAFETY: AVX2 checked; all four slices hold `d` floats.
                        unsafe {
                            vecs::turn(
                                &sc.tmp,
                                &self.t.fixed_c[(r - r0) * d..(r - r0 + 1) * d],
                                &self.t.fixed_s[(r - r0) * d..(r - r0 + 1) * d],
                                interleaved,
                                &mut sc.rows[(r - r0) * d..(r - r0 + 1) * d],
                            )
                        };
                        r += 1;
                    }
                }
            }
            let kr = F32Rows {
                data: &sc.rows,
                base: 0,
                stride: d,
            };
            simd::dot(isa, &kr, m, d, &sc.qt, g, &mut out[r0 * g..], g);
            r0 += m;
        }
    }

    /// Asks for the next block of KV head `h` (both tensors) into L2 when a
    /// tile starts a block at `p0`, as the kernel's generic loop does for
    /// keys it reads itself (`kernel.rs`, `prefetch_next_block`): without
    /// it, the codes' loads were the largest stall of the decode-and-turn
    /// loop and of the value loops after it (perf, MQA 4:1 32k).
    #[cfg(target_arch = "x86_64")]
    fn prefetch_next_block(&self, view: &SeqView, h: usize, p0: usize, bt: usize) {
        let Some(b) = view.block_at((p0 - self.sinks) / bt + 1) else {
            return;
        };
        for t in [Tensor::Key, Tensor::Value] {
            for line in view.block_part(b, h, t).chunks(16) {
                // SAFETY: a prefetch is a hint; the address is inside the
                // part. Into L2 (T1), as the kernel's.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(line.as_ptr() as *const i8)
                };
            }
        }
    }

    /// Sets `sc.bc`, `sc.bs` to the f64 cosines and sines of the angles of
    /// position `p0` (a tile of `n` tokens): kept where the last tile was
    /// the same, carried from it by one angle addition (`r = n` of the step
    /// table) where it ended at `p0`, else (and every [`CHAIN`] tiles, so
    /// that the f64 error stays near 1e-15) from `sin_cos`, which costs as
    /// much as the rest of a tile's angle work.
    fn base_angles(&self, p0: usize, n: usize, sc: &mut RopeScratch) {
        let half = self.d / 2;
        match sc.base {
            Some((p, _, k)) if p == p0 && sc.bc.len() == half => sc.base = Some((p0, n, k)),
            Some((p, len, k)) if p + len == p0 && len <= self.tile && k < CHAIN && sc.bc.len() == half => {
                for i in 0..half {
                    let (cb, sb) = (sc.bc[i], sc.bs[i]);
                    let (cr, sr) = (self.t.step_c[len * half + i], self.t.step_s[len * half + i]);
                    sc.bc[i] = cb * cr - sb * sr;
                    sc.bs[i] = sb * cr + cb * sr;
                }
                sc.base = Some((p0, n, k + 1));
            }
            _ => {
                sc.bc.clear();
                sc.bs.clear();
                for f in &self.t.inv_freq {
                    let (s, c) = (p0 as f64 * f).sin_cos();
                    sc.bc.push(c);
                    sc.bs.push(s);
                }
                sc.base = Some((p0, n, 0));
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

/// `R(r)` for `r < SUB` expanded per channel: `(cos, sin)` of `r * f_i`
/// from `sin_cos` in f64, rounded to f32 once ([`kivi_spec::Rope::cos_sin`]'s
/// rounding), channel `j` given its pair's cosine and the sine signed for
/// its side (`-s` on the pair's first channel), so that a row turns as
/// `x * cos + partner(x) * sin`.
fn fixed_table(inv_freq: &[f64], style: RopeStyle) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let d = 2 * half;
    let (mut co, mut si) = (vec![0f32; SUB * d], vec![0f32; SUB * d]);
    for r in 0..SUB {
        for (i, f) in inv_freq.iter().enumerate() {
            let (s, c) = (r as f64 * f).sin_cos();
            let (c, s) = (c as f32, s as f32);
            let (a, b) = match style {
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                RopeStyle::Half => (i, i + half),
            };
            co[r * d + a] = c;
            co[r * d + b] = c;
            si[r * d + a] = -s;
            si[r * d + b] = s;
        }
    }
    (co, si)
}

/// AVX-512F + DQ are there (the wide loops' features).
#[cfg(target_arch = "x86_64")]
fn avx512_ok() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq")
}

/// AVX2 + FMA + F16C are there (the vector path's intrinsics; an `Isa` above
/// scalar implies them, checked again because the path is unsafe code).
fn simd_ok() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The vector path's loops, each written once over [`Width`]: eight f32
/// lanes (AVX2) or sixteen (AVX-512), one `#[target_feature]` entry point
/// per width instantiating the same `#[inline(always)]` body (as `fused.rs`
/// and `dense.rs` do). Callers check the features and the slice lengths
/// each function names.
#[cfg(target_arch = "x86_64")]
mod vecs {
    use super::super::width::{Avx2, Avx512, Lanes, Width};

    /// The query of every head turned back by the angles whose f64
    /// cosines and sines are `cb cr - sb sr` and `sb cr + cb sr` (a tile's
    /// first angles `bc`, `bs` advanced by the step table's row `cr`, `sr`),
    /// rounded to f32 once into `qc`, `qs` (`[D/2]`): per pair `(a, b)`,
    /// `a' = a c + b s`, `b' = b c - a s`, i.e. `R(-t) q`, so that
    /// `R(-t) q . R(r) k = q . R(t + r) k`. Plain arithmetic over slices
    /// that each entry point's features let the compiler vectorise (no
    /// intrinsics, nothing to mirror); `q` and `out` are `[g][D]`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn qturn_body(
        bc: &[f64],
        bs: &[f64],
        cr: &[f64],
        sr: &[f64],
        q: &[f32],
        interleaved: bool,
        qc: &mut [f32],
        qs: &mut [f32],
        out: &mut [f32],
    ) {
        let half = qc.len();
        let d = 2 * half;
        for ((c, s), ((&cb, &sb), (&cr, &sr))) in qc
            .iter_mut()
            .zip(qs.iter_mut())
            .zip(bc.iter().zip(bs).zip(cr.iter().zip(sr)))
        {
            *c = (cb * cr - sb * sr) as f32;
            *s = (sb * cr + cb * sr) as f32;
        }
        let (qc, qs) = (&qc[..half], &qs[..half]);
        for (x, o) in q.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
            if interleaved {
                for ((o, x), (&c, &s)) in o.chunks_exact_mut(2).zip(x.chunks_exact(2)).zip(qc.iter().zip(qs)) {
                    o[0] = x[0] * c + x[1] * s;
                    o[1] = x[1] * c - x[0] * s;
                }
            } else {
                let (xa, xb) = x.split_at(half);
                let (oa, ob) = o.split_at_mut(half);
                for (((oa, ob), (&a, &b)), (&c, &s)) in
                    oa.iter_mut().zip(ob).zip(xa.iter().zip(xb)).zip(qc.iter().zip(qs))
                {
                    *oa = a * c + b * s;
                    *ob = b * c - a * s;
                }
            }
        }
    }

    /// [`qturn_body`] compiled for AVX2 (four f64 lanes).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn qturn(
        bc: &[f64],
        bs: &[f64],
        cr: &[f64],
        sr: &[f64],
        q: &[f32],
        interleaved: bool,
        qc: &mut [f32],
        qs: &mut [f32],
        out: &mut [f32],
    ) {
        qturn_body(bc, bs, cr, sr, q, interleaved, qc, qs, out)
    }

    /// [`qturn_body`] compiled for AVX-512 (eight f64 lanes).
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn qturn512(
        bc: &[f64],
        bs: &[f64],
        cr: &[f64],
        sr: &[f64],
        q: &[f32],
        interleaved: bool,
        qc: &mut [f32],
        qs: &mut [f32],
        out: &mut [f32],
    ) {
        qturn_body(bc, bs, cr, sr, q, interleaved, qc, qs, out)
    }

    /// `out[k] = f32(halves[i0 + k])` for the f16 halves packed two a word
    /// (low half first) in `words`, eight at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_run(words: &[u32], i0: usize, out: &mut [f32]) {
        debug_assert!(out.len().is_multiple_of(8) && 2 * words.len() >= i0 + out.len());
        let h = (words.as_ptr() as *const u16).add(i0);
        for k in (0..out.len()).step_by(8) {
            Avx2::store(out.as_mut_ptr().add(k), Avx2::load_f16(h.add(k)));
        }
    }

    /// Channels `c..c + LANES` of a packed row decoded: [`Width::codes`],
    /// then the level (the code itself, or `table[code]` when `TABLE`),
    /// then `x * s + z` with the group's per-channel parameters, a multiply
    /// and an add (no FMA: the row reader's rounding; table levels have
    /// `z = 0` and the reader's `s * table[code]`).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn decode<W: Width, const TABLE: bool, const BITS: u32>(
        row: *const u32,
        t: [W::F; 2],
        s: *const f32,
        z: *const f32,
        c: usize,
    ) -> W::F {
        let k = W::codes(row, BITS, c);
        let x = if TABLE { W::lookup16(t, k) } else { W::cvt_i(k) };
        W::add(W::mul(x, W::load(s.add(c))), W::load(z.add(c)))
    }

    /// `x * cos + p * sin`: the scalar turn's `xa c - xb s` and
    /// `xb c + xa s` (the sign is in `sin`), two multiplies and an add.
    #[inline(always)]
    unsafe fn rot<W: Width>(x: W::F, p: W::F, cos: *const f32, sin: *const f32) -> W::F {
        W::add(W::mul(x, W::load(cos)), W::mul(p, W::load(sin)))
    }

    /// A packed row decoded ([`decode`]) and turned as [`turn`] does,
    /// without the row's round trip through memory: `half` pairs decode
    /// channels `j` and `j + D/2` together (`D/2` a multiple of `LANES`),
    /// `interleaved` ones swap lanes. The code width is a constant: with a
    /// runtime one, each vector of codes cost an integer division (the word
    /// index) and a shift emulated for out-of-range counts (perf on
    /// `kivi bench`, MQA 32k).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn decode_turn_body<W: Width, const TABLE: bool, const BITS: u32>(
        row: &[u32],
        table: &[f32; 16],
        s: &[f32],
        z: &[f32],
        cos: &[f32],
        sin: &[f32],
        interleaved: bool,
        out: &mut [f32],
    ) {
        let d = out.len();
        let half = d / 2;
        let l = W::LANES;
        debug_assert!(d.is_multiple_of(16) && (32 / BITS as usize) >= 8 && row.len() * (32 / BITS as usize) >= d);
        debug_assert!(s.len() >= d && z.len() >= d && cos.len() >= d && sin.len() >= d);
        debug_assert!(interleaved || half.is_multiple_of(l));
        let t = W::table16(table.as_ptr());
        let (rp, sp, zp) = (row.as_ptr(), s.as_ptr(), z.as_ptr());
        let (co, si, o) = (cos.as_ptr(), sin.as_ptr(), out.as_mut_ptr());
        if interleaved {
            for c in (0..d).step_by(l) {
                let v = decode::<W, TABLE, BITS>(rp, t, sp, zp, c);
                W::store(o.add(c), rot::<W>(v, W::swap_pairs(v), co.add(c), si.add(c)));
            }
        } else {
            for j in (0..half).step_by(l) {
                let a = decode::<W, TABLE, BITS>(rp, t, sp, zp, j);
                let b = decode::<W, TABLE, BITS>(rp, t, sp, zp, j + half);
                W::store(o.add(j), rot::<W>(a, b, co.add(j), si.add(j)));
                W::store(o.add(j + half), rot::<W>(b, a, co.add(j + half), si.add(j + half)));
            }
        }
    }

    /// [`decode_turn_body`] at one width, table or uniform levels and code
    /// width, over the rows of a run (`wpt` words each; `cos`, `sin` and
    /// `out` `d = s.len()` floats a row): one call per run, where a call per
    /// row cost its argument setup again for every 256 channels.
    macro_rules! decode_turn_entry {
        ($name:ident, $w:ty, $features:literal, $table:literal, $bits:literal) => {
            #[target_feature(enable = $features)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn $name(
                rows: &[u32],
                wpt: usize,
                table: &[f32; 16],
                s: &[f32],
                z: &[f32],
                cos: &[f32],
                sin: &[f32],
                interleaved: bool,
                out: &mut [f32],
            ) {
                let d = s.len();
                for (i, row) in rows.chunks_exact(wpt).enumerate() {
                    let (c, si) = (&cos[i * d..(i + 1) * d], &sin[i * d..(i + 1) * d]);
                    decode_turn_body::<$w, $table, $bits>(
                        row,
                        table,
                        s,
                        z,
                        c,
                        si,
                        interleaved,
                        &mut out[i * d..(i + 1) * d],
                    )
                }
            }
        };
    }
    decode_turn_entry!(dt256_1, Avx2, "avx2,fma,f16c", false, 1);
    decode_turn_entry!(dt256_2, Avx2, "avx2,fma,f16c", false, 2);
    decode_turn_entry!(dt256_4, Avx2, "avx2,fma,f16c", false, 4);
    decode_turn_entry!(dt256_table_1, Avx2, "avx2,fma,f16c", true, 1);
    decode_turn_entry!(dt256_table_2, Avx2, "avx2,fma,f16c", true, 2);
    decode_turn_entry!(dt256_table_4, Avx2, "avx2,fma,f16c", true, 4);
    decode_turn_entry!(dt512_1, Avx512, "avx512f,avx512dq,avx2,fma,f16c", false, 1);
    decode_turn_entry!(dt512_2, Avx512, "avx512f,avx512dq,avx2,fma,f16c", false, 2);
    decode_turn_entry!(dt512_4, Avx512, "avx512f,avx512dq,avx2,fma,f16c", false, 4);
    decode_turn_entry!(dt512_table_1, Avx512, "avx512f,avx512dq,avx2,fma,f16c", true, 1);
    decode_turn_entry!(dt512_table_2, Avx512, "avx512f,avx512dq,avx2,fma,f16c", true, 2);
    decode_turn_entry!(dt512_table_4, Avx512, "avx512f,avx512dq,avx2,fma,f16c", true, 4);

    /// The signature of a [`decode_turn`] body.
    pub type DecodeTurn = unsafe fn(&[u32], usize, &[f32; 16], &[f32], &[f32], &[f32], &[f32], bool, &mut [f32]);

    /// The entry point for a width (`wide`: AVX-512), table or uniform
    /// levels (`table`: the padded table is read, else ignored) and code
    /// width (1, 2 or 4 bits; the caller checked).
    pub fn decode_turn(wide: bool, table: bool, bits: u32) -> DecodeTurn {
        match (wide, table, bits) {
            (true, true, 1) => dt512_table_1,
            (true, true, 2) => dt512_table_2,
            (true, true, _) => dt512_table_4,
            (true, false, 1) => dt512_1,
            (true, false, 2) => dt512_2,
            (true, false, _) => dt512_4,
            (false, true, 1) => dt256_table_1,
            (false, true, 2) => dt256_table_2,
            (false, true, _) => dt256_table_4,
            (false, false, 1) => dt256_1,
            (false, false, 2) => dt256_2,
            (false, false, _) => dt256_4,
        }
    }

    /// `out_j = x_j cos_j + partner(x)_j sin_j` (two multiplies and an add:
    /// the scalar turn's `xa c - xb s` and `xb c + xa s`, bit for bit),
    /// `partner` the other half's channel or the pair's neighbour.
    #[inline(always)]
    unsafe fn turn_body<W: Width>(x: &[f32], cos: &[f32], sin: &[f32], interleaved: bool, out: &mut [f32]) {
        let d = x.len();
        let half = d / 2;
        debug_assert!(d.is_multiple_of(16) && cos.len() >= d && sin.len() >= d && out.len() >= d);
        debug_assert!(interleaved || half.is_multiple_of(W::LANES));
        let xp = x.as_ptr();
        for j in (0..d).step_by(W::LANES) {
            let v = W::load(xp.add(j));
            let p = if interleaved {
                W::swap_pairs(v)
            } else {
                W::load(xp.add((j + half) % d))
            };
            W::store(
                out.as_mut_ptr().add(j),
                rot::<W>(v, p, cos.as_ptr().add(j), sin.as_ptr().add(j)),
            );
        }
    }

    /// [`turn_body`] on AVX2 (every `D % 16 == 0`: a half is whole vectors).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn turn(x: &[f32], cos: &[f32], sin: &[f32], interleaved: bool, out: &mut [f32]) {
        turn_body::<Avx2>(x, cos, sin, interleaved, out)
    }
}
