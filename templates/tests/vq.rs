//! Generation for `vq(...)` schemes: which templates a source pastes, the
//! codebooks as kernel arguments (never source literals), variants pruned
//! by the lookup tables' shared memory, and refusals by name of what the
//! vq templates leave out.

use kivi_spec::{parse_scheme, presets, Heads, Scheme};
use kivi_templates::{default_kernels, default_variant, generate, variants, GenError, Kernel};

fn vq(text: &str, heads: Heads, d: u32) -> Scheme {
    parse_scheme(text).unwrap().with_shape(heads, d).unwrap()
}

#[test]
fn vq_sources_paste_the_vq_templates_and_take_codebook_arguments() {
    let s = vq(
        "v { key: vq(dim = 8, entries = 256), value: vq(dim = 8, entries = 256), residual: 32 }",
        Heads::Gqa { q: 32, kv: 8 },
        128,
    );
    for k in Kernel::ALL {
        let g = generate(&s, k, &default_variant(&s, k)).unwrap();
        let file = if k == Kernel::Decode {
            "kivi_vq_decode.cuh"
        } else {
            "kivi_vq_extend.cuh"
        };
        assert!(g.source.contains(&format!("// ===== {file} =====")), "{}", g.name);
        let params: Vec<&str> = g.launch.entries[0].params.iter().map(|p| p.name).collect();
        assert!(params.contains(&"book_k") && params.contains(&"book_v"), "{params:?}");
        assert!(!params.contains(&"means_k"), "{params:?}");
        // 8 x 256 x 8 floats per tensor: never written into the source.
        assert!(g.source.len() < 200_000, "{}: {} bytes", g.name, g.source.len());
        assert!(g.name.contains("k.vq.d8.e256-v.vq.d8.e256"), "{}", g.name);
    }
    // Other schemes' sources are what they were: no vq template, no vq lines.
    let k2 = presets::kivi2().with_shape(Heads::Gqa { q: 32, kv: 8 }, 128).unwrap();
    for k in Kernel::ALL {
        let g = generate(&k2, k, &default_variant(&k2, k)).unwrap();
        assert!(!g.source.contains("kivi_vq"), "{}", g.name);
        assert!(!g.source.contains("VSUB"), "{}", g.name);
    }
}

#[test]
fn lookup_tables_bound_the_heads_per_block() {
    // 16 KiB of table per head at D = 128, M = 8, E = 256: two heads fit in
    // 48 KiB of static shared memory, four do not.
    let s = vq(
        "v { key: vq(dim = 8, entries = 256), value: full, residual: 32 }",
        Heads::Gqa { q: 32, kv: 8 },
        128,
    );
    let vs = variants(&s, Kernel::Decode);
    assert!(vs.len() >= 8, "{}", vs.len());
    assert!(vs.iter().all(|v| v.heads_per_block <= 2), "{vs:?}");
    assert!(vs.iter().any(|v| v.heads_per_block == 2));
    assert!(vs.iter().any(|v| v.splits == 2), "fewer splits amortize the table");
    // vq values only: no table; heads bounded by the registers a lane's
    // accumulators take (M per owned sub-vector), as for other codecs.
    let v = vq(
        "v { key: quant(bits = 2, axis = channel, group = 32), value: vq(dim = 8, entries = 256), residual: 32 }",
        Heads::Gqa { q: 32, kv: 8 },
        128,
    );
    assert!(variants(&v, Kernel::Decode).iter().any(|v| v.heads_per_block == 2));
    // A table no block can hold (64 x 4096 floats per head): no decode
    // variant, and the macro embeds no kernel (the CPU backend runs it).
    let big = vq(
        "b { key: vq(dim = 2, entries = 4096), value: full, residual: 32 }",
        Heads::Mqa(4),
        128,
    );
    assert!(variants(&big, Kernel::Decode).is_empty());
    assert!(matches!(
        generate(&big, Kernel::Decode, &default_variant(&big, Kernel::Decode)),
        Err(GenError::InvalidVariant { .. })
    ));
    assert_eq!(default_kernels(&big).unwrap(), Vec::new());
}

#[test]
fn what_the_vq_templates_leave_out_is_refused_by_name() {
    // A rotation of the (quantized) keys next to vq values.
    let s = vq(
        "r { key: quant(bits = 2, axis = token, group = 32), value: vq(dim = 8, entries = 64), \
         rotation: hadamard(block = 64, apply = [key]), residual: 8 }",
        Heads::Mqa(4),
        64,
    );
    let e = generate(&s, Kernel::Decode, &default_variant(&s, Kernel::Decode)).unwrap_err();
    assert!(matches!(e, GenError::Unsupported { .. }), "{e:?}");
    assert!(
        e.to_string().contains("rotation") && e.to_string().contains("vq"),
        "{e}"
    );
    assert_eq!(default_kernels(&s).unwrap(), Vec::new());
    // The many-query block kernel.
    let v = vq(
        "v { key: vq(dim = 4, entries = 16), value: full, residual: 8 }",
        Heads::Mqa(4),
        64,
    );
    let e = kivi_templates::generate_block(&v, Default::default()).unwrap_err();
    assert!(e.to_string().contains("vq"), "{e}");
}
