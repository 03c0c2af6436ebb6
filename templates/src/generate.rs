//! Scheme + layout + variant -> one CUDA source. Everything the templates
//! need to know is written here as constants of a `Cfg` struct; nothing
//! else is generated except the `extern "C"` entry points.

use crate::variant::cpw;
use crate::{Codebooks, EntryLaunch, Generated, Kernel, LaunchInfo, Param, ParamTy, Variant, TEMPLATES};
use kivi_spec::layout::{default_block_tokens, window_capacity, BlockLayout, TensorLayout};
use kivi_spec::{Axis, Codec, Dtype, Flush, Heads, Levels, Norm, RopeStyle, Scheme, Tensor};
use std::fmt::Write;

/// How a team of lanes covers one row of `wpt` words with `width`-word
/// loads: `size` lanes (a power of two, at most a warp) each make `steps`
/// loads. This is the one place the per-row launch shape is derived.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Team {
    pub size: usize,
    pub steps: usize,
    pub width: usize,
}

impl Team {
    /// Channels one lane owns (an upper bound; the last may be past `D`).
    pub fn channels(&self, _wpt: usize, cpw: usize) -> usize {
        self.steps * self.width * cpw
    }
}

pub(crate) fn team_of(wpt: usize, width: usize) -> Team {
    let loads = wpt.div_ceil(width).max(1);
    let size = loads.next_power_of_two().min(32);
    Team {
        size,
        steps: loads.div_ceil(size),
        width,
    }
}

/// The pipeline steps of tensor `t` in a kernel name: `.lm` / `.lml2`
/// (Lloyd–Max, rms / l2 norm), `.h256` (Hadamard block, `x` + seed when
/// signed), `.o4` (outliers per token), `.m128` (centered on 128 tokens).
fn pipe_tag(s: &Scheme, t: Tensor) -> String {
    let mut o = String::new();
    let Codec::Quant(q) = s.codec(t) else { return o };
    match q.levels {
        Levels::LloydMax(n) => o.push_str(if n == Norm::L2 { ".lml2" } else { ".lm" }),
        // The table itself is named by the `.cb` tag of the shape part
        // (`generate`): the scheme only says that it is calibrated.
        Levels::Nuq(n) => o.push_str(match n {
            Norm::L2 => ".nuql2",
            Norm::MinMax => ".nuqmm",
            Norm::MinMaxPinned => ".nuqmmp",
            Norm::Rms => ".nuq",
        }),
        Levels::Uniform => {}
    }
    if let Some(r) = s.rotation_of(t) {
        let _ = write!(o, ".h{}", r.block);
        if let Some(seed) = r.signs {
            let _ = write!(o, "x{seed}");
        }
    }
    if s.outliers_of(t) > 0 {
        let _ = write!(o, ".o{}", s.outliers_of(t));
    }
    if let Some(n) = s.center_of(t) {
        let _ = write!(o, ".m{n}");
    }
    o
}

fn codec_tag(c: &Codec) -> String {
    match c {
        Codec::Full => "full".into(),
        Codec::Vq(v) => format!("vq.d{}.e{}", v.dim, v.entries),
        Codec::Quant(q) => {
            let axis = match q.axis {
                Axis::Channel => "c",
                Axis::Token => "t",
            };
            let scale = match q.scale {
                kivi_spec::ScaleDtype::F16 => "",
                kivi_spec::ScaleDtype::F32 => ".sf32",
            };
            format!("{axis}.g{}.b{}{scale}", q.group, q.bits)
        }
    }
}

