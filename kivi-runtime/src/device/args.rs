//! Kernel arguments: one typed struct per kernel entry point, and the only
//! place in the project that turns host values into a kernel's argument
//! list. Encodings that the kernels define (a sliding window of "none" is
//! `-1`, the grid's z is the batch) live here once, so no two call sites
//! can disagree about them.
//!
//! Each struct's `launch` checks, before anything runs, that the
//! generator's parameter list ([`kivi_templates::EntryLaunch::params`]) has
//! exactly these names in this order and that every buffer is large enough
//! for the batch; [`Device::launch`] then checks the types.

use super::{Buffer, Device, KernelArg, Module};
use crate::error::{Error, Result};

/// A sliding window as the decode kernel reads it: `-1` = attend to every
/// token, `w >= 1` = only the last `w`. (A window of 0 tokens attends to
/// nothing; [`super::DeviceCache::decode`] answers it without a launch.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window(i32);

impl Window {
    /// The kernel's encoding of `AttnParams::window`.
    pub fn of(w: Option<usize>) -> Result<Window> {
        match w {
            None => Ok(Window(-1)),
            Some(0) => Err(Error::Config(
                "a sliding window of 0 tokens attends to nothing; it has no kernel encoding".into(),
            )),
            Some(w) => Ok(Window(i32::try_from(w).unwrap_or(i32::MAX))),
        }
    }
    /// The value passed to the kernel.
    pub fn raw(self) -> i32 {
        self.0
    }
}

/// The generator's launch description of `entry` in `m`.
fn entry<'m>(m: &'m Module, entry: &str) -> Result<&'m kivi_templates::EntryLaunch> {
    m.generated
        .launch
        .entry(entry)
        .ok_or_else(|| Error::Config(format!("`{}` has no entry point `{entry}`", m.generated.name)))
}

fn check_names(m: &Module, name: &str, names: &[&str]) -> Result<()> {
    let el = entry(m, name)?;
    let got: Vec<&str> = el.params.iter().map(|p| p.name).collect();
    if got != names {
        return Err(Error::Config(format!(
            "`{}`: kernel `{name}` takes ({}), the host passes ({})",
            m.generated.name,
            got.join(", "),
            names.join(", ")
        )));
    }
    Ok(())
}

fn at_least(b: &Buffer, n: usize, what: &str) -> Result<()> {
    if b.len() < n {
        return Err(Error::Config(format!(
            "kernel argument `{what}` holds {} elements, the launch reads {n}",
            b.len()
        )));
    }
    Ok(())
}

/// `x` as the kernel's `int`; `what` names it in the error (`{what} of {x}`).
fn int(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| Error::Config(format!("{what} of {x}")))
}

/// The block tables every paged kernel reads: `tables` holds `batch` rows
/// of `stride` entries; returns the stride as the kernel takes it.
fn table_stride(tables: &Buffer, batch: usize, stride: usize) -> Result<i32> {
    at_least(tables, batch * stride, "tables")?;
    i32::try_from(stride).map_err(|_| Error::Config(format!("a block table of {stride} entries")))
}

fn grid(m: &Module, name: &str, batch: usize) -> Result<[u32; 3]> {
    let el = entry(m, name)?;
    let b = u32::try_from(batch).map_err(|_| Error::Config(format!("a batch of {batch} sequences")))?;
    Ok(el.grid(b, 0))
}

/// The two per-tensor inputs of the decode and extend kernels after the
/// rings: a plain scheme's centering means, or a vq scheme's codebooks
/// (`templates/cuda/kivi_vq_decode.cuh`, `kivi_vq_extend.cuh`). One argument
/// list serves both kernel families, so the shared parts are checked and
/// passed once. `M` is how the means are passed: read (`&Buffer`, decode)
/// or written (`&mut Buffer`: prefill/append write them when the first `N`
/// tokens arrive).
pub enum Inputs<'a, M> {
    /// `means_k` / `means_v`: per-channel centering means, `[batch][Hkv][D]`
    /// act (a one-element buffer for a tensor that is not centered: the
    /// kernel never touches it).
    Means { k: M, v: M },
    /// `book_k` / `book_v`: product codebooks, f32 `[D / M][E][M]`, holding
    /// at least `len[0]` / `len[1]` floats (the sizes the scheme implies; 0
    /// and a one-element buffer, never read, for a tensor that is not vq).
    /// A codebook the two tensors share by name may be one buffer passed
    /// twice. Read by every kernel.
    Books {
        k: &'a Buffer,
        v: &'a Buffer,
        len: [usize; 2],
    },
}

