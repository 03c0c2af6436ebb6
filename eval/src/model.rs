//! Gemma 3 (text) forward pass on candle's quantized GGUF tensors, written
//! for this project so that the KV cache is ours.
//!
//! Two entry points share every weight and every step except attention:
//! - [`Gemma3::forward`]: the plain full-sequence forward (causal mask, sliding
//!   window in the mask, K/V never leave the function except as a capture).
//!   It is the reference the cached path is checked against, and it fills the
//!   prefix of a cache.
//! - [`Gemma3::step`]: one decode step for a batch of sequences at the same
//!   position; each layer hands its new K/V row and its query to a
//!   [`KvCache`], which stores them (quantized, per its scheme) and returns
//!   the attention output.
//!
//! The architecture, from the GGUF metadata (`gemma3.*`) and Gemma 3's
//! published design, checked against this file:
//! - `x = embed(tokens) * sqrt(hidden)`;
//! - per layer: `h = norm(x)`; `q, k, v = h Wq, h Wk, h Wv`; per-head RMS norm
//!   of q and k *before* RoPE (rotate-half); attention with scale 1/16
//!   (`query_pre_attn_scalar = 256`); `x += post_attn_norm(attn Wo)`;
//!   `x += post_ffw_norm(down(gelu_tanh(gate(norm(x))) * up(norm(x))))`;
//! - local layers: sliding window 512, RoPE base 10 000; global layers
//!   (every 6th: 5, 11, 17): full attention, RoPE base 1 000 000
//!   (`gemma3.rope.freq_base`);
//! - logits = `norm(x) E^T` with the embedding matrix (tied), no soft-capping.
//!
//! RMS norm: Gemma's norm multiplies by `(1 + w)`; llama.cpp's converter
//! stores `1 + w` in the GGUF (the file's norm weights bottom out at exactly
//! 0.0, the image of a -1 raw weight), so here the stored weight multiplies
//! directly. (Adding 1 again was tried once: perplexity 8e8 instead of 16
//! on the GPL text; see docs/accuracy.md.)

use crate::error::{Error, Result};
use crate::tokenizer::Tokenizer;
use candle_core::quantized::{gguf_file, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::path::Path;
use std::sync::Arc;

/// Shapes and constants of the loaded model.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Config {
    pub hidden: usize,
    pub layers: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub eps: f32,
    pub sliding_window: usize,
    pub rope_local: f32,
    pub rope_global: f32,
    /// Layers with full (global) attention.
    pub global_layers: Vec<usize>,
    /// Attention scale, `query_pre_attn_scalar^-1/2`.
    pub softmax_scale: f32,
    /// Positions the RoPE tables cover.
    pub max_positions: usize,
}

impl Config {
    /// The sliding window of a layer (`None` for global layers).
    pub fn window(&self, layer: usize) -> Option<usize> {
        (!self.global_layers.contains(&layer)).then_some(self.sliding_window)
    }
}

/// The tied output head: a Q8_0 embedding with f32 activations (our
/// kernel, exact to the stored weights), or candle's matmul (other
/// embedding types, or [`Weights::Quantized`]).
enum Head {
    Q8(crate::head::Q8Matrix),
    Candle(QMatMul),
}

struct Layer {
    q: QMatMul,
    k: QMatMul,
    v: QMatMul,
    o: QMatMul,
    gate: QMatMul,
    up: QMatMul,
    down: QMatMul,
    q_norm: Tensor,
    k_norm: Tensor,
    attn_norm: Tensor,
    post_attn_norm: Tensor,
    ffn_norm: Tensor,
    post_ffn_norm: Tensor,
    /// `cos`/`sin` tables `[max_positions, head_dim / 2]` for this layer's base.
    cos: Tensor,
    sin: Tensor,
}

/// The model: weights on the CPU, quantized as stored.
pub struct Gemma3 {
    cfg: Config,
    embed: Arc<QTensor>,
    lm_head: Head,
    layers: Vec<Layer>,
    final_norm: Tensor,
    embed_scale: f64,
    dev: Device,
}

/// How matmul weights are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum Weights {
    /// Dequantized to f32 at load, f32 GEMM (default: fast on any x86-64
    /// with AVX2, and exact to the stored weights).
    F32,
    /// As stored (Q4_K, Q5_0, Q6_K, Q8_0), candle's quantized matmul
    /// (activations rounded to 8 bits, as llama.cpp does).
    Quantized,
}

/// Which logits [`Gemma3::forward`] computes (the 262k-row head is most of
/// the cost of a token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    All,
    Last,
    None,
}

