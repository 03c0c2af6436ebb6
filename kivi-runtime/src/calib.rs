//! Calibration: what a scheme learns from a model's own K/V, kept in a
//! versioned file with its own hash (DESIGN.md §8: "everything learned from
//! data lives in a versioned calibration file, never in the eval text").
//!
//! Today a calibration holds `nuq` codebooks (`levels = nuq`: a `2^b`-entry
//! table per layer and tensor, found by k-means over the values the
//! quantizer sees, each group divided by its norm) and per-channel RMS
//! statistics of keys before and after RoPE and of values. The format
//! leaves room for bases (low-rank keys) and product codebooks: every entry
//! is a kind, a shape and f32 data.
//!
//! # File format (version 1, little-endian)
//!
//! ```text
//! magic    8 bytes  "KIVICAL\0"
//! version  u32      1
//! model    str name, u32 layers, u32 kv_heads, u32 head_dim
//! source   str      what the calibration was fitted on (free text)
//! entries  u32 count, then per entry, in key order:
//!          u32 layer, u8 tensor (0 key, 1 value), u8 stage (0 post-RoPE,
//!          1 pre-RoPE), u8 kind (1 codebook, 2 channel RMS, 3 vq
//!          codebooks, see [`crate::vq`]), u8 0,
//!          str fit, u32 rank, rank x u32 dims, prod(dims) x f32 data
//! hash     u64      FNV-1a 64 of every byte before it
//! ```
//!
//! `str` is a u32 byte length and UTF-8 bytes. The hash is the
//! calibration's identity ([`Calibration::hash`]): it joins the scheme hash
//! in a cache's identity ([`identity`]). Loading checks the magic, the
//! version, the hash, then every field; a damaged, truncated, foreign or
//! inconsistent file is a [`CalibError`], never a panic and never a
//! silently wrong codebook.
//!
//! ```
//! use kivi_runtime::calib::{Calibration, FitOptions, LayerSamples, ModelId};
//! let s = kivi_spec::parse_scheme("pub N { key: quant(bits = 2, axis = channel, group = 32, levels = nuq), \
//!     value: quant(bits = 2, axis = token, group = 32, levels = nuq), residual: 32, heads: mqa(q = 2), head_dim: 64 }").unwrap();
//! let mut rng = kivi_runtime::rand::Rng::new(1);
//! let sample = LayerSamples::new(0, 256, 2, 1, 64, rng.vec(256 * 64), rng.vec(256 * 64));
//! let mut cal = Calibration::new(ModelId { name: "toy".into(), layers: 1, kv_heads: 1, head_dim: 64 }, "random");
//! cal.fit_codebooks(&s, &[sample], FitOptions::default()).unwrap();
//! let back = Calibration::from_bytes(&cal.to_bytes()).unwrap();
//! assert_eq!(back.hash(), cal.hash());
//! assert_eq!(back.codebook(&s, kivi_spec::Tensor::Key, 0).unwrap().len(), 4);
//! ```

use crate::quant::{channel_mean, fixed_levels, round_to_dtype, round_to_scale, TensorCodec};
use kivi_spec::{fnv1a64, lloyd_max_levels, Axis, Heads, Levels, Norm, Scheme, Tensor};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The first eight bytes of every calibration file.
pub const MAGIC: [u8; 8] = *b"KIVICAL\0";
/// The format version this build reads and writes.
pub const VERSION: u32 = 1;
/// Longest string a file may hold (a guard against allocating on garbage).
const MAX_STR: usize = 1 << 16;

/// Everything that can be wrong with a calibration, or with a scheme's
/// need for one. Each variant names what was wrong and where.
#[derive(Debug, thiserror::Error)]
pub enum CalibError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("not a kivi calibration file (bad magic bytes)")]
    BadMagic,
    #[error("calibration format version {found}; this build reads version {VERSION}")]
    Version { found: u32 },
    #[error("calibration file is truncated: {what} at byte {at} needs {need} bytes, {left} are left")]
    Truncated {
        what: &'static str,
        at: usize,
        need: usize,
        left: usize,
    },
    #[error("calibration file is damaged: stored hash {stored:016x}, content hashes to {computed:016x}")]
    Corrupt { stored: u64, computed: u64 },
    #[error("malformed calibration: {0}")]
    Malformed(String),
    #[error("calibration is for {found}, the scheme needs {expected}")]
    ModelMismatch { expected: String, found: String },
    #[error("scheme `{scheme}` needs a calibrated codebook for layer {layer} {tensor} ({fit}); the calibration `{calibration}` has {have}; run `kivi calibrate` with this scheme")]
    Missing {
        scheme: String,
        layer: usize,
        tensor: &'static str,
        fit: String,
        calibration: String,
        have: String,
    },
    #[error("scheme `{scheme}` uses levels = nuq on its {tensor}s: build the cache with a calibration (PagedCache::with_calibration)")]
    Needed { scheme: String, tensor: &'static str },
    #[error("scheme `{scheme}` uses vq(...) on its {tensor}s: build the cache with a calibration that has its codebooks (PagedCache::with_calibration)")]
    VqNeeded { scheme: String, tensor: &'static str },
    #[error("calibration samples: {0}")]
    Samples(String),
    #[error("scheme `{scheme}` stores {wanted} keys, but the calibration `{calibration}` has only a {found} key codebook for layer {layer} ({fit}); run `kivi calibrate` with this scheme")]
    Stage {
        scheme: String,
        layer: usize,
        fit: String,
        calibration: String,
        wanted: Stage,
        found: Stage,
    },
}

/// The model a calibration was fitted on: its name (with a content hash
/// of its weights where the engine has one) and its attention shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelId {
    pub name: String,
    pub layers: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
}

impl std::fmt::Display for ModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` ({} layers, {} kv heads, head_dim {})",
            self.name, self.layers, self.kv_heads, self.head_dim
        )
    }
}

/// Whether an entry was fitted on keys before or after RoPE (values have
/// no RoPE and are always `PostRope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Stage {
    PostRope,
    PreRope,
}

