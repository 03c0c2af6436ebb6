//! One GPU: its context and stream, the modules loaded on it (compiled for
//! its exact `sm_XX` and loaded as CUBIN, so the driver never JITs), and
//! CUDA-event timing.

use super::compile::{Arch, Compiler, NvrtcOptions};
use super::toolkit::{self, guarded};
use crate::error::{Error, Result};
use cudarc::driver::sys::{CUdevice_attribute, CUevent_flags};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DriverError};
use kivi_templates::Generated;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

pub(crate) fn driver_err(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Unavailable {
        backend: "cuda",
        reason: format!("{what}: {e:?}"),
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

/// A module loaded on the device with its kernels.
pub struct Loaded {
    pub generated: Generated,
    functions: HashMap<String, CudaFunction>,
    _module: Arc<CudaModule>,
}

impl Loaded {
    /// The kernel `entry` (an entry point of the generated source).
    pub fn function(&self, entry: &str) -> Result<&CudaFunction> {
        self.functions
            .get(entry)
            .ok_or_else(|| Error::Config(format!("`{}` has no entry point `{entry}`", self.generated.name)))
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

/// A GPU with a compiler for its architecture.
pub struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    info: DeviceInfo,
    compiler: Compiler,
    modules: Mutex<HashMap<u64, Arc<Loaded>>>,
}

impl Device {
    /// Opens GPU `ordinal`. Returns [`Error::Unavailable`] (never panics)
    /// when there is no driver, no such GPU, or no way to compile kernels.
    pub fn new(ordinal: usize) -> Result<Device> {
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
            Ok(Device {
                ctx,
                stream,
                info,
                compiler,
                modules: Mutex::new(HashMap::new()),
            })
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }
    pub fn arch(&self) -> Arch {
        self.info.arch
    }
    pub fn compiler(&self) -> &Compiler {
        &self.compiler
    }
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Compiles (or reads from the artifact cache) and loads a generated
    /// source; loaded once per process per source.
    pub fn load(&self, g: &Generated) -> Result<Arc<Loaded>> {
        let opts = NvrtcOptions::for_arch(self.info.arch);
        let key = self.compiler.key(&g.source, &opts);
        let id = (key.0 as u64) ^ ((key.0 >> 64) as u64);
        if let Some(l) = self.modules.lock().expect("module map").get(&id) {
            return Ok(l.clone());
        }
        let compiled = self.compiler.compile(&g.name, &g.source, &opts)?;
        let image = if compiled.artifact.cubin.is_empty() {
            cudarc::nvrtc::Ptx::from_src(compiled.artifact.ptx.clone())
        } else {
            cudarc::nvrtc::Ptx::from_binary(compiled.artifact.cubin.clone())
        };
        let loaded = guarded("loading a module", || {
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
            Ok(Arc::new(Loaded {
                generated: g.clone(),
                functions,
                _module: module,
            }))
        })?;
        self.modules.lock().expect("module map").insert(id, loaded.clone());
        Ok(loaded)
    }

    /// Waits for the stream.
    pub fn sync(&self) -> Result<()> {
        self.stream.synchronize().map_err(driver_err("synchronizing"))
    }

    /// Times `f` (which enqueues work on this device's stream) with CUDA
    /// events recorded on that stream: `warmup` untimed runs, then `iters`
    /// timed ones. With `flush` set, a buffer of twice the L2 size is
    /// cleared before every run (outside the events) so the data `f` reads
    /// comes from DRAM, as in serving.
    pub fn time(&self, warmup: usize, iters: usize, flush: bool, mut f: impl FnMut() -> Result<()>) -> Result<Timing> {
        let mut scrub: Option<CudaSlice<u8>> = None;
        if flush {
            let bytes = (self.info.l2_bytes.max(8 << 20) as usize) * 2;
            scrub = Some(
                self.stream
                    .alloc_zeros::<u8>(bytes)
                    .map_err(driver_err("L2 flush buffer"))?,
            );
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
}
