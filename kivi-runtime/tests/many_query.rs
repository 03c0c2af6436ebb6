//! Attention for a causal block of new queries (`Backend::attend_block`):
//! the oracle's block is streaming bit for bit, the reference backend is the
//! oracle, the CPU backend matches it on every preset, head layout, odd
//! prefix length and block size, chunked prefill leaves the cache of one
//! `extend`, and bad input changes nothing.
//!
//! CPU tolerance, as for decode: max |cpu - ref| <= 1e-5 * max |ref| over
//! each query's output row.

mod common;

use common::{assert_block_rows, blocks, cases, filled, row_error, window_schemes};
use kivi_runtime::reference::{self, QueryView};
use kivi_runtime::*;
use kivi_spec::{presets, Heads, Scheme, Tensor};

const PASTS: [usize; 6] = [0, 1, 31, 33, 127, 1000];
const BLOCKS: [usize; 5] = [1, 2, 7, 33, 128];

/// Runs each backend on one batch holding every case (a fresh cache each)
/// and compares each query's row with the oracle on the raw tensors
/// (`reference::block_attention`).
fn check_against_oracle(s: &Scheme, attn: AttnParams, shapes: &[(usize, usize)], backends: &[&dyn Backend], seed: u64) {
    let cases = cases(s, shapes, seed);
    let want: Vec<Vec<f32>> = cases
        .iter()
        .map(|c| reference::block_attention(s, c.past, &c.q, &c.k, &c.v, attn).unwrap())
        .collect();
    for backend in backends {
        let (mut cache, seqs) = filled(s, &cases, 64);
        let got = backend
            .attend_block(&mut cache, &blocks(s, &cases, &seqs), attn)
            .unwrap();
        assert_block_rows(s, attn, backend.name(), &cache, &seqs, &cases, &want, &got, 1e-5);
    }
}

/// Every (prefix length, block size) pair.
fn grid() -> Vec<(usize, usize)> {
    PASTS
        .iter()
        .flat_map(|&p| BLOCKS.iter().map(move |&n| (p, n)))
        .collect()
}

/// Twelve of them: every prefix length with a small and a large block,
/// every block size at least twice.
fn some_of_grid() -> Vec<(usize, usize)> {
    vec![
        (0, 1),
        (0, 128),
        (1, 2),
        (1, 33),
        (31, 7),
        (31, 128),
        (33, 33),
        (33, 1),
        (127, 2),
        (127, 128),
        (1000, 7),
        (1000, 33),
    ]
}

fn layouts() -> [(Heads, u32); 4] {
    [
        (Heads::Mha(4), 64),
        (Heads::Gqa { q: 8, kv: 2 }, 64),
        (Heads::Gqa { q: 14, kv: 2 }, 96),
        (Heads::Mqa(4), 256),
    ]
}

#[test]
fn oracle_block_is_streaming_bit_for_bit() {
    let mut schemes: Vec<Scheme> = presets::all()
        .into_iter()
        .chain(window_schemes())
        .map(|s| s.with_shape(Heads::Gqa { q: 4, kv: 2 }, 32).unwrap())
        .collect();
    schemes.extend(
        presets::pipeline()
            .into_iter()
            .map(|s| s.with_shape(Heads::Mqa(2), 256).unwrap()),
    );
    for s in &schemes {
        let shape = s.shape().unwrap();
        let windowed = AttnParams {
            window: Some(9),
            ..AttnParams::of(s, shape)
        };
        for attn in [AttnParams::of(s, shape), windowed] {
            for (i, c) in cases(s, &[(0, 7), (1, 1), (31, 33), (125, 9), (150, 20)], 5)
                .iter()
                .enumerate()
            {
                let stream = reference::block_attention_streaming(s, c.past, &c.q, &c.k, &c.v, attn).unwrap();
                let block = reference::block_attention(s, c.past, &c.q, &c.k, &c.v, attn).unwrap();
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&stream),
                    bits(&block),
                    "{} case {i} window {:?}",
                    s.name,
                    attn.window
                );
            }
        }
    }
}

