//! CUDA as a tuning target, and the static ranking of CUDA variants.
//!
//! - [`static_ranking`] needs no GPU: it generates every decode variant,
//!   compiles it with NVRTC for an architecture (when NVRTC is present),
//!   reads ptxas's resource report (registers, spills, shared memory),
//!   estimates occupancy from the architecture's limits, prunes what
//!   cannot run well, and ranks the rest. `kivi tune` prints it where no
//!   GPU is usable.
//! - [`CudaTarget`] tunes on a device: a real GPU (the same pruning, then
//!   the shared methodology of [`crate::tune`] with CUDA events on the
//!   kernel's stream and L2 flushed before every timed launch) or the
//!   simulated device, which runs the same host code on the CPU.

use crate::bucket::Bucket;
use crate::cpu::{build_inputs_with, check_inputs_in, compare};
use crate::fingerprint::{Fingerprint, Toolchain};
use crate::tune::{Candidate, Method, Target, Workload};
use kivi_runtime::cuda::ptxas::Resources;
use kivi_runtime::cuda::{Arch, Compiler, CudaDevice, NvrtcOptions};
use kivi_runtime::device::{Device, DeviceCache, DeviceKind};
use kivi_runtime::AttnParams;
use kivi_spec::Scheme;
use kivi_templates::{generate, generate_calibrated, variants, Codebooks, GenOptions, Generated, Kernel, Variant};
use rayon::prelude::*;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Per-SM limits of an architecture (the occupancy calculator's inputs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SmLimits {
    pub regs_per_sm: u32,
    pub max_threads_per_sm: u32,
    pub max_blocks_per_sm: u32,
    pub smem_per_sm: u32,
    /// Shared memory the driver reserves per block.
    pub smem_reserved_per_block: u32,
    /// Registers are allocated per warp in units of this many.
    pub reg_alloc_unit: u32,
    pub sms: u32,
}

impl SmLimits {
    /// Limits for `arch` (datasheet values), with `sms` multiprocessors.
    pub fn of(arch: Arch, sms: u32) -> SmLimits {
        let (threads, blocks, smem_kib) = match arch.0 {
            90.. => (2048, 32, 228),
            86 | 87 | 89 => (1536, if arch.0 == 89 { 24 } else { 16 }, 100),
            80 => (2048, 32, 164),
            _ => (1024, 16, 64),
        };
        SmLimits {
            regs_per_sm: 65536,
            max_threads_per_sm: threads,
            max_blocks_per_sm: blocks,
            smem_per_sm: smem_kib * 1024,
            smem_reserved_per_block: 1024,
            reg_alloc_unit: 256,
            sms,
        }
    }

    /// Resident blocks per SM for a kernel, and what limits it.
    pub fn blocks_per_sm(&self, threads: u32, regs: u32, smem: u32) -> (u32, &'static str) {
        let warps = threads.div_ceil(32).max(1);
        let regs_per_warp = (regs.max(1) * 32).div_ceil(self.reg_alloc_unit) * self.reg_alloc_unit;
        let by_regs = self.regs_per_sm / (regs_per_warp * warps);
        let by_smem = self.smem_per_sm / (smem + self.smem_reserved_per_block);
        let by_threads = self.max_threads_per_sm / (warps * 32);
        let mut best = (self.max_blocks_per_sm, "block limit");
        for (n, why) in [
            (by_regs, "registers"),
            (by_smem, "shared memory"),
            (by_threads, "threads"),
        ] {
            if n < best.0 {
                best = (n, why);
            }
        }
        best
    }
}

