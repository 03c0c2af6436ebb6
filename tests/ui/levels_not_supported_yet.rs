// Calibrated codebooks come with calibration files (planned), not yet.
kivi::scheme! {
    pub S {
        key: quant(bits = 4, axis = channel, group = 32, levels = nuq),
        value: quant(bits = 2, axis = token, group = 32),
    }
}

fn main() {}
