//! The tuning loop against a deterministic fake backend: pruning,
//! verification, elimination, tie-breaks, the budget, cache hits and
//! misses, reuse when a variant is added, pins.

use crate::common;

use common::*;
use kivi_tuner::decisions::{entry_key, Status, Store};
use kivi_tuner::tune::{self, DecisionOrigin, Plan};

fn plan(budget: f64) -> Plan {
    Plan {
        budget_s: budget,
        ..Plan::default()
    }
}

fn tune_once(fake: &Fake, store: &Store, p: &Plan) -> (tune::Outcome, Vec<String>) {
    let mut w = Vec::new();
    let out = tune::run(fake, store, &scheme(), &[bucket()], p, &mut (), &mut w);
    (out.into_iter().next().unwrap(), w)
}

fn store(fake: &Fake, tag: &str) -> Store {
    Store::new(temp_dir(tag), fake.device.clone(), fake.toolchain.clone())
}

#[test]
fn pruned_and_wrong_candidates_are_never_timed() {
    let mut fast_but_wrong = cand("wrong", 0.001);
    fast_but_wrong.wrong = true;
    let mut too_big = cand("too_big", 0.001);
    too_big.prune = Some("needs 300 KiB of shared memory, the device has 228 KiB".into());
    let mut broken = cand("broken", 0.001);
    broken.fail_timing = true;
    let fake = Fake::new(vec![
        cand("default", 0.010),
        fast_but_wrong,
        too_big,
        broken,
        cand("good", 0.008),
    ]);
    let st = store(&fake, "prune");
    let (o, w) = tune_once(&fake, &st, &plan(10.0));
    assert!(w.is_empty(), "{w:?}");
    let e = o.entry.unwrap();
    assert_eq!(e.chosen, "good");
    let rec = |n: &str| e.candidate(n).unwrap().clone();
    assert_eq!(rec("wrong").status, Status::Rejected);
    assert!(rec("wrong").reason.unwrap().contains("reference"));
    assert_eq!(fake.sampled("wrong"), 0, "a wrong candidate must never be timed");
    assert_eq!(rec("too_big").status, Status::Pruned);
    assert!(rec("too_big").reason.unwrap().contains("shared memory"));
    assert_eq!(fake.verified("too_big"), 0);
    assert_eq!(rec("broken").status, Status::Rejected);
    assert!(rec("broken").reason.unwrap().contains("launch failed"));
    assert!(rec("broken").timing.is_none());
    assert_eq!(rec("default").status, Status::Ok);
}

#[test]
fn clearly_slower_candidates_are_eliminated_early() {
    let fake = Fake::new(vec![
        cand("default", 0.010),
        cand("slow", 0.050),
        cand("fast", 0.005),
        cand("slowish", 0.0075),
    ]);
    let st = store(&fake, "elim");
    let (o, _) = tune_once(&fake, &st, &plan(10.0));
    let e = o.entry.unwrap();
    assert_eq!(e.chosen, "fast");
    // 5x slower than the best so far: one sample, then out.
    assert_eq!(fake.sampled("slow"), 1);
    assert_eq!(e.candidate("slow").unwrap().status, Status::Eliminated);
    // 1.5x the best: out after the first round.
    assert_eq!(e.candidate("slowish").unwrap().status, Status::Eliminated);
    assert!(fake.sampled("slowish") <= fake.method.first_round as usize);
    // The default is the baseline: never eliminated, fully sampled.
    assert_eq!(e.candidate("default").unwrap().status, Status::Ok);
    assert_eq!(fake.sampled("default"), fake.method.max_samples as usize);
    assert!(e.reason.contains("2.00x faster than the default"), "{}", e.reason);
}

#[test]
fn ties_within_noise_go_to_the_default_then_canonical_order() {
    // 1% faster is noise: the default stays.
    let fake = Fake::new(vec![cand("default", 0.0100), cand("a", 0.0099)]);
    let (o, _) = tune_once(&fake, &store(&fake, "tie1"), &plan(10.0));
    let e = o.entry.unwrap();
    assert_eq!(e.chosen, "default");
    assert!(e.reason.starts_with("default kept"), "{}", e.reason);
    // Two equally fast variants: the first in canonical order wins.
    let fake = Fake::new(vec![cand("default", 0.0100), cand("b", 0.0050), cand("c", 0.0049)]);
    let (o, _) = tune_once(&fake, &store(&fake, "tie2"), &plan(10.0));
    assert_eq!(o.entry.unwrap().chosen, "b");
}

