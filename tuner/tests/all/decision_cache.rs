//! The decision cache on disk: corrupt files, concurrent writers (threads
//! and processes), bundles, and selection through it.

use crate::common;

use common::*;
use kivi_tuner::decisions::{self, entry_key, Store};
use kivi_tuner::tune::{self, DecisionOrigin, Plan};
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
        assert!(
            matches!(o.origin, DecisionOrigin::Tuned { .. }),
            "{what}: {:?}",
            o.origin
        );
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
                .args(["--exact", test_name("writer_child").as_str(), "--test-threads=1"])
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

/// Makes `<store file>.lock` look like the lock of a writer that died long ago.
fn plant_stale_lock(st: &Store) -> std::path::PathBuf {
    let lock = std::path::PathBuf::from(format!("{}.lock", st.path().display()));
    std::fs::write(&lock, "dead-writer\n").unwrap();
    let old = std::time::SystemTime::now() - decisions::STALE_LOCK - std::time::Duration::from_secs(5);
    std::fs::File::options()
        .write(true)
        .open(&lock)
        .unwrap()
        .set_modified(old)
        .unwrap();
    lock
}

#[test]
fn waiters_that_break_a_stale_lock_together_never_both_hold_it() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let (_, st) = tuned_store("stale-race");
    // Many waiters find the same stale lock at the same moment. Each must
    // get the lock to itself: a waiter that breaks the lock after another
    // one already took it again would remove a live lock. (Preemption
    // rarely lands in that window on its own; the strace test below puts
    // a waiter there every time.)
    let threads = 6;
    for round in 0..8 {
        let lock = plant_stale_lock(&st);
        let inside = AtomicUsize::new(0);
        let most = AtomicUsize::new(0);
        let barrier = std::sync::Barrier::new(threads);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    barrier.wait();
                    let mut w = Vec::new();
                    st.update(&mut w, |_| {
                        let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(n, Ordering::SeqCst);
                        std::thread::sleep(std::time::Duration::from_millis(3));
                        inside.fetch_sub(1, Ordering::SeqCst);
                    })
                    .unwrap();
                });
            }
        });
        assert_eq!(
            most.load(Ordering::SeqCst),
            1,
            "round {round}: two writers held the lock at once"
        );
        assert!(!lock.exists(), "round {round}: lock left behind");
        let leftovers: Vec<String> = std::fs::read_dir(&st.dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".break-") || n.contains(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "round {round}: {leftovers:?}");
    }
}

/// Child half of the two-process stale-lock test.
#[test]
fn stale_lock_child() {
    let Ok(dir) = std::env::var("KIVI_TUNER_TEST_STALE_LOCK") else {
        return;
    };
    let fake = Fake::new(vec![]);
    let st = Store::new(dir.into(), fake.device.clone(), fake.toolchain.clone());
    // Start together with the other process: wait for the parent's go file.
    let go = st.dir.join("go");
    while !go.exists() {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let log = st.dir.join("inside.log");
    let mut w = Vec::new();
    st.update(&mut w, |_| {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&log)
            .unwrap();
        writeln!(f, "enter {}", std::process::id()).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(40));
        writeln!(f, "leave {}", std::process::id()).unwrap();
    })
    .unwrap();
}

