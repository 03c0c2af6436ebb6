//! One block pool shared by several caches (`kivi_runtime::pool`): the
//! layers of a model with different schemes (different block sizes) and
//! sliding windows. Exhaustion is a typed error that changes nothing;
//! blocks an evicting layer frees are bytes another layer takes; the pool's
//! bytes in use are exactly the blocks its caches hold; attention is the
//! same, bit for bit, as on per-layer pools at odd lengths and several head
//! layouts; and a random session of appends, extends, evictions, freed
//! sequences and dropped caches across layers agrees with a plain model of
//! what each cache holds.

mod common;
use common::*;
use kivi_runtime::pool::BlockPool;
use kivi_runtime::*;
use kivi_spec::layout::regions;
use kivi_spec::{presets, Heads, Scheme, Tensor};

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn bound(s: Scheme, heads: Heads, d: u32) -> Scheme {
    s.with_shape(heads, d).unwrap()
}

/// Bytes of blocks a cache holds, by its own report.
fn held_bytes(c: &PagedCache) -> usize {
    c.memory().blocks_in_use * c.layout().block_bytes()
}

/// Everything a reader of sequence `id` can see, and the cache's report.
fn snapshot(c: &PagedCache, id: SeqId) -> (usize, Vec<u32>, Vec<u32>, MemoryReport, Vec<u32>) {
    (
        c.len(id).unwrap(),
        bits(&c.dequantize(id, Tensor::Key).unwrap()),
        bits(&c.dequantize(id, Tensor::Value).unwrap()),
        c.memory(),
        c.block_table(id).unwrap().to_vec(),
    )
}

/// A pool too small for the next append refuses it with
/// `PoolExhausted` on both write paths (vectorised and reference), for an
/// append and for a long extend, leaving the refused cache, the other
/// caches on the pool and the pool itself exactly as they were.
#[test]
fn exhaustion_is_a_typed_error_and_changes_nothing() {
    for isa in [Some(cpu::Isa::Avx512), None] {
        let a_s = bound(presets::kivi2(), Heads::Gqa { q: 8, kv: 2 }, 64);
        let b_s = bound(presets::kivi4(), Heads::Gqa { q: 8, kv: 2 }, 64);
        let cfg = CacheConfig::for_tokens(1 << 14);
        let mut a = PagedCache::new(a_s, cfg).unwrap();
        let mut b = PagedCache::new(b_s, cfg).unwrap();
        a.set_write_isa(isa);
        b.set_write_isa(isa);
        assert_ne!(a.layout().block_bytes(), b.layout().block_bytes());
        // Room for 3 blocks of each.
        let pool = BlockPool::new(3 * (a.layout().block_bytes() + b.layout().block_bytes()));
        a.set_pool(Some(pool.clone())).unwrap();
        b.set_pool(Some(pool.clone())).unwrap();
        let (ia, ib) = (a.add_sequence(), b.add_sequence());
        let mut rng = Rng::new(7);
        let row = 2 * 64;
        // Fill `b` (then `a`) token by token until the pool refuses one.
        for (c, id) in [(&mut b, ib), (&mut a, ia)] {
            let mut refused = false;
            for _ in 0..10_000 {
                let (k, v) = (rng.kv(1, 2, 64, true), rng.kv(1, 2, 64, false));
                let before = snapshot(c, id);
                let used = pool.memory();
                match c.append(id, &k, &v) {
                    Ok(()) => {}
                    Err(e) => {
                        assert!(matches!(e, Error::PoolExhausted { blocks: 1, .. }), "{e}");
                        assert!(e.to_string().contains("block pool exhausted"), "{e}");
                        assert_eq!(snapshot(c, id), before, "a refused append changed the cache");
                        assert_eq!(pool.memory(), used, "a refused append changed the pool");
                        refused = true;
                        break;
                    }
                }
            }
            assert!(refused);
        }
        let (sa, sb) = (snapshot(&a, ia), snapshot(&b, ib));
        assert_eq!(pool.memory().used, held_bytes(&a) + held_bytes(&b));
        assert!(pool.memory().free < a.layout().block_bytes());
        // A long extend is refused whole, on either cache.
        let (k, v) = (rng.kv(700, 2, 64, true), rng.kv(700, 2, 64, false));
        for (c, id, s) in [(&mut a, ia, &sa), (&mut b, ib, &sb)] {
            let e = c.extend(id, &k, &v).unwrap_err();
            assert!(matches!(e, Error::PoolExhausted { .. }), "{e}");
            assert_eq!(&snapshot(c, id), s);
        }
        assert_eq!((snapshot(&a, ia), snapshot(&b, ib)), (sa, sb));
        // Freeing `b`'s sequence gives its bytes back, and `a` goes on.
        let free_before = pool.memory().free;
        let b_bytes = held_bytes(&b);
        b.free_sequence(ib).unwrap();
        assert_eq!(pool.memory().free, free_before + b_bytes);
        a.extend(ia, &k[..100 * row], &v[..100 * row]).unwrap();
        assert_eq!(pool.memory().used, held_bytes(&a));
    }
}

