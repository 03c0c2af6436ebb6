//! The decision cache on disk: corrupt files, concurrent writers (threads
//! and processes), bundles, and selection through it.

mod common;

use common::*;
use kivi_tuner::decisions::{self, entry_key, Store};
use kivi_tuner::tune::{self, Origin, Plan};
use kivi_tuner::{select_with, Bucket, Mode, SelectOptions, Source};
use std::collections::BTreeMap;

fn tuned_store(tag: &str) -> (Fake, Store) {
    let fake = Fake::new(vec![cand("default", 0.010), cand("a", 0.005), cand("b", 0.012)]);
    let st = Store::new(temp_dir(tag), fake.device.clone(), fake.toolchain.clone());
    let mut w = Vec::new();
    let plan = Plan {
        budget_s: 10.0,
        ..Plan::default()
    };
    tune::run(&fake, &st, &scheme(), &[bucket()], &plan, &mut (), &mut w);
    assert!(w.is_empty(), "{w:?}");
    (fake, st)
}

fn retune(fake: &Fake, st: &Store) -> (tune::Outcome, Vec<String>) {
    let mut w = Vec::new();
    let plan = Plan {
        budget_s: 10.0,
        ..Plan::default()
    };
    let o = tune::run(fake, st, &scheme(), &[bucket()], &plan, &mut (), &mut w);
    (o.into_iter().next().unwrap(), w)
}

#[test]
fn truncated_garbage_and_foreign_json_files_warn_and_retune() {
    let (fake, st) = tuned_store("corrupt");
    let good = std::fs::read_to_string(st.path()).unwrap();
    let bad_files: Vec<(&str, Vec<u8>)> = vec![
        ("truncated", good.as_bytes()[..good.len() / 2].to_vec()),
        ("empty", vec![]),
        ("garbage", b"\x00\xff\xfe garbage \x01".to_vec()),
        ("other json", br#"{"hello": "world"}"#.to_vec()),
        (
            "wrong types",
            good.replace("\"median_s\"", "\"median_sss\"")
                .replace("\"chosen\": \"a\"", "\"chosen\": 7")
                .into_bytes(),
        ),
        (
            "chosen not measured",
            good.replace("\"chosen\": \"a\"", "\"chosen\": \"zzz\"").into_bytes(),
        ),
        (
            "old schema",
            good.replace("\"schema\": 1", "\"schema\": 0").into_bytes(),
        ),
    ];
    for (what, bytes) in bad_files {
        std::fs::write(st.path(), &bytes).unwrap();
        // Selection in cached mode: a warning and the default, never the bad file's choice.
        let fresh = Fake::new(fake.cands.clone());
        let opts = SelectOptions {
            mode: Mode::Cached,
            cache_dir: Some(st.dir.clone()),
            budget_s: 1.0,
        };
        let sel = select_with(&fresh, &scheme(), bucket(), &opts).unwrap();
        assert_eq!(sel.source, Source::Default, "{what}");
        assert_eq!(sel.variant, "default", "{what}");
        assert!(!sel.warnings.is_empty(), "{what}: no warning");
        // Tuning: a warning, a re-tune, a good file again.
        let (o, w) = retune(&fresh, &st);
        assert!(matches!(o.origin, Origin::Tuned { .. }), "{what}: {:?}", o.origin);
        assert!(!w.is_empty(), "{what}: no warning");
        assert!(fresh.total_samples() > 0, "{what}");
        let mut w = Vec::new();
        assert_eq!(st.load(&mut w).entries.len(), 1, "{what}");
        assert!(w.is_empty(), "{what}: {w:?}");
    }
    // Corrupt files were moved aside for inspection, not lost.
    let kept = std::fs::read_dir(&st.dir)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().contains(".bad-"))
        .count();
    assert!(kept >= 1);
}

fn entry_for(fake: &Fake, st: &Store, b: Bucket) -> kivi_tuner::Entry {
    let r = tune::tune_bucket(fake, &scheme(), b, None, 1.0, None, &mut ()).unwrap();
    let _ = st;
    r.0
}