/// `kivi2-k.c.g32.b2-v.t.g32.b2-r128/gqa32x8.d128` (+ `.bt128` when the
/// block size is not the default).
pub(crate) fn scheme_tag(s: &Scheme, block_tokens: Option<usize>) -> String {
    let mut t = format!(
        "{}-k.{}{}-v.{}{}",
        s.name,
        codec_tag(&s.key),
        pipe_tag(s, Tensor::Key),
        codec_tag(&s.value),
        pipe_tag(s, Tensor::Value)
    );
    if s.residual > 0 {
        let _ = write!(t, "-r{}", s.residual);
    }
    if s.sinks > 0 {
        let _ = write!(t, "-s{}", s.sinks);
    }
    if s.flush == Flush::Chunked {
        t.push_str("-chunked");
    }
    if let Some(q) = s.query {
        let _ = write!(t, "-q8.g{}", q.group);
    }
    if s.dtype != Dtype::F16 {
        let _ = write!(t, "-{}", s.dtype.name());
    }
    if let Some(r) = &s.rope {
        // `-ropeh10000`, `-ropei1000000x8` (interleaved, linear scaling 8).
        let style = if r.style == RopeStyle::Half { "h" } else { "i" };
        let _ = write!(t, "-rope{style}{}", r.theta);
        if r.scaling != 1.0 {
            let _ = write!(t, "x{}", r.scaling);
        }
    }
    if let (Some(h), Some(d)) = (s.heads, s.head_dim) {
        let heads = match h.normalized() {
            Heads::Mha(n) => format!("mha{n}"),
            Heads::Mqa(q) => format!("mqa{q}"),
            Heads::Gqa { q, kv } => format!("gqa{q}x{kv}"),
            // The value codec is the latent's (the key's); name the RoPE part's.
            Heads::Mla(m) => format!("mla{}.rope{}.{}", m.q, m.rope_dim, codec_tag(&m.rope)),
        };
        let _ = write!(t, "/{heads}.d{d}");
        if let Some(bt) = block_tokens {
            if bt != default_block_tokens(s) {
                let _ = write!(t, ".bt{bt}");
            }
        }
    }
    t
}

/// Writes members of a generated `Cfg` struct, one a line:
/// `static constexpr TY FIELD = VALUE;`, padded, then `// what`.
pub(crate) struct Members<'a>(pub &'a mut String);

impl Members<'_> {
    pub fn put(&mut self, ty: &str, field: &str, value: impl std::fmt::Display, what: &str) {
        let decl = format!("static constexpr {ty} {field} = {value};");
        let _ = writeln!(self.0, "  {decl:<44} // {what}");
    }
    pub fn int(&mut self, field: &str, value: impl std::fmt::Display, what: &str) {
        self.put("int", field, value, what)
    }
    pub fn flag(&mut self, field: &str, value: bool, what: &str) {
        self.put("bool", field, value, what)
    }
}

