//! CUDA templates (`cuda/`) and the generator: scheme + variant -> source.
