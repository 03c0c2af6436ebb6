//! Gemma 3 (text) forward pass on candle's quantized GGUF tensors, written
//! for this project so that the KV cache is ours.
//!
//! Two entry points share every weight and every step except attention:
//! - [`Gemma3::forward`]: the plain full-sequence forward (causal mask, sliding
//!   window in the mask, K/V never leave the function except as a capture).
//!   It is the reference the cached path is checked against, and its capture
//!   can fill the prefix of a cache ([`Gemma3::fill_cache`]).
//! - [`Gemma3::forward_cached`] / [`Gemma3::step`]: the model on kivi's
//!   cache, through the candle integration ([`kivi_candle::KiviKvCache`],
//!   the same type an engine would use): each layer hands its queries and
//!   new K/V to [`kivi_candle::KiviKvCache::attend`], which stores them
//!   (quantized, per the layer's scheme) and returns the attention output.
//!   `forward_cached` takes any number of new tokens of one sequence (a
//!   prefill chunk or one decode token); `step` one token for each of a
//!   batch of sequences.
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
use kivi_candle::{KiviKvCache, ModelShape};
use kivi_spec::Scheme;
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
/// `[T, Hkv, D]` (after norm and RoPE), `v` is `[T, Hkv, D]`; `k_pre` is
/// `k` before RoPE (after norm), what a `rope: pre(...)` cache stores.
#[derive(Clone, Debug, Default)]
pub struct Capture {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub k_pre: Vec<f32>,
}

/// Output of [`Gemma3::forward`].
pub struct Forward {
    /// `[rows, vocab]` as asked by [`Logits`].
    pub logits: Option<Tensor>,
    /// One entry per layer.
    pub layers: Vec<Capture>,
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

