//! The schemes a model run can use. The cache itself is kivi-candle's
//! [`kivi_candle::KiviKvCache`] (one [`kivi_runtime::PagedCache`] per layer,
//! fused attention through [`kivi_runtime::CpuBackend`]), made for the model
//! by [`crate::model::Gemma3::new_cache`].

use crate::error::{Error, Result};
use kivi_spec::{Codec, Dtype, Scheme};

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
