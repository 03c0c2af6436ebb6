//! Low-rank keys and values (`low_rank: pca(rank = R, apply = [key, value])`,
//! LowRAM-style): fitting the bases, the oracle, and the cache.
//!
//! # Bases
//!
//! Per layer, tensor and KV head, a calibration holds the full orthonormal
//! eigenbasis of the tensor's **uncentered** second moment
//! `M = (1/n) sum_t x_t x_tᵀ` over the calibration tokens
//! ([`Calibration::fit_bases`], entry kind [`Kind::Basis`], fit [`FIT`]),
//! vectors sorted by decreasing eigenvalue; a scheme of rank `R` uses the
//! first `R`. Uncentered, not centered: the cache stores `c = Bᵀ x` with no
//! mean, and the rank-`R` subspace minimising `E ||x - B Bᵀ x||²` is spanned
//! by the leading eigenvectors of `E[x xᵀ]` (centering would need a stored
//! mean per head and a `q . m` term per score; Gemma's keys have a large
//! mean that the uncentered basis simply spends its first vector on).
//! Deterministic: cyclic Jacobi in f64 (no random start), ties in the sort
//! broken by index, each vector's sign fixed so its largest-magnitude
//! component is positive.
//!
//! A cache rounds its basis to the scheme's activation dtype once (and
//! counts those bytes, once per cache, i.e. once per layer: see
//! [`Bases::bytes`]); the oracle uses the same rounded basis.
//!
//! # Semantics (the oracle, [`cache_view`] and [`attend`])
//!
//! 1. Inputs are rounded to the activation dtype (non-finite ones refused).
//! 2. Each row is projected: `c_j = sum_d B[j][d] x_d`, accumulated in f64
//!    and rounded to f32 once ([`Bases::project`]).
//! 3. The coordinates are stored by the scheme's
//!    [`kivi_spec::Scheme::coordinate_scheme`] exactly as a head of width
//!    `R` (DESIGN.md §3: rounded to the activation dtype, sinks and window
//!    kept, the rest quantized by the codecs): `c^`.
//! 4. Reconstruction: `x^_d = sum_j B[j][d] c^_j` (f64, one rounding).
//! 5. Decode attention per DESIGN.md §3 over `k^`, `v^`.
//! 6. With `residual = N` (LowRAM's exact residual), applied before 5: per
//!    sequence, tensor and KV head, the `N` tokens with the largest
//!    projection error `||x - B c||²` (step 2's `c`, before the codec;
//!    [`Bases::projection_errors`]; ties to the earlier token) read their
//!    rounded row `x` instead of `x^`. A token's error is fixed when it
//!    arrives, so the kept set is the same streamed or prefilled; a token
//!    can only leave it (when a worse one arrives).
//!
//! # The fast path ([`LowRankCache::decode`])
//!
//! `q . k^ = q . (B c^) = (Bᵀ q) . c^` and `sum_t p_t B c^_t = B sum_t p_t c^_t`:
//! the query is projected once per step, any backend decodes the `R`-wide
//! coordinate cache (every CPU fast path of that codec applies unchanged)
//! with the full head's softmax scale, and the output is reconstructed once.
//! The one difference from the oracle: the backend rounds the projected
//! query to the activation dtype as it rounds any query (the oracle dots the
//! rounded query with `k^` in f64), a relative error of the dtype's epsilon
//! in each score.
//!
//! # The exact residual (`residual = N`) on the fast path
//!
//! The kept tokens' scores and values differ from their reconstructions,
//! so they cannot go through the coordinate decode. Per sequence and KV
//! head, the positions kept as a key or as a value (at most `2N`) are left
//! out of it ([`Backend::decode_partial`]: the backend returns its online
//! softmax state — running max, normaliser, unnormalised value coordinates
//! — over the other tokens, before normalising). Those positions are scored
//! on the host against the rounded query in f64, as the oracle scores them,
//! each reading its exact row where it is kept for that tensor and its
//! reconstruction otherwise; the two states are merged by a rescale and a
//! sum. Nothing is subtracted: taking a kept token's reconstructed share
//! back out of a finished output would cancel catastrophically exactly when
//! that token holds most of the softmax weight. The host part costs
//! `O(N Hq D)` per step (plus a reconstruction per token kept for one
//! tensor only), independent of the sequence length.

use crate::backend::Backend;
use crate::cache::{CacheConfig, MemoryReport, PagedCache, SeqId};
use crate::calib::{CalibError, Calibration, Entry, Kind, LayerSamples, Stage};
use crate::error::{Error, Result};
use crate::quant::round_to_dtype;
use crate::reference::{self, round_inputs, AttnParams};
use kivi_spec::{Scheme, Tensor};

/// Why a plain [`PagedCache`] or [`reference::cache_view`] refuses a
/// low-rank scheme (they would store full rows and ignore the basis).
pub const NOT_PAGED: &str =
    "a low_rank scheme stores coordinates in a calibrated basis: use kivi_runtime::low_rank (LowRankCache, low_rank::cache_view) with its bases";

/// The `fit` text of basis entries: eigenvectors of the uncentered second moment.
pub const FIT: &str = "pca uncentered";

