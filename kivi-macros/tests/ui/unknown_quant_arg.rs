// quant(...) takes bits, axis, group and scale.
kivi::scheme! {
    pub Grp {
        key: quant(bits = 2, axis = channel, groups = 32),
        value: quant(bits = 2, axis = token, group = 32),
    }
}

fn main() {}