/// One variant's static facts and verdict.
#[derive(Clone, Debug)]
pub struct StaticRow {
    pub name: String,
    pub hash: u64,
    pub threads: u32,
    pub shared_bytes: u32,
    pub grid_blocks: u32,
    /// `Ok(resources of the decode entry)` or why it was not compiled.
    pub compiled: Result<Option<Resources>, String>,
    pub blocks_per_sm: Option<(u32, &'static str)>,
    /// Occupancy x wave efficiency (higher is better), when known.
    pub score: Option<f64>,
    /// `Some(reason)` when pruned.
    pub pruned: Option<String>,
}

/// Why a compiled variant should not be timed, if it should not.
pub fn prune_reason(threads: u32, res: &Resources, limits: &SmLimits) -> Option<String> {
    if res.spills() {
        return Some(format!(
            "spills ({} bytes stored, {} loaded)",
            res.spill_stores, res.spill_loads
        ));
    }
    let (bps, why) = limits.blocks_per_sm(threads, res.registers, res.shared);
    if bps == 0 {
        return Some(format!(
            "cannot launch: {} registers x {threads} threads or {} B shared memory exceed one SM ({why})",
            res.registers, res.shared
        ));
    }
    None
}

fn decode_launch(g: &Generated, batch: u32) -> (u32, u32, u32) {
    match g.launch.entry("kivi_decode") {
        Some(e) => {
            let grid = e.grid(batch, 0);
            (
                e.block[0] * e.block[1] * e.block[2],
                e.shared_bytes,
                grid[0] * grid[1] * grid[2],
            )
        }
        None => (0, 0, 0),
    }
}

/// Occupancy (resident warps / max) times wave efficiency (busy SM slots in
/// the last wave / all slots): a memory-bound decode kernel wants both high.
fn score(limits: &SmLimits, threads: u32, bps: u32, grid_blocks: u32) -> f64 {
    let warps = threads.div_ceil(32);
    let occ = (bps * warps) as f64 / (limits.max_threads_per_sm / 32) as f64;
    let slots = (bps * limits.sms).max(1);
    let waves = grid_blocks.div_ceil(slots).max(1);
    let eff = grid_blocks as f64 / (waves * slots) as f64;
    occ.min(1.0) * eff
}

/// Statically ranks the decode variants of `scheme` for `bucket` on `arch`
/// with `sms` multiprocessors, compiling with `compiler` when given. Rows
/// come back best first (pruned ones last); the canonical default keeps
/// its place among equals.
pub fn static_ranking(
    scheme: &Scheme,
    bucket: &Bucket,
    arch: Arch,
    sms: u32,
    compiler: Option<&Compiler>,
) -> Result<Vec<StaticRow>, String> {
    let limits = SmLimits::of(arch, sms);
    let vs = variants(scheme, Kernel::Decode);
    if vs.is_empty() {
        return Err(format!(
            "the generator offers no decode variant for scheme `{}`",
            scheme.name
        ));
    }
    let opts = NvrtcOptions::for_arch(arch);
    let mut rows: Vec<StaticRow> = vs
        .par_iter()
        .map(|v| {
            let g = match generate(scheme, Kernel::Decode, v) {
                Ok(g) => g,
                Err(e) => {
                    return StaticRow {
                        name: v.name(),
                        hash: 0,
                        threads: v.threads,
                        shared_bytes: 0,
                        grid_blocks: 0,
                        compiled: Err(e.to_string()),
                        blocks_per_sm: None,
                        score: None,
                        pruned: Some(format!("generation failed: {e}")),
                    }
                }
            };
            let (threads, shared, grid_blocks) = decode_launch(&g, bucket.batch);
            let compiled = match compiler {
                None => Err("NVRTC not available".to_string()),
                Some(c) => c
                    .compile(&g.name, &g.source, &opts)
                    .map(|k| k.resources().into_iter().find(|r| r.function.contains("kivi_decode")))
                    .map_err(|e| e.to_string()),
            };
            let res = compiled.as_ref().ok().and_then(|r| r.clone());
            let regs = res.as_ref().map(|r| r.registers);
            let smem = res.as_ref().map_or(shared, |r| r.shared.max(shared));
            let pruned = match (&compiled, &res) {
                (Err(e), _) if compiler.is_some() => Some(format!("compile failed: {e}")),
                (_, Some(r)) => prune_reason(threads, r, &limits),
                _ => None,
            };
            // Without ptxas numbers assume 64 registers, a typical decode kernel.
            let bps = limits.blocks_per_sm(threads, regs.unwrap_or(64), smem);
            StaticRow {
                name: v.name(),
                hash: g.hash,
                threads,
                shared_bytes: smem,
                grid_blocks,
                compiled,
                blocks_per_sm: Some(bps),
                score: (bps.0 > 0).then(|| score(&limits, threads, bps.0, grid_blocks)),
                pruned,
            }
        })
        .collect();
    // Stable sort: pruned last, then by score (descending).
    rows.sort_by(|a, b| {
        a.pruned
            .is_some()
            .cmp(&b.pruned.is_some())
            .then(b.score.unwrap_or(0.0).total_cmp(&a.score.unwrap_or(0.0)))
    });
    Ok(rows)
}

/// What keys a device's tuning decisions: its kind (`cuda` or `sim`), name
/// and hardware facts — never the ordinal.
pub fn device_fingerprint(dev: &dyn Device) -> Fingerprint {
    let i = dev.info();
    let mut facts = BTreeMap::new();
    facts.insert("cc".to_string(), i.arch.name());
    facts.insert("sm_count".to_string(), i.sms.to_string());
    facts.insert("l2".to_string(), i.l2_bytes.to_string());
    facts.insert("mem_clock_khz".to_string(), i.mem_clock_khz.to_string());
    facts.insert("bus_width_bits".to_string(), i.bus_width_bits.to_string());
    facts.insert("total_mem".to_string(), i.total_mem.to_string());
    facts.insert("driver".to_string(), i.driver_version.to_string());
    Fingerprint {
        backend: dev.kind().name().into(),
        name: i.name.clone(),
        facts,
    }
}

/// The toolchain half of a device's decision key: NVRTC's version on a GPU,
/// the host C++ compiler on the simulated device.
pub fn device_toolchain(dev: &dyn Device, compiler: Option<&Compiler>) -> Toolchain {
    let c = match (compiler, dev.kind()) {
        (Some(c), DeviceKind::Cuda) => format!("nvrtc {}", c.version()),
        (_, DeviceKind::Sim) => format!(
            "sim {}",
            kivi_runtime::sim::find_compiler().unwrap_or_else(|_| "no C++ compiler".into())
        ),
        (None, DeviceKind::Cuda) => "nvrtc (unknown)".into(),
    };
    Toolchain::current(&c)
}

/// The generated kernels on a [`Device`] as a tuning target: a GPU through
/// cudarc, or the simulated device (`kivi tune --backend sim`), which runs
/// exactly this code — candidates, correctness gate, timing loop — on the
/// CPU, so none of it is GPU-only. Simulated timings rank nothing useful;
/// they exist so the path is exercised.
pub struct CudaTarget {
    scheme: Scheme,
    dev: Arc<dyn Device>,
    /// NVRTC for the device's architecture (ptxas resources for pruning):
    /// the GPU's own; on the simulated device, NVRTC when it is provisioned.
    compiler: Option<Compiler>,
    limits: SmLimits,
    /// Generated sources by variant name, canonical order.
    gens: Vec<(Variant, Generated)>,
    pub method: Method,
    /// The calibration (and layer) the tuning caches are built with:
    /// `vq(...)` schemes decode with its codebooks (a kernel argument, so
    /// the sources are the same for every calibration).
    calibration: Option<crate::cpu::Calib>,
}

impl CudaTarget {
    /// GPU 0 and the generated decode variants of `scheme` (bound to a
    /// shape). Without a GPU this is an error that says why: `kivi tune
    /// --backend cuda` never tunes something else instead.
    pub fn new(scheme: &Scheme) -> Result<CudaTarget, String> {
        let dev = CudaDevice::new(0).map_err(|e| e.to_string())?;
        let compiler = Some(dev.compiler().clone());
        CudaTarget::with_device(scheme, Arc::new(dev), compiler)
    }