/// Eigen-decomposition of the symmetric `n x n` matrix `a` (row-major,
/// destroyed): eigenvalues in decreasing order and the matching unit
/// eigenvectors as rows (`vectors[k * n..][..n]`), each signed so that its
/// largest-magnitude component is positive. Cyclic Jacobi rotations until
/// the off-diagonal mass is below `1e-22` of the total (or 100 sweeps).
///
/// ```
/// let (vals, vecs) = kivi_runtime::low_rank::symmetric_eigen(vec![2.0, 1.0, 1.0, 2.0], 2);
/// assert!((vals[0] - 3.0).abs() < 1e-12 && (vals[1] - 1.0).abs() < 1e-12);
/// let s = 0.5f64.sqrt();
/// assert!((vecs[0] - s).abs() < 1e-12 && (vecs[1] - s).abs() < 1e-12);
/// ```
pub fn symmetric_eigen(mut a: Vec<f64>, n: usize) -> (Vec<f64>, Vec<f64>) {
    // v holds eigenvectors as columns while rotating.
    let mut v = vec![0f64; n * n];
    for i in 0..n {
        v[i * n + i] = 1.0;
    }
    let total: f64 = a.iter().map(|x| x * x).sum();
    for _sweep in 0..100 {
        let mut off = 0.0;
        for p in 0..n {
            for q in p + 1..n {
                off += a[p * n + q] * a[p * n + q];
            }
        }
        if off <= 1e-22 * total || off == 0.0 {
            break;
        }
        for p in 0..n {
            for q in p + 1..n {
                let apq = a[p * n + q];
                if apq == 0.0 {
                    continue;
                }
                let (app, aqq) = (a[p * n + p], a[q * n + q]);
                let theta = (aqq - app) / (2.0 * apq);
                let t = theta.signum() / (theta.abs() + (theta * theta + 1.0).sqrt());
                let t = if theta == 0.0 { 1.0 } else { t };
                let c = 1.0 / (t * t + 1.0).sqrt();
                let s = t * c;
                // A <- Jᵀ A J on rows and columns p, q.
                for k in 0..n {
                    let (akp, akq) = (a[k * n + p], a[k * n + q]);
                    a[k * n + p] = c * akp - s * akq;
                    a[k * n + q] = s * akp + c * akq;
                }
                for k in 0..n {
                    let (apk, aqk) = (a[p * n + k], a[q * n + k]);
                    a[p * n + k] = c * apk - s * aqk;
                    a[q * n + k] = s * apk + c * aqk;
                }
                for k in 0..n {
                    let (vkp, vkq) = (v[k * n + p], v[k * n + q]);
                    v[k * n + p] = c * vkp - s * vkq;
                    v[k * n + q] = s * vkp + c * vkq;
                }
            }
        }
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|&i, &j| a[j * n + j].total_cmp(&a[i * n + i]).then(i.cmp(&j)));
    let vals = order.iter().map(|&i| a[i * n + i]).collect();
    let mut vecs = vec![0f64; n * n];
    for (k, &i) in order.iter().enumerate() {
        let row = &mut vecs[k * n..][..n];
        for (d, r) in row.iter_mut().enumerate() {
            *r = v[d * n + i];
        }
        let big = row
            .iter()
            .copied()
            .fold(0f64, |m, x| if x.abs() > m.abs() { x } else { m });
        if big < 0.0 {
            row.iter_mut().for_each(|x| *x = -*x);
        }
    }
    (vals, vecs)
}

/// What one fitted basis captures on its own samples: the fraction of the
/// second moment's trace (the mean squared norm of a row) kept by the first
/// `r` vectors, for each `r` in `ranks`.
#[derive(Clone, Debug, PartialEq)]
pub struct BasisReport {
    pub layer: usize,
    pub tensor: Tensor,
    pub stage: Stage,
    pub head: usize,
    /// `(r, energy fraction)`.
    pub energy: Vec<(usize, f64)>,
}

/// The ranks [`Calibration::fit_bases`] reports energy at.
pub const REPORT_RANKS: [usize; 6] = [16, 32, 48, 64, 96, 128];

