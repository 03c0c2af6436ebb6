//! The generated prefill and append kernels, run by `sim`, write exactly
//! the words `PagedCache` writes: blocks (codes, scales, zero points, raw
//! rows), sink buffers and window rings, bit for bit.

mod sim_util;

use kivi_runtime::sim::{compile, SeqState, SimExtend, SimLibrary};
use kivi_spec::{presets, Heads, Scheme};
use kivi_templates::{default_variant, generate, Generated, Kernel};
use sim_util::*;
use std::sync::Arc;

fn shapes() -> [(Heads, u32); 3] {
    [
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Mqa(4), 256),
        (Heads::Mha(3), 48),
    ]
}

fn schemes() -> Vec<Scheme> {
    let mut v = presets::all();
    v.extend(extra_schemes());
    v
}

/// Prefill of a batch of unequal lengths equals `PagedCache::extend`.
fn check_prefill(s: &Scheme, kernel: &SimExtend, lens: &[usize], seed: u64) {
    let mut b = PrefillBatch::new(s, lens, seed);
    let status = b.run(kernel).unwrap();
    assert!(status.iter().all(|x| !x), "{}: overflow reported", s.name);
    assert!(
        b.pool == b.cache.pool(),
        "{}: prefill pool words differ from PagedCache ({})",
        s.name,
        kernel.generated().name
    );
    for (st, &id) in b.states.iter().zip(&b.ids) {
        assert_eq!(
            *st,
            SeqState::of(&b.cache, id).unwrap(),
            "{}: prefill windows differ",
            s.name
        );
    }
}

/// Appending one token at a time to a batch equals `PagedCache::append`,
/// through every flush of the window.
fn check_append(s: &Scheme, kernel: &SimExtend, starts: &[usize], steps: usize, seed: u64) {
    let mut b = AppendBatch::new(s, starts, 4096, seed);
    for step in 0..steps {
        let mut st = b.step();
        st.run(kernel).unwrap();
        assert!(
            st.pool == b.cache.pool(),
            "{}: append step {step}: pool words differ",
            s.name
        );
        for (state, &id) in st.states.iter().zip(&b.ids) {
            assert_eq!(
                *state,
                SeqState::of(&b.cache, id).unwrap(),
                "{}: append step {step}: windows differ",
                s.name
            );
        }
    }
}

/// Every scheme bound to every shape it fits, with its kernel generated;
/// all compiled into one library (one compiler run per test).
fn kernels(kernel: Kernel, shapes: &[(Heads, u32)]) -> (Vec<(Scheme, Generated)>, Arc<SimLibrary>) {
    let mut out = Vec::new();
    for &(heads, d) in shapes {
        for s in schemes() {
            let Ok(s) = s.with_shape(heads, d) else { continue };
            let g = generate(&s, kernel, &default_variant(&s, kernel)).unwrap();
            out.push((s, g));
        }
    }
    let lib = compile(&out.iter().map(|(_, g)| g).collect::<Vec<_>>()).unwrap();
    (out, lib)
}

#[test]
fn sim_prefill_equals_paged_cache_bit_for_bit() {
    let (ks, lib) = kernels(Kernel::Prefill, &shapes());
    for (i, (s, g)) in ks.iter().enumerate() {
        let runner = SimExtend::with_library(s, g.clone(), lib.clone()).unwrap();
        check_prefill(s, &runner, &[1, 31, 33, 127, 300], 11 + i as u64);
    }
    report(&format!(
        "sim: prefill kernels of {} scheme/shape pairs wrote PagedCache's words bit for bit",
        ks.len()
    ));
    assert!(ks.len() >= 35);
}

#[test]
fn sim_append_equals_paged_cache_bit_for_bit() {
    let (ks, lib) = kernels(Kernel::Append, &[(Heads::Gqa { q: 8, kv: 2 }, 64), (Heads::Mha(3), 48)]);
    for (i, (s, g)) in ks.iter().enumerate() {
        let runner = SimExtend::with_library(s, g.clone(), lib.clone()).unwrap();
        // 0, 1 and 150 tokens in, then enough steps to flush channel groups
        // and chunked windows at least once.
        check_append(s, &runner, &[0, 1, 150], 140, 7 + i as u64);
    }
    report(&format!(
        "sim: append kernels of {} scheme/shape pairs wrote PagedCache's words bit for bit at every step",
        ks.len()
    ));
    assert!(ks.len() >= 20);
}
