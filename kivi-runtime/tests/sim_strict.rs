//! The strict simulator, check by check: every check fires on a small kernel
//! that breaks its rule (with a message naming the block, thread and line)
//! and stays silent on one that keeps it. The barrier-deletion proof over
//! the real templates is in `sim_barriers.rs`.

use kivi_runtime::cuda::Arch;
mod sim_raw;

use kivi_runtime::sim::{compile, compile_flags, ArchLimits, Schedule, SimOptions};
use kivi_templates::{EntryLaunch, Generated, LaunchInfo, Param, ParamTy, TEMPLATES};
use sim_raw::{launch, Arg};
use std::ffi::c_void;

/// A hand-written source whose entry points all take `params` and run
/// `threads` threads per block.
fn kernel(tag: &str, source: &str, entries: &[&str], params: Vec<Param>, threads: u32, shared: u32) -> Generated {
    Generated {
        name: format!("strict-test/{tag}"),
        source: source.to_string(),
        hash: kivi_spec::fnv1a64(source.as_bytes()),
        entry_points: entries.iter().map(|e| e.to_string()).collect(),
        launch: LaunchInfo {
            entries: entries
                .iter()
                .map(|e| EntryLaunch {
                    entry: e.to_string(),
                    block: [threads, 1, 1],
                    grid_xy: [1, 1],
                    shared_bytes: shared,
                    params: params.clone(),
                })
                .collect(),
            splits: 1,
            q_heads: 1,
            head_dim: 1,
        },
        block_tokens: 1,
    }
}

fn p(name: &'static str, ty: ParamTy) -> Param {
    Param { name, ty }
}

fn run_f32(g: &Generated, entry: &str, grid: u32, out: &mut [f32], opts: SimOptions) -> Result<(), String> {
    let lib = compile(&[g]).unwrap();
    opts.scope(|| unsafe { launch(&lib, g, entry, [grid, 1, 1], &mut [Arg::F32sMut(out)]) })
        .map_err(|e| e.to_string())
}

fn run_i32(g: &Generated, entry: &str, grid: u32, out: &mut [i32], opts: SimOptions) -> Result<(), String> {
    let lib = compile(&[g]).unwrap();
    opts.scope(|| unsafe { launch(&lib, g, entry, [grid, 1, 1], &mut [Arg::I32sMut(out)]) })
        .map_err(|e| e.to_string())
}

fn sched(s: Schedule) -> SimOptions {
    SimOptions::with_schedule(s)
}

const RACE: &str = r#"
extern "C" __global__ void racy(float* __restrict__ out) {
  KIVI_SHARED(float, s, [64]);
  const int t = threadIdx.x;
  s[t] = (float)(t + 1);
  out[blockIdx.x * 64 + t] = s[63 - t];  // no barrier: reads another thread's slot
}
extern "C" __global__ void fixed(float* __restrict__ out) {
  KIVI_SHARED(float, s, [64]);
  const int t = threadIdx.x;
  s[t] = (float)(t + 1);
  __syncthreads();
  out[blockIdx.x * 64 + t] = s[63 - t];
}
extern "C" __global__ void stale(float* __restrict__ out) {
  KIVI_SHARED(float, s, [64]);
  const int t = threadIdx.x;
  if (blockIdx.x == 0) s[t] = 5.0f;  // only the first block writes
  __syncthreads();
  out[blockIdx.x * 64 + t] = s[t];
}
"#;

