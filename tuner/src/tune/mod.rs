//! The tuning loop, independent of any backend.
//!
//! A backend is a [`Target`]: it lists candidate variants for a bucket (the
//! heuristic default first), checks and compiles them (pruning what cannot
//! run), and builds a [`Workload`] of tuning inputs that can verify a
//! candidate against the reference and time it. The loop here owns the
//! methodology, so every backend is measured the same way:
//!
//! 1. **Reuse.** Timings stored for a candidate with the same hash are kept;
//!    only new or changed candidates are measured, plus two anchors (the
//!    default and the previous winner) so that new numbers are compared with
//!    fresh ones.
//! 2. **Prune** statically, candidates checked/compiled in parallel (rayon).
//! 3. **Verify** each survivor against the reference on the tuning inputs
//!    just before it is first timed (the verification call is its first
//!    warm-up call); a wrong or failing candidate is recorded as rejected
//!    and never timed.
//! 4. **Warm up** for [`Method::warmup_s`] and calibrate the calls per
//!    sample so that one sample lasts at least [`Method::min_sample_s`]
//!    (the workload rotates its inputs between calls so KV is read from
//!    memory, as in serving). Then the first-round samples; a candidate
//!    whose first sample is slower than [`Method::quick_ratio`] x the best
//!    median so far stops there.
//! 5. **Time in rounds**, interleaving candidates within a round (so drift
//!    and a noisy neighbour hit all of them alike), doubling the samples per
//!    round. After the first round a candidate whose *fastest* sample is
//!    slower than [`Method::clear_ratio`] x the best median is eliminated;
//!    after later rounds, one whose p20 is slower than the best's p80 plus
//!    the noise floor. The default is never eliminated: it is the baseline,
//!    and it is measured even when the budget is already spent.
//! 6. **Budget.** Every call is charged (the larger of wall time and the
//!    time the workload reports), and timing stops when the bucket's share
//!    of the budget is spent; untimed candidates are recorded as skipped.
//! 7. **Choose** deterministically with [`stats::choose`]: the first
//!    candidate in canonical order within the noise of the fastest median —
//!    so the default wins every tie, and the choice is never slower than the
//!    default by more than the noise.

pub mod stats;

use crate::bucket::Bucket;
use crate::decisions::{entry_key, now_unix, CandidateRecord, CandidateTiming, Entry, Status, Store};
use crate::fingerprint::{Fingerprint, Toolchain};
use kivi_spec::Scheme;
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::time::Instant;

/// One variant the tuner may pick.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Readable, unique name (the variant name for CUDA, `CpuParams::name` for the CPU).
    pub name: String,
    /// Hash of what runs: the generated source for CUDA, the parameters for
    /// the CPU. A stored timing is reused only while the hash is unchanged.
    pub hash: u64,
    /// Static facts shown by `kivi inspect` (launch shape, resources).
    pub notes: Vec<String>,
}

/// A backend seen by the tuner.
pub trait Target: Sync {
    /// `cpu` or `cuda`.
    fn backend(&self) -> &'static str;
    /// The device being tuned.
    fn device(&self) -> Fingerprint;
    /// What produced the kernels.
    fn toolchain(&self) -> Toolchain;
    /// Candidates for a bucket in canonical order; index 0 is the heuristic
    /// default. Names must be unique.
    fn candidates(&self, bucket: &Bucket) -> Vec<Candidate>;
    /// Static checks and compilation (launch limits, resources, shape
    /// fit). `Err(reason)` prunes. Called from several threads at once.
    fn check(&self, candidate: &Candidate, bucket: &Bucket) -> Result<(), String>;
    /// Builds the tuning inputs for a bucket (and the reference output).
    /// `prep_budget_s` is a hint: optional extras (more rotated copies)
    /// stop when it is spent; the first copy is always built.
    fn workload<'a>(&'a self, bucket: &Bucket, prep_budget_s: f64) -> Result<Box<dyn Workload + 'a>, String>;
    /// The timing method for this backend.
    fn method(&self) -> Method {
        Method::default()
    }
    /// Peak memory bandwidth in GB/s, for the roofline column.
    fn peak_gbps(&self) -> Option<f64> {
        None
    }
    /// The content hash of the calibration the tuning inputs are built
    /// with (issue #12: it joins the scheme hash in the cache's identity),
    /// `None` for none.
    fn calibration_hash(&self) -> Option<u64> {
        None
    }
}

