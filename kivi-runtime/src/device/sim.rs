//! The simulated device: [`Device`] on the CPU. Memory is host memory
//! aligned like `cudaMalloc`'s (256 bytes, so a misaligned vector load is
//! the kernel's fault, as on a GPU); a module is the generated source
//! compiled through the shim into a [`SimLibrary`]; a launch runs the
//! kernel's blocks on the CPU; timing uses the host clock.

use super::{
    check_launch, check_range, Buffer, Device, DeviceInfo, DeviceKind, Elem, KernelArg, Mem, Module, ModuleInner,
    Timing,
};
use crate::cuda::Arch;
use crate::error::{Error, Result};
use crate::sim::{compile, SimLibrary};
use kivi_templates::Generated;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// 256 bytes, aligned as `cudaMalloc` aligns every allocation.
#[derive(Clone, Copy)]
#[repr(C, align(256))]
struct Chunk([u8; 256]);

/// Simulated device memory.
pub(crate) struct HostMem {
    chunks: Vec<Chunk>,
}

impl HostMem {
    fn zeroed(bytes: usize) -> HostMem {
        HostMem {
            chunks: vec![Chunk([0; 256]); bytes.div_ceil(256).max(1)],
        }
    }
    fn bytes(&self) -> &[u8] {
        // SAFETY: Chunk is a plain byte array (repr(C)); the chunks are contiguous.
        unsafe { std::slice::from_raw_parts(self.chunks.as_ptr() as *const u8, self.chunks.len() * 256) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.chunks.as_mut_ptr() as *mut u8, self.chunks.len() * 256) }
    }
}

fn host(b: &Buffer) -> Result<&HostMem> {
    match &b.mem {
        Mem::Host(h) => Ok(h),
        Mem::Cuda(_) => Err(Error::Config(format!(
            "{b:?} belongs to a GPU, not the simulated device"
        ))),
    }
}

fn host_mut(b: &mut Buffer) -> Result<&mut HostMem> {
    match &mut b.mem {
        Mem::Host(h) => Ok(h),
        Mem::Cuda(_) => Err(Error::Config("a GPU buffer was passed to the simulated device".into())),
    }
}

/// The simulator as a [`Device`].
///
/// Its [`DeviceInfo`] describes the GPU it stands in for (an H200-like
/// `sm_90` with 132 SMs by default; [`SimDevice::with_info`] sets another,
/// e.g. a fake fingerprint for tests of decision bundles): the architecture
/// decides which launch limits the simulator enforces, and the rest keys
/// tuning decisions made on it, which never mix with a real GPU's because
/// the backend name differs.
pub struct SimDevice {
    info: DeviceInfo,
    modules: Mutex<HashMap<u64, Arc<Module>>>,
}

impl SimDevice {
    /// A simulated `sm_90` GPU.
    pub fn new() -> SimDevice {
        SimDevice::with_info(DeviceInfo {
            ordinal: 0,
            name: "kivi-sim (generated CUDA on the CPU)".into(),
            arch: Arch::SM90,
            sms: 132,
            l2_bytes: 50 << 20,
            mem_clock_khz: 0,
            bus_width_bits: 0,
            total_mem: 0,
            driver_version: 0,
        })
    }

    /// A simulated device that reports `info`.
    pub fn with_info(info: DeviceInfo) -> SimDevice {
        SimDevice {
            info,
            modules: Mutex::new(HashMap::new()),
        }
    }

    /// One process-wide simulated device (its modules are shared by every user).
    pub fn shared() -> Arc<dyn Device> {
        static DEV: OnceLock<Arc<SimDevice>> = OnceLock::new();
        DEV.get_or_init(|| Arc::new(SimDevice::new())).clone()
    }
}

impl Default for SimDevice {
    fn default() -> Self {
        SimDevice::new()
    }
}

