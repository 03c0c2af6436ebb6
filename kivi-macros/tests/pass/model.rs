// A model declaration compiles to a struct whose `decl()` resolves a
// scheme per layer: by index, else by kind, else the default.
kivi::model! {
    pub model Gemma3 {
        layers: 18,
        window: 512,
        global_layers: [5, 11, 17],
        default: kivi2,
        global: kivi4,
        layers[0]: K3 { key: quant(bits = 3, axis = channel, group = 32), value: quant(bits = 3, axis = token, group = 32) },
    }
}

fn main() {
    let d = Gemma3::decl();
    let kinds = d.kinds().unwrap();
    let s = d.schemes_for(&kinds).unwrap();
    assert_eq!(s.len(), 18);
    assert_eq!((s[0].name.as_str(), s[1].name.as_str(), s[5].name.as_str()), ("K3", "kivi2", "kivi4"));
    assert_eq!(d.windows().unwrap()[1], Some(512));
    assert!(Gemma3::TEXT.contains("global_layers"));
}