pub(crate) fn tensor_cfg(
    o: &mut String,
    name: &str,
    t: Tensor,
    s: &Scheme,
    l: &BlockLayout,
    v: &Variant,
    kernel: Kernel,
) {
    let tl: &TensorLayout = l.tensor(t);
    let cpw = cpw(l, t == Tensor::Key);
    let part = l.tensor_offset(0, t);
    let ring = window_capacity(s, t);
    let w = if kernel == Kernel::Decode {
        v.load_width as usize
    } else {
        1
    };
    // A vq tensor's lanes split its sub-vectors, not vector loads of its
    // words (kivi_vq_decode.cuh): one lane per code word.
    let team = match s.codec(t) {
        Codec::Vq(_) => team_of(tl.words_per_token, 1),
        _ => team_of(tl.words_per_token, w),
    };
    let (quant, bits, token_axis, group, scale_f32, what) = match s.codec(t) {
        Codec::Full => (
            false,
            0,
            false,
            1,
            false,
            format!("{}: full (rows stored raw in the activation dtype)", t.name()),
        ),
        // Only the vq decode template reads a vq tensor's lines: `QUANT`
        // and `TOKEN_AXIS` give its window the token-axis rule (a token is
        // coded alone, kivi_spec::layout::regions), `BITS` the code width.
        Codec::Vq(q) => (
            true,
            q.code_bits(),
            true,
            1,
            false,
            format!("{}: vq(dim = {}, entries = {})", t.name(), q.dim, q.entries),
        ),
        Codec::Quant(q) => (
            true,
            q.bits,
            q.axis == Axis::Token,
            q.group,
            q.scale == kivi_spec::ScaleDtype::F32,
            format!(
                "{}: quant(bits = {}, axis = {}, group = {}, scale = {})",
                t.name(),
                q.bits,
                if q.axis == Axis::Token { "token" } else { "channel" },
                q.group,
                q.scale.name()
            ),
        ),
    };
    let _ = writeln!(o, "// {what}");
    let _ = writeln!(o, "struct {name} {{");
    // `query: int8(group = G)`: the key's query blocks (0: f32 query).
    let qgroup = match (t, s.query) {
        (Tensor::Key, Some(q)) => q.group,
        _ => 0,
    };
    let mut c = Members(o);
    c.flag("QUANT", quant, "false: rows stored raw in the activation dtype");
    c.int("BITS", bits, "code width");
    c.flag(
        "TOKEN_AXIS",
        token_axis,
        "groups of G channels (else G tokens of a channel)",
    );
    c.int("GROUP", group, "G");
    c.int("QGROUP", qgroup, "int8 query blocks of the key (0: f32 query)");
    c.flag("SCALE_F32", scale_f32, "scales and zero points in f32 (else f16 pairs)");
    c.int("WPT", tl.words_per_token, "words per token row");
    c.int("CPW", cpw, "values per word");
    c.int(
        "PART",
        part,
        "word offset of this tensor in a KV head's part of a block",
    );
    c.int(
        "SCALES",
        tl.scales_offset,
        "word offset of the scales in the tensor's part",
    );
    c.int("ZEROS", tl.zeros_offset, "word offset of the zero points");
    c.int("RING", ring, "slots of the window ring");
    c.int("TEAM", team.size, "lanes per row (decode)");
    c.int("STEPS", team.steps, "loads per lane per row (decode)");
    let pipe = Pipe::of(s, t, l);
    c.flag("PIPE", pipe.any(), "any codec pipeline step below");
    // (also calibrated nuq tables; the text is kept so that every
    // existing source, and its hash, stays byte for byte the same)
    c.flag("LLOYD", pipe.lloyd, "Lloyd–Max levels: x^ = s * level(c)");
    c.flag("L2", pipe.l2, "Lloyd–Max norm corrected to the group's L2 norm");
    c.flag("ROT", pipe.rot_block.is_some(), "Hadamard-rotated rows");
    c.int("ROT_BLOCK", pipe.rot_block.unwrap_or(1), "channels per Hadamard block");
    c.flag("SIGNS", pipe.signs.is_some(), "seeded sign flip before the Hadamard");
    c.put(
        "unsigned long long",
        "SEED",
        pipe.signs.unwrap_or(0),
        "seed of the sign flip",
    );
    c.flag("CENTER", pipe.center.is_some(), "per-channel means subtracted");
    c.int("CENTER_N", pipe.center.unwrap_or(0), "tokens the means are taken over");
    c.int("OUTL", tl.outliers, "sparse outliers per token");
    c.int(
        "OIDX",
        tl.outlier_idx_offset,
        "word offset of the outlier channels (u16 pairs)",
    );
    c.int("OIW", tl.outlier_idx_words, "words of one token's outlier channels");
    c.int(
        "OVAL",
        tl.outlier_val_offset,
        "word offset of the outlier corrections (act)",
    );
    c.int("OVW", tl.outlier_val_words, "words of one token's outlier corrections");
    c.int("UNIT", pipe.unit, "rows an extend pipeline transforms at once");
    c.int("WORK", pipe.work, "floats of extend scratch per (sequence, KV head)");
    if pipe.lloyd {
        let _ = writeln!(
            o,
            "  __device__ __forceinline__ static float level(unsigned int c) {{ return {name}_levels[c]; }}"
        );
    }
    if pipe.minmax {
        // Only in these tensors' configurations (kivi_common.cuh reads a
        // missing `MINMAX` as false), so every other source stays as it was.
        Members(o).flag(
            "MINMAX",
            true,
            "table over [0, 1] with a zero point: x^ = z + s * level(c)",
        );
    }
    if s.has_vq() {
        // Only in vq sources (every other source stays byte for byte as it was).
        let (on, dim, entries) = match s.codec(t) {
            Codec::Vq(q) => (true, q.dim as usize, q.entries as usize),
            _ => (false, 1, 1),
        };
        let d = l.shape.head_dim;
        let mut c = Members(o);
        c.flag("VQ", on, "product vector quantized (kivi_vq_decode.cuh)");
        c.int("VDIM", dim, "channels per sub-vector, M");
        c.int("VSUB", d / dim, "sub-vectors per row, D / M");
        c.int("VENT", entries, "centroids per codebook, E");
    }
    let _ = writeln!(o, "}};");
}

