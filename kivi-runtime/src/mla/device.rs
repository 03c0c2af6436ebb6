//! MLA decode on a [`Device`]: the generated `kivi_mla_decode` kernel
//! (`templates/cuda/kivi_mla_decode.cuh`) over an [`MlaCache`]'s pool, on a
//! GPU or on the simulated device (the generated CUDA compiled as C++).
//!
//! The host uploads the pool and block tables as the cache holds them, each
//! part's sink and window rows in the activation dtype (per sequence: sinks,
//! then window), per-sequence counts, and the queries rounded to the
//! activation dtype; the kernel decodes stored rows from the blocks itself.

use super::cache::{MlaCache, Part};
use crate::cache::SeqId;
use crate::device::{download, upload, Buffer, Device, KernelArg, Module};
use crate::error::{Error, Result};
use crate::quant::{round_to_dtype, to_bits_16};
use crate::reference::AttnParams;
use kivi_spec::{scheme_hash, Dtype, Scheme};
use kivi_templates::{generate_mla_decode, mla_variants, Generated, MlaVariant, MLA_ENTRY};
use std::sync::Arc;

/// The MLA decode kernel of one scheme and variant, loaded on a device.
///
/// ```
/// use kivi_runtime::device::SimDevice;
/// use kivi_runtime::mla::{device::MlaDeviceDecode, reference, MlaCache, MlaConfig};
/// # if kivi_runtime::sim::find_compiler().is_err() { return; }
/// let s = kivi_spec::parse_scheme("M { key: quant(bits = 4, axis = token, group = 32),
///     heads: mla(q = 2, latent = 64, rope_dim = 16) }").unwrap();
/// let mut cache = MlaCache::new(s.clone(), MlaConfig { block_tokens: None, max_blocks: 2 }).unwrap();
/// let id = cache.add_sequence();
/// let c: Vec<f32> = (0..9 * 64).map(|i| (i % 7) as f32 * 0.1).collect();
/// let k: Vec<f32> = (0..9 * 16).map(|i| (i % 3) as f32 * 0.2).collect();
/// cache.extend(id, &c, &k).unwrap();
/// let q: Vec<f32> = (0..2 * 80).map(|i| (i % 5) as f32 * 0.05).collect();
/// let p = reference::attn_params(&s).unwrap();
/// let dev = MlaDeviceDecode::new(SimDevice::shared(), &s, None).unwrap();
/// let out = dev.decode(&cache, &[id], &q, p).unwrap();
/// let want = reference::attend(&s, &q, &c, &k, p).unwrap();
/// assert!(out.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-4));
/// ```
pub struct MlaDeviceDecode {
    dev: Arc<dyn Device>,
    module: Arc<Module>,
    scheme: Scheme,
    variant: MlaVariant,
}

impl MlaDeviceDecode {
    /// Generates and loads the decode kernel of `scheme` for `variant`
    /// (default: the canonical one, the first of [`mla_variants`]).
    pub fn new(dev: Arc<dyn Device>, scheme: &Scheme, variant: Option<&MlaVariant>) -> Result<Self> {
        let g = Self::generate(scheme, variant)?;
        let module = dev.load(&g)?;
        let variant = *variant.unwrap_or(&mla_variants(scheme)[0]);
        Ok(MlaDeviceDecode {
            dev,
            module,
            scheme: scheme.clone(),
            variant,
        })
    }

    /// Several variants at once, compiled together (the simulator builds
    /// them into one library): what a tuner sweeps.
    pub fn new_many(dev: Arc<dyn Device>, scheme: &Scheme, variants: &[MlaVariant]) -> Result<Vec<Self>> {
        let gens = variants
            .iter()
            .map(|v| Self::generate(scheme, Some(v)))
            .collect::<Result<Vec<_>>>()?;
        let modules = dev.load_many(&gens.iter().collect::<Vec<_>>())?;
        Ok(modules
            .into_iter()
            .zip(variants)
            .map(|(module, v)| MlaDeviceDecode {
                dev: dev.clone(),
                module,
                scheme: scheme.clone(),
                variant: *v,
            })
            .collect())
    }