impl Stage {
    /// The stage tensor `t` of `s` is stored (and its codebook fitted) at:
    /// keys of a `rope: pre(...)` scheme before RoPE, everything else after.
    ///
    /// ```
    /// use kivi_runtime::calib::Stage;
    /// use kivi_spec::Tensor;
    /// let s = kivi_spec::parse_scheme("p { key: quant(bits = 2, axis = channel, group = 32, levels = nuq), \
    ///     value: quant(bits = 2, axis = token, group = 32), rope: pre(theta = 10000, style = half) }").unwrap();
    /// assert_eq!(Stage::of(&s, Tensor::Key), Stage::PreRope);
    /// assert_eq!(Stage::of(&s, Tensor::Value), Stage::PostRope);
    /// ```
    pub fn of(s: &Scheme, t: Tensor) -> Stage {
        if t == Tensor::Key && s.rope.is_some() {
            Stage::PreRope
        } else {
            Stage::PostRope
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::PostRope => "post-RoPE",
            Stage::PreRope => "pre-RoPE",
        })
    }
}

/// What an entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A `nuq` codebook: `2^b` ascending levels, shape `[2^b]`.
    Codebook,
    /// The RMS of every channel over the calibration tokens, shape
    /// `[kv_heads, head_dim]` (scales for later schemes).
    ChannelRms,
    /// Product codebooks of a `vq(...)` tensor, shape
    /// `[head_dim / dim, entries, dim]` ([`crate::vq`]).
    VqCodebook,
    /// An orthonormal basis per KV head for low-rank keys and values,
    /// shape `[kv_heads, head_dim, head_dim]`, vectors as rows by
    /// decreasing eigenvalue (`crate::low_rank`). File code 4.
    Basis,
}

impl Kind {
    fn code(self) -> u8 {
        match self {
            Kind::Codebook => 1,
            Kind::ChannelRms => 2,
            Kind::VqCodebook => 3,
            Kind::Basis => 4,
        }
    }
}

/// One learned tensor: which layer and K/V tensor it belongs to, what it
/// is, what quantizer it was fitted for (`fit`, see [`fit_key`]), and its
/// data in row-major order.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub layer: u32,
    pub tensor: Tensor,
    pub stage: Stage,
    pub kind: Kind,
    pub fit: String,
    pub shape: Vec<u32>,
    pub data: Vec<f32>,
}

type Key = (u32, u8, Stage, Kind, String);

impl Entry {
    fn key(&self) -> Key {
        (
            self.layer,
            tensor_code(self.tensor),
            self.stage,
            self.kind,
            self.fit.clone(),
        )
    }
}

fn tensor_code(t: Tensor) -> u8 {
    match t {
        Tensor::Key => 0,
        Tensor::Value => 1,
    }
}

/// The quantizer a `nuq` codebook of tensor `t` is fitted for, as text:
/// everything that changes the values the quantizer sees (bits, axis,
/// group, norm, centering, rotation, outliers, sinks). `None` unless `t` uses
/// `levels = nuq`. A codebook is only used by a scheme with the same key.
///
/// ```
/// let s = kivi_spec::parse_scheme("pub N { key: quant(bits = 2, axis = channel, group = 32, levels = nuq), \
///     value: full }").unwrap();
/// assert_eq!(kivi_runtime::calib::fit_key(&s, kivi_spec::Tensor::Key).unwrap(),
///            "bits=2 axis=channel group=32 norm=rms center=none rotation=none outliers=0");
/// ```
pub fn fit_key(s: &Scheme, t: Tensor) -> Option<String> {
    let q = s.codec(t).quant()?;
    let Levels::Nuq(norm) = q.levels else { return None };
    let mut o = format!(
        "bits={} axis={} group={} norm={}",
        q.bits,
        match q.axis {
            Axis::Channel => "channel",
            Axis::Token => "token",
        },
        q.group,
        norm.name()
    );
    match s.center_of(t) {
        Some(n) => write!(o, " center={n}"),
        None => write!(o, " center=none"),
    }
    .expect("write to String");
    match s.rotation_of(t) {
        Some(r) => write!(
            o,
            " rotation=hadamard{}{}",
            r.block,
            r.signs.map_or(String::new(), |x| format!("x{x}"))
        ),
        None => write!(o, " rotation=none"),
    }
    .expect("write to String");
    write!(o, " outliers={}", s.outliers_of(t)).expect("write to String");
    // Sinks decide which tokens a table is fitted on (every full group past
    // them), so two schemes that differ only in sinks need two tables. Left
    // out at 0 so that sink-free keys (and the files holding them) stay as
    // they were.
    if s.sinks > 0 {
        write!(o, " sinks={}", s.sinks).expect("write to String");
    }
    Some(o)
}

/// A cache's identity: the scheme hash alone, or, for a calibrated cache,
/// the FNV-1a 64 of both hashes (so a tuning decision or an artifact keyed
/// by it never outlives a change of either).
///
/// ```
/// use kivi_runtime::calib::identity;
/// assert_eq!(identity(7, None), 7);
/// assert_ne!(identity(7, Some(1)), identity(7, Some(2)));
/// ```
pub fn identity(scheme_hash: u64, calibration_hash: Option<u64>) -> u64 {
    match calibration_hash {
        None => scheme_hash,
        Some(c) => {
            let mut b = scheme_hash.to_le_bytes().to_vec();
            b.extend_from_slice(&c.to_le_bytes());
            fnv1a64(&b)
        }
    }
}

/// A calibration: the model it belongs to, what it was fitted on, and its
/// entries (kept in key order, so the bytes and the hash do not depend on
/// the order entries were added in).
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    pub model: ModelId,
    /// What the calibration was fitted on (text, tokens, options).
    pub source: String,
    entries: Vec<Entry>,
}

impl Calibration {
    /// An empty calibration for `model`.
    pub fn new(model: ModelId, source: impl Into<String>) -> Calibration {
        Calibration {
            model,
            source: source.into(),
            entries: Vec::new(),
        }
    }

