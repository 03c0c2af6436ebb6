//! Sliding-window eviction (`PagedCache::set_eviction_window`): a cache
//! that frees the blocks its window no longer sees attends, under that
//! window, exactly as a cache that keeps everything — bit for bit, on the
//! reference and CPU backends (the simulated device: `sim_eviction.rs`) —
//! at odd lengths, on every preset and feature scheme and several head
//! layouts, streamed or extended; its memory report counts only the blocks
//! it holds, freed blocks are reused, and attention that would read an
//! evicted token is refused with a typed error.

mod common;
use common::*;
use kivi_runtime::*;
use kivi_spec::{Scheme, Tensor};

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Every scheme of the suite bound to every layout it binds.
fn bound_schemes() -> Vec<Scheme> {
    let mut out = Vec::new();
    for s in schemes().into_iter().chain(codec_schemes()) {
        for (heads, d) in layouts() {
            if let Ok(b) = s.with_shape(heads, d) {
                out.push(b);
            }
        }
    }
    out
}

fn cache(s: &Scheme, window: Option<usize>, tokens: usize) -> PagedCache {
    let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(tokens)).unwrap();
    c.set_eviction_window(window).unwrap();
    c
}

fn attn(s: &Scheme, window: usize) -> AttnParams {
    let mut a = AttnParams::of(s, s.shape().unwrap());
    a.window = Some(window);
    a
}

/// Decodes `q` on both caches with `window` and requires identical bits.
fn same_decode(
    b: &dyn Backend,
    s: &Scheme,
    plain: (&PagedCache, SeqId),
    evicting: (&PagedCache, SeqId),
    q: &[f32],
    window: usize,
    what: &str,
) {
    let a = attn(s, window);
    let want = b.decode(plain.0, &[plain.1], q, a).unwrap();
    let got = b
        .decode(evicting.0, &[evicting.1], q, a)
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    assert_eq!(bits(&got), bits(&want), "{what}: {} differs with eviction", b.name());
}

/// Streams 1000 tokens into a plain and an evicting cache (and extends a
/// third one from length to length), checking at each odd length that
/// decode under the eviction window, and under a narrower one, is the
/// plain cache's bit for bit, that extend left the streamed cache, and
/// that the evicting cache holds at most the blocks its window needs.
#[test]
fn evicting_cache_attends_as_the_full_cache_on_reference_and_cpu() {
    let cpu = CpuBackend::default();
    let mut checked = 0;
    for (si, s) in bound_schemes().into_iter().enumerate() {
        let shape = s.shape().unwrap();
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let row = hkv * d;
        // Windows below, around and above a block (64 tokens at least).
        for w in [1, 45, 200] {
            let mut rng = Rng::new(si as u64 * 31 + w as u64);
            let k = rng.kv(1000, hkv, d, true);
            let v = rng.kv(1000, hkv, d, false);
            let mut plain = cache(&s, None, 1100);
            let mut ev = cache(&s, Some(w), 1100);
            let mut ext = cache(&s, Some(w), 1100);
            let (p, e, x) = (plain.add_sequence(), ev.add_sequence(), ext.add_sequence());
            let mut done = 0;
            for &len in &LENS {
                for t in done..len {
                    let (kt, vt) = (&k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row]);
                    plain.append(p, kt, vt).unwrap();
                    ev.append(e, kt, vt).unwrap();
                }
                ext.extend(x, &k[done * row..len * row], &v[done * row..len * row])
                    .unwrap();
                done = len;
                let what = format!("{} w={w} len={len}", s.name);
                for t in [Tensor::Key, Tensor::Value] {
                    assert_eq!(
                        bits(&ev.dequantize(e, t).unwrap()),
                        bits(&ext.dequantize(x, t).unwrap()),
                        "{what}: extend and streaming differ"
                    );
                }
                assert_eq!(ev.memory(), ext.memory(), "{what}");
                assert_eq!(ev.evicted_tokens(e).unwrap(), ext.evicted_tokens(x).unwrap(), "{what}");
                // Held blocks: the stored tokens from the window's first on.
                let bt = ev.layout().block_tokens;
                let view = ev.view(e).unwrap();
                let stored = view.quantized(Tensor::Key).min(view.quantized(Tensor::Value));
                let keep = len.saturating_sub(w).saturating_sub(s.sinks as usize).min(stored) / bt;
                assert_eq!(view.first_block(), keep, "{what}: evicted blocks");
                assert_eq!(ev.memory().blocks_in_use, ev.block_table(e).unwrap().len(), "{what}");
                assert_eq!(ev.free_blocks() + ev.memory().blocks_in_use, ev.max_blocks(), "{what}");
                let q = rng.vec(hq * d);
                for window in [w, w / 2 + 1] {
                    for b in [&ReferenceBackend as &dyn Backend, &cpu] {
                        same_decode(b, &s, (&plain, p), (&ev, e), &q, window, &what);
                        same_decode(b, &s, (&plain, p), (&ext, x), &q, window, &what);
                    }
                }
                checked += 1;
            }
        }
    }
    assert!(checked > 300, "{checked}");
}