/// A non-finite value refused after the pool was charged gives the bytes
/// back: the pool is where it was.
#[test]
fn a_failed_write_gives_its_blocks_back() {
    let s = bound(presets::kivi2(), Heads::Mqa(4), 64);
    let mut c = PagedCache::new(s, CacheConfig::for_tokens(4096)).unwrap();
    let pool = BlockPool::new(1 << 20);
    c.set_pool(Some(pool.clone())).unwrap();
    let id = c.add_sequence();
    let mut rng = Rng::new(3);
    let (k, mut v) = (rng.kv(600, 1, 64, true), rng.kv(600, 1, 64, false));
    v[64 * 10 + 5] = f32::NAN;
    let e = c.extend(id, &k, &v).unwrap_err();
    assert!(matches!(e, Error::NonFinite { .. }), "{e}");
    assert_eq!(pool.memory().used, 0);
    assert_eq!(c.len(id).unwrap(), 0);
}

/// Two layers on one pool that holds exactly what the global layer needs
/// plus what the sliding layer keeps once it evicts: without eviction the
/// global layer is refused; once the sliding layer evicts, the global layer
/// takes the bytes it freed and holds more than the pool could otherwise
/// give it.
#[test]
fn blocks_an_evicting_sliding_layer_frees_are_reused_by_a_global_layer() {
    let heads = Heads::Mqa(4);
    let local = bound(presets::kivi4(), heads, 64);
    let global = bound(presets::kivi2(), heads, 64);
    let cfg = CacheConfig::for_tokens(1 << 14);
    let mut sl = PagedCache::new(local, cfg).unwrap();
    let mut gl = PagedCache::new(global, cfg).unwrap();
    let (lb, gb) = (sl.layout().block_bytes(), gl.layout().block_bytes());
    assert_ne!(lb, gb);
    let pool = BlockPool::new(12 * lb + 20 * gb);
    sl.set_pool(Some(pool.clone())).unwrap();
    gl.set_pool(Some(pool.clone())).unwrap();
    let (si, gi) = (sl.add_sequence(), gl.add_sequence());
    let mut rng = Rng::new(11);
    // Both layers take the same tokens, in lockstep, as a model's would.
    let step = |sl: &mut PagedCache, gl: &mut PagedCache, rng: &mut Rng, n: usize| -> Result<()> {
        let (k, v) = (rng.kv(n, 1, 64, true), rng.kv(n, 1, 64, false));
        sl.extend(si, &k, &v)?;
        gl.extend(gi, &k, &v)
    };
    let mut refused_at = None;
    for t in 0..200 {
        if let Err(e) = step(&mut sl, &mut gl, &mut rng, 64) {
            assert!(matches!(e, Error::PoolExhausted { .. }), "{e}");
            refused_at = Some(t);
            break;
        }
    }
    let refused_at = refused_at.expect("a pool of 12 + 20 blocks cannot hold 200 * 64 tokens");
    let held_before = gl.memory().blocks_in_use;
    // The sliding layer starts evicting: its blocks go back to the pool...
    let before = pool.memory().used;
    sl.set_eviction_window(Some(128)).unwrap();
    let freed = before - pool.memory().used;
    assert!(freed >= 5 * lb, "eviction freed only {freed} bytes");
    assert_eq!(pool.memory().used, held_bytes(&sl) + held_bytes(&gl));
    // ... and the global layer takes them: the lockstep goes on well past
    // the point it was refused (the sliding layer holds at most
    // 128 / 64 + 1 blocks from now on; the global one grows).
    let gl_len = gl.len(gi).unwrap();
    let sl_len = sl.len(si).unwrap();
    let (k, v) = (
        rng.kv(sl_len - gl_len, 1, 64, true),
        rng.kv(sl_len - gl_len, 1, 64, false),
    );
    gl.extend(gi, &k, &v).unwrap();
    for _ in 0..6 {
        step(&mut sl, &mut gl, &mut rng, 64).unwrap();
    }
    assert!(sl.memory().blocks_in_use <= 128 / 64 + 1 + 1);
    assert!(
        gl.memory().blocks_in_use * gb > 20 * gb && gl.memory().blocks_in_use > held_before,
        "the global layer holds {} blocks (refused at step {refused_at} with {held_before})",
        gl.memory().blocks_in_use
    );
    assert_eq!(pool.memory().used, held_bytes(&sl) + held_bytes(&gl));
    assert!(pool.memory().peak >= pool.memory().used);
    // Dropping a cache gives its bytes back too.
    let g = held_bytes(&gl);
    let used = pool.memory().used;
    drop(gl);
    assert_eq!(pool.memory().used, used - g);
}

