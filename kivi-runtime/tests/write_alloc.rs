//! Appends allocate nothing per token once a sequence is warm: counted by
//! a global allocator, on this thread (appends run on the caller's
//! thread). What may still allocate is amortised growth (a block table
//! doubling), a few times over hundreds of tokens.

use kivi_runtime::cpu::Isa;
use kivi_runtime::{CacheConfig, PagedCache};
use kivi_spec::{presets, Heads};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

struct Counting;

thread_local! {
    static ALLOCS: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.with(|n| n.set(n.get() + 1));
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, size: usize) -> *mut u8 {
        ALLOCS.with(|n| n.set(n.get() + 1));
        System.realloc(p, l, size)
    }
}

#[global_allocator]
static A: Counting = Counting;

fn allocs() -> usize {
    ALLOCS.with(|n| n.get())
}

#[test]
fn appends_do_not_allocate_per_token() {
    let cases = [
        ("kivi2", Heads::Gqa { q: 8, kv: 2 }, 128),
        ("int8", Heads::Gqa { q: 8, kv: 2 }, 128),
        ("tok4", Heads::Mha(2), 64),
        ("f16", Heads::Gqa { q: 8, kv: 2 }, 128),
        ("codec2", Heads::Mqa(4), 256),
        ("codec15", Heads::Mqa(4), 256),
    ];
    for (name, heads, d) in cases {
        let s = presets::by_name(name).unwrap().with_shape(heads, d).unwrap();
        let row = s.shape().unwrap().kv_heads * d as usize;
        let (warm, n) = (300, 512);
        let k: Vec<f32> = (0..(warm + n) * row)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        let v: Vec<f32> = (0..(warm + n) * row)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 30.0)
            .collect();
        let mut c = PagedCache::new(s, CacheConfig::for_tokens(warm + n + 64)).unwrap();
        c.set_write_isa(Some(Isa::Avx512));
        let id = c.add_sequence();
        for t in 0..warm {
            c.append(id, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
                .unwrap();
        }
        let before = allocs();
        for t in warm..warm + n {
            c.append(id, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
                .unwrap();
        }
        let got = allocs() - before;
        // The vectorised writes ran (the reference path allocates per row).
        assert_eq!(c.last_write_path(), c.write_isa(), "{name}");
        assert!(got <= 8, "{name}: {got} allocations in {n} appends");
    }
}

/// The same for channel-axis table keys (issue 12's `pk128mp_v1nuq_o2`:
/// pinned minmax `nuq` keys, pre-RoPE, with `l2` `nuq` values), whose
/// channel groups buffer `G` rows per thread, grown once.
#[test]
fn channel_table_key_appends_do_not_allocate_per_token() {
    use kivi_runtime::calib::{fit_key, Calibration, Entry, Kind, ModelId, Stage};
    use kivi_spec::Tensor;
    let s = kivi_spec::parse_scheme(
        "pk128mp_v1nuq_o2 { key: quant(bits = 2, axis = channel, group = 128, levels = nuq, norm = minmax_pinned),
           value: quant(bits = 1, axis = token, group = 256, levels = nuq, norm = l2),
           rotation: hadamard(block = 256, apply = [value]), outliers: sparse(per_token = 2, apply = [value]),
           residual: 128, sinks: 4, rope: pre(theta = 10000, style = half) }",
    )
    .unwrap()
    .with_shape(Heads::Mqa(4), 256)
    .unwrap();
    let mut cal = Calibration::new(
        ModelId {
            name: "test".into(),
            layers: 1,
            kv_heads: 1,
            head_dim: 256,
        },
        "written by the test",
    );
    for (t, data) in [
        (Tensor::Key, vec![0.0, 0.3, 0.7, 1.0]),
        (Tensor::Value, vec![-1.0, 1.0]),
    ] {
        let n = data.len() as u32;
        cal.insert(Entry {
            layer: 0,
            tensor: t,
            stage: Stage::of(&s, t),
            kind: Kind::Codebook,
            fit: fit_key(&s, t).unwrap(),
            shape: vec![n],
            data,
        })
        .unwrap();
    }
    let row = 256;
    let (warm, n) = (300, 512);
    let k: Vec<f32> = (0..(warm + n) * row)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
        .collect();
    let v: Vec<f32> = (0..(warm + n) * row)
        .map(|i| ((i * 53 % 97) as f32 - 48.0) / 30.0)
        .collect();
    let mut c = PagedCache::with_calibration(s, CacheConfig::for_tokens(warm + n + 64), &cal, 0).unwrap();
    c.set_write_isa(Some(Isa::Avx512));
    let id = c.add_sequence();
    for t in 0..warm {
        c.append(id, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
            .unwrap();
    }
    let before = allocs();
    for t in warm..warm + n {
        c.append(id, &k[t * row..(t + 1) * row], &v[t * row..(t + 1) * row])
            .unwrap();
    }
    let got = allocs() - before;
    assert_eq!(c.last_write_path(), c.write_isa());
    // Four channel groups (128 tokens each) left the window in these appends.
    assert!(got <= 8, "{got} allocations in {n} appends");
}
