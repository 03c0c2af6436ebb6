//! The paged MLA cache: per token one latent row and one RoPE row, each
//! stored by its own codec, in one block pool with exact accounting.
//!
//! A block holds `block_tokens` consecutive stored tokens (counted from the
//! first token after the sinks) of both parts, laid out by
//! [`MlaLayout`]: the latent part, then the RoPE part, each a
//! [`TensorLayout`] (codes `[token][word]`, then scales, then zero points;
//! raw rows for a `full` part). Sinks and the recent window of each part
//! are kept in the activation dtype outside the blocks. The two parts may
//! be stored up to different tokens (an exact RoPE part is stored at once,
//! a channel-axis latent `G` tokens at a time after its window): the block
//! table covers the further of the two.

use crate::cache::{params_at, read_raw, SeqId};
use crate::error::{Error, Result};
use crate::quant::{self, dequantize, pack, quantize_group, unpack_one, GroupParams};
use crate::reference::round_inputs;
use kivi_spec::layout::{regions, TensorLayout};
use kivi_spec::mla::mla_block_tokens;
use kivi_spec::{Axis, Codec, Dtype, MlaLayout, MlaParts, ScaleDtype, Scheme, Tensor};
use std::collections::BTreeMap;

/// One of the two parts of an MLA cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    /// The latent `c_t` (the scheme's `key` codec): scored and averaged.
    Latent,
    /// The decoupled RoPE key `k_rope_t` (the `rope` codec): scored only.
    Rope,
}

impl Part {
    pub fn name(self) -> &'static str {
        match self {
            Part::Latent => "latent",
            Part::Rope => "rope",
        }
    }
    fn index(self) -> usize {
        self as usize
    }
}

/// Block size and pool capacity of an [`MlaCache`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaConfig {
    /// Tokens per block; `None` picks [`mla_block_tokens`].
    pub block_tokens: Option<usize>,
    /// Blocks in the pool.
    pub max_blocks: usize,
}

/// Rows in the activation dtype, stored at their real width.
#[derive(Clone, Debug)]
struct Rows {
    dtype: Dtype,
    half: Vec<u16>,
    full: Vec<f32>,
}

impl Rows {
    fn new(dtype: Dtype) -> Rows {
        Rows {
            dtype,
            half: Vec::new(),
            full: Vec::new(),
        }
    }
    fn push(&mut self, xs: &[f32]) {
        match self.dtype {
            Dtype::F32 => self.full.extend_from_slice(xs),
            d => self.half.extend(xs.iter().map(|x| quant::to_bits_16(*x, d))),
        }
    }
    fn get(&self, i: usize) -> f32 {
        match self.dtype {
            Dtype::F32 => self.full[i],
            d => quant::from_bits_16(self.half[i], d),
        }
    }
    fn len(&self) -> usize {
        self.half.len() + self.full.len()
    }
    fn drain_front(&mut self, n: usize) {
        match self.dtype {
            Dtype::F32 => drop(self.full.drain(..n)),
            _ => drop(self.half.drain(..n)),
        }
    }
    fn bytes(&self) -> usize {
        self.len() * self.dtype.bytes()
    }
}

#[derive(Clone, Debug)]
struct PartState {
    sinks: Rows,
    /// Rows after the stored ones (the recent window), oldest first.
    window: Rows,
    /// Tokens stored in blocks.
    stored: usize,
}

#[derive(Clone, Debug)]
struct MlaSeq {
    tokens: usize,
    table: Vec<u32>,
    parts: [PartState; 2],
}

/// What one part of an append will write to blocks: the encoded rows of
/// stored tokens `first..first + rows` and their group parameters.
struct Pending {
    first: usize,
    rows: usize,
    words: Vec<u32>,
    /// (token index counted from the first stored token, channel, params)
    params: Vec<(usize, usize, GroupParams)>,
}