#[test]
fn concurrent_writers_in_threads_keep_every_entry() {
    let fake = Fake::new(vec![cand("default", 0.001), cand("a", 0.0005)]);
    let st = Store::new(temp_dir("threads"), fake.device.clone(), fake.toolchain.clone());
    let template = entry_for(&fake, &st, bucket());
    let h = kivi_spec::scheme_hash(&scheme());
    std::thread::scope(|s| {
        for t in 0..6u32 {
            let st = st.clone();
            let template = template.clone();
            s.spawn(move || {
                for i in 0..15u32 {
                    let mut e = template.clone();
                    e.bucket = Bucket::of(1 << t, 256 << (i % 10), 4 + i as usize / 10);
                    let mut one = BTreeMap::new();
                    one.insert(entry_key(h, &e.bucket), e);
                    let mut w = Vec::new();
                    st.save(&one, &mut w).unwrap();
                    assert!(w.is_empty(), "{w:?}");
                }
            });
        }
    });
    let mut w = Vec::new();
    let f = st.load(&mut w);
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(f.entries.len(), 6 * 15);
    // No temp or lock files left behind.
    let leftovers: Vec<String> = std::fs::read_dir(&st.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp") || n.ends_with(".lock"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// Child half of the process test: runs only when the parent sets the env.
#[test]
fn writer_child() {
    let Ok(spec) = std::env::var("KIVI_TUNER_TEST_WRITER") else {
        return;
    };
    let (dir, id) = spec.split_once('|').unwrap();
    let id: u32 = id.parse().unwrap();
    let fake = Fake::new(vec![cand("default", 0.001), cand("a", 0.0005)]);
    let st = Store::new(dir.into(), fake.device.clone(), fake.toolchain.clone());
    let template = entry_for(&fake, &st, bucket());
    let h = kivi_spec::scheme_hash(&scheme());
    for i in 0..20u32 {
        let mut e = template.clone();
        e.bucket = Bucket::of(1 << id, 256 << (i % 10), 1 + i as usize / 10);
        let mut one = BTreeMap::new();
        one.insert(entry_key(h, &e.bucket), e);
        let mut w = Vec::new();
        st.save(&one, &mut w).unwrap();
    }
}

#[test]
fn concurrent_writers_in_processes_keep_every_entry() {
    let dir = temp_dir("procs");
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..3)
        .map(|id| {
            std::process::Command::new(&exe)
                .args(["--exact", "writer_child", "--test-threads=1"])
                .env("KIVI_TUNER_TEST_WRITER", format!("{}|{id}", dir.display()))
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    for mut c in children {
        assert!(c.wait().unwrap().success());
    }
    let fake = Fake::new(vec![]);
    let st = Store::new(dir, fake.device.clone(), fake.toolchain.clone());
    let mut w = Vec::new();
    let f = st.load(&mut w);
    assert!(w.is_empty(), "{w:?}");
    assert_eq!(f.entries.len(), 3 * 20);
}

#[test]
fn a_lock_left_by_a_dead_writer_is_broken() {
    let (fake, st) = tuned_store("stale-lock");
    let lock = format!("{}.lock", st.path().display());
    std::fs::write(&lock, "99999999\n").unwrap();
    let old = std::time::SystemTime::now() - decisions::STALE_LOCK - std::time::Duration::from_secs(5);
    std::fs::File::options()
        .write(true)
        .open(&lock)
        .unwrap()
        .set_modified(old)
        .unwrap();
    let mut w = Vec::new();
    st.save(&BTreeMap::new(), &mut w).unwrap();
    assert!(!std::path::Path::new(&lock).exists());
    let _ = fake;
}

#[test]
fn bundles_export_and_import() {
    let (fake, st) = tuned_store("bundle-src");
    let bundle = st.dir.join("h200-bundle.json");
    assert_eq!(decisions::export_bundle(&st, &bundle).unwrap(), 1);
    let dest = temp_dir("bundle-dst");
    let mut w = Vec::new();
    assert_eq!(decisions::import_bundle(&dest, &bundle, &mut w).unwrap(), 1);
    // The importing machine (same device) now hits without measuring.
    let fresh = Fake::new(fake.cands.clone());
    let st2 = Store::new(dest.clone(), fresh.device.clone(), fresh.toolchain.clone());
    let (o, w) = retune(&fresh, &st2);
    assert_eq!(o.origin, Origin::Cached, "{w:?}");
    assert_eq!(fresh.total_samples(), 0);
    // A broken bundle is refused with a reason.
    std::fs::write(&bundle, "{ nope").unwrap();
    let err = decisions::import_bundle(&dest, &bundle, &mut Vec::new()).unwrap_err();
    assert!(err.contains("refusing to import"), "{err}");
}

#[test]
fn selection_modes() {
    let (fake, st) = tuned_store("select");
    let opts = |mode| SelectOptions {
        mode,
        cache_dir: Some(st.dir.clone()),
        budget_s: 5.0,
    };
    let sel = select_with(&fake, &scheme(), bucket(), &opts(Mode::Off)).unwrap();
    assert_eq!((sel.variant.as_str(), sel.source), ("default", Source::Default));
    let sel = select_with(&fake, &scheme(), bucket(), &opts(Mode::Cached)).unwrap();
    assert_eq!((sel.variant.as_str(), sel.source), ("a", Source::Cached));
    assert!(sel.warnings.is_empty());
    // A miss in cached mode: the documented default.
    let other = Bucket::of(8, 4096, 4);
    let sel = select_with(&fake, &scheme(), other, &opts(Mode::Cached)).unwrap();
    assert_eq!((sel.variant.as_str(), sel.source), ("default", Source::Default));
    assert!(sel.reason.contains("no cached decision"));
    // A miss in tune mode: tuned, saved, then a hit.
    let sel = select_with(&fake, &scheme(), other, &opts(Mode::Tune)).unwrap();
    assert_eq!((sel.variant.as_str(), sel.source), ("a", Source::Tuned));
    let sel = select_with(&fake, &scheme(), other, &opts(Mode::Cached)).unwrap();
    assert_eq!(sel.source, Source::Cached);
    // Out-of-date hit (the chosen variant changed): default plus a warning.
    let mut cands = fake.cands.clone();
    cands[1].hash ^= 1;
    let changed = Fake::new(cands);
    let sel = select_with(&changed, &scheme(), bucket(), &opts(Mode::Cached)).unwrap();
    assert_eq!(sel.source, Source::Default);
    assert!(
        sel.warnings.iter().any(|w| w.contains("out of date")),
        "{:?}",
        sel.warnings
    );
    // Env parsing.
    assert_eq!(Mode::parse("OFF").unwrap(), Mode::Off);
    assert_eq!(Mode::parse("tune").unwrap(), Mode::Tune);
    assert!(Mode::parse("sometimes").unwrap_err().contains("off, cached, tune"));
}

#[test]
fn cache_dir_resolution() {
    let p = std::path::Path::new("/x/y");
    assert_eq!(decisions::cache_dir(Some(p)).unwrap(), p);
}