    /// The generated source of `scheme`'s decode kernel for `variant`.
    pub fn generate(scheme: &Scheme, variant: Option<&MlaVariant>) -> Result<Generated> {
        let v = match variant {
            Some(v) => *v,
            None => *mla_variants(scheme).first().ok_or_else(|| {
                Error::Config(format!(
                    "scheme `{}` has no mla heads or no mla decode variant",
                    scheme.name
                ))
            })?,
        };
        generate_mla_decode(scheme, &v).map_err(|e| Error::Compile {
            backend: "mla",
            kernel: format!("{}/mla_decode/{}", scheme.name, v.name()),
            log: e.to_string(),
        })
    }

    pub fn variant(&self) -> MlaVariant {
        self.variant
    }

    pub fn generated(&self) -> &Generated {
        &self.module.generated
    }

    /// Absorbed decode attention for a batch (`q` `[B, Hq, L + R]`,
    /// returns `[B, Hq, L]`), the same contract as [`crate::cpu::mla::decode`].
    pub fn decode(&self, cache: &MlaCache, seqs: &[SeqId], q: &[f32], attn: AttnParams) -> Result<Vec<f32>> {
        if scheme_hash(cache.scheme()) != scheme_hash(&self.scheme)
            || cache.layout().block_tokens != self.module.generated.block_tokens
        {
            return Err(Error::Config(format!(
                "the cache holds `{}` with {}-token blocks; this kernel was generated for `{}` with {}-token blocks",
                cache.scheme().name,
                cache.layout().block_tokens,
                self.scheme.name,
                self.module.generated.block_tokens
            )));
        }
        let m = cache.parts().mla;
        let (hq, l, r) = (m.q as usize, m.latent as usize, m.rope_dim as usize);
        let w = l + r;
        let batch = seqs.len();
        if q.len() != batch * hq * w {
            return Err(Error::Shape {
                what: "query length",
                expected: format!("{} (batch x q_heads x (latent + rope_dim))", batch * hq * w),
                got: q.len().to_string(),
            });
        }
        if batch == 0 {
            return Ok(Vec::new());
        }
        if batch > 65535 {
            return Err(Error::Config(format!(
                "a batch of {batch} sequences exceeds the grid (65535)"
            )));
        }
        let dtype = cache.scheme().dtype;
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
            qs.push(v);
        }
        // Per sequence: length, table, and each part's sink/window rows.
        let mut lens = Vec::with_capacity(batch);
        let mut counts = Vec::with_capacity(batch * 4);
        let mut raw_rows = Vec::with_capacity(batch);
        let mut stride = 1usize;
        let mut raw_cap = 1usize;
        for (b, &id) in seqs.iter().enumerate() {
            let in_seq = |e: Error| Error::InSequence {
                seq: b,
                source: Box::new(e),
            };
            let t = cache.len(id).map_err(in_seq)?;
            lens.push(
                i32::try_from(t).map_err(|_| Error::Config(format!("{t} tokens exceed the kernel's i32 index")))?,
            );
            stride = stride.max(cache.block_table(id).map_err(in_seq)?.len());
            let mut per_part = Vec::with_capacity(2);
            for part in [Part::Latent, Part::Rope] {
                let (sinks, stored, window) = cache.regions_of(id, part).map_err(in_seq)?;
                counts.push(sinks as i32);
                counts.push(stored as i32);
                raw_cap = raw_cap.max(sinks + window);
                let raw: Vec<usize> = (0..sinks).chain(sinks + stored..sinks + stored + window).collect();
                per_part.push(raw);
            }
            raw_rows.push(per_part);
        }
        let mut tables = vec![0u32; batch * stride];
        for (b, &id) in seqs.iter().enumerate() {
            let t = cache.block_table(id)?;
            tables[b * stride..b * stride + t.len()].copy_from_slice(t);
        }
        let dev = &*self.dev;
        let raw_buf = |part: Part, pi: usize| -> Result<Buffer> {
            let d = cache.dim(part);
            let mut vals = vec![0f32; batch * raw_cap * d];
            for (b, &id) in seqs.iter().enumerate() {
                for (k, &p) in raw_rows[b][pi].iter().enumerate() {
                    cache.row(id, part, p, &mut vals[(b * raw_cap + k) * d..][..d])?;
                }
            }
            match dtype {
                Dtype::F32 => upload(dev, &vals),
                d16 => upload(dev, &vals.iter().map(|x| to_bits_16(*x, d16)).collect::<Vec<u16>>()),
            }
        };
        let pool = upload(dev, cache.pool())?;
        let tables = upload(dev, &tables)?;
        let lat_raw = raw_buf(Part::Latent, 0)?;
        let rope_raw = raw_buf(Part::Rope, 1)?;
        let lens = upload(dev, &lens)?;
        let counts = upload(dev, &counts)?;
        let qbuf = upload(dev, &qs)?;
        let mut out = dev.alloc(crate::device::Elem::F32, batch * hq * l)?;
        let window = match attn.window {
            None => -1,
            Some(win) => win.min(i32::MAX as usize) as i32,
        };
        let mut args = [
            KernelArg::In(&pool),
            KernelArg::In(&tables),
            KernelArg::I32(stride as i32),
            KernelArg::In(&lat_raw),
            KernelArg::In(&rope_raw),
            KernelArg::I32(raw_cap as i32),
            KernelArg::In(&lens),
            KernelArg::In(&counts),
            KernelArg::In(&qbuf),
            KernelArg::F32(attn.softmax_scale),
            KernelArg::I32(window),
            KernelArg::Out(&mut out),
        ];
        dev.launch(&self.module, MLA_ENTRY, [1, 1, batch as u32], &mut args)?;
        dev.sync()?;
        download(dev, &out)
    }
}