/// Exact bytes of an MLA cache (or one sequence), by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MlaMemory {
    /// Stored bytes of the latent part: codes and parameters of stored
    /// tokens (raw rows for `full`), plus its sink and window rows.
    pub latent: usize,
    /// The same for the RoPE part.
    pub rope: usize,
    /// Sink and window rows of both parts (included in `latent` and `rope`).
    pub windows: usize,
    pub blocks_in_use: usize,
    /// Bytes of the blocks in use (whole blocks: the last one of a
    /// sequence is partly empty).
    pub block_bytes: usize,
    /// Block-table entries, 4 bytes each.
    pub tables: usize,
    /// `block_bytes + windows + tables`: what the cache holds.
    pub total: usize,
}

/// A paged cache of an MLA scheme (`heads: mla(...)`).
///
/// ```
/// use kivi_runtime::mla::{MlaCache, MlaConfig};
/// let s = kivi_spec::parse_scheme("M { key: quant(bits = 2, axis = channel, group = 32), residual: 32,
///     heads: mla(q = 16, latent = 512, rope_dim = 64) }").unwrap();
/// let mut cache = MlaCache::new(s, MlaConfig { block_tokens: None, max_blocks: 8 }).unwrap();
/// let id = cache.add_sequence();
/// cache.extend(id, &vec![0.5; 100 * 512], &vec![0.25; 100 * 64]).unwrap();
/// let m = cache.sequence_memory(id).unwrap();
/// // 64 latent tokens stored at 192 B, 36 in the window at 1024 B; 100 exact rope rows
/// assert_eq!(m.latent, 64 * 192 + 36 * 1024);
/// assert_eq!(m.rope, 100 * 128);
/// ```
pub struct MlaCache {
    scheme: Scheme,
    parts: MlaParts,
    layout: MlaLayout,
    pool: Vec<u32>,
    free: Vec<u32>,
    max_blocks: usize,
    seqs: BTreeMap<SeqId, MlaSeq>,
    next_id: SeqId,
}