    /// The simulated device (an `sm_90` with 132 SMs unless `dev` says otherwise).
    pub fn sim(scheme: &Scheme, dev: Arc<dyn Device>) -> Result<CudaTarget, String> {
        CudaTarget::with_device(scheme, dev, Compiler::new().ok())
    }

    /// Any device, with an optional NVRTC for static resource checks.
    pub fn with_device(
        scheme: &Scheme,
        dev: Arc<dyn Device>,
        compiler: Option<Compiler>,
    ) -> Result<CudaTarget, String> {
        let info = dev.info();
        let limits = SmLimits::of(info.arch, info.sms.max(1) as u32);
        // A `levels = nuq` scheme's sources bake in its tables: they are
        // generated by `with_calibration`, which it needs before tuning.
        let gens = if needs_tables(scheme) {
            Vec::new()
        } else {
            generate_all(scheme, &Codebooks::default())?
        };
        let method = match dev.kind() {
            DeviceKind::Cuda => Method {
                // Every launch is timed by CUDA events with L2 flushed
                // before it; a sample is the median of enough launches to
                // span 0.5 ms (at most 20), which amortises the flush
                // buffer's set-up and keeps one slow launch from counting.
                warmup_s: 0.01,
                min_sample_s: 0.0005,
                max_iters: 20,
                first_round: 5,
                max_samples: 25,
                ..Method::default()
            },
            // Simulated launches take milliseconds to seconds: few samples.
            DeviceKind::Sim => Method {
                warmup_s: 0.0,
                min_sample_s: 0.0,
                max_iters: 1,
                first_round: 2,
                max_samples: 3,
                ..Method::default()
            },
        };
        Ok(CudaTarget {
            scheme: scheme.clone(),
            dev,
            compiler,
            limits,
            gens,
            method,
            calibration: None,
        })
    }

