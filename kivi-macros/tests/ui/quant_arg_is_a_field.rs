// Outliers, rotations and centering are fields of the scheme, not quant arguments.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32, outliers = 2),
        value: quant(bits = 2, axis = token, group = 32),
    }
}

fn main() {}
