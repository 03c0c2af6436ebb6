//! The on-disk artifact cache: compiled PTX and CUBIN, keyed by a content
//! hash of everything that decides the bytes NVRTC produces (the source, the
//! NVRTC version, the options, the architecture).
//!
//! One file per artifact, `<readable name>-<key>.kart`, under
//! `$KIVI_CACHE_DIR/artifacts`, else `$XDG_CACHE_HOME/kivi/artifacts`, else
//! `~/.cache/kivi/artifacts`. A file starts with a header (magic, format
//! version, the full 128-bit key, the two payload lengths and a checksum of
//! the payload), so a truncated, corrupt or foreign file is detected,
//! reported and replaced, never trusted. Writes go to a temporary file in
//! the same folder and are renamed into place, so two processes compiling
//! the same kernel at once both leave a whole file.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

const MAGIC: &[u8; 8] = b"KIVIART\0";
const FORMAT: u32 = 2;
const HEADER: usize = 8 + 4 + 16 + 8 + 8 + 8 + 8;

/// FNV-1a over 128 bits: no dependency, stable across platforms and Rust
/// versions, and wide enough that cache keys do not collide by accident
/// (the header stores the whole key, so a collision of file names is caught).
#[derive(Clone, Copy, Debug)]
pub struct Fnv128(u128);

impl Default for Fnv128 {
    fn default() -> Self {
        Fnv128(0x6c62272e07bb014262b821756295c58d)
    }
}

impl Fnv128 {
    pub fn write(&mut self, bytes: &[u8]) -> &mut Self {
        const PRIME: u128 = 0x0000000001000000000000000000013B;
        for &b in bytes {
            self.0 ^= b as u128;
            self.0 = self.0.wrapping_mul(PRIME);
        }
        self
    }
    /// Writes a length-prefixed field, so `("ab","c")` and `("a","bc")` differ.
    pub fn field(&mut self, bytes: &[u8]) -> &mut Self {
        self.write(&(bytes.len() as u64).to_le_bytes()).write(bytes)
    }
    pub fn finish(&self) -> u128 {
        self.0
    }
}

/// FNV-1a 64 of the payload, the checksum in the header.
fn checksum(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    }
    h
}

/// The key of one compilation: hash of (source, NVRTC version, options, arch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ArtifactKey(pub u128);

impl ArtifactKey {
    pub fn new(source: &str, nvrtc_version: &str, options: &[String], arch: &str) -> ArtifactKey {
        let mut h = Fnv128::default();
        h.field(b"kivi-artifact-v1");
        h.field(nvrtc_version.as_bytes());
        h.write(&(options.len() as u64).to_le_bytes());
        for o in options {
            h.field(o.as_bytes());
        }
        h.field(arch.as_bytes());
        h.field(source.as_bytes());
        ArtifactKey(h.finish())
    }
    pub fn hex(&self) -> String {
        format!("{:032x}", self.0)
    }
}

/// What a compilation produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Artifact {
    /// PTX text (without the trailing NUL).
    pub ptx: String,
    /// CUBIN for the exact `sm_XX` (empty when compiled for a virtual arch).
    pub cubin: Vec<u8>,
    /// NVRTC's log: warnings and ptxas's `-v` resource report.
    pub log: String,
}

/// How a lookup went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    Hit(Artifact),
    Miss,
    /// A file was there but unusable; the message says why. Callers
    /// recompile and overwrite it.
    Corrupt(String),
}

/// A folder of artifacts.
#[derive(Clone, Debug)]
pub struct ArtifactCache {
    dir: PathBuf,
}

/// The default cache root: `$KIVI_CACHE_DIR`, `$XDG_CACHE_HOME/kivi` or
/// `~/.cache/kivi`; `None` when none of them can be determined.
pub fn default_cache_root() -> Option<PathBuf> {
    let nonempty = |v: &str| std::env::var_os(v).filter(|s| !s.is_empty()).map(PathBuf::from);
    if let Some(d) = nonempty("KIVI_CACHE_DIR") {
        return Some(d);
    }
    if let Some(d) = nonempty("XDG_CACHE_HOME") {
        return Some(d.join("kivi"));
    }
    nonempty("HOME").map(|h| h.join(".cache").join("kivi"))
}

