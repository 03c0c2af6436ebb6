//! The harness every fuzz target shares (included with `#[path]` by the
//! fuzz tests of several crates, so there is one copy).
//!
//! Each case gets its own seeded RNG, so a failure names the seed that
//! reproduces it alone: `KIVI_FUZZ_SEED=<seed> KIVI_FUZZ_CASES=1 cargo test
//! ... --test <target>`. `KIVI_FUZZ_CASES` scales every target (CI runs the
//! default; `scripts/fuzz.sh` runs more). A case fails by panicking (caught
//! here, so one bad case does not hide the others) or by returning `Err`
//! (a property that did not hold).
#![allow(dead_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

pub use fastrand::Rng;

/// Prints a line to the real stderr. The test harness captures `eprintln!`
/// of passing tests; the fuzz counts must reach the CI log all the same.
macro_rules! log {
    ($($fmt:tt)+) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($fmt)+);
    }};
}

/// Cases per target: `KIVI_FUZZ_CASES`, else `default`.
pub fn cases(default: usize) -> usize {
    match std::env::var("KIVI_FUZZ_CASES") {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("KIVI_FUZZ_CASES={v:?} is not a count")),
        Err(_) => default,
    }
}

/// The first case's seed: `KIVI_FUZZ_SEED` (decimal or 0x hex), else a fixed one
/// so that CI runs the same cases every time.
pub fn base_seed() -> u64 {
    match std::env::var("KIVI_FUZZ_SEED") {
        Ok(v) => {
            let v = v.trim();
            let parsed = match v.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => v.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("KIVI_FUZZ_SEED={v:?} is not a number"))
        }
        Err(_) => 0x6b69_7669_0000_0000,
    }
}

/// Runs `case` `n` times (pass [`cases`]`(default)`), case `i` with seed
/// `base + i`, prints `fuzz NAME: N cases, P panics, F failures, T s` and
/// fails the test with the first few seeds and messages when any case failed.
pub fn run(name: &str, n: usize, mut case: impl FnMut(&mut Rng) -> Result<(), String>) {
    let base = base_seed();
    let start = Instant::now();
    let (mut panics, mut failures) = (Vec::new(), Vec::new());
    for i in 0..n {
        let seed = base.wrapping_add(i as u64);
        let mut rng = Rng::with_seed(seed);
        match catch_unwind(AssertUnwindSafe(|| case(&mut rng))) {
            Ok(Ok(())) => {}
            Ok(Err(msg)) => failures.push((seed, msg)),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "non-string panic".into());
                panics.push((seed, msg));
            }
        }
    }
    log!(
        "fuzz {name}: {n} cases, {} panics, {} failures, {:.1} s (seeds {base:#x}..; KIVI_FUZZ_CASES, KIVI_FUZZ_SEED)",
        panics.len(),
        failures.len(),
        start.elapsed().as_secs_f64()
    );
    if panics.is_empty() && failures.is_empty() {
        return;
    }
    let mut report = String::new();
    for (kind, list) in [("panic", &panics), ("failure", &failures)] {
        for (seed, msg) in list.iter().take(5) {
            report.push_str(&format!(
                "\n  {kind} at seed {seed:#x} (KIVI_FUZZ_SEED={seed:#x} KIVI_FUZZ_CASES=1): {msg}"
            ));
        }
    }
    panic!(
        "fuzz {name}: {} panics and {} failures in {n} cases:{report}",
        panics.len(),
        failures.len()
    );
}

/// A `Result` check with a message, for properties inside a case (the
/// including file declares the module `#[macro_use]`).
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// A random element of a slice.
pub fn pick<'a, T>(rng: &mut Rng, xs: &'a [T]) -> &'a T {
    &xs[rng.usize(..xs.len())]
}

/// An error message a user can act on: one line, non-empty, starts in lower
/// case (or with a quoted value), names something (has a letter).
pub fn check_message(msg: &str) -> Result<(), String> {
    let first = msg.chars().next();
    if msg.trim().is_empty() || !msg.chars().any(|c| c.is_alphabetic()) {
        return Err(format!("empty or wordless error message {msg:?}"));
    }
    if first.is_some_and(|c| c.is_uppercase()) {
        return Err(format!("error message starts in upper case: {msg:?}"));
    }
    if msg.ends_with('.') {
        return Err(format!("error message ends with a period: {msg:?}"));
    }
    Ok(())
}
