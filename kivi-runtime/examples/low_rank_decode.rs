//! What the host projection costs a low-rank decode step, side by side in
//! one process: `LowRankCache::decode` (project the query, decode the
//! R-wide coordinates, reconstruct the output) against the coordinate
//! cache's decode alone (what a device runs; the difference is the host
//! work `DeviceLowRankCache` adds per step) and against a full-width cache
//! of the same codec (kivi2 at head_dim D).
//!
//! With `pca(..., residual = N)` (`N` > 0, default 8) a fourth cache of the
//! same rows keeps each head's N worst-reconstructed tokens exactly: its
//! step (the coordinate decode with the kept tokens left out, the host
//! merge) and its coordinate decode alone (`Backend::decode_partial`) are
//! timed too.
//!
//! `cargo run --release -p kivi-runtime --example low_rank_decode [CONTEXT] [REPS] [N]`
//!
//! GQA 32:8, D 128, R 64, keys 2-bit per channel (g32), values 2-bit per
//! token (g32), residual 128, one sequence, the default CPU backend. The
//! calls alternate rep by rep (so load on a shared machine hits them
//! alike); medians and minima are printed.

use kivi_runtime::low_rank::{Bases, LowRankCache};
use kivi_runtime::{AttnParams, Backend, CacheConfig, CpuBackend, PagedCache};
use kivi_spec::{parse_scheme, Heads};
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let context: usize = args.next().and_then(|x| x.parse().ok()).unwrap_or(32768);
    let reps: usize = args.next().and_then(|x| x.parse().ok()).unwrap_or(21);
    let n_keep: usize = args.next().and_then(|x| x.parse().ok()).unwrap_or(8);
    let (hq, h, d, r) = (32usize, 8usize, 128usize, 64usize);
    let codecs = "key: quant(bits = 2, axis = channel, group = 32), value: quant(bits = 2, axis = token, group = 32), residual: 128";
    let heads = Heads::Gqa {
        q: hq as u32,
        kv: h as u32,
    };
    let lr = parse_scheme(&format!(
        "lr {{ {codecs}, low_rank: pca(rank = {r}, apply = [key, value]) }}"
    ))
    .unwrap()
    .with_shape(heads, d as u32)
    .unwrap();
    let full = parse_scheme(&format!("kivi2 {{ {codecs} }}"))
        .unwrap()
        .with_shape(heads, d as u32)
        .unwrap();
    // Any orthonormal rows time the same: the first R unit vectors.
    let unit: Vec<f32> = (0..h * r * d)
        .map(|i| if i % d == (i / d) % r { 1.0 } else { 0.0 })
        .collect();
    let bases = Bases::new(&lr, unit.clone(), unit).unwrap();
    let cfg = CacheConfig::for_tokens(context + 256);
    let mut low = LowRankCache::with_bases(lr.clone(), cfg, bases.clone()).unwrap();
    let mut lr_n = lr.clone();
    lr_n.low_rank.as_mut().unwrap().residual = n_keep.max(1) as u32;
    let mut kept = LowRankCache::with_bases(lr_n, cfg, bases).unwrap();
    let c = kept.add_sequence();
    let mut plain = PagedCache::new(full.clone(), cfg).unwrap();
    let (a, b) = (low.add_sequence(), plain.add_sequence());
    let mut rng = kivi_runtime::rand::Rng::new(1);
    let chunk = 1024;
    let mut done = 0;
    let fill = Instant::now();
    while done < context {
        let n = chunk.min(context - done);
        let (k, v) = (rng.vec(n * h * d), rng.vec(n * h * d));
        low.extend(a, &k, &v).unwrap();
        plain.extend(b, &k, &v).unwrap();
        kept.extend(c, &k, &v).unwrap();
        done += n;
    }
    let fill_s = fill.elapsed().as_secs_f64();
    let be = CpuBackend::default();
    let q = rng.vec(hq * d);
    let attn = AttnParams::of(&lr, lr.shape().unwrap());
    let qp = rng.vec(hq * r);
    let (mut t_low, mut t_coords, mut t_full) = (Vec::new(), Vec::new(), Vec::new());
    let (mut t_kept, mut t_part) = (Vec::new(), Vec::new());
    // The positions the residual cache leaves out of its coordinate decode.
    let skip = vec![kept.kept_positions(c).unwrap()];
    for _ in 0..reps {
        let t = Instant::now();
        std::hint::black_box(kept.decode(&be, &[c], &q, attn).unwrap());
        t_kept.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        std::hint::black_box(be.decode_partial(kept.coordinates(), &[c], &qp, attn, &skip).unwrap());
        t_part.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        std::hint::black_box(low.decode(&be, &[a], &q, attn).unwrap());
        t_low.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        std::hint::black_box(be.decode(low.coordinates(), &[a], &qp, attn).unwrap());
        t_coords.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        std::hint::black_box(
            be.decode(&plain, &[b], &q, AttnParams::of(&full, full.shape().unwrap()))
                .unwrap(),
        );
        t_full.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mins: Vec<f64> = [&t_low, &t_coords, &t_full, &t_kept, &t_part]
        .iter()
        .map(|v| v.iter().copied().fold(f64::INFINITY, f64::min))
        .collect();
    let (k, kp) = (median(t_kept), median(t_part));
    let (l, c, f) = (median(t_low), median(t_coords), median(t_full));
    println!(
        "context {context}, GQA {hq}:{h}, D {d}, R {r}, 2-bit keys/values, {reps} reps (fill of both caches {fill_s:.1} s)"
    );
    println!("  low-rank decode (project + coordinates + reconstruct) {l:8.3} ms");
    println!(
        "  coordinate decode alone                               {c:8.3} ms   (host projection + reconstruction {:.3} ms, {:.0}% of the step)",
        l - c,
        100.0 * (l - c) / l
    );
    println!(
        "  full-width kivi2 decode (D {d})                         {f:8.3} ms   (low-rank / kivi2 {:.2}x)",
        l / f
    );
    println!(
        "  residual = {n_keep}: low-rank step                      {k:8.3} ms   (vs residual 0: {:.2}x; {} positions left out per head)",
        k / l,
        skip[0].iter().map(Vec::len).max().unwrap_or(0)
    );
    println!(
        "  residual = {n_keep}: coordinate decode alone (partial)  {kp:8.3} ms   (host scoring + merge {:.3} ms)",
        k - kp
    );
    println!(
        "  minima: step {:.3}, coordinates {:.3}, kivi2 {:.3}, residual step {:.3}, residual coordinates {:.3} ms",
        mins[0], mins[1], mins[2], mins[3], mins[4]
    );
    let (ml, mf) = (low.memory(), plain.memory());
    println!(
        "  memory: low-rank {} bytes (bases {}), kivi2 {} bytes ({:.2}x smaller)",
        ml.total,
        ml.bases,
        mf.total,
        mf.total as f64 / ml.total as f64
    );
}
