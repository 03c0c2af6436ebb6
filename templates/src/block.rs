//! The many-query (block) kernel: attention for a causal block of new
//! queries over the cache (`cuda/kivi_block.cuh`). One source per scheme
//! and layout, with a launch shape derived from head_dim and the GQA group
//! in [`BlockShape::of`]; it has no tuning space yet.

use crate::generate::{cfg_prelude, levels_table, scheme_tag, tensor_cfg};
use crate::{EntryLaunch, GenError, Generated, Kernel, LaunchInfo, Param, ParamTy, Variant};
use kivi_spec::layout::BlockLayout;
use kivi_spec::{Scheme, Tensor};
use std::fmt::Write;

/// Static shared memory the block kernel may use, in floats (48 KiB less a
/// margin for the per-row softmax state).
const SHARED_FLOATS: usize = 12_000;

/// The launch shape of the block kernel: `threads` per block, each block
/// serving `queries` consecutive new tokens times `heads` query heads of
/// one KV head's group over tiles of `tile` cached tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockShape {
    /// Threads per block.
    pub threads: u32,
    /// New tokens (queries) per block: `QT`.
    pub queries: u32,
    /// Query heads per block, a divisor of the GQA group: `HB`.
    pub heads: u32,
    /// Cached tokens per tile in shared memory: `KT`.
    pub tile: u32,
}

impl BlockShape {
    /// Up to 16 query rows per block (queries x heads): the largest divisor
    /// of the GQA group up to 16 as heads, as many queries as fill 16 rows;
    /// then the largest token tile (at most 32) whose decoded keys and values
    /// fit static shared memory beside the query rows. Rows are halved
    /// until a tile of at least one token fits.
    pub fn of(group: usize, head_dim: usize) -> BlockShape {
        let heads = (1..=group.min(16))
            .rev()
            .find(|h| group.is_multiple_of(*h))
            .unwrap_or(1);
        let mut queries = (16 / heads).max(1);
        let mut heads = heads;
        loop {
            let rows = queries * heads;
            let fixed = rows * head_dim + 3 * rows;
            let tile = SHARED_FLOATS.saturating_sub(fixed) / (2 * head_dim + rows);
            if tile >= 1 || rows == 1 {
                return BlockShape {
                    threads: 128,
                    queries: queries as u32,
                    heads: heads as u32,
                    tile: tile.clamp(1, 32) as u32,
                };
            }
            if queries > 1 {
                queries /= 2;
            } else {
                heads = (1..heads).rev().find(|h| group.is_multiple_of(*h)).unwrap_or(1);
            }
        }
    }

    /// Query rows per block.
    pub fn rows(&self) -> usize {
        (self.queries * self.heads) as usize
    }

    /// `t128.q16.h1.k32`: threads, queries, heads, token tile.
    pub fn name(&self) -> String {
        format!("t{}.q{}.h{}.k{}", self.threads, self.queries, self.heads, self.tile)
    }

    /// Static shared memory, bytes: the query rows, a tile of keys and of
    /// values, the tile's scores and three floats of softmax state per row.
    pub fn shared_bytes(&self, head_dim: usize) -> usize {
        let (rows, tile) = (self.rows(), self.tile as usize);
        4 * (rows * head_dim + 2 * tile * head_dim + rows * tile + 3 * rows)
    }

    /// Blocks of the launch for a batch whose largest block has `max_n` new
    /// tokens: (query tiles, KV heads x head chunks, batch).
    pub fn grid(&self, kv_heads: usize, group: usize, max_n: usize, batch: usize) -> [u32; 3] {
        let chunks = group / self.heads as usize;
        [
            max_n.div_ceil(self.queries as usize).max(1) as u32,
            (kv_heads * chunks) as u32,
            batch as u32,
        ]
    }
}

/// The parameters of `kivi_block`, in order.
pub(crate) fn block_params() -> Vec<Param> {
    use ParamTy::*;
    let p = |name, ty| Param { name, ty };
    vec![
        p("pool", PtrU32),
        p("tables", PtrU32),
        p("table_stride", I32),
        p("past_lens", PtrI32),
        p("counts", PtrI32),
        p("q", PtrAct),
        p("max_n", I32),
        p("sinks_k", PtrAct),
        p("sinks_v", PtrAct),
        p("means_k", PtrAct),
        p("means_v", PtrAct),
        p("tail_k", PtrAct),
        p("tail_v", PtrAct),
        p("tail_stride", I32),
        p("sm_scale", F32),
        p("window", I32),
        p("out", PtrF32Mut),
    ]
}

