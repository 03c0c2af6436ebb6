//! Sliding-window eviction on the simulated device: the generated decode
//! kernel reads an evicting cache's block tables (their evicted entries
//! filled in, never read) and gives, under the eviction window, the bits
//! it gives on a cache that keeps every token — a batch of sequences at
//! odd lengths, streamed and prefilled, on three head layouts.

mod sim_util;
use kivi_runtime::sim::SimBackend;
use kivi_runtime::{AttnParams, Backend, CacheConfig, Error, PagedCache};
use kivi_spec::{presets, Heads, Scheme};
use sim_util::*;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn check(s: &Scheme, windows: &[usize]) {
    let shape = s.shape().unwrap();
    let row = shape.kv_heads * shape.head_dim;
    let batch = Batch::new(s, &LENS, 17, true);
    let sim = SimBackend::for_cache(&batch.cache, None).unwrap();
    for &w in windows {
        let total: usize = LENS.iter().sum();
        let mut ev = PagedCache::new(s.clone(), CacheConfig::for_tokens(total + 64 * LENS.len() + 64)).unwrap();
        ev.set_eviction_window(Some(w)).unwrap();
        let mut seqs = Vec::new();
        for (i, &t) in LENS.iter().enumerate() {
            let id = ev.add_sequence();
            let (k, v) = (&batch.k[i], &batch.v[i]);
            // Odd sequences streamed, as in `Batch::new`.
            if i % 2 == 1 {
                for p in 0..t {
                    ev.append(id, &k[p * row..(p + 1) * row], &v[p * row..(p + 1) * row])
                        .unwrap();
                }
            } else {
                ev.extend(id, k, v).unwrap();
            }
            seqs.push(id);
        }
        assert!(ev.evicted_tokens(*seqs.last().unwrap()).unwrap() > 0);
        let mut a = AttnParams::of(s, shape);
        a.window = Some(w);
        let want = sim.decode(&batch.cache, &batch.seqs, &batch.q, a).unwrap();
        let got = sim.decode(&ev, &seqs, &batch.q, a).unwrap();
        assert_eq!(bits(&got), bits(&want), "{} w={w}", s.name);
        // Against the oracle too, as every sim test.
        let e = rel_error(&got, &batch.reference(a));
        assert!(e <= 1e-4, "{} w={w}: {e}", s.name);
        // A wider window would read freed blocks: refused.
        a.window = None;
        assert!(matches!(
            sim.decode(&ev, &seqs, &batch.q, a),
            Err(Error::Evicted { .. })
        ));
    }
    report(&format!("sim eviction: {} checked at windows {windows:?}", s.name));
}

#[test]
fn sim_decode_on_an_evicting_cache_is_the_full_cache_bit_for_bit() {
    for (heads, d) in layouts() {
        check(&presets::kivi2().with_shape(heads, d).unwrap(), &[45, 200]);
    }
    let mqa = (Heads::Mqa(4), 256);
    for s in extra_schemes()
        .into_iter()
        .filter(|s| s.name == "sinks" || s.name == "b3")
    {
        check(&s.with_shape(mqa.0, mqa.1).unwrap(), &[130]);
    }
}

/// Many-query attention through the simulated device (the generated block
/// kernel, the host cache the truth): on an evicting cache, any cut of a
/// prompt gives the plain cache's bits, and the cache then holds what
/// streaming into an evicting cache holds.
#[test]
fn sim_block_attention_on_an_evicting_cache_is_the_full_cache_bit_for_bit() {
    use kivi_runtime::device::{DeviceBackend, SimDevice};
    use kivi_runtime::NewTokens;
    let be = DeviceBackend::new(SimDevice::shared());
    let s = presets::kivi2().with_shape(Heads::Mqa(4), 256).unwrap();
    let shape = s.shape().unwrap();
    let (row, qrow) = (shape.kv_heads * shape.head_dim, shape.q_heads * shape.head_dim);
    let (w, n) = (150, 600);
    let mut rng = Rng::new(5);
    let (k, v, q) = (rng.vec(n * row), rng.vec(n * row), rng.vec(n * qrow));
    let mut a = AttnParams::of(&s, shape);
    a.window = Some(w);
    for chunk in [1usize, 33, 128] {
        let mut plain = PagedCache::new(s.clone(), CacheConfig::for_tokens(n + 64)).unwrap();
        let mut ev = PagedCache::new(s.clone(), CacheConfig::for_tokens(n + 64)).unwrap();
        ev.set_eviction_window(Some(w)).unwrap();
        let (p, e) = (plain.add_sequence(), ev.add_sequence());
        let mut at = 0;
        while at < n {
            let end = (at + chunk).min(n);
            let blk = |seq| NewTokens {
                seq,
                q: &q[at * qrow..end * qrow],
                k: &k[at * row..end * row],
                v: &v[at * row..end * row],
            };
            // Streaming decode steps are many: sample them.
            if chunk > 1 || at % 37 == 0 || end == n {
                let want = be.attend_block(&mut plain, &[blk(p)], a).unwrap();
                let got = be.attend_block(&mut ev, &[blk(e)], a).unwrap();
                assert_eq!(bits(&got), bits(&want), "chunk {chunk} at {at}");
            } else {
                plain
                    .extend(p, &k[at * row..end * row], &v[at * row..end * row])
                    .unwrap();
                ev.extend(e, &k[at * row..end * row], &v[at * row..end * row]).unwrap();
            }
            at = end;
        }
        let mut streamed = PagedCache::new(s.clone(), CacheConfig::for_tokens(n + 64)).unwrap();
        streamed.set_eviction_window(Some(w)).unwrap();
        let id = streamed.add_sequence();
        streamed.extend(id, &k, &v).unwrap();
        assert!(ev.evicted_tokens(e).unwrap() > 0);
        assert_eq!(ev.memory(), streamed.memory(), "chunk {chunk}");
    }
    report("sim eviction: block attention checked at chunks 1, 33, 128");
}
