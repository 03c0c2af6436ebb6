//! Cache-write throughput behind `kivi bench --writes`: `PagedCache::extend`
//! (one call of many tokens, a prompt) and `PagedCache::append` (one token a
//! call, decoding) per preset, on the vectorised writes and on the reference
//! path (`quant.rs` group by group, what every write ran before) side by
//! side in one run: the two alternate rep by rep, so a drift in the shared
//! machine's speed hits both alike and the ratio holds.
//!
//! GB/s counts the f32 input a write consumes: `2 x Hkv x D x 4` bytes a
//! token (keys and values).

use super::{kv_data, Layout, Stats};
use kivi_runtime::cpu::Isa;
use kivi_runtime::{CacheConfig, PagedCache};
use serde::Serialize;
use std::fmt::Write as _;
use std::time::Instant;

/// One (layout, scheme, write path) row.
#[derive(Clone, Debug, Serialize)]
pub struct WriteRow {
    pub layout: &'static str,
    pub scheme: String,
    /// `avx512`, `avx2`, `scalar` (the vectorised writes), or `reference`.
    pub path: String,
    /// Tokens of one timed `extend`.
    pub extend_tokens: usize,
    /// Median over the reps.
    pub extend_tokens_per_s: f64,
    pub extend_gb_per_s: f64,
    /// Tokens appended one by one per timed rep.
    pub append_tokens: usize,
    pub append_tokens_per_s: f64,
    pub append_gb_per_s: f64,
    /// GB of input per CPU-second of the process (all threads, median):
    /// on a shared machine what a write costs, not how long it waited
    /// for a core.
    pub extend_gb_per_cpu_s: f64,
    pub append_gb_per_cpu_s: f64,
    /// The reference path's median time / this one's (extend, append).
    pub extend_speedup: f64,
    pub append_speedup: f64,
}

/// Everything `--writes` measured.
#[derive(Clone, Debug, Serialize)]
pub struct WriteReport {
    pub command: String,
    pub cpu: String,
    pub threads: usize,
    pub reps: usize,
    pub rows: Vec<WriteRow>,
    pub notes: Vec<String>,
}

/// Per-rep times of extend and append for one cache, each on fresh
/// sequences of a pool whose pages are already touched (a cache in service
/// reuses its blocks), in ms per token.
#[derive(Default)]
struct Timing {
    extend_ms: Vec<f64>,
    append_ms: Vec<f64>,
    extend_cpu_ms: Vec<f64>,
    append_cpu_ms: Vec<f64>,
}

/// A timed rep repeats its write until it has run this long: the process
/// CPU clock (`/proc` schedstat) advances in scheduler ticks, so a shorter
/// span can read as no CPU time at all.
const MIN_REP_MS: f64 = 60.0;

type Write<'a> = dyn FnMut(&mut PagedCache, u64) -> Result<(), String> + 'a;

/// Runs `write` (which writes `tokens` tokens into a new sequence) until
/// [`MIN_REP_MS`] have passed; wall and CPU ms per token.
fn per_token(cache: &mut PagedCache, tokens: usize, write: &mut Write) -> Result<(f64, f64), String> {
    let (t0, c0) = (Instant::now(), super::process_cpu_ns());
    let mut done = 0usize;
    loop {
        for id in cache.sequences() {
            cache.free_sequence(id).map_err(|e| e.to_string())?;
        }
        let id = cache.add_sequence();
        write(cache, id)?;
        done += tokens;
        if t0.elapsed().as_secs_f64() * 1e3 >= MIN_REP_MS {
            break;
        }
    }
    let wall = t0.elapsed().as_secs_f64() * 1e3;
    let cpu = super::process_cpu_ns().saturating_sub(c0) as f64 / 1e6;
    Ok((wall / done as f64, cpu / done as f64))
}

fn time_once(
    cache: &mut PagedCache,
    k: &[f32],
    v: &[f32],
    row: usize,
    appends: usize,
    t: &mut Timing,
) -> Result<(), String> {
    let n = k.len() / row;
    let (w, c) = per_token(cache, n, &mut |c, id| c.extend(id, k, v).map_err(|e| e.to_string()))?;
    t.extend_ms.push(w);
    t.extend_cpu_ms.push(c);
    let (w, c) = per_token(cache, appends, &mut |c, id| {
        for i in 0..appends {
            c.append(id, &k[i * row..(i + 1) * row], &v[i * row..(i + 1) * row])
                .map_err(|e| e.to_string())?;
        }
        Ok(())
    })?;
    t.append_ms.push(w);
    t.append_cpu_ms.push(c);
    Ok(())
}

