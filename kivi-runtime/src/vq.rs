//! Product vector quantization (`vq(dim = M, entries = E [, codebook =
//! NAME])`, see [`kivi_spec::vq`]): the codebooks, the scalar coder every
//! path shares, the k-means fit from calibration samples, and the oracle's
//! view of a vq tensor.
//!
//! # Codebooks in a calibration
//!
//! One entry of kind [`Kind::VqCodebook`] per layer and tensor, shape
//! `[head_dim / M, E, M]` (sub-vector, centroid, channel), fitted for the
//! text [`fit_key`] returns. A named codebook (`codebook = NAME`) is one
//! entry for every layer and for both tensors that name it: it is stored
//! at layer 0 under the key tensor (the first tensor that can name it),
//! with the name in its fit text, and fitted on the pooled sub-vectors of
//! every layer and tensor that share it.
//!
//! # Coding
//!
//! A token's row (rounded to the activation dtype) is cut into sub-vectors
//! of `M` consecutive channels; sub-vector `j` is coded as the centroid of
//! codebook `j` at the least squared L2 distance (summed in f32 in channel
//! order; ties to the lowest index). Every writer calls [`VqBook::encode`],
//! so the oracle and the paged cache store the same codes bit for bit.

use crate::calib::{CalibError, Calibration, Entry, Kind, LayerSamples, Stage};
use crate::error::{Error, Result};
use crate::quant::round_to_dtype;
use crate::reference::{round_inputs, shape_of};
use kivi_spec::layout::regions;
use kivi_spec::{Codec, Heads, Scheme, Tensor, Vq};
use std::sync::Arc;

/// One tensor's product codebooks at one layer: `subvectors` tables of
/// `entries` centroids of `dim` channels, `[sub][entry][dim]` row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct VqBook {
    pub dim: usize,
    pub entries: usize,
    pub subvectors: usize,
    /// `subvectors * entries * dim` f32.
    pub data: Vec<f32>,
    /// The shared name, if the scheme named one.
    pub name: Option<String>,
}

impl VqBook {
    /// Codebooks from calibration data, checked against the codec and the
    /// head width.
    pub fn new(vq: &Vq, head_dim: usize, data: Vec<f32>) -> std::result::Result<VqBook, CalibError> {
        let (dim, entries) = (vq.dim as usize, vq.entries as usize);
        if dim == 0 || !head_dim.is_multiple_of(dim) || data.len() != head_dim * entries {
            return Err(CalibError::Malformed(format!(
                "vq codebooks of {} values for dim {dim}, entries {entries}, head_dim {head_dim}",
                data.len()
            )));
        }
        if data.iter().any(|x| !x.is_finite()) {
            return Err(CalibError::Malformed("vq codebook has a non-finite centroid".into()));
        }
        Ok(VqBook {
            dim,
            entries,
            subvectors: head_dim / dim,
            data,
            name: vq.codebook.map(|n| n.as_str().to_string()),
        })
    }

    /// The `entries x dim` table of sub-vector `j`.
    #[inline]
    pub fn table(&self, j: usize) -> &[f32] {
        &self.data[j * self.entries * self.dim..][..self.entries * self.dim]
    }

    /// Centroid `c` of sub-vector `j`.
    #[inline]
    pub fn centroid(&self, j: usize, c: usize) -> &[f32] {
        &self.data[(j * self.entries + c) * self.dim..][..self.dim]
    }

    /// Codes of one row (`head_dim` values): the nearest centroid of each
    /// sub-vector (see the module docs).
    pub fn encode(&self, row: &[f32], codes: &mut [u32]) {
        for (j, (x, c)) in row.chunks_exact(self.dim).zip(codes.iter_mut()).enumerate() {
            *c = nearest(x, self.table(j), self.dim) as u32;
        }
    }

    /// The row that `codes` stand for: its centroids, concatenated.
    pub fn decode(&self, codes: &[u32], out: &mut [f32]) {
        for (j, (o, c)) in out.chunks_exact_mut(self.dim).zip(codes).enumerate() {
            o.copy_from_slice(self.centroid(j, *c as usize));
        }
    }

    /// Bytes the codebooks occupy (f32).
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}

