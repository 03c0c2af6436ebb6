//! `KiviKvCache::from_model` on one block pool: attention is the per-layer
//! pools' bit for bit (odd lengths, MHA/GQA/MQA, sliding and global layers
//! of different schemes), the pool's bytes are exactly the layers' blocks,
//! a pool too small refuses an append with a typed error and changes
//! nothing, and a pool shared by two caches (two sequences) lends one the
//! bytes the other frees.

use candle_core::{Device, Tensor};
use kivi_candle::{Error, KiviKvCache, ModelShape, PoolCapacity};
use kivi_runtime::pool::BlockPool;

const LENS: [usize; 5] = [1, 31, 33, 127, 1000];

fn decl() -> kivi_spec::ModelDecl {
    kivi_spec::parse_model(
        "model small { default: kivi2, global: kivi4, \
         layers[0]: K3 { key: quant(bits = 3, axis = channel, group = 32), value: quant(bits = 3, axis = token, group = 32), residual: 64 } }",
    )
    .unwrap()
}

fn rows(rng: &mut fastrand::Rng, heads: usize, n: usize, d: usize) -> Tensor {
    let v: Vec<f32> = (0..heads * n * d).map(|_| rng.f32() * 4.0 - 2.0).collect();
    Tensor::from_vec(v, (1, heads, n, d), &Device::Cpu).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// The pooled cache and one built layer by layer on per-layer pools
/// (`per_layer` + `set_window`, what `from_model` did before) attend
/// identically at every length, and the pool holds the layers' blocks.
#[test]
fn one_pool_attends_as_per_layer_pools() {
    let windows = [Some(45), Some(45), None, Some(200), None];
    let d = decl();
    let kinds: Vec<_> = windows
        .iter()
        .map(|w| {
            if w.is_some() {
                kivi_spec::LayerKind::Sliding
            } else {
                kivi_spec::LayerKind::Global
            }
        })
        .collect();
    let schemes = d.schemes_for(&kinds).unwrap();
    for (q, kv, hd) in [(2, 2, 32), (8, 2, 64), (4, 1, 64), (7, 1, 32)] {
        let shape = ModelShape {
            layers: windows.len(),
            q_heads: q,
            kv_heads: kv,
            head_dim: hd,
        };
        let mut pooled = KiviKvCache::from_model(&d, shape, &windows, 1100).unwrap();
        let mut own = KiviKvCache::per_layer(&schemes, shape, 1100).unwrap();
        for (l, w) in windows.iter().enumerate() {
            own.set_window(l, *w).unwrap();
        }
        assert!(pooled.pool().is_some() && own.pool().is_none());
        let mut rng = fastrand::Rng::with_seed((q * 100 + kv * 10 + hd) as u64);
        let mut done = 0;
        for &n in &LENS {
            for l in 0..windows.len() {
                let (qs, k, v) = (
                    rows(&mut rng, q, n - done, hd),
                    rows(&mut rng, kv, n - done, hd),
                    rows(&mut rng, kv, n - done, hd),
                );
                let want = own.attend(l, &qs, &k, &v).unwrap();
                let got = pooled.attend(l, &qs, &k, &v).unwrap();
                assert_eq!(bits(&got), bits(&want), "{q}/{kv} d{hd} layer {l} len {n}");
                assert_eq!(pooled.layer_memory(l).unwrap(), own.layer_memory(l).unwrap());
            }
            done = n;
            let pool = pooled.pool_memory().unwrap();
            let blocks: usize = (0..windows.len()).map(|l| pooled.layer_block_bytes(l).unwrap()).sum();
            assert_eq!(pool.used, blocks, "len {n}");
            assert_eq!(pool.used + pool.free, pool.capacity);
        }
        assert_eq!(pooled.memory(), own.memory());
    }
}

/// A pool of a given capacity refuses the append that does not fit, with
/// the runtime's typed error, and the layer keeps its tokens; eviction on
/// the sliding layers is what lets the global layers reach further.
#[test]
fn a_small_pool_refuses_typed_and_eviction_makes_room() {
    let d = decl();
    let shape = ModelShape {
        layers: 4,
        q_heads: 4,
        kv_heads: 1,
        head_dim: 64,
    };
    let windows = [Some(128), Some(128), Some(128), None];
    let mut rng = fastrand::Rng::with_seed(9);
    // The context each cache reaches on a 96 KiB pool, in chunks of 64.
    let mut reached = Vec::new();
    for evict in [false, true] {
        let mut c = KiviKvCache::from_model_pooled(&d, shape, &windows, 8192, PoolCapacity::Bytes(96 << 10)).unwrap();
        for l in 0..3 {
            c.set_eviction(l, evict).unwrap();
        }
        'fill: loop {
            let kv = rows(&mut rng, 1, 64, 64);
            for l in 0..4 {
                let before = (
                    c.seq_len(l).unwrap(),
                    c.layer_memory(l).unwrap(),
                    c.pool_memory().unwrap(),
                );
                if let Err(e) = c.extend(l, &kv, &kv) {
                    assert!(
                        matches!(
                            &e,
                            Error::Cache {
                                source: kivi_runtime::Error::PoolExhausted { .. },
                                ..
                            }
                        ),
                        "{e}"
                    );
                    assert_eq!(
                        (
                            c.seq_len(l).unwrap(),
                            c.layer_memory(l).unwrap(),
                            c.pool_memory().unwrap()
                        ),
                        before
                    );
                    break 'fill;
                }
            }
        }
        reached.push(c.seq_len(3).unwrap());
    }
    assert!(reached[1] > 2 * reached[0], "{reached:?}");
}

/// Two sequences, each a cache, on one shared pool: what one frees (reset)
/// the other can take.
#[test]
fn a_shared_pool_lends_one_sequence_what_another_frees() {
    let d = decl();
    let shape = ModelShape {
        layers: 2,
        q_heads: 4,
        kv_heads: 1,
        head_dim: 64,
    };
    let windows = [Some(64), None];
    let mut rng = fastrand::Rng::with_seed(4);
    let kv = rows(&mut rng, 1, 1500, 64);
    // What the global layer holds after 1500 tokens: the pool has room
    // for one and a half of it.
    let mut probe = KiviKvCache::from_model(&d, shape, &windows, 8192).unwrap();
    probe.extend(1, &kv, &kv).unwrap();
    let global = probe.layer_block_bytes(1).unwrap();
    let pool = BlockPool::new(global + global / 2);
    let mk = || KiviKvCache::from_model_pooled(&d, shape, &windows, 8192, PoolCapacity::Shared(pool.clone())).unwrap();
    let (mut a, mut b) = (mk(), mk());
    assert!(a.pool().unwrap().same_pool(b.pool().unwrap()));
    for l in 0..2 {
        a.extend(l, &kv, &kv).unwrap();
    }
    let e = b.extend(1, &kv, &kv).unwrap_err();
    assert!(e.to_string().contains("block pool exhausted"), "{e}");
    assert_eq!(b.seq_len(1).unwrap(), 0);
    a.reset();
    assert_eq!(pool.memory().used, 0);
    b.extend(1, &kv, &kv).unwrap();
    assert_eq!(pool.memory().used, b.layer_block_bytes(1).unwrap());
    drop(b);
    assert_eq!(pool.memory().used, 0);
}
