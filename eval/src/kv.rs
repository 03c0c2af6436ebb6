//! The KV cache of a model run, provided by kivi: one
//! [`kivi_runtime::PagedCache`] per layer, the scheme bound to the model's
//! head layout, decode attention through [`kivi_runtime::CpuBackend`].

use crate::error::{Error, Result};
use crate::model::{Config, KvCache};
use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, CpuParams, PagedCache, SeqId};
use kivi_spec::{Codec, Dtype, Heads, Scheme};

/// The unquantized baseline: f32 activations, keys and values kept as they
/// are (`dtype: f32`, `key: full`, `value: full`).
pub fn f32_scheme() -> Scheme {
    let mut s = kivi_spec::presets::f16();
    s.name = "f32".into();
    s.dtype = Dtype::F32;
    s.key = Codec::Full;
    s.value = Codec::Full;
    s
}

/// A scheme named on the command line, by the one rule of
/// [`kivi_spec::load_scheme`] (scheme text if it contains `{`, else a preset
/// name, else a file path) with `f32` ([`f32_scheme`]) counted as a preset.
pub fn resolve_scheme(spec: &str) -> Result<Scheme> {
    kivi_spec::resolve_scheme(spec, &[f32_scheme()])
        .map(|r| r.scheme)
        .map_err(|e| Error::Config(e.to_string()))
}

/// One sequence's cache for every layer of a model.
pub struct KiviCache {
    caches: Vec<PagedCache>,
    seqs: Vec<SeqId>,
    backend: CpuBackend,
    softmax_scale: f32,
}

impl KiviCache {
    /// Caches for `scheme` (shape left open: it is bound here to the model's
    /// heads and head_dim) with room for `max_tokens` tokens per layer.
    pub fn new(scheme: &Scheme, cfg: &Config, max_tokens: usize) -> Result<KiviCache> {
        let heads = Heads::from_counts(cfg.q_heads as u32, cfg.kv_heads as u32);
        let bound = scheme.with_shape(heads, cfg.head_dim as u32)?;
        let mut caches = Vec::with_capacity(cfg.layers);
        let mut seqs = Vec::with_capacity(cfg.layers);
        for _ in 0..cfg.layers {
            let mut c = PagedCache::new(bound.clone(), CacheConfig::for_tokens(max_tokens))?;
            seqs.push(c.add_sequence());
            caches.push(c);
        }
        Ok(KiviCache {
            caches,
            seqs,
            // threads = 0: the global rayon pool, shared with candle, sized
            // once by the caller (a per-call pool would be rebuilt per token).
            backend: CpuBackend::new(CpuParams::default())?,
            softmax_scale: cfg.softmax_scale,
        })
    }

    /// The bound scheme.
    pub fn scheme(&self) -> &Scheme {
        self.caches[0].scheme()
    }

    /// Bytes the caches of all layers use now (exact, from the cache).
    pub fn memory_bytes(&self) -> usize {
        self.caches.iter().map(|c| c.memory().total).sum()
    }
}

impl KvCache for KiviCache {
    fn prefill(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        Ok(self.caches[layer].extend(self.seqs[layer], k, v)?)
    }

    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32], window: Option<usize>) -> Result<Vec<f32>> {
        let (cache, seq) = (&mut self.caches[layer], self.seqs[layer]);
        cache.append(seq, k, v)?;
        let attn = AttnParams {
            softmax_scale: self.softmax_scale,
            window,
        };
        Ok(self.backend.decode(cache, &[seq], q, attn)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes_load_by_the_one_rule_with_f32_as_a_preset() {
        assert_eq!(resolve_scheme("f32").unwrap(), f32_scheme());
        assert_eq!(resolve_scheme("kivi2").unwrap(), kivi_spec::presets::kivi2());
        let s = resolve_scheme("mine { key: full, value: quant(bits = 4, axis = token, group = 32) }").unwrap();
        assert_eq!(s.name, "mine");
        let e = resolve_scheme("kivi9").unwrap_err().to_string();
        assert!(e.contains("not a preset (kivi2,") && e.contains(", f32)"), "{e}");
        assert!(e.contains("no file `kivi9`"), "{e}");
    }
}
