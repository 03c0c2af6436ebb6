//! Raw launches of hand-written kernels for the shim's own tests: host
//! slices passed straight to `SimLibrary::launch_raw` (cuLaunchKernel
//! style), so the tests control the exact pointers a kernel sees (e.g. an
//! alignment). Generated kernels go through `kivi_runtime::device` instead.
#![allow(dead_code)]

use kivi_runtime::sim::{SimLibrary, SimOptions};
use kivi_runtime::{Error, Result};
use kivi_templates::{Generated, ParamTy};
use std::ffi::c_void;

/// One kernel argument as a host slice or a scalar.
pub enum Arg<'a> {
    U32s(&'a [u32]),
    U32sMut(&'a mut [u32]),
    I32s(&'a [i32]),
    I32sMut(&'a mut [i32]),
    F32s(&'a [f32]),
    F32sMut(&'a mut [f32]),
    I32(i32),
    F32(f32),
}

impl Arg<'_> {
    fn fits(&self, ty: ParamTy) -> bool {
        matches!(
            (self, ty),
            (Arg::U32s(_), ParamTy::PtrU32)
                | (Arg::U32sMut(_), ParamTy::PtrU32Mut)
                | (Arg::I32s(_), ParamTy::PtrI32)
                | (Arg::I32sMut(_), ParamTy::PtrI32Mut)
                | (Arg::F32s(_), ParamTy::PtrF32)
                | (Arg::F32sMut(_), ParamTy::PtrF32Mut)
                | (Arg::I32(_), ParamTy::I32)
                | (Arg::F32(_), ParamTy::F32)
        )
    }
}

/// Launches `entry` of `g` (compiled into `lib`) on `grid` blocks of the
/// entry's threads under [`SimOptions::current`], after checking the
/// argument types against the entry's parameter list.
///
/// # Safety
/// The slices must be as large as the kernel indexes them.
pub unsafe fn launch(lib: &SimLibrary, g: &Generated, entry: &str, grid: [u32; 3], args: &mut [Arg<'_>]) -> Result<()> {
    let el = g
        .launch
        .entry(entry)
        .ok_or_else(|| Error::Config(format!("{} has no entry point `{entry}`", g.name)))?;
    if el.params.len() != args.len() || !el.params.iter().zip(args.iter()).all(|(p, a)| a.fits(p.ty)) {
        return Err(Error::Config(format!(
            "arguments of `{entry}` do not match its parameter list {:?}",
            el.params
        )));
    }
    let mut slots: Vec<u64> = args
        .iter_mut()
        .map(|a| match a {
            Arg::U32s(v) => v.as_ptr() as u64,
            Arg::U32sMut(v) => v.as_mut_ptr() as u64,
            Arg::I32s(v) => v.as_ptr() as u64,
            Arg::I32sMut(v) => v.as_mut_ptr() as u64,
            Arg::F32s(v) => v.as_ptr() as u64,
            Arg::F32sMut(v) => v.as_mut_ptr() as u64,
            Arg::I32(x) => *x as u32 as u64,
            Arg::F32(x) => x.to_bits() as u64,
        })
        .collect();
    // Little-endian: an int or float argument is the low bytes of its slot.
    let mut ptrs: Vec<*mut c_void> = slots.iter_mut().map(|s| s as *mut u64 as *mut c_void).collect();
    lib.launch_raw(g, entry, grid, el.block, &mut ptrs, &SimOptions::current()?)
}
