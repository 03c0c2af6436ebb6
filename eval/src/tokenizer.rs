//! The model's tokenizer, rebuilt from the vocabulary stored in the GGUF
//! (`tokenizer.ggml.model = "llama"`: SentencePiece pieces with scores,
//! merged greedily by score, with byte fallback).
//!
//! Encoding a text:
//! 1. split out special pieces — user-defined ones (runs of newlines or
//!    spaces, `[multimodal]`, ...) always, control ones (`<start_of_turn>`,
//!    `<bos>`, ...) only when asked — leftmost, longest first;
//! 2. in the rest, spaces become `▁` (U+2581); no space is prepended, as the
//!    file says (`add_space_prefix = false`);
//! 3. start from single characters and repeatedly merge the adjacent pair
//!    whose concatenation is the highest-scoring piece in the vocabulary
//!    (ties: leftmost), until no pair is a piece;
//! 4. a character that is not a piece becomes its UTF-8 bytes (`<0xAB>`).
//!
//! Decoding maps pieces back (`▁` to a space, byte pieces to bytes) and skips
//! control tokens.

use crate::error::{Error, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use std::collections::{BinaryHeap, HashMap};

/// SentencePiece token types as stored in `tokenizer.ggml.token_type`.
mod kind {
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const BYTE: i32 = 6;
}

/// A tokenizer for one GGUF vocabulary.
pub struct Tokenizer {
    pieces: Vec<String>,
    scores: Vec<f32>,
    types: Vec<i32>,
    index: HashMap<String, u32>,
    /// `byte_ids[b]` is the id of piece `<0xBB>`.
    byte_ids: [u32; 256],
    /// Special pieces grouped by first byte, longest first.
    specials: HashMap<u8, Vec<(String, u32, bool)>>,
    bos: u32,
    eos: u32,
    add_bos: bool,
}

fn meta<'a>(c: &'a Content, key: &str) -> Result<&'a Value> {
    c.metadata
        .get(key)
        .ok_or_else(|| Error::Tokenizer(format!("the model file has no `{key}`")))
}

fn bad(key: &str, e: candle_core::Error) -> Error {
    Error::Tokenizer(format!("`{key}` has an unexpected type: {e}"))
}

