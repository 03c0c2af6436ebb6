//! Shape buckets: which problems share a tuning decision.
//!
//! The best kernel variant depends on the batch size, the context length and
//! the GQA ratio (query heads served by one KV head); head_dim and head
//! counts are part of the scheme hash already. Batch and context are rounded
//! *up* to a power of two so that a handful of tuned buckets cover every
//! input: a batch of 3 sequences of up to 3000 tokens falls in bucket
//! `b4.c4096.g4`, and is tuned with inputs near the top of that bucket.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Smallest context bucket: below this every variant is launch-bound anyway.
pub const MIN_CONTEXT: u32 = 256;

/// One shape bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Bucket {
    /// Sequences per decode call, rounded up to a power of two.
    pub batch: u32,
    /// Longest context in the call, rounded up to a power of two (at least [`MIN_CONTEXT`]).
    pub context: u32,
    /// Query heads per KV head.
    pub gqa: u32,
}

impl Bucket {
    /// The bucket that real inputs fall into.
    ///
    /// ```
    /// use kivi_tuner::Bucket;
    /// let b = Bucket::of(3, 3000, 4);
    /// assert_eq!((b.batch, b.context, b.gqa), (4, 4096, 4));
    /// assert_eq!(b.key(), "b4.c4096.g4");
    /// assert_eq!(Bucket::of(1, 10, 1).context, 256);
    /// ```
    pub fn of(batch: usize, max_context: usize, gqa: usize) -> Bucket {
        let up = |x: usize, min: usize| -> u32 {
            let x = x.max(min).min(1 << 30);
            x.next_power_of_two() as u32
        };
        Bucket {
            batch: up(batch, 1),
            context: up(max_context, MIN_CONTEXT as usize),
            gqa: gqa.max(1) as u32,
        }
    }

    /// Key used in decision files and tables, e.g. `b8.c4096.g4`.
    pub fn key(&self) -> String {
        format!("b{}.c{}.g{}", self.batch, self.context, self.gqa)
    }

    /// Context lengths the tuner uses for this bucket's inputs: near the top
    /// of the bucket, odd, and different per sequence (variable-length
    /// batches are the common case, and odd lengths catch tail bugs).
    pub fn tuning_lengths(&self) -> Vec<usize> {
        let top = self.context as usize;
        (0..self.batch as usize)
            .map(|b| {
                let t = top - 1 - 2 * ((b * 37) % (top / 8).max(1));
                t.max(1)
            })
            .collect()
    }
}

impl fmt::Display for Bucket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.key())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up() {
        assert_eq!(Bucket::of(8, 4096, 4).context, 4096);
        assert_eq!(Bucket::of(8, 4097, 4).context, 8192);
        assert_eq!(Bucket::of(5, 1, 7).batch, 8);
        assert_eq!(
            Bucket::of(0, 0, 0),
            Bucket {
                batch: 1,
                context: 256,
                gqa: 1
            }
        );
    }

    #[test]
    fn tuning_lengths_stay_in_bucket() {
        for b in [Bucket::of(8, 4096, 4), Bucket::of(1, 256, 1), Bucket::of(16, 1024, 8)] {
            let l = b.tuning_lengths();
            assert_eq!(l.len(), b.batch as usize);
            for t in l {
                assert!(
                    t > b.context as usize / 2 && t < b.context as usize && t % 2 == 1,
                    "{t} in {b}"
                );
                assert_eq!(Bucket::of(1, t, 1).context, b.context);
            }
        }
    }
}
