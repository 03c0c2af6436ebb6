//! The device layer: one small interface between the host code of the GPU
//! path and whatever executes the generated kernels.
//!
//! [`Device`] allocates, uploads, downloads, loads a generated module,
//! launches an entry point with a typed argument list and times work. It
//! has two implementations:
//!
//! - [`crate::cuda::CudaDevice`] — a real GPU through cudarc (the only code
//!   in the project that runs on a GPU and nowhere else, and it is thin);
//! - [`SimDevice`] — the simulator: "device memory" is host memory and a
//!   module is the generated source compiled as C++ through the shim
//!   (`templates/cuda/sim_shim.h`), so every kernel runs on the CPU.
//!
//! Everything above it — the device-resident cache ([`DeviceCache`]:
//! prefill, append, decode, combine), the kernel argument structs
//! ([`args`], the one place kernel arguments are built), the tuner's
//! CUDA target, `kivi attend`/`kivi tune --backend sim|cuda` and the GPU
//! benchmark — is written once against [`Device`], and runs in CI on the
//! simulated device. A bug in that code is found on the CPU.
//!
//! ```
//! use kivi_runtime::device::{DeviceCache, SimDevice};
//! use kivi_runtime::{reference, AttnParams, CacheConfig, PagedCache};
//! use kivi_spec::{presets, Heads};
//! # if kivi_runtime::sim::find_compiler().is_err() { return; }
//! let s = presets::kivi2().with_shape(Heads::Gqa { q: 4, kv: 2 }, 32).unwrap();
//! let dev = SimDevice::shared();
//! let mut dc = DeviceCache::new(dev, &s, 1, 256, CacheConfig::for_tokens(256)).unwrap();
//! let kv: Vec<f32> = (0..40 * 2 * 32).map(|i| ((i * 7 % 13) as f32 - 6.0) / 4.0).collect();
//! dc.extend(&[40], &kv, &kv).unwrap(); // the prefill kernel, simulated
//! let q = vec![0.5f32; 4 * 32];
//! let out = dc.decode(&q, AttnParams::of(&s, s.shape().unwrap()), None).unwrap();
//! assert_eq!(out.len(), 4 * 32);
//! ```

pub mod args;
mod cache;
mod low_rank;
mod sim;

pub use cache::{nuq_codebooks, DecodeRun, DeviceBackend, DeviceCache};
pub use low_rank::{DeviceLowRankCache, NOT_DEVICE};
pub use sim::SimDevice;

use crate::cuda::Arch;
use crate::error::{Error, Result};
use kivi_templates::{Generated, ParamTy};
use std::sync::Arc;

/// Which implementation a [`Device`] is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A GPU, through cudarc.
    Cuda,
    /// The simulator: generated CUDA compiled as C++ and run on the CPU.
    Sim,
}

impl DeviceKind {
    /// `cuda` or `sim`: the backend name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cuda => "cuda",
            DeviceKind::Sim => "sim",
        }
    }
}

/// What a device is, for reports and decision keys (never the ordinal alone).
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    pub arch: Arch,
    pub sms: i32,
    pub l2_bytes: i32,
    /// Memory clock (kHz) and bus width (bits) as the driver reports them
    /// (0 where the driver no longer reports them).
    pub mem_clock_khz: i32,
    pub bus_width_bits: i32,
    pub total_mem: usize,
    pub driver_version: i32,
}

impl DeviceInfo {
    /// Peak DRAM bandwidth in GB/s: from clock and bus width (double data
    /// rate), or from the datasheet for GPUs whose driver hides them.
    pub fn peak_bandwidth_gbs(&self) -> Option<f64> {
        if self.mem_clock_khz > 0 && self.bus_width_bits > 0 {
            return Some(2.0 * self.mem_clock_khz as f64 * 1e3 * self.bus_width_bits as f64 / 8.0 / 1e9);
        }
        let n = self.name.to_ascii_uppercase();
        [
            ("H200", 4800.0),
            ("H100 NVL", 3900.0),
            ("H100", 3350.0),
            ("A100", 2039.0),
            ("L40S", 864.0),
        ]
        .iter()
        .find(|(k, _)| n.contains(k))
        .map(|(_, v)| *v)
    }
}

/// Median and quantiles of repeated timings, milliseconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Timing {
    pub median_ms: f64,
    pub p20_ms: f64,
    pub p80_ms: f64,
    pub samples: usize,
}

