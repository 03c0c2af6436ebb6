//! The CPU backend: fused dequantize + decode attention.
//!
//! Work is split over (sequence, KV head, split of the sequence) and run with
//! rayon; each task reads its KV head's bytes once and serves all query heads
//! of the GQA group from that pass, with an online softmax per tile of
//! tokens. Splits are merged flash-decoding style. Nothing materialises f32
//! K or V beyond one tile.

use crate::backend::{check_batch, Backend};
use crate::cache::{PagedCache, SeqId, SeqView};
use crate::error::{Error, Result};
use crate::quant::round_to_dtype;
use crate::reference::AttnParams;
use kivi_spec::Tensor;
use rayon::prelude::*;

/// Tunable parameters of the CPU kernel (the tuner searches these).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpuParams {
    /// Splits of each sequence; `0` picks enough to keep every thread busy.
    pub splits: usize,
    /// Tokens scored before each softmax rescale.
    pub tile_tokens: usize,
    /// Worker threads; `0` uses rayon's global pool.
    pub threads: usize,
}

impl Default for CpuParams {
    fn default() -> Self {
        CpuParams {
            splits: 0,
            tile_tokens: 64,
            threads: 0,
        }
    }
}

impl CpuParams {
    /// A readable name, used in tuning tables and decision files.
    pub fn name(&self) -> String {
        format!("cpu/s{}.t{}.th{}", self.splits, self.tile_tokens, self.threads)
    }
}

/// Fused CPU decode attention.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend {
    pub params: CpuParams,
}

/// Partial result of one split: running max, normaliser and unnormalised
/// output for each query head of the group.
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
}

const MIN_SPLIT_TOKENS: usize = 256;

fn auto_splits(work: usize, tokens: usize, threads: usize) -> usize {
    let want = (4 * threads).div_ceil(work.max(1));
    want.clamp(1, tokens.div_ceil(MIN_SPLIT_TOKENS).max(1))
}

impl CpuBackend {
    pub fn new(params: CpuParams) -> Result<Self> {
        if params.tile_tokens == 0 || params.tile_tokens > 4096 {
            return Err(Error::Config(format!("tile_tokens = {} must be between 1 and 4096", params.tile_tokens)));
        }
        Ok(CpuBackend { params })
    }

    fn run(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        let per = check_batch(cache, seqs, q)?;
        let shape = cache.shape();
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let group = shape.group_size();
        let dtype = cache.scheme().dtype;
        // Queries are inputs too: round them to the activation dtype.
        let mut qr = Vec::with_capacity(q.len());
        for (i, &x) in q.iter().enumerate() {
            let r = round_to_dtype(x, dtype);
            if !r.is_finite() {
                return Err(Error::NonFinite {
                    tensor: "query",
                    value: x,
                    token: i / per,
                    head: (i % per) / d,
                    channel: i % d,
                    policy: "reject",
                });
            }
            qr.push(r * attn.softmax_scale);
        }
        let views: Vec<SeqView> = seqs.iter().map(|&s| cache.view(s)).collect::<Result<_>>()?;
        let ranges: Vec<(usize, usize)> = views
            .iter()
            .map(|v| {
                let t = v.tokens();
                (attn.window.map_or(0, |w| t.saturating_sub(w)), t)
            })
            .collect();
        let threads = rayon::current_num_threads();
        let max_len = ranges.iter().map(|(a, b)| b - a).max().unwrap_or(0);
        let splits = if self.params.splits == 0 {
            auto_splits(seqs.len() * hkv, max_len, threads)
        } else {
            self.params.splits
        };
        let tasks: Vec<(usize, usize, usize)> = (0..seqs.len())
            .flat_map(|b| (0..hkv).flat_map(move |h| (0..splits).map(move |s| (b, h, s))))
            .collect();
        let tile = self.params.tile_tokens;
        let partials: Vec<Partial> = tasks
            .par_iter()
            .map(|&(b, h, s)| {
                let (lo, hi) = ranges[b];
                let len = hi - lo;
                let a = lo + len * s / splits;
                let z = lo + len * (s + 1) / splits;
                let qg = &qr[b * per + h * group * d..][..group * d];
                split_attention(&views[b], h, qg, group, d, a, z, tile)
            })
            .collect();
        let mut out = vec![0f32; seqs.len() * hq * d];
        for b in 0..seqs.len() {
            for h in 0..hkv {
                let parts = &partials[(b * hkv + h) * splits..][..splits];
                for g in 0..group {
                    let m = parts.iter().map(|p| p.m[g]).fold(f32::NEG_INFINITY, f32::max);
                    if m == f32::NEG_INFINITY {
                        continue; // nothing attended: output stays zero
                    }
                    let o = &mut out[(b * hq + h * group + g) * d..][..d];
                    let mut l = 0f32;
                    for p in parts {
                        if p.m[g] == f32::NEG_INFINITY {
                            continue;
                        }
                        let w = (p.m[g] - m).exp();
                        l += w * p.l[g];
                        for (x, a) in o.iter_mut().zip(&p.acc[g * d..(g + 1) * d]) {
                            *x += w * a;
                        }
                    }
                    for x in o.iter_mut() {
                        *x /= l;
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Online-softmax attention of `group` query heads (already scaled) over
/// tokens `a..z` of KV head `h`.
#[allow(clippy::too_many_arguments)]
fn split_attention(view: &SeqView, h: usize, q: &[f32], group: usize, d: usize, a: usize, z: usize, tile: usize) -> Partial {
    let mut m = vec![f32::NEG_INFINITY; group];
    let mut l = vec![0f32; group];
    let mut acc = vec![0f32; group * d];
    let mut krow = vec![0f32; d];
    let mut vrows = vec![0f32; tile * d];
    let mut scores = vec![0f32; tile * group];
    let mut t0 = a;
    while t0 < z {
        let n = tile.min(z - t0);
        for i in 0..n {
            view.row(Tensor::Key, t0 + i, h, &mut krow);
            for g in 0..group {
                let qg = &q[g * d..(g + 1) * d];
                scores[i * group + g] = qg.iter().zip(&krow).map(|(x, y)| x * y).sum();
            }
            view.row(Tensor::Value, t0 + i, h, &mut vrows[i * d..(i + 1) * d]);
        }
        for g in 0..group {
            let tm = (0..n).map(|i| scores[i * group + g]).fold(f32::NEG_INFINITY, f32::max);
            let new_m = m[g].max(tm);
            let corr = (m[g] - new_m).exp();
            l[g] *= corr;
            let ag = &mut acc[g * d..(g + 1) * d];
            if corr != 1.0 {
                for x in ag.iter_mut() {
                    *x *= corr;
                }
            }
            for i in 0..n {
                let p = (scores[i * group + g] - new_m).exp();
                l[g] += p;
                for (x, v) in ag.iter_mut().zip(&vrows[i * d..(i + 1) * d]) {
                    *x += p * v;
                }
            }
            m[g] = new_m;
        }
        t0 += n;
    }
    Partial { m, l, acc }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn decode(&self, cache: &PagedCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        if self.params.threads > 0 {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(self.params.threads)
                .build()
                .map_err(|e| Error::Config(format!("cannot start {} threads: {e}", self.params.threads)))?;
            pool.install(|| self.run(cache, seqs, q, attn))
        } else {
            self.run(cache, seqs, q, attn)
        }
    }
}