    /// This target with tuning caches built with the codebooks of `layer`
    /// in `calibration` (what `vq(...)` and `levels = nuq` schemes need),
    /// its decisions keyed by the scheme hash joined with the calibration's
    /// ([`crate::tune::decision_hash`]). Checked now (model shape, every
    /// codebook the scheme needs at `layer`), so a wrong calibration fails
    /// here, not mid-tuning. vq codebooks are kernel arguments (the sources
    /// are the same for every calibration); `nuq` tables are baked into the
    /// source, so a nuq scheme's variants are generated here, with them.
    pub fn with_calibration(
        mut self,
        calibration: &kivi_runtime::calib::Calibration,
        layer: usize,
    ) -> Result<CudaTarget, String> {
        calibration.check_shape(&self.scheme).map_err(|e| e.to_string())?;
        kivi_runtime::vq::books_for(&self.scheme, Some(calibration), layer).map_err(|e| e.to_string())?;
        let levels =
            kivi_runtime::calib::levels_for(&self.scheme, Some(calibration), layer).map_err(|e| e.to_string())?;
        if needs_tables(&self.scheme) {
            let cb = kivi_runtime::device::nuq_codebooks(&self.scheme, levels);
            self.gens = generate_all(&self.scheme, &cb)?;
        }
        self.calibration = Some((Arc::new(calibration.clone()), layer));
        Ok(self)
    }

    /// The device tuned on.
    pub fn device_handle(&self) -> &Arc<dyn Device> {
        &self.dev
    }

    /// The variant behind a candidate name.
    pub fn variant(&self, name: &str) -> Option<Variant> {
        self.gens.iter().find(|(v, _)| v.name() == name).map(|(v, _)| *v)
    }