    /// The entries, in key order.
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// Adds an entry after checking it ([`Self::from_bytes`] applies the
    /// same checks), replacing one with the same layer, tensor, stage, kind
    /// and fit.
    pub fn insert(&mut self, e: Entry) -> Result<(), CalibError> {
        check_entry(&self.model, &e)?;
        let k = e.key();
        match self.entries.binary_search_by(|x| x.key().cmp(&k)) {
            Ok(i) => self.entries[i] = e,
            Err(i) => self.entries.insert(i, e),
        }
        Ok(())
    }

    /// The entry with this key, if any.
    pub fn get(&self, layer: usize, tensor: Tensor, stage: Stage, kind: Kind, fit: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| {
            e.layer as usize == layer && e.tensor == tensor && e.stage == stage && e.kind == kind && e.fit == fit
        })
    }

    /// The content hash: FNV-1a 64 of the serialized bytes before the hash.
    pub fn hash(&self) -> u64 {
        let b = self.to_bytes();
        u64::from_le_bytes(b[b.len() - 8..].try_into().expect("8 bytes"))
    }

    /// Checks that this calibration was made for a model of `scheme`'s
    /// shape (KV heads and head_dim, when the scheme is bound).
    pub fn check_shape(&self, scheme: &Scheme) -> Result<(), CalibError> {
        let Some(shape) = scheme.shape() else { return Ok(()) };
        if shape.kv_heads != self.model.kv_heads as usize || shape.head_dim != self.model.head_dim as usize {
            return Err(CalibError::ModelMismatch {
                expected: format!(
                    "{} kv heads, head_dim {} (scheme `{}`)",
                    shape.kv_heads, shape.head_dim, scheme.name
                ),
                found: self.model.to_string(),
            });
        }
        Ok(())
    }

    /// The `nuq` codebook of tensor `t` of `scheme` at `layer`: checked
    /// against the model's shape, the layer count and the quantizer it was
    /// fitted for. A missing one is [`CalibError::Missing`], naming the
    /// layer, the tensor, the fit and what the calibration has instead.
    /// Keys of a `rope: pre(...)` scheme take the codebook fitted on
    /// pre-RoPE keys ([`Stage::of`]); one fitted on the other stage only is
    /// [`CalibError::Stage`].
    pub fn codebook(&self, scheme: &Scheme, t: Tensor, layer: usize) -> Result<Vec<f32>, CalibError> {
        let fit = fit_key(scheme, t).ok_or_else(|| {
            CalibError::Samples(format!(
                "scheme `{}` does not use levels = nuq on its {}s",
                scheme.name,
                t.name()
            ))
        })?;
        self.check_shape(scheme)?;
        let missing = |have: String| CalibError::Missing {
            scheme: scheme.name.clone(),
            layer,
            tensor: t.name(),
            fit: fit.clone(),
            calibration: self.model.name.clone(),
            have,
        };
        if layer >= self.model.layers as usize {
            return Err(missing(format!("{} layers", self.model.layers)));
        }
        let stage = Stage::of(scheme, t);
        match self.get(layer, t, stage, Kind::Codebook, &fit) {
            Some(e) => {
                let bits = scheme.codec(t).quant().map_or(0, |q| q.bits);
                if e.data.len() != 1usize << bits {
                    return Err(missing(format!("a {}-entry codebook", e.data.len())));
                }
                // A pinned table's ends are the scheme's meaning (each group
                // decodes its min and max exactly): a file that has other
                // ends under that fit was not made by this fit.
                let pinned = scheme.codec(t).quant().and_then(|q| q.levels.norm()) == Some(Norm::MinMaxPinned);
                if pinned && (e.data.first() != Some(&0.0) || e.data.last() != Some(&1.0)) {
                    return Err(CalibError::Malformed(format!(
                        "layer {layer} {} codebook ({fit}) must start at 0 and end at 1, has {:?}",
                        t.name(),
                        e.data
                    )));
                }
                Ok(e.data.clone())
            }
            None => {
                // The same quantizer fitted on the other side of RoPE would
                // decode keys with a table fitted on other data.
                let other = match stage {
                    Stage::PostRope => Stage::PreRope,
                    Stage::PreRope => Stage::PostRope,
                };
                if self.get(layer, t, other, Kind::Codebook, &fit).is_some() {
                    return Err(CalibError::Stage {
                        scheme: scheme.name.clone(),
                        layer,
                        fit,
                        calibration: self.model.name.clone(),
                        wanted: stage,
                        found: other,
                    });
                }
                let fits: Vec<&str> = self
                    .entries
                    .iter()
                    .filter(|e| e.layer as usize == layer && e.tensor == t && e.kind == Kind::Codebook)
                    .map(|e| e.fit.as_str())
                    .collect();
                Err(missing(if fits.is_empty() {
                    "no codebook there".into()
                } else {
                    format!("codebooks for: {}", fits.join("; "))
                }))
            }
        }
    }

    /// The serialized file (see the module docs).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        put_str(&mut b, &self.model.name);
        for x in [self.model.layers, self.model.kv_heads, self.model.head_dim] {
            b.extend_from_slice(&x.to_le_bytes());
        }
        put_str(&mut b, &self.source);
        b.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            b.extend_from_slice(&e.layer.to_le_bytes());
            b.push(tensor_code(e.tensor));
            b.push(match e.stage {
                Stage::PostRope => 0,
                Stage::PreRope => 1,
            });
            b.push(e.kind.code());
            b.push(0);
            put_str(&mut b, &e.fit);
            b.extend_from_slice(&(e.shape.len() as u32).to_le_bytes());
            for d in &e.shape {
                b.extend_from_slice(&d.to_le_bytes());
            }
            for x in &e.data {
                b.extend_from_slice(&x.to_le_bytes());
            }
        }
        let h = fnv1a64(&b);
        b.extend_from_slice(&h.to_le_bytes());
        b
    }

    /// Parses and checks a serialized calibration.
    pub fn from_bytes(bytes: &[u8]) -> Result<Calibration, CalibError> {
        let mut r = Reader { b: bytes, at: 0 };
        if r.take(8, "magic")? != MAGIC {
            return Err(CalibError::BadMagic);
        }
        let version = r.u32("version")?;
        if version != VERSION {
            return Err(CalibError::Version { found: version });
        }
        if bytes.len() < r.at + 8 {
            return Err(CalibError::Truncated {
                what: "hash",
                at: r.at,
                need: 8,
                left: bytes.len() - r.at,
            });
        }
        let (body, tail) = bytes.split_at(bytes.len() - 8);
        let stored = u64::from_le_bytes(tail.try_into().expect("8 bytes"));
        let computed = fnv1a64(body);
        if stored != computed {
            return Err(CalibError::Corrupt { stored, computed });
        }
        let mut r = Reader { b: body, at: r.at };
        let model = ModelId {
            name: r.str("model name")?,
            layers: r.u32("layers")?,
            kv_heads: r.u32("kv heads")?,
            head_dim: r.u32("head_dim")?,
        };
        if model.layers == 0 || model.kv_heads == 0 || model.head_dim == 0 {
            return Err(CalibError::Malformed(format!("model {model} has an empty shape")));
        }
        let source = r.str("source")?;
        let n = r.u32("entry count")? as usize;
        let mut cal = Calibration::new(model, source);
        for i in 0..n {
            let layer = r.u32("entry layer")?;
            let head = r.take(4, "entry header")?;
            let tensor = match head[0] {
                0 => Tensor::Key,
                1 => Tensor::Value,
                x => return Err(CalibError::Malformed(format!("entry {i}: tensor code {x}"))),
            };
            let stage = match head[1] {
                0 => Stage::PostRope,
                1 => Stage::PreRope,
                x => return Err(CalibError::Malformed(format!("entry {i}: stage code {x}"))),
            };
            let kind = match head[2] {
                1 => Kind::Codebook,
                2 => Kind::ChannelRms,
                3 => Kind::VqCodebook,
                4 => Kind::Basis,
                x => return Err(CalibError::Malformed(format!("entry {i}: unknown kind {x}"))),
            };
            if head[3] != 0 {
                return Err(CalibError::Malformed(format!("entry {i}: reserved byte {}", head[3])));
            }
            let fit = r.str("entry fit")?;
            let rank = r.u32("entry rank")? as usize;
            if rank > 8 {
                return Err(CalibError::Malformed(format!("entry {i}: rank {rank}")));
            }
            let shape = (0..rank)
                .map(|_| r.u32("entry dims"))
                .collect::<Result<Vec<u32>, _>>()?;
            let count = shape
                .iter()
                .try_fold(1usize, |a, d| a.checked_mul(*d as usize))
                .filter(|c| c.checked_mul(4).is_some_and(|b| b <= r.left()))
                .ok_or_else(|| CalibError::Truncated {
                    what: "entry data",
                    at: r.at,
                    need: shape.iter().map(|d| *d as usize).product::<usize>().saturating_mul(4),
                    left: r.left(),
                })?;
            let raw = r.take(count * 4, "entry data")?;
            let data = raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect();
            let e = Entry {
                layer,
                tensor,
                stage,
                kind,
                fit,
                shape,
                data,
            };
            if cal.get(layer as usize, tensor, stage, kind, &e.fit).is_some() {
                return Err(CalibError::Malformed(format!("entry {i}: duplicate")));
            }
            if cal.entries.last().is_some_and(|l| l.key() > e.key()) {
                return Err(CalibError::Malformed(format!("entry {i}: out of order")));
            }
            cal.insert(e)?;
        }
        if r.left() != 0 {
            return Err(CalibError::Malformed(format!(
                "{} bytes after the last entry",
                r.left()
            )));
        }
        Ok(cal)
    }

    /// Reads and checks a calibration file.
    pub fn load(path: &Path) -> Result<Calibration, CalibError> {
        let b = std::fs::read(path).map_err(|source| CalibError::Io {
            path: path.to_owned(),
            source,
        })?;
        Calibration::from_bytes(&b)
    }

    /// Writes the file atomically (a temporary file in the same folder,
    /// then a rename), so a reader never sees half a calibration.
    pub fn save(&self, path: &Path) -> Result<(), CalibError> {
        let io = |source| CalibError::Io {
            path: path.to_owned(),
            source,
        };
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, self.to_bytes()).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io(e)
        })
    }
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