impl Calibration {
    /// Fits the full eigenbasis of keys (after RoPE, and before it where the
    /// samples have pre-RoPE keys) and values for every layer and KV head
    /// in `samples` (several samples of a layer are pooled), and adds them
    /// as [`Kind::Basis`] entries of shape `[kv_heads, head_dim, head_dim]`
    /// (vector `j` of head `h` at `[h][j][..]`). Any rank up to head_dim
    /// takes a prefix of the same entry.
    pub fn fit_bases(&mut self, samples: &[LayerSamples]) -> std::result::Result<Vec<BasisReport>, CalibError> {
        let mut layers: Vec<usize> = samples.iter().map(|s| s.layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let mut reports = Vec::new();
        for layer in layers {
            let mine: Vec<&LayerSamples> = samples.iter().filter(|s| s.layer == layer).collect();
            let (h, d) = (mine[0].kv_heads, mine[0].head_dim);
            if mine.iter().any(|s| s.kv_heads != h || s.head_dim != d) {
                return Err(CalibError::Samples(format!(
                    "layer {layer}: samples of different shapes"
                )));
            }
            for s in &mine {
                for (name, v) in [
                    ("keys", Some(&s.keys)),
                    ("values", Some(&s.values)),
                    ("pre-RoPE keys", s.keys_pre_rope.as_ref()),
                ] {
                    if let Some(v) = v {
                        if v.len() != s.tokens * h * d || v.iter().any(|x| !x.is_finite()) {
                            return Err(CalibError::Samples(format!(
                                "layer {layer}: {name} are not {} finite values",
                                s.tokens * h * d
                            )));
                        }
                    }
                }
            }
            let pre = mine.iter().all(|s| s.keys_pre_rope.is_some());
            let mut kinds = vec![(Tensor::Key, Stage::PostRope), (Tensor::Value, Stage::PostRope)];
            if pre {
                kinds.push((Tensor::Key, Stage::PreRope));
            }
            for (t, stage) in kinds {
                let mut data = Vec::with_capacity(h * d * d);
                for head in 0..h {
                    let mut m = vec![0f64; d * d];
                    let mut n = 0usize;
                    for s in &mine {
                        let x = match (t, stage) {
                            (Tensor::Value, _) => &s.values,
                            (Tensor::Key, Stage::PostRope) => &s.keys,
                            (Tensor::Key, Stage::PreRope) => s.keys_pre_rope.as_ref().expect("checked"),
                        };
                        for tok in 0..s.tokens {
                            let row = &x[(tok * h + head) * d..][..d];
                            for i in 0..d {
                                let xi = row[i] as f64;
                                for j in i..d {
                                    m[i * d + j] += xi * row[j] as f64;
                                }
                            }
                            n += 1;
                        }
                    }
                    if n == 0 {
                        return Err(CalibError::Samples(format!("layer {layer}: no tokens")));
                    }
                    for i in 0..d {
                        for j in i..d {
                            let x = m[i * d + j] / n as f64;
                            m[i * d + j] = x;
                            m[j * d + i] = x;
                        }
                    }
                    let (vals, vecs) = symmetric_eigen(m, d);
                    let trace: f64 = vals.iter().map(|v| v.max(0.0)).sum();
                    let energy = REPORT_RANKS
                        .iter()
                        .filter(|&&r| r <= d)
                        .map(|&r| {
                            let kept: f64 = vals[..r].iter().map(|v| v.max(0.0)).sum();
                            (r, if trace > 0.0 { kept / trace } else { 1.0 })
                        })
                        .collect();
                    reports.push(BasisReport {
                        layer,
                        tensor: t,
                        stage,
                        head,
                        energy,
                    });
                    data.extend(vecs.iter().map(|&x| x as f32));
                }
                self.insert(Entry {
                    layer: layer as u32,
                    tensor: t,
                    stage,
                    kind: Kind::Basis,
                    fit: FIT.into(),
                    shape: vec![h as u32, d as u32, d as u32],
                    data,
                })?;
            }
        }
        Ok(reports)
    }

    /// The first `rank` vectors of the post-RoPE basis of tensor `t` at
    /// `layer`, `[kv_heads, rank, head_dim]`, checked against `scheme`'s
    /// shape. A missing one is [`CalibError::Missing`] naming the layer and
    /// tensor.
    pub fn basis(
        &self,
        scheme: &Scheme,
        t: Tensor,
        layer: usize,
        rank: usize,
    ) -> std::result::Result<Vec<f32>, CalibError> {
        self.check_shape(scheme)?;
        let missing = |have: String| CalibError::Missing {
            scheme: scheme.name.clone(),
            layer,
            tensor: t.name(),
            fit: format!("basis, {FIT}"),
            calibration: self.model.name.clone(),
            have,
        };
        if layer >= self.model.layers as usize {
            return Err(missing(format!("{} layers", self.model.layers)));
        }
        let (h, d) = (self.model.kv_heads as usize, self.model.head_dim as usize);
        let e = self
            .get(layer, t, Stage::PostRope, Kind::Basis, FIT)
            .ok_or_else(|| missing("no basis there".into()))?;
        if e.shape != [h as u32, d as u32, d as u32] || rank > d {
            return Err(missing(format!("a basis of shape {:?}", e.shape)));
        }
        let mut out = Vec::with_capacity(h * rank * d);
        for head in 0..h {
            out.extend_from_slice(&e.data[head * d * d..][..rank * d]);
        }
        Ok(out)
    }
}

/// The bases one low-rank cache (one layer) uses: per tensor
/// `[kv_heads, rank, head_dim]`, rounded to the scheme's activation dtype.
#[derive(Clone, Debug, PartialEq)]
pub struct Bases {
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rank: usize,
    /// Bytes per stored basis element (the activation dtype's).
    pub elem_bytes: usize,
    key: Vec<f32>,
    value: Vec<f32>,
}

impl Bases {
    /// The bases of `scheme` (bound, with `low_rank`) for `layer` from a calibration.
    pub fn for_layer(scheme: &Scheme, calibration: &Calibration, layer: usize) -> Result<Bases> {
        let (shape, rank) = low_rank_shape(scheme)?;
        let k = calibration.basis(scheme, Tensor::Key, layer, rank)?;
        let v = calibration.basis(scheme, Tensor::Value, layer, rank)?;
        Bases::new(scheme, k, v).map_err(|e| match e {
            Error::Shape { .. } => Error::Config(format!("layer {layer}: {e} (shape {:?})", shape)),
            e => e,
        })
    }

