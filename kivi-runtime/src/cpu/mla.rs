//! MLA decode on the CPU, over an [`MlaCache`], in the absorbed form.
//!
//! All query heads share one latent row per token, so this is MQA with
//! different widths for scoring (`latent + rope_dim`) and for the output
//! (`latent`): each task decodes a tile of latent and RoPE rows once and
//! serves every query head from it (16 heads on DeepSeek-V2-Lite), with an
//! online softmax per head. Work is split over (sequence, span of tokens)
//! with rayon and the spans merged flash-decoding style.
//!
//! Rows are decoded with per-channel scale and zero arrays (read once per
//! channel group for channel-axis codes, once per token for token-axis
//! codes), `code * s + z` in f32 as the oracle does; Lloyd–Max levels and
//! `full` parts go through the cache's own row decoder. The latent/RoPE
//! layout does not fit the paged cache's fused kernels (one tensor read as
//! key and value, a second key part of another width), so this path does
//! not reuse them; it is checked against [`crate::mla::reference`].

use crate::cache::{params_at, SeqId};
use crate::error::{Error, Result};
use crate::mla::cache::decode_row;
use crate::mla::{MlaCache, Part};
use crate::quant::round_to_dtype;
use crate::reference::AttnParams;
use kivi_spec::layout::TensorLayout;
use kivi_spec::{Axis, Codec, Levels};
use rayon::prelude::*;

/// Tokens per task (a span of one sequence).
const SPAN: usize = 256;
/// Tokens decoded and scored together inside a span.
const TILE: usize = 16;

/// Absorbed MLA decode attention for a batch: one query per sequence.
///
/// `q` is `[B, Hq, L + R]` (per head: the absorbed latent query, then the
/// RoPE query); returns `[B, Hq, L]`. Matches
/// [`crate::mla::reference::attend`] on the same tokens.
///
/// ```
/// use kivi_runtime::{cpu::mla, mla::{MlaCache, MlaConfig, reference}};
/// let s = kivi_spec::parse_scheme("M { key: quant(bits = 4, axis = token, group = 32),
///     heads: mla(q = 4, latent = 64, rope_dim = 16) }").unwrap();
/// let mut cache = MlaCache::new(s.clone(), MlaConfig { block_tokens: None, max_blocks: 4 }).unwrap();
/// let id = cache.add_sequence();
/// let c: Vec<f32> = (0..5 * 64).map(|i| (i % 7) as f32 * 0.1).collect();
/// let k: Vec<f32> = (0..5 * 16).map(|i| (i % 3) as f32 * 0.2).collect();
/// cache.extend(id, &c, &k).unwrap();
/// let q: Vec<f32> = (0..4 * 80).map(|i| (i % 5) as f32 * 0.05).collect();
/// let p = reference::attn_params(&s).unwrap();
/// let out = mla::decode(&cache, &[id], &q, p).unwrap();
/// let want = reference::attend(&s, &q, &c, &k, p).unwrap();
/// assert!(out.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-4));
/// ```
pub fn decode(cache: &MlaCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
    let m = cache.parts().mla;
    let (hq, l, r) = (m.q as usize, m.latent as usize, m.rope_dim as usize);
    let w = l + r;
    if q.len() != seqs.len() * hq * w {
        return Err(Error::Shape {
            what: "query length",
            expected: format!("{} (batch x q_heads x (latent + rope_dim))", seqs.len() * hq * w),
            got: q.len().to_string(),
        });
    }
    let dtype = cache.scheme().dtype;
    // Round the queries like the oracle, then fold the softmax scale in.
    let mut qs = Vec::with_capacity(q.len());
    for (i, &x) in q.iter().enumerate() {
        let v = round_to_dtype(x, dtype);
        if !v.is_finite() {
            return Err(Error::NonFinite {
                tensor: "query",
                value: x,
                token: i / (hq * w),
                head: (i / w) % hq,
                channel: i % w,
                policy: "reject",
            });
        }
        qs.push(v * attn.softmax_scale);
    }
    let mut tasks = Vec::new();
    for (b, &id) in seqs.iter().enumerate() {
        let t = cache.len(id).map_err(|e| Error::InSequence {
            seq: b,
            source: Box::new(e),
        })?;
        let start = attn.window.map_or(0, |win| t.saturating_sub(win));
        let mut s = start;
        while s < t {
            let e = (s + SPAN).min(t);
            tasks.push((b, id, s, e));
            s = e;
        }
    }
    let partials: Vec<Result<(usize, Partial)>> = tasks
        .par_iter()
        .map(|&(b, id, s, e)| span(cache, id, &qs[b * hq * w..(b + 1) * hq * w], s, e).map(|p| (b, p)))
        .collect();
    let mut merged: Vec<Option<Partial>> = (0..seqs.len()).map(|_| None).collect();
    for p in partials {
        let (b, p) = p?;
        merged[b] = Some(match merged[b].take() {
            None => p,
            Some(a) => a.merge(p, l),
        });
    }
    let mut out = vec![0f32; seqs.len() * hq * l];
    for (b, p) in merged.into_iter().enumerate() {
        let Some(p) = p else { continue }; // no tokens: zero output
        for h in 0..hq {
            let inv = 1.0 / p.sum[h];
            for (o, a) in out[(b * hq + h) * l..][..l].iter_mut().zip(&p.acc[h * l..(h + 1) * l]) {
                *o = a * inv;
            }
        }
    }
    Ok(out)
}

/// Online-softmax state of every head over a span: running max, sum of
/// weights, and the weighted sum of latent rows.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

