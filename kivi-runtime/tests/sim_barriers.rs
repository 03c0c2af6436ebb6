//! Proof that the simulator catches missing barriers: every
//! `__syncthreads()` and `__syncwarp()` of the generated decode, prefill and
//! append sources is deleted, one at a time; each mutant is compiled through
//! the sim and run under `Schedule::STRICT` on batches of odd lengths against
//! the oracle (decode) or the words `PagedCache` writes (prefill, append).
//! Every deletion must make some schedule fail (a wrong answer or a sim
//! error), except the barriers listed in `REDUNDANT`, each with the reason it
//! orders nothing; a listed barrier whose deletion is caught fails the test
//! too, so the list cannot go stale. The unmutated kernels must pass under
//! every schedule (otherwise a catch would prove nothing).

mod sim_util;

use kivi_runtime::sim::{compile, Schedule, SeqState, SimBackend, SimExtend, SimLibrary, SimOptions};
use kivi_runtime::{AttnParams, Backend};
use kivi_spec::{parse_scheme, presets, Heads, Scheme};
use kivi_templates::{default_variant, generate, Generated, Kernel, Variant};
use sim_util::*;
use std::sync::Arc;

/// Barriers whose deletion removes no ordering: (template, ordinal of the
/// barrier in the file counting from 1, why).
const REDUNDANT: &[(&str, usize, &str)] = &[
    (
        // #1 is the `__syncwarp` inside `teams_to_warp` (the shared value
        // reduction), which orders the warp's partial sums.
        "kivi_decode.cuh",
        2,
        "s_m/s_l are set by threads 0..H-1 before any shared write and first read in the softmax, after the \
         scores->softmax barrier of the first tile (or, with no tile, by the thread that set them, after the barrier \
         before the cross-warp sum)",
    ),
    (
        "kivi_extend.cuh",
        5,
        "every window-ring row is read inside the quantize loops, and every iteration of those ends with a barrier; \
         `full` tensors read only the new rows, so nothing is read between the last loop barrier and the ring writes",
    ),
];

/// One barrier call of a generated source.
#[derive(Clone, Debug)]
struct Site {
    file: String,
    /// 1-based among the barriers of its template file.
    ordinal: usize,
    /// 1-based line in the template file.
    line: usize,
    /// Byte range of the call (`__syncthreads()`) in the generated source.
    at: std::ops::Range<usize>,
}

impl Site {
    fn key(&self) -> String {
        format!("{}#{} (line {})", self.file, self.ordinal, self.line)
    }
}

/// The barrier calls of `src`, attributed to the template files the
/// generator pasted (`// ===== file =====` markers). Comments are skipped.
fn sites(src: &str) -> Vec<Site> {
    let mut out: Vec<Site> = Vec::new();
    let mut file = String::new();
    let mut line_in_file = 0;
    let mut offset = 0;
    for line in src.split_inclusive('\n') {
        if let Some(f) = line
            .trim()
            .strip_prefix("// ===== ")
            .and_then(|r| r.strip_suffix(" ====="))
        {
            file = f.to_string();
            line_in_file = 0;
        } else {
            line_in_file += 1;
            let code = line.split("//").next().unwrap_or("");
            for call in ["__syncthreads()", "__syncwarp()"] {
                let mut from = 0;
                while let Some(i) = code[from..].find(call) {
                    let start = offset + from + i;
                    let ordinal = out.iter().filter(|s| s.file == file).count() + 1;
                    out.push(Site {
                        file: file.clone(),
                        ordinal,
                        line: line_in_file,
                        at: start..start + call.len(),
                    });
                    from += i + call.len();
                }
            }
        }
        offset += line.len();
    }
    out.sort_by_key(|s| s.at.start);
    // Ordinals in source order within each file.
    let mut seen: Vec<(String, usize)> = Vec::new();
    for s in &mut out {
        let n = seen.iter().filter(|(f, _)| *f == s.file).count() + 1;
        seen.push((s.file.clone(), n));
        s.ordinal = n;
    }
    out
}

/// Each barrier site of a source with the source that lacks it.
type Mutants = Vec<(Site, Generated)>;

/// `g` with the barrier at `site` replaced by `(void)0` (same lines).
fn mutant(g: &Generated, site: &Site) -> Generated {
    let mut src = g.source.clone();
    src.replace_range(site.at.clone(), "(void)0");
    let mut m = g.clone();
    m.name = format!("{} without {}", g.name, site.key());
    m.hash = kivi_spec::fnv1a64(src.as_bytes());
    m.source = src;
    m
}