/// The codec pipeline of one tensor as the templates see it (all off for a
/// `full` tensor: the oracle runs no pipeline on those either).
pub(crate) struct Pipe {
    /// Codes index a table (`{name}_levels`): Lloyd–Max or a calibrated
    /// `nuq` codebook — the same kernels, only the baked table differs.
    pub lloyd: bool,
    pub l2: bool,
    /// Table codes with a zero point per group (`norm = minmax` or
    /// `minmax_pinned`): `x^ = z + s * L[c]`, codes of `(x - z) / s`.
    pub minmax: bool,
    pub rot_block: Option<usize>,
    pub signs: Option<u32>,
    pub center: Option<usize>,
    pub outliers: usize,
    /// Rows the extend kernel transforms at once: a channel group, or up to
    /// 32 tokens (at most G, so their groups fit the `[D]` staging arrays).
    pub unit: usize,
    /// Floats of extend scratch: `UNIT` transformed rows, then per row the
    /// outliers' channels and original values.
    pub work: usize,
}

impl Pipe {
    pub fn of(s: &Scheme, t: Tensor, l: &BlockLayout) -> Pipe {
        let d = l.shape.head_dim;
        let Codec::Quant(q) = s.codec(t) else {
            return Pipe {
                lloyd: false,
                l2: false,
                minmax: false,
                rot_block: None,
                signs: None,
                center: None,
                outliers: 0,
                unit: 1,
                work: 0,
            };
        };
        let (lloyd, l2, minmax) = match q.levels {
            Levels::Uniform => (false, false, false),
            // A nuq table is given to `generate` (`Codebooks`); without one
            // the public entry points refuse the scheme before generating.
            Levels::LloydMax(n) | Levels::Nuq(n) => (true, n == Norm::L2, n.has_zero()),
        };
        let rot = s.rotation_of(t);
        let outliers = l.tensor(t).outliers;
        let unit = match q.axis {
            Axis::Channel => q.group as usize,
            Axis::Token => (q.group as usize).min(32),
        };
        let mut p = Pipe {
            lloyd,
            l2,
            minmax,
            rot_block: rot.map(|r| r.block as usize),
            signs: rot.and_then(|r| r.signs),
            center: s.center_of(t),
            outliers,
            unit,
            work: 0,
        };
        if p.any() {
            p.work = unit * (d + 2 * outliers);
        }
        p
    }
    pub fn any(&self) -> bool {
        self.lloyd || self.rot_block.is_some() || self.center.is_some() || self.outliers > 0
    }
}

/// Floats of extend scratch one (sequence, KV head) needs: the larger of
/// the two tensors' `WORK` (the kernel's region stride).
pub(crate) fn work_floats(s: &Scheme, l: &BlockLayout) -> usize {
    Pipe::of(s, Tensor::Key, l).work.max(Pipe::of(s, Tensor::Value, l).work)
}

/// The level table of a tensor as a constant-memory array: the Lloyd–Max
/// values `kivi_spec::lloyd_max_levels` gives the oracle (not retyped), or
/// the calibrated `nuq` codebook of `cb` (checked by `lib::check_codebooks`
/// before any source is generated). Written with `{:?}`, which prints the
/// shortest text that reads back as the same f32, so the device decodes
/// with exactly the oracle's numbers.
pub(crate) fn levels_table(o: &mut String, name: &str, s: &Scheme, t: Tensor, cb: &Codebooks) {
    let table = match s.codec(t).quant().map(|q| (q.levels, q.bits)) {
        Some((Levels::LloydMax(_), bits)) => kivi_spec::lloyd_max_levels(bits),
        Some((Levels::Nuq(_), _)) => cb.get(t),
        _ => None,
    };
    if let Some(levels) = table {
        let vals: Vec<String> = levels.iter().map(|x| format!("{x:?}f")).collect();
        let _ = writeln!(
            o,
            "static __constant__ float {name}_levels[{}] = {{{}}};",
            levels.len(),
            vals.join(", ")
        );
    }
}

