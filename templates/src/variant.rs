//! The variant space: the launch and tiling choices a kernel can be
//! instantiated with, their readable names, and which ones are valid for a
//! scheme and shape.

use crate::{GenError, Kernel};
use kivi_spec::layout::BlockLayout;
use kivi_spec::{Scheme, Shape};
use std::fmt;

/// One point of a kernel's tuning space.
///
/// Every field is a compile-time constant of the generated source; the
/// readable [`Variant::name`] spells all of them, so a name identifies the
/// variant of one scheme and shape (and [`Variant::parse`] reads it back).
/// Fields a kernel does not use are ignored by it (prefill and append use
/// only `threads`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Variant {
    /// Threads per block (a multiple of 32, at most 1024).
    pub threads: u32,
    /// Tokens scored per online-softmax step (one tile in shared memory).
    pub tile_tokens: u32,
    /// Splits of each sequence (flash-decoding); each split is one block and
    /// writes a partial `(m, l, acc)` that the combine kernel merges.
    pub splits: u32,
    /// Query heads served by one block from one pass over the KV head's
    /// bytes; divides the GQA group size.
    pub heads_per_block: u32,
    /// Words per vector load of a code row (1, 2 or 4: `u32`, `uint2`,
    /// `uint4`); every row and block offset must be a multiple of it.
    pub load_width: u32,
    /// Unroll factor of the per-tile token loops.
    pub unroll: u32,
}

impl Variant {
    /// The readable name, e.g. `t128.tile32.s8.h4.w1.u1`.
    ///
    /// ```
    /// let v = kivi_templates::Variant { threads: 128, tile_tokens: 32, splits: 8,
    ///     heads_per_block: 4, load_width: 4, unroll: 1 };
    /// assert_eq!(v.name(), "t128.tile32.s8.h4.w4.u1");
    /// assert_eq!(kivi_templates::Variant::parse(&v.name()).unwrap(), v);
    /// ```
    pub fn name(&self) -> String {
        format!(
            "t{}.tile{}.s{}.h{}.w{}.u{}",
            self.threads, self.tile_tokens, self.splits, self.heads_per_block, self.load_width, self.unroll
        )
    }

    /// Reads a name written by [`Variant::name`].
    pub fn parse(name: &str) -> Result<Variant, GenError> {
        let bad = || GenError::BadVariantName(name.to_string());
        let mut v = Variant {
            threads: 0,
            tile_tokens: 0,
            splits: 0,
            heads_per_block: 0,
            load_width: 0,
            unroll: 0,
        };
        let mut seen = 0u32;
        for part in name.trim().split('.') {
            // `tile` before `t`: both start with a `t`.
            let (slot, bit, digits) = if let Some(d) = part.strip_prefix("tile") {
                (&mut v.tile_tokens, 1, d)
            } else if let Some(d) = part.strip_prefix('t') {
                (&mut v.threads, 0, d)
            } else if let Some(d) = part.strip_prefix('s') {
                (&mut v.splits, 2, d)
            } else if let Some(d) = part.strip_prefix('h') {
                (&mut v.heads_per_block, 3, d)
            } else if let Some(d) = part.strip_prefix('w') {
                (&mut v.load_width, 4, d)
            } else if let Some(d) = part.strip_prefix('u') {
                (&mut v.unroll, 5, d)
            } else {
                return Err(bad());
            };
            if seen & (1 << bit) != 0 {
                return Err(bad());
            }
            seen |= 1 << bit;
            *slot = digits.parse().map_err(|_| bad())?;
        }
        if seen != 0b11_1111 {
            return Err(bad());
        }
        Ok(v)
    }

