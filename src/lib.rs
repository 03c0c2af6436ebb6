pub use kivi_macros::scheme;
pub use kivi_spec as spec;