impl MlaCache {
    /// A cache for a validated scheme with `mla(...)` heads.
    pub fn new(scheme: Scheme, config: MlaConfig) -> Result<MlaCache> {
        kivi_spec::validate(&scheme)?;
        let parts = super::reference::mla_of(&scheme).map(|_| scheme.mla_parts().expect("mla heads"))?;
        let bt = config
            .block_tokens
            .unwrap_or_else(|| mla_block_tokens(&scheme, parts.mla));
        if bt == 0 || bt > kivi_spec::layout::MAX_BLOCK_TOKENS {
            return Err(Error::Config(format!("block size {bt} tokens is out of range")));
        }
        for (c, what) in [(scheme.key, "latent"), (parts.mla.rope, "rope")] {
            if let Some(q) = c.quant() {
                if q.axis == Axis::Channel && !bt.is_multiple_of(q.group as usize) {
                    return Err(Error::Config(format!(
                        "block size {bt} tokens is not a multiple of the {what} channel group {}",
                        q.group
                    )));
                }
            }
        }
        if config.max_blocks > u32::MAX as usize {
            return Err(Error::Config(format!("{} blocks is too many", config.max_blocks)));
        }
        let layout = MlaLayout::new(&scheme, parts.mla, bt);
        let words = layout
            .block_words
            .checked_mul(config.max_blocks)
            .ok_or_else(|| Error::Config("the block pool does not fit in memory".into()))?;
        Ok(MlaCache {
            scheme,
            parts,
            layout,
            pool: vec![0; words],
            free: (0..config.max_blocks as u32).rev().collect(),
            max_blocks: config.max_blocks,
            seqs: BTreeMap::new(),
            next_id: 0,
        })
    }

    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }
    pub fn parts(&self) -> &MlaParts {
        &self.parts
    }
    pub fn layout(&self) -> &MlaLayout {
        &self.layout
    }
    /// The block pool, `max_blocks * layout().block_words` words.
    pub fn pool(&self) -> &[u32] {
        &self.pool
    }
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// Width of one part's row.
    pub fn dim(&self, part: Part) -> usize {
        match part {
            Part::Latent => self.parts.mla.latent as usize,
            Part::Rope => self.parts.mla.rope_dim as usize,
        }
    }

    fn part_scheme(&self, part: Part) -> &Scheme {
        match part {
            Part::Latent => &self.parts.latent,
            Part::Rope => &self.parts.rope,
        }
    }

    fn tensor_layout(&self, part: Part) -> (&TensorLayout, usize) {
        match part {
            Part::Latent => (&self.layout.latent, 0),
            Part::Rope => (&self.layout.rope, self.layout.rope_offset),
        }
    }

    /// A new, empty sequence.
    pub fn add_sequence(&mut self) -> SeqId {
        let id = self.next_id;
        self.next_id += 1;
        let st = || PartState {
            sinks: Rows::new(self.scheme.dtype),
            window: Rows::new(self.scheme.dtype),
            stored: 0,
        };
        self.seqs.insert(
            id,
            MlaSeq {
                tokens: 0,
                table: Vec::new(),
                parts: [st(), st()],
            },
        );
        id
    }

    /// Frees a sequence and its blocks.
    pub fn free_sequence(&mut self, id: SeqId) -> Result<()> {
        let seq = self.seqs.remove(&id).ok_or(Error::UnknownSequence(id))?;
        self.free.extend(seq.table.iter().rev());
        Ok(())
    }

    pub fn sequences(&self) -> Vec<SeqId> {
        self.seqs.keys().copied().collect()
    }

    fn seq(&self, id: SeqId) -> Result<&MlaSeq> {
        self.seqs.get(&id).ok_or(Error::UnknownSequence(id))
    }

    /// Tokens in a sequence.
    pub fn len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.tokens)
    }

    /// Tokens of `part` stored in blocks (the rest are sinks or window).
    pub fn stored(&self, id: SeqId, part: Part) -> Result<usize> {
        Ok(self.seq(id)?.parts[part.index()].stored)
    }

    /// The block table of a sequence.
    pub fn block_table(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.seq(id)?.table)
    }

    /// Appends one token: `latent` (`L`) and `rope` (`R`).
    pub fn append(&mut self, id: SeqId, latent: &[f32], rope: &[f32]) -> Result<()> {
        let (l, r) = (self.dim(Part::Latent), self.dim(Part::Rope));
        if latent.len() != l || rope.len() != r {
            return Err(Error::Shape {
                what: "appended latent/rope",
                expected: format!("{l} and {r} values"),
                got: format!("{} and {}", latent.len(), rope.len()),
            });
        }
        self.extend(id, latent, rope)
    }

    /// Appends `T` tokens at once: `latent` `[T, L]`, `rope` `[T, R]`.
    /// Streaming the same tokens one at a time gives a bit-identical cache.
    /// On error nothing changes.
    pub fn extend(&mut self, id: SeqId, latent: &[f32], rope: &[f32]) -> Result<()> {
        let (l, r) = (self.dim(Part::Latent), self.dim(Part::Rope));
        if !latent.len().is_multiple_of(l) || !rope.len().is_multiple_of(r) || latent.len() / l != rope.len() / r {
            return Err(Error::Shape {
                what: "latent/rope length",
                expected: format!("T x {l} and T x {r} for the same T"),
                got: format!("{} and {}", latent.len(), rope.len()),
            });
        }
        let n = latent.len() / l;
        let seq = self.seq(id)?;
        let old = seq.tokens;
        let total = old + n;
        let rows = [
            round_inputs(&self.scheme, "latent", latent, 1, l)?,
            round_inputs(&self.scheme, "rope", rope, 1, r)?,
        ];
        // Encode what becomes stored, per part, without touching the cache.
        let mut pending = Vec::with_capacity(2);
        for part in [Part::Latent, Part::Rope] {
            pending.push(self.encode(seq, part, &rows[part.index()], total)?);
        }
        let bt = self.layout.block_tokens;
        let stored_max = pending.iter().map(|p| p.first + p.rows).max().unwrap_or(0);
        let need = stored_max.div_ceil(bt).saturating_sub(seq.table.len());
        if need > self.free.len() {
            return Err(Error::OutOfBlocks {
                need,
                free: self.free.len(),
                total: self.max_blocks,
            });
        }
        // Commit.
        let new_blocks: Vec<u32> = (0..need).map(|_| self.free.pop().expect("checked")).collect();
        let seq = self.seqs.get_mut(&id).expect("checked");
        seq.table.extend(new_blocks);
        let table = seq.table.clone();
        for part in [Part::Latent, Part::Rope] {
            let p = &pending[part.index()];
            let d = if part == Part::Latent { l } else { r };
            let ps = match part {
                Part::Latent => &self.parts.latent,
                Part::Rope => &self.parts.rope,
            };
            let st = &mut seq.parts[part.index()];
            let reg = regions(ps, Tensor::Key, total);
            let x = &rows[part.index()];
            // New sinks come first among the new rows.
            let new_sinks = reg.sinks - st.sinks.len() / d;
            st.sinks.push(&x[..new_sinks * d]);
            st.window.push(&x[new_sinks * d..]);
            st.window.drain_front(p.rows * d);
            st.stored += p.rows;
            debug_assert_eq!(st.stored, reg.quantized);
            debug_assert_eq!(st.window.len(), reg.window * d);
        }
        seq.tokens = total;
        for part in [Part::Latent, Part::Rope] {
            self.write(&table, part, &pending[part.index()]);
        }
        Ok(())
    }

    /// Encodes the tokens of `part` that become stored when the sequence
    /// grows to `total` tokens with new rows `x` (rounded).
    fn encode(&self, seq: &MlaSeq, part: Part, x: &[f32], total: usize) -> Result<Pending> {
        let d = self.dim(part);
        let st = &seq.parts[part.index()];
        let reg = regions(self.part_scheme(part), Tensor::Key, total);
        let first = st.stored;
        let rows = reg.quantized - first;
        let (tl, _) = self.tensor_layout(part);
        let wpt = tl.words_per_token;
        let mut out = Pending {
            first,
            rows,
            words: vec![0; rows * wpt],
            params: Vec::new(),
        };
        if rows == 0 {
            return Ok(out);
        }
        // The rows becoming stored: the old window, then the new rows after
        // the new sinks.
        let new_sinks = reg.sinks - st.sinks.len() / d;
        let old_window = st.window.len() / d;
        let row = |j: usize, c: usize| -> f32 {
            if j < old_window {
                st.window.get(j * d + c)
            } else {
                x[(new_sinks + j - old_window) * d + c]
            }
        };
        let sinks = reg.sinks;
        match self.codec(part) {
            Codec::Full => {
                let mut buf = vec![0f32; d];
                for j in 0..rows {
                    for (c, b) in buf.iter_mut().enumerate() {
                        *b = row(j, c);
                    }
                    write_raw_row(&mut out.words[j * wpt..(j + 1) * wpt], &buf, self.scheme.dtype);
                }
            }
            // `validate` refuses vq with mla heads; a hand-built one is an error.
            Codec::Vq(_) => {
                return Err(Error::Config(
                    "vq codecs do not apply to mla caches (kivi_spec::validate refuses them)".into(),
                ))
            }
            Codec::Quant(q) => {
                let g = q.group as usize;
                let mut codes = vec![0u32; rows * d];
                let mut vals = vec![0f32; g];
                let mut gc = vec![0u32; g];
                let check = |p: GroupParams, lo: f32, hi: f32, tok: usize, ch: usize| -> Result<()> {
                    if p.is_finite() {
                        Ok(())
                    } else {
                        Err(Error::ScaleOverflow {
                            tensor: part.name(),
                            token: tok,
                            head: 0,
                            channel: ch,
                            lo,
                            hi,
                            dtype: q.scale.name(),
                        })
                    }
                };
                match q.axis {
                    Axis::Channel => {
                        for j0 in (0..rows).step_by(g) {
                            for ch in 0..d {
                                for (k, v) in vals.iter_mut().enumerate() {
                                    *v = row(j0 + k, ch);
                                }
                                let (p, lo, hi) = quantize_group(&vals, &q, &mut gc);
                                check(p, lo, hi, sinks + first + j0, ch)?;
                                for k in 0..g {
                                    codes[(j0 + k) * d + ch] = gc[k];
                                }
                                out.params.push((first + j0, ch, p));
                            }
                        }
                    }
                    Axis::Token => {
                        for j in 0..rows {
                            for c0 in (0..d).step_by(g) {
                                for (k, v) in vals.iter_mut().enumerate() {
                                    *v = row(j, c0 + k);
                                }
                                let (p, lo, hi) = quantize_group(&vals, &q, &mut gc);
                                check(p, lo, hi, sinks + first + j, c0)?;
                                codes[j * d + c0..j * d + c0 + g].copy_from_slice(&gc);
                                out.params.push((first + j, c0, p));
                            }
                        }
                    }
                }
                for j in 0..rows {
                    pack(
                        &codes[j * d..(j + 1) * d],
                        q.bits,
                        &mut out.words[j * wpt..(j + 1) * wpt],
                    );
                }
            }
        }
        Ok(out)
    }

    fn codec(&self, part: Part) -> Codec {
        match part {
            Part::Latent => self.scheme.key,
            Part::Rope => self.parts.mla.rope,
        }
    }

    fn write(&mut self, table: &[u32], part: Part, p: &Pending) {
        let bt = self.layout.block_tokens;
        let bw = self.layout.block_words;
        let (tl, off) = self.tensor_layout(part);
        let tl = *tl;
        let wpt = tl.words_per_token;
        for j in 0..p.rows {
            let tok = p.first + j;
            let base = table[tok / bt] as usize * bw + off;
            let at = base + tl.codes_offset + (tok % bt) * wpt;
            self.pool[at..at + wpt].copy_from_slice(&p.words[j * wpt..(j + 1) * wpt]);
        }
        if let Codec::Quant(q) = self.codec(part) {
            for &(tok, ch, gp) in &p.params {
                let base = table[tok / bt] as usize * bw + off;
                let i = tl.param_index(tok % bt, ch);
                write_param(&mut self.pool[base + tl.scales_offset..], i, gp.scale, q.scale);
                if q.has_zeros() {
                    write_param(&mut self.pool[base + tl.zeros_offset..], i, gp.zero, q.scale);
                }
            }
        }
    }

    /// The words of `part` in block `block`.
    pub fn block_part(&self, block: u32, part: Part) -> &[u32] {
        let (tl, off) = self.tensor_layout(part);
        &self.pool[block as usize * self.layout.block_words + off..][..tl.words]
    }

    /// The cache's value of token `p` of `part` into `out` (`dim(part)`
    /// values): the stored row for sinks and window tokens, the decoded row
    /// for tokens in blocks.
    pub fn row(&self, id: SeqId, part: Part, p: usize, out: &mut [f32]) -> Result<()> {
        let seq = self.seq(id)?;
        let d = self.dim(part);
        if p >= seq.tokens || out.len() != d {
            return Err(Error::Shape {
                what: "row",
                expected: format!("token < {} and {d} values", seq.tokens),
                got: format!("token {p}, {} values", out.len()),
            });
        }
        let st = &seq.parts[part.index()];
        let sinks = st.sinks.len() / d;
        if p < sinks {
            for (c, o) in out.iter_mut().enumerate() {
                *o = st.sinks.get(p * d + c);
            }
            return Ok(());
        }
        let j = p - sinks;
        if j >= st.stored {
            let w = j - st.stored;
            for (c, o) in out.iter_mut().enumerate() {
                *o = st.window.get(w * d + c);
            }
            return Ok(());
        }
        let bt = self.layout.block_tokens;
        let words = self.block_part(seq.table[j / bt], part);
        let (tl, _) = self.tensor_layout(part);
        decode_row(tl, words, j % bt, out);
        Ok(())
    }

    /// Every row of `part` of a sequence, `[T, dim(part)]`: what the oracle's
    /// [`super::reference::cache_views`] computes in one shot.
    pub fn dequantize(&self, id: SeqId, part: Part) -> Result<Vec<f32>> {
        let t = self.len(id)?;
        let d = self.dim(part);
        let mut out = vec![0f32; t * d];
        for p in 0..t {
            self.row(id, part, p, &mut out[p * d..(p + 1) * d])?;
        }
        Ok(out)
    }

    /// The sink and window rows of `part` and how many tokens are stored:
    /// `(sinks, stored, window)` counts, for backends.
    pub(crate) fn regions_of(&self, id: SeqId, part: Part) -> Result<(usize, usize, usize)> {
        let seq = self.seq(id)?;
        let d = self.dim(part);
        let st = &seq.parts[part.index()];
        Ok((st.sinks.len() / d, st.stored, st.window.len() / d))
    }

    fn seq_memory(&self, seq: &MlaSeq) -> MlaMemory {
        let mut m = MlaMemory::default();
        for part in [Part::Latent, Part::Rope] {
            let d = self.dim(part);
            let st = &seq.parts[part.index()];
            let raw = st.sinks.bytes() + st.window.bytes();
            let stored = match self.codec(part) {
                Codec::Full => st.stored * d * self.scheme.dtype.bytes(),
                Codec::Vq(_) => st.stored * self.tensor_layout(part).0.words_per_token * 4,
                Codec::Quant(q) => {
                    let (tl, _) = self.tensor_layout(part);
                    let g = q.group as usize;
                    let groups = match q.axis {
                        Axis::Channel => st.stored / g * d,
                        Axis::Token => st.stored * (d / g),
                    };
                    let per = if q.has_zeros() { 2 } else { 1 };
                    st.stored * tl.words_per_token * 4 + groups * per * scale_bytes(q.scale)
                }
            };
            m.windows += raw;
            match part {
                Part::Latent => m.latent = stored + raw,
                Part::Rope => m.rope = stored + raw,
            }
        }
        m.blocks_in_use = seq.table.len();
        m.block_bytes = seq.table.len() * self.layout.block_words * 4;
        m.tables = seq.table.len() * 4;
        m.total = m.block_bytes + m.windows + m.tables;
        m
    }

    /// Exact bytes of one sequence.
    pub fn sequence_memory(&self, id: SeqId) -> Result<MlaMemory> {
        Ok(self.seq_memory(self.seq(id)?))
    }

    /// Exact bytes of the whole cache (the sum over sequences).
    pub fn memory(&self) -> MlaMemory {
        let mut t = MlaMemory::default();
        for s in self.seqs.values() {
            let m = self.seq_memory(s);
            t.latent += m.latent;
            t.rope += m.rope;
            t.windows += m.windows;
            t.blocks_in_use += m.blocks_in_use;
            t.block_bytes += m.block_bytes;
            t.tables += m.tables;
            t.total += m.total;
        }
        t
    }
}