fn p(name: &'static str, ty: ParamTy) -> Param {
    Param { name, ty }
}

/// The centering means (of type `means`) or, for a vq scheme, the
/// codebooks: f32 `[D / M][E][M]` per vq tensor (a one-element buffer for
/// the other; vq schemes refuse centering).
fn inputs(vq: bool, means: ParamTy) -> [Param; 2] {
    if vq {
        [p("book_k", ParamTy::PtrF32), p("book_v", ParamTy::PtrF32)]
    } else {
        [p("means_k", means), p("means_v", means)]
    }
}

/// The decode kernel's arguments (`vq`: the lookup-table kernel's).
fn decode_params(vq: bool) -> Vec<Param> {
    use ParamTy::*;
    let [k, v] = inputs(vq, PtrAct);
    vec![
        p("pool", PtrU32),
        p("tables", PtrU32),
        p("table_stride", I32),
        p("seq_lens", PtrI32),
        p("q", PtrAct),
        p("sinks_k", PtrAct),
        p("sinks_v", PtrAct),
        p("ring_k", PtrAct),
        p("ring_v", PtrAct),
        k,
        v,
        p("sm_scale", F32),
        p("window", I32),
        p("part_ml", PtrF32Mut),
        p("part_acc", PtrF32Mut),
    ]
}

fn combine_params() -> Vec<Param> {
    use ParamTy::*;
    vec![p("part_ml", PtrF32), p("part_acc", PtrF32), p("out", PtrF32Mut)]
}

/// The prefill/append kernels' arguments (`vq`: the vq tensors coded by
/// `kivi_vq_extend.cuh`, which reads the codebooks).
fn extend_params(vq: bool) -> Vec<Param> {
    use ParamTy::*;
    let [k, v] = inputs(vq, PtrActMut);
    vec![
        p("pool", PtrU32Mut),
        p("tables", PtrU32),
        p("table_stride", I32),
        p("old_lens", PtrI32),
        p("new_counts", PtrI32),
        p("k_new", PtrAct),
        p("v_new", PtrAct),
        p("max_new", I32),
        p("sinks_k", PtrActMut),
        p("sinks_v", PtrActMut),
        p("ring_k", PtrActMut),
        p("ring_v", PtrActMut),
        k,
        v,
        p("work", PtrF32Mut),
        p("status", PtrI32Mut),
    ]
}

pub(crate) fn c_type(ty: ParamTy, act: &str) -> String {
    match ty {
        ParamTy::PtrU32 => "const unsigned int* __restrict__".into(),
        ParamTy::PtrU32Mut => "unsigned int* __restrict__".into(),
        ParamTy::PtrI32 => "const int* __restrict__".into(),
        ParamTy::PtrI32Mut => "int* __restrict__".into(),
        ParamTy::PtrAct => format!("const {act}* __restrict__"),
        ParamTy::PtrActMut => format!("{act}* __restrict__"),
        ParamTy::PtrF32 => "const float* __restrict__".into(),
        ParamTy::PtrF32Mut => "float* __restrict__".into(),
        ParamTy::I32 => "int".into(),
        ParamTy::F32 => "float".into(),
    }
}

fn entry(o: &mut String, name: &str, threads: u32, params: &[Param], body: &str, act: &str) {
    let _ = writeln!(o, "extern \"C\" __global__ void __launch_bounds__({threads}) {name}(");
    for (i, prm) in params.iter().enumerate() {
        let sep = if i + 1 == params.len() { ")" } else { "," };
        let _ = writeln!(o, "    {} {}{sep}", c_type(prm.ty, act), prm.name);
    }
    let args: Vec<&str> = params.iter().map(|p| p.name).collect();
    let _ = writeln!(o, "{{\n  {body}({});\n}}\n", args.join(", "));
}

