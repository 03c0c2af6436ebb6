//! One GPU as a [`Device`]: its context and stream, the modules loaded on it
//! (compiled for its exact `sm_XX` and loaded as CUBIN, so the driver never
//! JITs), launches and CUDA-event timing.
//!
//! This file is the thin cudarc layer: the only code of the project that
//! runs on a GPU and nowhere else. Everything above it (`device::DeviceCache`,
//! the kernel argument structs, the tuner, the CLI, the GPU benchmark) is
//! shared with the simulated device and runs in CI.

use super::compile::{Arch, Compiler, NvrtcOptions};
use super::toolkit::{self, guarded};
use crate::device::{
    check_launch, check_range, Buffer, Device, DeviceInfo, DeviceKind, Elem, KernelArg, Mem, Module, ModuleInner,
    Timing,
};
use crate::error::{Error, Result};
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError, LaunchConfig, PushKernelArg,
};
use kivi_templates::Generated;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub(crate) fn driver_err(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Unavailable {
        backend: "cuda",
        reason: format!("{what}: {e:?}"),
    }
}

/// The kernels of a module loaded on a GPU.
pub(crate) struct CudaModuleFns {
    functions: HashMap<String, CudaFunction>,
    _module: Arc<CudaModule>,
}

fn cuda_slice(b: &Buffer) -> Result<&CudaSlice<u8>> {
    match &b.mem {
        Mem::Cuda(s) => Ok(s),
        Mem::Host(_) => Err(Error::Config(format!(
            "{b:?} belongs to the simulated device, not a GPU"
        ))),
    }
}

fn cuda_slice_mut(b: &mut Buffer) -> Result<&mut CudaSlice<u8>> {
    match &mut b.mem {
        Mem::Cuda(s) => Ok(s),
        Mem::Host(_) => Err(Error::Config("a simulated-device buffer was passed to a GPU".into())),
    }
}

/// A GPU with a compiler for its architecture.
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    info: DeviceInfo,
    compiler: Compiler,
    modules: Mutex<HashMap<u64, Arc<Module>>>,
}

