// A norm is the parameter of Lloyd–Max groups; uniform groups have a scale and zero point.
kivi::scheme! {
    pub S {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32, norm = l2),
    }
}

fn main() {}