/// The reference backend on a cache is the oracle on raw tensors, bit for
/// bit, and is `append` + `decode` token by token, bit for bit.
#[test]
fn reference_backend_is_the_oracle_and_streaming() {
    let mut schemes: Vec<Scheme> = presets::all()
        .into_iter()
        .chain(window_schemes())
        .map(|s| s.with_shape(Heads::Gqa { q: 6, kv: 2 }, 32).unwrap())
        .collect();
    schemes.extend(
        presets::pipeline()
            .into_iter()
            .map(|s| s.with_shape(Heads::Mqa(2), 256).unwrap()),
    );
    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for s in &schemes {
        let shape = s.shape().unwrap();
        let (per, row) = (shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim);
        let attn = AttnParams::of(s, shape);
        let cases = cases(s, &[(0, 5), (33, 40), (140, 3), (200, 70)], 9);
        let (mut cache, seqs) = filled(s, &cases, 0);
        let got = ReferenceBackend
            .attend_block(&mut cache, &blocks(s, &cases, &seqs), attn)
            .unwrap();
        let (mut streamed, sseqs) = filled(s, &cases, 0);
        let mut at = 0;
        for (c, &seq) in cases.iter().zip(&sseqs) {
            let want = reference::block_attention(s, c.past, &c.q, &c.k, &c.v, attn).unwrap();
            assert_eq!(
                bits(&got[at * per..(at + c.n) * per]),
                bits(&want),
                "{} past {}",
                s.name,
                c.past
            );
            for i in 0..c.n {
                let t = c.past + i;
                streamed
                    .append(seq, &c.k[t * row..(t + 1) * row], &c.v[t * row..(t + 1) * row])
                    .unwrap();
                let one = ReferenceBackend
                    .decode(&streamed, &[seq], &c.q[i * per..(i + 1) * per], attn)
                    .unwrap();
                assert_eq!(bits(&one), bits(&want[i * per..(i + 1) * per]), "{} token {t}", s.name);
            }
            at += c.n;
        }
    }
}

/// kivi2 on the whole grid of prefix lengths and block sizes; the other
/// presets on twelve points of it.
#[test]
fn cpu_every_preset_every_layout_every_length() {
    for s in presets::all() {
        let shapes = if s.name == "kivi2" { grid() } else { some_of_grid() };
        for (l, (heads, d)) in layouts().into_iter().enumerate() {
            let s = s.with_shape(heads, d).unwrap();
            let attn = AttnParams::of(&s, s.shape().unwrap());
            check_against_oracle(&s, attn, &shapes, &[&CpuBackend::default()], 100 + l as u64);
        }
    }
}

#[test]
fn cpu_codec_pipelines() {
    for s in presets::pipeline() {
        for heads in [Heads::Mqa(4), Heads::Gqa { q: 4, kv: 2 }] {
            let s = s.with_shape(heads, 256).unwrap();
            let attn = AttnParams::of(&s, s.shape().unwrap());
            // Centering needs 128 tokens: blocks before, across and after.
            let shapes = [(0, 7), (1, 128), (31, 33), (100, 60), (127, 2), (1000, 33), (1000, 128)];
            check_against_oracle(&s, attn, &shapes, &[&CpuBackend::default()], 7);
        }
    }
}

#[test]
fn cpu_sinks_flushes_and_sliding_windows() {
    let shapes: Vec<(usize, usize)> = [0, 1, 2, 19, 31, 33, 127, 300]
        .iter()
        .flat_map(|&p| [1, 2, 7, 33, 128].map(|n| (p, n)))
        .collect();
    for s in window_schemes() {
        for (heads, d) in [(Heads::Gqa { q: 8, kv: 2 }, 64), (Heads::Gqa { q: 7, kv: 1 }, 96)] {
            let s = s.with_shape(heads, d).unwrap();
            let attn = AttnParams::of(&s, s.shape().unwrap());
            check_against_oracle(&s, attn, &shapes, &[&CpuBackend::default()], 21);
        }
    }
    // Presets with sliding windows smaller than the block, window 0 included
    // (a query that attends to nothing gives zeros).
    for s in [presets::kivi2(), presets::tok4(), presets::f16(), presets::swapped2()] {
        let s = s.with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
        for w in [0, 1, 5, 20, 100, 200] {
            let attn = AttnParams {
                window: Some(w),
                ..AttnParams::of(&s, s.shape().unwrap())
            };
            check_against_oracle(
                &s,
                attn,
                &[(0, 33), (127, 128), (300, 7), (1000, 128)],
                &[&CpuBackend::default()],
                3,
            );
        }
    }
}