/// Tallies the failing runs per barrier site over every source and input,
/// then asserts the rule and prints the table.
#[derive(Default)]
struct Tally {
    /// (site key, runs, "schedule: why" of each failing run)
    rows: Vec<(String, usize, Vec<String>)>,
}

impl Tally {
    fn add(&mut self, site: &Site, how: Vec<String>) {
        let runs = Schedule::STRICT.len();
        match self.rows.iter_mut().find(|(k, _, _)| *k == site.key()) {
            Some((_, n, v)) => {
                *n += runs;
                v.extend(how);
            }
            None => self.rows.push((site.key(), runs, how)),
        }
    }

    fn check(&self, what: &str, files: &[&str]) {
        let mut bad = Vec::new();
        for (key, runs, how) in &self.rows {
            let listed = REDUNDANT.iter().find(|(f, n, _)| key.starts_with(&format!("{f}#{n} ")));
            match (listed, how.is_empty()) {
                (None, false) => {
                    let by: Vec<String> = Schedule::STRICT
                        .iter()
                        .map(|s| {
                            let n = how.iter().filter(|h| h.starts_with(&format!("{s}: "))).count();
                            format!("{s} {n}")
                        })
                        .collect();
                    report(&format!(
                        "  {what}: deleting {key}: caught in {} of {runs} runs ({}); first: {}",
                        how.len(),
                        by.join(", "),
                        how[0]
                    ))
                }
                (Some((_, _, why)), true) => report(&format!(
                    "  {what}: deleting {key}: no run of {runs} changed; listed redundant: {why}"
                )),
                (None, true) => bad.push(format!(
                    "deleting {key} changed no result in {runs} runs: a race the simulator misses, or a redundant \
                     barrier to list in REDUNDANT with its reason"
                )),
                (Some(_), false) => bad.push(format!(
                    "{key} is listed as redundant but deleting it was caught: {}",
                    how[0]
                )),
            }
        }
        for (f, n, _) in REDUNDANT.iter().filter(|r| files.contains(&r.0)) {
            if !self.rows.iter().any(|(k, _, _)| k.starts_with(&format!("{f}#{n} "))) {
                bad.push(format!("REDUNDANT names {f}#{n}, which the sources do not have"));
            }
        }
        let caught = self.rows.iter().filter(|(_, _, h)| !h.is_empty()).count();
        // What one schedule alone would have caught, to show why there are several.
        let alone: Vec<String> = Schedule::STRICT
            .iter()
            .map(|s| {
                let n = self
                    .rows
                    .iter()
                    .filter(|(_, _, h)| h.iter().any(|x| x.starts_with(&format!("{s}: "))))
                    .count();
                format!("{s} {n}")
            })
            .collect();
        report(&format!(
            "sim: {what}: {} barriers, deleting {caught} was caught, {} listed redundant (caught by one schedule \
             alone: {})",
            self.rows.len(),
            self.rows.len() - caught,
            alone.join(", ")
        ));
        assert!(bad.is_empty(), "{what}:\n{}", bad.join("\n"));
    }
}

fn scheme(text: &str) -> Scheme {
    parse_scheme(text).unwrap()
}

/// Schemes that reach every path of the templates: channel- and token-axis
/// codes, `full` keys, key and value rows of different widths (so the key
/// and value teams own different rows of a tile), sinks.
fn schemes() -> Vec<Scheme> {
    let shape = |s: Scheme| s.with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    vec![
        shape(presets::kivi2()),
        shape(scheme(
            "fullkey { key: full, value: quant(bits = 2, axis = token, group = 32), residual: 16, dtype: bf16 }",
        )),
        shape(scheme(
            "tokgroup8 { key: quant(bits = 2, axis = token, group = 8), value: quant(bits = 4, axis = channel, group = 8), residual: 8, sinks: 2 }",
        )),
        // The int8 query's per-tile tables (`query: int8(...)`).
        shape(scheme(
            "q8 { key: quant(bits = 2, axis = channel, group = 16), value: quant(bits = 2, axis = token, group = 32), residual: 8, sinks: 1, query: int8(group = 32) }",
        )),
    ]
}

fn variant(name: &str) -> Variant {
    Variant::parse(name).unwrap()
}