#[test]
fn a_missing_barrier_changes_the_answer_and_shared_memory_starts_poisoned() {
    let g = kernel(
        "race",
        RACE,
        &["racy", "fixed", "stale"],
        vec![p("out", ParamTy::PtrF32Mut)],
        64,
        256,
    );
    let want: Vec<f32> = (0..128).map(|i| (64 - i % 64) as f32).collect();
    for s in Schedule::STRICT {
        let mut out = vec![0f32; 128];
        run_f32(&g, "fixed", 2, &mut out, sched(s)).unwrap();
        assert_eq!(out, want, "with the barrier, under {s}");
        let mut out = vec![0f32; 128];
        run_f32(&g, "racy", 2, &mut out, sched(s)).unwrap();
        assert_ne!(out, want, "without the barrier, under {s}");
    }
    // In thread order, thread 0 reads slot 63 before thread 63 wrote it: the
    // poison (0xff bytes, NaN). In reverse, thread 63 reads slot 0: 0x7f bytes.
    let mut out = vec![0f32; 128];
    run_f32(&g, "racy", 2, &mut out, sched(Schedule::InOrder)).unwrap();
    assert_eq!(out[0].to_bits(), 0xffff_ffff);
    assert_eq!(out[63], 1.0);
    run_f32(&g, "racy", 2, &mut out, sched(Schedule::Reverse)).unwrap();
    assert_eq!(out[63].to_bits(), 0x7f7f_7f7f);
    assert_eq!(out[0], 64.0);
    // Every block starts poisoned, also on a worker that ran another block
    // of this kernel just before (one worker: block 1 follows block 0).
    let mut out = vec![0f32; 128];
    let one = SimOptions {
        workers: Some(1),
        poison: Some(0xff),
        ..sched(Schedule::InOrder)
    };
    run_f32(&g, "stale", 2, &mut out, one).unwrap();
    assert!(out[..64].iter().all(|&x| x == 5.0));
    assert!(
        out[64..].iter().all(|x| x.is_nan()),
        "block 1 saw block 0's shared memory"
    );
}

const ORDER: &str = r#"
extern "C" __global__ void order(int* __restrict__ out) {
  KIVI_SHARED(int, n, [1]);
  const int t = threadIdx.x;
  if (t == 0) n[0] = 0;
  __syncthreads();
  // Fibers switch only at barriers, so this counts the order they ran in.
  out[blockIdx.x * 128 + t] = n[0]++;
  __syncthreads();
  out[256 + blockIdx.x * 128 + t] = n[0]++;
}
"#;

#[test]
fn schedules_are_the_orders_they_say_and_deterministic() {
    let g = kernel("order", ORDER, &["order"], vec![p("out", ParamTy::PtrI32Mut)], 128, 4);
    let run = |o: SimOptions| {
        let mut out = vec![0i32; 512];
        run_i32(&g, "order", 2, &mut out, o).unwrap();
        out
    };
    let inorder = run(sched(Schedule::InOrder));
    assert_eq!(&inorder[..128], &(0..128).collect::<Vec<i32>>()[..]);
    let reverse = run(sched(Schedule::Reverse));
    assert_eq!(&reverse[..128], &(0..128).rev().collect::<Vec<i32>>()[..]);
    let a = run(sched(Schedule::Seeded(1)));
    let b = run(sched(Schedule::Seeded(2)));
    // out = [block 0, block 1] of the first phase, then of the second,
    // whose counts continue from 128.
    let phase = |o: &[i32], block: usize, second: bool| -> Vec<i32> {
        let at = if second { 256 } else { 0 } + block * 128;
        o[at..at + 128]
            .iter()
            .map(|x| x - if second { 128 } else { 0 })
            .collect()
    };
    for o in [&a, &b] {
        for (block, second) in [(0, false), (1, false), (0, true), (1, true)] {
            let mut v = phase(o, block, second);
            v.sort();
            assert_eq!(v, (0..128).collect::<Vec<i32>>(), "a permutation of the threads");
        }
    }
    assert_ne!(a, b, "two seeds, two orders");
    assert_ne!(
        phase(&a, 0, false),
        phase(&a, 1, false),
        "each block draws its own order"
    );
    assert_ne!(
        phase(&a, 0, false),
        phase(&a, 0, true),
        "each barrier phase draws a new order"
    );
    // The same seed gives the same run, whatever the number of workers.
    for workers in [1, 2, 3] {
        let o = SimOptions {
            workers: Some(workers),
            ..sched(Schedule::Seeded(1))
        };
        assert_eq!(run(o), a, "{workers} workers");
    }
}