    /// Why this variant cannot be instantiated for `kernel` on this layout,
    /// or `Ok` when it can.
    pub fn check(&self, kernel: Kernel, scheme: &Scheme, layout: &BlockLayout) -> Result<(), GenError> {
        let shape = layout.shape;
        let invalid = |why: String| {
            Err(GenError::InvalidVariant {
                variant: self.name(),
                why,
            })
        };
        if self.threads == 0 || !self.threads.is_multiple_of(32) || self.threads > 1024 {
            return invalid(format!(
                "{} threads per block is not a multiple of 32 between 32 and 1024",
                self.threads
            ));
        }
        if matches!(kernel, Kernel::Prefill | Kernel::Append) {
            return Ok(());
        }
        if self.splits == 0 || self.splits > 256 {
            return invalid(format!("{} splits is out of range; expected 1 to 256", self.splits));
        }
        if self.tile_tokens == 0 || self.tile_tokens > 256 {
            return invalid(format!(
                "a tile of {} tokens is out of range; expected 1 to 256",
                self.tile_tokens
            ));
        }
        let group = shape.group_size() as u32;
        if self.heads_per_block == 0 || !group.is_multiple_of(self.heads_per_block) || self.heads_per_block > 16 {
            return invalid(format!(
                "{} query heads per block does not divide the GQA group of {group} (at most 16)",
                self.heads_per_block
            ));
        }
        if !matches!(self.load_width, 1 | 2 | 4) {
            return invalid(format!("load width {} words is not 1, 2 or 4", self.load_width));
        }
        let w = self.load_width as usize;
        for (what, n) in [
            ("key row", layout.key.words_per_token),
            ("value row", layout.value.words_per_token),
            ("key part", layout.key.words),
            ("KV head part", layout.head_words),
        ] {
            if !n.is_multiple_of(w) {
                return invalid(format!(
                    "a {what} of {n} words is not a multiple of the {w}-word load width"
                ));
            }
        }
        if self.unroll == 0 || self.unroll > 8 {
            return invalid(format!("unroll {} is out of range; expected 1 to 8", self.unroll));
        }
        // Registers per thread: each lane holds its channels of the query and
        // of the accumulator for every head of the block. Past this budget
        // ptxas spills (measured: 128 floats compile to ~170 registers, 512
        // to 255 registers and 1.8 KB of spills); do not offer such variants.
        let regs = self.register_floats(scheme, layout);
        if regs > MAX_REGISTER_FLOATS {
            return invalid(format!(
                "{regs} floats of query and accumulator per thread is over the {MAX_REGISTER_FLOATS}-float register budget"
            ));
        }
        let shared = crate::generate::decode_shared_bytes(self, scheme, layout);
        if shared > 48 * 1024 {
            return invalid(format!(
                "{shared} bytes of static shared memory is over the 48 KiB limit"
            ));
        }
        Ok(())
    }
}

/// Floats of query slice and accumulators one decode thread keeps in registers.
pub const MAX_REGISTER_FLOATS: usize = 128;

impl Variant {
    /// Floats of query slice and accumulators per decode thread: heads per
    /// block times the channels a lane owns in a key row and a value row.
    /// A value tensor that is rotated or centered keeps a second
    /// accumulator (its quantized tokens are summed in the codec's domain
    /// and brought back once per split).
    pub fn register_floats(&self, scheme: &Scheme, layout: &BlockLayout) -> usize {
        let w = self.load_width.max(1) as usize;
        let mut k = crate::generate::team_of(layout.key.words_per_token, w)
            .channels(layout.key.words_per_token, cpw(layout, true));
        let mut v = crate::generate::team_of(layout.value.words_per_token, w)
            .channels(layout.value.words_per_token, cpw(layout, false));
        // vq (kivi_vq_decode.cuh): keys score from the shared lookup table
        // (no query in registers); a value lane holds M accumulators for
        // each sub-vector it owns, one lane per code word.
        if scheme.key.vq().is_some() {
            k = 0;
        }
        if let Some(q) = scheme.value.vq() {
            let team = crate::generate::team_of(layout.value.words_per_token, 1).size;
            v = q.subvectors(layout.shape.head_dim).div_ceil(team) * q.dim as usize;
        }
        let accs = if crate::generate::value_split(scheme, layout) {
            2
        } else {
            1
        };
        self.heads_per_block as usize * (k + accs * v)
    }
}

