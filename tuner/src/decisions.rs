//! The decision cache: what was measured, what was chosen and why.
//!
//! One JSON file per (backend, device fingerprint) under the cache
//! directory, `decisions-<backend>-<fingerprint id>.json`. Inside, one
//! [`Entry`] per (canonical scheme hash, shape bucket) keeps the timing of
//! *every* candidate with the hash of what was timed, so adding a variant
//! later tunes only the new one, and an edited variant (new source hash)
//! only itself.
//!
//! Trust rules (DESIGN.md §6):
//! - A file that does not parse, has another format marker, another schema,
//!   another toolchain (stale) or another device (foreign) is reported as a
//!   warning and ignored — never trusted, never a crash. The next write
//!   starts a new file and first moves the old one aside, unchanged, as
//!   `<name>.bad-<unix time>` (corrupt or foreign) or
//!   `<name>.stale-<unix time>` (another schema or toolchain: every scheme's
//!   entries are kept there for `kivi inspect --all`; timings taken by
//!   another toolchain are not reused). A name already taken gets a `.N`
//!   suffix, so nothing moved aside is ever overwritten.
//! - Writes go to a temporary file in the same directory, synced, renamed
//!   over the old one (atomic on POSIX), and then the directory is synced so
//!   that the rename itself survives a crash: a reader sees the old or the
//!   new file, never half of one.
//! - Writers take `<file>.lock` (created with `create_new`, so only one
//!   process can hold it; it holds a token unique to its holder), re-read
//!   the file under the lock and merge their entries into it, so two tuners
//!   running at once both keep their results. A lock older than
//!   [`STALE_LOCK`] is considered abandoned (a crashed writer) and broken —
//!   by exactly one waiter: breaking the lock with token `T` first takes
//!   `<file>.lock.break-T` with `create_new`, then removes the lock only if
//!   it still holds `T`. Two waiters that saw the same stale lock can
//!   therefore never remove each other's fresh lock.

use crate::bucket::Bucket;
use crate::fingerprint::{Fingerprint, Toolchain, SCHEMA_VERSION};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Marker in every decision file, so that a foreign JSON file is recognised.
pub const FORMAT: &str = "kivi-decisions";

/// A lock held longer than this belongs to a dead writer (a merge takes milliseconds).
pub const STALE_LOCK: Duration = Duration::from_secs(30);

/// Outcome of one candidate in one bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Verified and timed to the end.
    Ok,
    /// Verified, timed, then dropped early as clearly slower than the best.
    Eliminated,
    /// Disagreed with the reference (or failed to run): never timed.
    Rejected,
    /// Removed before compiling/running: launch limits, resources, shape.
    Pruned,
    /// The time budget ran out before it was timed.
    Skipped,
}

impl Status {
    /// Whether the candidate has a usable timing.
    pub fn timed(self) -> bool {
        matches!(self, Status::Ok | Status::Eliminated)
    }
    pub fn name(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Eliminated => "eliminated",
            Status::Rejected => "rejected",
            Status::Pruned => "pruned",
            Status::Skipped => "skipped",
        }
    }
}

/// Timing summary of one candidate, in seconds per call (`CandidateTiming`:
/// the runtime's device `Timing` is the raw event times of one launch set).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct CandidateTiming {
    pub median_s: f64,
    pub p20_s: f64,
    pub p80_s: f64,
    pub samples: u32,
    /// KV bytes read per call divided by the median.
    pub gbps: f64,
}

impl CandidateTiming {
    /// Half the p20..p80 spread relative to the median: this candidate's noise.
    pub fn noise(&self) -> f64 {
        if self.median_s > 0.0 {
            (self.p80_s - self.p20_s) / self.median_s / 2.0
        } else {
            0.0
        }
    }
}

/// One candidate's record in a bucket.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CandidateRecord {
    pub name: String,
    /// Hash of what was timed (generated source for CUDA, parameters for CPU), hex.
    pub hash: String,
    pub status: Status,
    /// Why it was rejected, pruned, eliminated or skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timing: Option<CandidateTiming>,
    /// Static facts (resources, launch shape) shown by `kivi inspect`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
    /// Unix seconds of the measurement.
    pub measured_at: u64,
}