const WARPS: &str = r#"
extern "C" __global__ void split_shuffle(float* __restrict__ out) {
  float v = (float)threadIdx.x;
  if (threadIdx.x % 32 < 16) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
  } else {
    v += __shfl_xor_sync(0xffffffffu, v, 2);
  }
  out[threadIdx.x] = v;
}
extern "C" __global__ void shuffle_vs_syncwarp(float* __restrict__ out) {
  float v = (float)threadIdx.x;
  if (threadIdx.x % 32 == 5) __syncwarp();
  else v = __shfl_down_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}
extern "C" __global__ void partial_mask(float* __restrict__ out) {
  float v = (float)threadIdx.x;
  if (threadIdx.x < 16) v = __shfl_xor_sync(0x0000ffffu, v, 1);
  out[threadIdx.x] = v;
}
extern "C" __global__ void divergent_sync(float* __restrict__ out) {
  if (threadIdx.x < 40) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}
extern "C" __global__ void full_warps(float* __restrict__ out) {
  float v = (float)threadIdx.x;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncwarp();
  out[threadIdx.x] = v;
}
"#;

#[test]
fn warp_collectives_and_barriers_must_be_the_same_call() {
    let g = kernel(
        "warps",
        WARPS,
        &[
            "split_shuffle",
            "shuffle_vs_syncwarp",
            "partial_mask",
            "divergent_sync",
            "full_warps",
        ],
        vec![p("out", ParamTy::PtrF32Mut)],
        64,
        0,
    );
    let mut out = vec![0f32; 64];
    let line_of = |needle: &str| WARPS.lines().position(|l| l.contains(needle)).unwrap() + 1;
    let tag = format!("{:016x}.cu", g.hash);
    for s in Schedule::STRICT {
        let o = sched(s);
        let e = run_f32(&g, "split_shuffle", 1, &mut out, o).unwrap_err();
        let (a, b) = (line_of("v, 1);"), line_of("v, 2);"));
        assert!(
            e.contains("block (0, 0, 0)") && e.contains("wait at different warp collectives"),
            "{e}"
        );
        assert!(
            e.contains("0-15 wait at __shfl_xor_sync") || e.contains("32-47 wait at __shfl_xor_sync"),
            "{e}"
        );
        assert!(
            e.contains(&format!("{tag}:{a})")) && e.contains(&format!("{tag}:{b})")),
            "{e}"
        );
        // The message quotes the source lines.
        assert!(e.contains("__shfl_xor_sync(0xffffffffu, v, 2);"), "{e}");
        let e = run_f32(&g, "shuffle_vs_syncwarp", 1, &mut out, o).unwrap_err();
        assert!(
            e.contains("thread 5 wait at __syncwarp") || e.contains("thread 37 wait at __syncwarp"),
            "{e}"
        );
        assert!(e.contains("wait at __shfl_down_sync"), "{e}");
        // A partial mask is an error of the launch, not an abort of the process.
        let e = run_f32(&g, "partial_mask", 1, &mut out, o).unwrap_err();
        assert!(e.contains("mask 0xffff: only full-warp masks are implemented"), "{e}");
        assert!(e.contains("(warp 0, lane "), "names the thread: {e}");
        let e = run_f32(&g, "divergent_sync", 1, &mut out, o).unwrap_err();
        assert!(e.contains("divergent __syncthreads()"), "{e}");
        assert!(
            e.contains("threads 0-39 wait at __syncthreads") && e.contains("threads 40-63 wait at"),
            "{e}"
        );
        run_f32(&g, "full_warps", 1, &mut out, o).unwrap();
        let w0: f32 = (0..32).map(|x| x as f32).sum();
        let w1: f32 = (32..64).map(|x| x as f32).sum();
        assert!(out[..32].iter().all(|&x| x == w0) && out[32..].iter().all(|&x| x == w1));
    }
    // A shuffle in a warp of 16 threads names lanes that do not exist.
    let mut g48 = g.clone();
    g48.launch.entries[4].block = [48, 1, 1];
    let mut out = vec![0f32; 48];
    let e = run_f32(&g48, "full_warps", 1, &mut out, SimOptions::default()).unwrap_err();
    assert!(e.contains("names lanes 16-31 of warp 1, which do not exist"), "{e}");
}