/// Kernel parameters and instruction sets: splits of the common range, odd
/// tiles, one thread, AVX2 and the scalar loops.
#[test]
fn cpu_parameters_and_instruction_sets() {
    let d = CpuParams::default();
    let cpus = [
        CpuParams { splits: 1, ..d },
        CpuParams {
            splits: 3,
            tile_tokens: 16,
            ..d
        },
        CpuParams {
            tile_tokens: 7,
            threads: 1,
            ..d
        },
        CpuParams { avx512: false, ..d },
        CpuParams { scalar: true, ..d },
    ]
    .map(|p| CpuBackend::new(p).unwrap());
    let backends: Vec<&dyn Backend> = cpus.iter().map(|c| c as &dyn Backend).collect();
    let shapes = [(0, 33), (33, 7), (127, 128), (1000, 2), (1000, 33)];
    for s in [presets::kivi2(), presets::int8(), presets::f16(), presets::codec15()] {
        let s = s.with_shape(Heads::Gqa { q: 8, kv: 2 }, 256).unwrap();
        let attn = AttnParams::of(&s, s.shape().unwrap());
        check_against_oracle(&s, attn, &shapes, &backends, 13);
    }
}

/// Bits of both tensors' views and the memory reports.
fn state(cache: &PagedCache, seq: SeqId) -> (Vec<u32>, Vec<u32>, MemoryReport, MemoryReport, usize, Vec<u32>) {
    let bits = |t| cache.dequantize(seq, t).unwrap().iter().map(|x| x.to_bits()).collect();
    (
        bits(Tensor::Key),
        bits(Tensor::Value),
        cache.memory(),
        cache.sequence_memory(seq).unwrap(),
        cache.free_blocks(),
        cache.block_table(seq).unwrap().to_vec(),
    )
}

/// A prompt prefilled in chunks of any size leaves the cache one `extend`
/// leaves, and the same outputs: bit for bit from the reference backend,
/// within tolerance of it from the CPU.
#[test]
fn chunked_prefill_is_one_extend() {
    let total = 200;
    for s in [presets::kivi2(), presets::codec2(), window_schemes().remove(1)] {
        let s = s.with_shape(Heads::Gqa { q: 4, kv: 1 }, 256).unwrap();
        let shape = s.shape().unwrap();
        let (per, row) = (shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim);
        let attn = AttnParams::of(&s, shape);
        let c = &cases(&s, &[(0, total)], 17)[0];
        let mut whole = PagedCache::new(s.clone(), CacheConfig::for_tokens(total)).unwrap();
        let wseq = whole.add_sequence();
        whole.extend(wseq, &c.k, &c.v).unwrap();
        let want_state = state(&whole, wseq);
        let mut by_one: Option<Vec<f32>> = None;
        for chunk in [1, 2, 7, 64, 129, total] {
            for backend in [&ReferenceBackend as &dyn Backend, &CpuBackend::default()] {
                let mut cache = PagedCache::new(s.clone(), CacheConfig::for_tokens(total)).unwrap();
                let seq = cache.add_sequence();
                let mut out = Vec::new();
                for a in (0..total).step_by(chunk) {
                    let z = (a + chunk).min(total);
                    let blk = NewTokens {
                        seq,
                        q: &c.q[a * per..z * per],
                        k: &c.k[a * row..z * row],
                        v: &c.v[a * row..z * row],
                    };
                    out.extend(backend.attend_block(&mut cache, &[blk], attn).unwrap());
                }
                assert!(
                    state(&cache, seq) == want_state,
                    "{} chunk {chunk} {}",
                    s.name,
                    backend.name()
                );
                if backend.name() == "reference" {
                    // Chunk size 1 is streaming decode; every chunk size gives its bits.
                    let first = by_one.get_or_insert_with(|| out.clone());
                    assert!(
                        first == &out,
                        "{} chunk {chunk}: reference differs from chunk 1",
                        s.name
                    );
                } else {
                    let want = by_one.as_ref().unwrap();
                    for i in 0..total {
                        let (err, scale) = row_error(&want[i * per..(i + 1) * per], &out[i * per..(i + 1) * per]);
                        assert!(err <= 1e-5 * scale, "{} chunk {chunk} token {i}: {err:e}", s.name);
                    }
                }
            }
        }
    }
}