/// The decision for one (scheme, bucket).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    /// Scheme name when tuned (informational; the hash is the key).
    pub scheme: String,
    /// `kivi_spec::scheme_hash` of the bound scheme, joined with the
    /// calibration's hash when tuned with one ([`crate::tune::decision_hash`]), hex.
    pub scheme_hash: String,
    pub bucket: Bucket,
    /// The variant to run.
    pub chosen: String,
    /// The heuristic default variant for this bucket (always a candidate).
    pub default: String,
    /// Why `chosen` won, in words.
    pub reason: String,
    /// Set by `kivi tune --pin`: later tuning keeps this choice.
    #[serde(default)]
    pub pinned: bool,
    /// Every candidate, canonical order (the default first).
    pub candidates: Vec<CandidateRecord>,
    /// How the timings were taken (clock, rotation, warm-up).
    pub method: String,
    /// The device's peak bandwidth estimate (GB/s) used for the roofline column.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_gbps: Option<f64>,
    /// Unix seconds of the decision.
    pub decided_at: u64,
}

impl Entry {
    /// The record of a candidate by name.
    pub fn candidate(&self, name: &str) -> Option<&CandidateRecord> {
        self.candidates.iter().find(|c| c.name == name)
    }
}

/// Key of an entry inside a file: `<scheme hash>/<bucket key>`.
pub fn entry_key(scheme_hash: u64, bucket: &Bucket) -> String {
    format!("{scheme_hash:016x}/{}", bucket.key())
}

/// A whole decision file (also the format of exported bundles).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecisionFile {
    /// Always [`FORMAT`].
    pub format: String,
    /// [`SCHEMA_VERSION`] of the writer.
    pub schema: u32,
    pub device: Fingerprint,
    pub toolchain: Toolchain,
    pub entries: BTreeMap<String, Entry>,
}

impl DecisionFile {
    /// An empty file for a device and toolchain.
    pub fn new(device: Fingerprint, toolchain: Toolchain) -> Self {
        DecisionFile {
            format: FORMAT.into(),
            schema: SCHEMA_VERSION,
            device,
            toolchain,
            entries: BTreeMap::new(),
        }
    }
}

/// Why a file was not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Distrust {
    /// Unreadable, not JSON, truncated, or not a decision file.
    Corrupt(String),
    /// Written by another schema or toolchain.
    Stale(String),
    /// Written for another device.
    Foreign(String),
}

impl Distrust {
    /// The suffix a file of this kind is moved aside with (`.bad-` or `.stale-`).
    fn aside_tag(&self) -> &'static str {
        match self {
            Distrust::Stale(_) => "stale",
            Distrust::Corrupt(_) | Distrust::Foreign(_) => "bad",
        }
    }

    /// The same reason with control characters escaped: it quotes the
    /// file's own text (keys, names, toolchain), which must not add lines
    /// to a one-line warning (found by the decision-file fuzzer).
    fn one_line(self) -> Distrust {
        let clean = |s: String| -> String {
            s.chars()
                .flat_map(|c| {
                    let esc: Vec<char> = if c.is_control() {
                        c.escape_default().collect()
                    } else {
                        vec![c]
                    };
                    esc
                })
                .collect()
        };
        match self {
            Distrust::Corrupt(s) => Distrust::Corrupt(clean(s)),
            Distrust::Stale(s) => Distrust::Stale(clean(s)),
            Distrust::Foreign(s) => Distrust::Foreign(clean(s)),
        }
    }
}

impl std::fmt::Display for Distrust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Distrust::Corrupt(s) => write!(f, "corrupt: {s}"),
            Distrust::Stale(s) => write!(f, "stale: {s}"),
            Distrust::Foreign(s) => write!(f, "foreign: {s}"),
        }
    }
}

/// Parses and checks a decision file's text against the expected device and
/// toolchain (either may be `None` to accept any, as `inspect` does).
pub fn parse_checked(
    text: &str,
    device: Option<&Fingerprint>,
    toolchain: Option<&Toolchain>,
) -> Result<DecisionFile, Distrust> {
    check_file(text, device, toolchain).map_err(Distrust::one_line)
}

