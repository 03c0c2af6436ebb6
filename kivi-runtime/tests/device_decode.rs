//! Decode through the device layer (`DeviceCache` upload, typed launches)
//! against the reference oracle: every preset (and the corner-case schemes
//! of the sim tests) at odd lengths 1, 31, 33, 127, 1000 and an empty
//! sequence, on MHA, GQA 4:1, GQA 7:1, GQA 32:8 and MQA, with and without
//! windows; and every decode variant of every preset on the three main
//! layouts.
//!
//! Runs on the simulated device everywhere (CI) and on GPU 0 where one is
//! usable; without a GPU the GPU half prints `SKIP ...: <reason>`.

mod device_util;
#[path = "sim_util/mod.rs"]
mod sim_util;

use device_util::{backends, gpu_or_skip};
use kivi_runtime::cuda::CudaDevice;
use kivi_runtime::device::DeviceBackend;
use kivi_runtime::AttnParams;
use kivi_spec::{presets, Heads, Scheme};
use kivi_templates::{default_variant, generate, variants, Generated, Kernel};
use sim_util::{extra_schemes, Batch};

const LENS: [usize; 6] = [1, 31, 33, 127, 1000, 0];
const TOL: f32 = 1e-4;

fn layouts() -> Vec<(Heads, u32)> {
    vec![
        (Heads::Mha(8), 64),
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Gqa { q: 14, kv: 2 }, 128),
        (Heads::Gqa { q: 32, kv: 8 }, 128),
        (Heads::Mqa(4), 256),
    ]
}

fn schemes_at(heads: Heads, d: u32) -> Vec<Scheme> {
    presets::all()
        .into_iter()
        .chain(extra_schemes())
        .filter_map(|s| s.with_shape(heads, d).ok())
        .collect()
}

fn default_kernels() -> Vec<Generated> {
    let mut out = Vec::new();
    for (h, d) in layouts() {
        for s in schemes_at(h, d) {
            out.push(generate(&s, Kernel::Decode, &default_variant(&s, Kernel::Decode)).unwrap());
        }
    }
    out
}

#[test]
fn default_variant_matches_reference_everywhere() {
    for dev in backends("default_variant", default_kernels) {
        default_variant_on(&dev);
    }
}

fn default_variant_on(cuda: &DeviceBackend) {
    let mut checked = 0;
    let mut worst = 0f32;
    for (heads, d) in layouts() {
        for (i, s) in schemes_at(heads, d).iter().enumerate() {
            let b = Batch::new(s, &LENS, 7 + i as u64, true);
            let attn = AttnParams::of(s, s.shape().unwrap());
            let want = b.reference(attn);
            let e = b.rel_error(cuda, attn, &want);
            assert!(
                e <= TOL,
                "{} {heads} d{d}: relative error {e} (lengths {LENS:?})",
                s.name
            );
            // the empty sequence attends to nothing: its output is exactly zero
            let got = cuda_decode(cuda, &b, attn);
            let per = s.shape().unwrap().q_heads * d as usize;
            assert!(
                got[5 * per..6 * per].iter().all(|x| *x == 0.0),
                "{}: empty sequence",
                s.name
            );
            worst = worst.max(e);
            checked += 1;
        }
    }
    println!(
        "{}: {checked} scheme/layout pairs agree with the reference (worst relative error {worst:.2e})",
        cuda.device().kind().name()
    );
}

fn cuda_decode(cuda: &DeviceBackend, b: &Batch, attn: AttnParams) -> Vec<f32> {
    use kivi_runtime::Backend;
    cuda.decode(&b.cache, &b.seqs, &b.q, attn).unwrap()
}

fn all_variant_kernels() -> Vec<Generated> {
    let mut out = Vec::new();
    for (h, d) in sim_util::layouts() {
        for p in presets::all() {
            let s = p.with_shape(h, d).unwrap();
            for v in variants(&s, Kernel::Decode) {
                out.push(generate(&s, Kernel::Decode, &v).unwrap());
            }
        }
    }
    out
}

/// On a GPU. (On the simulated device, `sim_variants` runs every variant
/// through the same `DeviceCache` path.)
#[test]
fn cuda_every_decode_variant_matches_reference() {
    let Some(dev) = gpu_or_skip("cuda_every_variant", all_variant_kernels) else {
        return;
    };
    let cuda = DeviceBackend::new(dev);
    let mut n = 0;
    let mut worst = 0f32;
    for (heads, d) in sim_util::layouts() {
        for (i, p) in presets::all().iter().enumerate() {
            let s = p.with_shape(heads, d).unwrap();
            let b = Batch::new(&s, &[1, 33, 301, 1000], 100 + i as u64, true);
            let attn = AttnParams::of(&s, s.shape().unwrap());
            let want = b.reference(attn);
            for v in variants(&s, Kernel::Decode) {
                let backend = cuda.clone().with_variant(Some(v));
                let e = b.rel_error(&backend, attn, &want);
                assert!(e <= TOL, "{} {heads} d{d} {}: relative error {e}", s.name, v.name());
                worst = worst.max(e);
                n += 1;
            }
        }
    }
    println!("cuda: {n} decode variants agree with the reference (worst relative error {worst:.2e})");
}