pub(crate) fn generate_block(s: &Scheme, l: &BlockLayout, cb: &crate::Codebooks) -> Result<Generated, GenError> {
    // The block kernel scores stored keys with the f32 query: refused for
    // an integer-domain query rather than generated with other numbers
    // (backends run such blocks as decodes, `Backend::attend_block`).
    if s.query.is_some() {
        return Err(GenError::Unsupported {
            what: "the many-query kernel (kivi_block) with `query: int8(...)`; decode it per query".into(),
            field: kivi_spec::Field::Query,
        });
    }
    let shape = l.shape;
    let d = shape.head_dim;
    let group = shape.group_size();
    let bs = BlockShape::of(group, d);
    if bs.shared_bytes(d) > 48 * 1024 {
        return Err(GenError::InvalidVariant {
            variant: bs.name(),
            why: format!("head_dim {d} leaves no room for a tile of tokens in 48 KiB of shared memory"),
        });
    }
    let mut tag = scheme_tag(s, Some(l.block_tokens));
    if let Some(h) = cb.tag() {
        // as `generate::generate` names a calibrated source
        let _ = write!(tag, ".cb{:08x}", h as u32);
    }
    let name = format!("{tag}/block/{}", bs.name());
    let (act, _) = crate::generate::act_types(s.dtype);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "// Generated by kivi-templates {} — do not edit",
        env!("CARGO_PKG_VERSION")
    );
    crate::generate::source_header(&mut o, name.as_str(), s);
    for (file, text) in [
        ("kivi_common.cuh", crate::TEMPLATES[0].1),
        ("kivi_block.cuh", crate::BLOCK_TEMPLATE),
    ] {
        let _ = writeln!(o, "// ===== {file} =====");
        o.push_str(text);
        o.push('\n');
    }
    let _ = writeln!(o, "// ===== generated configuration =====");
    // Lloyd–Max tables, or the calibrated `nuq` ones (`check_calibrated`
    // has seen them): the kernel decodes rows with `T::level` either way.
    levels_table(&mut o, "KeyCfg", s, Tensor::Key, cb);
    levels_table(&mut o, "ValueCfg", s, Tensor::Value, cb);
    // The per-tensor structs of the other kernels (load width 1: the block
    // kernel decodes channel by channel).
    let v = Variant {
        threads: bs.threads,
        tile_tokens: bs.tile,
        splits: 1,
        heads_per_block: bs.heads,
        load_width: 1,
        unroll: 1,
    };
    tensor_cfg(&mut o, "KeyCfg", Tensor::Key, s, l, &v, Kernel::Prefill);
    tensor_cfg(&mut o, "ValueCfg", Tensor::Value, s, l, &v, Kernel::Prefill);
    cfg_prelude(&mut o, s, l);
    let _ = writeln!(o, "  // launch shape {}", bs.name());
    let _ = writeln!(o, "  static constexpr int THREADS = {};", bs.threads);
    let _ = writeln!(
        o,
        "  static constexpr int QT = {};      // new tokens per block",
        bs.queries
    );
    let _ = writeln!(
        o,
        "  static constexpr int HB = {};      // query heads per block",
        bs.heads
    );
    let _ = writeln!(
        o,
        "  static constexpr int KT = {};      // cached tokens per tile",
        bs.tile
    );
    let _ = writeln!(o, "  static constexpr int WIDTH = 1;");
    let _ = writeln!(o, "  typedef KeyCfg K;\n  typedef ValueCfg V;\n}};\n");
    let params = block_params();
    let _ = writeln!(
        o,
        "extern \"C\" __global__ void __launch_bounds__({}) kivi_block(",
        bs.threads
    );
    for (i, prm) in params.iter().enumerate() {
        let sep = if i + 1 == params.len() { ")" } else { "," };
        let _ = writeln!(o, "    {} {}{sep}", crate::generate::c_type(prm.ty, act), prm.name);
    }
    let args: Vec<&str> = params.iter().map(|p| p.name).collect();
    let _ = writeln!(o, "{{\n  kivi::block_kernel<Cfg>({});\n}}\n", args.join(", "));
    let hash = kivi_spec::fnv1a64(o.as_bytes());
    Ok(Generated {
        name,
        source: o,
        hash,
        entry_points: vec!["kivi_block".into()],
        launch: LaunchInfo {
            entries: vec![EntryLaunch {
                entry: "kivi_block".into(),
                block: [bs.threads, 1, 1],
                // x (query tiles) depends on the block size: BlockShape::grid.
                grid_xy: [1, (shape.kv_heads * group / bs.heads as usize) as u32],
                shared_bytes: bs.shared_bytes(d) as u32,
                params,
            }],
            splits: 1,
            q_heads: shape.q_heads as u32,
            head_dim: d as u32,
        },
        block_tokens: l.block_tokens,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_fit_shared_memory() {
        for group in [1, 2, 3, 4, 7, 8, 16, 32, 64] {
            for d in [8, 32, 64, 96, 128, 256, 512, 1024] {
                let b = BlockShape::of(group, d);
                assert!(b.shared_bytes(d) <= 48 * 1024, "{group} {d} {b:?}");
                assert!(group.is_multiple_of(b.heads as usize) && b.tile >= 1 && b.rows() <= 16);
            }
        }
        assert_eq!(BlockShape::of(1, 128).name(), "t128.q16.h1.k32");
        assert_eq!(BlockShape::of(4, 256).rows(), 16);
    }
}