/// The memory report after eviction is that of the blocks held: every
/// per-block kind scales with `blocks_in_use`, tables are 4 bytes a held
/// block, windows and means do not change, and the total adds up.
#[test]
fn memory_after_eviction_counts_only_held_blocks() {
    for s in bound_schemes() {
        let shape = s.shape().unwrap();
        let row = shape.kv_heads * shape.head_dim;
        let mut rng = Rng::new(3);
        let k = rng.kv(1000, shape.kv_heads, shape.head_dim, true);
        let v = rng.kv(1000, shape.kv_heads, shape.head_dim, false);
        let mut plain = cache(&s, None, 1100);
        let mut ev = cache(&s, Some(100), 1100);
        let (p, e) = (plain.add_sequence(), ev.add_sequence());
        plain.extend(p, &k, &v).unwrap();
        ev.extend(e, &k, &v).unwrap();
        let (mp, me) = (plain.memory(), ev.memory());
        assert!(me.blocks_in_use < mp.blocks_in_use, "{}: nothing evicted", s.name);
        let per_block = |m: &MemoryReport| [m.codes, m.scales, m.zeros, m.outliers];
        for (a, b) in per_block(&mp).iter().zip(per_block(&me)) {
            assert_eq!(a * me.blocks_in_use, b * mp.blocks_in_use, "{}", s.name);
        }
        assert_eq!(me.tables, 4 * me.blocks_in_use, "{}", s.name);
        assert_eq!(
            (me.windows, me.means, me.codebooks),
            (mp.windows, mp.means, mp.codebooks)
        );
        assert_eq!(
            me.total,
            me.codes + me.scales + me.zeros + me.outliers + me.means + me.codebooks + me.windows + me.tables
        );
        assert_eq!(ev.sequence_memory(e).unwrap().total + me.codebooks, me.total);
        // Freeing the sequence returns every held block.
        ev.free_sequence(e).unwrap();
        assert_eq!(ev.free_blocks(), ev.max_blocks(), "{}", s.name);
        let _ = row;
    }
}