    /// Bases handed in directly (any engine): `key` and `value` are
    /// `[kv_heads, rank, head_dim]` with orthonormal rows per head (checked
    /// to 1e-3: a unit length and orthogonality to every other row).
    pub fn new(scheme: &Scheme, key: Vec<f32>, value: Vec<f32>) -> Result<Bases> {
        let (shape, rank) = low_rank_shape(scheme)?;
        let (h, d) = (shape.kv_heads, shape.head_dim);
        for (t, b) in [(Tensor::Key, &key), (Tensor::Value, &value)] {
            if b.len() != h * rank * d {
                return Err(Error::Shape {
                    what: "low-rank basis",
                    expected: format!(
                        "{} values (kv_heads x rank x head_dim) for the {}",
                        h * rank * d,
                        t.name()
                    ),
                    got: b.len().to_string(),
                });
            }
            for head in 0..h {
                for i in 0..rank {
                    for j in i..rank {
                        let (a, c) = (&b[(head * rank + i) * d..][..d], &b[(head * rank + j) * d..][..d]);
                        let dot: f64 = a.iter().zip(c).map(|(x, y)| *x as f64 * *y as f64).sum();
                        let want = if i == j { 1.0 } else { 0.0 };
                        if (dot - want).abs() > 1e-3 || !dot.is_finite() {
                            return Err(Error::Config(format!(
                                "{} basis of kv head {head}: rows {i} and {j} have dot product {dot}, not {want} (not orthonormal)",
                                t.name()
                            )));
                        }
                    }
                }
            }
        }
        let round = |b: Vec<f32>| b.into_iter().map(|x| round_to_dtype(x, scheme.dtype)).collect();
        Ok(Bases {
            kv_heads: h,
            head_dim: d,
            rank,
            elem_bytes: scheme.dtype.bytes(),
            key: round(key),
            value: round(value),
        })
    }

    /// The basis of tensor `t`, `[kv_heads, rank, head_dim]`.
    pub fn of(&self, t: Tensor) -> &[f32] {
        match t {
            Tensor::Key => &self.key,
            Tensor::Value => &self.value,
        }
    }

    /// Bytes the bases occupy (both tensors, in the activation dtype).
    pub fn bytes(&self) -> usize {
        2 * self.kv_heads * self.rank * self.head_dim * self.elem_bytes
    }

    fn row_project(&self, t: Tensor, head: usize, x: &[f32], out: &mut [f32]) {
        let (r, d) = (self.rank, self.head_dim);
        let b = &self.of(t)[head * r * d..][..r * d];
        for (j, o) in out.iter_mut().enumerate() {
            let dot: f64 = b[j * d..][..d].iter().zip(x).map(|(a, c)| *a as f64 * *c as f64).sum();
            *o = dot as f32;
        }
    }

    fn row_reconstruct(&self, t: Tensor, head: usize, c: &[f32], out: &mut [f32]) {
        let (r, d) = (self.rank, self.head_dim);
        let b = &self.of(t)[head * r * d..][..r * d];
        let mut acc = vec![0f64; d];
        for (j, &cj) in c.iter().enumerate() {
            for (a, x) in acc.iter_mut().zip(&b[j * d..][..d]) {
                *a += *x as f64 * cj as f64;
            }
        }
        for (o, a) in out.iter_mut().zip(acc) {
            *o = a as f32;
        }
    }

    /// Coordinates `[rows, R]` of rows `[rows, D]` whose head is
    /// `head_of(row)` (f64 sums, one rounding).
    fn map_rows(&self, x: &[f32], from: usize, to: usize, mut f: impl FnMut(usize, &[f32], &mut [f32])) -> Vec<f32> {
        let rows = x.len() / from;
        let mut out = vec![0f32; rows * to];
        for i in 0..rows {
            f(i, &x[i * from..][..from], &mut out[i * to..][..to]);
        }
        out
    }

    /// How badly each row `[T, Hkv, D]` of `x` is reconstructed from its
    /// coordinates `c` (`[T, Hkv, R]`, [`Self::project`] of `x`): `||x -
    /// B c||²` per (token, KV head), in f64 (`B c` summed in f64, not
    /// rounded). What `residual = N` ranks tokens by.
    pub fn projection_errors(&self, t: Tensor, x: &[f32], c: &[f32]) -> Vec<f64> {
        let (h, r, d) = (self.kv_heads, self.rank, self.head_dim);
        let rows = x.len() / d;
        (0..rows)
            .map(|i| {
                let b = &self.of(t)[(i % h) * r * d..][..r * d];
                let ci = &c[i * r..][..r];
                (0..d)
                    .map(|k| {
                        let rec: f64 = ci
                            .iter()
                            .enumerate()
                            .map(|(j, &cj)| b[j * d + k] as f64 * cj as f64)
                            .sum();
                        let e = x[i * d + k] as f64 - rec;
                        e * e
                    })
                    .sum()
            })
            .collect()
    }