#[test]
fn choice_is_never_slower_than_the_default_beyond_noise() {
    // Deterministic pseudo-random timings and noise patterns.
    let mut rng = kivi_runtime::rand::Rng::new(0x1234_5678_9abc_def1);
    let mut next = || rng.unit();
    for trial in 0..40 {
        let n = 2 + (next() * 8.0) as usize;
        let cands: Vec<FakeCand> = (0..n).map(|i| cand(&format!("v{i}"), 0.001 * (0.5 + next()))).collect();
        let mut fake = Fake::new(cands);
        fake.noise = (0..7).map(|_| 0.9 + 0.2 * next()).collect();
        let (o, _) = tune_once(&fake, &store(&fake, &format!("prop{trial}")), &plan(10.0));
        let e = o.entry.unwrap();
        let t = |n: &str| e.candidate(n).unwrap().timing.unwrap();
        let (c, d) = (t(&e.chosen), t(&e.default));
        let tol = kivi_tuner::tune::stats::tie_tolerance(&c, &d, fake.method.noise_floor);
        assert!(
            c.median_s <= d.median_s * (1.0 + tol),
            "trial {trial}: chose {} {:?} over default {:?}",
            e.chosen,
            c,
            d
        );
    }
}

#[test]
fn the_budget_stops_timing_but_the_default_is_always_measured() {
    // 20 candidates at 10 ms a call and 50 ms of budget: a handful get timed.
    let mut cands = vec![cand("default", 0.010)];
    for i in 0..19 {
        cands.push(cand(&format!("v{i}"), 0.010));
    }
    let fake = Fake::new(cands);
    let (o, _) = tune_once(&fake, &store(&fake, "budget"), &plan(0.05));
    let e = o.entry.unwrap();
    assert!(o.spent_s < 0.05 + 0.010 * 2.0, "spent {}", o.spent_s);
    assert!(fake.total_samples() <= 7, "{} samples", fake.total_samples());
    let skipped = e.candidates.iter().filter(|c| c.status == Status::Skipped).count();
    assert!(skipped >= 15, "{skipped} skipped");
    assert!(e.candidate("default").unwrap().timing.is_some());
    // Zero budget: still a decision, from the default alone.
    let fake = Fake::new(vec![cand("default", 0.010), cand("v", 0.001)]);
    let (o, _) = tune_once(&fake, &store(&fake, "budget0"), &plan(1e-9));
    let e = o.entry.unwrap();
    assert_eq!(e.chosen, "default");
    assert_eq!(e.candidate("v").unwrap().status, Status::Skipped);
}

#[test]
fn a_hit_measures_nothing_and_a_new_variant_tunes_only_itself() {
    let fake = Fake::new(vec![
        cand("default", 0.010),
        cand("a", 0.008),
        cand("b", 0.012),
        cand("c", 0.0085),
    ]);
    let st = store(&fake, "hit");
    let (o, _) = tune_once(&fake, &st, &plan(10.0));
    assert!(matches!(o.origin, DecisionOrigin::Tuned { reused: 0, .. }));
    let chosen = o.entry.unwrap().chosen;
    assert_eq!(chosen, "a");

    // Same candidates again: served from the cache.
    let fake2 = Fake::new(fake.cands.clone());
    let (o, w) = tune_once(&fake2, &st, &plan(10.0));
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(o.origin, DecisionOrigin::Cached);
    assert_eq!(fake2.total_samples(), 0);
    assert_eq!(fake2.verified.lock().unwrap().len(), 0);

    // One new variant: it and the two anchors (default, previous winner) run.
    let mut cands = fake.cands.clone();
    cands.push(cand("d", 0.004));
    let fake3 = Fake::new(cands);
    let (o, _) = tune_once(&fake3, &st, &plan(10.0));
    assert_eq!(fake3.sampled("b"), 0);
    assert_eq!(fake3.sampled("c"), 0);
    assert!(fake3.sampled("d") > 0 && fake3.sampled("default") > 0 && fake3.sampled("a") > 0);
    match o.origin {
        DecisionOrigin::Tuned { measured, reused } => assert_eq!((measured, reused), (3, 2)),
        other => panic!("{other:?}"),
    }
    assert_eq!(o.entry.unwrap().chosen, "d");

    // A changed variant (new source hash) is measured again, alone with the anchors.
    let mut cands = fake3.cands.clone();
    cands[2].hash ^= 1; // "b"
    let fake4 = Fake::new(cands);
    let (_, _) = tune_once(&fake4, &st, &plan(10.0));
    assert!(fake4.sampled("b") > 0);
    assert_eq!(fake4.sampled("c"), 0);
}