/// Windows, no window and scale overrides. The CUDA host code once passed
/// a window of 0 for "no window", which the kernel reads as "the last 0
/// tokens": every decode without a window returned zeros. The no-window
/// cases here fail on that code, on the simulated device too.
#[test]
fn sliding_window_no_window_and_scale_override() {
    for dev in backends("window", default_kernels) {
        windows_on(&dev);
    }
}

fn windows_on(cuda: &DeviceBackend) {
    let s = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let b = Batch::new(&s, &[1000, 33, 127], 3, false);
    for attn in [
        AttnParams {
            softmax_scale: 0.125,
            window: None,
        },
        AttnParams {
            softmax_scale: 1.0 / 16.0,
            window: None,
        },
        AttnParams {
            softmax_scale: 1.0 / 16.0,
            window: Some(100),
        },
        AttnParams {
            softmax_scale: 0.3,
            window: Some(1),
        },
        AttnParams {
            softmax_scale: 0.125,
            window: Some(5000),
        },
    ] {
        let want = b.reference(attn);
        assert!(want.iter().any(|x| x.abs() > 1e-3), "a reference that is not all zeros");
        let e = b.rel_error(cuda, attn, &want);
        assert!(e <= TOL, "{attn:?}: relative error {e}");
    }
    // A window of zero tokens attends to nothing.
    let zero = AttnParams {
        softmax_scale: 0.125,
        window: Some(0),
    };
    let got = cuda_decode(cuda, &b, zero);
    assert!(got.iter().all(|x| *x == 0.0));
}

#[test]
fn bad_input_is_an_error_not_a_crash() {
    // a layout of `layouts()`, so the bundle's precompiled kernels cover it
    for cuda in backends("bad_input", default_kernels) {
        bad_input_on(&cuda);
    }
}

fn bad_input_on(cuda: &DeviceBackend) {
    use kivi_runtime::Backend;
    let s = presets::kivi4().with_shape(Heads::Mha(8), 64).unwrap();
    let b = Batch::new(&s, &[40], 1, false);
    let attn = AttnParams::of(&s, s.shape().unwrap());
    assert!(cuda.decode(&b.cache, &b.seqs, &b.q[1..], attn).is_err());
    let mut q = b.q.clone();
    q[3] = f32::NAN;
    assert!(cuda.decode(&b.cache, &b.seqs, &q, attn).is_err());
    assert!(cuda.decode(&b.cache, &[99], &b.q, attn).is_err());
}

/// Without a GPU the backend reports why, as a typed error.
#[test]
fn cuda_unavailable_is_typed() {
    match CudaDevice::new(0) {
        Ok(_) => println!("a GPU is present; nothing to check"),
        Err(e) => {
            assert!(
                matches!(e, kivi_runtime::Error::Unavailable { backend: "cuda", .. }),
                "{e}"
            );
            assert!(!e.to_string().is_empty());
            println!("no GPU here, as expected: {e}");
        }
    }
}

/// Every decode variant on shapes no preset is bound to (GQA 7:1 at
/// head_dim 80, MHA 3 at 96), for a channel-axis 2-bit, a token-axis 4-bit
/// and an 8-bit scheme, at odd lengths.
#[test]
fn every_decode_variant_on_odd_shapes() {
    let cases = || {
        let mut out = Vec::new();
        for (h, d) in [(Heads::Gqa { q: 7, kv: 1 }, 80u32), (Heads::Mha(3), 96)] {
            for p in [presets::kivi2(), presets::tok4(), presets::int8()] {
                if let Ok(s) = p.with_shape(h, d) {
                    out.push(s);
                }
            }
        }
        out
    };
    let gens = || {
        cases()
            .iter()
            .flat_map(|s| {
                variants(s, Kernel::Decode)
                    .into_iter()
                    .map(|v| generate(s, Kernel::Decode, &v).unwrap())
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    };
    for be in backends("odd_shapes", gens) {
        let all = gens();
        be.device().load_many(&all.iter().collect::<Vec<_>>()).unwrap();
        let mut n = 0;
        for (i, s) in cases().iter().enumerate() {
            let b = Batch::new(s, &[1, 31, 127], 300 + i as u64, true);
            let attn = AttnParams::of(s, s.shape().unwrap());
            let want = b.reference(attn);
            for v in variants(s, Kernel::Decode) {
                let e = b.rel_error(&be.clone().with_variant(Some(v)), attn, &want);
                assert!(e <= TOL, "{} {:?} {}: relative error {e}", s.name, s.heads, v.name());
                n += 1;
            }
        }
        sim_util::report(&format!(
            "{}: {n} decode variants on GQA 7:1 d80 / MHA 3 d96 agree with the reference",
            be.device().kind().name()
        ));
        assert!(n >= 40, "{n}");
    }
}