/// Values one word holds in a tensor's rows (codes, or raw 16/32-bit values).
pub(crate) fn cpw(layout: &BlockLayout, key: bool) -> usize {
    let t = if key { &layout.key } else { &layout.value };
    match t.codec {
        kivi_spec::Codec::Quant(q) => kivi_spec::layout::codes_per_word(q.bits),
        kivi_spec::Codec::Full => 4 / t.dtype.bytes(),
        kivi_spec::Codec::Vq(v) => kivi_spec::layout::codes_per_word(v.code_bits()),
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

/// Query heads per block to try: the largest divisor of the GQA group up to
/// 8 (one pass over the KV bytes serves them all), half of it, and 1.
fn head_choices(shape: &Shape) -> Vec<u32> {
    let g = shape.group_size() as u32;
    let best = (1..=g.min(8)).rev().find(|h| g.is_multiple_of(*h)).unwrap_or(1);
    let mut v = vec![best];
    for h in [best / 2, 1] {
        if h >= 1 && g.is_multiple_of(h) && !v.contains(&h) {
            v.push(h);
        }
    }
    v
}

/// (heads per block, load width) pairs: for each head count, the widest load
/// that keeps the thread within the register budget, and single words.
fn head_width_pairs(scheme: &Scheme, layout: &BlockLayout) -> Vec<(u32, u32)> {
    let mut out = Vec::new();
    let mut heads = head_choices(&layout.shape);
    if scheme.key.vq().is_some() {
        // vq keys: each head of a block has its own lookup table in shared
        // memory (`[D / M][E]` floats), so the head count is what fits:
        // the largest divisor of the group whose tables fit, and 1.
        let g = layout.shape.group_size() as u32;
        let fit = |h: u32| {
            let v = Variant {
                threads: 128,
                tile_tokens: 32,
                splits: 8,
                heads_per_block: h,
                load_width: 1,
                unroll: 1,
            };
            v.check(Kernel::Decode, scheme, layout).is_ok()
        };
        let best = (1..=g.min(16))
            .rev()
            .find(|&h| g.is_multiple_of(h) && fit(h))
            .unwrap_or(1);
        heads = if best > 1 { vec![best, 1] } else { vec![1] };
    }
    // Both tensors vq: no row is read with vector loads (lanes take code
    // words one by one), so wider loads would only rename one kernel.
    let both_vq = scheme.key.vq().is_some() && scheme.value.vq().is_some();
    for h in heads {
        if both_vq {
            out.push((h, 1));
            continue;
        }
        let fits = |w: u32| {
            let v = Variant {
                threads: 128,
                tile_tokens: 32,
                splits: 8,
                heads_per_block: h,
                load_width: w,
                unroll: 1,
            };
            v.check(Kernel::Decode, scheme, layout).is_ok()
        };
        if let Some(w) = [4, 2].into_iter().find(|&w| fits(w)) {
            out.push((h, w));
        }
        out.push((h, 1));
    }
    out
}

/// The candidate list before validity checks, canonical default first.
pub(crate) fn space(scheme: &Scheme, layout: &BlockLayout, kernel: Kernel) -> Vec<Variant> {
    let base = Variant {
        threads: 128,
        tile_tokens: 32,
        splits: 8,
        heads_per_block: 1,
        load_width: 1,
        unroll: 1,
    };
    match kernel {
        Kernel::Prefill | Kernel::Append => [128, 64, 256]
            .into_iter()
            .map(|threads| Variant { threads, ..base })
            .collect(),
        Kernel::Decode => {
            let pairs = head_width_pairs(scheme, layout);
            let mut out = Vec::new();
            for (threads, tile_tokens) in [(128, 32), (64, 32), (256, 64)] {
                for splits in [8, 1] {
                    for &(heads_per_block, load_width) in &pairs {
                        out.push(Variant {
                            threads,
                            tile_tokens,
                            splits,
                            heads_per_block,
                            load_width,
                            unroll: 1,
                        });
                    }
                }
            }
            // Long contexts want more splits; and an unrolled token loop.
            // vq keys rebuild their lookup table in every split (D x E
            // FMAs per head): fewer splits amortize it over more tokens.
            let (h, w) = pairs[0];
            let fewer: &[(u32, u32)] = if scheme.key.vq().is_some() {
                &[(4, 1), (2, 1)]
            } else {
                &[]
            };
            for &(splits, unroll) in [(32, 1), (16, 2)].iter().chain(fewer) {
                out.push(Variant {
                    threads: 128,
                    tile_tokens: 32,
                    splits,
                    heads_per_block: h,
                    load_width: w,
                    unroll,
                });
            }
            out
        }
    }
}

/// The first point of the space for a scheme without a shape (generation
/// then fails with `Unbound`, which names the real problem).
pub(crate) fn space_fallback(_kernel: Kernel) -> Variant {
    Variant {
        threads: 128,
        tile_tokens: 32,
        splits: 8,
        heads_per_block: 1,
        load_width: 1,
        unroll: 1,
    }
}
