//! Which local address to listen on and advertise to peers.
//!
//! 1. `WEFT_SOCKET_IFNAME`: comma-separated interface name prefixes
//!    (`eth,ib`), `=name` for an exact name, or a leading `^` to exclude
//!    (`^lo,docker`), as NCCL_SOCKET_IFNAME. IPv4 addresses are preferred.
//! 2. Otherwise the address this host would use to reach `MASTER_ADDR`.
//! 3. Otherwise loopback.

use nix::ifaddrs::getifaddrs;
use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs, UdpSocket};
use weft::{Error, Result};

/// Environment variable selecting interfaces.
pub const ENV_IFNAME: &str = "WEFT_SOCKET_IFNAME";

/// The address to bind and advertise, and how it was chosen.
pub fn local_addr() -> Result<(IpAddr, String)> {
    if let Ok(spec) = std::env::var(ENV_IFNAME) {
        let ip = from_ifname(&spec)?;
        return Ok((ip, format!("{ENV_IFNAME}={spec}")));
    }
    if let Ok(master) = std::env::var("MASTER_ADDR") {
        if let Some(ip) = route_to(&master) {
            return Ok((ip, format!("route to MASTER_ADDR={master}")));
        }
    }
    Ok((Ipv4Addr::LOCALHOST.into(), "loopback (no WEFT_SOCKET_IFNAME or MASTER_ADDR)".into()))
}

/// Whether interface `name` is selected by `spec`.
pub fn matches(spec: &str, name: &str) -> bool {
    let (exclude, list) = match spec.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, spec),
    };
    let hit = list.split(',').map(str::trim).filter(|p| !p.is_empty()).any(|p| match p.strip_prefix('=') {
        Some(exact) => name == exact,
        None => name.starts_with(p),
    });
    hit != exclude
}

fn from_ifname(spec: &str) -> Result<IpAddr> {
    let addrs = getifaddrs().map_err(|e| Error::backend(format!("getifaddrs: {e}")))?;
    let mut seen = Vec::new();
    let mut v6 = None;
    for ifa in addrs {
        if !seen.contains(&ifa.interface_name) {
            seen.push(ifa.interface_name.clone());
        }
        if !matches(spec, &ifa.interface_name) {
            continue;
        }
        let Some(addr) = ifa.address else { continue };
        if let Some(sin) = addr.as_sockaddr_in() {
            return Ok(IpAddr::V4(sin.ip()));
        }
        if let Some(sin6) = addr.as_sockaddr_in6() {
            if !sin6.ip().is_unicast_link_local() {
                v6.get_or_insert(IpAddr::V6(sin6.ip()));
            }
        }
    }
    v6.ok_or_else(|| {
        Error::invalid(format!("{ENV_IFNAME}={spec:?} matches no interface with an address (interfaces: {})", seen.join(", ")))
    })
}

fn route_to(host: &str) -> Option<IpAddr> {
    let target = (host, 9).to_socket_addrs().ok()?.next()?;
    let bind: std::net::SocketAddr = if target.is_ipv4() { ([0, 0, 0, 0], 0).into() } else { (std::net::Ipv6Addr::UNSPECIFIED, 0).into() };
    let sock = UdpSocket::bind(bind).ok()?;
    sock.connect(target).ok()?;
    Some(sock.local_addr().ok()?.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ifname_specs() {
        assert!(matches("eth,ib", "eth0"));
        assert!(matches("eth,ib", "ib1"));
        assert!(!matches("eth", "lo"));
        assert!(matches("^lo,docker", "eth0"));
        assert!(!matches("^lo,docker", "docker0"));
        assert!(matches("=lo", "lo"));
        assert!(!matches("=eth", "eth0"));
        assert!(from_ifname("lo").unwrap().is_loopback());
        assert!(from_ifname("no-such-if").unwrap_err().to_string().contains("lo"));
        assert!(route_to("127.0.0.1").unwrap().is_loopback());
    }
}