/// Times every scheme of `schemes` that binds to each layout, both paths.
/// Schemes that do not fit a layout (codec2 needs head_dim 256) are noted.
pub fn run(
    layouts: &[Layout],
    schemes: &[String],
    tokens: usize,
    reps: usize,
    isa: Isa,
    command: String,
    progress: &mut dyn FnMut(&str),
) -> Result<WriteReport, String> {
    if reps == 0 || tokens == 0 {
        return Err("--reps and --prefill-tokens must be at least 1".into());
    }
    let mut rows = Vec::new();
    let mut notes = vec![
        format!("median of {reps} reps after a warm-up; the vectorised and reference writes alternate rep by rep"),
        "GB/s: f32 input consumed (keys and values, 2 x kv_heads x head_dim x 4 bytes a token) / wall time; GB/cpu: the same per CPU-second of all the process's threads (what a write costs on a shared machine)".into(),
        format!("extend: one call of all the tokens into a new sequence; append: one token a call into a new sequence; a rep repeats its write until it has run {MIN_REP_MS} ms"),
    ];
    for &l in layouts {
        let (h, d) = (l.kv_heads as usize, l.head_dim as usize);
        let row = h * d;
        let (k, v) = kv_data(tokens, l, 7);
        let appends = tokens.min(4096);
        for name in schemes {
            let s = match super::bind(name, l) {
                Ok(s) => s,
                Err(e) => {
                    notes.push(format!("skipped: {e}"));
                    continue;
                }
            };
            progress(&format!("{}: writes of {name}", l.name));
            let config = CacheConfig::for_tokens(tokens + appends + 256);
            // Calibrated schemes (`levels = nuq`, `vq(...)`) get tables fitted
            // on the bench's own K/V, as the decode table's caches do.
            let mut fast = super::paged_cache(None, &s, l, config)?;
            let mut reference = super::paged_cache(None, &s, l, config)?;
            reference.set_write_isa(None);
            // `--no-avx512` / `--scalar` cap the vectorised writes too.
            fast.set_write_isa(Some(isa));
            let path = fast.write_isa().map_or("reference", Isa::name).to_string();
            let (mut tf, mut tr) = (Timing::default(), Timing::default());
            for rep in 0..=reps {
                time_once(&mut fast, &k, &v, row, appends, &mut tf)?;
                time_once(&mut reference, &k, &v, row, appends, &mut tr)?;
                if rep == 0 {
                    // The warm-up: it touches the pool's pages.
                    (tf, tr) = (Timing::default(), Timing::default());
                }
            }
            let med = |ms: &[f64]| Stats::of(ms).median_ms;
            let (re, ra) = (med(&tr.extend_ms), med(&tr.append_ms));
            let bytes = (2 * row * 4) as f64;
            let make = |path: String, t: &Timing| {
                let (e, a) = (med(&t.extend_ms), med(&t.append_ms));
                let (ec, ac) = (med(&t.extend_cpu_ms), med(&t.append_cpu_ms));
                WriteRow {
                    layout: l.name,
                    scheme: name.clone(),
                    path,
                    extend_tokens: tokens,
                    extend_tokens_per_s: 1e3 / e,
                    extend_gb_per_s: bytes / (e / 1e3) / 1e9,
                    append_tokens: appends,
                    append_tokens_per_s: 1e3 / a,
                    append_gb_per_s: bytes / (a / 1e3) / 1e9,
                    extend_gb_per_cpu_s: bytes / (ec / 1e3) / 1e9,
                    append_gb_per_cpu_s: bytes / (ac / 1e3) / 1e9,
                    extend_speedup: re / e,
                    append_speedup: ra / a,
                }
            };
            rows.push(make(path, &tf));
            rows.push(make("reference".into(), &tr));
        }
    }
    Ok(WriteReport {
        command,
        cpu: super::cpu_name(),
        threads: rayon::current_num_threads(),
        reps,
        rows,
        notes,
    })
}