fn check_file(
    text: &str,
    device: Option<&Fingerprint>,
    toolchain: Option<&Toolchain>,
) -> Result<DecisionFile, Distrust> {
    // Peek at the marker and schema first so that an old-schema file is
    // reported as stale rather than as a parse error of the new layout.
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| Distrust::Corrupt(format!("not valid JSON ({e})")))?;
    if value.get("format").and_then(|v| v.as_str()) != Some(FORMAT) {
        return Err(Distrust::Corrupt(format!("not a {FORMAT} file")));
    }
    match value.get("schema").and_then(|v| v.as_u64()) {
        Some(s) if s == SCHEMA_VERSION as u64 => {}
        Some(s) => {
            return Err(Distrust::Stale(format!(
                "schema {s}, this build reads schema {SCHEMA_VERSION}"
            )))
        }
        None => return Err(Distrust::Corrupt("no schema version".into())),
    }
    let file: DecisionFile =
        serde_json::from_value(value).map_err(|e| Distrust::Corrupt(format!("malformed ({e})")))?;
    if let Some(d) = device {
        if file.device != *d {
            return Err(Distrust::Foreign(format!(
                "written for {}, this is {}",
                file.device.summary(),
                d.summary()
            )));
        }
    }
    if let Some(t) = toolchain {
        if file.toolchain != *t {
            return Err(Distrust::Stale(format!(
                "written by {}, this is {}",
                file.toolchain.summary(),
                t.summary()
            )));
        }
    }
    for (key, e) in &file.entries {
        let Some(hash) = u64::from_str_radix(&e.scheme_hash, 16).ok() else {
            return Err(Distrust::Corrupt(format!("entry `{key}` has a bad scheme hash")));
        };
        if *key != entry_key(hash, &e.bucket) {
            return Err(Distrust::Corrupt(format!(
                "entry `{key}` does not match its scheme hash and bucket"
            )));
        }
        match e.candidate(&e.chosen) {
            None => {
                return Err(Distrust::Corrupt(format!(
                    "entry `{key}` chose `{}`, which it never measured",
                    e.chosen
                )))
            }
            // Only a verified candidate is ever chosen (tuned or pinned): a
            // file that says otherwise would run a variant that failed its
            // check against the reference.
            Some(c) if c.status != Status::Ok => {
                return Err(Distrust::Corrupt(format!(
                    "entry `{key}` chose `{}`, which is marked {}",
                    e.chosen,
                    c.status.name()
                )))
            }
            Some(_) => {}
        }
    }
    Ok(file)
}

/// The cache directory: `flag`, else `$KIVI_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/kivi`, else `$HOME/.cache/kivi`.
pub fn cache_dir(flag: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = flag {
        return Ok(p.to_path_buf());
    }
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = env("KIVI_CACHE_DIR") {
        return Ok(p);
    }
    if let Some(p) = env("XDG_CACHE_HOME") {
        return Ok(p.join("kivi"));
    }
    if let Some(p) = env("HOME") {
        return Ok(p.join(".cache").join("kivi"));
    }
    Err("no cache directory: pass --cache-dir or set KIVI_CACHE_DIR".into())
}

/// Unix seconds now.
pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// The decision cache of one device under one directory.
#[derive(Clone, Debug)]
pub struct Store {
    pub dir: PathBuf,
    pub device: Fingerprint,
    pub toolchain: Toolchain,
}

impl Store {
    pub fn new(dir: PathBuf, device: Fingerprint, toolchain: Toolchain) -> Self {
        Store { dir, device, toolchain }
    }

    /// This device's file.
    pub fn path(&self) -> PathBuf {
        self.dir.join(format!(
            "decisions-{}-{:016x}.json",
            self.device.backend,
            self.device.id()
        ))
    }

    /// Loads this device's decisions. A missing file is an empty cache; an
    /// untrusted one is an empty cache plus a warning in `warnings`.
    pub fn load(&self, warnings: &mut Vec<String>) -> DecisionFile {
        match self.read() {
            Ok(Some(f)) => f,
            Ok(None) => self.empty(),
            Err(d) => {
                warnings.push(format!(
                    "ignoring decision file {}: {d}; affected buckets will be re-tuned",
                    self.path().display()
                ));
                self.empty()
            }
        }
    }

    fn empty(&self) -> DecisionFile {
        DecisionFile::new(self.device.clone(), self.toolchain.clone())
    }

