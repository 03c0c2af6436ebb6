// The RoPE part's codec follows the same rules as any codec: a token-axis
// group must divide rope_dim.
kivi::scheme! {
    pub Mla2 {
        key: quant(bits = 2, axis = channel, group = 32),
        heads: mla(q = 16, latent = 512, rope_dim = 64, rope = quant(bits = 4, axis = token, group = 48)),
    }
}

fn main() {}