/// Static shared memory of the decode kernel: scores of a tile, the running
/// max / sum / rescale per head, and one accumulator slice per warp.
pub(crate) fn decode_shared_bytes(v: &Variant, s: &Scheme, l: &BlockLayout) -> usize {
    let d = l.shape.head_dim;
    let h = v.heads_per_block as usize;
    let warps = v.threads as usize / 32;
    let base = h * v.tile_tokens as usize + 3 * h + warps * h * d;
    if s.has_vq() {
        // kivi_vq_decode.cuh: vq keys add the scaled query and the lookup
        // table, `[H][D / M][E]` (one float each otherwise).
        let lut = match s.key.vq() {
            Some(k) => h * d + h * (d / k.dim as usize) * k.entries as usize,
            None => 2,
        };
        return 4 * (base + lut);
    }
    // The query in both domains (keys with a pipeline), the quantized
    // tokens' probability sum and accumulator of a split (values rotated or
    // centered); one float per array when unused (the arrays exist).
    let (kq, split) = (key_query_shared(s, l), value_split(s, l));
    let q = if kq { 2 * h * d } else { 1 };
    let vs = if split { h + h * d } else { 2 };
    // The int8 query's tables (`query: int8(...)`), one word each when unused.
    let i8 = match (s.query, s.key.quant()) {
        (Some(qq), Some(k)) => {
            let ng = v.tile_tokens as usize / k.group as usize + 2;
            ng * h * (d / 4 + d / qq.group as usize + 1)
        }
        _ => 3,
    };
    4 * (base + q + vs + i8)
}

/// Whether the decode kernel keeps the query in shared memory (rotated
/// keys read the raw query for sink and window rows, outliers read any
/// channel, centered keys need `q . m`).
pub(crate) fn key_query_shared(s: &Scheme, l: &BlockLayout) -> bool {
    let p = Pipe::of(s, Tensor::Key, l);
    p.rot_block.is_some() || p.outliers > 0 || p.center.is_some()
}

/// Whether the value's quantized tokens are summed apart (rotated or centered).
pub(crate) fn value_split(s: &Scheme, l: &BlockLayout) -> bool {
    let p = Pipe::of(s, Tensor::Value, l);
    p.rot_block.is_some() || p.center.is_some()
}

pub(crate) fn combine_threads(d: usize) -> u32 {
    (d.div_ceil(32) * 32).clamp(32, 256) as u32
}

/// The part of every generated source's header after its provenance
/// line: the kernel's name, the scheme with its hash and canonical text,
/// and the one system include.
pub(crate) fn source_header(o: &mut String, name: &str, s: &Scheme) {
    let _ = writeln!(o, "// kernel  {name}");
    let _ = writeln!(
        o,
        "// scheme  {} (scheme hash {:016x})",
        s.name,
        kivi_spec::scheme_hash(s)
    );
    for line in kivi_spec::canonical_body(s).lines() {
        let _ = writeln!(o, "//   {}", line.trim());
    }
    let _ = writeln!(o, "#include <cuda_fp16.h>\n");
}

/// The C type and the `kivi::ACT_*` enumerator of an activation dtype.
pub(crate) fn act_types(d: Dtype) -> (&'static str, &'static str) {
    match d {
        Dtype::F16 => ("unsigned short", "ACT_F16"),
        Dtype::Bf16 => ("unsigned short", "ACT_BF16"),
        Dtype::F32 => ("float", "ACT_F32"),
    }
}

/// Pre-RoPE keys: the inverse frequency of every channel pair as a
/// constant-memory f64 table, from the values `kivi_spec::Rope::inv_freq`
/// gives the oracle (linear scaling folded in).
fn rope_table(o: &mut String, s: &Scheme, d: usize) {
    if let Some(r) = &s.rope {
        let vals: Vec<String> = (0..d / 2).map(|i| format!("{:?}", r.inv_freq(i, d))).collect();
        let _ = writeln!(
            o,
            "static __constant__ double kivi_rope_freq[{}] = {{{}}};",
            d / 2,
            vals.join(", ")
        );
    }
}

/// The `Cfg` lines of `rope: pre(...)` (decode turns the query per row).
fn rope_cfg(o: &mut String, s: &Scheme) {
    let (on, half) = match &s.rope {
        Some(r) => (true, r.style == RopeStyle::Half),
        None => (false, true),
    };
    let _ = writeln!(
        o,
        "  static constexpr bool ROPE = {on};   // pre-RoPE keys, turned in decode"
    );
    let _ = writeln!(
        o,
        "  static constexpr bool ROPE_HALF = {half};   // pairs (i, i + D/2), else (2i, 2i + 1)"
    );
    if on {
        let _ = writeln!(
            o,
            "  __device__ __forceinline__ static double rope_freq(int i) {{ return kivi_rope_freq[i]; }}"
        );
    }
}