/// A model-like set of layers (three schemes, sliding and global, evicting)
/// on one pool attends exactly as the same layers on their own pools, on
/// the reference and CPU backends, at odd lengths and for several layouts;
/// the pool's bytes are the layers' blocks at every length.
#[test]
fn attention_on_one_pool_is_bit_identical_to_per_layer_pools() {
    let cpu = CpuBackend::default();
    let reference = ReferenceBackend;
    let three = schemes().into_iter().find(|s| s.name == "three_bit_sinks").unwrap();
    let models = [
        [presets::kivi2(), presets::kivi4(), three.clone()],
        [three, presets::kivi2(), presets::kivi4()],
    ];
    let windows = [Some(45), None, Some(200)];
    let mut checked = 0;
    for (mi, model) in models.iter().enumerate() {
        for (heads, d) in layouts() {
            let layers: Vec<Scheme> = model.iter().filter_map(|s| s.with_shape(heads, d).ok()).collect();
            if layers.len() != 3 {
                continue;
            }
            let shape = layers[0].shape().unwrap();
            let (hq, hkv, dd) = (shape.q_heads, shape.kv_heads, shape.head_dim);
            let pool = BlockPool::new(1 << 26);
            let mk = |s: &Scheme, w: Option<usize>, p: Option<&BlockPool>| {
                let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(1100)).unwrap();
                c.set_eviction_window(w).unwrap();
                c.set_pool(p.cloned()).unwrap();
                let id = c.add_sequence();
                (c, id)
            };
            let mut own: Vec<_> = layers.iter().zip(windows).map(|(s, w)| mk(s, w, None)).collect();
            let mut pooled: Vec<_> = layers.iter().zip(windows).map(|(s, w)| mk(s, w, Some(&pool))).collect();
            let mut rng = Rng::new(mi as u64 * 100 + hkv as u64 * 10 + dd as u64);
            let k = rng.kv(1000, hkv, dd, true);
            let v = rng.kv(1000, hkv, dd, false);
            let mut done = 0;
            for &n in &LENS {
                // Layer 0 streams, the others extend: both paths draw on the pool.
                for l in 0..3 {
                    let (ks, vs) = (&k[done * hkv * dd..n * hkv * dd], &v[done * hkv * dd..n * hkv * dd]);
                    for (c, id) in [&mut own[l], &mut pooled[l]] {
                        if l == 0 {
                            for t in 0..n - done {
                                let r = hkv * dd;
                                c.append(*id, &ks[t * r..][..r], &vs[t * r..][..r]).unwrap();
                            }
                        } else {
                            c.extend(*id, ks, vs).unwrap();
                        }
                    }
                }
                done = n;
                let q = rng.vec(hq * dd);
                for l in 0..3 {
                    let mut a = AttnParams::of(&layers[l], shape);
                    a.window = windows[l];
                    for b in [&cpu as &dyn Backend, &reference] {
                        let want = b.decode(&own[l].0, &[own[l].1], &q, a).unwrap();
                        let got = b.decode(&pooled[l].0, &[pooled[l].1], &q, a).unwrap();
                        assert_eq!(
                            bits(&got),
                            bits(&want),
                            "model {mi} layer {l} {heads:?} d{d} len {n} on {}",
                            b.name()
                        );
                    }
                    assert_eq!(pooled[l].0.memory(), own[l].0.memory(), "layer {l} memory");
                }
                let sum: usize = pooled.iter().map(|(c, _)| held_bytes(c)).sum();
                assert_eq!(pool.memory().used, sum, "len {n}");
                checked += 1;
            }
        }
    }
    assert!(checked >= 5 * 5, "{checked}");
}