const LOADS: &str = r#"
extern "C" __global__ void vload(const unsigned int* __restrict__ p, unsigned int* __restrict__ out, int off) {
  const uint4 v = KIVI_LOAD_VECTOR(uint4, p + off);
  const uint2 u = KIVI_LOAD_VECTOR(uint2, p + off + 4);
  if (threadIdx.x == 0) { out[0] = v.x + v.y + v.z + v.w; out[1] = u.x + u.y; }
}
"#;

#[test]
fn misaligned_vector_loads_fail_the_launch() {
    let g = kernel(
        "loads",
        LOADS,
        &["vload"],
        vec![
            p("p", ParamTy::PtrU32),
            p("out", ParamTy::PtrU32Mut),
            p("off", ParamTy::I32),
        ],
        32,
        0,
    );
    let lib = compile(&[&g]).unwrap();
    // Words 0, 1, 2, ... in a Vec<u128>: 16-byte aligned, as a device
    // allocation would be.
    let mut backing = vec![0u128; 8];
    // SAFETY: 8 u128 are 32 u32, and u128 is more aligned than u32.
    let buf: &mut [u32] = unsafe { std::slice::from_raw_parts_mut(backing.as_mut_ptr() as *mut u32, 32) };
    for (i, w) in buf.iter_mut().enumerate() {
        *w = i as u32;
    }
    let buf: &[u32] = buf;
    let mut out = vec![0u32; 2];
    let run = |off: i32, out: &mut Vec<u32>| unsafe {
        launch(
            &lib,
            &g,
            "vload",
            [1, 1, 1],
            &mut [Arg::U32s(buf), Arg::U32sMut(out), Arg::I32(off)],
        )
    };
    run(4, &mut out).unwrap();
    assert_eq!(out, vec![4 + 5 + 6 + 7, 8 + 9]);
    let e = run(1, &mut out).unwrap_err().to_string();
    assert!(e.contains("misaligned 16-byte vector load"), "{e}");
    assert!(e.contains("KIVI_LOAD_VECTOR(uint4, p + off)"), "quotes the line: {e}");
    assert!(e.contains("block (0, 0, 0): thread ("), "names the thread: {e}");
    let e = run(2, &mut out).unwrap_err().to_string();
    assert!(e.contains("misaligned 16-byte vector load"), "{e}");
    // 8-byte aligned is enough for the uint2 but not the uint4.
    let e = run(6, &mut out).unwrap_err().to_string();
    assert!(e.contains("misaligned 16-byte"), "{e}");
}

const SHARED: &str = r#"
extern "C" __global__ void big(float* __restrict__ out) {
  KIVI_SHARED(float, a, [8192]);  // 32 KiB
  KIVI_SHARED(float, b, [4608]);  // 18 KiB: 50 KiB in all
  a[threadIdx.x] = 1.0f;
  b[threadIdx.x] = 2.0f;
  __syncthreads();
  out[threadIdx.x] = a[threadIdx.x] + b[threadIdx.x];
}
extern "C" __global__ void __launch_bounds__(64) small(float* __restrict__ out) {
  KIVI_SHARED(float, a, [64]);
  a[threadIdx.x] = 1.0f;
  __syncthreads();
  out[threadIdx.x] = a[63 - threadIdx.x];
}
"#;

