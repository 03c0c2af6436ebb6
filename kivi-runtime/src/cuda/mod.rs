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
//! - [`device`] opens a GPU, loads CUBIN for its exact `sm_XX`, and times
//!   work with CUDA events;
//! - [`backend`] keeps a paged cache on the GPU ([`DeviceCache`]) and
//!   implements [`crate::Backend`] ([`CudaBackend`]).
//!
//! Everything is loaded at run time through cudarc's dynamic loading; a
//! machine without NVRTC, headers or a driver gets [`crate::Error::Unavailable`]
//! from every entry point, never a panic. See `docs/cuda.md`.
//!
//! ```
//! use kivi_runtime::{cuda::CudaBackend, Error};
//! match CudaBackend::new() {
//!     Ok(b) => println!("GPU: {}", b.device().info().name),
//!     Err(Error::Unavailable { reason, .. }) => println!("no CUDA here: {reason}"),
//!     Err(e) => panic!("{e}"),
//! }
//! ```

pub mod artifacts;
pub mod backend;
pub mod compile;
pub mod device;
pub mod ptxas;
pub mod toolkit;

pub use artifacts::{Artifact, ArtifactCache, ArtifactKey};
pub use backend::{CudaBackend, DecodeRun, DeviceCache};
pub use compile::{Arch, Compiled, Compiler, NvrtcOptions, Origin};
pub use device::{Device, DeviceInfo, Timing};
pub use toolkit::{NvrtcVersion, Toolkit};