impl Timing {
    /// From samples (any order).
    pub fn of(mut ms: Vec<f64>) -> Timing {
        ms.sort_by(|a, b| a.total_cmp(b));
        let q = |p: f64| {
            if ms.is_empty() {
                return f64::NAN;
            }
            // nearest rank: simple, and exact for the median of odd counts
            let i = ((ms.len() - 1) as f64 * p).round() as usize;
            ms[i]
        };
        Timing {
            median_ms: q(0.5),
            p20_ms: q(0.2),
            p80_ms: q(0.8),
            samples: ms.len(),
        }
    }
}

/// The element type of a device buffer, checked against the kernel
/// parameter it is passed as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Elem {
    U32,
    I32,
    F32,
    /// f16 or bf16 bits.
    U16,
    /// Raw bytes (scratch, L2 flush).
    U8,
}

impl Elem {
    pub fn size(self) -> usize {
        match self {
            Elem::U32 | Elem::I32 | Elem::F32 => 4,
            Elem::U16 => 2,
            Elem::U8 => 1,
        }
    }
}

/// A value type that can live in a device buffer.
pub trait DeviceElem: Copy + Default + Send + Sync + 'static {
    const ELEM: Elem;
}
impl DeviceElem for u32 {
    const ELEM: Elem = Elem::U32;
}
impl DeviceElem for i32 {
    const ELEM: Elem = Elem::I32;
}
impl DeviceElem for f32 {
    const ELEM: Elem = Elem::F32;
}
impl DeviceElem for u16 {
    const ELEM: Elem = Elem::U16;
}
impl DeviceElem for u8 {
    const ELEM: Elem = Elem::U8;
}

pub(crate) fn as_bytes<T: DeviceElem>(x: &[T]) -> &[u8] {
    // SAFETY: every DeviceElem is a plain integer or float: no padding, no
    // invalid bit patterns, alignment of u8 is 1.
    unsafe { std::slice::from_raw_parts(x.as_ptr() as *const u8, std::mem::size_of_val(x)) }
}

pub(crate) fn from_bytes<T: DeviceElem>(b: &[u8]) -> Vec<T> {
    let n = b.len() / std::mem::size_of::<T>();
    let mut out = vec![T::default(); n];
    // SAFETY: `out` has room for exactly n * size_of::<T>() bytes and every
    // bit pattern is a valid T (see as_bytes).
    unsafe {
        std::ptr::copy_nonoverlapping(b.as_ptr(), out.as_mut_ptr() as *mut u8, n * std::mem::size_of::<T>());
    }
    out
}

/// Device memory: a sized, typed allocation of one [`Device`]. Create it
/// with [`Device::alloc`] or [`upload`]; it is freed when dropped.
pub struct Buffer {
    pub(crate) elem: Elem,
    pub(crate) len: usize,
    pub(crate) mem: Mem,
}

pub(crate) enum Mem {
    /// Simulated device memory: host memory aligned like `cudaMalloc`'s.
    Host(sim::HostMem),
    Cuda(cudarc::driver::CudaSlice<u8>),
}

impl Buffer {
    /// Elements (not bytes).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn elem(&self) -> Elem {
        self.elem
    }
    pub fn bytes(&self) -> usize {
        self.len * self.elem.size()
    }
}

impl std::fmt::Debug for Buffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let on = match self.mem {
            Mem::Host(_) => "sim",
            Mem::Cuda(_) => "cuda",
        };
        write!(f, "Buffer({:?} x {} on {on})", self.elem, self.len)
    }
}

/// A generated source loaded on a device.
pub struct Module {
    pub generated: Generated,
    pub(crate) inner: ModuleInner,
}

pub(crate) enum ModuleInner {
    Sim(Arc<crate::sim::SimLibrary>),
    Cuda(Box<crate::cuda::device::CudaModuleFns>),
}

impl Module {
    /// A source compiled into a simulator library.
    pub(crate) fn sim(generated: Generated, lib: Arc<crate::sim::SimLibrary>) -> Module {
        Module {
            generated,
            inner: ModuleInner::Sim(lib),
        }
    }
    /// Whether the module defines entry point `entry`.
    pub fn has(&self, entry: &str) -> bool {
        self.generated.entry_points.iter().any(|e| e == entry)
    }
}

