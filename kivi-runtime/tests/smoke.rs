use kivi_runtime::*;
use kivi_spec::{presets, Heads, Tensor};

#[test]
fn smoke_cache_matches_reference() {
    let s = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let t = 300;
    let mut rng = rand::Rng::new(7);
    let k: Vec<f32> = (0..t * 2 * 64).map(|_| rng.f32()).collect();
    let v: Vec<f32> = (0..t * 2 * 64).map(|_| rng.f32()).collect();
    let q: Vec<f32> = (0..8 * 64).map(|_| rng.f32()).collect();
    let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(1000)).unwrap();
    let a = c.add_sequence();
    for i in 0..t {
        c.append(a, &k[i * 128..(i + 1) * 128], &v[i * 128..(i + 1) * 128])
            .unwrap();
    }
    let b = c.add_sequence();
    c.extend(b, &k, &v).unwrap();
    let rk = reference::cache_view(&s, Tensor::Key, &k).unwrap();
    assert_eq!(c.dequantize(a, Tensor::Key).unwrap(), rk);
    assert_eq!(c.dequantize(b, Tensor::Key).unwrap(), rk);
    let rv = reference::cache_view(&s, Tensor::Value, &v).unwrap();
    assert_eq!(c.dequantize(a, Tensor::Value).unwrap(), rv);
    let shape = s.shape().unwrap();
    let ap = AttnParams::of(&s, shape);
    let want = reference::attend(&s, &q, &k, &v, ap).unwrap();
    let got = CpuBackend::default().decode(&c, &[a], &q, ap).unwrap();
    let err = want.iter().zip(&got).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(err < 1e-5, "{err}");
}
