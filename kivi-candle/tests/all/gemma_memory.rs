//! KV memory of a Gemma-3-270M-shaped model at 32k context, before and
//! after sliding-window eviction, from the caches' own exact accounting
//! (docs/performance.md quotes the table this prints). The model: 18
//! layers, 4 query heads on 1 KV head (MQA), head_dim 256; 15 local layers
//! attend to the last 512 tokens, 3 global layers to everything.
//!
//! Every local layer holds the same bytes, and so does every global one,
//! so one of each is filled (a 32k-token prompt in 512-token chunks, as a
//! chunked prefill) and the model's total is 15 local + 3 global. Before
//! eviction a local layer holds what a global one does.
//!
//! `cargo test -p kivi-candle --test all gemma_memory:: -- --nocapture`
//! prints it.

use candle_core::{Device, Tensor};
use kivi_candle::{KiviKvCache, ModelShape};
use kivi_spec::presets;

const CONTEXT: usize = 32 * 1024;
const CHUNK: usize = 512;
const WINDOW: usize = 512;
const LOCAL: usize = 15;
const GLOBAL: usize = 3;

#[test]
fn gemma_shaped_kv_memory_at_32k_drops_below_a_quarter_with_eviction() {
    let shape = ModelShape {
        layers: 2,
        q_heads: 4,
        kv_heads: 1,
        head_dim: 256,
    };
    let mut rng = fastrand::Rng::with_seed(1);
    let mut lines = vec![format!(
        "{:<8} {:>14} {:>14} {:>14} {:>14} {:>7}",
        "scheme", "local layer", "local evicting", "model before", "model after", "after"
    )];
    for scheme in [presets::kivi2(), presets::kivi4(), presets::f16()] {
        // Layer 0 local (window 512, evicting), layer 1 global.
        let mut c = KiviKvCache::new(&scheme, shape, CONTEXT).unwrap();
        c.set_window(0, Some(WINDOW)).unwrap();
        let mut at = 0;
        while at < CONTEXT {
            let rows: Vec<f32> = (0..CHUNK * 256).map(|_| rng.f32() * 4.0 - 2.0).collect();
            let t = Tensor::from_vec(rows, (1, 1, CHUNK, 256), &Device::Cpu).unwrap();
            for l in 0..2 {
                c.extend(l, &t, &t).unwrap();
            }
            at += CHUNK;
        }
        assert_eq!(c.current_seq_len(), CONTEXT);
        let local = c.layer_memory(0).unwrap().total;
        let global = c.layer_memory(1).unwrap().total;
        let before = (LOCAL + GLOBAL) * global;
        let after = LOCAL * local + GLOBAL * global;
        lines.push(format!(
            "{:<8} {:>14} {:>14} {:>14} {:>14} {:>6.1}%",
            scheme.name,
            global,
            local,
            before,
            after,
            100.0 * after as f64 / before as f64
        ));
        assert!(4 * after <= before, "{}: {after} of {before}", scheme.name);
        // The local layer holds its window and at most two partial blocks.
        let blocks = c.layer_memory(0).unwrap().blocks_in_use;
        let bt = kivi_spec::layout::default_block_tokens(c.scheme(0).unwrap());
        assert!(blocks <= WINDOW / bt + 2, "{}: {blocks} blocks of {bt}", scheme.name);
    }
    println!("{}", lines.join("\n"));
}