#[test]
fn two_processes_breaking_a_stale_lock_take_turns() {
    let exe = std::env::current_exe().unwrap();
    for round in 0..4 {
        let (_, st) = tuned_store(&format!("stale-procs-{round}"));
        plant_stale_lock(&st);
        let children: Vec<_> = (0..3)
            .map(|_| {
                std::process::Command::new(&exe)
                    .args(["--exact", test_name("stale_lock_child").as_str(), "--test-threads=1"])
                    .env("KIVI_TUNER_TEST_STALE_LOCK", &st.dir)
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        std::thread::sleep(std::time::Duration::from_millis(300));
        std::fs::write(st.dir.join("go"), "").unwrap();
        for mut c in children {
            assert!(c.wait().unwrap().success());
        }
        // Every critical section closed before the next one opened.
        let log = std::fs::read_to_string(st.dir.join("inside.log")).unwrap();
        let lines: Vec<&str> = log.lines().collect();
        assert_eq!(lines.len(), 6, "{log}");
        for pair in lines.chunks(2) {
            let (a, b) = (pair[0], pair[1]);
            assert!(
                a.starts_with("enter") && b.starts_with("leave") && a[6..] == b[6..],
                "round {round}: overlapping writers:\n{log}"
            );
        }
    }
}

/// Child of the strace test: `KIVI_TUNER_TEST_RACER=dir|role|hold_ms`.
#[test]
fn stale_lock_racer() {
    let Ok(spec) = std::env::var("KIVI_TUNER_TEST_RACER") else {
        return;
    };
    let mut parts = spec.split('|');
    let (dir, role, hold) = (parts.next().unwrap(), parts.next().unwrap(), parts.next().unwrap());
    let hold = std::time::Duration::from_millis(hold.parse().unwrap());
    let fake = Fake::new(vec![]);
    let st = Store::new(dir.into(), fake.device.clone(), fake.toolchain.clone());
    std::fs::write(st.dir.join(format!("ready-{role}")), "").unwrap();
    let log = st.dir.join("inside.log");
    let mut w = Vec::new();
    st.update(&mut w, |_| {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(&log)
            .unwrap();
        writeln!(f, "enter {role}").unwrap();
        std::thread::sleep(hold);
        writeln!(f, "leave {role}").unwrap();
    })
    .unwrap();
}

/// A test of this file as the harness names it, for a child process that
/// runs just that one (`--exact`): `decision_cache::NAME` in the crate's
/// one test binary (tests/all), whatever the module path above this file.
fn test_name(name: &str) -> String {
    match module_path!().split_once("::") {
        Some((_, module)) => format!("{module}::{name}"),
        None => name.to_string(),
    }
}

/// Whether `strace` can trace a child here (it is part of the project's
/// machine image; ptrace may be forbidden in some containers).
fn strace_works() -> Result<(), String> {
    let out = std::process::Command::new("strace")
        .args(["-qq", "-o", "/dev/null", "-e", "trace=unlink", "true"])
        .output()
        .map_err(|e| format!("strace not found ({e})"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "strace cannot trace here: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// The race, made to happen every time: a waiter that judged the lock
/// stale is held (by strace) just before it removes the lock for 0.6 s;
/// meanwhile a second process breaks the stale lock and takes a fresh one.
/// The first waiter must not then remove that fresh lock and enter too.
#[test]
fn a_waiter_delayed_while_breaking_a_stale_lock_never_removes_a_fresh_one() {
    if let Err(why) = strace_works() {
        if std::env::var_os("KIVI_REQUIRE_STRACE").is_some() {
            panic!("{why}");
        }
        eprintln!("skipped: {why} (set KIVI_REQUIRE_STRACE=1 to fail instead)");
        return;
    }
    let (_, st) = tuned_store("stale-strace");
    plant_stale_lock(&st);
    let exe = std::env::current_exe().unwrap();
    let racer = |role: &str, hold_ms: u32| format!("{}|{role}|{hold_ms}", st.dir.display());
    // Every unlink of the slow waiter waits 0.6 s before it happens.
    let mut slow = std::process::Command::new("strace")
        .args(["-f", "-qq", "-o", "/dev/null", "-e", "trace=unlink,unlinkat"])
        .args(["-e", "inject=unlink,unlinkat:delay_enter=600000"])
        .arg(&exe)
        .args(["--exact", test_name("stale_lock_racer").as_str(), "--test-threads=1"])
        .env("KIVI_TUNER_TEST_RACER", racer("slow", 100))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ready = st.dir.join("ready-slow");
    let t0 = std::time::Instant::now();
    while !ready.exists() {
        assert!(t0.elapsed().as_secs() < 60, "the slow waiter never started");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    // The slow waiter is now inside its delayed removal of the stale lock.
    std::thread::sleep(std::time::Duration::from_millis(200));
    let mut fast = std::process::Command::new(&exe)
        .args(["--exact", test_name("stale_lock_racer").as_str(), "--test-threads=1"])
        .env("KIVI_TUNER_TEST_RACER", racer("fast", 1500))
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    assert!(fast.wait().unwrap().success());
    assert!(slow.wait().unwrap().success());
    let log = std::fs::read_to_string(st.dir.join("inside.log")).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    assert_eq!(lines.len(), 4, "{log}");
    assert!(
        lines[0].starts_with("enter") && lines[1] == lines[0].replace("enter", "leave"),
        "the two writers overlapped:\n{log}"
    );
}

/// Child of the fsync test: one save into `KIVI_TUNER_TEST_SAVER=dir`.
#[test]
fn saver_child() {
    let Ok(dir) = std::env::var("KIVI_TUNER_TEST_SAVER") else {
        return;
    };
    let fake = Fake::new(vec![cand("default", 0.001), cand("a", 0.0005)]);
    let st = Store::new(dir.into(), fake.device.clone(), fake.toolchain.clone());
    let e = entry_for(&fake, &st, bucket());
    let mut one = BTreeMap::new();
    one.insert(entry_key(kivi_spec::scheme_hash(&scheme()), &e.bucket), e);
    st.save(&one, &mut Vec::new()).unwrap();
}

/// A rename is durable only once its directory is synced: watch the
/// system calls of a save (strace) for an fsync of the cache directory
/// after the rename that replaces the decision file.
#[test]
fn a_save_syncs_the_directory_after_the_rename() {
    if let Err(why) = strace_works() {
        if std::env::var_os("KIVI_REQUIRE_STRACE").is_some() {
            panic!("{why}");
        }
        eprintln!("skipped: {why} (set KIVI_REQUIRE_STRACE=1 to fail instead)");
        return;
    }
    let dir = temp_dir("fsync");
    let trace = dir.join("strace.log");
    let status = std::process::Command::new("strace")
        .args(["-f", "-qq", "-y", "-o"])
        .arg(&trace)
        .args(["-e", "trace=rename,renameat,renameat2,fsync,fdatasync"])
        .arg(std::env::current_exe().unwrap())
        .args(["--exact", test_name("saver_child").as_str(), "--test-threads=1"])
        .env("KIVI_TUNER_TEST_SAVER", &dir)
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    let log = std::fs::read_to_string(&trace).unwrap();
    let lines: Vec<&str> = log.lines().collect();
    let rename = lines
        .iter()
        .position(|l| l.contains("rename") && l.contains(".tmp-") && l.contains("decisions-fake-"))
        .unwrap_or_else(|| panic!("no rename of the decision file in:\n{log}"));
    let dir_fd = format!("<{}>", dir.display());
    assert!(
        lines[rename..]
            .iter()
            .any(|l| (l.contains("fsync(") || l.contains("fdatasync(")) && l.contains(&dir_fd)),
        "no fsync of {} after the rename:\n{log}",
        dir.display()
    );
}

#[test]
fn a_toolchain_change_moves_the_old_file_aside_with_every_scheme() {
    // Two schemes tuned by one toolchain.
    let (fake, st) = tuned_store("toolchain");
    let other = kivi_spec::presets::kivi4()
        .with_shape(kivi_spec::Heads::Gqa { q: 8, kv: 2 }, 64)
        .unwrap();
    let plan = Plan {
        budget_s: 10.0,
        ..Plan::default()
    };
    let mut w = Vec::new();
    tune::run(&fake, &st, &other, &[bucket()], &plan, &mut (), &mut w);
    let old_text = std::fs::read_to_string(st.path()).unwrap();
    let mut w = Vec::new();
    assert_eq!(st.load(&mut w).entries.len(), 2);
    // A new toolchain tunes one of them.
    let mut newer = Fake::new(fake.cands.clone());
    newer.toolchain = kivi_tuner::Toolchain::current("fakec 2.0");
    let st2 = Store::new(st.dir.clone(), newer.device.clone(), newer.toolchain.clone());
    assert_eq!(st2.path(), st.path(), "same device, same file");
    let (o, w) = retune(&newer, &st2);
    assert!(matches!(o.origin, DecisionOrigin::Tuned { .. }), "{:?}", o.origin);
    // Reported, with where the old file went ...
    let note = w
        .iter()
        .find(|m| m.contains("stale") && m.contains("kept as"))
        .unwrap_or_else(|| panic!("no warning names the moved file: {w:?}"));
    let aside: Vec<std::path::PathBuf> = std::fs::read_dir(&st.dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains(".json.stale-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(note.contains(&aside[0].display().to_string()), "{note}");
    // ... unchanged, with both schemes' entries; the new file has the new one.
    assert_eq!(std::fs::read_to_string(&aside[0]).unwrap(), old_text);
    let mut w = Vec::new();
    assert_eq!(st2.load(&mut w).entries.len(), 1);
    assert!(w.is_empty(), "{w:?}");
    // `kivi inspect --all` still lists it, as ignored (stale).
    let listed = decisions::scan(&st.dir);
    assert!(
        listed
            .iter()
            .any(|(p, r)| p == &aside[0] && matches!(r, Err(decisions::Distrust::Stale(_)) | Ok(_))),
        "{listed:?}"
    );
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
    assert_eq!(o.origin, DecisionOrigin::Cached, "{w:?}");
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

/// Found by the decision-file fuzzer: a file whose chosen candidate is
/// marked rejected (it failed its check against the reference) parsed as
/// trusted, so selection would have run a wrong variant.
#[test]
fn a_file_that_chose_a_rejected_candidate_is_not_trusted() {
    let (fake, st) = tuned_store("chose-rejected");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(st.path()).unwrap()).unwrap();
    let entry = v["entries"].as_object_mut().unwrap().values_mut().next().unwrap();
    let chosen = entry["chosen"].as_str().unwrap().to_string();
    assert_eq!(chosen, "a");
    for c in entry["candidates"].as_array_mut().unwrap() {
        if c["name"] == chosen.as_str() {
            c["status"] = "rejected".into();
        }
    }
    std::fs::write(st.path(), serde_json::to_string_pretty(&v).unwrap()).unwrap();
    let opts = SelectOptions {
        mode: Mode::Cached,
        cache_dir: Some(st.dir.clone()),
        budget_s: 1.0,
    };
    let sel = select_with(&fake, &scheme(), bucket(), &opts).unwrap();
    assert_eq!((sel.variant.as_str(), sel.source), ("default", Source::Default));
    assert!(
        sel.warnings
            .iter()
            .any(|w| w.contains("chose `a`, which is marked rejected")),
        "{:?}",
        sel.warnings
    );
}
