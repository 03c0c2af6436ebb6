//! The MLA decode kernel (`heads: mla(...)`): `cuda/kivi_mla_decode.cuh`
//! instantiated for one scheme and one [`MlaVariant`].
//!
//! The generated source has one entry point, `kivi_mla_decode`, launched on
//! a grid of `[1, 1, batch]` blocks of `threads` threads: one block per
//! sequence serves all query heads (the latent is shared, as in MQA).

use crate::generate::{act_types, c_type, source_header};
use crate::{EntryLaunch, GenError, Generated, LaunchInfo, Param, ParamTy};
use kivi_spec::layout::{codes_per_word, TensorLayout};
use kivi_spec::mla::mla_block_tokens;
use kivi_spec::{Axis, Codec, Field, Levels, MlaLayout, ScaleDtype, Scheme, Tensor};
use std::fmt::Write;

/// The template text.
pub const MLA_TEMPLATE: &str = include_str!("../cuda/kivi_mla_decode.cuh");

/// The entry point's name.
pub const MLA_ENTRY: &str = "kivi_mla_decode";

/// A launch shape of the MLA decode kernel: threads per block (a multiple
/// of 32) and tokens decoded into shared memory per tile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MlaVariant {
    pub threads: u32,
    pub tile: u32,
}

impl MlaVariant {
    /// Readable name, e.g. `t128.tile4`.
    pub fn name(&self) -> String {
        format!("t{}.tile{}", self.threads, self.tile)
    }
}

/// Static shared memory of a variant, bytes.
pub fn mla_shared_bytes(s: &Scheme, v: &MlaVariant) -> Option<usize> {
    let m = s.mla()?;
    let (l, r, hq, t) = (m.latent as usize, m.rope_dim as usize, m.q as usize, v.tile as usize);
    Some(4 * (t * l + t * r + hq * t + 3 * hq))
}

/// Every variant that fits (48 KiB of static shared memory, at most 64
/// output channels per thread), the canonical one (`t128.tile4`) first.
pub fn mla_variants(s: &Scheme) -> Vec<MlaVariant> {
    let Some(m) = s.mla() else { return Vec::new() };
    let mut out = vec![MlaVariant { threads: 128, tile: 4 }];
    for threads in [64u32, 128, 256] {
        for tile in [1u32, 4, 8] {
            let v = MlaVariant { threads, tile };
            let cpt = (m.latent as usize).div_ceil(threads as usize);
            if !out.contains(&v) && mla_shared_bytes(s, &v).is_some_and(|b| b <= 48 * 1024) && cpt * m.q as usize <= 512
            {
                out.push(v);
            }
        }
    }
    out.retain(|v| mla_shared_bytes(s, v).is_some_and(|b| b <= 48 * 1024));
    out
}

/// Parameters of `kivi_mla_decode`, in order.
pub fn mla_params() -> Vec<Param> {
    let p = |name: &'static str, ty: ParamTy| Param { name, ty };
    vec![
        p("pool", ParamTy::PtrU32),
        p("tables", ParamTy::PtrU32),
        p("table_stride", ParamTy::I32),
        p("lat_raw", ParamTy::PtrAct),
        p("rope_raw", ParamTy::PtrAct),
        p("raw_cap", ParamTy::I32),
        p("lens", ParamTy::PtrI32),
        p("counts", ParamTy::PtrI32),
        p("q", ParamTy::PtrF32),
        p("scale", ParamTy::F32),
        p("window", ParamTy::I32),
        p("out", ParamTy::PtrF32Mut),
    ]
}

fn part_cfg(o: &mut String, name: &str, tl: &TensorLayout, part_offset: usize) {
    let _ = writeln!(o, "struct {name} {{");
    let _ = writeln!(o, "  static constexpr int D = {};", tl.head_dim);
    let _ = writeln!(
        o,
        "  static constexpr int PART = {part_offset};  // word offset in a block"
    );
    let _ = writeln!(
        o,
        "  static constexpr int WPT = {};   // words per row",
        tl.words_per_token
    );
    let _ = writeln!(o, "  static constexpr int SCALES = {};", tl.scales_offset);
    let _ = writeln!(o, "  static constexpr int ZEROS = {};", tl.zeros_offset);
    match tl.codec {
        // `validate` refuses vq with mla heads, so no mla part is vq.
        Codec::Full | Codec::Vq(_) => {
            let _ = writeln!(o, "  static constexpr bool QUANT = false;");
            let _ = writeln!(o, "  static constexpr int BITS = 0, CPW = 1, GROUP = 1;");
            let _ = writeln!(o, "  static constexpr bool TOKEN_AXIS = false, SCALE_F32 = false;");
        }
        Codec::Quant(q) => {
            let _ = writeln!(o, "  static constexpr bool QUANT = true;");
            let _ = writeln!(
                o,
                "  static constexpr int BITS = {}, CPW = {}, GROUP = {};",
                q.bits,
                codes_per_word(q.bits),
                q.group
            );
            let _ = writeln!(
                o,
                "  static constexpr bool TOKEN_AXIS = {}, SCALE_F32 = {};",
                q.axis == Axis::Token,
                q.scale == ScaleDtype::F32
            );
        }
    }
    let _ = writeln!(o, "}};");
}