    /// Coordinates `[T, Hkv, R]` of tensor rows `[T, Hkv, D]`.
    pub fn project(&self, t: Tensor, x: &[f32]) -> Vec<f32> {
        let h = self.kv_heads;
        self.map_rows(x, self.head_dim, self.rank, |i, a, o| self.row_project(t, i % h, a, o))
    }

    /// Rows `[T, Hkv, D]` from coordinates `[T, Hkv, R]`.
    pub fn reconstruct(&self, t: Tensor, c: &[f32]) -> Vec<f32> {
        let h = self.kv_heads;
        self.map_rows(c, self.rank, self.head_dim, |i, a, o| {
            self.row_reconstruct(t, i % h, a, o)
        })
    }

    /// Queries `[n, Hq, D]` projected on their KV head's key basis: `[n, Hq, R]`.
    pub fn project_queries(&self, q: &[f32], q_heads: usize) -> Vec<f32> {
        let g = q_heads / self.kv_heads;
        self.map_rows(q, self.head_dim, self.rank, |i, a, o| {
            self.row_project(Tensor::Key, (i % q_heads) / g, a, o)
        })
    }

    /// Attention outputs `[n, Hq, R]` (value coordinates) back to `[n, Hq, D]`.
    pub fn reconstruct_outputs(&self, o: &[f32], q_heads: usize) -> Vec<f32> {
        let g = q_heads / self.kv_heads;
        self.map_rows(o, self.rank, self.head_dim, |i, a, out| {
            self.row_reconstruct(Tensor::Value, (i % q_heads) / g, a, out)
        })
    }
}

fn low_rank_shape(scheme: &Scheme) -> Result<(kivi_spec::Shape, usize)> {
    kivi_spec::validate(scheme)?;
    let l = scheme
        .low_rank
        .ok_or_else(|| Error::Config(format!("scheme `{}` has no low_rank field", scheme.name)))?;
    let shape = reference::shape_of(scheme)?;
    Ok((shape, l.rank as usize))
}

/// The oracle's view of tensor `t` (`[T, Hkv, D]`) in a low-rank cache:
/// steps 1-4 of the module docs.
pub fn cache_view(s: &Scheme, t: Tensor, x: &[f32], bases: &Bases) -> Result<Vec<f32>> {
    let (shape, _) = low_rank_shape(s)?;
    let (h, d) = (shape.kv_heads, shape.head_dim);
    check_bases(s, bases)?;
    if !x.len().is_multiple_of(h * d) {
        return Err(Error::Shape {
            what: "tensor length",
            expected: format!("a multiple of {} (heads x head_dim)", h * d),
            got: x.len().to_string(),
        });
    }
    let x = round_inputs(s, t.name(), x, h, d)?;
    let c = bases.project(t, &x);
    let coords = s.coordinate_scheme().expect("low_rank checked");
    let stored = reference::cache_view(&coords, t, &c)?;
    let mut out = bases.reconstruct(t, &stored);
    // Step 6: the `residual` worst-reconstructed tokens of each head, exact.
    let n = s.low_rank.map_or(0, |l| l.residual as usize);
    if n > 0 {
        let err = bases.projection_errors(t, &x, &c);
        for head in 0..h {
            let mut all: Vec<(f64, usize)> = (0..x.len() / (h * d)).map(|p| (err[p * h + head], p)).collect();
            all.sort_by(worse_first);
            for &(_, p) in all.iter().take(n) {
                let at = (p * h + head) * d;
                out[at..at + d].copy_from_slice(&x[at..at + d]);
            }
        }
    }
    Ok(out)
}

/// The order of `residual = N`: the larger reconstruction error first,
/// ties to the earlier token (a total order, so the `N` kept are the same
/// however the tokens arrived).
fn worse_first(a: &(f64, usize), b: &(f64, usize)) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The exact residual's merge (module docs, "The exact residual"): for
/// each sequence `b` and query head, the coordinate decode's partial result
/// (`part`, value coordinates, kept tokens left out) reconstructed, and the
/// tokens `skip[b][kv head]` inside the attended range scored on the host
/// against the rounded query `q` (`[B, Hq, D]`) in f64 as the oracle scores
/// them; `row(b, tensor, pos, kv head, out)` gives a skipped token's row
/// (its exact one where it is kept for that tensor, else its
/// reconstruction). Both parts are online-softmax states, so the merge is
/// a rescale and a sum: no token's share is ever taken back out.
#[allow(clippy::too_many_arguments)]
pub(crate) fn merge_exact(
    bases: &Bases,
    hq: usize,
    q: &[f32],
    attn: AttnParams,
    lens: &[usize],
    skip: &[Vec<Vec<usize>>],
    part: &crate::backend::DecodePartial,
    mut row: impl FnMut(usize, Tensor, usize, usize, &mut [f32]) -> Result<()>,
) -> Result<Vec<f32>> {
    let (h, d, r) = (bases.kv_heads, bases.head_dim, bases.rank);
    let group = hq / h;
    let mut out = vec![0f32; lens.len() * hq * d];
    let (mut k, mut v) = (vec![0f32; d], vec![0f32; d]);
    let mut coord_out = vec![0f32; d];
    for (b, &t) in lens.iter().enumerate() {
        let lo = attn.window.map_or(0, |w| t.saturating_sub(w));
        for (head, skipped) in skip[b].iter().enumerate().take(h) {
            let mine: Vec<usize> = skipped.iter().copied().filter(|p| (lo..t).contains(p)).collect();
            // Each skipped token's key and value, read once for the group.
            let mut rows = Vec::with_capacity(mine.len());
            for &pos in &mine {
                row(b, Tensor::Key, pos, head, &mut k)?;
                row(b, Tensor::Value, pos, head, &mut v)?;
                rows.push((k.clone(), v.clone()));
            }
            for g in 0..group {
                let at = b * hq + head * group + g;
                let qh = &q[at * d..][..d];
                let scores: Vec<f64> = rows
                    .iter()
                    .map(|(k, _)| {
                        let dot: f64 = qh.iter().zip(k).map(|(a, c)| *a as f64 * *c as f64).sum();
                        dot * attn.softmax_scale as f64
                    })
                    .collect();
                let mc = part.max[at] as f64;
                let m = scores.iter().copied().fold(mc, f64::max);
                if m == f64::NEG_INFINITY {
                    continue; // nothing attended: the output is zero
                }
                let wc = if mc == f64::NEG_INFINITY { 0.0 } else { (mc - m).exp() };
                let mut l = wc * part.sum[at] as f64;
                let mut acc = vec![0f64; d];
                if wc > 0.0 {
                    bases.row_reconstruct(Tensor::Value, head, &part.acc[at * r..][..r], &mut coord_out);
                    for (a, x) in acc.iter_mut().zip(&coord_out) {
                        *a = wc * *x as f64;
                    }
                }
                for (s, (_, v)) in scores.iter().zip(&rows) {
                    let w = (s - m).exp();
                    l += w;
                    for (a, x) in acc.iter_mut().zip(v) {
                        *a += w * *x as f64;
                    }
                }
                for (o, a) in out[at * d..][..d].iter_mut().zip(acc) {
                    *o = (a / l) as f32;
                }
            }
        }
    }
    Ok(out)
}

/// The whole oracle for one sequence of a low-rank scheme: [`cache_view`]
/// of `k` and `v`, then [`reference::decode_attention`] (DESIGN.md §3).
pub fn attend(s: &Scheme, q: &[f32], k: &[f32], v: &[f32], params: AttnParams, bases: &Bases) -> Result<Vec<f32>> {
    let kk = cache_view(s, Tensor::Key, k, bases)?;
    let vv = cache_view(s, Tensor::Value, v, bases)?;
    let mut plain = s.clone();
    plain.low_rank = None;
    reference::decode_attention(&plain, q, &kk, &vv, params)
}

pub(crate) fn check_bases(s: &Scheme, b: &Bases) -> Result<()> {
    let (shape, rank) = low_rank_shape(s)?;
    if (b.kv_heads, b.head_dim, b.rank) != (shape.kv_heads, shape.head_dim, rank) {
        return Err(Error::Config(format!(
            "bases for {} kv heads, head_dim {}, rank {}; scheme `{}` has {}, {}, {}",
            b.kv_heads, b.head_dim, b.rank, s.name, shape.kv_heads, shape.head_dim, rank
        )));
    }
    Ok(())
}

/// Rows `[n, Hkv, D]` of tensor `t` rounded to the activation dtype
/// (non-finite ones refused) and projected: the coordinates `[n, Hkv, R]`
/// every low-rank cache stores, on the host ([`LowRankCache`]) and on a
/// device ([`crate::device::DeviceLowRankCache`]) alike.
pub(crate) fn project_rows(s: &Scheme, bases: &Bases, t: Tensor, x: &[f32]) -> Result<Vec<f32>> {
    Ok(bases.project(t, &rounded_rows(s, bases, t, x)?))
}

/// Rows `[n, Hkv, D]` of tensor `t` rounded to the activation dtype, their
/// length checked (non-finite values refused).
fn rounded_rows(s: &Scheme, bases: &Bases, t: Tensor, x: &[f32]) -> Result<Vec<f32>> {
    let (h, d) = (bases.kv_heads, bases.head_dim);
    if !x.len().is_multiple_of(h * d) {
        return Err(Error::Shape {
            what: "key/value length",
            expected: format!("a multiple of {} (kv_heads x head_dim)", h * d),
            got: x.len().to_string(),
        });
    }
    round_inputs(s, t.name(), x, h, d)
}

/// One query per sequence (`[batch, Hq, D]`) rounded and projected on its
/// KV head's key basis: `[batch, Hq, R]`, what any backend then decodes
/// against the coordinates (host and device caches alike).
pub(crate) fn project_queries(s: &Scheme, bases: &Bases, batch: usize, q: &[f32]) -> Result<Vec<f32>> {
    let shape = reference::shape_of(s)?;
    let (hq, d) = (shape.q_heads, bases.head_dim);
    if q.len() != batch * hq * d {
        return Err(Error::Shape {
            what: "query length",
            expected: format!("{} (sequences x q_heads x head_dim)", batch * hq * d),
            got: q.len().to_string(),
        });
    }
    let q = round_inputs(s, "query", q, hq, d)?;
    Ok(bases.project_queries(&q, hq))
}

/// A paged cache of a low-rank scheme (one layer): a [`PagedCache`] of the
/// scheme's coordinate scheme plus the layer's [`Bases`]. Appends project
/// rows, decode projects the query once per step and reconstructs the
/// output once (module docs); memory counts the bases once.
pub struct LowRankCache {
    scheme: Scheme,
    cache: PagedCache,
    bases: Bases,
    calibration: Option<u64>,
    /// `residual = N`: per sequence, `[tensor * Hkv + head]` the kept
    /// tokens, worst first ([`worse_first`]), at most `N` each.
    exact: std::collections::HashMap<SeqId, Vec<Vec<Kept>>>,
}

/// One token kept exactly: its projection error, position and rounded row.
#[derive(Clone)]
struct Kept {
    err: f64,
    pos: usize,
    row: Vec<f32>,
}

impl LowRankCache {
    /// The cache of layer `layer` with its bases from `calibration` (a
    /// missing basis is an error naming the layer and tensor).
    pub fn with_calibration(
        scheme: Scheme,
        config: CacheConfig,
        calibration: &Calibration,
        layer: usize,
    ) -> Result<Self> {
        let bases = Bases::for_layer(&scheme, calibration, layer)?;
        let mut c = Self::with_bases(scheme, config, bases)?;
        c.calibration = Some(calibration.hash());
        Ok(c)
    }