/// A pool a few blocks larger than the window streams ten times its size:
/// freed blocks are reused. Without eviction the same pool runs out.
#[test]
fn freed_blocks_are_reused_by_a_small_pool() {
    let s = kivi_spec::presets::kivi2()
        .with_shape(kivi_spec::Heads::Mqa(4), 64)
        .unwrap();
    let w: usize = 300;
    let bt = kivi_spec::layout::default_block_tokens(&s);
    let config = CacheConfig {
        block_tokens: None,
        max_blocks: w.div_ceil(bt) + 3,
    };
    let blocks_total = config.max_blocks * bt;
    let mut rng = Rng::new(9);
    let row = 64;
    let kv = rng.kv(10 * blocks_total, 1, 64, true);
    for evict in [true, false] {
        let mut c = PagedCache::new(s.clone(), config).unwrap();
        c.set_eviction_window(evict.then_some(w)).unwrap();
        let id = c.add_sequence();
        let mut failed = None;
        for t in 0..10 * blocks_total {
            let r = &kv[t * row..(t + 1) * row];
            if let Err(e) = c.append(id, r, r) {
                failed = Some((t, e));
                break;
            }
        }
        if evict {
            assert!(failed.is_none(), "{failed:?}");
            assert_eq!(c.len(id).unwrap(), 10 * blocks_total);
            c.free_sequence(id).unwrap();
            assert_eq!(c.free_blocks(), c.max_blocks());
        } else {
            assert!(matches!(failed, Some((_, Error::OutOfBlocks { .. }))), "{failed:?}");
        }
    }
}

/// Attention that would read an evicted token is refused, never served
/// from freed blocks; the window the cache evicts with is accepted.
#[test]
fn attention_past_the_eviction_window_is_refused() {
    let s = kivi_spec::presets::kivi4()
        .with_shape(kivi_spec::Heads::Gqa { q: 4, kv: 2 }, 32)
        .unwrap();
    let (w, n) = (100, 700);
    let mut rng = Rng::new(1);
    let k = rng.kv(n, 2, 32, true);
    let mut c = cache(&s, Some(w), 800);
    let id = c.add_sequence();
    // Short sequences have evicted nothing: any window reads them.
    c.extend(id, &k[..64 * 64], &k[..64 * 64]).unwrap();
    let q = rng.vec(4 * 32);
    let mut wide = attn(&s, w);
    wide.window = None;
    let cpu = CpuBackend::default();
    for b in [&ReferenceBackend as &dyn Backend, &cpu] {
        b.decode(&c, &[id], &q, wide).unwrap();
    }
    c.extend(id, &k[64 * 64..], &k[64 * 64..]).unwrap();
    let evicted = c.evicted_tokens(id).unwrap();
    assert!(evicted > 0);
    for b in [&ReferenceBackend as &dyn Backend, &cpu] {
        // Eviction frees whole blocks: a window reaching back to the first
        // held token reads, one token further is refused.
        let mut a = attn(&s, w);
        a.window = Some(n - evicted);
        b.decode(&c, &[id], &q, a).unwrap();
        for window in [None, Some(n - evicted + 1), Some(n)] {
            let mut a = attn(&s, w);
            a.window = window;
            let e = b.decode(&c, &[id], &q, a).unwrap_err();
            assert!(
                matches!(e, Error::Evicted { seq, .. } if seq == id),
                "{}: {e}",
                b.name()
            );
        }
        b.decode(&c, &[id], &q, attn(&s, w)).unwrap();
        // A block of new queries is refused too, and leaves the cache as it was.
        let before = (c.len(id).unwrap(), c.memory(), c.free_blocks());
        let blk = NewTokens {
            seq: id,
            q: &q,
            k: &k[..64],
            v: &k[..64],
        };
        let mut a = attn(&s, w);
        a.window = None;
        assert!(matches!(b.attend_block(&mut c, &[blk], a), Err(Error::Evicted { .. })));
        assert_eq!(before, (c.len(id).unwrap(), c.memory(), c.free_blocks()));
    }
    assert!(matches!(c.set_eviction_window(Some(0)), Err(Error::Config(_))));
}

/// Turning eviction on for a long sequence evicts at once; then appends
/// keep it trimmed.
#[test]
fn setting_a_window_on_a_long_sequence_evicts_now() {
    let s = kivi_spec::presets::kivi2()
        .with_shape(kivi_spec::Heads::Mha(2), 32)
        .unwrap();
    let mut rng = Rng::new(4);
    let k = rng.kv(1000, 2, 32, true);
    let mut c = cache(&s, None, 1100);
    let id = c.add_sequence();
    c.extend(id, &k, &k).unwrap();
    let held = c.memory().blocks_in_use;
    c.set_eviction_window(Some(128)).unwrap();
    assert!(c.memory().blocks_in_use < held);
    assert_eq!(c.evicted_tokens(id).unwrap(), (1000 - 128) / 64 * 64);
}