/// Index of the row of `table` (`k x dim`) nearest to `x` (squared L2
/// summed in f32 in channel order; ties to the lowest index).
pub fn nearest(x: &[f32], table: &[f32], dim: usize) -> usize {
    let mut best = (f32::INFINITY, 0usize);
    for (c, cent) in table.chunks_exact(dim).enumerate() {
        let mut d = 0f32;
        for (a, b) in x.iter().zip(cent) {
            let e = a - b;
            d += e * e;
        }
        if d < best.0 {
            best = (d, c);
        }
    }
    best.1
}

/// The fit text of a vq tensor: `vq dim=M entries=E`, plus
/// ` shared=NAME` for a named codebook; `None` unless `t` is vq.
///
/// ```
/// let s = kivi_spec::parse_scheme("V { key: vq(dim = 8, entries = 256), value: vq(dim = 8, entries = 256, codebook = c) }").unwrap();
/// assert_eq!(kivi_runtime::vq::fit_key(&s, kivi_spec::Tensor::Key).unwrap(), "vq dim=8 entries=256");
/// assert_eq!(kivi_runtime::vq::fit_key(&s, kivi_spec::Tensor::Value).unwrap(), "vq dim=8 entries=256 shared=c");
/// ```
pub fn fit_key(s: &Scheme, t: Tensor) -> Option<String> {
    let v = s.codec(t).vq()?;
    let mut o = format!("vq dim={} entries={}", v.dim, v.entries);
    if let Some(n) = v.codebook {
        o.push_str(&format!(" shared={n}"));
    }
    Some(o)
}

/// Where tensor `t`'s codebook lives in a calibration: `(layer, tensor)`
/// of the entry (layer 0, key, for a shared one).
fn entry_place(s: &Scheme, t: Tensor, layer: usize) -> (usize, Tensor) {
    match s.codec(t).vq().and_then(|v| v.codebook) {
        Some(_) => (0, Tensor::Key),
        None => (layer, t),
    }
}

/// The codebooks of tensor `t` (which must be vq) of `scheme` at `layer`,
/// checked against the model's shape and the codec; a missing one is
/// [`CalibError::Missing`] naming the layer, the tensor and the fit.
pub fn book(cal: &Calibration, scheme: &Scheme, t: Tensor, layer: usize) -> std::result::Result<VqBook, CalibError> {
    let (Some(v), Some(fit)) = (scheme.codec(t).vq(), fit_key(scheme, t)) else {
        return Err(CalibError::Samples(format!(
            "scheme `{}` does not use vq on its {}s",
            scheme.name,
            t.name()
        )));
    };
    cal.check_shape(scheme)?;
    let d = cal.model.head_dim as usize;
    let missing = |have: String| CalibError::Missing {
        scheme: scheme.name.clone(),
        layer,
        tensor: t.name(),
        fit: fit.clone(),
        calibration: cal.model.name.clone(),
        have,
    };
    if layer >= cal.model.layers as usize {
        return Err(missing(format!("{} layers", cal.model.layers)));
    }
    let (l, et) = entry_place(scheme, t, layer);
    match cal.get(l, et, Stage::PostRope, Kind::VqCodebook, &fit) {
        Some(e) => {
            if e.shape != [d as u32 / v.dim, v.entries, v.dim] {
                return Err(missing(format!("vq codebooks of shape {:?}", e.shape)));
            }
            VqBook::new(v, d, e.data.clone())
        }
        None => {
            let fits: Vec<&str> = cal
                .entries()
                .iter()
                .filter(|e| e.layer as usize == l && e.tensor == et && e.kind == Kind::VqCodebook)
                .map(|e| e.fit.as_str())
                .collect();
            Err(missing(if fits.is_empty() {
                "no vq codebook there".into()
            } else {
                format!("vq codebooks for: {}", fits.join("; "))
            }))
        }
    }
}

/// The codebooks every vq tensor of `scheme` decodes with at `layer`
/// (`None` for other tensors). Without a calibration a vq tensor is
/// [`CalibError::VqNeeded`].
pub fn books_for(
    scheme: &Scheme,
    cal: Option<&Calibration>,
    layer: usize,
) -> std::result::Result<[Option<Arc<VqBook>>; 2], CalibError> {
    let mut out = [None, None];
    for (i, t) in [Tensor::Key, Tensor::Value].into_iter().enumerate() {
        if scheme.codec(t).vq().is_none() {
            continue;
        }
        let Some(c) = cal else {
            return Err(CalibError::VqNeeded {
                scheme: scheme.name.clone(),
                tensor: t.name(),
            });
        };
        out[i] = Some(Arc::new(book(c, scheme, t, layer)?));
    }
    Ok(out)
}