    fn generated(&self, name: &str) -> Result<&Generated, String> {
        self.gens
            .iter()
            .find(|(v, _)| v.name() == name)
            .map(|(_, g)| g)
            .ok_or_else(|| format!("`{name}` is not a decode variant"))
    }
}

/// Whether `scheme` has `levels = nuq` tensors, whose tables the
/// generated source bakes in (so its variants need a calibration).
fn needs_tables(scheme: &Scheme) -> bool {
    [kivi_spec::Tensor::Key, kivi_spec::Tensor::Value].into_iter().any(|t| {
        scheme
            .codec(t)
            .quant()
            .is_some_and(|q| matches!(q.levels, kivi_spec::Levels::Nuq(_)))
    })
}

/// Every decode variant of `scheme`, generated with the `nuq` tables `cb`
/// (none for a scheme without such tensors), canonical order.
fn generate_all(scheme: &Scheme, cb: &Codebooks) -> Result<Vec<(Variant, Generated)>, String> {
    let mut gens = Vec::new();
    for v in variants(scheme, Kernel::Decode) {
        let g = if cb.tag().is_some() {
            generate_calibrated(scheme, Kernel::Decode, &v, GenOptions::default(), cb)
        } else {
            generate(scheme, Kernel::Decode, &v)
        }
        .map_err(|e| e.to_string())?;
        gens.push((v, g));
    }
    if gens.is_empty() {
        return Err(format!(
            "the generator offers no decode variant for scheme `{}`",
            scheme.name
        ));
    }
    Ok(gens)
}

impl Target for CudaTarget {
    fn backend(&self) -> &'static str {
        self.dev.kind().name()
    }
    fn device(&self) -> Fingerprint {
        device_fingerprint(self.dev.as_ref())
    }
    fn toolchain(&self) -> Toolchain {
        device_toolchain(self.dev.as_ref(), self.compiler.as_ref())
    }
    fn candidates(&self, bucket: &Bucket) -> Vec<Candidate> {
        self.gens
            .iter()
            .map(|(v, g)| {
                let (threads, shared, grid) = decode_launch(g, bucket.batch);
                Candidate {
                    name: v.name(),
                    hash: g.hash,
                    notes: vec![format!(
                        "{threads} threads/block, {grid} blocks, {shared} B static shared memory"
                    )],
                }
            })
            .collect()
    }
    fn check(&self, c: &Candidate, bucket: &Bucket) -> Result<(), String> {
        let g = self.generated(&c.name)?;
        let Some(compiler) = &self.compiler else {
            return Ok(()); // the simulator without NVRTC: launch limits only, checked at launch
        };
        let compiled = compiler
            .compile(&g.name, &g.source, &NvrtcOptions::for_arch(self.dev.info().arch))
            .map_err(|e| format!("compile failed: {e}"))?;
        let (threads, _, _) = decode_launch(g, bucket.batch);
        if let Some(r) = compiled
            .resources()
            .into_iter()
            .find(|r| r.function.contains("kivi_decode"))
        {
            if let Some(why) = prune_reason(threads, &r, &self.limits) {
                return Err(why);
            }
        }
        Ok(())
    }
    fn workload<'a>(&'a self, bucket: &Bucket, _prep: f64) -> Result<Box<dyn Workload + 'a>, String> {
        if self.gens.is_empty() {
            return Err(format!(
                "scheme `{}` has levels = nuq tensors, whose tables its kernels bake in: build the target with_calibration",
                self.scheme.name
            ));
        }
        let calib = self.calibration.as_ref();
        let (cache, seqs, q, attn, want) = build_inputs_with(&self.scheme, bucket, calib)?;
        let dc = DeviceCache::upload(self.dev.clone(), &cache, &seqs).map_err(|e| e.to_string())?;
        let (ccache, cseqs, cq, cattn, cwant) = check_inputs_in(&self.scheme, bucket, calib)?;
        let check = DeviceCache::upload(self.dev.clone(), &ccache, &cseqs).map_err(|e| e.to_string())?;
        let bytes = dc.decode_bytes() as u64;
        // Load every candidate at once (the simulator builds one library).
        let names: Vec<Variant> = self.gens.iter().map(|(v, _)| *v).collect();
        dc.decode_modules(&names).map_err(|e| e.to_string())?;
        Ok(Box::new(CudaWorkload {
            target: self,
            dc,
            q,
            attn,
            want,
            check: (check, cq, cattn, cwant),
            bytes,
        }))
    }
    fn method(&self) -> Method {
        self.method.clone()
    }
    fn peak_gbps(&self) -> Option<f64> {
        self.dev.info().peak_bandwidth_gbs()
    }
    fn calibration_hash(&self) -> Option<u64> {
        self.calibration.as_ref().map(|(c, _)| c.hash())
    }
}

struct CudaWorkload<'a> {
    target: &'a CudaTarget,
    dc: DeviceCache,
    q: Vec<f32>,
    attn: AttnParams,
    want: Vec<f32>,
    /// The second input set of the correctness gate (edge lengths).
    check: (DeviceCache, Vec<f32>, AttnParams, Vec<f32>),
    bytes: u64,
}