/// One kernel argument. Built only by the structs of [`args`], which know
/// each entry point's parameter list; checked again against the generator's
/// list ([`kivi_templates::EntryLaunch::params`]) at every launch.
pub enum KernelArg<'a> {
    /// A buffer the kernel only reads.
    In(&'a Buffer),
    /// A buffer the kernel writes.
    Out(&'a mut Buffer),
    I32(i32),
    F32(f32),
}

impl KernelArg<'_> {
    fn describe(&self) -> String {
        match self {
            KernelArg::In(b) => format!("const {:?}*", b.elem),
            KernelArg::Out(b) => format!("{:?}*", b.elem),
            KernelArg::I32(_) => "i32".into(),
            KernelArg::F32(_) => "f32".into(),
        }
    }

    /// Whether this argument can be passed as a parameter of type `ty`.
    pub fn fits(&self, ty: ParamTy) -> bool {
        let act = |e: Elem| matches!(e, Elem::U16 | Elem::F32);
        match (self, ty) {
            (KernelArg::In(b), ParamTy::PtrU32) => b.elem == Elem::U32,
            (KernelArg::In(b), ParamTy::PtrI32) => b.elem == Elem::I32,
            (KernelArg::In(b), ParamTy::PtrF32) => b.elem == Elem::F32,
            (KernelArg::In(b), ParamTy::PtrAct) => act(b.elem),
            (KernelArg::Out(b), ParamTy::PtrU32Mut) => b.elem == Elem::U32,
            (KernelArg::Out(b), ParamTy::PtrI32Mut) => b.elem == Elem::I32,
            (KernelArg::Out(b), ParamTy::PtrF32Mut) => b.elem == Elem::F32,
            (KernelArg::Out(b), ParamTy::PtrActMut) => act(b.elem),
            (KernelArg::I32(_), ParamTy::I32) | (KernelArg::F32(_), ParamTy::F32) => true,
            _ => false,
        }
    }
}

