//! Tuning and the decision cache.
