// A full-precision window means nothing when both tensors are already full.
kivi::scheme! {
    pub AllFull {
        key: full,
        value: full,
        residual: 64,
    }
}

fn main() {}