/// [`Inputs`] of `kivi_decode`: the means are read.
pub type DecodeInputs<'a> = Inputs<'a, &'a Buffer>;

/// [`Inputs`] of `kivi_prefill` / `kivi_append`: the means are written.
pub type ExtendInputs<'a> = Inputs<'a, &'a mut Buffer>;

/// A buffer as a kernel argument: read if shared, written if mutable.
pub trait AsArg<'a> {
    fn arg(self) -> KernelArg<'a>;
}

impl<'a> AsArg<'a> for &'a Buffer {
    fn arg(self) -> KernelArg<'a> {
        KernelArg::In(self)
    }
}

impl<'a> AsArg<'a> for &'a mut Buffer {
    fn arg(self) -> KernelArg<'a> {
        KernelArg::Out(self)
    }
}

/// The parameter names of [`Inputs`]: the codebooks (`books`) or the means.
fn input_names(books: bool) -> [&'static str; 2] {
    if books {
        ["book_k", "book_v"]
    } else {
        ["means_k", "means_v"]
    }
}

impl<'a, M: AsArg<'a>> Inputs<'a, M> {
    fn is_books(&self) -> bool {
        matches!(self, Inputs::Books { .. })
    }

    /// The buffers as kernel arguments, after checking the codebooks' sizes.
    fn args(self) -> Result<[KernelArg<'a>; 2]> {
        match self {
            Inputs::Means { k, v } => Ok([k.arg(), v.arg()]),
            Inputs::Books { k, v, len } => {
                at_least(k, len[0], "book_k")?;
                at_least(v, len[1], "book_v")?;
                Ok([KernelArg::In(k), KernelArg::In(v)])
            }
        }
    }
}

/// `kivi_decode`: one split of the flash-decoding pass per block.
pub struct DecodeArgs<'a> {
    pub batch: usize,
    pub pool: &'a Buffer,
    pub tables: &'a Buffer,
    pub table_stride: usize,
    pub seq_lens: &'a Buffer,
    pub q: &'a Buffer,
    pub sinks_k: &'a Buffer,
    pub sinks_v: &'a Buffer,
    pub ring_k: &'a Buffer,
    pub ring_v: &'a Buffer,
    /// Centering means or codebooks.
    pub inputs: DecodeInputs<'a>,
    pub sm_scale: f32,
    pub window: Window,
    pub part_ml: &'a mut Buffer,
    pub part_acc: &'a mut Buffer,
}

impl DecodeArgs<'_> {
    pub const ENTRY: &'static str = "kivi_decode";

    /// The kernel's parameter names, in order: with the codebooks of a vq
    /// scheme (`books`) or the centering means.
    pub fn params(books: bool) -> [&'static str; 15] {
        let [k, v] = input_names(books);
        [
            "pool",
            "tables",
            "table_stride",
            "seq_lens",
            "q",
            "sinks_k",
            "sinks_v",
            "ring_k",
            "ring_v",
            k,
            v,
            "sm_scale",
            "window",
            "part_ml",
            "part_acc",
        ]
    }

    pub fn launch(self, dev: &dyn Device, m: &Module) -> Result<()> {
        check_names(m, Self::ENTRY, &Self::params(self.inputs.is_books()))?;
        let li = &m.generated.launch;
        let (hq, d) = (li.q_heads as usize, li.head_dim as usize);
        let stride = table_stride(self.tables, self.batch, self.table_stride)?;
        at_least(self.seq_lens, self.batch, "seq_lens")?;
        at_least(self.q, self.batch * hq * d, "q")?;
        let [ik, iv] = self.inputs.args()?;
        at_least(self.part_ml, li.part_ml_len(self.batch), "part_ml")?;
        at_least(self.part_acc, li.part_acc_len(self.batch), "part_acc")?;
        let g = grid(m, Self::ENTRY, self.batch)?;
        dev.launch(
            m,
            Self::ENTRY,
            g,
            &mut [
                KernelArg::In(self.pool),
                KernelArg::In(self.tables),
                KernelArg::I32(stride),
                KernelArg::In(self.seq_lens),
                KernelArg::In(self.q),
                KernelArg::In(self.sinks_k),
                KernelArg::In(self.sinks_v),
                KernelArg::In(self.ring_k),
                KernelArg::In(self.ring_v),
                ik,
                iv,
                KernelArg::F32(self.sm_scale),
                KernelArg::I32(self.window.raw()),
                KernelArg::Out(self.part_ml),
                KernelArg::Out(self.part_acc),
            ],
        )
    }
}