/// Many-query attention on an evicting cache: any cut of a prompt into
/// blocks (one sequence twice in a batch included) gives the plain cache's
/// outputs bit for bit on the reference and CPU backends, then holds what
/// streaming holds; a batch that fails part-way leaves everything as it was.
#[test]
fn blocks_of_new_queries_on_an_evicting_cache() {
    let cpu = CpuBackend::default();
    for s in bound_schemes().into_iter().step_by(3) {
        let shape = s.shape().unwrap();
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let (row, qrow) = (hkv * d, hq * d);
        let w = 90;
        let mut rng = Rng::new(12);
        let n = 1000;
        let k = rng.kv(n, hkv, d, true);
        let v = rng.kv(n, hkv, d, false);
        let q = rng.vec(n * qrow);
        for b in [&ReferenceBackend as &dyn Backend, &cpu] {
            for chunk in [1usize, 7, 33, 128] {
                let mut plain = cache(&s, None, 1100);
                let mut ev = cache(&s, Some(w), 1100);
                let (p, e) = (plain.add_sequence(), ev.add_sequence());
                let mut at = 0;
                while at < n {
                    // Two blocks of the same sequence in one batch.
                    let mid = (at + chunk).min(n);
                    let end = (mid + chunk).min(n);
                    let blocks = |id| {
                        let mut v_ = vec![NewTokens {
                            seq: id,
                            q: &q[at * qrow..mid * qrow],
                            k: &k[at * row..mid * row],
                            v: &v[at * row..mid * row],
                        }];
                        if end > mid {
                            v_.push(NewTokens {
                                seq: id,
                                q: &q[mid * qrow..end * qrow],
                                k: &k[mid * row..end * row],
                                v: &v[mid * row..end * row],
                            });
                        }
                        v_
                    };
                    let a = attn(&s, w);
                    let want = b.attend_block(&mut plain, &blocks(p), a).unwrap();
                    let got = b.attend_block(&mut ev, &blocks(e), a).unwrap();
                    assert_eq!(bits(&got), bits(&want), "{} {} chunk {chunk} at {at}", s.name, b.name());
                    at = end;
                }
                let mut streamed = cache(&s, Some(w), 1100);
                let id = streamed.add_sequence();
                for t in 0..n {
                    streamed
                        .append(id, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
                        .unwrap();
                }
                assert_eq!(ev.memory(), streamed.memory(), "{} chunk {chunk}", s.name);
                assert_eq!(
                    bits(&ev.dequantize(e, Tensor::Key).unwrap()),
                    bits(&streamed.dequantize(id, Tensor::Key).unwrap())
                );
                // A failing batch: a good block, then one with a NaN key.
                let before = (
                    ev.memory(),
                    ev.free_blocks(),
                    ev.evicted_tokens(e).unwrap(),
                    ev.len(e).unwrap(),
                );
                let mut bad = k[..40 * row].to_vec();
                bad[39 * row] = f32::NAN;
                let blocks = [
                    NewTokens {
                        seq: e,
                        q: &q[..40 * qrow],
                        k: &k[..40 * row],
                        v: &v[..40 * row],
                    },
                    NewTokens {
                        seq: e,
                        q: &q[..40 * qrow],
                        k: &bad,
                        v: &v[..40 * row],
                    },
                ];
                assert!(b.attend_block(&mut ev, &blocks, attn(&s, w)).is_err());
                let after = (
                    ev.memory(),
                    ev.free_blocks(),
                    ev.evicted_tokens(e).unwrap(),
                    ev.len(e).unwrap(),
                );
                assert_eq!(before, after, "{} {}", s.name, b.name());
            }
        }
    }
}
