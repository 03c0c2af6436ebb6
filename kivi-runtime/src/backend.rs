//! The backend interface: decode attention over a paged cache for a batch
//! of sequences. Every backend is checked against [`ReferenceBackend`].

use crate::cache::{PagedCache, SeqId};
use crate::error::{Error, Result};
use crate::reference::{self, AttnParams};
use kivi_spec::Tensor;

/// Decode attention for one query per sequence.
pub trait Backend: Sync {
    /// Short name (`reference`, `cpu`, `sim`, `cuda`).
    fn name(&self) -> &'static str;
    /// `q` is `[B, Hq, D]` for the `B` sequences in `seqs`; returns `[B, Hq, D]`.
    fn decode(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>>;
}

/// Checks `q` against the batch and returns the per-sequence query length.
pub fn check_batch(cache: &PagedCache, seqs: &[SeqId], q: &[f32]) -> Result<usize> {
    let shape = cache.shape();
    let per = shape.q_heads * shape.head_dim;
    if q.len() != seqs.len() * per {
        return Err(Error::Shape {
            what: "query batch",
            expected: format!(
                "{} values ({} sequences x {} q_heads x {} head_dim)",
                seqs.len() * per,
                seqs.len(),
                shape.q_heads,
                shape.head_dim
            ),
            got: q.len().to_string(),
        });
    }
    for &s in seqs {
        cache.len(s)?;
    }
    Ok(per)
}

/// The oracle on a paged cache: reads the cache's view of K and V and runs
/// [`reference::decode_attention`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ReferenceBackend;

impl Backend for ReferenceBackend {
    fn name(&self) -> &'static str {
        "reference"
    }
    fn decode(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        let per = check_batch(cache, seqs, q)?;
        let mut out = Vec::with_capacity(q.len());
        for (b, &s) in seqs.iter().enumerate() {
            let k = cache.dequantize(s, Tensor::Key)?;
            let v = cache.dequantize(s, Tensor::Value)?;
            out.extend(reference::decode_attention(
                cache.scheme(),
                &q[b * per..(b + 1) * per],
                &k,
                &v,
                attn,
            )?);
        }
        Ok(out)
    }
}