impl Device for SimDevice {
    fn kind(&self) -> DeviceKind {
        DeviceKind::Sim
    }
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn describe(&self) -> String {
        format!(
            "{} ({} limits, {} SMs; C++ compiler {})",
            self.info.name,
            self.info.arch,
            self.info.sms,
            crate::sim::find_compiler().unwrap_or_else(|e| e.to_string())
        )
    }
    fn alloc(&self, elem: Elem, len: usize) -> Result<Buffer> {
        let len = len.max(1);
        let bytes = len
            .checked_mul(elem.size())
            .filter(|b| *b <= isize::MAX as usize / 2)
            .ok_or_else(|| Error::Config(format!("an allocation of {len} {elem:?} elements is too large")))?;
        Ok(Buffer {
            elem,
            len,
            mem: Mem::Host(HostMem::zeroed(bytes)),
        })
    }
    fn write(&self, dst: &mut Buffer, at: usize, src: &[u8]) -> Result<()> {
        let size = dst.elem.size();
        if !src.len().is_multiple_of(size) {
            return Err(Error::Config(format!("writing {} bytes into {dst:?}", src.len())));
        }
        check_range(dst, at, src.len() / size, "write")?;
        host_mut(dst)?.bytes_mut()[at * size..][..src.len()].copy_from_slice(src);
        Ok(())
    }
    fn read(&self, src: &Buffer, at: usize, len: usize) -> Result<Vec<u8>> {
        check_range(src, at, len, "read")?;
        let size = src.elem.size();
        Ok(host(src)?.bytes()[at * size..][..len * size].to_vec())
    }
    fn copy(&self, src: &Buffer, src_at: usize, dst: &mut Buffer, dst_at: usize, len: usize) -> Result<()> {
        if src.elem != dst.elem {
            return Err(Error::Config(format!("copying {src:?} into {dst:?}")));
        }
        check_range(src, src_at, len, "copy source")?;
        check_range(dst, dst_at, len, "copy destination")?;
        let size = src.elem.size();
        let bytes = host(src)?.bytes()[src_at * size..][..len * size].to_vec();
        host_mut(dst)?.bytes_mut()[dst_at * size..][..len * size].copy_from_slice(&bytes);
        Ok(())
    }
    fn load_many(&self, gens: &[&Generated]) -> Result<Vec<Arc<Module>>> {
        let missing: Vec<&Generated> = {
            let m = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            let mut v: Vec<&Generated> = Vec::new();
            for g in gens {
                if !m.contains_key(&g.hash) && !v.iter().any(|x| x.hash == g.hash) {
                    v.push(g);
                }
            }
            v
        };
        if !missing.is_empty() {
            // One library for the whole batch: the shim's headers are parsed
            // once per translation unit, not once per variant.
            let lib: Arc<SimLibrary> = compile(&missing)?;
            let mut m = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            for g in missing {
                m.entry(g.hash).or_insert_with(|| {
                    Arc::new(Module {
                        generated: g.clone(),
                        inner: ModuleInner::Sim(lib.clone()),
                    })
                });
            }
        }
        let m = self.modules.lock().unwrap_or_else(|e| e.into_inner());
        gens.iter()
            .map(|g| {
                m.get(&g.hash)
                    .cloned()
                    .ok_or_else(|| Error::Config(format!("`{}` was not loaded", g.name)))
            })
            .collect()
    }
    fn launch(&self, m: &Module, entry: &str, grid: [u32; 3], args: &mut [KernelArg<'_>]) -> Result<()> {
        let block = check_launch(m, entry, args)?;
        let ModuleInner::Sim(lib) = &m.inner else {
            return Err(Error::Config(format!(
                "`{}` was loaded on a GPU, not the simulated device",
                m.generated.name
            )));
        };
        // Storage the void** array points into: a pointer or a scalar per argument.
        let mut slots: Vec<u64> = Vec::with_capacity(args.len());
        for a in args.iter_mut() {
            slots.push(match a {
                KernelArg::In(b) => host(b)?.chunks.as_ptr() as u64,
                KernelArg::Out(b) => host_mut(b)?.chunks.as_mut_ptr() as u64,
                KernelArg::I32(x) => *x as u32 as u64,
                KernelArg::F32(x) => x.to_bits() as u64,
            });
        }
        // Little-endian: an int or float argument is the low bytes of its slot.
        let mut ptrs: Vec<*mut c_void> = slots.iter_mut().map(|s| s as *mut u64 as *mut c_void).collect();
        // The schedule, poison and limits of the process (KIVI_SIM_SCHEDULE,
        // test scopes), for the architecture this device stands in for.
        let mut opts = crate::sim::SimOptions::current()?;
        opts.arch = self.info.arch;
        // SAFETY: the argument list matches the entry point's parameters in
        // number and type (check_launch), and the typed argument structs of
        // `device::args` checked every buffer against what the launch reads.
        unsafe { lib.launch_raw(&m.generated, entry, grid, block, &mut ptrs, &opts) }
    }
    fn sync(&self) -> Result<()> {
        Ok(()) // launches run to completion before they return
    }
    fn time(&self, warmup: usize, iters: usize, _flush: bool, f: &mut dyn FnMut() -> Result<()>) -> Result<Timing> {
        for _ in 0..warmup {
            f()?;
        }
        let mut ms = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t = Instant::now();
            f()?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        Ok(Timing::of(ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{download, upload};

    #[test]
    fn memory_is_aligned_checked_and_round_trips() {
        let d = SimDevice::new();
        let mut b = upload(&d, &[1u32, 2, 3, 4, 5]).unwrap();
        assert_eq!(host(&b).unwrap().chunks.as_ptr() as usize % 256, 0);
        assert_eq!(download::<u32>(&d, &b).unwrap(), [1, 2, 3, 4, 5]);
        d.write(&mut b, 3, crate::device::as_bytes(&[9u32, 8])).unwrap();
        assert_eq!(download::<u32>(&d, &b).unwrap(), [1, 2, 3, 9, 8]);
        assert!(d.write(&mut b, 4, crate::device::as_bytes(&[9u32, 8])).is_err());
        assert!(d.read(&b, 5, 1).is_err());
        assert!(download::<f32>(&d, &b).is_err(), "element type is checked");
        let mut c = d.alloc(Elem::U32, 5).unwrap();
        d.copy(&b, 1, &mut c, 0, 4).unwrap();
        assert_eq!(download::<u32>(&d, &c).unwrap(), [2, 3, 9, 8, 0]);
        assert!(d.alloc(Elem::F32, usize::MAX / 2).is_err());
        assert_eq!(d.alloc(Elem::F32, 0).unwrap().len(), 1);
    }
}