    /// `Ok(None)` when there is no file.
    fn read(&self) -> Result<Option<DecisionFile>, Distrust> {
        let text = match fs::read(self.path()) {
            Ok(b) => String::from_utf8(b).map_err(|_| Distrust::Corrupt("not UTF-8 text".into()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(Distrust::Corrupt(format!("unreadable ({e})"))),
        };
        parse_checked(&text, Some(&self.device), Some(&self.toolchain)).map(Some)
    }

    /// Merges `entries` into the file under the lock (re-reading it first,
    /// so concurrent writers' entries survive) and writes it atomically.
    /// Entries given here replace those with the same key.
    pub fn save(&self, entries: &BTreeMap<String, Entry>, warnings: &mut Vec<String>) -> Result<(), String> {
        self.update(warnings, |file| {
            for (k, e) in entries {
                file.entries.insert(k.clone(), e.clone());
            }
        })
    }

    /// Runs `f` on the current file contents under the lock and writes the result.
    pub fn update(&self, warnings: &mut Vec<String>, f: impl FnOnce(&mut DecisionFile)) -> Result<(), String> {
        fs::create_dir_all(&self.dir)
            .map_err(|e| format!("cannot create cache directory {}: {e}", self.dir.display()))?;
        let path = self.path();
        let _lock = Lock::acquire(&lock_path(&path))?;
        let mut file = match self.read() {
            Ok(Some(f)) => f,
            Ok(None) => self.empty(),
            Err(d) => {
                match move_aside(&path, d.aside_tag()) {
                    Ok(aside) => warnings.push(format!(
                        "replacing decision file {} ({d}); the old one is kept as {}",
                        path.display(),
                        aside.display()
                    )),
                    Err(e) => warnings.push(format!(
                        "replacing decision file {} ({d}); could not keep a copy: {e}",
                        path.display()
                    )),
                }
                self.empty()
            }
        };
        f(&mut file);
        let text = serde_json::to_string_pretty(&file).map_err(|e| format!("cannot encode decisions: {e}"))?;
        write_atomic(&path, text.as_bytes())
    }
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

fn lock_path(path: &Path) -> PathBuf {
    with_suffix(path, ".lock")
}

/// Moves `path` to `<path>.<tag>-<unix time>` (or `...-<unix time>.N` when
/// that name is taken: a hard link never replaces an existing file, so no
/// earlier copy is lost) and returns the new name. Called under the lock.
fn move_aside(path: &Path, tag: &str) -> std::io::Result<PathBuf> {
    let base = with_suffix(path, &format!(".{tag}-{}", now_unix()));
    for n in 0..1000 {
        let aside = if n == 0 {
            base.clone()
        } else {
            with_suffix(&base, &format!(".{n}"))
        };
        match fs::hard_link(path, &aside) {
            Ok(()) => {
                fs::remove_file(path)?;
                sync_dir(path)?;
                return Ok(aside);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            // No hard links on this file system: a rename onto a name that
            // was free a moment ago (we hold the lock) is as good.
            Err(_) if !aside.exists() => {
                fs::rename(path, &aside)?;
                sync_dir(path)?;
                return Ok(aside);
            }
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::other(format!(
        "every name like {} is taken",
        base.display()
    )))
}

/// Syncs the directory holding `path`, so that a rename or removal in it is
/// on disk (a file's own sync does not cover its directory entry).
fn sync_dir(path: &Path) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    #[cfg(test)]
    tests::SYNCED_DIRS.lock().unwrap().push(dir.to_path_buf());
    // Directories cannot be opened for syncing on every platform (Windows);
    // there a rename is as durable as the file system makes it.
    if cfg!(unix) {
        fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
}

/// Writes `bytes` to a unique temporary file next to `path`, syncs it and
/// renames it over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = dir.join(
        format!(
            ".{name}.tmp-{}-{nanos}-{:?}",
            std::process::id(),
            std::thread::current().id()
        )
        .replace(['(', ')'], ""),
    );
    let result = (|| {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        sync_dir(path)
    })();
    result.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        format!("cannot write {}: {e}", path.display())
    })
}

/// An exclusive lock file holding a token unique to its holder, removed on drop.
struct Lock {
    path: PathBuf,
}

/// A token no other lock holder has: process, thread, time and a counter.
fn unique_token() -> String {
    static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!(
        "{}-{nanos}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    )
}

/// What identifies one lock file instance: its token, or (for a holder that
/// died before writing it) its modification time.
fn lock_identity(path: &Path) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    let token = text.trim();
    if token.is_empty() {
        let m = fs::metadata(path).ok()?.modified().ok()?;
        let t = m.duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        Some(format!("empty-{t}"))
    } else {
        // Tokens are ours (digits and dashes); anything else is made safe
        // for a file name rather than trusted.
        Some(
            token
                .chars()
                .take(64)
                .map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' })
                .collect(),
        )
    }
}

fn age(path: &Path) -> Option<Duration> {
    fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|m| m.elapsed().ok())
}