    /// A cache with bases handed in directly ([`Bases::new`]).
    pub fn with_bases(scheme: Scheme, config: CacheConfig, bases: Bases) -> Result<Self> {
        check_bases(&scheme, &bases)?;
        let coords = scheme.coordinate_scheme().expect("low_rank checked");
        Ok(LowRankCache {
            cache: PagedCache::new(coords, config)?,
            scheme,
            bases,
            calibration: None,
            exact: Default::default(),
        })
    }

    /// The low-rank scheme (head_dim `D`).
    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }
    /// The coordinate cache (head_dim `R`) the rows live in.
    pub fn coordinates(&self) -> &PagedCache {
        &self.cache
    }
    pub fn bases(&self) -> &Bases {
        &self.bases
    }
    /// The scheme hash joined with the calibration's (as [`PagedCache::identity`]).
    pub fn identity(&self) -> u64 {
        crate::calib::identity(kivi_spec::scheme_hash(&self.scheme), self.calibration)
    }
    pub fn add_sequence(&mut self) -> SeqId {
        self.cache.add_sequence()
    }
    pub fn len(&self, id: SeqId) -> Result<usize> {
        self.cache.len(id)
    }
    pub fn free_sequence(&mut self, id: SeqId) -> Result<()> {
        self.cache.free_sequence(id)?;
        self.exact.remove(&id);
        Ok(())
    }