fn sanitize(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    // Keep file names well under common limits; the key makes them unique.
    s.chars().take(120).collect()
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

impl ArtifactCache {
    /// The cache at `dir` (created on first store).
    pub fn at(dir: impl Into<PathBuf>) -> ArtifactCache {
        ArtifactCache { dir: dir.into() }
    }

    /// The default location (`<root>/artifacts`), if there is one.
    pub fn default_location() -> Option<ArtifactCache> {
        default_cache_root().map(|r| ArtifactCache::at(r.join("artifacts")))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file an artifact named `name` with `key` lives in.
    pub fn path(&self, name: &str, key: ArtifactKey) -> PathBuf {
        self.dir.join(format!("{}-{}.kart", sanitize(name), key.hex()))
    }

    /// Reads an artifact; never trusts a file whose header disagrees.
    pub fn load(&self, name: &str, key: ArtifactKey) -> Lookup {
        let path = self.path(name, key);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Lookup::Miss,
            Err(e) => return Lookup::Corrupt(format!("{}: cannot read: {e}", path.display())),
        };
        match decode(&bytes, key) {
            Ok(a) => Lookup::Hit(a),
            Err(why) => Lookup::Corrupt(format!("{}: {why}", path.display())),
        }
    }

    /// Writes an artifact atomically (temporary file, then rename).
    pub fn store(&self, name: &str, key: ArtifactKey, a: &Artifact) -> std::io::Result<PathBuf> {
        std::fs::create_dir_all(&self.dir)?;
        let path = self.path(name, key);
        let tmp = self.dir.join(format!(
            ".tmp-{}-{}-{}",
            std::process::id(),
            TMP_COUNTER.fetch_add(1, Ordering::Relaxed),
            key.hex()
        ));
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&encode(key, a))?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        let r = write();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r.map(|_| path)
    }
}

fn encode(key: ArtifactKey, a: &Artifact) -> Vec<u8> {
    let ptx = a.ptx.as_bytes();
    let log = a.log.as_bytes();
    let mut out = Vec::with_capacity(HEADER + ptx.len() + a.cubin.len() + log.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT.to_le_bytes());
    out.extend_from_slice(&key.0.to_le_bytes());
    out.extend_from_slice(&(ptx.len() as u64).to_le_bytes());
    out.extend_from_slice(&(a.cubin.len() as u64).to_le_bytes());
    out.extend_from_slice(&(log.len() as u64).to_le_bytes());
    out.extend_from_slice(&checksum(&[ptx, &a.cubin, log]).to_le_bytes());
    out.extend_from_slice(ptx);
    out.extend_from_slice(&a.cubin);
    out.extend_from_slice(log);
    out
}

