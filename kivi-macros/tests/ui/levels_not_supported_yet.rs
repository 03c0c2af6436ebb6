// Learned codebooks are spelled `levels = nuq`; other names are refused.
kivi::scheme! {
    pub S {
        key: quant(bits = 4, axis = channel, group = 32, levels = kmeans),
        value: quant(bits = 2, axis = token, group = 32),
    }
}

fn main() {}