impl Workload for CudaWorkload<'_> {
    fn bytes_per_call(&self) -> u64 {
        self.bytes
    }
    fn verify(&mut self, c: &Candidate) -> Result<(), String> {
        let v = self.target.variant(&c.name).ok_or("unknown variant")?;
        let got = self
            .dc
            .decode(&self.q, self.attn, Some(v))
            .map_err(|e| format!("failed: {e}"))?;
        compare(&got, &self.want)?;
        let (dc, q, attn, want) = &self.check;
        let got = dc
            .decode(q, *attn, Some(v))
            .map_err(|e| format!("failed on the edge-length inputs: {e}"))?;
        compare(&got, want).map_err(|e| format!("edge-length inputs: {e}"))
    }
    fn sample(&mut self, c: &Candidate, iters: u32) -> Result<f64, String> {
        // Compile and load happen outside timing (the module is cached by
        // the device after verification).
        let v = self.target.variant(&c.name).ok_or("unknown variant")?;
        let m = self.dc.decode_module(Some(v)).map_err(|e| e.to_string())?;
        let mut run = self
            .dc
            .prepare_decode(&m, &self.q, self.attn)
            .map_err(|e| e.to_string())?;
        // The median of `iters` flushed, timed launches.
        let t = run.time(0, iters.max(1) as usize).map_err(|e| e.to_string())?;
        Ok(t.median_ms / 1e3)
    }
    fn describe(&self) -> String {
        match self.target.dev.kind() {
            DeviceKind::Cuda => "CUDA events on the kernel's stream, L2 flushed (2x L2 cleared) before every launch, one launch per sample".into(),
            DeviceKind::Sim => "simulated device: host clock around each simulated launch (not a GPU timing; exercises the tuning path)".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn occupancy_follows_the_tightest_limit() {
        let l = SmLimits::of(Arch::SM90, 132);
        // 64 regs x 128 threads = 8192 regs per block -> 8 blocks by registers.
        assert_eq!(l.blocks_per_sm(128, 64, 8752), (8, "registers"));
        // 200 KiB of shared memory: one block.
        assert_eq!(l.blocks_per_sm(128, 32, 200 * 1024), (1, "shared memory"));
        // 1024 threads at 16 regs: two blocks by threads (four by registers).
        assert_eq!(l.blocks_per_sm(1024, 16, 0), (2, "threads"));
        // 255 regs x 1024 threads cannot launch.
        assert_eq!(l.blocks_per_sm(1024, 255, 0).0, 0);
    }

    #[test]
    fn spills_and_unlaunchable_kernels_are_pruned() {
        let l = SmLimits::of(Arch::SM90, 132);
        let ok = Resources {
            function: "kivi_decode".into(),
            registers: 64,
            ..Resources::default()
        };
        assert_eq!(prune_reason(128, &ok, &l), None);
        let spill = Resources {
            spill_stores: 16,
            ..ok.clone()
        };
        assert!(prune_reason(128, &spill, &l).unwrap().contains("spills"));
        let fat = Resources { registers: 255, ..ok };
        assert!(prune_reason(1024, &fat, &l).unwrap().contains("cannot launch"));
    }

    #[test]
    fn static_ranking_without_nvrtc_ranks_every_variant() {
        let s = kivi_spec::presets::kivi2()
            .with_shape(kivi_spec::Heads::Gqa { q: 32, kv: 8 }, 128)
            .unwrap();
        let b = Bucket::of(1, 4096, 4);
        let rows = static_ranking(&s, &b, Arch::SM90, 132, None).unwrap();
        assert_eq!(rows.len(), variants(&s, Kernel::Decode).len());
        assert!(rows
            .iter()
            .all(|r| r.pruned.is_none() && r.compiled.is_err() && r.score.is_some()));
        assert!(rows.windows(2).all(|w| w[0].score >= w[1].score));
        let unbound = kivi_spec::presets::kivi2();
        assert!(static_ranking(&unbound, &b, Arch::SM90, 132, None).is_err());
    }

    #[test]
    fn static_ranking_with_nvrtc_reads_ptxas_resources() {
        // Only where NVRTC is provisioned (.cache/nvidia or KIVI_CUDA_HOME).
        let Ok(compiler) = Compiler::new() else {
            assert!(
                std::env::var_os("KIVI_REQUIRE_NVRTC").is_none(),
                "KIVI_REQUIRE_NVRTC is set but NVRTC is unavailable"
            );
            eprintln!("skipped: no NVRTC on this machine");
            return;
        };
        let s = kivi_spec::presets::kivi2()
            .with_shape(kivi_spec::Heads::Gqa { q: 8, kv: 2 }, 64)
            .unwrap();
        let rows = static_ranking(&s, &Bucket::of(2, 1024, 4), Arch::SM90, 132, Some(&compiler)).unwrap();
        let compiled: Vec<&Resources> = rows
            .iter()
            .filter_map(|r| r.compiled.as_ref().ok().and_then(|x| x.as_ref()))
            .collect();
        assert_eq!(compiled.len(), rows.len(), "every variant compiles");
        assert!(compiled.iter().all(|r| r.registers > 0));
        // Pruned rows come last and say why.
        let first_pruned = rows.iter().position(|r| r.pruned.is_some()).unwrap_or(rows.len());
        assert!(rows[first_pruned..].iter().all(|r| r.pruned.is_some()));
    }
}
