//! Low-rank keys and values (`low_rank: pca(...)`) on a [`Device`].
//!
//! A low-rank cache stores each token's `R` coordinates in a calibrated
//! basis, exactly as a cache of the scheme's coordinate scheme stores a head
//! of width `R` ([`kivi_spec::Scheme::coordinate_scheme`],
//! [`crate::low_rank`]). So [`DeviceLowRankCache`] is a [`DeviceCache`] of
//! the coordinate scheme — its prefill, append and decode are the generated
//! kernels of that scheme, unchanged (`kivi_templates::kernel_scheme`) —
//! plus the layer's [`Bases`]:
//!
//! - `extend` rounds and projects the new rows on the host with the same
//!   code as [`LowRankCache::extend`] (`low_rank::project_rows`), then runs
//!   the device's own prefill/append on the coordinates;
//! - `decode` projects the query once per step on the host
//!   (`low_rank::project_queries`), runs the decode and combine kernels on
//!   the `R`-wide coordinates, and reconstructs the output once
//!   ([`Bases::reconstruct_outputs`]).
//!
//! One copy of the math, on the host: no projection kernel is generated.
//! What that costs on a GPU (a host round trip per step, `Hq x D x R`
//! multiply-adds twice per step on the host) and why it is the right
//! first step is in docs/cuda.md, "Low-rank caches".

use super::{Device, DeviceCache};
use crate::cache::{CacheConfig, SeqId};
use crate::calib::Calibration;
use crate::error::{Error, Result};
use crate::low_rank::{self, Bases, LowRankCache};
use crate::reference::AttnParams;
use kivi_spec::{Scheme, Tensor};
use kivi_templates::Variant;
use std::sync::Arc;

/// Why [`DeviceCache::new`] refuses a low-rank scheme (it would store
/// full rows and run kernels generated for `R`-wide coordinates).
pub const NOT_DEVICE: &str =
    "a low_rank scheme stores coordinates in a calibrated basis: use kivi_runtime::device::DeviceLowRankCache with its bases";

/// A batch of sequences of a low-rank scheme (one layer) on a [`Device`]:
/// a [`DeviceCache`] of the coordinate scheme plus the layer's [`Bases`]
/// (module docs).
///
/// ```
/// use kivi_runtime::device::{DeviceLowRankCache, SimDevice};
/// use kivi_runtime::low_rank::Bases;
/// use kivi_runtime::{AttnParams, CacheConfig};
/// # if kivi_runtime::sim::find_compiler().is_err() { return; }
/// let s = kivi_spec::parse_scheme("L { key: quant(bits = 4, axis = channel, group = 32), \
///     value: quant(bits = 4, axis = token, group = 8), residual: 32, \
///     low_rank: pca(rank = 8, apply = [key, value]), heads: mha(1), head_dim: 16 }").unwrap();
/// // The first 8 unit vectors: any orthonormal rows will do.
/// let e: Vec<f32> = (0..8 * 16).map(|i| if i % 16 == i / 16 { 1.0 } else { 0.0 }).collect();
/// let bases = Bases::new(&s, e.clone(), e).unwrap();
/// let mut dc = DeviceLowRankCache::with_bases(SimDevice::shared(), &s, 1, 64, CacheConfig::for_tokens(64), bases).unwrap();
/// let kv: Vec<f32> = (0..40 * 16).map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0).collect();
/// dc.extend(&[40], &kv, &kv).unwrap(); // projected on the host, the prefill kernel on the device
/// let out = dc.decode(&[0.5; 16], AttnParams::of(&s, s.shape().unwrap()), None).unwrap();
/// assert_eq!(out.len(), 16);
/// ```
pub struct DeviceLowRankCache {
    scheme: Scheme,
    inner: DeviceCache,
    bases: Bases,
    calibration: Option<u64>,
}

impl DeviceLowRankCache {
    /// An empty batch of `batch` sequences (each up to `max_tokens`) of
    /// layer `layer`, with its bases from `calibration` (a missing basis is
    /// [`crate::calib::CalibError::Missing`] naming the layer and tensor; a
    /// calibration of another model shape is an error too).
    pub fn with_calibration(
        dev: Arc<dyn Device>,
        scheme: &Scheme,
        batch: usize,
        max_tokens: usize,
        config: CacheConfig,
        calibration: &Calibration,
        layer: usize,
    ) -> Result<Self> {
        let bases = Bases::for_layer(scheme, calibration, layer)?;
        let mut c = Self::with_bases(dev, scheme, batch, max_tokens, config, bases)?;
        c.calibration = Some(calibration.hash());
        Ok(c)
    }

