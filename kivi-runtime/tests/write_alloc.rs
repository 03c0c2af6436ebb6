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
