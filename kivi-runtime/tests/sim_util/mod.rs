//! Helpers shared by the `sim_*` tests: deterministic inputs, caches filled
//! by streaming and by prefill, and the comparison against the oracle.
#![allow(dead_code)]

use kivi_runtime::{reference, AttnParams, Backend, CacheConfig, PagedCache, SeqId};
use kivi_spec::{Heads, Scheme};

/// The runtime's one seeded generator: `f32()` in [-1, 1), `vec(n)`.
pub use kivi_runtime::rand::Rng;

/// The three head layouts every decode variant is run on.
pub fn layouts() -> [(Heads, u32); 3] {
    [
        (Heads::Gqa { q: 32, kv: 8 }, 128),
        (Heads::Mqa(4), 256),
        (Heads::Mha(8), 64),
    ]
}

/// A cache holding one sequence per entry of `lens`, with its K/V inputs.
pub struct Batch {
    pub scheme: Scheme,
    pub cache: PagedCache,
    pub seqs: Vec<SeqId>,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub q: Vec<f32>,
}

impl Batch {
    /// Sequences of the given lengths; odd ones are streamed token by token
    /// when `stream`, the rest prefilled.
    pub fn new(scheme: &Scheme, lens: &[usize], seed: u64, stream: bool) -> Batch {
        let shape = scheme.shape().unwrap();
        let row = shape.kv_heads * shape.head_dim;
        let total: usize = lens.iter().sum();
        let mut cache = PagedCache::new(scheme.clone(), CacheConfig::for_tokens(total + 64 * lens.len() + 64)).unwrap();
        let mut rng = Rng::new(seed);
        let (mut seqs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (i, &t) in lens.iter().enumerate() {
            let k = rng.vec(t * row);
            // values with an offset per channel, keys with outlier channels (KIVI's picture)
            let k: Vec<f32> = k
                .iter()
                .enumerate()
                .map(|(j, x)| if j % 16 == 3 { x * 6.0 } else { *x })
                .collect();
            let v = rng.vec(t * row);
            let id = cache.add_sequence();
            if stream && i % 2 == 1 {
                for p in 0..t {
                    cache
                        .append(id, &k[p * row..(p + 1) * row], &v[p * row..(p + 1) * row])
                        .unwrap();
                }
            } else {
                cache.extend(id, &k, &v).unwrap();
            }
            seqs.push(id);
            ks.push(k);
            vs.push(v);
        }
        let q = rng.vec(lens.len() * shape.q_heads * shape.head_dim);
        Batch {
            scheme: scheme.clone(),
            cache,
            seqs,
            k: ks,
            v: vs,
            q,
        }
    }

    /// The oracle's output for the whole batch (from the raw inputs, not the cache).
    pub fn reference(&self, attn: AttnParams) -> Vec<f32> {
        let shape = self.scheme.shape().unwrap();
        let per = shape.q_heads * shape.head_dim;
        let mut out = Vec::new();
        for b in 0..self.seqs.len() {
            out.extend(
                reference::attend(
                    &self.scheme,
                    &self.q[b * per..(b + 1) * per],
                    &self.k[b],
                    &self.v[b],
                    attn,
                )
                .unwrap(),
            );
        }
        out
    }

    /// max |got - want| / max |want| of a backend against the oracle.
    pub fn rel_error(&self, backend: &dyn Backend, attn: AttnParams, want: &[f32]) -> f32 {
        let got = backend.decode(&self.cache, &self.seqs, &self.q, attn).unwrap();
        rel_error(&got, want)
    }
}

pub fn rel_error(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    let err = got.iter().zip(want).fold(0f32, |m, (g, w)| {
        if g.is_nan() {
            f32::INFINITY
        } else {
            m.max((g - w).abs())
        }
    });
    err / scale
}

/// Schemes beyond the presets that exercise every corner of the templates:
/// 1/3/8-bit codes, words that straddle token-axis groups, f32 scales,
/// bf16/f32 activations, sinks, chunked flush, `full` tensors, odd shapes.
pub fn extra_schemes() -> Vec<Scheme> {
    let texts = [
        "b3 { key: quant(bits = 3, axis = channel, group = 32), value: quant(bits = 3, axis = token, group = 16), residual: 32 }",
        "b1 { key: quant(bits = 1, axis = channel, group = 16), value: quant(bits = 1, axis = token, group = 64), residual: 16 }",
        "bf16 { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 64, dtype: bf16 }",
        "f32act { key: quant(bits = 4, axis = channel, group = 32), value: quant(bits = 4, axis = token, group = 32), residual: 48, dtype: f32 }",
        "sinks { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 64, sinks: 5 }",
        "chunked { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 64, flush: chunked }",
        "f32scale { key: quant(bits = 4, axis = channel, group = 16, scale = f32), value: quant(bits = 8, axis = token, group = 16, scale = f32), residual: 24 }",
        "tokgroup8 { key: quant(bits = 2, axis = token, group = 8), value: quant(bits = 4, axis = channel, group = 8), residual: 8, sinks: 2 }",
        "fullkey { key: full, value: quant(bits = 2, axis = token, group = 32), residual: 16, dtype: bf16 }",
        "window { key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 32, sliding_window: 100, softmax_scale: 0.0625 }",
    ];
    texts.iter().map(|t| kivi_spec::parse_scheme(t).unwrap()).collect()
}

/// Prints a summary line even when the test harness captures output (it
/// captures `print!`, not writes to the stderr handle), so CI logs show how
/// many variants sim executed.
pub fn report(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// A batch for the extend kernels' prefill: sequences of `lens` tokens
/// (values scaled and offset away from the keys' range) written by
/// `PagedCache::extend`, and the device's starting point: a zeroed pool
/// and empty windows over the cache's block tables.
pub struct PrefillBatch {
    pub cache: PagedCache,
    pub ids: Vec<SeqId>,
    pub ks: Vec<Vec<f32>>,
    pub vs: Vec<Vec<f32>>,
    pub pool: Vec<u32>,
    pub states: Vec<kivi_runtime::sim::SeqState>,
}

impl PrefillBatch {
    pub fn new(s: &Scheme, lens: &[usize], seed: u64) -> PrefillBatch {
        let shape = s.shape().unwrap();
        let row = shape.kv_heads * shape.head_dim;
        let total: usize = lens.iter().sum();
        let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(total + 64 * lens.len())).unwrap();
        let mut rng = Rng::new(seed);
        let (mut ks, mut vs, mut ids) = (Vec::new(), Vec::new(), Vec::new());
        for &t in lens {
            let k = rng.vec(t * row);
            let v: Vec<f32> = rng.vec(t * row).iter().map(|x| x * 3.0 + 0.5).collect();
            let id = cache.add_sequence();
            cache.extend(id, &k, &v).unwrap();
            ks.push(k);
            vs.push(v);
            ids.push(id);
        }
        let pool = vec![0u32; cache.pool().len()];
        let states = ids
            .iter()
            .map(|&id| kivi_runtime::sim::SeqState::empty(s, cache.block_table(id).unwrap().to_vec()).unwrap())
            .collect();
        PrefillBatch {
            cache,
            ids,
            ks,
            vs,
            pool,
            states,
        }
    }

    /// Runs `kernel` from the starting point (updating `pool` and
    /// `states`), the keys and values one slice a sequence.
    pub fn run(&mut self, kernel: &kivi_runtime::sim::SimExtend) -> kivi_runtime::Result<Vec<bool>> {
        let kr: Vec<&[f32]> = self.ks.iter().map(|x| x.as_slice()).collect();
        let vr: Vec<&[f32]> = self.vs.iter().map(|x| x.as_slice()).collect();
        kernel.run(&mut self.pool, &mut self.states, &kr, &vr)
    }
}

/// A batch for the append kernel: sequences of `starts` tokens (one
/// `extend` each) in a cache with room for `capacity` tokens, then one
/// token a sequence per [`AppendBatch::step`].
pub struct AppendBatch {
    pub cache: PagedCache,
    pub ids: Vec<SeqId>,
    rng: Rng,
    row: usize,
}

/// One append step: the pool and windows before it (block tables already
/// grown for the new token, as the host does before a launch) and the new
/// keys and values, one row a sequence.
pub struct AppendStep {
    pub pool: Vec<u32>,
    pub states: Vec<kivi_runtime::sim::SeqState>,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
}

impl AppendStep {
    /// Runs `kernel` over the step (updating `pool` and `states`).
    pub fn run(&mut self, kernel: &kivi_runtime::sim::SimExtend) -> kivi_runtime::Result<Vec<bool>> {
        let kr: Vec<&[f32]> = self.k.iter().map(|x| x.as_slice()).collect();
        let vr: Vec<&[f32]> = self.v.iter().map(|x| x.as_slice()).collect();
        kernel.run(&mut self.pool, &mut self.states, &kr, &vr)
    }
}

impl AppendBatch {
    pub fn new(s: &Scheme, starts: &[usize], capacity: usize, seed: u64) -> AppendBatch {
        let shape = s.shape().unwrap();
        let row = shape.kv_heads * shape.head_dim;
        let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(capacity)).unwrap();
        let mut rng = Rng::new(seed);
        let mut ids = Vec::new();
        for &t in starts {
            let id = cache.add_sequence();
            if t > 0 {
                cache.extend(id, &rng.vec(t * row), &rng.vec(t * row)).unwrap();
            }
            ids.push(id);
        }
        AppendBatch { cache, ids, rng, row }
    }

    /// Draws one token a sequence and appends it to the host cache; returns
    /// what the kernel starts from and takes.
    pub fn step(&mut self) -> AppendStep {
        use kivi_runtime::sim::SeqState;
        let pool = self.cache.pool().to_vec();
        let mut states: Vec<SeqState> = self
            .ids
            .iter()
            .map(|&id| SeqState::of(&self.cache, id).unwrap())
            .collect();
        let k: Vec<Vec<f32>> = self.ids.iter().map(|_| self.rng.vec(self.row)).collect();
        let v: Vec<Vec<f32>> = self.ids.iter().map(|_| self.rng.vec(self.row)).collect();
        for (i, &id) in self.ids.iter().enumerate() {
            self.cache.append(id, &k[i], &v[i]).unwrap();
            states[i].table = self.cache.block_table(id).unwrap().to_vec();
        }
        AppendStep { pool, states, k, v }
    }
}