/// A cursor that turns every short read into [`CalibError::Truncated`].
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.at
    }
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], CalibError> {
        if self.left() < n {
            return Err(CalibError::Truncated {
                what,
                at: self.at,
                need: n,
                left: self.left(),
            });
        }
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, CalibError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn str(&mut self, what: &'static str) -> Result<String, CalibError> {
        let n = self.u32(what)? as usize;
        if n > MAX_STR {
            return Err(CalibError::Malformed(format!("{what}: a {n}-byte string")));
        }
        String::from_utf8(self.take(n, what)?.to_vec())
            .map_err(|_| CalibError::Malformed(format!("{what} is not UTF-8")))
    }
}

/// The checks every entry passes, on insert and on load.
fn check_entry(model: &ModelId, e: &Entry) -> Result<(), CalibError> {
    let bad = |m: String| CalibError::Malformed(format!("layer {} {} {:?}: {m}", e.layer, e.tensor.name(), e.kind));
    if e.layer >= model.layers {
        return Err(bad(format!("layer out of range (model has {})", model.layers)));
    }
    if e.stage == Stage::PreRope && e.tensor == Tensor::Value {
        return Err(bad("values have no pre-RoPE stage".into()));
    }
    let count = e.shape.iter().try_fold(1usize, |a, d| a.checked_mul(*d as usize));
    if count != Some(e.data.len()) {
        return Err(bad(format!(
            "shape {:?} does not hold {} values",
            e.shape,
            e.data.len()
        )));
    }
    if let Some(x) = e.data.iter().find(|x| !x.is_finite()) {
        return Err(bad(format!("non-finite value {x}")));
    }
    match e.kind {
        Kind::Codebook => {
            let n = e.data.len();
            if e.shape.len() != 1 || !(2..=16).contains(&n) || !n.is_power_of_two() {
                return Err(bad(format!(
                    "a codebook has 2, 4, 8 or 16 entries, not shape {:?}",
                    e.shape
                )));
            }
            if e.data.windows(2).any(|w| w[0] > w[1]) {
                return Err(bad("codebook levels are not ascending".into()));
            }
        }
        Kind::VqCodebook => crate::vq::check_entry(model, e).map_err(bad)?,
        Kind::ChannelRms => {
            if e.shape != [model.kv_heads, model.head_dim] {
                return Err(bad(format!(
                    "channel RMS has shape {:?}, the model [{}, {}]",
                    e.shape, model.kv_heads, model.head_dim
                )));
            }
            if e.data.iter().any(|x| *x < 0.0) {
                return Err(bad("negative RMS".into()));
            }
        }
        Kind::Basis => {
            let d = model.head_dim as usize;
            if e.shape != [model.kv_heads, model.head_dim, model.head_dim] {
                return Err(bad(format!(
                    "a basis has shape [kv_heads, head_dim, head_dim] = [{}, {d}, {d}], not {:?}",
                    model.kv_heads, e.shape
                )));
            }
            // Unit rows (orthogonality is checked where a cache takes a
            // prefix: low_rank::Bases::new).
            if let Some(i) = e.data.chunks(d).position(|r| {
                let n: f64 = r.iter().map(|x| *x as f64 * *x as f64).sum();
                (n - 1.0).abs() > 1e-3
            }) {
                return Err(bad(format!("basis row {i} is not of unit length")));
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Fitting from samples
// ---------------------------------------------------------------------------

/// One sequence of one layer's attention inputs, handed in by any engine:
/// keys and values `[tokens, kv_heads, head_dim]` (keys after RoPE, as the
/// cache stores them), optionally the queries `[tokens, q_heads, head_dim]`
/// (for weighting) and the keys before RoPE.
#[derive(Clone, Debug)]
pub struct LayerSamples {
    pub layer: usize,
    pub tokens: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
    pub queries: Option<Vec<f32>>,
    pub keys_pre_rope: Option<Vec<f32>>,
}

impl LayerSamples {
    /// Keys and values only.
    pub fn new(
        layer: usize,
        tokens: usize,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        keys: Vec<f32>,
        values: Vec<f32>,
    ) -> LayerSamples {
        LayerSamples {
            layer,
            tokens,
            q_heads,
            kv_heads,
            head_dim,
            keys,
            values,
            queries: None,
            keys_pre_rope: None,
        }
    }

    fn check(&self) -> Result<(), CalibError> {
        let bad = |m: String| CalibError::Samples(format!("layer {}: {m}", self.layer));
        let kv = self.tokens * self.kv_heads * self.head_dim;
        if self.kv_heads == 0 || self.head_dim == 0 || self.q_heads == 0 || !self.q_heads.is_multiple_of(self.kv_heads)
        {
            return Err(bad(format!(
                "{} query heads, {} kv heads, head_dim {}",
                self.q_heads, self.kv_heads, self.head_dim
            )));
        }
        for (name, v) in [
            ("keys", Some(&self.keys)),
            ("values", Some(&self.values)),
            ("pre-RoPE keys", self.keys_pre_rope.as_ref()),
        ] {
            if let Some(v) = v {
                if v.len() != kv {
                    return Err(bad(format!("{name} hold {} values, expected {kv}", v.len())));
                }
            }
        }
        if let Some(q) = &self.queries {
            if q.len() != self.tokens * self.q_heads * self.head_dim {
                return Err(bad(format!("queries hold {} values", q.len())));
            }
        }
        let all = self
            .keys
            .iter()
            .chain(&self.values)
            .chain(self.queries.iter().flatten());
        if all.chain(self.keys_pre_rope.iter().flatten()).any(|x| !x.is_finite()) {
            return Err(bad("non-finite sample".into()));
        }
        Ok(())
    }
}

/// [`LayerSamples`]' own checks, for the other fitters of the crate.
pub(crate) fn check_samples(s: &LayerSamples) -> Result<(), CalibError> {
    s.check()
}

/// How codebooks are fitted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FitOptions {
    /// Weight each key value by the mean squared query magnitude of its
    /// channel (a cheap stand-in for KVQuant's Fisher weights: a key
    /// channel's error reaches the score multiplied by that query channel).
    /// Needs queries in the samples; values are never weighted.
    pub weighted: bool,
    /// Most Lloyd iterations (the fit stops earlier once no value changes
    /// its level).
    pub iterations: usize,
}

impl Default for FitOptions {
    fn default() -> Self {
        FitOptions {
            weighted: false,
            iterations: 100,
        }
    }
}

/// What one fitted codebook achieved on its own samples: the (weighted)
/// mean squared error of the normalised values against it and against the
/// fixed Lloyd–Max table of the same width.
#[derive(Clone, Debug, PartialEq)]
pub struct FitReport {
    pub layer: usize,
    pub tensor: Tensor,
    pub values: usize,
    pub mse: f64,
    pub mse_lloyd_max: f64,
}

impl Calibration {
    /// Fits a `nuq` codebook for every `levels = nuq` tensor of `scheme`
    /// and every layer present in `samples` (several samples of a layer are
    /// pooled), and adds them. The scheme is bound to the samples' shape if
    /// it is not already. Deterministic: the fit sorts the values and
    /// starts from their weighted quantiles, no random draw is involved.
    pub fn fit_codebooks(
        &mut self,
        scheme: &Scheme,
        samples: &[LayerSamples],
        opts: FitOptions,
    ) -> Result<Vec<FitReport>, CalibError> {
        let mut layers: Vec<usize> = samples.iter().map(|s| s.layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let mut reports = Vec::new();
        for s in samples {
            s.check()?;
            if (s.kv_heads, s.head_dim) != (self.model.kv_heads as usize, self.model.head_dim as usize) {
                return Err(CalibError::ModelMismatch {
                    expected: self.model.to_string(),
                    found: format!("samples of {} kv heads, head_dim {}", s.kv_heads, s.head_dim),
                });
            }
        }
        for t in [Tensor::Key, Tensor::Value] {
            let Some(fit) = fit_key(scheme, t) else { continue };
            for &layer in &layers {
                let mut pts = Vec::new();
                for s in samples.iter().filter(|s| s.layer == layer) {
                    let bound = scheme
                        .with_shape(
                            Heads::from_counts(s.q_heads as u32, s.kv_heads as u32),
                            s.head_dim as u32,
                        )
                        .map_err(|e| CalibError::Samples(e.to_string()))?;
                    normalised_values(&bound, t, s, opts.weighted, &mut pts)?;
                }
                if pts.is_empty() {
                    return Err(CalibError::Samples(format!(
                        "layer {layer} {}: no group to fit (too few tokens past the sinks and centering)",
                        t.name()
                    )));
                }
                let bits = scheme.codec(t).quant().map_or(1, |q| q.bits);
                let norm = scheme.codec(t).quant().and_then(|q| q.levels.norm());
                let table = if norm == Some(Norm::MinMaxPinned) {
                    kmeans_1d_pinned(&mut pts, 1 << bits, opts.iterations)?
                } else {
                    kmeans_1d(&mut pts, 1 << bits, opts.iterations)
                };
                // The report's fixed table: Lloyd-Max's, or for a table over
                // [0, 1] (minmax) the uniform levels it replaces.
                let uniform: Vec<f32> = (0..1u32 << bits)
                    .map(|c| c as f32 / ((1u32 << bits) - 1) as f32)
                    .collect();
                let lm = if norm.is_some_and(Norm::has_zero) {
                    &uniform[..]
                } else {
                    lloyd_max_levels(bits).unwrap_or(&[])
                };
                reports.push(FitReport {
                    layer,
                    tensor: t,
                    values: pts.len(),
                    mse: table_mse(&pts, &table),
                    mse_lloyd_max: table_mse(&pts, lm),
                });
                self.insert(Entry {
                    layer: layer as u32,
                    tensor: t,
                    stage: Stage::of(scheme, t),
                    kind: Kind::Codebook,
                    fit: fit.clone(),
                    shape: vec![table.len() as u32],
                    data: table,
                })?;
            }
        }
        Ok(reports)
    }

    /// Adds the per-channel RMS of the samples' keys (after and, when
    /// given, before RoPE) and values, per layer (several samples of a layer
    /// are pooled).
    pub fn add_channel_rms(&mut self, samples: &[LayerSamples]) -> Result<(), CalibError> {
        let mut layers: Vec<usize> = samples.iter().map(|s| s.layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let (h, d) = (self.model.kv_heads as usize, self.model.head_dim as usize);
        for s in samples {
            s.check()?;
            if (s.kv_heads, s.head_dim) != (h, d) {
                return Err(CalibError::ModelMismatch {
                    expected: self.model.to_string(),
                    found: format!("samples of {} kv heads, head_dim {}", s.kv_heads, s.head_dim),
                });
            }
        }
        type Pick = fn(&LayerSamples) -> Option<&Vec<f32>>;
        let picks: [(Tensor, Stage, Pick); 3] = [
            (Tensor::Key, Stage::PostRope, |s| Some(&s.keys)),
            (Tensor::Key, Stage::PreRope, |s| s.keys_pre_rope.as_ref()),
            (Tensor::Value, Stage::PostRope, |s| Some(&s.values)),
        ];
        for layer in layers {
            for (t, stage, pick) in picks {
                let mut ss = vec![0f64; h * d];
                let mut n = 0usize;
                for s in samples.iter().filter(|s| s.layer == layer) {
                    let Some(x) = pick(s) else { continue };
                    for row in x.chunks_exact(h * d) {
                        for (a, v) in ss.iter_mut().zip(row) {
                            *a += (*v as f64) * (*v as f64);
                        }
                    }
                    n += s.tokens;
                }
                if n == 0 {
                    continue;
                }
                self.insert(Entry {
                    layer: layer as u32,
                    tensor: t,
                    stage,
                    kind: Kind::ChannelRms,
                    fit: String::new(),
                    shape: vec![h as u32, d as u32],
                    data: ss.iter().map(|a| (a / n as f64).sqrt() as f32).collect(),
                })?;
            }
        }
        Ok(())
    }
}

/// The values the quantizer of tensor `t` sees in sample `s`, each divided
/// by its group's norm, with their weights, appended to `out`: the same
/// pipeline as the cache (round to the activation dtype, center, rotate,
/// take out outliers, group, divide by the stored RMS), over every full
/// group past the sinks. Groups of norm 0 carry no information and are
/// skipped. Keys of a `rope: pre(...)` scheme are taken before RoPE (as
/// that cache stores them); samples without them are an error.
fn normalised_values(
    s: &Scheme,
    t: Tensor,
    x: &LayerSamples,
    weighted: bool,
    out: &mut Vec<(f32, f32)>,
) -> Result<(), CalibError> {
    let (h, d) = (x.kv_heads, x.head_dim);
    let Some(codec) = TensorCodec::of(s, t, d) else {
        return Ok(());
    };
    let q = codec.quant;
    let g = q.group as usize;
    let first = s.sinks as usize;
    let rows = match (t, Stage::of(s, t)) {
        (Tensor::Value, _) => &x.values,
        (Tensor::Key, Stage::PostRope) => &x.keys,
        (Tensor::Key, Stage::PreRope) => x.keys_pre_rope.as_ref().ok_or_else(|| {
            CalibError::Samples(format!(
                "layer {}: scheme `{}` stores keys before RoPE, the samples have no pre-RoPE keys",
                x.layer, s.name
            ))
        })?,
    };
    let at = |tok: usize, head: usize| (tok * h + head) * d;
    let weights = weights_of(&codec, s, t, x, weighted);
    for head in 0..h {
        let mean = codec.center.and_then(|n| {
            (n <= x.tokens).then(|| {
                let r: Vec<Vec<f32>> = (0..n)
                    .map(|tok| {
                        rows[at(tok, head)..at(tok, head) + d]
                            .iter()
                            .map(|v| round_to_dtype(*v, s.dtype))
                            .collect()
                    })
                    .collect();
                channel_mean(r.iter().map(|r| r.as_slice()), d, s.dtype)
            })
        });
        if codec.center.is_some() && mean.is_none() {
            continue;
        }
        let ys: Vec<Vec<f32>> = (first..x.tokens)
            .map(|tok| {
                let mut row: Vec<f32> = rows[at(tok, head)..at(tok, head) + d]
                    .iter()
                    .map(|v| round_to_dtype(*v, s.dtype))
                    .collect();
                codec.forward(&mut row, mean.as_deref());
                codec.take_outliers(&mut row);
                row
            })
            .collect();
        let w = &weights[head * d..(head + 1) * d];
        let mut push = |vals: &[f32], chans: &mut dyn Iterator<Item = usize>| {
            if q.levels.norm().is_some_and(Norm::has_zero) {
                // `(x - z) / s` with the group's stored `s`, `z` (the
                // oracle's own, `quant::minmax_group_in`). The error in `x`
                // is `s` times the error in `y`, so each value also weighs
                // `s^2`: the fit minimises the error the cache makes.
                let (p, _, _) = crate::quant::minmax_group_in(vals, &q, &[], &mut vec![0; vals.len()]);
                if p.scale == 0.0 || !p.scale.is_finite() || !p.zero.is_finite() {
                    return;
                }
                let s2 = p.scale * p.scale;
                for (v, c) in vals.iter().zip(chans) {
                    out.push(((v - p.zero) / p.scale, w[c] * s2));
                }
                return;
            }
            let ss: f64 = vals.iter().map(|v| (*v as f64) * (*v as f64)).sum();
            let rms = round_to_scale((ss / vals.len() as f64).sqrt() as f32, q.scale);
            if rms == 0.0 || !rms.is_finite() {
                return;
            }
            for (v, c) in vals.iter().zip(chans) {
                out.push((v / rms, w[c]));
            }
        };
        match q.axis {
            Axis::Channel => {
                let mut vals = vec![0f32; g];
                for j0 in (0..ys.len().saturating_sub(g - 1)).step_by(g) {
                    for ch in 0..d {
                        for (v, row) in vals.iter_mut().zip(&ys[j0..j0 + g]) {
                            *v = row[ch];
                        }
                        push(&vals, &mut std::iter::repeat(ch));
                    }
                }
            }
            Axis::Token => {
                for row in &ys {
                    for c0 in (0..d).step_by(g) {
                        push(&row[c0..c0 + g], &mut (c0..c0 + g));
                    }
                }
            }
        }
    }
    Ok(())
}

/// Per (KV head, channel) weights, mean 1 per head: the mean squared
/// query (rotated like the keys) over the head's query heads and tokens,
/// for weighted key fits with queries; 1 otherwise. For pre-RoPE keys the
/// two channels of a RoPE pair share the mean of their weights: RoPE turns
/// a pair by the token's angle, so an error in either channel meets the
/// query's whole pair, whose squared norm no angle changes.
fn weights_of(codec: &TensorCodec, s: &Scheme, t: Tensor, x: &LayerSamples, weighted: bool) -> Vec<f32> {
    let (h, d) = (x.kv_heads, x.head_dim);
    let mut w = vec![1f32; h * d];
    let (true, Tensor::Key, Some(q)) = (weighted, t, x.queries.as_ref()) else {
        return w;
    };
    let group = x.q_heads / h;
    let mut acc = vec![0f64; h * d];
    let mut row = vec![0f32; d];
    for tok in 0..x.tokens {
        for qh in 0..x.q_heads {
            row.copy_from_slice(&q[(tok * x.q_heads + qh) * d..][..d]);
            codec.forward(&mut row, None); // rotation only: q . k = (Tq) . (Tk)
            let kvh = qh / group;
            for (a, v) in acc[kvh * d..(kvh + 1) * d].iter_mut().zip(&row) {
                *a += (*v as f64) * (*v as f64);
            }
        }
    }
    if let (Some(r), Stage::PreRope) = (s.rope, Stage::of(s, t)) {
        let partner = |c: usize| match r.style {
            kivi_spec::RopeStyle::Half => (c + d / 2) % d,
            kivi_spec::RopeStyle::Interleaved => c ^ 1,
        };
        for head in acc.chunks_exact_mut(d) {
            let pair: Vec<f64> = (0..d).map(|c| 0.5 * (head[c] + head[partner(c)])).collect();
            head.copy_from_slice(&pair);
        }
    }
    for head in 0..h {
        let a = &acc[head * d..(head + 1) * d];
        let mean = a.iter().sum::<f64>() / d as f64;
        if mean > 0.0 {
            for (w, a) in w[head * d..(head + 1) * d].iter_mut().zip(a) {
                *w = (a / mean) as f32;
            }
        }
    }
    w
}

/// Weighted 1-D k-means (Lloyd's algorithm) of `pts` (value, weight) into
/// `k` ascending levels. `pts` is sorted by value, so each iteration
/// assigns by binary search on the midpoints (values above a midpoint go up,
/// as the quantizer codes them) and takes centroids from prefix sums; it
/// starts at the weighted quantiles `(j + 1/2) / k` and stops when no
/// boundary moves or after `iterations`. A level whose range is empty
/// keeps its place; fewer distinct values than `k` repeat levels, which
/// the quantizer handles (equal thresholds).
pub fn kmeans_1d(pts: &mut [(f32, f32)], k: usize, iterations: usize) -> Vec<f32> {
    if pts.is_empty() || k == 0 {
        return vec![0.0; k];
    }
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (sw, swy) = prefix_sums(pts);
    let n = pts.len();
    let total = sw[n];
    let mut c: Vec<f32> = (0..k)
        .map(|j| {
            let target = total * (j as f64 + 0.5) / k as f64;
            let i = sw[1..].partition_point(|s| *s < target).min(n - 1);
            pts[i].0
        })
        .collect();
    lloyd_steps(pts, (&sw, &swy), &mut c, iterations, 0..k, None);
    c
}

/// Prefix sums of the weights (negative ones as 0) and of weight x value
/// of `pts` sorted by value: `[n + 1]` each, for [`lloyd_steps`]' means.
fn prefix_sums(pts: &[(f32, f32)]) -> (Vec<f64>, Vec<f64>) {
    let n = pts.len();
    let mut sw = vec![0f64; n + 1];
    let mut swy = vec![0f64; n + 1];
    for (i, (y, w)) in pts.iter().enumerate() {
        let w = w.max(0.0) as f64;
        sw[i + 1] = sw[i] + w;
        swy[i + 1] = swy[i] + w * *y as f64;
    }
    (sw, swy)
}

/// Lloyd's two steps on the ascending table `c` over `pts` (sorted by
/// value, `prefix` from [`prefix_sums`]), at most `iterations` times (at
/// least once), stopping when no boundary moves: assign by binary search on
/// the midpoints (values above a midpoint go up, as the quantizer codes
/// them), then move the levels in `movable` to their cell's weighted mean
/// (clamped to `clamp` if given; an empty cell keeps its level) and keep
/// those levels sorted. [`kmeans_1d`] moves all of them, the pinned fit only
/// the inner ones.
fn lloyd_steps(
    pts: &[(f32, f32)],
    (sw, swy): (&[f64], &[f64]),
    c: &mut [f32],
    iterations: usize,
    movable: std::ops::Range<usize>,
    clamp: Option<(f32, f32)>,
) {
    let (n, k) = (pts.len(), c.len());
    let mut bounds = vec![usize::MAX; k + 1];
    for _ in 0..iterations.max(1) {
        let mut nb = vec![0usize; k + 1];
        nb[k] = n;
        for j in 0..k - 1 {
            let t = (c[j] + c[j + 1]) * 0.5;
            nb[j + 1] = pts.partition_point(|p| p.0 <= t).max(nb[j]);
        }
        if nb == bounds {
            break;
        }
        for j in movable.clone() {
            let (a, b) = (nb[j], nb[j + 1]);
            let w = sw[b] - sw[a];
            if w > 0.0 {
                let m = ((swy[b] - swy[a]) / w) as f32;
                c[j] = clamp.map_or(m, |(lo, hi)| m.clamp(lo, hi));
            }
        }
        c[movable.clone()].sort_by(f32::total_cmp);
        bounds = nb;
    }
}

/// [`kmeans_1d`] with the first and last of the `k` levels pinned at 0 and
/// 1 (`norm = minmax_pinned`): only the inner `k - 2` move. They start at
/// the uniform table's places `j / (k - 1)`, so the fit begins at the
/// uniform levels it replaces, and each iteration assigns by midpoints and
/// moves every inner level to its cell's weighted mean (a level whose cell
/// is empty keeps its place). Lloyd's two steps never raise the weighted
/// error, so the fitted table codes `pts` at least as well as uniform
/// levels. Inner levels are clamped to `[0, 1]` and the table stays
/// ascending; the ends are exactly 0.0 and 1.0 whatever the points.
///
/// `k < 2` (no room for both ends) is [`CalibError::Samples`]; validation
/// already refuses the 1-bit spelling (`k = 2`, nothing to learn, would be
/// uniform levels), which this returns as `[0, 1]` if asked.
pub fn kmeans_1d_pinned(pts: &mut [(f32, f32)], k: usize, iterations: usize) -> Result<Vec<f32>, CalibError> {
    if k < 2 {
        return Err(CalibError::Samples(format!(
            "a pinned table needs at least 2 levels (its ends at 0 and 1), asked for {k}"
        )));
    }
    let mut c: Vec<f32> = (0..k).map(|j| j as f32 / (k - 1) as f32).collect();
    if pts.is_empty() || k == 2 {
        return Ok(c);
    }
    pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (sw, swy) = prefix_sums(pts);
    // Each inner mean lies inside its own cell, between its neighbours'
    // midpoints, so the order holds; the sort only guards the clamp.
    lloyd_steps(pts, (&sw, &swy), &mut c, iterations, 1..k - 1, Some((0.0, 1.0)));
    Ok(c)
}

/// Weighted mean squared error of `pts` coded to the nearest of `table`
/// (thresholds at midpoints, as the quantizer codes); 0 for no points.
pub fn table_mse(pts: &[(f32, f32)], table: &[f32]) -> f64 {
    if table.is_empty() {
        return f64::INFINITY;
    }
    let (mut se, mut sw) = (0f64, 0f64);
    for (y, w) in pts {
        let c = crate::quant::lloyd_encode(*y, table) as usize;
        let e = (*y - table[c]) as f64;
        se += *w as f64 * e * e;
        sw += *w as f64;
    }
    if sw == 0.0 {
        0.0
    } else {
        se / sw
    }
}

/// The tables every tensor of a bound scheme decodes with at `layer`:
/// the fixed table (Lloyd–Max) or the calibrated codebook (`nuq`),
/// `None` for full tensors and uniform levels. Without a calibration a
/// `nuq` tensor is [`CalibError::Needed`].
pub fn levels_for(
    scheme: &Scheme,
    calibration: Option<&Calibration>,
    layer: usize,
) -> Result<[Option<Vec<f32>>; 2], CalibError> {
    let mut out = [None, None];
    for (i, t) in [Tensor::Key, Tensor::Value].into_iter().enumerate() {
        let Some(q) = scheme.codec(t).quant() else { continue };
        out[i] = match q.levels {
            Levels::Uniform => None,
            Levels::LloydMax(_) => Some(fixed_levels(q).to_vec()),
            Levels::Nuq(_) => match calibration {
                Some(c) => Some(c.codebook(scheme, t, layer)?),
                None => {
                    return Err(CalibError::Needed {
                        scheme: scheme.name.clone(),
                        tensor: t.name(),
                    })
                }
            },
        };
    }
    Ok(out)
}