/// Checks `args` against the entry point's parameter list and returns its
/// launch shape (block) — what every [`Device::launch`] does first.
pub(crate) fn check_launch(m: &Module, entry: &str, args: &[KernelArg<'_>]) -> Result<[u32; 3]> {
    let el = m
        .generated
        .launch
        .entry(entry)
        .ok_or_else(|| Error::Config(format!("`{}` has no entry point `{entry}`", m.generated.name)))?;
    if el.params.len() != args.len() || !el.params.iter().zip(args).all(|(p, a)| a.fits(p.ty)) {
        let want: Vec<String> = el.params.iter().map(|p| format!("{}: {:?}", p.name, p.ty)).collect();
        let got: Vec<String> = args.iter().map(|a| a.describe()).collect();
        return Err(Error::Config(format!(
            "`{}`: kernel `{entry}` takes ({}), the host passes ({})",
            m.generated.name,
            want.join(", "),
            got.join(", ")
        )));
    }
    Ok(el.block)
}

/// Something that runs generated kernels: a GPU or the simulator.
///
/// Work is ordered as issued (one stream). Errors are typed: a device that
/// is missing or lost is [`Error::Unavailable`], a bad launch is
/// [`Error::Config`]; nothing here panics on bad input.
pub trait Device: Send + Sync {
    fn kind(&self) -> DeviceKind;
    fn info(&self) -> &DeviceInfo;
    /// A short description for logs: name, arch, compiler.
    fn describe(&self) -> String;
    /// `len` zeroed elements of type `elem` (a zero-length request gets one
    /// element: zero-size allocations are not portable).
    fn alloc(&self, elem: Elem, len: usize) -> Result<Buffer>;
    /// Writes `src` (bytes) at element offset `at` of `dst`.
    fn write(&self, dst: &mut Buffer, at: usize, src: &[u8]) -> Result<()>;
    /// Reads `len` elements from element offset `at` of `src`, as bytes.
    fn read(&self, src: &Buffer, at: usize, len: usize) -> Result<Vec<u8>>;
    /// Copies `len` elements from `src[src_at..]` to `dst[dst_at..]` on the device.
    fn copy(&self, src: &Buffer, src_at: usize, dst: &mut Buffer, dst_at: usize, len: usize) -> Result<()>;
    /// Compiles (or finds in a cache) and loads generated sources; a
    /// device may build several into one image (the simulator does).
    fn load_many(&self, gens: &[&Generated]) -> Result<Vec<Arc<Module>>>;
    /// Launches entry point `entry` of `m` on `grid` blocks. `args` must
    /// match the entry point's parameter list (checked).
    fn launch(&self, m: &Module, entry: &str, grid: [u32; 3], args: &mut [KernelArg<'_>]) -> Result<()>;
    /// Waits for every launch and copy issued so far; reports a kernel fault.
    fn sync(&self) -> Result<()>;
    /// Times `f` (which issues work on this device): `warmup` untimed runs,
    /// then `iters` timed ones. With `flush`, the device's caches are
    /// cleared before every timed run so the data comes from memory, as in
    /// serving. GPUs time with events on the stream; the simulator with
    /// the host clock.
    fn time(&self, warmup: usize, iters: usize, flush: bool, f: &mut dyn FnMut() -> Result<()>) -> Result<Timing>;
}

impl dyn Device {
    /// Loads one generated source.
    pub fn load(&self, g: &Generated) -> Result<Arc<Module>> {
        self.load_many(&[g])?
            .pop()
            .ok_or_else(|| Error::Config(format!("loading `{}` returned no module", g.name)))
    }
}

/// A new buffer holding `x`.
pub fn upload<T: DeviceElem>(dev: &dyn Device, x: &[T]) -> Result<Buffer> {
    let mut b = dev.alloc(T::ELEM, x.len())?;
    if !x.is_empty() {
        dev.write(&mut b, 0, as_bytes(x))?;
    }
    Ok(b)
}

/// Overwrites the start of `dst` with `x` (same element type).
pub fn write<T: DeviceElem>(dev: &dyn Device, dst: &mut Buffer, x: &[T]) -> Result<()> {
    if dst.elem != T::ELEM || x.len() > dst.len {
        return Err(Error::Config(format!(
            "writing {} {:?} values into {dst:?}",
            x.len(),
            T::ELEM
        )));
    }
    dev.write(dst, 0, as_bytes(x))
}

/// The whole of `src` back on the host.
pub fn download<T: DeviceElem>(dev: &dyn Device, src: &Buffer) -> Result<Vec<T>> {
    if src.elem != T::ELEM {
        return Err(Error::Config(format!("reading {src:?} as {:?}", T::ELEM)));
    }
    Ok(from_bytes(&dev.read(src, 0, src.len)?))
}

/// Bounds and type check shared by the implementations of read/write/copy.
pub(crate) fn check_range(b: &Buffer, at: usize, len: usize, what: &str) -> Result<()> {
    match at.checked_add(len) {
        Some(end) if end <= b.len => Ok(()),
        _ => Err(Error::Config(format!(
            "{what}: elements {at}..{} are outside {b:?}",
            at.saturating_add(len)
        ))),
    }
}

/// Opens the device named by `backend`: `sim` (always available where a C++
/// compiler is) or `cuda` (GPU 0). A missing GPU, driver or NVRTC is an
/// [`Error::Unavailable`] that says so.
pub fn open(backend: DeviceKind) -> Result<Arc<dyn Device>> {
    match backend {
        DeviceKind::Sim => Ok(SimDevice::shared()),
        DeviceKind::Cuda => Ok(Arc::new(crate::cuda::CudaDevice::new(0)?)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles() {
        let t = Timing::of(vec![5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!((t.median_ms, t.p20_ms, t.p80_ms, t.samples), (3.0, 2.0, 4.0, 5));
        assert!(Timing::of(vec![]).median_ms.is_nan());
    }

    #[test]
    fn bandwidth_from_attributes_or_table() {
        let mut i = DeviceInfo {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            arch: Arch::SM90,
            sms: 132,
            l2_bytes: 60 << 20,
            mem_clock_khz: 0,
            bus_width_bits: 0,
            total_mem: 0,
            driver_version: 13000,
        };
        assert_eq!(i.peak_bandwidth_gbs(), Some(4800.0));
        i.mem_clock_khz = 2_619_000;
        i.bus_width_bits = 6144;
        let bw = i.peak_bandwidth_gbs().unwrap();
        assert!((bw - 4022.8).abs() < 1.0, "{bw}");
        i.mem_clock_khz = 0;
        i.name = "mystery".into();
        assert_eq!(i.peak_bandwidth_gbs(), None);
    }

    #[test]
    fn bytes_round_trip() {
        let x = [1.5f32, -2.0, f32::MIN_POSITIVE];
        assert_eq!(from_bytes::<f32>(as_bytes(&x)), x);
        let y = [7u16, 65535];
        assert_eq!(from_bytes::<u16>(as_bytes(&y)), y);
    }
}