impl CudaDevice {
    /// Opens GPU `ordinal`. Returns [`Error::Unavailable`] (never panics)
    /// when there is no driver, no such GPU, or no way to compile kernels.
    pub fn new(ordinal: usize) -> Result<CudaDevice> {
        if toolkit::disabled("driver") || !toolkit::driver_present() {
            return Err(Error::Unavailable {
                backend: "cuda",
                reason: "no CUDA driver (libcuda.so) on this machine".into(),
            });
        }
        let compiler = Compiler::new()?;
        guarded("CUDA driver", || {
            let n = CudaContext::device_count().map_err(driver_err("cuInit / cuDeviceGetCount"))?;
            if ordinal >= n.max(0) as usize {
                return Err(Error::Unavailable {
                    backend: "cuda",
                    reason: format!("GPU {ordinal} requested, the driver sees {n}"),
                });
            }
            let ctx = CudaContext::new(ordinal).map_err(driver_err("creating a context"))?;
            // One stream, ordered by itself: cudarc's per-buffer event
            // tracking would only add event records to every launch (and to
            // every timed iteration). Must precede every allocation.
            // SAFETY: all work of this device goes to `stream`.
            unsafe { ctx.disable_event_tracking() };
            let stream = ctx.new_stream().map_err(driver_err("creating a stream"))?;
            let attr = |a| ctx.attribute(a).unwrap_or(0);
            let (major, minor) = ctx.compute_capability().map_err(driver_err("compute capability"))?;
            let mut driver_version = 0;
            // SAFETY: an out-pointer to a live integer.
            let _ = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) };
            let info = DeviceInfo {
                ordinal,
                name: ctx.name().unwrap_or_else(|_| "unknown".into()),
                arch: Arch::from_cc(major, minor),
                sms: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                l2_bytes: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE),
                mem_clock_khz: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
                bus_width_bits: attr(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
                total_mem: ctx.total_mem().unwrap_or(0),
                driver_version,
            };
            Ok(CudaDevice {
                ctx,
                stream,
                info,
                compiler,
                modules: Mutex::new(HashMap::new()),
            })
        })
    }

    pub fn arch(&self) -> Arch {
        self.info.arch
    }
    /// NVRTC for this GPU's architecture.
    pub fn compiler(&self) -> &Compiler {
        &self.compiler
    }

    fn load_one(&self, g: &Generated) -> Result<Arc<Module>> {
        let opts = NvrtcOptions::for_arch(self.info.arch);
        if let Some(m) = self.modules.lock().unwrap_or_else(|e| e.into_inner()).get(&g.hash) {
            return Ok(m.clone());
        }
        let compiled = self.compiler.compile(&g.name, &g.source, &opts)?;
        let image = if compiled.artifact.cubin.is_empty() {
            cudarc::nvrtc::Ptx::from_src(compiled.artifact.ptx.clone())
        } else {
            cudarc::nvrtc::Ptx::from_binary(compiled.artifact.cubin.clone())
        };
        let module = guarded("loading a module", || {
            let module = self
                .ctx
                .load_module(image)
                .map_err(driver_err(&format!("loading `{}`", g.name)))?;
            let mut functions = HashMap::new();
            for e in &g.entry_points {
                let f = module
                    .load_function(e)
                    .map_err(driver_err(&format!("kernel `{e}` of `{}`", g.name)))?;
                functions.insert(e.clone(), f);
            }
            Ok(Arc::new(Module {
                generated: g.clone(),
                inner: ModuleInner::Cuda(Box::new(CudaModuleFns {
                    functions,
                    _module: module,
                })),
            }))
        })?;
        self.modules
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(g.hash, module.clone());
        Ok(module)
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Cuda
    }
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn describe(&self) -> String {
        format!(
            "{} ({}, {} SMs, NVRTC {})",
            self.info.name,
            self.info.arch,
            self.info.sms,
            self.compiler.version()
        )
    }
    fn alloc(&self, elem: Elem, len: usize) -> Result<Buffer> {
        let len = len.max(1);
        let bytes = len
            .checked_mul(elem.size())
            .ok_or_else(|| Error::Config(format!("an allocation of {len} {elem:?} elements is too large")))?;
        let s = guarded("allocating", || {
            self.stream.alloc_zeros::<u8>(bytes).map_err(driver_err("allocating"))
        })?;
        Ok(Buffer {
            elem,
            len,
            mem: Mem::Cuda(s),
        })
    }
    fn write(&self, dst: &mut Buffer, at: usize, src: &[u8]) -> Result<()> {
        let size = dst.elem().size();
        if !src.len().is_multiple_of(size) {
            return Err(Error::Config(format!("writing {} bytes into {dst:?}", src.len())));
        }
        check_range(dst, at, src.len() / size, "write")?;
        let s = cuda_slice_mut(dst)?;
        guarded("uploading", || {
            let mut view = s.slice_mut(at * size..at * size + src.len());
            self.stream.memcpy_htod(src, &mut view).map_err(driver_err("uploading"))
        })
    }
    fn read(&self, src: &Buffer, at: usize, len: usize) -> Result<Vec<u8>> {
        check_range(src, at, len, "read")?;
        let size = src.elem().size();
        let s = cuda_slice(src)?;
        guarded("downloading", || {
            let view = s.slice(at * size..(at + len) * size);
            self.stream.clone_dtoh(&view).map_err(driver_err("downloading"))
        })
    }
    fn copy(&self, src: &Buffer, src_at: usize, dst: &mut Buffer, dst_at: usize, len: usize) -> Result<()> {
        if src.elem() != dst.elem() {
            return Err(Error::Config(format!("copying {src:?} into {dst:?}")));
        }
        check_range(src, src_at, len, "copy source")?;
        check_range(dst, dst_at, len, "copy destination")?;
        let size = src.elem().size();
        let s = cuda_slice(src)?;
        let d = cuda_slice_mut(dst)?;
        guarded("copying on the device", || {
            let from = s.slice(src_at * size..(src_at + len) * size);
            let mut to = d.slice_mut(dst_at * size..(dst_at + len) * size);
            self.stream
                .memcpy_dtod(&from, &mut to)
                .map_err(driver_err("copying on the device"))
        })
    }
    fn load_many(&self, gens: &[&Generated]) -> Result<Vec<Arc<Module>>> {
        gens.iter().map(|g| self.load_one(g)).collect()
    }
    fn launch(&self, m: &Module, entry: &str, grid: [u32; 3], args: &mut [KernelArg<'_>]) -> Result<()> {
        let block = check_launch(m, entry, args)?;
        let ModuleInner::Cuda(fns) = &m.inner else {
            return Err(Error::Config(format!(
                "`{}` was loaded on the simulated device, not this GPU",
                m.generated.name
            )));
        };
        let f = fns
            .functions
            .get(entry)
            .ok_or_else(|| Error::Config(format!("`{}` has no entry point `{entry}`", m.generated.name)))?;
        // Scalars need a home that outlives the builder.
        let ints: Vec<i32> = args
            .iter()
            .map(|a| if let KernelArg::I32(x) = a { *x } else { 0 })
            .collect();
        let floats: Vec<f32> = args
            .iter()
            .map(|a| if let KernelArg::F32(x) = a { *x } else { 0.0 })
            .collect();
        let cfg = LaunchConfig {
            grid_dim: (grid[0], grid[1], grid[2]),
            block_dim: (block[0], block[1], block[2]),
            // The templates use static shared memory only.
            shared_mem_bytes: 0,
        };
        guarded("launching", || {
            let mut b = self.stream.launch_builder(f);
            for (i, a) in args.iter_mut().enumerate() {
                match a {
                    KernelArg::In(buf) => {
                        b.arg(cuda_slice(buf)?);
                    }
                    KernelArg::Out(buf) => {
                        b.arg(cuda_slice_mut(buf)?);
                    }
                    KernelArg::I32(_) => {
                        b.arg(&ints[i]);
                    }
                    KernelArg::F32(_) => {
                        b.arg(&floats[i]);
                    }
                }
            }
            // SAFETY: the arguments match the entry point's parameter list in
            // order and type (check_launch), and the typed argument structs of
            // `device::args` checked every buffer against what the launch reads.
            unsafe { b.launch(cfg) }
                .map(|_| ())
                .map_err(driver_err(&format!("launching `{entry}` of `{}`", m.generated.name)))
        })
    }
    fn sync(&self) -> Result<()> {
        guarded("synchronizing", || {
            self.stream.synchronize().map_err(driver_err("synchronizing"))
        })
    }
    fn time(&self, warmup: usize, iters: usize, flush: bool, f: &mut dyn FnMut() -> Result<()>) -> Result<Timing> {
        let mut scrub: Option<CudaSlice<u8>> = None;
        if flush {
            let bytes = (self.info.l2_bytes.max(8 << 20) as usize) * 2;
            scrub = Some(guarded("L2 flush buffer", || {
                self.stream
                    .alloc_zeros::<u8>(bytes)
                    .map_err(driver_err("L2 flush buffer"))
            })?);
        }
        let ev = || {
            self.ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(driver_err("creating an event"))
        };
        let (start, end) = (ev()?, ev()?);
        for _ in 0..warmup {
            f()?;
        }
        self.sync()?;
        let mut ms = Vec::with_capacity(iters);
        for _ in 0..iters {
            if let Some(s) = scrub.as_mut() {
                self.stream.memset_zeros(s).map_err(driver_err("L2 flush"))?;
            }
            start.record(&self.stream).map_err(driver_err("recording an event"))?;
            f()?;
            end.record(&self.stream).map_err(driver_err("recording an event"))?;
            ms.push(start.elapsed_ms(&end).map_err(driver_err("event timing"))? as f64);
        }
        Ok(Timing::of(ms))
    }
}
