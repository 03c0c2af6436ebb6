//! Fuzzing decision files (`tuner/src/decisions.rs`): a real file written
//! by a tuning run, then JSON-level mutations (keys removed, values of the
//! wrong type, huge/negative/fractional numbers, unicode strings, entries
//! copied under other keys, other schema/format/toolchain/device) and
//! byte-level damage (truncation, flips, insertions).
//!
//! Properties: nothing panics — parsing, loading, selecting through the
//! file, tuning over it, listing it (`scan`), importing it as a bundle, or
//! replacing it. An untrusted file is reported with a clear reason and
//! ignored; after the next write the store is trusted again and the bad
//! file was moved aside. A trusted file round-trips through the writer and
//! selection only ever returns a variant the target offers.

#[macro_use]
#[path = "../../../tests/fuzz_support/mod.rs"]
mod fuzz;
use crate::common;

use common::*;
use fuzz::{check_message, pick, Rng};
use kivi_tuner::decisions::{self, parse_checked, Distrust, Store};
use kivi_tuner::tune::{self, Plan};
use kivi_tuner::{select_with, Mode, SelectOptions, Status};
use serde_json::Value;

fn random_value(rng: &mut Rng) -> Value {
    match rng.u8(..12) {
        0 => Value::Null,
        1 => Value::Bool(rng.bool()),
        2 => serde_json::json!(-1),
        3 => serde_json::json!(1e308),
        4 => serde_json::json!(0.5),
        5 => serde_json::json!(u64::MAX),
        6 => serde_json::json!(""),
        7 => serde_json::json!(pick(rng, &["é🦀\u{0}\u{202e}", "two\nlines", "a"])),
        8 => serde_json::json!([]),
        9 => serde_json::json!({}),
        10 => serde_json::json!(0),
        _ => serde_json::json!(pick(
            rng,
            &["ok", "eliminated", "rejected", "a", "default", "b1.c1024.g4"]
        )),
    }
}

/// A random path into a JSON value: mutate what it points at.
fn mutate_json(rng: &mut Rng, v: &mut Value, depth: usize) {
    let stop = depth > 0 && rng.u8(..3) == 0;
    match v {
        Value::Object(map) if !map.is_empty() && !stop => {
            let keys: Vec<String> = map.keys().cloned().collect();
            let k = pick(rng, &keys).clone();
            match rng.u8(..10) {
                0 => {
                    map.remove(&k);
                }
                1 => {
                    // The same entry under another key.
                    let val = map[&k].clone();
                    map.insert(format!("{k}{}", pick(rng, &["x", "", "0", "/b2.c256.g1", "\n"])), val);
                }
                2 => {
                    map.insert(k, random_value(rng));
                }
                _ => mutate_json(rng, map.get_mut(&k).unwrap(), depth + 1),
            }
        }
        Value::Array(a) if !a.is_empty() && !stop => {
            let i = rng.usize(..a.len());
            match rng.u8(..6) {
                0 => {
                    a.remove(i);
                }
                1 => {
                    let x = a[i].clone();
                    a.push(x);
                }
                _ => mutate_json(rng, &mut a[i], depth + 1),
            }
        }
        Value::Number(_) => {
            *v = pick(
                rng,
                &[
                    serde_json::json!(0),
                    serde_json::json!(-3),
                    serde_json::json!(1e300),
                    serde_json::json!(0.0001),
                    serde_json::json!(4294967296u64),
                    serde_json::json!(2),
                ],
            )
            .clone()
        }
        // A status becomes another valid status (the file still parses).
        Value::String(st) if STATUSES.contains(&st.as_str()) && rng.bool() => {
            *v = Value::String(pick(rng, STATUSES).to_string())
        }
        _ => *v = random_value(rng),
    }
}

const STATUSES: &[&str] = &["ok", "eliminated", "rejected", "pruned", "skipped"];

fn mutate_bytes(rng: &mut Rng, b: &mut Vec<u8>) {
    for _ in 0..rng.usize(1..4) {
        if b.is_empty() {
            return;
        }
        match rng.u8(..4) {
            0 => b.truncate(rng.usize(..b.len())),
            1 => {
                let i = rng.usize(..b.len());
                b[i] = rng.u8(..);
            }
            2 => {
                let i = rng.usize(..=b.len());
                b.splice(
                    i..i,
                    pick(rng, &[&b"{"[..], b"\"", b"\\u0000", b"]", "é".as_bytes(), b"\xff"])
                        .iter()
                        .copied(),
                );
            }
            _ => {
                let i = rng.usize(..b.len());
                b.remove(i);
            }
        }
    }
}

fn reason(d: &Distrust) -> &str {
    match d {
        Distrust::Corrupt(s) | Distrust::Stale(s) | Distrust::Foreign(s) => s,
    }
}