/// Per-layer tensors captured by [`Gemma3::forward`], row-major f32:
/// `q` is `[T, Hq, D]` (after norm and RoPE, before scaling), `k` is
/// `[T, Hkv, D]` (after norm and RoPE), `v` is `[T, Hkv, D]`.
#[derive(Clone, Debug, Default)]
pub struct Capture {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

/// Output of [`Gemma3::forward`].
pub struct Forward {
    /// `[rows, vocab]` as asked by [`Logits`].
    pub logits: Option<Tensor>,
    /// One entry per layer.
    pub layers: Vec<Capture>,
}

/// Where a decode step keeps K/V and gets attention from.
pub trait KvCache {
    /// Appends a prefix (`k`, `v` `[T, Hkv, D]`) to `layer`.
    fn prefill(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()>;
    /// Appends one token (`k`, `v` `[Hkv, D]`) to `layer` and returns decode
    /// attention of `q` (`[Hq, D]`) over everything stored, `[Hq, D]`.
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32], window: Option<usize>) -> Result<Vec<f32>>;
}

fn meta_u32(c: &gguf_file::Content, key: &str) -> Result<usize> {
    let v = c
        .metadata
        .get(key)
        .ok_or_else(|| Error::Config(format!("the model file has no `{key}`")))?;
    Ok(v.to_u32().map_err(|e| Error::Config(format!("`{key}`: {e}")))? as usize)
}

fn meta_f32(c: &gguf_file::Content, key: &str) -> Result<f32> {
    let v = c
        .metadata
        .get(key)
        .ok_or_else(|| Error::Config(format!("the model file has no `{key}`")))?;
    v.to_f32().map_err(|e| Error::Config(format!("`{key}`: {e}")))
}