/// `kivi_combine`: merges the splits of [`DecodeArgs`] into `[batch][Hq][D]` f32.
pub struct CombineArgs<'a> {
    pub batch: usize,
    pub part_ml: &'a Buffer,
    pub part_acc: &'a Buffer,
    pub out: &'a mut Buffer,
}

impl CombineArgs<'_> {
    pub const ENTRY: &'static str = "kivi_combine";
    pub const PARAMS: [&'static str; 3] = ["part_ml", "part_acc", "out"];

    pub fn launch(self, dev: &dyn Device, m: &Module) -> Result<()> {
        check_names(m, Self::ENTRY, &Self::PARAMS)?;
        let li = &m.generated.launch;
        at_least(self.part_ml, li.part_ml_len(self.batch), "part_ml")?;
        at_least(self.part_acc, li.part_acc_len(self.batch), "part_acc")?;
        at_least(self.out, self.batch * li.q_heads as usize * li.head_dim as usize, "out")?;
        let g = grid(m, Self::ENTRY, self.batch)?;
        dev.launch(
            m,
            Self::ENTRY,
            g,
            &mut [
                KernelArg::In(self.part_ml),
                KernelArg::In(self.part_acc),
                KernelArg::Out(self.out),
            ],
        )
    }
}

/// `kivi_prefill` / `kivi_append`: adds `new_counts[b]` tokens to sequence `b`.
pub struct ExtendArgs<'a> {
    pub batch: usize,
    pub pool: &'a mut Buffer,
    pub tables: &'a Buffer,
    pub table_stride: usize,
    pub old_lens: &'a Buffer,
    pub new_counts: &'a Buffer,
    /// `[batch][max_new][Hkv][D]`, already rounded to the activation dtype.
    pub k_new: &'a Buffer,
    pub v_new: &'a Buffer,
    pub max_new: usize,
    pub sinks_k: &'a mut Buffer,
    pub sinks_v: &'a mut Buffer,
    pub ring_k: &'a mut Buffer,
    pub ring_v: &'a mut Buffer,
    /// Centering means or codebooks.
    pub inputs: ExtendInputs<'a>,
    /// Codec-pipeline scratch: `batch * 2 * Hkv` regions of
    /// [`kivi_templates::extend_work_floats`] f32 (one element without a pipeline).
    pub work: &'a mut Buffer,
    /// Per sequence: 0 = stored; see [`super::cache::status_message`].
    pub status: &'a mut Buffer,
}