/// The hash decisions for `scheme` on `target` are keyed by: the scheme
/// hash joined with the target's calibration hash
/// ([`kivi_runtime::calib::identity`], the cache's
/// [`kivi_runtime::PagedCache::identity`]), so a decision made under one
/// calibration is never served under another. Without a calibration it is
/// the scheme hash itself, so every decision saved before stays valid.
pub fn decision_hash(target: &dyn Target, scheme: &Scheme) -> u64 {
    kivi_runtime::calib::identity(kivi_spec::scheme_hash(scheme), target.calibration_hash())
}

/// Tuning inputs for one bucket.
pub trait Workload {
    /// KV bytes one call reads (for GB/s).
    fn bytes_per_call(&self) -> u64;
    /// Runs the candidate on the tuning inputs and compares with the
    /// reference; `Err(reason)` rejects it.
    fn verify(&mut self, candidate: &Candidate) -> Result<(), String>;
    /// Runs `iters` calls back to back, each on the next rotated input set,
    /// and returns the seconds per call (device time where the backend has
    /// a device clock, e.g. CUDA events on the kernel's stream).
    fn sample(&mut self, candidate: &Candidate, iters: u32) -> Result<f64, String>;
    /// How the timings are taken, for the decision file.
    fn describe(&self) -> String;
}

/// Timing methodology knobs (see the module docs).
#[derive(Clone, Debug, PartialEq)]
pub struct Method {
    /// Warm-up time per candidate, seconds.
    pub warmup_s: f64,
    /// A sample lasts at least this long (more calls per sample if needed).
    pub min_sample_s: f64,
    /// Upper bound on calls per sample.
    pub max_iters: u32,
    /// Samples per candidate in the first round.
    pub first_round: u32,
    /// Samples per candidate at most.
    pub max_samples: u32,
    /// First-round elimination: fastest sample slower than this x best median.
    pub clear_ratio: f64,
    /// Relative noise floor for ties and later eliminations.
    pub noise_floor: f64,
    /// Eliminate after one sample when it is slower than this x the best median so far.
    pub quick_ratio: f64,
    /// Share of a bucket's budget the workload may spend building inputs
    /// (rotated copies beyond the first are dropped when it runs out).
    pub prep_share: f64,
}

impl Default for Method {
    fn default() -> Self {
        Method {
            warmup_s: 0.02,
            min_sample_s: 0.002,
            max_iters: 1000,
            first_round: 3,
            max_samples: 15,
            clear_ratio: 1.3,
            noise_floor: 0.03,
            quick_ratio: 2.0,
            prep_share: 0.15,
        }
    }
}

/// What to do for each bucket.
#[derive(Clone, Debug, Default)]
pub struct Plan {
    /// Total time budget in seconds for all buckets that need tuning.
    pub budget_s: f64,
    /// Ignore stored timings and pins; measure everything again.
    pub force: bool,
    /// Record this variant as the choice (verified, not timed).
    pub pin: Option<String>,
    /// Also measure candidates an earlier run skipped for lack of budget.
    pub resume: bool,
}

/// How a bucket's decision came about.
#[derive(Clone, Debug, PartialEq)]
pub enum DecisionOrigin {
    /// Served from the decision cache; nothing ran.
    Cached,
    /// Measured now: `measured` candidates timed, `reused` stored timings kept.
    Tuned { measured: usize, reused: usize },
    /// Pinned by the user.
    Pinned,
    /// No decision (the error says why); the heuristic default applies.
    Failed(String),
}