    fn residual(&self) -> usize {
        self.scheme.low_rank.map_or(0, |l| l.residual as usize)
    }

    /// The hash of the calibration the bases came from, if any.
    pub fn calibration_hash(&self) -> Option<u64> {
        self.calibration
    }

    /// Draws the coordinate cache's blocks from a shared pool (every layer
    /// of a model, [`crate::pool`]): [`PagedCache::set_pool`]. The bases and
    /// the exact residual's rows are per cache, outside any pool.
    pub fn set_pool(&mut self, pool: Option<crate::pool::BlockPool>) -> Result<()> {
        self.cache.set_pool(pool)
    }

    /// Appends tokens `[n, Hkv, D]` (projected, then stored as the
    /// coordinate cache stores them); an error leaves the cache unchanged.
    pub fn extend(&mut self, id: SeqId, k: &[f32], v: &[f32]) -> Result<()> {
        if k.len() != v.len() {
            return Err(Error::Shape {
                what: "key/value length",
                expected: format!("equal lengths (keys {})", k.len()),
                got: v.len().to_string(),
            });
        }
        let n = self.residual();
        if n == 0 {
            let (ck, cv) = (
                project_rows(&self.scheme, &self.bases, Tensor::Key, k)?,
                project_rows(&self.scheme, &self.bases, Tensor::Value, v)?,
            );
            return self.cache.extend(id, &ck, &cv);
        }
        // `residual = N`: rank the new rows with the kept ones (module docs,
        // step 6), committed only once the coordinate cache took them.
        let start = self.cache.len(id)?;
        let (h, d) = (self.bases.kv_heads, self.bases.head_dim);
        let mut kept = self.exact.get(&id).cloned().unwrap_or_else(|| vec![Vec::new(); 2 * h]);
        let mut coords = Vec::with_capacity(2);
        for (ti, (t, x)) in [(Tensor::Key, k), (Tensor::Value, v)].into_iter().enumerate() {
            let xr = rounded_rows(&self.scheme, &self.bases, t, x)?;
            let c = self.bases.project(t, &xr);
            let err = self.bases.projection_errors(t, &xr, &c);
            for (i, e) in err.iter().enumerate() {
                let (pos, head) = (start + i / h, i % h);
                let list = &mut kept[ti * h + head];
                list.push(Kept {
                    err: *e,
                    pos,
                    row: xr[i * d..(i + 1) * d].to_vec(),
                });
            }
            for list in &mut kept[ti * h..(ti + 1) * h] {
                list.sort_by(|a, b| worse_first(&(a.err, a.pos), &(b.err, b.pos)));
                list.truncate(n);
            }
            coords.push(c);
        }
        self.cache.extend(id, &coords[0], &coords[1])?;
        self.exact.insert(id, kept);
        Ok(())
    }