/// Runs `f` under every strict schedule; the failures, as "schedule: why".
fn under_schedules(f: impl Fn() -> Result<(), String>) -> Vec<String> {
    Schedule::STRICT
        .iter()
        .filter_map(|&s| {
            SimOptions::with_schedule(s)
                .scope(&f)
                .err()
                .map(|e| format!("{s}: {e}"))
        })
        .collect()
}

fn first_line(s: &str) -> String {
    let l = s.lines().next().unwrap_or("");
    if l.len() > 240 {
        format!("{}...", &l[..240])
    } else {
        l.to_string()
    }
}

// ---- decode ----

const DECODE_LENS: [usize; 5] = [1, 31, 33, 127, 301];

/// Decode of `b` by `g` against the oracle, 1e-4 relative.
fn decode_ok(s: &Scheme, g: &Generated, lib: &Arc<SimLibrary>, b: &Batch, want: &[f32]) -> Result<(), String> {
    let attn = AttnParams::of(s, s.shape().unwrap());
    let sim = SimBackend::with_library(s, g.clone(), lib.clone()).map_err(|e| e.to_string())?;
    let got = sim
        .decode(&b.cache, &b.seqs, &b.q, attn)
        .map_err(|e| first_line(&e.to_string()))?;
    let e = rel_error(&got, want);
    if e <= 1e-4 {
        Ok(())
    } else {
        Err(format!("relative error {e:.2e}"))
    }
}

#[test]
fn deleting_any_decode_barrier_that_orders_something_is_caught() {
    let t = std::time::Instant::now();
    // The default variant; one head per block over one split (many tiles,
    // warps that skip the softmax); 8 warps with 2-word loads.
    let picks = ["t64.tile32.s1.h1.w1.u1", "t256.tile64.s8.h2.w2.u1"];
    let mut jobs: Vec<(Scheme, Generated, Mutants)> = Vec::new();
    for s in schemes() {
        let mut vs = vec![default_variant(&s, Kernel::Decode)];
        vs.extend(picks.iter().map(|p| variant(p)));
        for v in vs {
            let g = generate(&s, Kernel::Decode, &v).unwrap();
            let muts = sites(&g.source)
                .into_iter()
                .map(|site| {
                    let m = mutant(&g, &site);
                    (site, m)
                })
                .collect();
            jobs.push((s.clone(), g, muts));
        }
    }
    let all: Vec<&Generated> = jobs
        .iter()
        .flat_map(|(_, g, ms)| std::iter::once(g).chain(ms.iter().map(|(_, m)| m)))
        .collect();
    let lib = compile(&all).unwrap();
    let compiled = t.elapsed();
    let mut tally = Tally::default();
    for (i, (s, g, muts)) in jobs.iter().enumerate() {
        let b = Batch::new(s, &DECODE_LENS, 40 + i as u64, true);
        let want = b.reference(AttnParams::of(s, s.shape().unwrap()));
        let fails = under_schedules(|| decode_ok(s, g, &lib, &b, &want));
        assert!(fails.is_empty(), "{} fails without any deletion: {fails:?}", g.name);
        for (site, m) in muts {
            tally.add(site, under_schedules(|| decode_ok(s, m, &lib, &b, &want)));
        }
    }
    report(&format!(
        "sim: decode barrier deletions: {} sources, {} mutants, compile {compiled:.1?}, total {:.1?}",
        jobs.len(),
        jobs.iter().map(|j| j.2.len()).sum::<usize>(),
        t.elapsed()
    ));
    assert!(
        tally
            .rows
            .iter()
            .filter(|(k, _, _)| k.starts_with("kivi_decode.cuh"))
            .count()
            >= 5
    );
    tally.check("decode", &["kivi_decode.cuh"]);
}

// ---- prefill and append ----

/// Prefill of sequences of `lens` tokens (from empty) by `k`, compared with
/// `PagedCache::extend` word for word.
fn prefill_ok(s: &Scheme, k: &SimExtend, lens: &[usize], seed: u64) -> Result<(), String> {
    let mut b = PrefillBatch::new(s, lens, seed);
    b.run(k).map_err(|e| first_line(&e.to_string()))?;
    if b.pool != b.cache.pool() {
        let n = b.pool.iter().zip(b.cache.pool()).filter(|(x, y)| x != y).count();
        return Err(format!("{n} pool words differ from PagedCache"));
    }
    for (st, &id) in b.states.iter().zip(&b.ids) {
        if *st != SeqState::of(&b.cache, id).unwrap() {
            return Err("sink/window buffers differ from PagedCache".into());
        }
    }
    Ok(())
}

