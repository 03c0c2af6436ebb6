//! The shim itself: f16/bf16 conversions bit-exact with the `half` crate
//! (the prefill/append kernels depend on it), shuffles and shared-memory
//! reductions give CUDA's results, and what the shim cannot run fails with
//! a message instead of hanging.

mod sim_raw;

use kivi_runtime::sim::compile;
use kivi_templates::{EntryLaunch, Generated, LaunchInfo, Param, ParamTy};
use sim_raw::{launch, Arg};

fn kernel(name: &str, source: &str, params: Vec<Param>, threads: u32) -> Generated {
    Generated {
        name: format!("shim-test/{name}"),
        source: source.to_string(),
        hash: kivi_spec::fnv1a64(source.as_bytes()),
        entry_points: vec![name.to_string()],
        launch: LaunchInfo {
            entries: vec![EntryLaunch {
                entry: name.to_string(),
                block: [threads, 1, 1],
                grid_xy: [1, 1],
                shared_bytes: 0,
                params,
            }],
            splits: 1,
            q_heads: 1,
            head_dim: 1,
        },
        block_tokens: 1,
    }
}

const CONVERT: &str = r#"
#include <cuda_fp16.h>
extern "C" __global__ void convert(const float* __restrict__ x, unsigned int* __restrict__ out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    const unsigned short h = __half_as_ushort(__float2half_rn(x[i]));
    const float back = __half2float(__ushort_as_half((unsigned short)i));
    out[2 * i] = h;
    out[2 * i + 1] = __float_as_uint(back);
  }
}
"#;

const REDUCE: &str = r#"
extern "C" __global__ void reduce(const float* __restrict__ x, float* __restrict__ out) {
  KIVI_SHARED(float, s, [8]);
  const int t = threadIdx.x;
  float v = x[blockIdx.x * blockDim.x + t];
  float d = v;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  for (int o = 16; o > 0; o >>= 1) d += __shfl_down_sync(0xffffffffu, d, o);
  const float first = __shfl_sync(0xffffffffu, x[blockIdx.x * blockDim.x + t], 0);
  if ((t & 31) == 0) s[t >> 5] = d;
  __syncthreads();
  if (t == 0) {
    float sum = 0.0f;
    for (int w = 0; w < (int)(blockDim.x / 32); ++w) sum += s[w];
    out[blockIdx.x * 3 + 0] = sum;
  }
  if (t == 33) out[blockIdx.x * 3 + 1] = v;      // the xor butterfly gives every lane its warp's sum
  if (t == 40) out[blockIdx.x * 3 + 2] = first;  // lane 0 of warp 1
}
"#;

const DIVERGE: &str = r#"
extern "C" __global__ void diverge(int* __restrict__ out) {
  if (threadIdx.x < 7) __syncthreads();
  out[threadIdx.x] = 1;
}
extern "C" __global__ void partial_shuffle(int* __restrict__ out) {
  int v = threadIdx.x;
  if (threadIdx.x < 16) v = __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}
"#;

#[test]
fn f16_conversions_match_the_half_crate_bit_for_bit() {
    let n = 65536usize;
    let mut rng = kivi_runtime::rand::Rng::new(0x1234_5678);
    // Every f16 pattern's value, then random and edge-case floats around the f16 range.
    let mut x: Vec<f32> = (0..n as u32 / 2)
        .map(|i| half::f16::from_bits(i as u16).to_f32())
        .collect();
    while x.len() < n {
        let seed = rng.next_u32();
        let e = (seed % 60) as i32 - 30; // 2^-30 .. 2^30: subnormals, overflow
        let m = 1.0 + (seed >> 8) as f32 / (1u32 << 24) as f32;
        let sign = if seed & 1 == 0 { 1.0 } else { -1.0 };
        x.push(sign * m * (e as f32).exp2());
    }
    x[n - 1] = 65520.0;
    x[n - 2] = 65519.996;
    x[n - 3] = f32::INFINITY;
    x[n - 4] = 5.960_464_5e-8 / 2.0; // exactly half the smallest subnormal: ties to 0
    let g = kernel(
        "convert",
        CONVERT,
        vec![
            Param {
                name: "x",
                ty: ParamTy::PtrF32,
            },
            Param {
                name: "out",
                ty: ParamTy::PtrU32Mut,
            },
            Param {
                name: "n",
                ty: ParamTy::I32,
            },
        ],
        256,
    );
    let lib = compile(&[&g]).unwrap();
    let mut out = vec![0u32; 2 * n];
    unsafe {
        launch(
            &lib,
            &g,
            "convert",
            [(n / 256) as u32, 1, 1],
            &mut [Arg::F32s(&x), Arg::U32sMut(&mut out), Arg::I32(n as i32)],
        )
        .unwrap();
    }
    for i in 0..n {
        let want = half::f16::from_f32(x[i]).to_bits() as u32;
        assert_eq!(out[2 * i], want, "__float2half_rn({:e}) ({:#x})", x[i], x[i].to_bits());
        let back = half::f16::from_bits(i as u16).to_f32();
        if back.is_nan() {
            assert!(f32::from_bits(out[2 * i + 1]).is_nan());
        } else {
            assert_eq!(out[2 * i + 1], back.to_bits(), "__half2float({i:#x})");
        }
    }
}