/// Many-query attention that fails on a later sequence undoes the earlier
/// ones' appends: their blocks go back to the pool too.
#[test]
fn a_refused_many_query_block_gives_back_what_earlier_sequences_took() {
    let s = bound(presets::kivi2(), Heads::Gqa { q: 4, kv: 2 }, 32);
    let mut rng = Rng::new(5);
    let n = 400;
    let (q, k, v) = (rng.vec(n * 4 * 32), rng.kv(n, 2, 32, true), rng.kv(n, 2, 32, false));
    let attn = AttnParams::of(&s, s.shape().unwrap());
    for b in [&CpuBackend::default() as &dyn Backend, &ReferenceBackend] {
        let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(4096)).unwrap();
        let bb = c.layout().block_bytes();
        // 400 tokens need 3 blocks of 128 in kivi2 (residual 128 stays in
        // the window): two sequences do not fit in 5.
        let pool = BlockPool::new(5 * bb);
        c.set_pool(Some(pool.clone())).unwrap();
        let (x, y) = (c.add_sequence(), c.add_sequence());
        let blocks = [
            NewTokens {
                seq: x,
                q: &q,
                k: &k,
                v: &v,
            },
            NewTokens {
                seq: y,
                q: &q,
                k: &k,
                v: &v,
            },
        ];
        let e = b.attend_block(&mut c, &blocks, attn).unwrap_err();
        assert!(e.to_string().contains("block pool exhausted"), "{}: {e}", b.name());
        assert_eq!(pool.memory().used, 0, "{}", b.name());
        assert_eq!((c.len(x).unwrap(), c.len(y).unwrap()), (0, 0));
        // One sequence fits, and its blocks are charged.
        b.attend_block(&mut c, &blocks[..1], attn).unwrap();
        assert_eq!(c.len(x).unwrap(), n);
        assert!(pool.memory().used > 0);
        assert_eq!(pool.memory().used, held_bytes(&c));
        c.free_sequence(x).unwrap();
        assert_eq!(pool.memory().used, 0);
    }
}