/// `kivi bench --writes`: every preset unless `schemes` names some;
/// `tokens` per extend (`--prefill-tokens`), `reps` (default 5), the
/// vectorised writes capped at `isa` (`--no-avx512`, `--scalar`).
pub fn main(
    layouts: &[Layout],
    schemes: Vec<String>,
    tokens: usize,
    reps: Option<usize>,
    isa: Isa,
    json: bool,
    out: Option<&std::path::Path>,
) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let command = format!("kivi {}", std::env::args().skip(1).collect::<Vec<_>>().join(" "));
    let schemes = if schemes.is_empty() {
        kivi_spec::presets::listed().into_iter().map(|s| s.name).collect()
    } else {
        schemes
    };
    let mut log = |m: &str| eprintln!("kivi bench: {m}");
    let report = run(layouts, &schemes, tokens, reps.unwrap_or(5), isa, command, &mut log)?;
    let text = serde_json::to_string_pretty(&report)?;
    if let Some(path) = out {
        std::fs::write(path, &text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if json {
        println!("{text}");
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

/// The report as an aligned text table.
pub fn render(r: &WriteReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# {}", r.command);
    let _ = writeln!(s, "cpu: {}, {} threads\n", r.cpu, r.threads);
    let _ = writeln!(
        s,
        "{:<14} {:<10} {:<10} {:>13} {:>7} {:>7} {:>6} {:>13} {:>7} {:>7} {:>6}",
        "layout",
        "scheme",
        "path",
        "extend tok/s",
        "GB/s",
        "GB/cpu",
        "x ref",
        "append tok/s",
        "GB/s",
        "GB/cpu",
        "x ref"
    );
    for w in &r.rows {
        let _ = writeln!(
            s,
            "{:<14} {:<10} {:<10} {:>13.0} {:>7.3} {:>7.3} {:>6.1} {:>13.0} {:>7.3} {:>7.3} {:>6.1}",
            w.layout,
            w.scheme,
            w.path,
            w.extend_tokens_per_s,
            w.extend_gb_per_s,
            w.extend_gb_per_cpu_s,
            w.extend_speedup,
            w.append_tokens_per_s,
            w.append_gb_per_s,
            w.append_gb_per_cpu_s,
            w.append_speedup
        );
    }
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_write_suite_runs() {
        let l = Layout {
            name: "tiny",
            q_heads: 4,
            kv_heads: 2,
            head_dim: 32,
        };
        let schemes = vec!["kivi2".to_string(), "f16".to_string(), "codec2".to_string()];
        let r = run(&[l], &schemes, 200, 1, Isa::Avx512, "test".into(), &mut |_| {}).unwrap();
        // codec2 binds only to head_dim 256: skipped with a note
        assert_eq!(r.rows.len(), 4);
        assert!(r.notes.iter().any(|n| n.contains("codec2")));
        assert!(r
            .rows
            .iter()
            .all(|w| w.extend_tokens_per_s > 0.0 && w.append_gb_per_s > 0.0));
        assert!(render(&r).contains("append tok/s"));
    }

    /// A `levels = nuq` scheme (channel-axis pinned-minmax keys, pre-RoPE)
    /// gets its tables fitted on the bench's own K/V and is timed on both
    /// paths, rather than stopping the run for want of a calibration.
    #[test]
    fn nuq_schemes_are_fitted_and_timed() {
        let dir = std::env::temp_dir().join(format!("kivi-bench-writes-nuq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("pinned.kivi");
        std::fs::write(
            &p,
            "pinned { key: quant(bits = 2, axis = channel, group = 32, levels = nuq, norm = minmax_pinned), \
             value: quant(bits = 1, axis = token, group = 32, levels = nuq, norm = l2), residual: 32, sinks: 4, \
             rope: pre(theta = 10000, style = half) }",
        )
        .unwrap();
        let l = Layout {
            name: "tiny",
            q_heads: 4,
            kv_heads: 2,
            head_dim: 32,
        };
        let schemes = vec![p.display().to_string()];
        let r = run(&[l], &schemes, 200, 1, Isa::Avx512, "test".into(), &mut |_| {});
        std::fs::remove_dir_all(&dir).unwrap();
        let r = r.unwrap();
        assert_eq!(r.rows.len(), 2, "{:?}", r.notes);
        assert!(r.rows.iter().all(|w| w.extend_tokens_per_s > 0.0));
    }
}
