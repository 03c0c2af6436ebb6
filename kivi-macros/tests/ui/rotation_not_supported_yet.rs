// Learned rotations need calibration (planned), not yet.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        rotation: learned(block = 64, apply = [key]),
    }
}

fn main() {}