/// Opens the generated `struct Cfg` with what every kernel's configuration
/// shares: activation type, head layout, windows, block geometry. The
/// caller adds its launch shape and closes the struct.
pub(crate) fn cfg_prelude(o: &mut String, s: &Scheme, l: &BlockLayout) {
    let shape = l.shape;
    let (d, group) = (shape.head_dim, shape.group_size());
    let (act, act_enum) = act_types(s.dtype);
    let _ = writeln!(o, "struct Cfg {{");
    let _ = writeln!(o, "  typedef {act} act_t;");
    let _ = writeln!(o, "  static constexpr int ACT = kivi::{act_enum};");
    let _ = writeln!(o, "  static constexpr int HQ = {};", shape.q_heads);
    let _ = writeln!(o, "  static constexpr int HKV = {};", shape.kv_heads);
    let _ = writeln!(
        o,
        "  static constexpr int GROUP_Q = {group};   // query heads per KV head"
    );
    let _ = writeln!(o, "  static constexpr int D = {d};");
    let _ = writeln!(o, "  static constexpr int SINKS = {};", s.sinks);
    let _ = writeln!(o, "  static constexpr int RESIDUAL = {};", s.residual);
    let _ = writeln!(o, "  static constexpr bool CHUNKED = {};", s.flush == Flush::Chunked);
    let _ = writeln!(o, "  static constexpr int BLOCK_TOKENS = {};", l.block_tokens);
    let _ = writeln!(o, "  static constexpr int BLOCK_WORDS = {};", l.block_words);
    let _ = writeln!(o, "  static constexpr int HEAD_WORDS = {};", l.head_words);
}