// ---------------------------------------------------------------------------
// Fitting
// ---------------------------------------------------------------------------

/// How product codebooks are fitted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct VqFitOptions {
    /// Most Lloyd iterations (stops earlier when no assignment changes).
    pub iterations: usize,
    /// Most training sub-vectors per codebook: beyond it the pooled
    /// sub-vectors are thinned by an even stride (deterministic), which
    /// keeps a shared codebook's fit in the same time as a per-layer one.
    pub max_points: usize,
    /// Seed of the initial centroids (distinct training points drawn with
    /// [`crate::rand::Rng`]).
    pub seed: u64,
    /// Skip a codebook the calibration already has (same layer, tensor and
    /// fit): for several schemes fitted on the same samples in one run.
    pub keep_existing: bool,
}

impl Default for VqFitOptions {
    fn default() -> Self {
        VqFitOptions {
            iterations: 20,
            max_points: 8192,
            seed: 1,
            keep_existing: false,
        }
    }
}

/// What one fitted codebook set achieved on its own training rows: the
/// mean squared error per element and the mean square of the data (their
/// ratio is the relative reconstruction error).
#[derive(Clone, Debug, PartialEq)]
pub struct VqFitReport {
    /// The layer of the entry (0 for a shared codebook).
    pub layer: usize,
    pub tensor: Tensor,
    pub fit: String,
    pub rows: usize,
    pub mse: f64,
    pub mean_square: f64,
}

/// k-means (Lloyd) of `n = pts.len() / dim` points into `k` centroids:
/// initial centroids are `k` distinct points drawn with a seeded
/// generator (all points, repeated, when there are fewer than `k`);
/// each iteration assigns every point to its nearest centroid and moves each centroid to its
/// points' mean (in f64); a centroid left without points keeps its place.
/// Returns `k x dim` centroids.
pub fn kmeans(pts: &[f32], dim: usize, k: usize, iterations: usize, seed: u64) -> Vec<f32> {
    let n = pts.len() / dim.max(1);
    if n == 0 || k == 0 {
        return vec![0.0; k * dim];
    }
    let mut rng = crate::rand::Rng::new(seed);
    let mut order: Vec<usize> = (0..n).collect();
    // Partial Fisher–Yates: the first min(k, n) of a seeded shuffle.
    for i in 0..k.min(n) {
        let j = i + rng.below(n - i);
        order.swap(i, j);
    }
    let mut c: Vec<f32> = (0..k)
        .flat_map(|i| pts[order[i % n] * dim..][..dim].iter().copied())
        .collect();
    let mut assign = vec![usize::MAX; n];
    for _ in 0..iterations.max(1) {
        if !assign_all(pts, dim, &c, &mut assign) {
            break;
        }
        let mut sum = vec![0f64; k * dim];
        let mut count = vec![0usize; k];
        for (i, &a) in assign.iter().enumerate() {
            count[a] += 1;
            for (s, x) in sum[a * dim..][..dim].iter_mut().zip(&pts[i * dim..][..dim]) {
                *s += *x as f64;
            }
        }
        for j in 0..k {
            if count[j] > 0 {
                for (cc, s) in c[j * dim..][..dim].iter_mut().zip(&sum[j * dim..][..dim]) {
                    *cc = (*s / count[j] as f64) as f32;
                }
            }
        }
    }
    c
}

/// Assigns every point of `pts` to its nearest centroid of `c` (`k x dim`)
/// for training; whether any assignment changed. Distances are taken as
/// `|c|^2 - 2 x . c` against the centroids transposed (`[dim][k]`), so the
/// loop over centroids vectorizes: about ten times [`nearest`]'s speed.
/// Training only: its rounding may break a near-tie differently from
/// [`nearest`], which is what every stored code comes from.
fn assign_all(pts: &[f32], dim: usize, c: &[f32], assign: &mut [usize]) -> bool {
    let k = c.len() / dim;
    let mut ct = vec![0f32; dim * k];
    let mut norms = vec![0f32; k];
    for (e, cent) in c.chunks_exact(dim).enumerate() {
        for (d, x) in cent.iter().enumerate() {
            ct[d * k + e] = *x;
            norms[e] += x * x;
        }
    }
    let mut dist = vec![0f32; k];
    let mut changed = false;
    for (x, a) in pts.chunks_exact(dim).zip(assign.iter_mut()) {
        dist.copy_from_slice(&norms);
        for (d, xd) in x.iter().enumerate() {
            let m = -2.0 * xd;
            for (o, r) in dist.iter_mut().zip(&ct[d * k..(d + 1) * k]) {
                *o += m * r;
            }
        }
        let mut best = (dist[0], 0usize);
        for (e, v) in dist.iter().enumerate().skip(1) {
            if *v < best.0 {
                best = (*v, e);
            }
        }
        if best.1 != *a {
            *a = best.1;
            changed = true;
        }
    }
    changed
}