impl Partial {
    fn merge(self, o: Partial, l: usize) -> Partial {
        let mut out = self;
        for h in 0..out.max.len() {
            let m = out.max[h].max(o.max[h]);
            let (a, b) = ((out.max[h] - m).exp(), (o.max[h] - m).exp());
            out.sum[h] = out.sum[h] * a + o.sum[h] * b;
            for (x, y) in out.acc[h * l..(h + 1) * l].iter_mut().zip(&o.acc[h * l..(h + 1) * l]) {
                *x = *x * a + *y * b;
            }
            out.max[h] = m;
        }
        out
    }
}

/// Attention of all heads over tokens `s..e` of one sequence.
fn span(cache: &MlaCache, id: SeqId, q: &[f32], s: usize, e: usize) -> Result<Partial> {
    let m = cache.parts().mla;
    let (hq, l, r) = (m.q as usize, m.latent as usize, m.rope_dim as usize);
    let w = l + r;
    let mut lat = RowReader::new(cache, id, Part::Latent)?;
    let mut rope = RowReader::new(cache, id, Part::Rope)?;
    let mut p = Partial {
        max: vec![f32::NEG_INFINITY; hq],
        sum: vec![0.0; hq],
        acc: vec![0.0; hq * l],
    };
    let mut cs = vec![0f32; TILE * l];
    let mut ks = vec![0f32; TILE * r];
    let mut scores = [0f32; TILE];
    let mut t0 = s;
    while t0 < e {
        let n = (e - t0).min(TILE);
        for i in 0..n {
            lat.read(t0 + i, &mut cs[i * l..(i + 1) * l])?;
            rope.read(t0 + i, &mut ks[i * r..(i + 1) * r])?;
        }
        for h in 0..hq {
            let (ql, qr) = q[h * w..(h + 1) * w].split_at(l);
            for i in 0..n {
                scores[i] = dot(ql, &cs[i * l..(i + 1) * l]) + dot(qr, &ks[i * r..(i + 1) * r]);
            }
            let tile_max = scores[..n].iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let mx = p.max[h].max(tile_max);
            let keep = (p.max[h] - mx).exp();
            let acc = &mut p.acc[h * l..(h + 1) * l];
            if keep != 1.0 {
                acc.iter_mut().for_each(|a| *a *= keep);
            }
            p.sum[h] *= keep;
            for i in 0..n {
                let wgt = (scores[i] - mx).exp();
                p.sum[h] += wgt;
                for (a, c) in acc.iter_mut().zip(&cs[i * l..(i + 1) * l]) {
                    *a += wgt * c;
                }
            }
            p.max[h] = mx;
        }
        t0 += n;
    }
    Ok(p)
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums: lets the compiler vectorise without reordering
    // into one serial chain.
    let mut acc = [0f32; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        s += x * y;
    }
    s
}

/// Decodes rows of one part of one sequence, keeping the per-channel
/// parameters of the last channel group it read.
struct RowReader<'a> {
    cache: &'a MlaCache,
    id: SeqId,
    part: Part,
    tl: TensorLayout,
    table: &'a [u32],
    sinks: usize,
    stored: usize,
    /// (block, group) whose parameters `scale`/`zero` hold.
    held: Option<(u32, usize)>,
    scale: Vec<f32>,
    zero: Vec<f32>,
}

impl<'a> RowReader<'a> {
    fn new(cache: &'a MlaCache, id: SeqId, part: Part) -> Result<Self> {
        let (sinks, stored, _) = cache.regions_of(id, part)?;
        let tl = match part {
            Part::Latent => cache.layout().latent,
            Part::Rope => cache.layout().rope,
        };
        let d = cache.dim(part);
        Ok(RowReader {
            cache,
            id,
            part,
            tl,
            table: cache.block_table(id)?,
            sinks,
            stored,
            held: None,
            scale: vec![0.0; d],
            zero: vec![0.0; d],
        })
    }

    fn read(&mut self, p: usize, out: &mut [f32]) -> Result<()> {
        if p < self.sinks || p - self.sinks >= self.stored {
            return self.cache.row(self.id, self.part, p, out);
        }
        let j = p - self.sinks;
        let bt = self.tl.block_tokens;
        let block = self.table[j / bt];
        let slot = j % bt;
        let words = self.cache.block_part(block, self.part);
        let q = match self.tl.codec {
            Codec::Quant(q) if q.levels == Levels::Uniform => q,
            _ => {
                decode_row(&self.tl, words, slot, out);
                return Ok(());
            }
        };
        let d = out.len();
        let g = q.group as usize;
        let key = match q.axis {
            Axis::Channel => Some((block, slot / g)),
            Axis::Token => None,
        };
        if key.is_none() || self.held != key {
            for c in 0..d {
                let gp = params_at(&self.tl, words, &q, slot, c);
                self.scale[c] = gp.scale;
                self.zero[c] = gp.zero;
            }
            self.held = key;
        }
        let row = &words[self.tl.codes_offset + slot * self.tl.words_per_token..][..self.tl.words_per_token];
        let per = (32 / q.bits) as usize;
        let mask = q.max_code();
        for (wi, &word) in row.iter().enumerate() {
            let c0 = wi * per;
            for k in 0..per.min(d.saturating_sub(c0)) {
                let c = c0 + k;
                let code = (word >> (k as u32 * q.bits)) & mask;
                out[c] = code as f32 * self.scale[c] + self.zero[c];
            }
        }
        Ok(())
    }
}