#[test]
fn launch_limits_are_checked_like_the_driver() {
    let mut g = kernel(
        "shared",
        SHARED,
        &["big", "small"],
        vec![p("out", ParamTy::PtrF32Mut)],
        64,
        256,
    );
    let lib = compile(&[&g]).unwrap();
    let mut out = vec![0f32; 2048];
    let opts = SimOptions::default();
    let raw = |g: &Generated, e: &str, grid: [u32; 3], block: [u32; 3], out: &mut [f32]| {
        let mut ptr = out.as_mut_ptr() as *mut c_void;
        let mut args = [&mut ptr as *mut *mut c_void as *mut c_void];
        unsafe { lib.launch_raw(g, e, grid, block, &mut args, &opts) }.map_err(|e| e.to_string())
    };
    raw(&g, "small", [1, 1, 1], [64, 1, 1], &mut out).unwrap();
    assert!(out[..64].iter().all(|&x| x == 1.0));
    for (grid, block, want) in [
        (
            [1, 1, 1],
            [1025, 1, 1],
            "block dimension x = 1025 is outside 1..=1024 on sm_90",
        ),
        (
            [1, 1, 1],
            [32, 32, 2],
            "a block of 2048 threads (32x32x2) exceeds the 1024 threads per block",
        ),
        ([1, 1, 1], [1, 1, 65], "block dimension z = 65 is outside 1..=64"),
        (
            [1, 65536, 1],
            [64, 1, 1],
            "grid dimension y = 65536 is outside 1..=65535",
        ),
        ([1, 1, 65536], [64, 1, 1], "grid dimension z = 65536"),
        (
            [1 << 31, 1, 1],
            [64, 1, 1],
            "grid dimension x = 2147483648 is outside 1..=2147483647",
        ),
        ([0, 1, 1], [64, 1, 1], "grid dimension x = 0"),
        ([1, 1, 1], [128, 1, 1], "exceeds the kernel's __launch_bounds__(64)"),
    ] {
        let e = raw(&g, "small", grid, block, &mut out).unwrap_err();
        assert!(e.contains("refused") && e.contains(want), "{grid:?} {block:?}: {e}");
    }
    // The wrong number of arguments is refused before anything runs.
    let e = unsafe { lib.launch_raw(&g, "small", [1, 1, 1], [64, 1, 1], &mut [], &opts) }.unwrap_err();
    assert!(e.to_string().contains("takes 1 arguments, 0 given"), "{e}");
    // Static shared memory: the declared size against the arch, before the
    // launch; what a block touches against both, while it runs.
    g.launch.entries[0].shared_bytes = 48 * 1024 + 4;
    let e = raw(&g, "big", [1, 1, 1], [64, 1, 1], &mut out).unwrap_err();
    assert!(
        e.contains("49156 bytes of static shared memory per block exceed the 49152-byte limit"),
        "{e}"
    );
    g.launch.entries[0].shared_bytes = 40 * 1024;
    let e = raw(&g, "big", [1, 1, 1], [64, 1, 1], &mut out).unwrap_err();
    assert!(
        e.contains("`b` (18432 bytes") && e.contains("51200 bytes, over the 49152-byte limit"),
        "{e}"
    );
    let e = raw(&g, "small", [1, 1, 1], [64, 1, 1], &mut out);
    assert!(e.is_ok(), "{e:?}");
    g.launch.entries[1].shared_bytes = 128;
    let e = raw(&g, "small", [1, 1, 1], [64, 1, 1], &mut out).unwrap_err();
    assert!(
        e.contains("more than the 128 bytes the kernel's EntryLaunch::shared_bytes declares"),
        "{e}"
    );
    // Other architectures: the same static limits.
    let l = ArchLimits::of(Arch::SM80);
    assert_eq!(l.max_static_shared, 48 * 1024);
    assert_eq!(l.max_shared_optin, 163 * 1024);
    assert_eq!(ArchLimits::of(Arch::SM90).max_shared_optin, 227 * 1024);
}

#[test]
fn bare_shared_declarations_do_not_compile_and_templates_use_kivi_shared() {
    let src = "extern \"C\" __global__ void bare(float* __restrict__ out) {\n  __shared__ float s[4];\n  s[0] = 1.0f;\n  out[0] = s[0];\n}\n";
    let g = kernel("bare", src, &["bare"], vec![p("out", ParamTy::PtrF32Mut)], 32, 16);
    let e = compile(&[&g]).unwrap_err().to_string();
    assert!(e.contains("declare shared memory with KIVI_SHARED"), "{e}");
    // In the templates `__shared__` appears only in comments and in the
    // definition of KIVI_SHARED for NVRTC.
    let mut defs = 0;
    for (file, text) in TEMPLATES {
        for (i, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            if !code.contains("__shared__") {
                continue;
            }
            assert!(
                code.trim_start()
                    .starts_with("#define KIVI_SHARED(T, name, dims) __shared__ T name dims"),
                "{file}:{}: a bare __shared__ escapes the sim's poisoning; use KIVI_SHARED: {line}",
                i + 1
            );
            defs += 1;
        }
        assert!(!text.contains("reinterpret_cast<const uint4*>(") || file == "kivi_common.cuh");
    }
    assert_eq!(defs, 1);
    let shared_uses: usize = TEMPLATES
        .iter()
        .map(|(_, t)| t.matches("KIVI_SHARED(float").count())
        .sum();
    assert!(shared_uses >= 7, "{shared_uses}");
}