#[test]
fn scheme_toolchain_and_device_changes_miss_the_cache() {
    let fake = Fake::new(vec![cand("default", 0.010), cand("a", 0.008)]);
    let st = store(&fake, "inval");
    tune_once(&fake, &st, &plan(10.0));
    let key = entry_key(kivi_spec::scheme_hash(&scheme()), &bucket());

    // Another scheme: its own entry, a miss.
    let other = kivi_spec::presets::kivi4()
        .with_shape(kivi_spec::Heads::Gqa { q: 8, kv: 2 }, 64)
        .unwrap();
    let mut w = Vec::new();
    let out = tune::run(&fake, &st, &other, &[bucket()], &plan(10.0), &mut (), &mut w);
    assert!(matches!(out[0].origin, DecisionOrigin::Tuned { .. }));
    let mut w = Vec::new();
    let f = st.load(&mut w);
    assert_eq!(f.entries.len(), 2);
    assert!(f.entries.contains_key(&key));

    // Another toolchain: the file is stale -> warning, re-tune, replaced.
    let mut fake_tc = Fake::new(fake.cands.clone());
    fake_tc.toolchain.compiler = "fakec 2.0".into();
    let st_tc = Store::new(st.dir.clone(), fake_tc.device.clone(), fake_tc.toolchain.clone());
    let (o, w) = tune_once(&fake_tc, &st_tc, &plan(10.0));
    assert!(matches!(o.origin, DecisionOrigin::Tuned { .. }));
    assert!(w.iter().any(|w| w.contains("stale")), "{w:?}");
    let mut w = Vec::new();
    assert_eq!(st_tc.load(&mut w).toolchain.compiler, "fakec 2.0");
    assert!(w.is_empty());

    // Another device: another file, a miss, no warning.
    let mut fake_dev = Fake::new(fake.cands.clone());
    fake_dev.device = device("another fake device");
    let st_dev = Store::new(st.dir.clone(), fake_dev.device.clone(), fake_dev.toolchain.clone());
    assert_ne!(st_dev.path(), st.path());
    let (o, w) = tune_once(&fake_dev, &st_dev, &plan(10.0));
    assert!(matches!(o.origin, DecisionOrigin::Tuned { .. }));
    assert!(w.is_empty(), "{w:?}");

    // A file for another device copied over ours: foreign, ignored.
    std::fs::copy(st_dev.path(), st_tc.path()).unwrap();
    let mut w = Vec::new();
    let f = st_tc.load(&mut w);
    assert!(f.entries.is_empty());
    assert!(w.iter().any(|w| w.contains("foreign")), "{w:?}");
}

#[test]
fn pins_are_verified_kept_and_checked() {
    let fake = Fake::new(vec![cand("default", 0.010), cand("a", 0.008), cand("b", 0.020)]);
    let st = store(&fake, "pin");
    let p = Plan {
        budget_s: 10.0,
        pin: Some("b".into()),
        ..Plan::default()
    };
    let (o, _) = tune_once(&fake, &st, &p);
    assert_eq!(o.origin, DecisionOrigin::Pinned);
    let e = o.entry.unwrap();
    assert!(e.pinned && e.chosen == "b");
    assert_eq!(fake.verified("b"), 1);
    assert_eq!(fake.total_samples(), 0, "a pin is verified, not timed");
    // A later plain tune keeps the pin.
    let fake2 = Fake::new(fake.cands.clone());
    let (o, _) = tune_once(&fake2, &st, &plan(10.0));
    assert_eq!(o.origin, DecisionOrigin::Pinned);
    assert_eq!(o.entry.unwrap().chosen, "b");
    // --force measures again and drops the pin.
    let p = Plan {
        budget_s: 10.0,
        force: true,
        ..Plan::default()
    };
    let (o, _) = tune_once(&fake2, &st, &p);
    assert_eq!(o.entry.unwrap().chosen, "a");
    // Unknown or wrong pins are errors, not decisions.
    let mut cands = fake.cands.clone();
    cands[2].wrong = true;
    let fake3 = Fake::new(cands);
    for bad in ["nope", "b"] {
        let p = Plan {
            budget_s: 10.0,
            pin: Some(bad.into()),
            ..Plan::default()
        };
        let (o, _) = tune_once(&fake3, &st, &p);
        assert!(
            matches!(o.origin, DecisionOrigin::Failed(ref e) if e.contains("cannot pin")),
            "{:?}",
            o.origin
        );
    }
}

#[test]
fn a_wrong_default_still_yields_a_verified_choice() {
    let mut d = cand("default", 0.010);
    d.wrong = true;
    let fake = Fake::new(vec![d, cand("a", 0.012)]);
    let (o, _) = tune_once(&fake, &store(&fake, "wrongdef"), &plan(10.0));
    let e = o.entry.unwrap();
    assert_eq!(e.chosen, "a");
    assert_eq!(e.candidate("default").unwrap().status, Status::Rejected);
    // Nothing verifies: a failure, not a decision.
    let mut a = cand("a", 0.01);
    a.wrong = true;
    let mut d = cand("default", 0.01);
    d.wrong = true;
    let fake = Fake::new(vec![d, a]);
    let (o, _) = tune_once(&fake, &store(&fake, "allwrong"), &plan(10.0));
    assert!(matches!(o.origin, DecisionOrigin::Failed(_)));
    assert!(o.entry.is_none());
}
