//! Low-rank keys and values (LowRAM-style): `low_rank: pca(rank = R, apply = [key, value])`.
//!
//! Per layer and KV head a calibration supplies an orthonormal basis
//! `B` (`head_dim x R`, the leading eigenvectors of the keys' — and
//! separately the values' — second moment, see `kivi_runtime::low_rank`).
//! The cache stores each token's *coordinates* `c = Bᵀ x` (R numbers)
//! instead of its row, and decodes `x^ = B c^`. The `key` and `value`
//! codecs then describe how the R coordinates are stored: `full` keeps them
//! in the activation dtype, `quant(...)` quantizes them exactly as it would a
//! row of `R` channels (channel groups run over tokens of one coordinate,
//! token groups over consecutive coordinates of one token). Sinks and the
//! residual window hold coordinates too, unquantized: every token goes
//! through the basis, so a score never mixes two kinds of key.
//!
//! Why coordinates and not a residual row: with `q' = Bᵀ q` computed once
//! per step, `q . (B c) = q' . c`, so decode scores `R`-wide rows; the
//! weighted sum of values stays in coordinates too
//! (`sum p_t B c_t = B sum p_t c_t`) and is reconstructed once. A cache of
//! a low-rank scheme is therefore a cache of its [`Scheme::coordinate_scheme`]
//! (head_dim `R`, the same codecs and windows, the outer softmax scale), and
//! every fast path of that cache serves it unchanged.
//!
//! What is refused (spanned errors, "not supported yet"): `apply` other than
//! `[key, value]` (one cache stores both tensors at one width), `levels =
//! nuq` (its codebooks are fitted on full rows), a rotation, outliers or
//! centering, `rope: pre(...)` (a per-position turn does not commute with
//! the basis), `query: int8(...)` and `mla` heads.

use crate::model::*;
use crate::validate::{Field, Invalid};

/// `low_rank: pca(rank = R, apply = [...])`: see the module docs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LowRank {
    /// Coordinates kept per token and KV head (`1 <= R <= head_dim`).
    pub rank: u32,
    /// Which tensors go through a basis (only `[key, value]` today).
    pub apply: Apply,
    /// LowRAM's exact residual (`residual = N`, default 0): per sequence
    /// and KV head, the `N` tokens the basis reconstructs worst (largest
    /// `||x - B Bᵀ x||²` of the rounded row, ties to the earlier token) are
    /// kept exactly, in the activation dtype, and read instead of their
    /// reconstruction (`kivi_runtime::low_rank`).
    pub residual: u32,
}

impl LowRank {
    /// The canonical spelling, e.g. `pca(rank = 64, apply = [key, value])`
    /// (`, residual = N` only when `N > 0`, so schemes without one keep
    /// their text and hash).
    pub fn text(&self) -> String {
        let residual = if self.residual > 0 {
            format!(", residual = {}", self.residual)
        } else {
            String::new()
        };
        format!("pca(rank = {}, apply = {}{residual})", self.rank, self.apply.text())
    }
}

impl Scheme {
    /// The rank of tensor `t`'s basis, if it is low-rank.
    pub fn rank_of(&self, t: Tensor) -> Option<usize> {
        self.low_rank.filter(|l| l.apply.has(t)).map(|l| l.rank as usize)
    }

    /// The scheme a low-rank cache actually stores: the same codecs,
    /// windows and heads over `rank` coordinates (`head_dim = R`), with the
    /// softmax scale of the full head fixed (`1/sqrt(head_dim)` unless set),
    /// because scores on coordinates equal scores on reconstructed keys.
    /// `None` for a scheme without `low_rank`.
    ///
    /// ```
    /// let s = kivi_spec::parse_scheme(
    ///     "L { key: quant(bits = 4, axis = channel, group = 32), value: full, residual: 32,
    ///          low_rank: pca(rank = 64, apply = [key, value]), heads: mqa(q = 4), head_dim: 256 }",
    /// ).unwrap();
    /// let c = s.coordinate_scheme().unwrap();
    /// assert_eq!((c.head_dim, c.softmax_scale, c.low_rank), (Some(64), Some(1.0 / 16.0), None));
    /// ```
    pub fn coordinate_scheme(&self) -> Option<Scheme> {
        let l = self.low_rank?;
        let mut c = self.clone();
        c.low_rank = None;
        c.head_dim = Some(l.rank);
        c.softmax_scale = self.head_dim.map(|d| self.effective_softmax_scale(d as usize));
        Some(c)
    }
}

/// The most exact tokens `residual = N` may keep per sequence and KV head.
pub const MAX_RESIDUAL: u32 = 4096;

/// The rules of `low_rank` (called by [`crate::validate`]).
pub(crate) fn validate_low_rank(s: &Scheme) -> Result<(), Invalid> {
    let Some(l) = s.low_rank else {
        return Ok(());
    };
    if !(l.apply.key && l.apply.value) {
        return Err(Invalid::new(
            Field::LowRankApply,
            format!(
                "low_rank apply = {} is not supported yet; the cache stores keys and values at one width, so write apply = [key, value]",
                l.apply.text()
            ),
        ));
    }
    let limit = s.head_dim.unwrap_or(crate::validate::MAX_HEAD_DIM);
    if l.rank == 0 || l.rank > limit {
        return Err(Invalid::new(
            Field::LowRankRank,
            match s.head_dim {
                Some(d) => format!("low_rank rank = {} must be between 1 and head_dim {d}", l.rank),
                None => format!("low_rank rank = {} must be between 1 and {limit}", l.rank),
            },
        ));
    }
    if l.residual > MAX_RESIDUAL {
        return Err(Invalid::new(
            Field::LowRank,
            format!(
                "low_rank residual = {} is out of range; expected 0 to {MAX_RESIDUAL} exact tokens per sequence and KV head",
                l.residual
            ),
        ));
    }
    let refuse = |field: Field, what: &str| -> Result<(), Invalid> {
        Err(Invalid::new(
            field,
            format!("{what} with low_rank is not supported yet; drop one of them"),
        ))
    };
    for t in [Tensor::Key, Tensor::Value] {
        if s.codec(t).vq().is_some() {
            return refuse(
                Field::Codec(t),
                &format!(
                    "{} vq(...) (product codebooks fitted on full rows, not coordinates)",
                    t.name()
                ),
            );
        }
        if s.codec(t).quant().is_some_and(|q| matches!(q.levels, Levels::Nuq(_))) {
            return refuse(
                Field::Levels(t),
                &format!(
                    "{} levels = nuq (codebooks fitted on full rows, not coordinates)",
                    t.name()
                ),
            );
        }
    }
    if s.rotation.is_some() {
        return refuse(Field::Rotation, "a rotation");
    }
    if s.outliers.is_some() {
        return refuse(Field::Outliers, "outliers");
    }
    if s.center.is_some() {
        return refuse(Field::Center, "centering");
    }
    if s.rope.is_some() {
        return refuse(
            Field::Rope,
            "rope: pre(...) (a per-position turn does not commute with the basis)",
        );
    }
    if s.query.is_some() {
        return refuse(Field::Query, "query: int8(...)");
    }
    if matches!(s.heads, Some(Heads::Mla(_))) {
        return refuse(Field::Heads, "mla heads");
    }
    // The codecs act on R coordinates: check them as a head of width R
    // (token groups must divide R, ...), naming the coordinates.
    let mut c = s.clone();
    c.low_rank = None;
    c.head_dim = Some(l.rank);
    crate::validate::validate(&c)
        .map_err(|e| Invalid::new(e.field, format!("{} (on the rank-{} coordinates)", e.message, l.rank)))
}