/// Every `step`-th of `n` rows so that at most `max` remain.
fn thin(n: usize, max: usize) -> impl Iterator<Item = usize> {
    let step = n.div_ceil(max.max(1)).max(1);
    (0..n).step_by(step)
}

/// One codebook set to fit: the entry's layer, tensor and fit text, the
/// codec, and the `(layer, tensor)`s whose rows it is fitted on.
type FitJob = (usize, Tensor, String, Vq, Vec<(usize, Tensor)>);

impl Calibration {
    /// Fits product codebooks for every vq tensor of `scheme` and every
    /// layer in `samples` (several samples of a layer are pooled; a named
    /// codebook pools every layer and tensor that names it) and adds them.
    /// The training rows are what the cache codes: every token past the
    /// sinks, every KV head, rounded to the activation dtype.
    /// Deterministic for given samples and options.
    pub fn fit_vq(
        &mut self,
        scheme: &Scheme,
        samples: &[LayerSamples],
        opts: VqFitOptions,
    ) -> std::result::Result<Vec<VqFitReport>, CalibError> {
        let (h, d) = (self.model.kv_heads as usize, self.model.head_dim as usize);
        for s in samples {
            if (s.kv_heads, s.head_dim) != (h, d) {
                return Err(CalibError::ModelMismatch {
                    expected: self.model.to_string(),
                    found: format!("samples of {} kv heads, head_dim {}", s.kv_heads, s.head_dim),
                });
            }
            crate::calib::check_samples(s)?;
        }
        let bound = scheme
            .with_shape(scheme.heads.unwrap_or(Heads::Mqa(1)), d as u32)
            .or_else(|_| match samples.first() {
                Some(s) => scheme.with_shape(Heads::from_counts(s.q_heads as u32, h as u32), d as u32),
                None => scheme.with_shape(Heads::from_counts(h as u32, h as u32), d as u32),
            })
            .map_err(|e| CalibError::Samples(e.to_string()))?;
        let mut layers: Vec<usize> = samples.iter().map(|s| s.layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let mut jobs: Vec<FitJob> = Vec::new();
        for t in [Tensor::Key, Tensor::Value] {
            let (Some(v), Some(fit)) = (bound.codec(t).vq().copied(), fit_key(&bound, t)) else {
                continue;
            };
            for &layer in &layers {
                let (l, et) = entry_place(&bound, t, layer);
                match jobs.iter_mut().find(|j| j.0 == l && j.1 == et && j.2 == fit) {
                    Some(j) => j.4.push((layer, t)),
                    None => jobs.push((l, et, fit.clone(), v, vec![(layer, t)])),
                }
            }
        }
        let mut reports = Vec::new();
        for (l, et, fit, v, from) in jobs {
            // Fits are deterministic in the samples and options: an entry
            // already fitted on these samples (another scheme of one
            // `kivi calibrate` run with the same codec) is kept as it is.
            if opts.keep_existing && self.get(l, et, Stage::PostRope, Kind::VqCodebook, &fit).is_some() {
                continue;
            }
            let dim = v.dim as usize;
            let k = v.entries as usize;
            let sub = d / dim;
            // Rows: every token past the sinks of every head, rounded.
            let mut rows: Vec<f32> = Vec::new();
            for &(layer, t) in &from {
                for s in samples.iter().filter(|s| s.layer == layer) {
                    let x = if t == Tensor::Key { &s.keys } else { &s.values };
                    let first = (bound.sinks as usize).min(s.tokens);
                    rows.extend(x[first * h * d..].iter().map(|v| round_to_dtype(*v, bound.dtype)));
                }
            }
            let n = rows.len() / d;
            if n == 0 {
                return Err(CalibError::Samples(format!(
                    "layer {l} {}: no token past the sinks to fit vq codebooks on",
                    et.name()
                )));
            }
            let keep: Vec<usize> = thin(n, opts.max_points).collect();
            // Sub-vectors are independent fits: one rayon job each (the
            // seeds depend on the sub-vector, not on the schedule).
            use rayon::prelude::*;
            let tables: Vec<Vec<f32>> = (0..sub)
                .into_par_iter()
                .map(|j| {
                    let mut pts = vec![0f32; keep.len() * dim];
                    for (p, &r) in pts.chunks_exact_mut(dim).zip(&keep) {
                        p.copy_from_slice(&rows[r * d + j * dim..][..dim]);
                    }
                    let seed = opts.seed ^ ((l as u64) << 32) ^ ((j as u64) << 8) ^ (et == Tensor::Value) as u64;
                    kmeans(&pts, dim, k, opts.iterations, seed)
                })
                .collect();
            let data: Vec<f32> = tables.concat();
            let book = VqBook::new(&v, d, data)?;
            let (mut se, mut ss) = (0f64, 0f64);
            let (mut codes, mut dec) = (vec![0u32; sub], vec![0f32; d]);
            for &r in &keep {
                let row = &rows[r * d..][..d];
                book.encode(row, &mut codes);
                book.decode(&codes, &mut dec);
                for (a, b) in row.iter().zip(&dec) {
                    se += ((a - b) as f64).powi(2);
                    ss += (*a as f64).powi(2);
                }
            }
            let m = (keep.len() * d) as f64;
            reports.push(VqFitReport {
                layer: l,
                tensor: et,
                fit: fit.clone(),
                rows: keep.len(),
                mse: se / m,
                mean_square: ss / m,
            });
            self.insert(Entry {
                layer: l as u32,
                tensor: et,
                stage: Stage::PostRope,
                kind: Kind::VqCodebook,
                fit,
                shape: vec![sub as u32, k as u32, dim as u32],
                data: book.data,
            })?;
        }
        Ok(reports)
    }
}

/// The checks a [`Kind::VqCodebook`] entry passes on insert and load:
/// shape `[head_dim / M, E, M]` with `E` a power of two from 2 to 65536.
pub(crate) fn check_entry(model: &crate::calib::ModelId, e: &Entry) -> std::result::Result<(), String> {
    let [sub, k, dim] = e.shape[..] else {
        return Err(format!(
            "vq codebooks have shape [sub-vectors, entries, dim], not {:?}",
            e.shape
        ));
    };
    if dim == 0 || sub.checked_mul(dim) != Some(model.head_dim) {
        return Err(format!(
            "vq codebooks of shape {:?} do not cover head_dim {}",
            e.shape, model.head_dim
        ));
    }
    if !(2..=kivi_spec::vq::MAX_VQ_ENTRIES).contains(&k) || !k.is_power_of_two() {
        return Err(format!(
            "vq codebooks of {k} entries; expected a power of two from 2 to 65536"
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// The oracle
// ---------------------------------------------------------------------------

/// The oracle's view of a vq tensor holding `x` (`[T, Hkv, D]`): sinks and
/// window tokens rounded to the activation dtype, every other token the
/// concatenation of its sub-vectors' nearest centroids in `book`
/// (DESIGN.md §3 with the codes replaced; the windows follow the
/// token-axis rule). Use through
/// [`crate::reference::cache_view_calibrated`].
pub fn cache_view(s: &Scheme, t: Tensor, x: &[f32], book: &VqBook) -> Result<Vec<f32>> {
    let shape = shape_of(s)?;
    let (h, d) = (shape.kv_heads, shape.head_dim);
    if !matches!(s.codec(t), Codec::Vq(_)) || book.subvectors * book.dim != d {
        return Err(Error::Config(format!(
            "vq codebooks of {} x {} channels do not fit the {} tensor of `{}`",
            book.subvectors,
            book.dim,
            t.name(),
            s.name
        )));
    }
    if !x.len().is_multiple_of(h * d) {
        return Err(Error::Shape {
            what: "tensor length",
            expected: format!("a multiple of {} (heads x head_dim)", h * d),
            got: x.len().to_string(),
        });
    }
    let tokens = x.len() / (h * d);
    let mut out = round_inputs(s, t.name(), x, h, d)?;
    let r = regions(s, t, tokens);
    let mut codes = vec![0u32; book.subvectors];
    for tok in r.sinks..r.sinks + r.quantized {
        for row in out[tok * h * d..(tok + 1) * h * d].chunks_exact_mut(d) {
            book.encode(row, &mut codes);
            book.decode(&codes, row);
        }
    }
    Ok(out)
}
