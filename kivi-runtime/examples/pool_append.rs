//! Appends on a cache that draws on a shared [`BlockPool`] against the same
//! cache on its own blocks alone, side by side in one process: the pool's
//! charge (one compare-and-swap per fresh block, one add per freed block)
//! must not make writes slower.
//!
//! `cargo run --release -p kivi-runtime --example pool_append [TOKENS] [REPS]`
//!
//! Each rep fills a new sequence with TOKENS tokens one append a call, then
//! another by extends of 512 tokens; the configurations alternate rep by
//! rep (so load on a shared machine hits them alike) and the medians are
//! printed: wall time, and for appends the main thread's CPU time
//! (`/proc/thread-self/schedstat`; appends of one token run on it).

use kivi_runtime::pool::BlockPool;
use kivi_runtime::{CacheConfig, PagedCache};
use kivi_spec::{presets, Heads, Scheme};
use std::time::Instant;

fn thread_cpu_ns() -> u64 {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|x| x.parse().ok()))
        .unwrap_or(0)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// One rep: (append wall s, append thread-CPU s, extend wall s).
fn rep(s: &Scheme, tokens: usize, pool: Option<&BlockPool>, window: Option<usize>, rows: &[f32]) -> (f64, f64, f64) {
    let row = s.shape().unwrap().kv_heads * s.shape().unwrap().head_dim;
    let mk = || {
        let mut c = PagedCache::new(s.clone(), CacheConfig::for_tokens(tokens)).unwrap();
        c.set_eviction_window(window).unwrap();
        c.set_pool(pool.cloned()).unwrap();
        c
    };
    let mut c = mk();
    let id = c.add_sequence();
    let (t0, c0) = (Instant::now(), thread_cpu_ns());
    for t in 0..tokens {
        let x = &rows[(t % 1024) * row..][..row];
        c.append(id, x, x).unwrap();
    }
    let (aw, ac) = (t0.elapsed().as_secs_f64(), (thread_cpu_ns() - c0) as f64 * 1e-9);
    drop(c);
    let mut c = mk();
    let id = c.add_sequence();
    let t0 = Instant::now();
    for _ in 0..tokens / 512 {
        c.extend(id, &rows[..512 * row], &rows[..512 * row]).unwrap();
    }
    (aw, ac, t0.elapsed().as_secs_f64())
}

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let tokens = args.first().copied().unwrap_or(8192).max(512);
    let reps = args.get(1).copied().unwrap_or(7).max(1);
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l[l.find(':').unwrap() + 2..].to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    println!("# pool_append: {tokens} tokens, median of {reps} reps; cpu: {cpu}");
    println!(
        "{:<14} {:<7} {:<8} {:>14} {:>14} {:>8} {:>14} {:>14} {:>8} {:>14} {:>14} {:>8}",
        "layout",
        "scheme",
        "window",
        "append own",
        "append pool",
        "ratio",
        "cpu own",
        "cpu pool",
        "ratio",
        "extend own",
        "extend pool",
        "ratio"
    );
    for (heads, d, lname) in [
        (Heads::Mqa(4), 256, "mqa4:1/d256"),
        (Heads::Gqa { q: 32, kv: 8 }, 128, "gqa32:8/d128"),
    ] {
        for base in [presets::kivi2(), presets::kivi4()] {
            let s = base.with_shape(heads, d).unwrap();
            let row = s.shape().unwrap().kv_heads * d as usize;
            let mut rng = kivi_runtime::rand::Rng::new(1);
            let rows = rng.vec(1024 * row);
            for window in [None, Some(512)] {
                // Unbounded: the bench measures the charge, not refusals.
                let pool = BlockPool::new(usize::MAX);
                let mut own = (Vec::new(), Vec::new(), Vec::new());
                let mut pooled = (Vec::new(), Vec::new(), Vec::new());
                rep(&s, 1024, None, window, &rows); // warm-up
                for _ in 0..reps {
                    for (p, out) in [(None, &mut own), (Some(&pool), &mut pooled)] {
                        let (a, c, e) = rep(&s, tokens, p, window, &rows);
                        out.0.push(a);
                        out.1.push(c);
                        out.2.push(e);
                    }
                }
                let tps = |v: Vec<f64>| tokens as f64 / median(v);
                let (ao, co, eo) = (tps(own.0), tps(own.1), tps(own.2));
                let (ap, cp, ep) = (tps(pooled.0), tps(pooled.1), tps(pooled.2));
                println!(
                    "{lname:<14} {:<7} {:<8} {ao:>14.0} {ap:>14.0} {:>8.3} {co:>14.0} {cp:>14.0} {:>8.3} {eo:>14.0} {ep:>14.0} {:>8.3}",
                    base.name,
                    window.map_or("-".into(), |w| w.to_string()),
                    ap / ao,
                    cp / co,
                    ep / eo
                );
            }
        }
    }
    println!(
        "note: tokens/s; ratio = pool / own (1.0: no cost); cpu = tokens per second of the main thread's CPU time"
    );
}