/// One call with several sequences (one of them twice) gives what separate
/// calls give, and what the oracle gives.
#[test]
fn batches_of_unequal_blocks() {
    let s = presets::kivi4().with_shape(Heads::Gqa { q: 8, kv: 2 }, 64).unwrap();
    let shape = s.shape().unwrap();
    let (per, row) = (shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim);
    let attn = AttnParams::of(&s, shape);
    let cases = cases(&s, &[(0, 50), (130, 3), (1000, 128), (5, 1)], 23);
    let cpu = CpuBackend::default();
    let (mut cache, seqs) = filled(&s, &cases, 0);
    let mut blks = blocks(&s, &cases, &seqs);
    // Case 0's 50 new tokens as two blocks of the same batch: 30, then 20.
    let (first, second) = (
        NewTokens {
            q: &cases[0].q[..30 * per],
            k: &cases[0].k[..30 * row],
            v: &cases[0].v[..30 * row],
            ..blks[0]
        },
        NewTokens {
            q: &cases[0].q[30 * per..],
            k: &cases[0].k[30 * row..],
            v: &cases[0].v[30 * row..],
            ..blks[0]
        },
    );
    blks[0] = first;
    blks.push(second);
    let got = cpu.attend_block(&mut cache, &blks, attn).unwrap();
    let (mut apart, aseqs) = filled(&s, &cases, 0);
    let mut at = 0;
    for (b, blk) in blks.iter().enumerate() {
        let seq = aseqs[if b == 4 { 0 } else { b }];
        let n = blk.k.len() / row;
        let alone = cpu
            .attend_block(&mut apart, &[NewTokens { seq, ..*blk }], attn)
            .unwrap();
        let c = &cases[if b == 4 { 0 } else { b }];
        let (past, i0) = if b == 4 { (30, 30) } else { (c.past, 0) };
        let want = reference::block_attention(
            &s,
            past,
            &c.q[i0 * per..(i0 + n) * per],
            &c.k[..(past + n) * row],
            &c.v[..(past + n) * row],
            attn,
        )
        .unwrap();
        for i in 0..n {
            let g = &got[(at + i) * per..(at + i + 1) * per];
            assert_eq!(
                g,
                &alone[i * per..(i + 1) * per],
                "block {b} query {i}: batch and alone differ"
            );
            let (err, scale) = row_error(&want[i * per..(i + 1) * per], g);
            assert!(err <= 1e-5 * scale, "block {b} query {i}: {err:e}");
        }
        at += n;
    }
    for (&a, &b) in seqs.iter().zip(&aseqs) {
        assert!(state(&cache, a) == state(&apart, b));
    }
    // No blocks, and a block of no tokens: nothing to return, nothing changes.
    let before = state(&cache, seqs[1]);
    assert!(cpu.attend_block(&mut cache, &[], attn).unwrap().is_empty());
    let empty = NewTokens {
        seq: seqs[1],
        q: &[],
        k: &[],
        v: &[],
    };
    for backend in [&ReferenceBackend as &dyn Backend, &cpu] {
        assert!(backend.attend_block(&mut cache, &[empty], attn).unwrap().is_empty());
    }
    assert!(state(&cache, seqs[1]) == before);
}

