//! The CUDA backend: generated source -> NVRTC -> PTX/CUBIN (cached on disk)
//! -> driver module -> launches, with CUDA-event timing.
//!
//! Everything is loaded at run time through cudarc's dynamic loading; a
//! machine without NVRTC, headers or a driver gets [`crate::Error::Unavailable`]
//! from every entry point, never a panic. See `docs/cuda.md`.

pub mod artifacts;
pub mod compile;
pub mod ptxas;
pub mod toolkit;

pub use artifacts::{Artifact, ArtifactCache, ArtifactKey};
pub use compile::{Arch, Compiled, Compiler, NvrtcOptions, Origin};
pub use toolkit::{NvrtcVersion, Toolkit};