/// Appends `steps` tokens one at a time to sequences of `starts` tokens,
/// compared with `PagedCache::append` after every step.
fn append_ok(s: &Scheme, k: &SimExtend, starts: &[usize], steps: usize, seed: u64) -> Result<(), String> {
    let mut b = AppendBatch::new(s, starts, 2048, seed);
    for step in 0..steps {
        let mut st = b.step();
        st.run(k)
            .map_err(|e| format!("step {step}: {}", first_line(&e.to_string())))?;
        if st.pool != b.cache.pool() {
            return Err(format!("step {step}: pool words differ from PagedCache"));
        }
        for (state, &id) in st.states.iter().zip(&b.ids) {
            if *state != SeqState::of(&b.cache, id).unwrap() {
                return Err(format!("step {step}: sink/window buffers differ"));
            }
        }
    }
    Ok(())
}

/// Starting lengths that make the next few appends flush a window: a
/// channel group (residual + group - 1 tokens), a chunk, token-axis rows.
fn append_starts(s: &Scheme) -> Vec<usize> {
    let r = s.residual as usize + s.sinks as usize;
    vec![0, r + 31, r + 7, r + 3]
}

#[test]
fn deleting_any_extend_barrier_that_orders_something_is_caught() {
    let t = std::time::Instant::now();
    let mut jobs: Vec<(Scheme, Kernel, Generated, Mutants)> = Vec::new();
    for s in schemes() {
        for kernel in [Kernel::Prefill, Kernel::Append] {
            let mut vs = vec![default_variant(&s, kernel)];
            vs.push(variant("t64.tile32.s8.h1.w1.u1"));
            for v in vs {
                let g = generate(&s, kernel, &v).unwrap();
                let muts = sites(&g.source)
                    .into_iter()
                    .map(|site| {
                        let m = mutant(&g, &site);
                        (site, m)
                    })
                    .collect();
                jobs.push((s.clone(), kernel, g, muts));
            }
        }
    }
    let all: Vec<&Generated> = jobs
        .iter()
        .flat_map(|(_, _, g, ms)| std::iter::once(g).chain(ms.iter().map(|(_, m)| m)))
        .collect();
    let lib = compile(&all).unwrap();
    let compiled = t.elapsed();
    let mut tally = Tally::default();
    for (i, (s, kernel, g, muts)) in jobs.iter().enumerate() {
        let seed = 70 + i as u64;
        let check = |g: &Generated| -> Result<(), String> {
            let k = SimExtend::with_library(s, g.clone(), lib.clone()).map_err(|e| e.to_string())?;
            match kernel {
                Kernel::Prefill => prefill_ok(s, &k, &[1, 31, 33, 127, 301], seed),
                _ => append_ok(s, &k, &append_starts(s), 3, seed),
            }
        };
        let fails = under_schedules(|| check(g));
        assert!(fails.is_empty(), "{} fails without any deletion: {fails:?}", g.name);
        for (site, m) in muts {
            tally.add(site, under_schedules(|| check(m)));
        }
    }
    report(&format!(
        "sim: prefill/append barrier deletions: {} sources, {} mutants, compile {compiled:.1?}, total {:.1?}",
        jobs.len(),
        jobs.iter().map(|j| j.3.len()).sum::<usize>(),
        t.elapsed()
    ));
    assert!(
        tally
            .rows
            .iter()
            .filter(|(k, _, _)| k.starts_with("kivi_extend.cuh"))
            .count()
            >= 5
    );
    tally.check("prefill/append", &["kivi_extend.cuh"]);
}

#[test]
fn barrier_sites_are_found_in_template_order() {
    let s = presets::kivi2().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let g = generate(&s, Kernel::Decode, &default_variant(&s, Kernel::Decode)).unwrap();
    let found = sites(&g.source);
    let keys: Vec<String> = found.iter().map(|s| s.key()).collect();
    // Six __syncthreads and one __syncwarp, all in kivi_decode.cuh.
    assert_eq!(found.len(), 7, "{keys:?}");
    assert!(found.iter().all(|s| s.file == "kivi_decode.cuh"), "{keys:?}");
    assert_eq!(
        found.iter().map(|s| s.ordinal).collect::<Vec<_>>(),
        vec![1, 2, 3, 4, 5, 6, 7]
    );
    let text = kivi_templates::TEMPLATES[1].1;
    for s in &found {
        let line = text.lines().nth(s.line - 1).unwrap();
        assert!(line.contains(&g.source[s.at.clone()]), "{}: {line}", s.key());
    }
    let m = mutant(&g, &found[1]);
    assert_eq!(m.source.lines().count(), g.source.lines().count());
    assert_eq!(sites(&m.source).len(), 6);
    assert_ne!(m.hash, g.hash);
}