/// Every bad input is refused, the cache left as it was: checked by the
/// bits and memory of every sequence and by appending afterwards, which
/// must give what a cache that never saw the call gives.
#[test]
fn bad_input_changes_nothing() {
    // 1-bit codes with f16 scales and bf16 activations: a finite value can
    // be out of range (beyond ±32752).
    let s = window_schemes()
        .remove(1)
        .with_shape(Heads::Gqa { q: 4, kv: 2 }, 64)
        .unwrap();
    let shape = s.shape().unwrap();
    let (per, row) = (shape.q_heads * shape.head_dim, shape.kv_heads * shape.head_dim);
    let attn = AttnParams::of(&s, shape);
    let cases = cases(&s, &[(150, 40), (31, 128)], 31);
    let mut nan_q = cases[0].q.clone();
    nan_q[3 * per + 5] = f32::NAN;
    let mut inf_k = cases[1].k.clone();
    inf_k[(31 + 100) * row + 1] = f32::INFINITY;
    let mut huge_v = cases[1].v.clone();
    huge_v[(31 + 2) * row] = 1e6;
    let sim = kivi_runtime::device::DeviceBackend::new(kivi_runtime::device::SimDevice::shared());
    for backend in [&ReferenceBackend as &dyn Backend, &CpuBackend::default(), &sim] {
        let (mut cache, seqs) = filled(&s, &cases, 0);
        let good = blocks(&s, &cases, &seqs);
        let (mut fresh, _) = filled(&s, &cases, 0);
        let before: Vec<_> = seqs.iter().map(|&q| state(&cache, q)).collect();
        let shorter = &good[0].q[..per * 39];
        let k_only = &good[0].k[..row * 39];
        // Far more tokens than the pool has room for.
        let overflow_k = vec![0.5f32; row * 20_000];
        let overflow_q = vec![0.5f32; per * 20_000];
        let bad: Vec<(&str, Vec<NewTokens>)> = vec![
            ("short q", vec![NewTokens { q: shorter, ..good[0] }]),
            ("k, v differ", vec![NewTokens { k: k_only, ..good[0] }]),
            (
                "ragged q",
                vec![NewTokens {
                    q: &good[0].q[1..],
                    ..good[0]
                }],
            ),
            ("nan query", vec![good[1], NewTokens { q: &nan_q, ..good[0] }]),
            (
                "inf key",
                vec![
                    good[0],
                    NewTokens {
                        k: &inf_k[31 * row..],
                        ..good[1]
                    },
                ],
            ),
            (
                "out of range value",
                vec![
                    good[0],
                    NewTokens {
                        v: &huge_v[31 * row..],
                        ..good[1]
                    },
                ],
            ),
            ("unknown sequence", vec![good[0], NewTokens { seq: 99, ..good[1] }]),
            (
                "pool overflow",
                vec![
                    good[0],
                    good[1],
                    NewTokens {
                        q: &overflow_q,
                        k: &overflow_k,
                        v: &overflow_k,
                        ..good[1]
                    },
                ],
            ),
        ];
        for (what, blks) in &bad {
            let err = backend.attend_block(&mut cache, blks, attn);
            assert!(err.is_err(), "{what} ({}) was accepted", backend.name());
            let err = err.unwrap_err();
            // The error names the block; the right cause inside (the device
            // backend appends on the host first: the same errors).
            let Error::InSequence { seq, source } = &err else {
                panic!("{what}: {err}")
            };
            assert_eq!(*seq, blks.len() - 1, "{what}: {err}");
            let ok = match *what {
                "nan query" | "inf key" => matches!(**source, Error::NonFinite { .. }),
                "out of range value" => matches!(**source, Error::OutOfRange { .. }),
                "unknown sequence" => matches!(**source, Error::UnknownSequence(99)),
                "pool overflow" => matches!(**source, Error::OutOfBlocks { .. }),
                _ => matches!(**source, Error::Shape { .. }),
            };
            assert!(ok, "{what}: {err}");
            let after: Vec<_> = seqs.iter().map(|&q| state(&cache, q)).collect();
            assert!(before == after, "{what} ({}) changed the cache", backend.name());
        }
        // Afterwards the cache behaves like one that never saw those calls.
        for (c, &seq) in cases.iter().zip(&seqs) {
            cache.extend(seq, &c.k[c.past * row..], &c.v[c.past * row..]).unwrap();
            fresh.extend(seq, &c.k[c.past * row..], &c.v[c.past * row..]).unwrap();
            assert!(state(&cache, seq) == state(&fresh, seq), "{}", backend.name());
        }
    }
}

/// The boundaries a query reads by: its window and, per tensor, where its
/// stored tokens end — for kivi2 (R = 128, key groups of 32).
#[test]
fn query_view_boundaries() {
    let s = presets::kivi2().with_shape(Heads::Mha(1), 32).unwrap();
    let attn = AttnParams {
        window: Some(100),
        ..AttnParams::of(&s, s.shape().unwrap())
    };
    let v = |t| QueryView::at(&s, attn, t);
    assert_eq!(
        v(1),
        QueryView {
            start: 0,
            end: 1,
            stored: [0, 0]
        }
    );
    assert_eq!(
        v(128),
        QueryView {
            start: 28,
            end: 128,
            stored: [0, 0]
        }
    );
    assert_eq!(
        v(129),
        QueryView {
            start: 29,
            end: 129,
            stored: [0, 1]
        }
    );
    assert_eq!(
        v(159),
        QueryView {
            start: 59,
            end: 159,
            stored: [0, 31]
        }
    );
    assert_eq!(
        v(160),
        QueryView {
            start: 60,
            end: 160,
            stored: [32, 32]
        }
    );
}