/// What the plain model predicts a cache of `s` (block `bt` tokens) holds
/// for a sequence of `tokens` tokens under eviction window `w`: the blocks
/// its table would reach, and the ones evicted from its front.
fn model_blocks(s: &Scheme, bt: usize, tokens: usize, w: Option<usize>) -> (usize, usize) {
    let q = [Tensor::Key, Tensor::Value].map(|t| regions(s, t, tokens).quantized);
    let reach = q[0].max(q[1]).div_ceil(bt);
    let stored = q[0].min(q[1]);
    let evicted = match w {
        Some(w) => (tokens.saturating_sub(w).saturating_sub(s.sinks as usize)).min(stored) / bt,
        None => 0,
    };
    (reach, evicted)
}

/// Random sessions across three layers (different schemes and block
/// sizes, two of them evicting) sharing a small pool: sequences added and
/// freed, appends and extends of random lengths, a cache dropped and
/// rebuilt. Before each write the plain model predicts whether the pool
/// can hold it; a refused write must be `PoolExhausted` and change
/// nothing; after each step the pool holds exactly the model's blocks.
#[test]
fn interleaved_appends_and_evictions_agree_with_a_plain_model() {
    let heads = Heads::Gqa { q: 4, kv: 2 };
    let three = schemes().into_iter().find(|s| s.name == "three_bit_sinks").unwrap();
    let layer_schemes = [
        bound(presets::kivi2(), heads, 32),
        bound(presets::kivi4(), heads, 32),
        bound(three, heads, 32),
    ];
    let windows = [Some(40), None, Some(100)];
    let mut total_refused = 0;
    for seed in 0..12u64 {
        let mut rng = Rng::new(seed + 1);
        let bbs: Vec<usize> = layer_schemes
            .iter()
            .map(|s| {
                kivi_spec::layout::BlockLayout::new(s, s.shape().unwrap(), kivi_spec::layout::default_block_tokens(s))
                    .block_bytes()
            })
            .collect();
        let capacity = (4 + rng.below(16)) * bbs[0];
        let pool = BlockPool::new(capacity);
        let mk = |l: usize| {
            let mut c = PagedCache::new(layer_schemes[l].clone(), CacheConfig::for_tokens(1 << 15)).unwrap();
            c.set_eviction_window(windows[l]).unwrap();
            c.set_pool(Some(pool.clone())).unwrap();
            c
        };
        let mut caches: Vec<PagedCache> = (0..3).map(mk).collect();
        // The model: per layer, its sequences and their token counts.
        let mut model: Vec<Vec<(SeqId, usize)>> = vec![Vec::new(); 3];
        let model_used = |model: &Vec<Vec<(SeqId, usize)>>, caches: &Vec<PagedCache>| -> usize {
            (0..3)
                .map(|l| {
                    let bt = caches[l].layout().block_tokens;
                    model[l]
                        .iter()
                        .map(|&(_, t)| {
                            let (reach, ev) = model_blocks(&layer_schemes[l], bt, t, windows[l]);
                            (reach - ev) * bbs[l]
                        })
                        .sum::<usize>()
                })
                .sum()
        };
        let (mut refused, mut ok) = (0, 0);
        for _ in 0..300 {
            let l = rng.below(3);
            match rng.below(20) {
                0 => {
                    let id = caches[l].add_sequence();
                    model[l].push((id, 0));
                }
                1 if !model[l].is_empty() => {
                    let i = rng.below(model[l].len());
                    let (id, _) = model[l].remove(i);
                    caches[l].free_sequence(id).unwrap();
                }
                2 => {
                    // Drop the layer's cache and start it again.
                    caches[l] = mk(l);
                    model[l].clear();
                }
                _ => {
                    if model[l].is_empty() {
                        let id = caches[l].add_sequence();
                        model[l].push((id, 0));
                    }
                    let i = rng.below(model[l].len());
                    let (id, t) = model[l][i];
                    let n = if rng.below(3) == 0 { 1 } else { 1 + rng.below(150) };
                    let bt = caches[l].layout().block_tokens;
                    let (reach0, _) = model_blocks(&layer_schemes[l], bt, t, windows[l]);
                    let (reach1, _) = model_blocks(&layer_schemes[l], bt, t + n, windows[l]);
                    let need = (reach1 - reach0) * bbs[l];
                    let fits = model_used(&model, &caches) + need <= capacity;
                    let k = rng.kv(n, 2, 32, true);
                    let v = rng.kv(n, 2, 32, false);
                    let before = snapshot(&caches[l], id);
                    let r = if n == 1 {
                        caches[l].append(id, &k, &v)
                    } else {
                        caches[l].extend(id, &k, &v)
                    };
                    match (r, fits) {
                        (Ok(()), true) => {
                            model[l][i].1 = t + n;
                            ok += 1;
                        }
                        (Err(Error::PoolExhausted { need: got, .. }), false) => {
                            assert_eq!(got, need, "seed {seed}");
                            assert_eq!(
                                snapshot(&caches[l], id),
                                before,
                                "seed {seed}: refused write changed layer {l}"
                            );
                            refused += 1;
                        }
                        (r, fits) => panic!("seed {seed} layer {l}: {r:?}, the model says fits = {fits}"),
                    }
                }
            }
            assert_eq!(pool.memory().used, model_used(&model, &caches), "seed {seed}");
            let held: usize = caches.iter().map(held_bytes).sum();
            assert_eq!(pool.memory().used, held, "seed {seed}");
            assert_eq!(pool.memory().used + pool.memory().free, capacity);
            for (l, c) in caches.iter().enumerate() {
                for &(id, t) in &model[l] {
                    assert_eq!(c.len(id).unwrap(), t);
                }
            }
        }
        assert!(ok > 50, "seed {seed}: {ok} writes");
        total_refused += refused;
    }
    assert!(total_refused > 12 * 5, "{total_refused} writes refused in all");
}