/// One candidate of [`tune`]: its error against the oracle on the tuning
/// inputs and, when it was correct, its timing.
#[derive(Clone, Debug, PartialEq)]
pub struct MlaCandidate {
    pub variant: MlaVariant,
    /// max |out - oracle| / max |oracle|.
    pub rel_err: f32,
    /// `None`: wrong (above [`TUNE_TOLERANCE`]), so never timed.
    pub timing: Option<crate::device::Timing>,
}

/// The error a candidate may have against the oracle and still be timed.
pub const TUNE_TOLERANCE: f32 = 1e-4;

/// Picks the fastest correct variant of the MLA decode kernel on `dev` for
/// these inputs. Every variant is first checked against the oracle
/// ([`super::reference::decode_attention`] on the cache's own rows); only a
/// correct one is timed (`warmup` + `iters` runs, median). Within 3 % of
/// the fastest, the canonical variant (the first of [`mla_variants`]) wins,
/// so the choice does not flip on noise.
pub fn tune(
    dev: Arc<dyn Device>,
    cache: &MlaCache,
    seqs: &[SeqId],
    q: &[f32],
    attn: AttnParams,
    warmup: usize,
    iters: usize,
) -> Result<(MlaVariant, Vec<MlaCandidate>)> {
    let s = cache.scheme().clone();
    let m = cache.parts().mla;
    let w = (m.latent + m.rope_dim) as usize * m.q as usize;
    if q.len() != seqs.len() * w {
        return Err(Error::Shape {
            what: "query length",
            expected: (seqs.len() * w).to_string(),
            got: q.len().to_string(),
        });
    }
    let mut want = Vec::new();
    for (b, &id) in seqs.iter().enumerate() {
        let (c, k) = (cache.dequantize(id, Part::Latent)?, cache.dequantize(id, Part::Rope)?);
        want.extend(super::reference::decode_attention(
            &s,
            &q[b * w..(b + 1) * w],
            &c,
            &k,
            attn,
        )?);
    }
    let den = want.iter().map(|x| x.abs()).fold(0f32, f32::max).max(1e-30);
    let variants = mla_variants(&s);
    let runs = MlaDeviceDecode::new_many(dev.clone(), &s, &variants)?;
    let mut out = Vec::with_capacity(runs.len());
    for run in &runs {
        let got = run.decode(cache, seqs, q, attn)?;
        let rel_err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / den;
        let timing = if rel_err <= TUNE_TOLERANCE {
            Some(dev.time(warmup, iters, true, &mut || {
                run.decode(cache, seqs, q, attn).map(|_| ())
            })?)
        } else {
            None
        };
        out.push(MlaCandidate {
            variant: run.variant(),
            rel_err,
            timing,
        });
    }
    let fastest = out
        .iter()
        .filter_map(|c| c.timing.as_ref().map(|t| (c.variant, t.median_ms)))
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .ok_or_else(|| Error::Config(format!("no mla decode variant of `{}` matched the oracle", s.name)))?;
    let canonical = out
        .first()
        .and_then(|c| c.timing.as_ref().map(|t| (c.variant, t.median_ms)));
    let pick = match canonical {
        Some((v, ms)) if ms <= fastest.1 * 1.03 => v,
        _ => fastest.0,
    };
    Ok((pick, out))
}