fn scale_bytes(s: ScaleDtype) -> usize {
    s.bytes()
}

/// Decodes stored token `slot` of one part's block words into `out`.
pub(crate) fn decode_row(tl: &TensorLayout, words: &[u32], slot: usize, out: &mut [f32]) {
    let row = &words[tl.codes_offset + slot * tl.words_per_token..][..tl.words_per_token];
    match tl.codec {
        Codec::Full => {
            for (c, o) in out.iter_mut().enumerate() {
                *o = read_raw(row, c, tl.dtype);
            }
        }
        // Never stored (the writer refuses vq parts).
        Codec::Vq(_) => out.fill(0.0),
        Codec::Quant(q) => {
            for (c, o) in out.iter_mut().enumerate() {
                let p = params_at(tl, words, &q, slot, c);
                *o = dequantize(unpack_one(row, q.bits, c), p, &q);
            }
        }
    }
}

fn write_param(words: &mut [u32], i: usize, x: f32, dtype: ScaleDtype) {
    match dtype {
        ScaleDtype::F16 => {
            let shift = 16 * (i % 2);
            let b = half::f16::from_f32(x).to_bits() as u32;
            words[i / 2] = (words[i / 2] & !(0xffff << shift)) | (b << shift);
        }
        ScaleDtype::F32 => words[i] = x.to_bits(),
    }
}

fn write_raw_row(words: &mut [u32], vals: &[f32], dtype: Dtype) {
    match dtype {
        Dtype::F32 => {
            for (w, v) in words.iter_mut().zip(vals) {
                *w = v.to_bits();
            }
        }
        d => {
            for (w, pair) in words.iter_mut().zip(vals.chunks(2)) {
                let lo = quant::to_bits_16(pair[0], d) as u32;
                let hi = pair.get(1).map_or(0, |x| quant::to_bits_16(*x, d) as u32);
                *w = lo | (hi << 16);
            }
        }
    }
}