fn rope_tables(base: f32, head_dim: usize, positions: usize, dev: &Device) -> Result<(Tensor, Tensor)> {
    let half = head_dim / 2;
    let inv: Vec<f32> = (0..half)
        .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    let mut cos = Vec::with_capacity(positions * half);
    let mut sin = Vec::with_capacity(positions * half);
    for p in 0..positions {
        for f in &inv {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    Ok((
        Tensor::from_vec(cos, (positions, half), dev)?,
        Tensor::from_vec(sin, (positions, half), dev)?,
    ))
}

/// Gemma's RMS norm over the last dimension (the weight already holds `1 + w`).
fn norm(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
    Ok(candle_nn::ops::rms_norm(&x.contiguous()?, w, eps)?)
}

impl Gemma3 {
    /// Loads a Gemma 3 GGUF and its tokenizer. RoPE tables cover
    /// `max_positions` positions (a few thousand is plenty here; the stock
    /// 131 072 would cost gigabytes).
    pub fn load(path: &Path, max_positions: usize, mode: Weights) -> Result<(Gemma3, Tokenizer)> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        let mut r = std::io::BufReader::new(file);
        let bad = |e: candle_core::Error| Error::Model {
            path: path.display().to_string(),
            reason: e.to_string(),
        };
        let c = gguf_file::Content::read(&mut r).map_err(bad)?;
        let arch = c
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if arch != "gemma3" {
            return Err(Error::Model {
                path: path.display().to_string(),
                reason: format!("architecture `{arch}`, expected `gemma3`"),
            });
        }
        let tok = Tokenizer::from_gguf(&c)?;
        let q_heads = meta_u32(&c, "gemma3.attention.head_count")?;
        let head_dim = meta_u32(&c, "gemma3.attention.key_length")?;
        let layers = meta_u32(&c, "gemma3.block_count")?;
        // Gemma 3 alternates five local layers with one global one; newer
        // converters store the period, older ones (like this file) do not.
        let period = meta_u32(&c, "gemma3.attention.sliding_window_pattern").unwrap_or(6);
        if period == 0 {
            return Err(Error::Config("sliding_window_pattern is 0".into()));
        }
        let cfg = Config {
            hidden: meta_u32(&c, "gemma3.embedding_length")?,
            layers,
            q_heads,
            kv_heads: meta_u32(&c, "gemma3.attention.head_count_kv")?,
            head_dim,
            ffn: meta_u32(&c, "gemma3.feed_forward_length")?,
            vocab: tok.vocab_size(),
            eps: meta_f32(&c, "gemma3.attention.layer_norm_rms_epsilon")?,
            sliding_window: meta_u32(&c, "gemma3.attention.sliding_window")?,
            rope_local: 10_000.0,
            rope_global: meta_f32(&c, "gemma3.rope.freq_base")?,
            global_layers: (0..layers).filter(|i| (i + 1) % period == 0).collect(),
            softmax_scale: 1.0 / (head_dim as f32).sqrt(),
            max_positions,
        };
        if cfg.kv_heads == 0 || !cfg.q_heads.is_multiple_of(cfg.kv_heads) || !cfg.head_dim.is_multiple_of(2) {
            return Err(Error::Config(format!(
                "unsupported head layout: {} query heads, {} kv heads, head_dim {}",
                cfg.q_heads, cfg.kv_heads, cfg.head_dim
            )));
        }
        let v_len = meta_u32(&c, "gemma3.attention.value_length")?;
        if v_len != head_dim {
            return Err(Error::Config(format!("key_length {head_dim} != value_length {v_len}")));
        }
        let dev = Device::Cpu;
        let mut get = |name: &str| -> Result<QTensor> { c.tensor(&mut r, name, &dev).map_err(bad) };
        let embed = Arc::new(get("token_embd.weight")?);
        let (rows, cols) = embed.shape().dims2()?;
        if rows != cfg.vocab || cols != cfg.hidden {
            return Err(Error::Config(format!(
                "token_embd is {rows}x{cols}, expected {}x{}",
                cfg.vocab, cfg.hidden
            )));
        }
        let (lc, ls) = rope_tables(cfg.rope_local, head_dim, max_positions, &dev)?;
        let (gc, gs) = rope_tables(cfg.rope_global, head_dim, max_positions, &dev)?;
        // Matmul weights: dequantized once to f32 (exact: the stored values)
        // and multiplied with candle's f32 GEMM, which picks AVX2/FMA at run
        // time. candle's quantized kernels have no AVX2 path for Q5_0 (the
        // q/k/gate/up weights here) unless built with target-cpu=native, and
        // they round activations to 8 bits; this is faster and closer to the
        // weights as stored. ~1.1 GB of f32 for the 270M model.
        let matmul = |t: QTensor| -> Result<QMatMul> {
            Ok(match mode {
                Weights::F32 => QMatMul::Tensor(t.dequantize(&Device::Cpu)?),
                Weights::Quantized => QMatMul::from_qtensor(t)?,
            })
        };
        let mut ls_ = Vec::with_capacity(layers);
        for i in 0..layers {
            let mut mm = |n: &str| -> Result<QMatMul> { matmul(get(&format!("blk.{i}.{n}.weight"))?) };
            let (q, k, v, o) = (mm("attn_q")?, mm("attn_k")?, mm("attn_v")?, mm("attn_output")?);
            let (gate, up, down) = (mm("ffn_gate")?, mm("ffn_up")?, mm("ffn_down")?);
            let mut w = |n: &str| -> Result<Tensor> { Ok(get(&format!("blk.{i}.{n}.weight"))?.dequantize(&dev)?) };
            let global = cfg.global_layers.contains(&i);
            ls_.push(Layer {
                q,
                k,
                v,
                o,
                gate,
                up,
                down,
                q_norm: w("attn_q_norm")?,
                k_norm: w("attn_k_norm")?,
                attn_norm: w("attn_norm")?,
                post_attn_norm: w("post_attention_norm")?,
                ffn_norm: w("ffn_norm")?,
                post_ffn_norm: w("post_ffw_norm")?,
                cos: if global { gc.clone() } else { lc.clone() },
                sin: if global { gs.clone() } else { ls.clone() },
            });
        }
        let final_norm = get("output_norm.weight")?.dequantize(&dev)?;
        let q8 = match (mode, embed.dtype()) {
            (Weights::F32, candle_core::quantized::GgmlDType::Q8_0) => {
                crate::head::Q8Matrix::from_blocks(&embed.data()?, cfg.vocab, cfg.hidden)
            }
            _ => None,
        };
        let lm_head = match q8 {
            Some(m) => Head::Q8(m),
            None => Head::Candle(match mode {
                Weights::F32 => QMatMul::Tensor(embed.dequantize(&dev)?),
                Weights::Quantized => QMatMul::from_arc(embed.clone())?,
            }),
        };
        let embed_scale = (cfg.hidden as f64).sqrt();
        Ok((
            Gemma3 {
                cfg,
                embed,
                lm_head,
                layers: ls_,
                final_norm,
                embed_scale,
                dev,
            },
            tok,
        ))
    }

    /// The model's shapes and constants.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Overrides the local layers' sliding window. For tests: a short window
    /// exercises the window logic of both paths on short texts.
    pub fn with_sliding_window(mut self, window: usize) -> Gemma3 {
        self.cfg.sliding_window = window.max(1);
        self
    }

    fn check_tokens(&self, tokens: &[u32], last_pos: usize) -> Result<()> {
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab) {
            return Err(Error::Config(format!(
                "token id {t} is outside the vocabulary of {}",
                self.cfg.vocab
            )));
        }
        if last_pos >= self.cfg.max_positions {
            return Err(Error::Config(format!(
                "position {last_pos} is beyond the {} positions the model was loaded for",
                self.cfg.max_positions
            )));
        }
        Ok(())
    }

    /// Norm, projections, q/k norm and RoPE for `rows` tokens at positions
    /// `pos0..pos0+rows` (`per_row_pos`: every row at `pos0`, for a batch of
    /// sequences). Returns `q [rows, Hq, D]`, `k`, `v` `[rows, Hkv, D]`.
    fn qkv(&self, l: &Layer, x: &Tensor, pos0: usize, same_pos: bool) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.cfg;
        let rows = x.dim(0)?;
        let h = norm(x, &l.attn_norm, c.eps)?;
        let q = l.q.forward(&h)?.reshape((rows, c.q_heads, c.head_dim))?;
        let k = l.k.forward(&h)?.reshape((rows, c.kv_heads, c.head_dim))?;
        let v = l.v.forward(&h)?.reshape((rows, c.kv_heads, c.head_dim))?;
        let q = norm(&q, &l.q_norm, c.eps)?;
        let k = norm(&k, &l.k_norm, c.eps)?;
        // candle's rope wants [batch, heads, seq, D] and cos/sin [seq, D/2].
        let (q, k) = if same_pos {
            let cos = l.cos.narrow(0, pos0, 1)?;
            let sin = l.sin.narrow(0, pos0, 1)?;
            let q = candle_nn::rotary_emb::rope(&q.unsqueeze(2)?, &cos, &sin)?.squeeze(2)?;
            let k = candle_nn::rotary_emb::rope(&k.unsqueeze(2)?, &cos, &sin)?.squeeze(2)?;
            (q, k)
        } else {
            let cos = l.cos.narrow(0, pos0, rows)?;
            let sin = l.sin.narrow(0, pos0, rows)?;
            let rot = |t: &Tensor| -> Result<Tensor> {
                let t = t.transpose(0, 1)?.unsqueeze(0)?.contiguous()?;
                Ok(candle_nn::rotary_emb::rope(&t, &cos, &sin)?
                    .squeeze(0)?
                    .transpose(0, 1)?
                    .contiguous()?)
            };
            (rot(&q)?, rot(&k)?)
        };
        Ok((q, k, v.contiguous()?))
    }

    /// Output projection, post-attention norm, residual, MLP block.
    fn finish_layer(&self, l: &Layer, x: &Tensor, attn: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let a = norm(&l.o.forward(attn)?, &l.post_attn_norm, c.eps)?;
        let x = (x + a)?;
        let h = norm(&x, &l.ffn_norm, c.eps)?;
        let m = (l.gate.forward(&h)?.gelu()? * l.up.forward(&h)?)?;
        let m = norm(&l.down.forward(&m)?, &l.post_ffn_norm, c.eps)?;
        Ok((x + m)?)
    }

    fn embed(&self, tokens: &[u32]) -> Result<Tensor> {
        let ids = Tensor::new(tokens, &self.dev)?;
        Ok((self.embed.embedding(&ids)? * self.embed_scale)?)
    }

    fn head(&self, x: &Tensor) -> Result<Tensor> {
        let x = norm(x, &self.final_norm, self.cfg.eps)?;
        match &self.lm_head {
            Head::Candle(m) => Ok(m.forward(&x)?),
            Head::Q8(w) => {
                let rows = x.dim(0)?;
                let xs: Vec<f32> = x.flatten_all()?.to_vec1()?;
                let l = crate::head::logits(w, &xs, rows);
                Ok(Tensor::from_vec(l, (rows, self.cfg.vocab), &self.dev)?)
            }
        }
    }

    /// The plain forward over `tokens` at positions `0..T`: full causal
    /// attention with each layer's sliding window, no cache. `capture`
    /// returns every layer's q/k/v.
    pub fn forward(&self, tokens: &[u32], logits: Logits, capture: bool) -> Result<Forward> {
        let c = &self.cfg;
        let t = tokens.len();
        if t == 0 {
            return Err(Error::Config("no tokens to run".into()));
        }
        self.check_tokens(tokens, t - 1)?;
        let group = c.q_heads / c.kv_heads;
        let mut x = self.embed(tokens)?;
        let mut caps = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            let (q, k, v) = self.qkv(l, &x, 0, false)?;
            if capture {
                caps.push(Capture {
                    q: q.flatten_all()?.to_vec1()?,
                    k: k.flatten_all()?.to_vec1()?,
                    v: v.flatten_all()?.to_vec1()?,
                });
            }
            // [Hkv, group * T, D] x [Hkv, D, T]: one matmul per KV head
            // serves its whole group of query heads.
            let qg = q
                .reshape((t, c.kv_heads, group, c.head_dim))?
                .permute((1, 2, 0, 3))?
                .reshape((c.kv_heads, group * t, c.head_dim))?
                .contiguous()?;
            let kt = k.permute((1, 2, 0))?.contiguous()?;
            let vt = v.transpose(0, 1)?.contiguous()?;
            let scores = (qg.matmul(&kt)? * c.softmax_scale as f64)?;
            let mask = causal_mask(t, c.window(i), &self.dev)?;
            let scores = scores
                .reshape((c.kv_heads, group, t, t))?
                .broadcast_add(&mask)?
                .reshape((c.kv_heads, group * t, t))?;
            let p = candle_nn::ops::softmax_last_dim(&scores)?;
            let o = p
                .matmul(&vt)?
                .reshape((c.kv_heads, group, t, c.head_dim))?
                .permute((2, 0, 1, 3))?
                .reshape((t, c.q_heads * c.head_dim))?
                .contiguous()?;
            x = self.finish_layer(l, &x, &o)?;
        }
        let logits = match logits {
            Logits::All => Some(self.head(&x)?),
            Logits::Last => Some(self.head(&x.narrow(0, t - 1, 1)?)?),
            Logits::None => None,
        };
        Ok(Forward { logits, layers: caps })
    }

    /// One decode step for `tokens.len()` sequences, all at position `pos`:
    /// sequence `b` reads and extends `caches[b]`. Returns logits
    /// `[B, vocab]`.
    pub fn step(&self, tokens: &[u32], pos: usize, caches: &mut [&mut dyn KvCache]) -> Result<Tensor> {
        let c = &self.cfg;
        let b = tokens.len();
        if b == 0 || caches.len() != b {
            return Err(Error::Config(format!("{b} tokens for {} caches", caches.len())));
        }
        self.check_tokens(tokens, pos)?;
        let (qn, kn) = (c.q_heads * c.head_dim, c.kv_heads * c.head_dim);
        let mut x = self.embed(tokens)?;
        for (i, l) in self.layers.iter().enumerate() {
            let (q, k, v) = self.qkv(l, &x, pos, true)?;
            let q: Vec<f32> = q.flatten_all()?.to_vec1()?;
            let k: Vec<f32> = k.flatten_all()?.to_vec1()?;
            let v: Vec<f32> = v.flatten_all()?.to_vec1()?;
            let mut out = Vec::with_capacity(b * qn);
            for (s, cache) in caches.iter_mut().enumerate() {
                let o = cache.attend(
                    i,
                    &q[s * qn..(s + 1) * qn],
                    &k[s * kn..(s + 1) * kn],
                    &v[s * kn..(s + 1) * kn],
                    c.window(i),
                )?;
                if o.len() != qn {
                    return Err(Error::Config(format!(
                        "attention returned {} values, expected {qn}",
                        o.len()
                    )));
                }
                out.extend(o);
            }
            let o = Tensor::from_vec(out, (b, qn), &self.dev)?;
            x = self.finish_layer(l, &x, &o)?;
        }
        self.head(&x)
    }
}

/// `[T, T]` additive mask: 0 where query `i` may see key `j` (`j <= i` and,
/// with a window `W`, `i - j < W`), minus infinity elsewhere.
fn causal_mask(t: usize, window: Option<usize>, dev: &Device) -> Result<Tensor> {
    let w = window.unwrap_or(usize::MAX);
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i && i - j < w { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Ok(Tensor::from_vec(m, (t, t), dev)?.to_dtype(DType::F32)?)
}

/// Log-softmax of each row of `logits` (`[B, V]`), in f64 for the metrics.
pub fn log_softmax_rows(logits: &Tensor) -> Result<Vec<Vec<f64>>> {
    let rows: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_vec2()?;
    Ok(rows
        .into_iter()
        .map(|r| {
            let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = m + r.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
            r.iter().map(|&x| x as f64 - lse).collect()
        })
        .collect())
}