/// The codec pipeline's barriers (`kivi_codec_decode.cuh`,
/// `kivi_codec_extend.cuh`, pasted only into pipeline schemes' sources):
/// the same deletion rule, on one scheme that takes every step — Lloyd–Max
/// l2 keys and channel-axis values, both rotated with a sign flip, with
/// outliers and centered — for the default decode variant and a one-split
/// one, and the default prefill and append kernels.
#[test]
fn deleting_any_codec_pipeline_barrier_that_orders_something_is_caught() {
    let t = std::time::Instant::now();
    let s = scheme(
        "codecmix { key: quant(bits = 2, axis = token, group = 32, levels = lloyd_max, norm = l2), \
         value: quant(bits = 2, axis = channel, group = 16), \
         rotation: hadamard(block = 32, apply = [key, value], signs = 3), \
         outliers: sparse(per_token = 2, apply = [key, value]), \
         center: channel_mean(tokens = 12, apply = [key, value]), residual: 16, sinks: 2 }",
    )
    .with_shape(Heads::Gqa { q: 8, kv: 2 }, 64)
    .unwrap();
    let with_mutants = |g: Generated| -> (Generated, Mutants) {
        let muts = sites(&g.source)
            .into_iter()
            .filter(|site| site.file.starts_with("kivi_codec_"))
            .map(|site| {
                let m = mutant(&g, &site);
                (site, m)
            })
            .collect();
        (g, muts)
    };
    let mut jobs: Vec<(Kernel, Generated, Mutants)> = Vec::new();
    for v in [default_variant(&s, Kernel::Decode), variant("t64.tile32.s1.h1.w1.u1")] {
        let (g, m) = with_mutants(generate(&s, Kernel::Decode, &v).unwrap());
        jobs.push((Kernel::Decode, g, m));
    }
    for k in [Kernel::Prefill, Kernel::Append] {
        let (g, m) = with_mutants(generate(&s, k, &default_variant(&s, k)).unwrap());
        jobs.push((k, g, m));
    }
    let all: Vec<&Generated> = jobs
        .iter()
        .flat_map(|(_, g, ms)| std::iter::once(g).chain(ms.iter().map(|(_, m)| m)))
        .collect();
    let lib = compile(&all).unwrap();
    let compiled = t.elapsed();
    let b = Batch::new(&s, &DECODE_LENS, 90, true);
    let want = b.reference(AttnParams::of(&s, s.shape().unwrap()));
    let (mut dec, mut ext) = (Tally::default(), Tally::default());
    for (i, (kernel, g, muts)) in jobs.iter().enumerate() {
        let seed = 95 + i as u64;
        let check = |g: &Generated| -> Result<(), String> {
            match kernel {
                Kernel::Decode => decode_ok(&s, g, &lib, &b, &want),
                _ => {
                    let k = SimExtend::with_library(&s, g.clone(), lib.clone()).map_err(|e| e.to_string())?;
                    if *kernel == Kernel::Prefill {
                        prefill_ok(&s, &k, &[1, 31, 33, 127, 301], seed)
                    } else {
                        // from empty through the centering tokens, and flushes
                        append_ok(&s, &k, &[0, 11, 17, 40], 3, seed)
                    }
                }
            }
        };
        let fails = under_schedules(|| check(g));
        assert!(fails.is_empty(), "{} fails without any deletion: {fails:?}", g.name);
        let tally = if *kernel == Kernel::Decode { &mut dec } else { &mut ext };
        for (site, m) in muts {
            tally.add(site, under_schedules(|| check(m)));
        }
    }
    report(&format!(
        "sim: codec-pipeline barrier deletions: {} sources, {} mutants, compile {compiled:.1?}, total {:.1?}",
        jobs.len(),
        jobs.iter().map(|j| j.2.len()).sum::<usize>(),
        t.elapsed()
    ));
    assert!(
        dec.rows.len() >= 5 && ext.rows.len() >= 4,
        "{} / {}",
        dec.rows.len(),
        ext.rows.len()
    );
    dec.check("codec decode", &["kivi_codec_decode.cuh"]);
    ext.check("codec prefill/append", &["kivi_codec_extend.cuh"]);
}
