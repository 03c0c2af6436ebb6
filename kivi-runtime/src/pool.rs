//! One block pool for every layer of a model.
//!
//! A model whose layers use different schemes has blocks of different
//! byte sizes (a kivi4 block is about twice a kivi2 one), and a model with
//! sliding-window layers frees blocks on some layers while others keep
//! growing: on Gemma 3 the 15 sliding layers settle at a few blocks each
//! while the 3 global layers grow with the context. Per-layer pools sized
//! for the worst case of each layer reserve memory that only one kind of
//! layer can ever use; a serving engine wants one budget, spent where the
//! tokens are.
//!
//! # Design
//!
//! A [`BlockPool`] is a **byte budget with a capacity**, shared (it is a
//! cheap handle, `Clone` shares it) by every [`crate::PagedCache`] attached
//! to it ([`crate::PagedCache::set_pool`]): the caches of all layers of a
//! model, and of several sequences or models if the engine wishes.
//!
//! - **Allocation.** A cache that needs `n` fresh blocks for an append
//!   charges `n * block_bytes` of *its* layout to the pool before anything
//!   a reader can see changes. Blocks of different sizes draw on the same
//!   bytes, so there is no per-size partition to balance and no page
//!   rounding: the pool's `used` is exactly the sum of the blocks its
//!   caches hold, byte for byte.
//! - **Release.** Blocks go back to the pool when a sliding layer evicts
//!   them ([`crate::PagedCache::set_eviction_window`]), when a sequence is
//!   freed, when an append that took them fails, and when a cache is
//!   dropped; a global layer can then take those bytes.
//! - **Exhaustion** is a typed error, [`crate::Error::PoolExhausted`],
//!   raised where per-layer pools raise [`crate::Error::OutOfBlocks`]:
//!   before anything is written, so the refused append leaves that cache
//!   (and every other one) exactly as it was. Never a panic.
//! - **Accounting.** [`BlockPool::memory`] gives capacity, bytes in use,
//!   bytes free and the high-water mark; each cache's
//!   [`crate::PagedCache::memory`] stays exact per layer, and the pool's
//!   `used` equals the sum over its caches of `blocks_in_use *
//!   layout().block_bytes()`. Sink and window buffers, block tables and
//!   centering means are per sequence, sized when it starts, and are not
//!   charged to the pool (as in vLLM, the pool is for paged KV only).
//! - **Concurrency.** The charge is one compare-and-swap on an atomic, so
//!   layers may append from different threads; an append that finds the
//!   pool short fails, it never waits.
//!
//! # Where the bytes live
//!
//! vLLM's hybrid allocator makes one block id name a page in every
//! layer's tensor and equalises page sizes across layer groups by choosing
//! tokens per block; FlashInfer's page tables index one paged buffer per
//! layer. Both keep the kernels' address arithmetic per layer (`page id *
//! page stride`). So does this pool: each cache keeps its blocks in its own
//! word arena, addressed `block id * block_words` exactly as before (no
//! kernel, device upload or simulator changes), reserved up front but
//! untouched pages cost nothing; the pool decides how many bytes of blocks
//! all of them may hold at once. A layer reuses its own freed block slots
//! first, so its touched memory follows its own high-water mark.
//!
//! ```
//! use kivi_runtime::{pool::BlockPool, CacheConfig, Error, PagedCache};
//! use kivi_spec::{presets, Heads};
//! let shape = |s: kivi_spec::Scheme| s.with_shape(Heads::Mqa(4), 64).unwrap();
//! let (local, global) = (shape(presets::kivi2()), shape(presets::kivi4()));
//! let cfg = CacheConfig::for_tokens(4096);
//! let mut sliding = PagedCache::new(local, cfg).unwrap();
//! let mut full = PagedCache::new(global, cfg).unwrap();
//! // Room for 8 kivi4 blocks, shared by both layers.
//! let pool = BlockPool::new(8 * full.layout().block_bytes());
//! sliding.set_pool(Some(pool.clone())).unwrap();
//! full.set_pool(Some(pool.clone())).unwrap();
//! sliding.set_eviction_window(Some(256)).unwrap();
//! let (a, b) = (sliding.add_sequence(), full.add_sequence());
//! let row: Vec<f32> = (0..64).map(|i| (i as f32).sin()).collect();
//! let mut refused = None;
//! for i in 0..4000 {
//!     sliding.append(a, &row, &row).unwrap();
//!     if let Err(e) = full.append(b, &row, &row) {
//!         refused = Some((i, e));
//!         break;
//!     }
//! }
//! // The sliding layer settles at a few blocks; the global layer takes the rest.
//! let (at, e) = refused.unwrap();
//! assert!(matches!(e, Error::PoolExhausted { .. }), "{e}");
//! assert_eq!(full.len(b).unwrap(), at); // the refused token left nothing behind
//! let held = sliding.memory().blocks_in_use * sliding.layout().block_bytes()
//!     + full.memory().blocks_in_use * full.layout().block_bytes();
//! assert_eq!(pool.memory().used, held);
//! ```

