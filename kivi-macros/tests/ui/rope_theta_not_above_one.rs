// A RoPE base must turn low pairs faster than high ones: theta above 1.
kivi::scheme! {
    pub PreRope {
        key: quant(bits = 2, axis = channel, group = 32),
        value: quant(bits = 2, axis = token, group = 32),
        rope: pre(theta = 0.5, style = half),
    }
}

fn main() {}