/// Result for one bucket.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub bucket: Bucket,
    pub origin: DecisionOrigin,
    pub entry: Option<Entry>,
    /// Seconds charged to the budget.
    pub spent_s: f64,
}

/// Progress reports from the loop (the CLI draws a bar; tests ignore them).
pub trait Progress {
    /// `done` of `total` steps of the current bucket, with a short label.
    fn update(&mut self, bucket: &Bucket, label: &str, done: usize, total: usize);
}

impl Progress for () {
    fn update(&mut self, _: &Bucket, _: &str, _: usize, _: usize) {}
}

/// Seconds charged against a budget.
struct Budget {
    limit_s: f64,
    spent_s: f64,
}

impl Budget {
    fn charge(&mut self, s: f64) {
        self.spent_s += s.max(0.0);
    }
    fn left(&self) -> bool {
        self.spent_s < self.limit_s
    }
}

/// Whether a stored entry still answers for the current candidates without
/// measuring anything: every current candidate has a record with the same
/// hash and the choice is still a candidate. Candidates skipped for lack of
/// budget count as answered unless `resume` is set (`kivi tune --resume`
/// measures them, reusing everything else).
pub fn is_fresh(entry: &Entry, candidates: &[Candidate], resume: bool) -> bool {
    let same = |c: &Candidate| {
        entry
            .candidate(&c.name)
            .is_some_and(|r| r.hash == hex(c.hash) && !(resume && r.status == Status::Skipped))
    };
    let chosen_ok = candidates.iter().any(|c| c.name == entry.chosen && same(c));
    chosen_ok && (entry.pinned || candidates.iter().all(same))
}

/// `{:016x}`.
pub fn hex(h: u64) -> String {
    format!("{h:016x}")
}

/// Tunes (or serves from the cache) every bucket, saving each decision as
/// soon as it is made. Problems that do not stop the run are appended to
/// `warnings`.
pub fn run(
    target: &dyn Target,
    store: &Store,
    scheme: &Scheme,
    buckets: &[Bucket],
    plan: &Plan,
    progress: &mut dyn Progress,
    warnings: &mut Vec<String>,
) -> Vec<Outcome> {
    let shash = decision_hash(target, scheme);
    let file = store.load(warnings);
    let mut todo = Vec::new();
    let mut outcomes: Vec<Option<Outcome>> = vec![None; buckets.len()];
    for (i, b) in buckets.iter().enumerate() {
        let prev = file.entries.get(&entry_key(shash, b));
        let cands = target.candidates(b);
        match prev {
            Some(e) if !plan.force && plan.pin.is_none() && is_fresh(e, &cands, plan.resume) => {
                outcomes[i] = Some(Outcome {
                    bucket: *b,
                    origin: if e.pinned {
                        DecisionOrigin::Pinned
                    } else {
                        DecisionOrigin::Cached
                    },
                    entry: Some(e.clone()),
                    spent_s: 0.0,
                });
            }
            _ => todo.push(i),
        }
    }
    let mut spent_total = 0.0;
    for (k, &i) in todo.iter().enumerate() {
        let b = buckets[i];
        // A share of what is left, weighted by sqrt(batch x context): a
        // bigger bucket costs more per call and more to prepare, but the
        // small ones still get enough to measure every candidate. What an
        // early bucket leaves unspent goes to the later ones.
        let weight = |b: &Bucket| ((b.batch as f64) * (b.context as f64)).sqrt();
        let rest: f64 = todo[k..].iter().map(|&j| weight(&buckets[j])).sum();
        let share = ((plan.budget_s - spent_total) * weight(&b) / rest.max(1e-9)).max(0.0);
        let prev = file.entries.get(&entry_key(shash, &b)).filter(|_| !plan.force);
        let result = tune_bucket(target, scheme, b, prev, share, plan.pin.as_deref(), progress);
        let outcome = match result {
            Ok((entry, origin, spent)) => {
                spent_total += spent;
                let mut one = BTreeMap::new();
                one.insert(entry_key(shash, &b), entry.clone());
                if let Err(e) = store.save(&one, warnings) {
                    warnings.push(format!("decision for {b} not saved: {e}"));
                }
                Outcome {
                    bucket: b,
                    origin,
                    entry: Some(entry),
                    spent_s: spent,
                }
            }
            Err(e) => Outcome {
                bucket: b,
                origin: DecisionOrigin::Failed(e),
                entry: None,
                spent_s: 0.0,
            },
        };
        outcomes[i] = Some(outcome);
    }
    outcomes.into_iter().flatten().collect()
}