use crate::error::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A byte budget for blocks, shared by the caches attached to it (see the
/// [module docs](self)). Cloning gives another handle to the same pool.
#[derive(Clone, Debug)]
pub struct BlockPool {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    capacity: usize,
    used: AtomicUsize,
    peak: AtomicUsize,
}

/// What a [`BlockPool`] holds, in bytes. `used + free == capacity`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolReport {
    /// The budget the pool was made with.
    pub capacity: usize,
    /// Bytes of blocks its caches hold now.
    pub used: usize,
    /// `capacity - used`.
    pub free: usize,
    /// The most bytes held at once since the pool was made.
    pub peak: usize,
}

impl BlockPool {
    /// A pool of `capacity` bytes of blocks. Nothing is allocated here:
    /// the bytes are a budget the attached caches draw on.
    pub fn new(capacity: usize) -> BlockPool {
        BlockPool {
            inner: Arc::new(Inner {
                capacity,
                used: AtomicUsize::new(0),
                peak: AtomicUsize::new(0),
            }),
        }
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Capacity, bytes in use, bytes free and the high-water mark.
    pub fn memory(&self) -> PoolReport {
        let used = self.inner.used.load(Ordering::Acquire);
        PoolReport {
            capacity: self.inner.capacity,
            used,
            free: self.inner.capacity.saturating_sub(used),
            peak: self.inner.peak.load(Ordering::Acquire),
        }
    }

    /// Whether `self` and `other` are handles to the same pool.
    pub fn same_pool(&self, other: &BlockPool) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Charges `blocks` blocks of `block_bytes` each, or refuses with
    /// [`Error::PoolExhausted`] and charges nothing.
    pub(crate) fn take(&self, blocks: usize, block_bytes: usize) -> Result<()> {
        let capacity = self.inner.capacity;
        let exhausted = |free: usize| Error::PoolExhausted {
            blocks,
            need: blocks.saturating_mul(block_bytes),
            free,
            capacity,
        };
        let bytes = blocks.checked_mul(block_bytes).ok_or_else(|| exhausted(0))?;
        let mut used = self.inner.used.load(Ordering::Acquire);
        loop {
            let after = used.checked_add(bytes).filter(|a| *a <= capacity);
            let Some(after) = after else {
                return Err(exhausted(capacity - used));
            };
            match self
                .inner
                .used
                .compare_exchange_weak(used, after, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.inner.peak.fetch_max(after, Ordering::AcqRel);
                    return Ok(());
                }
                Err(now) => used = now,
            }
        }
    }

    /// Charges `blocks` blocks of `block_bytes` each whatever is free:
    /// only for putting back blocks a cache held before (an undone
    /// eviction), which the pool lent it once already.
    pub(crate) fn retake(&self, blocks: usize, block_bytes: usize) {
        if blocks > 0 {
            let after = self.inner.used.fetch_add(blocks * block_bytes, Ordering::AcqRel) + blocks * block_bytes;
            self.inner.peak.fetch_max(after, Ordering::AcqRel);
        }
    }

    /// Gives back `blocks` blocks of `block_bytes` each (taken before).
    pub(crate) fn give(&self, blocks: usize, block_bytes: usize) {
        if blocks > 0 {
            self.inner.used.fetch_sub(blocks * block_bytes, Ordering::AcqRel);
        }
    }
}