    /// Decode attention of one query per sequence (`q` is `[B, Hq, D]`) on
    /// `backend`: project, decode the coordinates, reconstruct. `[B, Hq, D]`.
    ///
    /// With `residual = N` (module docs, "The exact residual"): `backend`
    /// decodes the coordinates with each head's kept tokens left out
    /// ([`Backend::decode_partial`]), the kept tokens are scored on the
    /// host, and the two softmax parts are merged exactly.
    pub fn decode(&self, backend: &dyn Backend, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        let hq = self.cache.shape().q_heads;
        let qp = project_queries(&self.scheme, &self.bases, seqs.len(), q)?;
        if self.residual() == 0 {
            let out = backend.decode(&self.cache, seqs, &qp, attn)?;
            return Ok(self.bases.reconstruct_outputs(&out, hq));
        }
        let skip: Vec<Vec<Vec<usize>>> = seqs.iter().map(|&id| self.kept_positions(id)).collect::<Result<_>>()?;
        let part = backend.decode_partial(&self.cache, seqs, &qp, attn, &skip)?;
        let lens: Vec<usize> = seqs.iter().map(|&id| self.cache.len(id)).collect::<Result<_>>()?;
        let q = round_inputs(&self.scheme, "query", q, seqs.len() * hq, self.bases.head_dim)?;
        let mut coords = vec![0f32; self.bases.rank];
        merge_exact(
            &self.bases,
            hq,
            &q,
            attn,
            &lens,
            &skip,
            &part,
            |b, t, pos, head, out| {
                match self.exact.get(&seqs[b]).and_then(|kept| {
                    let ti = if t == Tensor::Key { 0 } else { 1 };
                    kept[ti * self.bases.kv_heads + head].iter().find(|k| k.pos == pos)
                }) {
                    Some(k) => out.copy_from_slice(&k.row),
                    None => {
                        self.cache.view(seqs[b])?.row(t, pos, head, &mut coords);
                        self.bases.row_reconstruct(t, head, &coords, out);
                    }
                }
                Ok(())
            },
        )
    }

    /// Per KV head, the positions of sequence `id` kept exactly as a key or
    /// as a value (`residual = N`; sorted): what [`Self::decode`] leaves
    /// out of the coordinate decode. Empty lists without a residual.
    pub fn kept_positions(&self, id: SeqId) -> Result<Vec<Vec<usize>>> {
        self.cache.len(id)?;
        let h = self.bases.kv_heads;
        Ok((0..h)
            .map(|head| {
                let mut p: Vec<usize> = self.exact.get(&id).map_or(Vec::new(), |kept| {
                    kept[head].iter().chain(&kept[h + head]).map(|k| k.pos).collect()
                });
                p.sort_unstable();
                p.dedup();
                p
            })
            .collect())
    }

    /// The cache's view of tensor `t` of a sequence, reconstructed: `[T, Hkv, D]`.
    /// With `residual = N`, the kept tokens read their exact rows.
    pub fn dequantize(&self, id: SeqId, t: Tensor) -> Result<Vec<f32>> {
        let mut out = self.bases.reconstruct(t, &self.cache.dequantize(id, t)?);
        if let Some(kept) = self.exact.get(&id) {
            let (h, d) = (self.bases.kv_heads, self.bases.head_dim);
            let ti = if t == Tensor::Key { 0 } else { 1 };
            for (head, list) in kept[ti * h..(ti + 1) * h].iter().enumerate() {
                for k in list {
                    out[(k.pos * h + head) * d..][..d].copy_from_slice(&k.row);
                }
            }
        }
        Ok(out)
    }

    /// Bytes in use: the coordinate cache's, plus the bases once.
    ///
    /// With `residual = N`, the kept tokens are counted under `outliers`
    /// (tokens set aside exactly, as sparse outliers are): per kept row its
    /// `D` values in the activation dtype and a 4-byte position.
    pub fn memory(&self) -> MemoryReport {
        let mut m = self.cache.memory();
        m.bases = self.bases.bytes();
        let rows: usize = self.exact.values().flatten().map(Vec::len).sum();
        let exact = rows * (self.bases.head_dim * self.bases.elem_bytes + 4);
        m.outliers += exact;
        m.total += m.bases + exact;
        m
    }
}