pub(crate) fn generate(s: &Scheme, l: &BlockLayout, kernel: Kernel, v: &Variant, cb: &Codebooks) -> Generated {
    let shape = l.shape;
    let d = shape.head_dim;
    let group = shape.group_size();
    let mut tag = scheme_tag(s, Some(l.block_tokens));
    if let Some(h) = cb.tag() {
        // Two calibrations give two names as well as two source hashes.
        let _ = write!(tag, ".cb{:08x}", h as u32);
    }
    let name = format!("{tag}/{}/{}", kernel.name(), v.name());
    let (act, _) = act_types(s.dtype);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "// Generated by kivi-templates {} — do not edit; regenerate with",
        env!("CARGO_PKG_VERSION")
    );
    let _ = writeln!(
        o,
        "//   kivi codegen --scheme {} --kernel {} --variant {}",
        s.name,
        kernel.name(),
        v.name()
    );
    source_header(&mut o, name.as_str(), s);
    let pipeline = Pipe::of(s, Tensor::Key, l).any() || Pipe::of(s, Tensor::Value, l).any();
    let vq = s.has_vq();
    for (file, text) in TEMPLATES {
        let wanted = match file {
            "kivi_common.cuh" => true,
            "kivi_vq_decode.cuh" => vq && kernel == Kernel::Decode,
            "kivi_vq_extend.cuh" => vq && kernel != Kernel::Decode,
            "kivi_decode.cuh" => kernel == Kernel::Decode,
            "kivi_codec_decode.cuh" => pipeline && kernel == Kernel::Decode,
            "kivi_codec_extend.cuh" => pipeline && kernel != Kernel::Decode,
            _ => kernel != Kernel::Decode,
        };
        if wanted {
            let _ = writeln!(o, "// ===== {file} =====");
            o.push_str(text);
            o.push('\n');
        }
    }
    let _ = writeln!(o, "// ===== generated configuration =====");
    levels_table(&mut o, "KeyCfg", s, Tensor::Key, cb);
    levels_table(&mut o, "ValueCfg", s, Tensor::Value, cb);
    tensor_cfg(&mut o, "KeyCfg", Tensor::Key, s, l, v, kernel);
    tensor_cfg(&mut o, "ValueCfg", Tensor::Value, s, l, v, kernel);
    let cthreads = combine_threads(d);
    // Only decode reads the RoPE lines (prefill/append store keys as
    // given), so their sources stay as they were.
    if kernel == Kernel::Decode {
        rope_table(&mut o, s, d);
    }
    cfg_prelude(&mut o, s, l);
    if kernel == Kernel::Decode {
        rope_cfg(&mut o, s);
    }
    let _ = writeln!(o, "  // variant {}", v.name());
    let _ = writeln!(o, "  static constexpr int THREADS = {};", v.threads);
    let _ = writeln!(o, "  static constexpr int TILE = {};", v.tile_tokens);
    let _ = writeln!(o, "  static constexpr int SPLITS = {};", v.splits);
    let _ = writeln!(
        o,
        "  static constexpr int HEADS = {};     // query heads per block",
        v.heads_per_block
    );
    let _ = writeln!(
        o,
        "  static constexpr int WIDTH = {};     // words per load",
        if kernel == Kernel::Decode { v.load_width } else { 1 }
    );
    let _ = writeln!(o, "  static constexpr int UNROLL = {};", v.unroll);
    let _ = writeln!(o, "  static constexpr int COMBINE_THREADS = {cthreads};");
    let _ = writeln!(
        o,
        "  static constexpr int WORK = {};  // extend scratch floats per (sequence, tensor, KV head)",
        work_floats(s, l)
    );
    let _ = writeln!(o, "  typedef KeyCfg K;\n  typedef ValueCfg V;\n}};\n");

    let mut entries = Vec::new();
    let mut entry_points = Vec::new();
    let f32s = |n: usize| (n * 4) as u32;
    match kernel {
        Kernel::Decode => {
            let h = v.heads_per_block as usize;
            if kernel == Kernel::Decode {
                // vq schemes: the lookup-table kernel, codebooks as arguments.
                let params = decode_params(vq);
                let body = if vq {
                    "kivi::vq_decode_kernel<Cfg>"
                } else {
                    "kivi::decode_kernel<Cfg>"
                };
                entry(&mut o, "kivi_decode", v.threads, &params, body, act);
                entry_points.push("kivi_decode".to_string());
                entries.push(EntryLaunch {
                    entry: "kivi_decode".into(),
                    block: [v.threads, 1, 1],
                    grid_xy: [v.splits, (shape.kv_heads * group / h) as u32],
                    shared_bytes: decode_shared_bytes(v, s, l) as u32,
                    params,
                });
            }
            entry(
                &mut o,
                "kivi_combine",
                cthreads,
                &combine_params(),
                "kivi::combine_kernel<Cfg>",
                act,
            );
            entry_points.push("kivi_combine".to_string());
            entries.push(EntryLaunch {
                entry: "kivi_combine".into(),
                block: [cthreads, 1, 1],
                grid_xy: [shape.q_heads as u32, 1],
                shared_bytes: 0,
                params: combine_params(),
            });
        }
        Kernel::Prefill | Kernel::Append => {
            let e = if kernel == Kernel::Prefill {
                "kivi_prefill"
            } else {
                "kivi_append"
            };
            // vq schemes: the vq tensors are coded by kivi_vq_extend.cuh.
            let params = extend_params(vq);
            let body = if vq {
                "kivi::vq_extend_kernel<Cfg>"
            } else {
                "kivi::extend_kernel<Cfg>"
            };
            entry(&mut o, e, v.threads, &params, body, act);
            entry_points.push(e.to_string());
            entries.push(EntryLaunch {
                entry: e.into(),
                block: [v.threads, 1, 1],
                grid_xy: [shape.kv_heads as u32, 2],
                shared_bytes: f32s(4 * d), // s_s, s_z of the key and of the value instantiation
                params,
            });
        }
    }
    let hash = kivi_spec::fnv1a64(o.as_bytes());
    Generated {
        name,
        source: o,
        hash,
        entry_points,
        launch: LaunchInfo {
            entries,
            splits: v.splits,
            q_heads: shape.q_heads as u32,
            head_dim: d as u32,
        },
        block_tokens: l.block_tokens,
    }
}