const FMA: &str = r#"
extern "C" __global__ void contract(const float* __restrict__ x, float* __restrict__ out) {
  out[0] = x[0] * x[1] + x[2];                       // may be fused, like --fmad=true
  out[1] = __fadd_rn(__fmul_rn(x[0], x[1]), x[2]);   // never fused, like CUDA
  out[2] = __fsub_rn(x[2], __fmul_rn(x[0], x[1]) * -1.0f);
  out[3] = __fdiv_rn(__fsub_rn(x[0], x[2]), x[1]);
}
"#;

#[test]
fn contraction_like_nvrtc_fmad_but_never_across_rn_intrinsics() {
    let g = kernel(
        "fma",
        FMA,
        &["contract"],
        vec![p("x", ParamTy::PtrF32), p("out", ParamTy::PtrF32Mut)],
        32,
        0,
    );
    let flags = compile_flags();
    assert!(flags.iter().any(|f| f == "-std=c++17"), "{flags:?}");
    assert!(flags.iter().any(|f| f == "-ffp-contract=fast"), "{flags:?}");
    let lib = compile(&[&g]).unwrap();
    // a * b rounds away 2^-26, which a fused multiply-add keeps.
    let a = 1.0f32 + (-13f32).exp2();
    let x = [a, a, -(1.0f32 + (-12f32).exp2())];
    let mut out = vec![0f32; 4];
    unsafe {
        launch(
            &lib,
            &g,
            "contract",
            [1, 1, 1],
            &mut [Arg::F32s(&x), Arg::F32sMut(&mut out)],
        )
    }
    .unwrap();
    let unfused = x[0] * x[1] + x[2];
    let fused = x[0].mul_add(x[1], x[2]);
    assert_eq!(unfused, 0.0);
    assert_eq!(fused, (-26f32).exp2());
    if flags.iter().any(|f| f == "-mfma") {
        assert_eq!(
            out[0], fused,
            "plain a * b + c is contracted, as NVRTC --fmad=true does"
        );
    }
    assert_eq!(out[1], unfused, "__fadd_rn(__fmul_rn(..)) must not fuse");
    assert_eq!(out[2], unfused, "__fsub_rn(c, __fmul_rn(..) * -1) must not fuse");
    assert_eq!(out[3], (x[0] - x[2]) / x[1]);
}

#[test]
fn options_parse_and_scope() {
    assert_eq!(Schedule::parse("inorder").unwrap(), Schedule::InOrder);
    assert_eq!(Schedule::parse("In-Order").unwrap(), Schedule::InOrder);
    assert_eq!(Schedule::parse("reverse").unwrap(), Schedule::Reverse);
    assert_eq!(Schedule::parse("42").unwrap(), Schedule::Seeded(42));
    assert_eq!(Schedule::parse("seeded:7").unwrap(), Schedule::Seeded(7));
    assert!(Schedule::parse("sideways")
        .unwrap_err()
        .to_string()
        .contains("not a sim schedule"));
    for s in Schedule::STRICT {
        assert_eq!(Schedule::parse(&s.to_string()).unwrap(), s);
    }
    assert_eq!(SimOptions::default().arch, Arch::SM90);
    let outer = SimOptions::with_schedule(Schedule::Reverse);
    let inner = SimOptions::with_schedule(Schedule::Seeded(9));
    outer.scope(|| {
        assert_eq!(SimOptions::current().unwrap(), outer);
        let r = std::panic::catch_unwind(|| {
            inner.scope(|| {
                assert_eq!(SimOptions::current().unwrap(), inner);
                panic!("unwinds through the scope");
            })
        });
        assert!(r.is_err());
        assert_eq!(SimOptions::current().unwrap(), outer, "restored after a panic");
    });
}