impl Tokenizer {
    /// Builds the tokenizer from a GGUF file's metadata.
    pub fn from_gguf(c: &Content) -> Result<Tokenizer> {
        let model = meta(c, "tokenizer.ggml.model")?
            .to_string()
            .map_err(|e| bad("tokenizer.ggml.model", e))?;
        if model != "llama" {
            return Err(Error::Tokenizer(format!(
                "tokenizer model `{model}` is not supported (only SentencePiece, `llama`)"
            )));
        }
        let list = |key: &str| -> Result<&Vec<Value>> { meta(c, key)?.to_vec().map_err(|e| bad(key, e)) };
        let pieces: Vec<String> = list("tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.to_string().cloned().map_err(|e| bad("tokenizer.ggml.tokens", e)))
            .collect::<Result<_>>()?;
        let scores: Vec<f32> = list("tokenizer.ggml.scores")?
            .iter()
            .map(|v| v.to_f32().map_err(|e| bad("tokenizer.ggml.scores", e)))
            .collect::<Result<_>>()?;
        let types: Vec<i32> = list("tokenizer.ggml.token_type")?
            .iter()
            .map(|v| v.to_i32().map_err(|e| bad("tokenizer.ggml.token_type", e)))
            .collect::<Result<_>>()?;
        if scores.len() != pieces.len() || types.len() != pieces.len() {
            return Err(Error::Tokenizer(format!(
                "{} pieces but {} scores and {} token types",
                pieces.len(),
                scores.len(),
                types.len()
            )));
        }
        let id = |key: &str| -> Result<u32> { meta(c, key)?.to_u32().map_err(|e| bad(key, e)) };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let add_bos = c
            .metadata
            .get("tokenizer.ggml.add_bos_token")
            .map_or(Ok(true), |v| v.to_bool())
            .map_err(|e| bad("tokenizer.ggml.add_bos_token", e))?;
        if let Some(v) = c.metadata.get("tokenizer.ggml.add_space_prefix") {
            if v.to_bool().map_err(|e| bad("tokenizer.ggml.add_space_prefix", e))? {
                return Err(Error::Tokenizer("add_space_prefix = true is not supported".into()));
            }
        }
        Tokenizer::new(pieces, scores, types, bos, eos, add_bos)
    }

    /// Builds a tokenizer from its parts (tests build small ones by hand).
    pub fn new(
        pieces: Vec<String>,
        scores: Vec<f32>,
        types: Vec<i32>,
        bos: u32,
        eos: u32,
        add_bos: bool,
    ) -> Result<Tokenizer> {
        let n = pieces.len();
        if bos as usize >= n || eos as usize >= n {
            return Err(Error::Tokenizer(format!(
                "bos {bos} or eos {eos} is outside the vocabulary of {n}"
            )));
        }
        let mut index = HashMap::with_capacity(n);
        let mut byte_ids = [u32::MAX; 256];
        let mut specials: HashMap<u8, Vec<(String, u32, bool)>> = HashMap::new();
        for (i, p) in pieces.iter().enumerate() {
            let i = i as u32;
            match types[i as usize] {
                kind::BYTE => {
                    let b = p
                        .strip_prefix("<0x")
                        .and_then(|s| s.strip_suffix('>'))
                        .and_then(|h| u8::from_str_radix(h, 16).ok())
                        .ok_or_else(|| Error::Tokenizer(format!("byte piece {i} is `{p}`, not `<0xHH>`")))?;
                    byte_ids[b as usize] = i;
                }
                t @ (kind::CONTROL | kind::USER_DEFINED) if !p.is_empty() => {
                    specials
                        .entry(p.as_bytes()[0])
                        .or_default()
                        .push((p.clone(), i, t == kind::CONTROL));
                }
                _ => {}
            }
            // The first piece with a given text wins, as in SentencePiece.
            index.entry(p.clone()).or_insert(i);
        }
        if let Some(b) = byte_ids.iter().position(|&x| x == u32::MAX) {
            return Err(Error::Tokenizer(format!(
                "the vocabulary has no byte piece <0x{b:02X}>"
            )));
        }
        for v in specials.values_mut() {
            v.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        }
        Ok(Tokenizer {
            pieces,
            scores,
            types,
            index,
            byte_ids,
            specials,
            bos,
            eos,
            add_bos,
        })
    }

    /// Number of pieces.
    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }
    /// Beginning-of-sequence id.
    pub fn bos(&self) -> u32 {
        self.bos
    }
    /// End-of-sequence id.
    pub fn eos(&self) -> u32 {
        self.eos
    }
    /// The piece text of an id, if it exists.
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(|s| s.as_str())
    }
    /// The id of an exact piece text.
    pub fn id_of(&self, piece: &str) -> Option<u32> {
        self.index.get(piece).copied()
    }

    /// Encodes `text`, with `<bos>` first when the model asks for it.
    /// `parse_special`: recognise control pieces such as `<start_of_turn>`
    /// written in the text (otherwise they are encoded as plain text).
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if self.add_bos {
            out.push(self.bos);
        }
        let bytes = text.as_bytes();
        let mut start = 0; // start of the pending plain segment
        let mut i = 0;
        while i < bytes.len() {
            if !text.is_char_boundary(i) {
                i += 1;
                continue;
            }
            let hit = self.specials.get(&bytes[i]).and_then(|cands| {
                cands
                    .iter()
                    .find(|(p, _, control)| (parse_special || !control) && bytes[i..].starts_with(p.as_bytes()))
            });
            match hit {
                Some((p, id, _)) => {
                    self.encode_plain(&text[start..i], &mut out);
                    out.push(*id);
                    i += p.len();
                    start = i;
                }
                None => i += 1,
            }
        }
        self.encode_plain(&text[start..], &mut out);
        out
    }

    /// Score-greedy merging of one plain segment (no special pieces inside).
    fn encode_plain(&self, text: &str, out: &mut Vec<u32>) {
        if text.is_empty() {
            return;
        }
        let text = text.replace(' ', "\u{2581}");
        // Symbols: byte ranges of `text`, linked in order; merged-away
        // symbols get length 0.
        struct Sym {
            start: usize,
            len: usize,
            prev: Option<usize>,
            next: Option<usize>,
        }
        let mut syms: Vec<Sym> = Vec::new();
        for (k, (s, ch)) in text.char_indices().enumerate() {
            syms.push(Sym {
                start: s,
                len: ch.len_utf8(),
                prev: k.checked_sub(1),
                next: None,
            });
            if k > 0 {
                syms[k - 1].next = Some(k);
            }
        }
        // Max-heap on (score, then leftmost); `len` detects stale entries.
        #[derive(PartialEq)]
        struct Cand {
            score: f32,
            left: usize,
            right: usize,
            len: usize,
        }
        impl Eq for Cand {}
        impl PartialOrd for Cand {
            fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(o))
            }
        }
        impl Ord for Cand {
            fn cmp(&self, o: &Self) -> std::cmp::Ordering {
                self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
            }
        }
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<Cand>, syms: &[Sym], l: usize, r: usize| {
            let s = syms[l].start;
            let len = syms[l].len + syms[r].len;
            if let Some(&id) = self.index.get(&text[s..s + len]) {
                heap.push(Cand {
                    score: self.scores[id as usize],
                    left: l,
                    right: r,
                    len,
                });
            }
        };
        for k in 1..syms.len() {
            push(&mut heap, &syms, k - 1, k);
        }
        while let Some(c) = heap.pop() {
            let (l, r) = (c.left, c.right);
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].next != Some(r) || syms[l].len + syms[r].len != c.len {
                continue; // one side changed since this pair was queued
            }
            syms[l].len = c.len;
            syms[r].len = 0;
            syms[l].next = syms[r].next;
            if let Some(n) = syms[r].next {
                syms[n].prev = Some(l);
            }
            if let Some(p) = syms[l].prev {
                push(&mut heap, &syms, p, l);
            }
            if let Some(n) = syms[l].next {
                push(&mut heap, &syms, l, n);
            }
        }
        let mut k = Some(0);
        while let Some(j) = k {
            let s = &syms[j];
            let piece = &text[s.start..s.start + s.len];
            match self.index.get(piece) {
                Some(&id) => out.push(id),
                None => out.extend(piece.bytes().map(|b| self.byte_ids[b as usize])),
            }
            k = s.next;
        }
    }

    /// Decodes ids to text. Control tokens (`<bos>`, `<eos>`, ...) are
    /// skipped; ids outside the vocabulary are an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let p = self.pieces.get(id as usize).ok_or_else(|| {
                Error::Tokenizer(format!(
                    "token id {id} is outside the vocabulary of {}",
                    self.pieces.len()
                ))
            })?;
            match self.types[id as usize] {
                kind::CONTROL => {}
                kind::BYTE => bytes.push(self.byte_ids.iter().position(|&b| b == id).unwrap_or(0) as u8),
                _ => bytes.extend(p.replace('\u{2581}', " ").as_bytes()),
            }
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny vocabulary: all 256 bytes, a few pieces with scores.
    fn tiny() -> Tokenizer {
        let mut pieces = vec![
            "<pad>".to_string(),
            "<eos>".into(),
            "<bos>".into(),
            "<start_of_turn>".into(),
            "\n".into(),
        ];
        let mut types = vec![3, 3, 3, 3, 4];
        for b in 0..256 {
            pieces.push(format!("<0x{b:02X}>"));
            types.push(6);
        }
        for p in ["a", "b", "c", "ab", "bc", "abc", "\u{2581}", "\u{2581}a"] {
            pieces.push(p.into());
            types.push(1);
        }
        let n = pieces.len();
        let mut scores = vec![0.0; n];
        // "bc" beats "ab": "abc" merges as a + bc, then abc.
        scores[n - 5] = -10.0; // ab
        scores[n - 4] = -1.0; // bc
        scores[n - 3] = -20.0; // abc
        Tokenizer::new(pieces, scores, types, 2, 1, true).unwrap()
    }

    #[test]
    fn merges_by_score_and_falls_back_to_bytes() {
        let t = tiny();
        let ids = t.encode("abc", false);
        assert_eq!(ids[0], 2);
        assert_eq!(t.piece(ids[1]), Some("abc"));
        assert_eq!(ids.len(), 2);
        // 'é' is not a piece: two byte tokens.
        let ids = t.encode("é", false);
        assert_eq!(ids[1..], [t.id_of("<0xC3>").unwrap(), t.id_of("<0xA9>").unwrap()]);
        assert_eq!(t.decode(&ids).unwrap(), "é");
    }

    #[test]
    fn specials_only_when_asked_for_control() {
        let t = tiny();
        let with = t.encode("<start_of_turn>a\nb", true);
        assert_eq!(with[1], 3);
        assert!(with.contains(&4), "user-defined `\\n` is always split out");
        let without = t.encode("<start_of_turn>", false);
        assert!(!without.contains(&3));
        assert_eq!(t.decode(&without).unwrap(), "<start_of_turn>");
    }

    #[test]
    fn round_trip_with_spaces() {
        let t = tiny();
        for s in ["a b  c", " ab", "xyz\n\nabc é", ""] {
            assert_eq!(t.decode(&t.encode(s, false)).unwrap(), s);
        }
    }
}
