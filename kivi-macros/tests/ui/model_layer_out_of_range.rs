kivi::model! {
    model Broken {
        layers: 4,
        default: kivi2,
        layers[2, 4]: kivi4,
    }
}

fn main() {}