/// A cache with blocks moves to another pool with them: refused, with the
/// cache and both pools unchanged, when the new pool cannot hold them;
/// else charged there and given back to the old one. Detached, it holds
/// its blocks on its own.
#[test]
fn set_pool_moves_the_blocks_a_cache_holds() {
    let s = bound(presets::kivi4(), Heads::Mha(2), 32);
    let mut c = PagedCache::new(s, CacheConfig::for_tokens(4096)).unwrap();
    let bb = c.layout().block_bytes();
    let (first, small, big) = (
        BlockPool::new(100 * bb),
        BlockPool::new(2 * bb),
        BlockPool::new(100 * bb),
    );
    c.set_pool(Some(first.clone())).unwrap();
    let id = c.add_sequence();
    let mut rng = Rng::new(2);
    let (k, v) = (rng.kv(1000, 2, 32, true), rng.kv(1000, 2, 32, false));
    c.extend(id, &k, &v).unwrap();
    let held = held_bytes(&c);
    assert!(held > 2 * bb);
    assert_eq!(first.memory().used, held);
    let before = snapshot(&c, id);
    let e = c.set_pool(Some(small.clone())).unwrap_err();
    assert!(matches!(e, Error::PoolExhausted { .. }), "{e}");
    assert_eq!((first.memory().used, small.memory().used), (held, 0));
    assert!(c.block_pool().unwrap().same_pool(&first));
    assert_eq!(snapshot(&c, id), before);
    c.set_pool(Some(big.clone())).unwrap();
    assert_eq!((first.memory().used, big.memory().used), (0, held));
    // Attaching the same pool again charges nothing twice.
    c.set_pool(Some(big.clone())).unwrap();
    assert_eq!(big.memory().used, held);
    c.set_pool(None).unwrap();
    assert_eq!(big.memory().used, 0);
    assert!(c.block_pool().is_none());
    assert_eq!(snapshot(&c, id), before);
}
