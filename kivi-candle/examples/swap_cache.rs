//! A tiny candle attention layer, first on a plain concatenating KV cache
//! (candle-nn's way), then on kivi's: the lines marked `kivi:` are the whole
//! switch. Runs a 48-token prompt as one chunk and 16 decode steps through
//! both and prints how far the outputs are apart and the cache sizes.
//!
//! `cargo run --release -p kivi-candle --example swap_cache`

use candle_core::{Device, Result, Tensor, D};
use kivi_candle::{KiviKvCache, ModelShape};

const HQ: usize = 8;
const HKV: usize = 2;
const HD: usize = 64;
const HIDDEN: usize = 256;

/// The projections both versions share.
struct Proj {
    wq: Tensor,
    wk: Tensor,
    wv: Tensor,
}

impl Proj {
    fn new(dev: &Device) -> Result<Proj> {
        let w = |out: usize| Tensor::randn(0f32, (HIDDEN as f32).powf(-0.5), (HIDDEN, out), dev);
        Ok(Proj {
            wq: w(HQ * HD)?,
            wk: w(HKV * HD)?,
            wv: w(HKV * HD)?,
        })
    }

    /// `x [seq, hidden]` to q `[1, HQ, seq, HD]`, k and v `[1, HKV, seq, HD]`.
    fn qkv(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let seq = x.dim(0)?;
        let heads = |w: &Tensor, h: usize| x.matmul(w)?.reshape((1, seq, h, HD))?.transpose(1, 2)?.contiguous();
        Ok((heads(&self.wq, HQ)?, heads(&self.wk, HKV)?, heads(&self.wv, HKV)?))
    }
}

/// Before: K/V concatenated in full precision, GQA by repeating K/V heads,
/// a causal mask for the new queries.
struct PlainAttention {
    proj: Proj,
    cache: Option<(Tensor, Tensor)>,
}

impl PlainAttention {
    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let (q, k, v) = self.proj.qkv(x)?;
        let (k, v) = match self.cache.take() {
            None => (k, v),
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
        };
        self.cache = Some((k.clone(), v.clone()));
        let (n, t) = (q.dim(2)?, k.dim(2)?);
        let rep = |x: &Tensor| {
            x.unsqueeze(2)?
                .expand((1, HKV, HQ / HKV, t, HD))?
                .reshape((1, HQ, t, HD))
        };
        let scores = (q.matmul(&rep(&k)?.t()?)? / (HD as f64).sqrt())?;
        let mask: Vec<f32> = (0..n)
            .flat_map(|i| (0..t).map(move |j| if j <= t - n + i { 0.0 } else { f32::NEG_INFINITY }))
            .collect();
        let scores = scores.broadcast_add(&Tensor::from_vec(mask, (n, t), x.device())?)?;
        let e = scores.broadcast_sub(&scores.max_keepdim(D::Minus1)?)?.exp()?;
        e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?.matmul(&rep(&v)?)
    }
}

/// After: the same layer on kivi's cache. No concatenation, no repeat_kv,
/// no mask: `attend` stores the new tokens (quantized) and attends causally.
struct KiviAttention {
    proj: Proj,
    cache: KiviKvCache, // kivi: the cache of the whole model
    layer: usize,       // kivi: which layer this is
}

impl KiviAttention {
    fn forward(&mut self, x: &Tensor) -> Result<Tensor> {
        let (q, k, v) = self.proj.qkv(x)?;
        Ok(self.cache.attend(self.layer, &q, &k, &v)?) // kivi: fused attention over the cache
    }
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let proj = Proj::new(&dev)?;
    let same = |p: &Proj| Proj {
        wq: p.wq.clone(),
        wk: p.wk.clone(),
        wv: p.wv.clone(),
    };
    let shape = ModelShape {
        layers: 1,
        q_heads: HQ,
        kv_heads: HKV,
        head_dim: HD,
    };
    let mut plain = PlainAttention {
        proj: same(&proj),
        cache: None,
    };
    let mut kivi2 = KiviAttention {
        proj: same(&proj),
        // kivi: 2-bit keys per channel, 2-bit values per token, 128 recent tokens in f16.
        cache: KiviKvCache::new(&kivi_spec::presets::kivi2(), shape, 4096)?,
        layer: 0,
    };
    // No recent window: every token but the newest is 2-bit.
    let mut kivi2_r0 = KiviAttention {
        proj,
        cache: KiviKvCache::new(&kivi_spec::presets::kivi2_r0(), shape, 4096)?,
        layer: 0,
    };
    let mut worst = [0f32; 2];
    for (step, n) in std::iter::once(48).chain(std::iter::repeat_n(1, 16)).enumerate() {
        let x = Tensor::randn(0f32, 1.0, (n, HIDDEN), &dev)?;
        let want = plain.forward(&x)?;
        for (w, layer) in worst.iter_mut().zip([&mut kivi2, &mut kivi2_r0]) {
            let got = layer.forward(&x)?;
            let d = (&want - &got)?.abs()?.max_all()?.to_scalar::<f32>()?;
            *w = w.max(d);
        }
        if step == 0 {
            println!("prefilled {n} tokens as one chunk");
        }
    }
    let plain_bytes = 2 * HKV * HD * 4 * plain.cache.as_ref().map_or(0, |(k, _)| k.dim(2).unwrap_or(0));
    println!("64 tokens: plain f32 cache {plain_bytes} bytes");
    for (name, w, l) in [("kivi2", worst[0], &kivi2), ("kivi2_r0", worst[1], &kivi2_r0)] {
        println!(
            "{name}: {} bytes (exact; an f16 cache: {}), max |output - plain| = {w:.4}",
            l.cache.memory_bytes(),
            l.cache.f16_bytes()
        );
    }
    Ok(())
}
