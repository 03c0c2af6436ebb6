// The means must be known before the first token is quantized.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        residual: 16,
        center: channel_mean(tokens = 32, apply = [key]),
    }
}

fn main() {}