impl ExtendArgs<'_> {
    /// The kernels' parameter names, in order: with the codebooks of a vq
    /// scheme (`books`) or the centering means.
    pub fn params(books: bool) -> [&'static str; 16] {
        let [k, v] = input_names(books);
        [
            "pool",
            "tables",
            "table_stride",
            "old_lens",
            "new_counts",
            "k_new",
            "v_new",
            "max_new",
            "sinks_k",
            "sinks_v",
            "ring_k",
            "ring_v",
            k,
            v,
            "work",
            "status",
        ]
    }

    /// Launches the module's entry point (`kivi_prefill` or `kivi_append`).
    pub fn launch(self, dev: &dyn Device, m: &Module) -> Result<()> {
        let entry = m
            .generated
            .entry_points
            .first()
            .filter(|e| matches!(e.as_str(), "kivi_prefill" | "kivi_append"))
            .cloned()
            .ok_or_else(|| Error::Config(format!("`{}` is not a prefill or append kernel", m.generated.name)))?;
        if entry == "kivi_append" && self.max_new > 1 {
            return Err(Error::Config(format!(
                "the append kernel adds one token per sequence, not {}",
                self.max_new
            )));
        }
        check_names(m, &entry, &Self::params(self.inputs.is_books()))?;
        let row = m.generated.launch.head_dim as usize;
        let stride = table_stride(self.tables, self.batch, self.table_stride)?;
        at_least(self.old_lens, self.batch, "old_lens")?;
        at_least(self.new_counts, self.batch, "new_counts")?;
        at_least(self.k_new, self.batch * self.max_new * row, "k_new")?;
        at_least(self.v_new, self.batch * self.max_new * row, "v_new")?;
        at_least(self.status, self.batch, "status")?;
        let [ik, iv] = self.inputs.args()?;
        let max_new = i32::try_from(self.max_new).map_err(|_| Error::Config(format!("{} new tokens", self.max_new)))?;
        let g = grid(m, &entry, self.batch)?;
        dev.launch(
            m,
            &entry,
            g,
            &mut [
                KernelArg::Out(self.pool),
                KernelArg::In(self.tables),
                KernelArg::I32(stride),
                KernelArg::In(self.old_lens),
                KernelArg::In(self.new_counts),
                KernelArg::In(self.k_new),
                KernelArg::In(self.v_new),
                KernelArg::I32(max_new),
                KernelArg::Out(self.sinks_k),
                KernelArg::Out(self.sinks_v),
                KernelArg::Out(self.ring_k),
                KernelArg::Out(self.ring_v),
                ik,
                iv,
                KernelArg::Out(self.work),
                KernelArg::Out(self.status),
            ],
        )
    }
}

/// `kivi_block`: attention for a causal block of new queries per sequence
/// over a cache the block was just appended to
/// ([`kivi_templates::generate_block`] documents the arguments).
pub struct BlockArgs<'a> {
    pub batch: usize,
    /// The module's launch shape ([`kivi_templates::block_shape`]).
    pub shape: kivi_templates::BlockShape,
    pub kv_heads: usize,
    pub pool: &'a Buffer,
    pub tables: &'a Buffer,
    pub table_stride: usize,
    /// Tokens of each sequence before its block, and the block's size.
    pub past_lens: &'a Buffer,
    pub counts: &'a Buffer,
    /// `[batch][max_n][Hq][D]` act.
    pub q: &'a Buffer,
    pub max_n: usize,
    pub sinks_k: &'a Buffer,
    pub sinks_v: &'a Buffer,
    /// Centering means, `[batch][Hkv][D]` act (one element for a tensor
    /// that is not centered).
    pub means_k: &'a Buffer,
    pub means_v: &'a Buffer,
    /// `[batch][tail_stride][Hkv][D]` act: each sequence's full-precision
    /// rows from its stored boundary before the block on.
    pub tail_k: &'a Buffer,
    pub tail_v: &'a Buffer,
    pub tail_stride: usize,
    pub sm_scale: f32,
    /// `None`: no sliding window; `Some(0)` attends to nothing (zeros).
    pub window: Option<usize>,
    /// `[batch][max_n][Hq][D]` f32.
    pub out: &'a mut Buffer,
}

