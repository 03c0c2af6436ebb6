//! Low-rank schemes (`low_rank: pca(...)`) as a tuning target.
//!
//! A low-rank cache is a cache of its coordinate scheme
//! ([`kivi_spec::Scheme::coordinate_scheme`]); the host projects and
//! reconstructs around the very kernels (CPU paths or generated CUDA) that
//! a plain cache of that scheme runs. So the variants to tune are the
//! coordinate scheme's, measured by that scheme's target (a [`CpuTarget`]
//! or [`crate::cuda::CudaTarget`]) and checked against that scheme's
//! reference on its tuning inputs — which is exactly what runs. What
//! changes is the key: [`LowRankTarget`] reports the calibration the bases
//! came from ([`Target::calibration_hash`]), and `tune::run` is handed the
//! low-rank scheme, so decisions are keyed by the low-rank scheme's hash
//! joined with the calibration's ([`crate::tune::decision_hash`]), as a
//! `LowRankCache`'s identity is.
//!
//! [`CpuTarget`]: crate::CpuTarget

use crate::bucket::Bucket;
use crate::fingerprint::{Fingerprint, Toolchain};
use crate::tune::{Candidate, Method, Target, Workload};
use kivi_runtime::calib::Calibration;
use kivi_spec::Scheme;

/// The coordinate scheme's target, keyed by a calibration (module docs).
pub struct LowRankTarget {
    inner: Box<dyn Target>,
    calibration: u64,
}

impl LowRankTarget {
    /// Wraps `inner`, a target built for `scheme.coordinate_scheme()`,
    /// after checking that `calibration` has both bases of `layer` for
    /// `scheme`'s shape (so a wrong file fails here, naming the layer and
    /// tensor, not after tuning).
    ///
    /// ```
    /// # use kivi_runtime::calib::{Calibration, LayerSamples, ModelId};
    /// let s = kivi_spec::parse_scheme("L { key: quant(bits = 2, axis = channel, group = 32), \
    ///     value: quant(bits = 2, axis = token, group = 8), residual: 16, \
    ///     low_rank: pca(rank = 8, apply = [key, value]), heads: mha(1), head_dim: 16 }").unwrap();
    /// let mut rng = kivi_runtime::rand::Rng::new(1);
    /// let model = ModelId { name: "toy".into(), layers: 1, kv_heads: 1, head_dim: 16 };
    /// let mut cal = Calibration::new(model, "draws");
    /// cal.fit_bases(&[LayerSamples::new(0, 64, 1, 1, 16, rng.vec(64 * 16), rng.vec(64 * 16))]).unwrap();
    /// let inner = kivi_tuner::CpuTarget::new(&s.coordinate_scheme().unwrap()).unwrap();
    /// let t = kivi_tuner::low_rank::LowRankTarget::new(&s, Box::new(inner), &cal, 0).unwrap();
    /// use kivi_tuner::tune::Target;
    /// assert_eq!(t.calibration_hash(), Some(cal.hash()));
    /// assert!(kivi_tuner::low_rank::LowRankTarget::new(&s, Box::new(kivi_tuner::CpuTarget::new(&s.coordinate_scheme().unwrap()).unwrap()), &cal, 1).is_err());
    /// ```
    pub fn new(
        scheme: &Scheme,
        inner: Box<dyn Target>,
        calibration: &Calibration,
        layer: usize,
    ) -> Result<Self, String> {
        if scheme.low_rank.is_none() {
            return Err(format!("scheme `{}` has no low_rank field", scheme.name));
        }
        kivi_runtime::low_rank::Bases::for_layer(scheme, calibration, layer).map_err(|e| e.to_string())?;
        Ok(LowRankTarget {
            inner,
            calibration: calibration.hash(),
        })
    }
}

impl Target for LowRankTarget {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn device(&self) -> Fingerprint {
        self.inner.device()
    }
    fn toolchain(&self) -> Toolchain {
        self.inner.toolchain()
    }
    fn candidates(&self, bucket: &Bucket) -> Vec<Candidate> {
        self.inner.candidates(bucket)
    }
    fn check(&self, candidate: &Candidate, bucket: &Bucket) -> Result<(), String> {
        self.inner.check(candidate, bucket)
    }
    fn workload<'a>(&'a self, bucket: &Bucket, prep_budget_s: f64) -> Result<Box<dyn Workload + 'a>, String> {
        self.inner.workload(bucket, prep_budget_s)
    }
    fn method(&self) -> Method {
        self.inner.method()
    }
    fn peak_gbps(&self) -> Option<f64> {
        self.inner.peak_gbps()
    }
    fn calibration_hash(&self) -> Option<u64> {
        Some(self.calibration)
    }
}