/// A candidate that failed while being timed (in any round): rejected with
/// the error, its samples dropped.
fn fail_timing(rec: &mut Option<CandidateRecord>, samples: &mut Vec<f64>, c: &Candidate, e: impl std::fmt::Display) {
    *rec = Some(record(
        c,
        Status::Rejected,
        Some(format!("failed while timing: {e}")),
        None,
    ));
    samples.clear();
}

fn record(c: &Candidate, status: Status, reason: Option<String>, timing: Option<CandidateTiming>) -> CandidateRecord {
    CandidateRecord {
        name: c.name.clone(),
        hash: hex(c.hash),
        status,
        reason,
        timing,
        notes: c.notes.clone(),
        measured_at: now_unix(),
    }
}

fn ms(s: f64) -> String {
    if s >= 0.1 {
        format!("{:.0} ms", s * 1e3)
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} us", s * 1e6)
    }
}

/// Tunes one bucket within `budget_s`. Returns the entry, how it came
/// about, and the seconds charged.
pub fn tune_bucket(
    target: &dyn Target,
    scheme: &Scheme,
    bucket: Bucket,
    previous: Option<&Entry>,
    budget_s: f64,
    pin: Option<&str>,
    progress: &mut dyn Progress,
) -> Result<(Entry, DecisionOrigin, f64), String> {
    let method = target.method();
    let cands = target.candidates(&bucket);
    if cands.is_empty() {
        return Err(format!(
            "the {} backend offers no variant for {bucket}",
            target.backend()
        ));
    }
    let n = cands.len();
    let mut budget = Budget {
        limit_s: budget_s,
        spent_s: 0.0,
    };
    let mut records: Vec<Option<CandidateRecord>> = vec![None; n];
    let mut reused = 0;

    if let Some(p) = pin {
        if !cands.iter().any(|c| c.name == p) {
            let names: Vec<&str> = cands.iter().map(|c| c.name.as_str()).take(8).collect();
            return Err(format!(
                "cannot pin `{p}`: not a variant for {bucket} (candidates: {}, ...)",
                names.join(", ")
            ));
        }
    }

    // 1. Reuse stored records with the same hash (anchors are re-measured).
    if let Some(prev) = previous {
        for (i, c) in cands.iter().enumerate() {
            let Some(r) = prev.candidate(&c.name) else { continue };
            if r.hash != hex(c.hash) {
                continue;
            }
            let anchor = i == 0 || c.name == prev.chosen;
            let keep = match pin {
                // Pinning measures nothing else: keep what is known.
                Some(p) => c.name != p && r.status != Status::Skipped,
                None => match r.status {
                    Status::Ok | Status::Eliminated => !anchor,
                    // Same hash, same code: it would be wrong again.
                    Status::Rejected => true,
                    Status::Pruned | Status::Skipped => false,
                },
            };
            if keep {
                records[i] = Some(r.clone());
                reused += 1;
            }
        }
    }

    // 2. Static checks / compilation, in parallel.
    let todo: Vec<usize> = (0..n)
        .filter(|&i| records[i].is_none() && pin.is_none_or_eq(&cands[i].name))
        .collect();
    progress.update(&bucket, "compiling", 0, 1);
    let t = Instant::now();
    let checks: Vec<(usize, Result<(), String>)> = todo
        .par_iter()
        .map(|&i| (i, target.check(&cands[i], &bucket)))
        .collect();
    budget.charge(t.elapsed().as_secs_f64());
    let mut live = Vec::new();
    for (i, r) in checks {
        match r {
            Ok(()) => live.push(i),
            Err(why) => records[i] = Some(record(&cands[i], Status::Pruned, Some(why), None)),
        }
    }

    // 3-5. Inputs; then per candidate, in canonical order: verify (the
    // first warm-up call), warm up, first-round samples. Doing it candidate
    // by candidate means a tight budget still yields the default and its
    // nearest neighbours fully measured rather than everything half-done.
    let mut timings: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut method_text = previous.map(|p| p.method.clone()).unwrap_or_default();
    let mut measured = 0;
    if !live.is_empty() {
        progress.update(&bucket, "preparing inputs", 0, 1);
        let t = Instant::now();
        let mut wl = target.workload(&bucket, budget_s * method.prep_share)?;
        budget.charge(t.elapsed().as_secs_f64());
        method_text = wl.describe();
        let bytes = wl.bytes_per_call();
        let skipped = || Some("the time budget ran out before it was timed".to_string());
        let mut iters = vec![1u32; n];
        let mut alive: Vec<usize> = Vec::new();
        let mut eliminated: BTreeMap<usize, String> = BTreeMap::new();
        let mut best_so_far = f64::INFINITY;
        let first = method.first_round.max(1) as usize;
        for (k, &i) in live.iter().enumerate() {
            // The default is measured whatever the budget says: without
            // it there is no baseline and no decision.
            let must = i == 0;
            if !must && !budget.left() {
                records[i] = Some(record(&cands[i], Status::Skipped, skipped(), None));
                continue;
            }
            progress.update(&bucket, &format!("verifying {}", cands[i].name), k, live.len());
            let t = Instant::now();
            let r = wl.verify(&cands[i]);
            let verify_s = t.elapsed().as_secs_f64();
            budget.charge(verify_s);
            if let Err(why) = r {
                records[i] = Some(record(&cands[i], Status::Rejected, Some(why), None));
                continue;
            }
            if pin.is_some() {
                continue; // a pin is verified, not timed
            }
            // Warm-up beyond the verification call, and calibration.
            let mut est = verify_s;
            let mut warm_s = verify_s;
            let mut failed = None;
            let mut calls = 1;
            while warm_s < method.warmup_s && calls < 50 {
                let t = Instant::now();
                match wl.sample(&cands[i], 1) {
                    Ok(x) => est = est.min(x),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
                let w = t.elapsed().as_secs_f64();
                budget.charge(w);
                warm_s += w;
                calls += 1;
            }
            if let Some(e) = failed {
                records[i] = Some(record(
                    &cands[i],
                    Status::Rejected,
                    Some(format!("failed while timing: {e}")),
                    None,
                ));
                continue;
            }
            iters[i] = if est > 0.0 && est.is_finite() {
                ((method.min_sample_s / est).ceil() as u32).clamp(1, method.max_iters)
            } else {
                1
            };
            for s in 0..first {
                if !must && !budget.left() {
                    break;
                }
                progress.update(&bucket, &cands[i].name, k, live.len());
                let t = Instant::now();
                match wl.sample(&cands[i], iters[i]) {
                    Ok(x) => {
                        budget.charge(t.elapsed().as_secs_f64().max(x * iters[i] as f64));
                        timings[i].push(x);
                        if s == 0 && !must && x > best_so_far * method.quick_ratio {
                            eliminated.insert(
                                i,
                                format!(
                                    "first sample {} > {:.1}x the best median so far {}",
                                    ms(x),
                                    method.quick_ratio,
                                    ms(best_so_far)
                                ),
                            );
                            break;
                        }
                    }
                    Err(e) => {
                        budget.charge(t.elapsed().as_secs_f64());
                        fail_timing(&mut records[i], &mut timings[i], &cands[i], e);
                        break;
                    }
                }
            }
            if records[i].is_some() {
                continue;
            }
            if timings[i].is_empty() {
                records[i] = Some(record(&cands[i], Status::Skipped, skipped(), None));
                continue;
            }
            if let Some(st) = stats::summarize(&timings[i], bytes) {
                best_so_far = best_so_far.min(st.median_s);
            }
            if !eliminated.contains_key(&i) {
                alive.push(i);
            }
        }

        if pin.is_none() {
            // Later rounds, interleaved, with elimination.
            let mut round = 0;
            let mut per_round = first as u32;
            let total_planned = alive.len() * method.max_samples as usize;
            while !alive.is_empty() {
                if round > 0 {
                    'round: for s in 0..per_round as usize {
                        for k in 0..alive.len() {
                            let i = alive[(k + s) % alive.len()];
                            if timings[i].len() >= method.max_samples as usize {
                                continue;
                            }
                            if !budget.left() {
                                break 'round;
                            }
                            let done: usize = timings.iter().map(Vec::len).sum();
                            progress.update(&bucket, &cands[i].name, done, total_planned.max(done + 1));
                            let t = Instant::now();
                            match wl.sample(&cands[i], iters[i]) {
                                Ok(x) => {
                                    budget.charge(t.elapsed().as_secs_f64().max(x * iters[i] as f64));
                                    timings[i].push(x);
                                }
                                Err(e) => {
                                    budget.charge(t.elapsed().as_secs_f64());
                                    fail_timing(&mut records[i], &mut timings[i], &cands[i], e);
                                }
                            }
                        }
                    }
                }
                alive.retain(|&i| records[i].is_none());
                let stats: Vec<(usize, CandidateTiming)> = alive
                    .iter()
                    .filter_map(|&i| Some((i, stats::summarize(&timings[i], bytes)?)))
                    .collect();
                let Some(best) = stats
                    .iter()
                    .map(|(_, t)| *t)
                    .min_by(|a, b| a.median_s.total_cmp(&b.median_s))
                else {
                    break;
                };
                for (i, t) in &stats {
                    if *i == 0 {
                        continue; // the default is the baseline: always kept
                    }
                    let fastest = timings[*i].iter().copied().fold(f64::INFINITY, f64::min);
                    let why = if round == 0 {
                        (fastest > best.median_s * method.clear_ratio).then(|| {
                            format!(
                                "fastest sample {} > {:.2}x the best median {}",
                                ms(fastest),
                                method.clear_ratio,
                                ms(best.median_s)
                            )
                        })
                    } else {
                        (t.p20_s > best.p80_s * (1.0 + method.noise_floor)).then(|| {
                            format!(
                                "p20 {} > the best p80 {} + {:.0}%",
                                ms(t.p20_s),
                                ms(best.p80_s),
                                method.noise_floor * 100.0
                            )
                        })
                    };
                    if let Some(w) = why {
                        eliminated.insert(*i, w);
                    }
                }
                alive.retain(|i| !eliminated.contains_key(i));
                if !budget.left() || alive.iter().all(|&i| timings[i].len() >= method.max_samples as usize) {
                    break;
                }
                round += 1;
                per_round = if round == 1 {
                    first as u32
                } else {
                    (per_round * 2).min(method.max_samples)
                };
            }
            for i in 0..n {
                if records[i].is_some() || timings[i].is_empty() {
                    continue;
                }
                if let Some(t) = stats::summarize(&timings[i], bytes) {
                    measured += 1;
                    let (st, why) = match eliminated.remove(&i) {
                        Some(w) => (Status::Eliminated, Some(w)),
                        None => (Status::Ok, None),
                    };
                    records[i] = Some(record(&cands[i], st, why, Some(t)));
                }
            }
        } else {
            for &i in &live {
                if records[i].is_none() {
                    records[i] = Some(record(
                        &cands[i],
                        Status::Ok,
                        Some("pinned: verified, not timed".into()),
                        None,
                    ));
                }
            }
        }
    }

    let records: Vec<CandidateRecord> = records
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.unwrap_or_else(|| record(&cands[i], Status::Skipped, Some("not considered".into()), None)))
        .collect();

    // 7. Choose.
    let default = cands[0].name.clone();
    let (chosen, reason, origin) = if let Some(p) = pin {
        let r = records.iter().find(|r| r.name == p).expect("pin checked above");
        if r.status != Status::Ok {
            return Err(format!(
                "cannot pin `{p}`: {}",
                r.reason.clone().unwrap_or_else(|| r.status.name().into())
            ));
        }
        (
            p.to_string(),
            "pinned by the user (verified against the reference, not timed)".to_string(),
            DecisionOrigin::Pinned,
        )
    } else {
        let timed: Vec<(usize, CandidateTiming)> = records
            .iter()
            .enumerate()
            // Survivors only: an eliminated candidate lost to one of them.
            .filter(|(_, r)| r.status == Status::Ok)
            .filter_map(|(i, r)| Some((i, r.timing?)))
            .collect();
        let Some(w) = stats::choose(&timed, method.noise_floor) else {
            let why: Vec<String> = records
                .iter()
                .take(3)
                .map(|r| {
                    format!(
                        "{}: {}",
                        r.name,
                        r.reason.clone().unwrap_or_else(|| r.status.name().into())
                    )
                })
                .collect();
            return Err(format!(
                "no candidate was verified and timed for {bucket} ({})",
                why.join("; ")
            ));
        };
        let (wi, wt) = timed[w];
        let best = timed
            .iter()
            .map(|(_, t)| *t)
            .min_by(|a, b| a.median_s.total_cmp(&b.median_s))
            .expect("non-empty");
        let def_t = records[0].timing.filter(|_| records[0].status.timed());
        let reason = match def_t {
            Some(dt) if wi == 0 => {
                if best.median_s < dt.median_s {
                    format!(
                        "default kept: the fastest candidate ({}) is {:.1}% faster, within the noise ({:.1}%)",
                        ms(best.median_s),
                        (1.0 - best.median_s / dt.median_s) * 100.0,
                        stats::tie_tolerance(&dt, &best, method.noise_floor) * 100.0
                    )
                } else {
                    "default kept: it is the fastest".to_string()
                }
            }
            Some(dt) => format!(
                "{:.2}x faster than the default (median {} vs {})",
                dt.median_s / wt.median_s,
                ms(wt.median_s),
                ms(dt.median_s)
            ),
            None => format!(
                "fastest verified candidate (median {}); the default was {}",
                ms(wt.median_s),
                records[0].status.name()
            ),
        };
        (
            records[wi].name.clone(),
            reason,
            DecisionOrigin::Tuned { measured, reused },
        )
    };
    let entry = Entry {
        scheme: scheme.name.clone(),
        scheme_hash: hex(decision_hash(target, scheme)),
        bucket,
        chosen,
        default,
        reason,
        pinned: pin.is_some(),
        candidates: records,
        method: method_text,
        peak_gbps: target.peak_gbps(),
        decided_at: now_unix(),
    };
    Ok((entry, origin, budget.spent_s))
}

/// `Option<&str>` helper: `None` matches everything, `Some(p)` only `p`.
trait PinFilter {
    fn is_none_or_eq(&self, name: &str) -> bool;
}

impl PinFilter for Option<&str> {
    fn is_none_or_eq(&self, name: &str) -> bool {
        match self {
            None => true,
            Some(p) => *p == name,
        }
    }
}
