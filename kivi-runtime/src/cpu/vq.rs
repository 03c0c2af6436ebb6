//! Decode over `vq(...)` tensors by asymmetric distance computation
//! (DESIGN.md §8): no key or value row is ever reconstructed.
//!
//! Keys: once per split, per query head `h` and sub-vector `j`, a table
//! `L[h][j][c] = q_h[j] . C_j[c]` over the `E` centroids of codebook `j`;
//! a token's score is then `sum_j L[h][j][code_j]`, `D / M` lookups
//! instead of `D` multiply-adds over decoded channels.
//!
//! Values: each token's softmax weight is added to the bin of its centroid
//! in every sub-vector, `B[h][j][c] += p_t`; the bins follow the online
//! softmax's rescaling like the accumulator does, and the output is
//! expanded once per split, `acc[h][j] += sum_c B[h][j][c] C_j[c]`.

use crate::vq::VqBook;

/// The codes of a packed row (LSB first, `32 / bits` codes per word), each
/// offset by its sub-vector's table, `codes[j] = j * entries + code_j`:
/// word by word, so no division per code (it cost more than the lookups).
#[inline(always)]
fn offsets(row: &[u32], bits: u32, entries: usize, codes: &mut [usize]) {
    let per = (32 / bits) as usize;
    let mask = (1u32 << bits) - 1;
    for (w, chunk) in row.iter().zip(codes.chunks_mut(per)) {
        let mut x = *w;
        for c in chunk.iter_mut() {
            *c = (x & mask) as usize;
            x >>= bits;
        }
    }
    for (j, c) in codes.iter_mut().enumerate() {
        *c += j * entries;
    }
}

/// The lookup table of `g` query heads (`q`, `g x D`, already scaled):
/// `lut[(h * S + j) * E + c] = q_h[j*M..(j+1)*M] . C_j[c]`.
pub(crate) fn build_lut(book: &VqBook, q: &[f32], g: usize, lut: &mut Vec<f32>) {
    let (m, e, s) = (book.dim, book.entries, book.subvectors);
    let d = m * s;
    lut.clear();
    lut.resize(g * s * e, 0.0);
    for hh in 0..g {
        for j in 0..s {
            let qj = &q[hh * d + j * m..][..m];
            let out = &mut lut[(hh * s + j) * e..][..e];
            for (o, cent) in out.iter_mut().zip(book.table(j).chunks_exact(m)) {
                *o = qj.iter().zip(cent).map(|(a, b)| a * b).sum();
            }
        }
    }
}

/// Scores of `len` block rows starting at word `base` (`wpt` words a row):
/// `out[r * g + h] = sum_j lut[(h * S + j) * E + code(r, j)]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn score(
    book: &VqBook,
    bits: u32,
    words: &[u32],
    base: usize,
    wpt: usize,
    len: usize,
    lut: &[f32],
    g: usize,
    out: &mut [f32],
) {
    let (e, s) = (book.entries, book.subvectors);
    let mut codes = vec![0usize; s];
    for r in 0..len {
        offsets(&words[base + r * wpt..][..wpt], bits, e, &mut codes);
        for hh in 0..g {
            let l = &lut[hh * s * e..][..s * e];
            let mut sum = 0f32;
            for &c in &codes {
                // SAFETY: `c = j * E + code` with `j < S` and `code < 2^bits
                // = E` (masked), so `c < S * E = l.len()`.
                sum += unsafe { *l.get_unchecked(c) };
            }
            out[r * g + hh] = sum;
        }
    }
}

/// Adds the weights `p[r * g + h]` of `len` block rows to their centroids'
/// bins: `bins[(h * S + j) * E + code(r, j)] += p[r * g + h]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn accumulate(
    book: &VqBook,
    bits: u32,
    words: &[u32],
    base: usize,
    wpt: usize,
    len: usize,
    p: &[f32],
    g: usize,
    bins: &mut [f32],
) {
    let (e, s) = (book.entries, book.subvectors);
    let mut codes = vec![0usize; s];
    for r in 0..len {
        offsets(&words[base + r * wpt..][..wpt], bits, e, &mut codes);
        for hh in 0..g {
            let w = p[r * g + hh];
            let b = &mut bins[hh * s * e..][..s * e];
            for &c in &codes {
                // SAFETY: `c < S * E = b.len()`, as in `score`.
                unsafe { *b.get_unchecked_mut(c) += w };
            }
        }
    }
}

/// `acc[h][j*M..] += sum_c bins[h][j][c] * C_j[c]` for the `g` heads
/// (`acc` is `g x D`); empty bins cost one comparison.
pub(crate) fn expand(book: &VqBook, bins: &[f32], g: usize, acc: &mut [f32]) {
    let (m, e, s) = (book.dim, book.entries, book.subvectors);
    let d = m * s;
    for hh in 0..g {
        for j in 0..s {
            let b = &bins[(hh * s + j) * e..][..e];
            let out = &mut acc[hh * d + j * m..][..m];
            for (c, &w) in b.iter().enumerate() {
                if w != 0.0 {
                    for (o, x) in out.iter_mut().zip(book.centroid(j, c)) {
                        *o += w * x;
                    }
                }
            }
        }
    }
}
