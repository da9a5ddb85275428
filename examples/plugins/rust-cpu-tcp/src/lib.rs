//! The real cpu-tcp backend as a plugin: `libweft_backend_cpu_tcp_plugin.so`
//! exports the backend `cpu-tcp-plugin`. Load it with
//! `WEFT_PLUGIN_PATH=target/release/libweft_backend_cpu_tcp_plugin.so`.

include!("export.rs");
