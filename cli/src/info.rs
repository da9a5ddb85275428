//! `weft info`: what this build and machine offer.

use anyhow::Result;

pub fn print() -> Result<i32> {
    println!("weft {}", env!("CARGO_PKG_VERSION"));
    println!("\nbackends (highest auto priority first):");
    for line in weft::registry::describe() {
        println!("  {line}");
    }
    println!("\nenvironment:");
    for var in [
        weft::ENV_BACKEND,
        weft::ENV_TIMEOUT,
        weft::plugin::ENV_PLUGIN_PATH,
        weft_cpu_tcp::ENV_IFNAME,
        "WEFT_DEBUG",
        "WEFT_LOG",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        println!("  {var:<22} {}", std::env::var(var).unwrap_or_else(|_| "(unset)".into()));
    }
    match weft::GroupOptions::from_env() {
        Ok(o) => println!("  default group: backend {:?}, timeout {:?}", o.backend, o.timeout),
        Err(e) => println!("  default group: {e}"),
    }
    match weft::auth::Key::from_env() {
        Ok(Some(_)) => println!("  authentication: on (a key from {} or {})", weft::auth::ENV_KEY, weft::auth::ENV_KEY_FILE),
        Ok(None) => println!(
            "  authentication: off: the job is unauthenticated (anyone who can reach its store can join; set {} or run under `weft run`)",
            weft::auth::ENV_KEY
        ),
        Err(e) => println!("  authentication: {e}"),
    }
    match weft_cpu_tcp::local_addr() {
        Ok((ip, why)) => println!("  cpu-tcp address: {ip} ({why})"),
        Err(e) => println!("  cpu-tcp address: {e}"),
    }
    match weft::launch::LaunchEnv::from_env() {
        Ok(env) => println!(
            "  launcher: {:?}, rank {} of {}, store {}:{}",
            env.launcher, env.rank, env.world_size, env.master_addr, env.master_port
        ),
        Err(e) => println!("  launcher: none detected ({})", e.message()),
    }
    Ok(0)
}