fn decode(bytes: &[u8], key: ArtifactKey) -> Result<Artifact, String> {
    if bytes.len() < HEADER {
        return Err(format!(
            "{} bytes is shorter than the {HEADER}-byte header",
            bytes.len()
        ));
    }
    if &bytes[..8] != MAGIC {
        return Err("not a kivi artifact (bad magic)".into());
    }
    let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().expect("8 bytes"));
    let format = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if format != FORMAT {
        return Err(format!("artifact format {format}, this build reads {FORMAT}"));
    }
    let stored = u128::from_le_bytes(bytes[12..28].try_into().expect("16 bytes"));
    if stored != key.0 {
        return Err(format!("holds key {stored:032x}, expected {}", key.hex()));
    }
    let (ptx_len, cubin_len, log_len, sum) = (
        u64_at(28) as usize,
        u64_at(36) as usize,
        u64_at(44) as usize,
        u64_at(52),
    );
    let body = &bytes[HEADER..];
    if ptx_len.checked_add(cubin_len).and_then(|n| n.checked_add(log_len)) != Some(body.len()) {
        return Err(format!(
            "payload is {} bytes, the header says {ptx_len} + {cubin_len} + {log_len}",
            body.len()
        ));
    }
    let (ptx, rest) = body.split_at(ptx_len);
    let (cubin, log) = rest.split_at(cubin_len);
    if checksum(&[ptx, cubin, log]) != sum {
        return Err("checksum mismatch".into());
    }
    let text = |b: &[u8], what: &str| String::from_utf8(b.to_vec()).map_err(|_| format!("{what} is not UTF-8"));
    Ok(Artifact {
        ptx: text(ptx, "PTX")?,
        cubin: cubin.to_vec(),
        log: text(log, "the log")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kivi-art-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn key_depends_on_every_input() {
        let o = vec!["--std=c++17".to_string()];
        let k = ArtifactKey::new("src", "13.0", &o, "sm_90");
        assert_ne!(k, ArtifactKey::new("src ", "13.0", &o, "sm_90"));
        assert_ne!(k, ArtifactKey::new("src", "13.1", &o, "sm_90"));
        assert_ne!(k, ArtifactKey::new("src", "13.0", &[], "sm_90"));
        assert_ne!(k, ArtifactKey::new("src", "13.0", &o, "sm_80"));
        assert_eq!(k, ArtifactKey::new("src", "13.0", &o, "sm_90"));
        // field boundaries count
        let a = ArtifactKey::new("x", "13.0", &["ab".into(), "c".into()], "sm_90");
        let b = ArtifactKey::new("x", "13.0", &["a".into(), "bc".into()], "sm_90");
        assert_ne!(a, b);
    }

    #[test]
    fn store_load_and_corruption() {
        let dir = tmpdir("rt");
        let c = ArtifactCache::at(&dir);
        let key = ArtifactKey::new("s", "13.0", &[], "sm_90");
        let other = ArtifactKey::new("t", "13.0", &[], "sm_90");
        assert_eq!(c.load("k/decode", key), Lookup::Miss);
        let a = Artifact {
            ptx: ".version 9.0\n".into(),
            cubin: vec![1, 2, 3, 255],
            log: "ptxas info".into(),
        };
        let path = c.store("k/decode", key, &a).unwrap();
        assert!(path.file_name().unwrap().to_str().unwrap().starts_with("k_decode-"));
        assert_eq!(c.load("k/decode", key), Lookup::Hit(a.clone()));
        // no temporary files left behind
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");

        let bytes = std::fs::read(&path).unwrap();
        // flipped payload byte
        let mut bad = bytes.clone();
        *bad.last_mut().unwrap() ^= 1;
        std::fs::write(&path, &bad).unwrap();
        assert!(matches!(c.load("k/decode", key), Lookup::Corrupt(m) if m.contains("checksum")));
        // truncated
        std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
        assert!(matches!(c.load("k/decode", key), Lookup::Corrupt(m) if m.contains("header says")));
        std::fs::write(&path, &bytes[..10]).unwrap();
        assert!(matches!(c.load("k/decode", key), Lookup::Corrupt(m) if m.contains("shorter")));
        // foreign file
        std::fs::write(&path, vec![0u8; 100]).unwrap();
        assert!(matches!(c.load("k/decode", key), Lookup::Corrupt(m) if m.contains("magic")));
        // a file holding another key under this name
        std::fs::write(&path, encode(other, &a)).unwrap();
        assert!(matches!(c.load("k/decode", key), Lookup::Corrupt(m) if m.contains("expected")));
        // overwrite repairs it
        c.store("k/decode", key, &a).unwrap();
        assert_eq!(c.load("k/decode", key), Lookup::Hit(a));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn concurrent_writers_leave_a_whole_file() {
        let dir = tmpdir("conc");
        let c = ArtifactCache::at(&dir);
        let key = ArtifactKey::new("s", "13.0", &[], "sm_80");
        let a = Artifact {
            ptx: "x".repeat(200_000),
            cubin: vec![7; 100_000],
            log: String::new(),
        };
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..5 {
                        c.store("n", key, &a).unwrap();
                        match c.load("n", key) {
                            Lookup::Hit(b) => assert_eq!(b, a),
                            other => panic!("{other:?}"),
                        }
                    }
                });
            }
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}