#[test]
fn fuzz_decision_files() {
    let fake = Fake::new(vec![cand("default", 0.010), cand("a", 0.005), cand("b", 0.012)]);
    let dir = temp_dir("fuzz-decisions");
    let st = Store::new(dir.clone(), fake.device.clone(), fake.toolchain.clone());
    let plan = Plan {
        budget_s: 5.0,
        ..Plan::default()
    };
    let mut w = Vec::new();
    let b2 = kivi_tuner::Bucket::of(4, 4096, 4);
    tune::run(&fake, &st, &scheme(), &[bucket(), b2], &plan, &mut (), &mut w);
    assert!(w.is_empty(), "{w:?}");
    let good = std::fs::read_to_string(st.path()).unwrap();
    let good_json: Value = serde_json::from_str(&good).unwrap();
    let names = ["default", "a", "b"];
    let opts = SelectOptions {
        mode: Mode::Cached,
        cache_dir: Some(dir.clone()),
        budget_s: 1.0,
    };
    let (mut trusted, mut refused) = (0usize, 0usize);
    fuzz::run("decision files", fuzz::cases(10_000), |rng| {
        let bytes = if rng.u8(..4) == 0 {
            let mut b = good.clone().into_bytes();
            mutate_bytes(rng, &mut b);
            b
        } else {
            let mut v = good_json.clone();
            for _ in 0..rng.usize(1..4) {
                mutate_json(rng, &mut v, 0);
            }
            // Deep, well-formed edits are rare through random paths: now
            // and then change one candidate's status outright.
            if rng.u8(..6) == 0 {
                if let Some(Value::Object(entries)) = v.get_mut("entries") {
                    let keys: Vec<String> = entries.keys().cloned().collect();
                    if !keys.is_empty() {
                        let k = pick(rng, &keys).clone();
                        if let Some(Value::Array(cs)) = entries[&k].get_mut("candidates") {
                            if !cs.is_empty() {
                                let i = rng.usize(..cs.len());
                                if let Some(c) = cs[i].as_object_mut() {
                                    c.insert("status".into(), Value::String(pick(rng, STATUSES).to_string()));
                                }
                            }
                        }
                    }
                }
            }
            let text = if rng.bool() {
                serde_json::to_string_pretty(&v).unwrap()
            } else {
                serde_json::to_string(&v).unwrap()
            };
            text.into_bytes()
        };
        let text = String::from_utf8_lossy(&bytes);
        match parse_checked(&text, Some(&fake.device), Some(&fake.toolchain)) {
            Ok(f) => {
                trusted += 1;
                // The writer's text of a trusted file is trusted and equal.
                let again = serde_json::to_string_pretty(&f).map_err(|e| format!("cannot re-encode: {e}"))?;
                let back = parse_checked(&again, Some(&fake.device), Some(&fake.toolchain))
                    .map_err(|d| format!("re-encoded file refused: {d}"))?;
                if back != f {
                    let a = format!("{f:?}");
                    let b = format!("{back:?}");
                    let i = a.bytes().zip(b.bytes()).position(|(x, y)| x != y).unwrap_or(0);
                    return Err(format!(
                        "a trusted file changed through the writer: ...{}... became ...{}...",
                        &a[i.saturating_sub(80)..(i + 80).min(a.len())],
                        &b[i.saturating_sub(80)..(i + 80).min(b.len())]
                    ));
                }
                // A trusted choice is a candidate that passed its check.
                for (k, e) in &f.entries {
                    let c = e.candidate(&e.chosen).ok_or(format!("{k}: chosen not measured"))?;
                    ensure!(
                        c.status == Status::Ok,
                        "{k}: trusted a choice marked {}",
                        c.status.name()
                    );
                }
            }
            Err(d) => {
                refused += 1;
                check_message(reason(&d))?;
                ensure!(!d.to_string().contains('\n'), "multi-line reason {d}");
            }
        }
        // Through the store and the selector, as a user meets it.
        // Remove, then create: ext4 flushes a file rewritten in place
        // (truncated) on close, which would make this test wait on the disk.
        let _ = std::fs::remove_file(st.path());
        std::fs::write(st.path(), &bytes).map_err(|e| e.to_string())?;
        let sel = select_with(&fake, &scheme(), bucket(), &opts)?;
        ensure!(
            names.contains(&sel.variant.as_str()),
            "selected `{}`, not a candidate",
            sel.variant
        );
        for w in &sel.warnings {
            check_message(w)?;
            ensure!(!w.contains('\n'), "multi-line warning {w:?}");
        }
        // The writing paths sync files and directories (tens of ms each on
        // a real disk): one case in 100 goes through each.
        if rng.u8(..100) == 0 {
            for (_, r) in decisions::scan(&dir) {
                if let Err(d) = r {
                    check_message(reason(&d))?;
                }
            }
            let into = temp_sub(&dir, "import");
            if let Err(e) = decisions::import_bundle(&into, &st.path(), &mut Vec::new()) {
                check_message(&e)?;
            }
            // Files moved aside pile up (one per second): start afresh.
            for e in std::fs::read_dir(&dir).map_err(|e| e.to_string())? {
                let p = e.map_err(|e| e.to_string())?.path();
                if p.to_string_lossy().contains(".json.bad-") || p.to_string_lossy().contains(".json.stale-") {
                    let _ = std::fs::remove_file(p);
                }
            }
            let _ = std::fs::remove_dir_all(into);
        }
        if rng.u8(..100) == 0 {
            // Tune over the file with one new candidate (reusing whatever
            // timings were trusted), then the store must be trusted.
            let mut cands = fake.cands.clone();
            cands.push(cand("new", 0.007));
            let mut more = Fake::new(cands);
            more.device = fake.device.clone();
            let mut w = Vec::new();
            let out = tune::run(&more, &st, &scheme(), &[bucket()], &plan, &mut (), &mut w);
            ensure!(out.len() == 1, "tune returned {} outcomes", out.len());
            let mut w2 = Vec::new();
            let f = st.load(&mut w2);
            ensure!(w2.is_empty(), "after tuning the store is still untrusted: {w2:?}");
            ensure!(!f.entries.is_empty(), "tuning kept no entry");
        }
        Ok(())
    });
    log!("fuzz decision files: {trusted} trusted, {refused} refused");
    // Both kinds were exercised.
    assert!(
        trusted + refused < 1000 || (trusted > 0 && refused > 0),
        "{trusted} trusted, {refused} refused"
    );
}

fn temp_sub(dir: &std::path::Path, name: &str) -> std::path::PathBuf {
    let d = dir.join(name);
    let _ = std::fs::create_dir_all(&d);
    d
}
