kivi::model! {
    model Broken {
        default: kivi2,
        global: kivi9,
    }
}

fn main() {}
