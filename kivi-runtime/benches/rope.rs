//! Pre-RoPE keys on the CPU: what turning each cached key costs, and which
//! side should turn (`cargo bench -p kivi-runtime --bench rope -- [context] [reps]`).
//!
//! For each layout (Gemma 3's MQA 4:1 d256, Llama's GQA 32:8 d128) it times,
//! interleaved rep by rep on one cache's data: kivi2 as the model hands
//! keys over (post-RoPE, the fused path), kivi2 with `rope: pre` rotating
//! each dequantized key row (the default), and the same rotating the query
//! of every head by the opposite angle per token. Prints medians and the
//! ratios side by side.
//!
//! Columns: kivi2 post-RoPE (fused), pre-RoPE on the vector path (the
//! default, `<isa>-vec+rope`), pre-RoPE on the row reader (the path before
//! it, `<isa>+rope`), pre-RoPE with the query turned. Each is the median of
//! wall time and of process CPU time (all threads' run time from
//! `/proc/self/task/*/schedstat`, which a loaded machine inflates less).
//! `ONLY=j` runs column `j` alone (0-3; for `perf record`); a third
//! argument `avx2` caps the backend at AVX2.

use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, PagedCache};
use kivi_spec::{presets, Heads, Rope, RopeStyle};
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let context: usize = args.first().and_then(|s| s.parse().ok()).unwrap_or(4096);
    let reps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(20);
    for (name, heads, d) in [
        ("mqa4 d256", Heads::Mqa(4), 256u32),
        ("gqa32:8 d128", Heads::Gqa { q: 32, kv: 8 }, 128),
    ] {
        let post = presets::kivi2().with_shape(heads, d).unwrap();
        let mut pre = post.clone();
        pre.rope = Some(Rope {
            theta: 10_000.0,
            style: RopeStyle::Half,
            scaling: 1.0,
        });
        let shape = post.shape().unwrap();
        let (hq, hkv, d) = (shape.q_heads, shape.kv_heads, shape.head_dim);
        let mut rng = kivi_runtime::rand::Rng::new(7);
        let k: Vec<f32> = (0..context * hkv * d)
            .map(|i| (i % d % 5) as f32 * 0.5 - 1.0 + rng.f32())
            .collect();
        let v: Vec<f32> = (0..context * hkv * d).map(|_| rng.f32()).collect();
        let q: Vec<f32> = (0..hq * d).map(|_| rng.f32()).collect();
        let fill = |s: &kivi_spec::Scheme| {
            let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(context + 64)).unwrap();
            let id = c.add_sequence();
            c.extend(id, &k, &v).unwrap();
            (c, id)
        };
        let (cpost, ipost) = fill(&post);
        let (cpre, ipre) = fill(&pre);
        let cpu = if args.get(2).is_some_and(|a| a == "avx2") {
            CpuBackend::new(kivi_runtime::CpuParams {
                avx512: false,
                ..Default::default()
            })
            .unwrap()
        } else {
            CpuBackend::default()
        };
        let attn = AttnParams::of(&post, shape);
        let mut t = vec![Vec::new(); 4];
        let mut ct = vec![Vec::new(); 4];
        let mut paths = [""; 4];
        for _ in 0..reps {
            for j in 0..4 {
                if std::env::var("ONLY").is_ok_and(|o| o != j.to_string()) {
                    continue;
                }
                let (c, id) = if j == 0 { (&cpost, ipost) } else { (&cpre, ipre) };
                kivi_runtime::cpu::set_rope_strategy(j == 3);
                kivi_runtime::cpu::set_rope_vector(j != 2);
                paths[j] = cpu.kernel_path(c);
                let (t0, c0) = (Instant::now(), cpu_ns());
                std::hint::black_box(cpu.decode(c, &[id], &q, attn).unwrap());
                ct[j].push(cpu_ns().saturating_sub(c0) as f64 / 1e6);
                t[j].push(t0.elapsed().as_secs_f64() * 1e3);
            }
        }
        kivi_runtime::cpu::set_rope_strategy(false);
        kivi_runtime::cpu::set_rope_vector(true);
        let med = |v: &mut Vec<Vec<f64>>| -> Vec<f64> {
            v.iter_mut()
                .map(|x| {
                    x.sort_by(f64::total_cmp);
                    x.get(x.len() / 2).copied().unwrap_or(0.0)
                })
                .collect()
        };
        let (w, c) = (med(&mut t), med(&mut ct));
        let what = [
            "kivi2 post-RoPE",
            "pre-RoPE vector",
            "pre-RoPE rows",
            "pre-RoPE query turned",
        ];
        println!(
            "{name} context {context} {} (medians of {reps}; wall ms / CPU ms / CPU ratio to kivi2):",
            cpu.kernel_path(&cpost)
        );
        for j in 0..4 {
            println!(
                "  {:<22} {:<20} {:>9.3} {:>9.3} {:>7.2}x",
                what[j],
                paths[j],
                w[j],
                c[j],
                c[j] / c[0]
            );
        }
    }
}

/// Run time of all this process's threads so far, in ns (0 where
/// `/proc` has no schedstat).
fn cpu_ns() -> u64 {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next().and_then(|x| x.parse::<u64>().ok()))
        .sum()
}