/// The MLA decode kernel of `s` (which must have `mla(...)` heads) for
/// variant `v`, with the default block size ([`mla_block_tokens`]).
///
/// ```
/// let s = kivi_spec::parse_scheme("M { key: quant(bits = 2, axis = channel, group = 32),
///     residual: 64, heads: mla(q = 16, latent = 512, rope_dim = 64) }").unwrap();
/// let v = kivi_templates::mla_variants(&s)[0];
/// let g = kivi_templates::generate_mla_decode(&s, &v).unwrap();
/// assert!(g.name.ends_with("/mla_decode/t128.tile4"), "{}", g.name);
/// assert!(g.source.contains("kivi_mla_decode"));
/// ```
pub fn generate_mla_decode(s: &Scheme, v: &MlaVariant) -> Result<Generated, GenError> {
    kivi_spec::validate(s).map_err(|e| GenError::Scheme(e.message))?;
    let m = s
        .mla()
        .ok_or_else(|| GenError::Scheme(format!("scheme `{}` has no mla heads", s.name)))?;
    for (c, field) in [(s.key, Field::Codec(Tensor::Key)), (m.rope, Field::MlaRope)] {
        if c.quant().is_some_and(|q| q.levels != Levels::Uniform) {
            return Err(GenError::Unsupported {
                what: "lloyd_max levels in mla caches".into(),
                field,
            });
        }
    }
    if !mla_variants(s).contains(v) {
        return Err(GenError::InvalidVariant {
            variant: v.name(),
            why: format!(
                "the mla decode kernel takes {}",
                mla_variants(s).iter().map(|v| v.name()).collect::<Vec<_>>().join(", ")
            ),
        });
    }
    let bt = mla_block_tokens(s, m);
    let l = MlaLayout::new(s, m, bt);
    let tag = crate::scheme_tag(s);
    let name = format!("{tag}/mla_decode/{}", v.name());
    let (act, act_enum) = act_types(s.dtype);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "// Generated by kivi-templates {} — do not edit (kivi_templates::generate_mla_decode)",
        env!("CARGO_PKG_VERSION")
    );
    source_header(&mut o, &name, s);
    for (file, text) in [
        ("kivi_common.cuh", crate::TEMPLATES[0].1),
        ("kivi_mla_decode.cuh", MLA_TEMPLATE),
    ] {
        let _ = writeln!(o, "// ===== {file} =====");
        o.push_str(text);
        o.push('\n');
    }
    let _ = writeln!(o, "// ===== generated configuration =====");
    part_cfg(&mut o, "LatCfg", &l.latent, 0);
    part_cfg(&mut o, "RopeCfg", &l.rope, l.rope_offset);
    let _ = writeln!(o, "struct Cfg {{");
    let _ = writeln!(o, "  typedef {act} act_t;");
    let _ = writeln!(o, "  static constexpr int ACT = kivi::{act_enum};");
    let _ = writeln!(o, "  static constexpr int HQ = {};", m.q);
    let _ = writeln!(o, "  static constexpr int L = {};", m.latent);
    let _ = writeln!(o, "  static constexpr int R = {};", m.rope_dim);
    let _ = writeln!(o, "  static constexpr int BLOCK_TOKENS = {bt};");
    let _ = writeln!(o, "  static constexpr int BLOCK_WORDS = {};", l.block_words);
    let _ = writeln!(o, "  // variant {}", v.name());
    let _ = writeln!(o, "  static constexpr int THREADS = {};", v.threads);
    let _ = writeln!(o, "  static constexpr int TILE = {};", v.tile);
    let _ = writeln!(o, "  typedef LatCfg Lat;\n  typedef RopeCfg Rope;\n}};\n");
    let params = mla_params();
    let _ = writeln!(
        o,
        "extern \"C\" __global__ void __launch_bounds__({}) {MLA_ENTRY}(",
        v.threads
    );
    for (i, prm) in params.iter().enumerate() {
        let sep = if i + 1 == params.len() { ")" } else { "," };
        let _ = writeln!(o, "    {} {}{sep}", c_type(prm.ty, act), prm.name);
    }
    let args: Vec<&str> = params.iter().map(|p| p.name).collect();
    let _ = writeln!(o, "{{\n  kivi::mla_decode_kernel<Cfg>({});\n}}", args.join(", "));
    let hash = kivi_spec::fnv1a64(o.as_bytes());
    Ok(Generated {
        name,
        source: o,
        hash,
        entry_points: vec![MLA_ENTRY.into()],
        launch: LaunchInfo {
            entries: vec![EntryLaunch {
                entry: MLA_ENTRY.into(),
                block: [v.threads, 1, 1],
                grid_xy: [1, 1],
                shared_bytes: mla_shared_bytes(s, v).unwrap_or(0) as u32,
                params,
            }],
            splits: 1,
            q_heads: m.q,
            head_dim: m.latent,
        },
        block_tokens: bt,
    })
}