impl BlockArgs<'_> {
    pub const ENTRY: &'static str = "kivi_block";
    pub const PARAMS: [&'static str; 17] = [
        "pool",
        "tables",
        "table_stride",
        "past_lens",
        "counts",
        "q",
        "max_n",
        "sinks_k",
        "sinks_v",
        "means_k",
        "means_v",
        "tail_k",
        "tail_v",
        "tail_stride",
        "sm_scale",
        "window",
        "out",
    ];

    pub fn launch(self, dev: &dyn Device, m: &Module) -> Result<()> {
        check_names(m, Self::ENTRY, &Self::PARAMS)?;
        let li = &m.generated.launch;
        let (hq, d) = (li.q_heads as usize, li.head_dim as usize);
        let tail_len = self.tail_k.len().min(self.tail_v.len());
        let stride = table_stride(self.tables, self.batch, self.table_stride)?;
        at_least(self.past_lens, self.batch, "past_lens")?;
        at_least(self.counts, self.batch, "counts")?;
        at_least(self.q, self.batch * self.max_n * hq * d, "q")?;
        at_least(self.out, self.batch * self.max_n * hq * d, "out")?;
        if tail_len < self.batch * self.tail_stride * self.kv_heads * d {
            return Err(Error::Config(format!(
                "the tail buffers hold {tail_len} elements, the launch reads {} rows per sequence",
                self.tail_stride
            )));
        }
        let max_n = int(self.max_n, "a block")?;
        let tail_stride = int(self.tail_stride, "a tail")?;
        // -1 = no window, as for decode; 0 is a valid window here (the
        // kernel attends to nothing and writes zeros).
        let window = self.window.map_or(-1, |w| i32::try_from(w).unwrap_or(i32::MAX));
        let y = entry(m, Self::ENTRY)?.grid_xy[1];
        let x = u32::try_from(self.max_n.div_ceil(self.shape.queries as usize).max(1))
            .map_err(|_| Error::Config(format!("a block of {} tokens", self.max_n)))?;
        let z = u32::try_from(self.batch).map_err(|_| Error::Config(format!("a batch of {} sequences", self.batch)))?;
        let g = [x, y, z];
        dev.launch(
            m,
            Self::ENTRY,
            g,
            &mut [
                KernelArg::In(self.pool),
                KernelArg::In(self.tables),
                KernelArg::I32(stride),
                KernelArg::In(self.past_lens),
                KernelArg::In(self.counts),
                KernelArg::In(self.q),
                KernelArg::I32(max_n),
                KernelArg::In(self.sinks_k),
                KernelArg::In(self.sinks_v),
                KernelArg::In(self.means_k),
                KernelArg::In(self.means_v),
                KernelArg::In(self.tail_k),
                KernelArg::In(self.tail_v),
                KernelArg::I32(tail_stride),
                KernelArg::F32(self.sm_scale),
                KernelArg::I32(window),
                KernelArg::Out(self.out),
            ],
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kivi_spec::{presets, Heads};
    use kivi_templates::{default_variant, generate, Kernel};

    /// A window of "none" is -1 (the kernel reads `window >= 0` as "only
    /// the last `window` tokens"); the old CUDA host code passed 0 here and
    /// every decode without a window attended to nothing.
    #[test]
    fn no_window_is_minus_one() {
        assert_eq!(Window::of(None).unwrap().raw(), -1);
        assert_eq!(Window::of(Some(5)).unwrap().raw(), 5);
        assert!(Window::of(Some(0)).is_err());
        assert_eq!(Window::of(Some(usize::MAX)).unwrap().raw(), i32::MAX);
    }

    /// The parameter lists here are the generator's, for every preset and
    /// kernel, and for a vq scheme (codebooks in place of the means).
    #[test]
    fn params_match_the_generator() {
        let vq = kivi_spec::parse_scheme(
            "vqp { key: vq(dim = 8, entries = 16), value: quant(bits = 2, axis = token, group = 32), residual: 32 }",
        )
        .unwrap();
        for p in presets::listed().into_iter().chain([vq]) {
            let s = p.with_shape(Heads::Gqa { q: 8, kv: 2 }, 256).unwrap();
            let books = s.has_vq();
            for k in Kernel::ALL {
                let g = generate(&s, k, &default_variant(&s, k)).unwrap();
                for e in &g.launch.entries {
                    let names: Vec<&str> = e.params.iter().map(|p| p.name).collect();
                    let want: &[&str] = match e.entry.as_str() {
                        "kivi_decode" => &DecodeArgs::params(books),
                        "kivi_combine" => &CombineArgs::PARAMS,
                        _ => &ExtendArgs::params(books),
                    };
                    assert_eq!(names, want, "{} {}", g.name, e.entry);
                    assert_eq!(e.grid(3, 0)[2], 3, "grid z is the batch");
                }
            }
            // The block kernel, where it is generated (not for rotated or
            // centered tensors).
            if let Ok(g) = kivi_templates::generate_block(&s, Default::default()) {
                let names: Vec<&str> = g.launch.entries[0].params.iter().map(|p| p.name).collect();
                assert_eq!(names, BlockArgs::PARAMS, "{}", g.name);
            }
        }
    }
}