    /// Norm, projections, q/k norm and RoPE for `rows` tokens; `cos`/`sin`
    /// are the RoPE table rows of their positions, `[rows, D / 2]`. Returns
    /// `q [1, Hq, rows, D]` and `k`, `v` `[1, Hkv, rows, D]`: candle's
    /// attention layout, the one [`KiviKvCache`] takes; last, `k` before
    /// RoPE (for `rope: pre(...)` caches).
    fn qkv(&self, l: &Layer, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let c = &self.cfg;
        let rows = x.dim(0)?;
        let h = norm(x, &l.attn_norm, c.eps)?;
        let heads = |t: Tensor, n: usize| -> Result<Tensor> {
            Ok(t.reshape((rows, n, c.head_dim))?
                .transpose(0, 1)?
                .unsqueeze(0)?
                .contiguous()?)
        };
        let q = heads(l.q.forward(&h)?, c.q_heads)?;
        let k = heads(l.k.forward(&h)?, c.kv_heads)?;
        let v = heads(l.v.forward(&h)?, c.kv_heads)?;
        // Both norms are per row of D values, so the layout does not change
        // a bit of them; candle's rope wants [batch, heads, seq, D] and
        // cos/sin [seq, D/2], which is the layout here.
        let q = candle_nn::rotary_emb::rope(&norm(&q, &l.q_norm, c.eps)?, cos, sin)?;
        let k_pre = norm(&k, &l.k_norm, c.eps)?;
        let k = candle_nn::rotary_emb::rope(&k_pre, cos, sin)?;
        Ok((q, k, v, k_pre))
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
            let (cos, sin) = (l.cos.narrow(0, 0, t)?, l.sin.narrow(0, 0, t)?);
            let (q, k, v, k_pre) = self.qkv(l, &x, &cos, &sin)?;
            if capture {
                let rows =
                    |x: &Tensor| -> Result<Vec<f32>> { Ok(x.squeeze(0)?.transpose(0, 1)?.flatten_all()?.to_vec1()?) };
                caps.push(Capture {
                    q: rows(&q)?,
                    k: rows(&k)?,
                    v: rows(&v)?,
                    k_pre: rows(&k_pre)?,
                });
            }
            // [Hkv, group * T, D] x [Hkv, D, T]: one matmul per KV head
            // serves its whole group of query heads (query heads are
            // numbered KV head major).
            let qg = q.reshape((c.kv_heads, group * t, c.head_dim))?;
            let kt = k.squeeze(0)?.transpose(1, 2)?.contiguous()?;
            let vt = v.squeeze(0)?;
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

    /// The model's attention shape, for [`KiviKvCache`].
    pub fn model_shape(&self) -> ModelShape {
        ModelShape {
            layers: self.cfg.layers,
            q_heads: self.cfg.q_heads,
            kv_heads: self.cfg.kv_heads,
            head_dim: self.cfg.head_dim,
        }
    }

    /// A kivi cache for one sequence of this model with room for
    /// `max_tokens` tokens: `schemes` holds one scheme for every layer or
    /// one per layer; each layer gets the model's sliding window and
    /// attention scale.
    ///
    /// A scheme with `rope: pre(...)` stores keys before RoPE. Gemma 3 has
    /// two RoPE bases (10 000 on local layers, 1 000 000 on global ones), so
    /// like the window, the base is the layer's own: each layer's scheme
    /// takes its layer's base in place of the declared `theta` (what
    /// `kivi::model!` would spell with `sliding:` and `global:` schemes).
    /// The pair convention must be `half` (Gemma rotates halves) and the
    /// scaling `none`; anything else is refused.
    pub fn new_cache(&self, schemes: &[Scheme], max_tokens: usize) -> Result<KiviKvCache> {
        self.new_cache_calibrated(schemes, max_tokens, None)
    }

    /// [`Self::new_cache`] whose `levels = nuq` tensors decode with the
    /// codebooks of `calibration` (made by `kivi calibrate` for this model).
    pub fn new_cache_calibrated(
        &self,
        schemes: &[Scheme],
        max_tokens: usize,
        calibration: Option<&kivi_runtime::calib::Calibration>,
    ) -> Result<KiviKvCache> {
        let shape = self.model_shape();
        let layers = self.cfg.layers;
        let per: Vec<Scheme> = match schemes {
            [one] => vec![one.clone(); layers],
            many => many.to_vec(),
        };
        let per = per
            .into_iter()
            .enumerate()
            .map(|(i, mut s)| -> Result<Scheme> {
                if let Some(r) = s.rope.as_mut() {
                    if r.style != kivi_spec::RopeStyle::Half || r.scaling != 1.0 {
                        return Err(Error::Config(format!(
                            "scheme `{}`: Gemma 3 rotates halves without scaling; use rope: pre(theta = B, style = half)",
                            s.name
                        )));
                    }
                    r.theta = self.rope_base(i) as f64;
                }
                Ok(s)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut cache = KiviKvCache::per_layer_calibrated(&per, shape, max_tokens, calibration)?;
        for i in 0..self.cfg.layers {
            cache.set_window(i, self.cfg.window(i))?;
        }
        cache.set_softmax_scale(self.cfg.softmax_scale)?;
        Ok(cache)
    }

    /// The RoPE base of layer `layer`: global layers use the file's
    /// `gemma3.rope.freq_base`, local ones 10 000.
    pub fn rope_base(&self, layer: usize) -> f32 {
        if self.cfg.global_layers.contains(&layer) {
            self.cfg.rope_global
        } else {
            self.cfg.rope_local
        }
    }

    /// Stores the K/V a [`Gemma3::forward`] captured into `cache` (for
    /// every layer), as if the cache had run those tokens itself, but with
    /// unquantized attention for the prefix.
    pub fn fill_cache(&self, cache: &mut KiviKvCache, fwd: &Forward) -> Result<()> {
        let (h, d) = (self.cfg.kv_heads, self.cfg.head_dim);
        if fwd.layers.len() != self.cfg.layers {
            return Err(Error::Config(format!(
                "the forward captured {} layers, the model has {}",
                fwd.layers.len(),
                self.cfg.layers
            )));
        }
        for (l, cap) in fwd.layers.iter().enumerate() {
            let t = cap.k.len() / (h * d);
            let tensor = |x: &[f32]| -> Result<Tensor> {
                Ok(Tensor::from_slice(x, (t, h, d), &self.dev)?
                    .transpose(0, 1)?
                    .unsqueeze(0)?)
            };
            // A pre-RoPE layer stores the keys from before RoPE.
            let k = if cache.scheme(l)?.rope.is_some() {
                &cap.k_pre
            } else {
                &cap.k
            };
            cache.extend(l, &tensor(k)?, &tensor(&cap.v)?)?;
        }
        Ok(())
    }

    /// Runs new tokens of one sequence on its cache: they sit at positions
    /// `cache.current_seq_len()..`, and every layer attends over the cache
    /// and the new tokens (causal, the layer's window) with kivi's fused
    /// attention, storing their K/V. A prompt goes in as chunks of any size
    /// (straight into the quantized cache); a decode step is one token.
    /// Returns the logits asked for (`Logits::Last`: `[1, vocab]`).
    pub fn forward_cached(&self, tokens: &[u32], cache: &mut KiviKvCache, logits: Logits) -> Result<Option<Tensor>> {
        let x = self.run_cached(tokens, &mut [(tokens.len(), cache)])?;
        let rows = tokens.len();
        Ok(match logits {
            Logits::All => Some(self.head(&x)?),
            Logits::Last => Some(self.head(&x.narrow(0, rows - 1, 1)?)?),
            Logits::None => None,
        })
    }

    /// One decode step for a batch of sequences: `tokens[b]` is the next
    /// token of the sequence in `caches[b]` (each at its own position; the
    /// matmuls run once for the batch). Returns logits `[B, vocab]`.
    pub fn step(&self, tokens: &[u32], caches: &mut [&mut KiviKvCache]) -> Result<Tensor> {
        if caches.len() != tokens.len() {
            return Err(Error::Config(format!(
                "{} tokens for {} caches",
                tokens.len(),
                caches.len()
            )));
        }
        let mut seqs: Vec<(usize, &mut KiviKvCache)> = caches.iter_mut().map(|c| (1, &mut **c)).collect();
        let x = self.run_cached(tokens, &mut seqs)?;
        self.head(&x)
    }

    /// The layers on kivi caches: `seqs[b] = (n, cache)` takes the next `n`
    /// rows of `tokens`. Returns the final hidden states `[rows, hidden]`.
    fn run_cached(&self, tokens: &[u32], seqs: &mut [(usize, &mut KiviKvCache)]) -> Result<Tensor> {
        let c = &self.cfg;
        let rows = tokens.len();
        if rows == 0 || seqs.iter().map(|s| s.0).sum::<usize>() != rows {
            return Err(Error::Config(format!(
                "{rows} tokens for sequences taking {} in all",
                seqs.iter().map(|s| s.0).sum::<usize>()
            )));
        }
        // Everything that can be refused is refused before a layer writes
        // its cache: a failure half-way would leave layers out of step.
        let mut positions: Vec<u32> = Vec::with_capacity(rows);
        for (n, cache) in seqs.iter() {
            if cache.shape() != self.model_shape() {
                return Err(Error::Config(format!(
                    "the cache was made for {:?}, the model is {:?}",
                    cache.shape(),
                    self.model_shape()
                )));
            }
            let p0 = cache.current_seq_len();
            if (0..c.layers).any(|l| cache.seq_len(l).ok() != Some(p0)) {
                return Err(Error::Config(
                    "the cache's layers hold different numbers of tokens (a forward stopped half-way); reset it".into(),
                ));
            }
            if p0 + n > cache.max_tokens() {
                return Err(Error::Config(format!(
                    "{n} more tokens after {p0} do not fit a cache sized for {} tokens",
                    cache.max_tokens()
                )));
            }
            positions.extend((p0..p0 + n).map(|p| p as u32));
        }
        let last = positions.iter().copied().max().unwrap_or(0) as usize;
        self.check_tokens(tokens, last)?;
        let pos = Tensor::from_vec(positions, rows, &self.dev)?;
        let mut x = self.embed(tokens)?;
        for (i, l) in self.layers.iter().enumerate() {
            let (cos, sin) = (l.cos.index_select(&pos, 0)?, l.sin.index_select(&pos, 0)?);
            let (q, k, v, k_pre) = self.qkv(l, &x, &cos, &sin)?;
            let mut outs = Vec::with_capacity(seqs.len());
            let mut at = 0;
            for (n, cache) in seqs.iter_mut() {
                let part = |t: &Tensor| t.narrow(2, at, *n);
                // The query is always after RoPE; a pre-RoPE layer gets its
                // keys from before RoPE and turns them in the kernel.
                let k = if cache.scheme(i)?.rope.is_some() { &k_pre } else { &k };
                outs.push(cache.attend(i, &part(&q)?, &part(k)?, &part(&v)?)?);
                at += *n;
            }
            let o = if outs.len() == 1 {
                outs.swap_remove(0)
            } else {
                Tensor::cat(&outs, 2)?
            };
            let o = o.squeeze(0)?.transpose(0, 1)?.reshape((rows, c.q_heads * c.head_dim))?;
            x = self.finish_layer(l, &x, &o)?;
        }
        Ok(x)
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