    /// [`Self::with_calibration`] with bases handed in directly
    /// ([`Bases::new`]); bases of another shape or rank are an error.
    pub fn with_bases(
        dev: Arc<dyn Device>,
        scheme: &Scheme,
        batch: usize,
        max_tokens: usize,
        config: CacheConfig,
        bases: Bases,
    ) -> Result<Self> {
        low_rank::check_bases(scheme, &bases)?;
        refuse_residual(scheme)?;
        let coords = scheme
            .coordinate_scheme()
            .ok_or_else(|| Error::Config(format!("scheme `{}` has no low_rank field", scheme.name)))?;
        Ok(DeviceLowRankCache {
            inner: DeviceCache::new(dev, &coords, batch, max_tokens, config)?,
            scheme: scheme.clone(),
            bases,
            calibration: None,
        })
    }

    /// Copies sequences `seqs` of a host low-rank cache to the device (its
    /// coordinate words, as [`DeviceCache::upload`] copies a host cache).
    pub fn upload(dev: Arc<dyn Device>, host: &LowRankCache, seqs: &[SeqId]) -> Result<Self> {
        refuse_residual(host.scheme())?;
        Ok(DeviceLowRankCache {
            inner: DeviceCache::upload(dev, host.coordinates(), seqs)?,
            scheme: host.scheme().clone(),
            bases: host.bases().clone(),
            calibration: host.calibration_hash(),
        })
    }

    /// The low-rank scheme (head_dim `D`).
    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }
    /// The device cache of coordinates (head_dim `R`) the rows live in.
    pub fn coordinates(&self) -> &DeviceCache {
        &self.inner
    }
    pub fn bases(&self) -> &Bases {
        &self.bases
    }
    pub fn lens(&self) -> &[usize] {
        self.inner.lens()
    }
    /// The hash of the calibration the bases came from, if any.
    pub fn calibration_hash(&self) -> Option<u64> {
        self.calibration
    }
    /// The scheme hash joined with the calibration's, as
    /// [`LowRankCache::identity`].
    pub fn identity(&self) -> u64 {
        crate::calib::identity(kivi_spec::scheme_hash(&self.scheme), self.calibration)
    }

    /// Adds `counts[b]` tokens to sequence `b`: `k`, `v` are `[sum(counts),
    /// Hkv, D]`, projected on the host ([`LowRankCache::extend`]'s code),
    /// then stored by the device's prefill or append kernel. An error
    /// leaves the cache unchanged.
    pub fn extend(&mut self, counts: &[usize], k: &[f32], v: &[f32]) -> Result<()> {
        self.extend_with(counts, k, v, None)
    }

    /// [`Self::extend`] with a chosen prefill/append variant.
    pub fn extend_with(&mut self, counts: &[usize], k: &[f32], v: &[f32], variant: Option<Variant>) -> Result<()> {
        let row = self.bases.kv_heads * self.bases.head_dim;
        let total: usize = counts.iter().sum();
        if counts.len() != self.inner.batch() || k.len() != total * row || v.len() != k.len() {
            return Err(Error::Shape {
                what: "device low-rank extend",
                expected: format!(
                    "{} counts and {} values each for key and value",
                    self.inner.batch(),
                    total * row
                ),
                got: format!("{} counts, {} and {} values", counts.len(), k.len(), v.len()),
            });
        }
        let ck = low_rank::project_rows(&self.scheme, &self.bases, Tensor::Key, k)?;
        let cv = low_rank::project_rows(&self.scheme, &self.bases, Tensor::Value, v)?;
        self.inner.extend_with(counts, &ck, &cv, variant)
    }

    /// Decode attention of one query per sequence (`q` is `[batch, Hq,
    /// D]`): project the query, decode the coordinates on the device
    /// (`variant`, default when `None`), reconstruct. `[batch, Hq, D]`.
    pub fn decode(&self, q: &[f32], attn: AttnParams, variant: Option<Variant>) -> Result<Vec<f32>> {
        let qp = low_rank::project_queries(&self.scheme, &self.bases, self.inner.batch(), q)?;
        let out = self.inner.decode(&qp, attn, variant)?;
        Ok(self
            .bases
            .reconstruct_outputs(&out, self.inner.scheme().shape().map_or(1, |s| s.q_heads)))
    }
}

/// `residual = N` (exact rows for the worst-reconstructed tokens) has no
/// device path yet. The host fast path ([`LowRankCache::decode`]) leaves
/// the kept tokens out of the coordinate decode and merges them back in
/// exactly; the generated decode kernel has no argument to leave tokens
/// out (a per-head list of skipped positions), and taking their share back
/// out of its finished output instead would cancel catastrophically when a
/// kept token holds most of the softmax weight.
fn refuse_residual(scheme: &Scheme) -> Result<()> {
    match scheme.low_rank {
        Some(l) if l.residual > 0 => Err(Error::Config(format!(
            "scheme `{}`: low_rank residual = {} (exact tokens) is not supported on the device yet \
             (its decode kernel cannot leave the kept tokens out); LowRankCache decodes it on any host backend",
            scheme.name, l.residual
        ))),
        _ => Ok(()),
    }
}