#[test]
fn shuffles_and_shared_memory_reduce_like_cuda() {
    let g = kernel(
        "reduce",
        REDUCE,
        vec![
            Param {
                name: "x",
                ty: ParamTy::PtrF32,
            },
            Param {
                name: "out",
                ty: ParamTy::PtrF32Mut,
            },
        ],
        128,
    );
    let mut g = g;
    g.launch.entries[0].shared_bytes = 32;
    let lib = compile(&[&g]).unwrap();
    let blocks = 5;
    let x: Vec<f32> = (0..blocks * 128).map(|i| (i % 97) as f32).collect();
    let mut out = vec![0f32; blocks * 3];
    unsafe {
        launch(
            &lib,
            &g,
            "reduce",
            [blocks as u32, 1, 1],
            &mut [Arg::F32s(&x), Arg::F32sMut(&mut out)],
        )
        .unwrap();
    }
    for b in 0..blocks {
        let xs = &x[b * 128..(b + 1) * 128];
        assert_eq!(out[b * 3], xs.iter().sum::<f32>(), "block sum {b}");
        assert_eq!(out[b * 3 + 1], xs[32..64].iter().sum::<f32>(), "warp 1 butterfly {b}");
        assert_eq!(out[b * 3 + 2], xs[32], "broadcast {b}");
    }
}

#[test]
fn divergent_barriers_fail_with_a_message() {
    let p = vec![Param {
        name: "out",
        ty: ParamTy::PtrI32Mut,
    }];
    let mut g = kernel("diverge", DIVERGE, p.clone(), 64);
    g.entry_points.push("partial_shuffle".into());
    g.launch.entries.push(EntryLaunch {
        entry: "partial_shuffle".into(),
        block: [32, 1, 1],
        grid_xy: [1, 1],
        shared_bytes: 0,
        params: p,
    });
    let lib = compile(&[&g]).unwrap();
    let mut out = vec![0i32; 64];
    let e = unsafe { launch(&lib, &g, "diverge", [2, 1, 1], &mut [Arg::I32sMut(&mut out)]) }.unwrap_err();
    assert!(e.to_string().contains("__syncthreads() was reached by 7 of 64"), "{e}");
    let e = unsafe { launch(&lib, &g, "partial_shuffle", [1, 1, 1], &mut [Arg::I32sMut(&mut out)]) }.unwrap_err();
    assert!(e.to_string().contains("reached by 16 of the 32 lanes"), "{e}");
    // Wrong argument types are refused before anything runs.
    let e = unsafe { launch(&lib, &g, "diverge", [1, 1, 1], &mut [Arg::I32(3)]) }.unwrap_err();
    assert!(e.to_string().contains("do not match"), "{e}");
}

#[test]
fn unimplemented_cuda_fails_to_compile_loudly() {
    let src = "extern \"C\" __global__ void atom(float* __restrict__ x) { atomicAdd(x, 1.0f); }\n";
    let g = kernel(
        "atom",
        src,
        vec![Param {
            name: "x",
            ty: ParamTy::PtrF32Mut,
        }],
        32,
    );
    let e = compile(&[&g]).unwrap_err().to_string();
    assert!(e.contains("atomicAdd is not implemented"), "{e}");
}