impl Lock {
    fn acquire(path: &Path) -> Result<Lock, String> {
        let start = std::time::Instant::now();
        let mut wait = Duration::from_millis(1);
        let token = unique_token();
        loop {
            match fs::OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(mut f) => {
                    let _ = writeln!(f, "{token}");
                    return Ok(Lock {
                        path: path.to_path_buf(),
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if age(path).is_some_and(|a| a > STALE_LOCK) {
                        // The holder died mid-merge; its temp file never
                        // replaced the real one, so breaking the lock is safe.
                        if let Some(id) = lock_identity(path) {
                            break_stale(path, &id);
                        }
                        continue;
                    }
                    if start.elapsed() > STALE_LOCK + Duration::from_secs(5) {
                        return Err(format!(
                            "timed out waiting for {}; remove it if no tuner is running",
                            path.display()
                        ));
                    }
                    std::thread::sleep(wait);
                    wait = (wait * 2).min(Duration::from_millis(50));
                }
                Err(e) => return Err(format!("cannot create lock {}: {e}", path.display())),
            }
        }
    }
}

/// Removes the stale lock instance `id` at `path`, if this caller wins the
/// right to: only the waiter that creates `<lock>.break-<id>` may remove it,
/// and only while the lock still is that instance and still stale. Once
/// checked, the instance cannot change under us: its holder is dead and we
/// are its only breaker. A waiter that comes late finds another token (or
/// a fresh lock) and leaves it alone.
fn break_stale(path: &Path, id: &str) {
    let breaker = with_suffix(path, &format!(".break-{id}"));
    match fs::OpenOptions::new().write(true).create_new(true).open(&breaker) {
        Ok(_) => {
            if lock_identity(path).as_deref() == Some(id) && age(path).is_some_and(|a| a > STALE_LOCK) {
                let _ = fs::remove_file(path);
            }
            let _ = fs::remove_file(&breaker);
        }
        Err(_) => {
            // Another waiter is breaking it (a moment), or died doing so
            // (its breaker is then as old as a stale lock: clear it).
            if age(&breaker).is_some_and(|a| a > STALE_LOCK) {
                let _ = fs::remove_file(&breaker);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Every decision file in a directory with how far it can be trusted
/// (for `kivi inspect`): `(path, Ok(file) | Err(why))`.
pub fn scan(dir: &Path) -> Vec<(PathBuf, Result<DecisionFile, Distrust>)> {
    let mut out = Vec::new();
    let Ok(rd) = fs::read_dir(dir) else {
        return out;
    };
    let mut paths: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let n = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            // Files moved aside are listed too, as ignored.
            n.starts_with("decisions-")
                && (n.ends_with(".json") || n.contains(".json.bad-") || n.contains(".json.stale-"))
        })
        .collect();
    paths.sort();
    for p in paths {
        let r = match fs::read_to_string(&p) {
            Ok(t) => parse_checked(&t, None, None),
            Err(e) => Err(Distrust::Corrupt(format!("unreadable ({e})"))),
        };
        out.push((p, r));
    }
    out
}

/// Writes the decisions of one device file as a bundle (the same format),
/// so that they can be imported on another machine with the same device.
pub fn export_bundle(store: &Store, out: &Path) -> Result<usize, String> {
    let file = match store.read() {
        Ok(Some(f)) => f,
        Ok(None) => return Err(format!("no decisions for this device in {}", store.dir.display())),
        Err(d) => return Err(format!("cannot export {}: {d}", store.path().display())),
    };
    let text = serde_json::to_string_pretty(&file).map_err(|e| format!("cannot encode decisions: {e}"))?;
    write_atomic(out, text.as_bytes())?;
    Ok(file.entries.len())
}

/// Imports a bundle into `dir`: checked like any decision file, then merged
/// into the file of the bundle's own device (a bundle from another GPU
/// model lands in that model's file and is used only on such a device).
/// Returns the number of entries merged.
pub fn import_bundle(dir: &Path, bundle: &Path, warnings: &mut Vec<String>) -> Result<usize, String> {
    let text = fs::read_to_string(bundle).map_err(|e| format!("cannot read {}: {e}", bundle.display()))?;
    let file = parse_checked(&text, None, None).map_err(|d| format!("refusing to import {}: {d}", bundle.display()))?;
    let store = Store::new(dir.to_path_buf(), file.device.clone(), file.toolchain.clone());
    let n = file.entries.len();
    store.save(&file.entries, warnings)?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Directories `sync_dir` synced, in order (all tests of this module).
    pub(super) static SYNCED_DIRS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

    fn temp_dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kivi-decisions-unit-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    fn synced(dir: &Path) -> usize {
        SYNCED_DIRS
            .lock()
            .unwrap()
            .iter()
            .filter(|d| d.as_path() == dir)
            .count()
    }

    #[test]
    fn an_atomic_write_syncs_its_directory_after_the_rename() {
        let dir = temp_dir("sync");
        let path = dir.join("decisions-x.json");
        write_atomic(&path, b"{}").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"{}");
        assert_eq!(synced(&dir), 1, "the directory was not synced after the rename");
        // Moving a file aside is a rename too.
        let aside = move_aside(&path, "bad").unwrap();
        assert!(!path.exists() && aside.exists());
        assert_eq!(synced(&dir), 2);
    }

    #[test]
    fn moving_aside_never_overwrites_an_earlier_copy() {
        let dir = temp_dir("aside");
        let path = dir.join("decisions-x.json");
        let mut kept = Vec::new();
        for i in 0..3 {
            fs::write(&path, format!("copy {i}")).unwrap();
            kept.push(move_aside(&path, "stale").unwrap());
        }
        // Same second, three names; each holds its own copy.
        for (i, p) in kept.iter().enumerate() {
            assert_eq!(fs::read_to_string(p).unwrap(), format!("copy {i}"), "{}", p.display());
            assert!(p.to_string_lossy().contains(".json.stale-"), "{}", p.display());
        }
    }

    /// Found by the decision-file fuzzer: serde_json's default float parser
    /// can be 1 ulp off, so every merge (read, then write) of a file nudged
    /// other entries' timings. The workspace enables `float_roundtrip`.
    #[test]
    fn timings_survive_a_read_and_write_bit_for_bit() {
        let t = CandidateTiming {
            median_s: 0.01,
            p20_s: 0.009940000000000003,
            p80_s: 0.01006,
            samples: 15,
            gbps: 0.1,
        };
        let text = serde_json::to_string(&t).unwrap();
        let back: CandidateTiming = serde_json::from_str(&text).unwrap();
        assert_eq!(back.p20_s.to_bits(), t.p20_s.to_bits(), "{text}");
    }

    /// Found by the decision-file fuzzer: a reason quoted the file's text
    /// as is, so a line break in it split a one-line warning in two.
    #[test]
    fn reasons_quoting_the_file_stay_on_one_line() {
        let device = Fingerprint {
            backend: "cpu".into(),
            name: "x".into(),
            facts: BTreeMap::new(),
        };
        let mut theirs = Toolchain::current("rustc");
        theirs.compiler = "rustc\nkivi: error: injected".into();
        let text = serde_json::to_string(&DecisionFile::new(device.clone(), theirs)).unwrap();
        let d = parse_checked(&text, Some(&device), Some(&Toolchain::current("rustc"))).unwrap_err();
        assert!(matches!(d, Distrust::Stale(_)), "{d}");
        assert!(
            !d.to_string().contains('\n') && d.to_string().contains("rustc\\nkivi"),
            "{d}"
        );
    }

    #[test]
    fn a_fresh_lock_is_never_broken_by_a_late_waiter() {
        let dir = temp_dir("late");
        let lock = dir.join("x.lock");
        // A waiter judged an old instance stale, then a new holder took the
        // lock before the waiter got to break it: the new lock stays.
        fs::write(&lock, "new-holder\n").unwrap();
        break_stale(&lock, "old-holder");
        assert_eq!(fs::read_to_string(&lock).unwrap(), "new-holder\n");
        // Even when the waiter read the new token: the lock is fresh.
        break_stale(&lock, "new-holder");
        assert!(lock.exists());
        assert!(!with_suffix(&lock, ".break-new-holder").exists());
    }
}
