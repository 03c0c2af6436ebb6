// Zero outliers per token is no outlier storage.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        outliers: sparse(per_token = 0, apply = [key]),
    }
}

fn main() {}
