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
//!   replaces it; a corrupt or foreign file is first moved aside as
//!   `<name>.bad-<unix time>` so that it can be inspected.
//! - Writes go to a temporary file in the same directory and are renamed
//!   over the old one (atomic on POSIX), so a reader sees the old or the new
//!   file, never half of one.
//! - Writers take `<file>.lock` (created with `create_new`, so only one
//!   process can hold it), re-read the file under the lock and merge their
//!   entries into it, so two tuners running at once both keep their
//!   results. A lock older than [`STALE_LOCK`] is considered abandoned (a
//!   crashed writer) and broken.

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

/// Timing summary of one candidate, in seconds per call.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub median_s: f64,
    pub p20_s: f64,
    pub p80_s: f64,
    pub samples: u32,
    /// KV bytes read per call divided by the median.
    pub gbps: f64,
}

impl Timing {
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
    pub timing: Option<Timing>,
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
    /// `kivi_spec::scheme_hash` of the bound scheme, hex.
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
    fn moved_aside(&self) -> bool {
        !matches!(self, Distrust::Stale(_))
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
        if e.candidate(&e.chosen).is_none() {
            return Err(Distrust::Corrupt(format!(
                "entry `{key}` chose `{}`, which it never measured",
                e.chosen
            )));
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
                if d.moved_aside() {
                    let aside = path.with_extension(format!("json.bad-{}", now_unix()));
                    match fs::rename(&path, &aside) {
                        Ok(()) => warnings.push(format!(
                            "replacing decision file {} ({d}); the old one is kept as {}",
                            path.display(),
                            aside.display()
                        )),
                        Err(e) => warnings.push(format!(
                            "replacing decision file {} ({d}); could not keep a copy: {e}",
                            path.display()
                        )),
                    }
                } else {
                    warnings.push(format!("replacing decision file {} ({d})", path.display()));
                }
                self.empty()
            }
        };
        f(&mut file);
        let text = serde_json::to_string_pretty(&file).map_err(|e| format!("cannot encode decisions: {e}"))?;
        write_atomic(&path, text.as_bytes())
    }
}

fn lock_path(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(".lock");
    PathBuf::from(s)
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
        fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = fs::remove_file(&tmp);
        format!("cannot write {}: {e}", path.display())
    })
}

/// An exclusive lock file, removed on drop.
struct Lock {
    path: PathBuf,
}

impl Lock {
    fn acquire(path: &Path) -> Result<Lock, String> {
        let start = std::time::Instant::now();
        let mut wait = Duration::from_millis(1);
        loop {
            match fs::OpenOptions::new().write(true).create_new(true).open(path) {
                Ok(mut f) => {
                    let _ = writeln!(f, "{}", std::process::id());
                    return Ok(Lock {
                        path: path.to_path_buf(),
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let age = fs::metadata(path)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|m| m.elapsed().ok());
                    if age.is_some_and(|a| a > STALE_LOCK) {
                        // The holder died mid-merge; its temp file never
                        // replaced the real one, so breaking the lock is safe.
                        let _ = fs::remove_file(path);
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
            // Files moved aside as corrupt are listed too, as ignored.
            n.starts_with("decisions-") && (n.ends_with(".json") || n.contains(".json.bad-"))
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
