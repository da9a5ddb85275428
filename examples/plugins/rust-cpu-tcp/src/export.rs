// The whole plugin: cpu-tcp's factory exported through the SDK.
use weft_plugin_sdk::{export_backend, CPU, DENSE};

static FACTORY: weft_cpu_tcp::CpuTcp = weft_cpu_tcp::CpuTcp;
export_backend!(FACTORY, name = "cpu-tcp-plugin", devices = CPU, layouts = DENSE, priority = 0);
