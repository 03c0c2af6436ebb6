// Planned quantizer options are refused with "not supported yet".
kivi::scheme! {
    pub Codebook {
        key: quant(bits = 4, axis = channel, group = 32, codebook = nuq16),
        value: quant(bits = 2, axis = token, group = 32),
    }
}

fn main() {}
