//! The CUDA backend: generated source -> NVRTC -> PTX/CUBIN (cached on disk)
//! -> driver module -> launches, with CUDA-event timing.
//!
//! Trace one kernel through these files:
//! - [`toolkit`] finds NVRTC, the headers and ptxas (provisioned wheels,
//!   `$KIVI_CUDA_HOME`, a system toolkit) and loads NVRTC without
//!   `LD_LIBRARY_PATH`;
//! - [`compile`] runs NVRTC on a [`kivi_templates::Generated`] source with
//!   explicit options, through the [`artifacts`] cache;
//! - [`ptxas`] reports registers, spills and shared memory per kernel;
//! - [`device`] is the thin cudarc layer: [`CudaDevice`] implements
//!   [`crate::device::Device`] (allocate, copy, load CUBIN for the GPU's
//!   exact `sm_XX`, launch, time with CUDA events). Everything above it —
//!   the device-resident cache, kernel arguments, decode — is
//!   [`crate::device`], shared with the simulated device.
//!
//! Everything is loaded at run time through cudarc's dynamic loading; a
//! machine without NVRTC, headers or a driver gets [`crate::Error::Unavailable`]
//! from every entry point, never a panic. See `docs/cuda.md`.
//!
//! ```
//! use kivi_runtime::{cuda::CudaDevice, device::Device, Error};
//! match CudaDevice::new(0) {
//!     Ok(d) => println!("GPU: {}", d.info().name),
//!     Err(Error::Unavailable { reason, .. }) => println!("no CUDA here: {reason}"),
//!     Err(e) => panic!("{e}"),
//! }
//! ```

pub mod artifacts;
pub mod compile;
pub mod device;
pub mod ptxas;
pub mod toolkit;

pub use artifacts::{Artifact, ArtifactCache, ArtifactKey};
pub use compile::{Arch, Compiled, Compiler, NvrtcOptions, Origin};
pub use device::CudaDevice;
pub use toolkit::{NvrtcVersion, Toolkit};
