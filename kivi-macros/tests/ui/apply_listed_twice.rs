// Each tensor at most once in an apply list.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        outliers: sparse(per_token = 2, apply = [key, key]),
    }
}

fn main() {}
