//! `WEFT_FUZZ_TARGET=<name> cargo afl fuzz -i ... -o ... target/release/weft-fuzz-afl`:
//! the named target of `weft_fuzz::TARGETS` under AFL++.

fn main() {
    let name = std::env::var("WEFT_FUZZ_TARGET").unwrap_or_default();
    let Some(target) = weft_fuzz::target(&name) else {
        let names: Vec<&str> = weft_fuzz::TARGETS.iter().map(|t| t.name).collect();
        eprintln!("WEFT_FUZZ_TARGET={name:?}: use one of {names:?}");
        std::process::exit(2);
    };
    afl::fuzz!(|data: &[u8]| (target.run)(data));
}
