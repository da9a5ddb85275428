//! Socket options of the connections: no Nagle delay, fixed buffers, and
//! a congestion control that does not pace within a host.

use socket2::Socket;
use weft::{Error, Result};

/// Environment variable setting the socket buffer size (bytes; 0 leaves
/// them to the kernel's autotuning).
pub const ENV_BUFFER: &str = "WEFT_SOCKET_BUFFER";
/// Default send and receive buffer request (the kernel doubles it). Fixed
/// buffers holding several pipeline segments keep a segment's send from
/// stalling on a window that autotuning has not grown yet (figures: bench/RESULTS.md, "Measurements behind code comments").
pub const DEFAULT_BUFFER: usize = 1 << 20;

/// Environment variable naming the TCP congestion control of every
/// connection (`system`: the kernel's default everywhere).
pub const ENV_CONGESTION: &str = "WEFT_TCP_CONGESTION";
/// What connections within a host use unless told otherwise. The kernel
/// lets every process choose Reno. A pacing algorithm (BBR, the default on
/// many current distributions) spaces a host-local stream out with timers
/// although nothing can congest there (figures: bench/RESULTS.md, "Measurements behind code comments").
const HOST_LOCAL_CONGESTION: &str = "reno";

/// Before a socket connects or listens: the congestion control it should
/// start with (`host_local`: the peer is on this host; a listener assumes
/// so, see [`connections`]). It must be chosen before the connection
/// starts: a pacing algorithm marks the socket as paced, and switching
/// algorithms later keeps the pacing (figures: bench/RESULTS.md, "Measurements behind code comments").
pub fn before_connecting(sock: &Socket, host_local: bool) -> Result<()> {
    match asked()? {
        Asked::System => Ok(()),
        Asked::Named(name) => sock.set_tcp_congestion(name.as_bytes()).map_err(|e| {
            Error::invalid(format!(
                "{ENV_CONGESTION}={name:?}: the kernel refused it ({e}); see /proc/sys/net/ipv4/tcp_allowed_congestion_control"
            ))
        }),
        Asked::Default if host_local => {
            if let Err(e) = sock.set_tcp_congestion(HOST_LOCAL_CONGESTION.as_bytes()) {
                weft::log::debug(format_args!("cpu-tcp: keeping the system's congestion control ({HOST_LOCAL_CONGESTION}: {e})"));
            }
            Ok(())
        }
        Asked::Default => Ok(()),
    }
}

/// Tune every established connection: TCP_NODELAY, the buffers of
/// `WEFT_SOCKET_BUFFER`; and a connection from another host accepted by a
/// listener set up for host-local peers goes back to the system's
/// congestion control.
pub fn connections(peers: &[Option<Socket>]) -> Result<()> {
    let buffer = parse_buffer(std::env::var(ENV_BUFFER).ok())?;
    let system =
        matches!(asked()?, Asked::Default).then(|| std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control").ok()).flatten();
    for sock in peers.iter().flatten() {
        sock.set_tcp_nodelay(true)?;
        if buffer > 0 {
            sock.set_send_buffer_size(buffer)?;
            sock.set_recv_buffer_size(buffer)?;
        }
        if let Some(name) = system.as_deref().filter(|_| !host_local(sock)) {
            // The system's default is always allowed.
            let _ = sock.set_tcp_congestion(name.trim().as_bytes());
        }
    }
    Ok(())
}

fn parse_buffer(v: Option<String>) -> Result<usize> {
    match v {
        None => Ok(DEFAULT_BUFFER),
        Some(v) => v.trim().parse().map_err(|_| Error::invalid(format!("{ENV_BUFFER}={v:?} is not a size in bytes"))),
    }
}

/// What `WEFT_TCP_CONGESTION` asks for.
enum Asked {
    /// Unset: Reno within a host, the system's elsewhere.
    Default,
    /// `system`: the system's everywhere.
    System,
    /// An algorithm by name, everywhere.
    Named(String),
}

fn asked() -> Result<Asked> {
    Ok(match std::env::var(ENV_CONGESTION) {
        Err(std::env::VarError::NotPresent) => Asked::Default,
        Err(std::env::VarError::NotUnicode(v)) => return Err(Error::invalid(format!("{ENV_CONGESTION}={v:?} is not a name"))),
        Ok(v) if v.trim() == "system" => Asked::System,
        Ok(v) => Asked::Named(v.trim().to_string()),
    })
}

/// Whether both ends of a connection are on this host (the kernel routes
/// it over loopback).
pub fn host_local(sock: &Socket) -> bool {
    let ends = sock.local_addr().ok().and_then(|a| a.as_socket()).zip(sock.peer_addr().ok().and_then(|a| a.as_socket()));
    ends.is_some_and(|(me, peer)| peer.ip().is_loopback() || peer.ip() == me.ip())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_socket_buffer_size_is_bytes_or_a_clear_error() {
        assert_eq!(parse_buffer(None).unwrap(), DEFAULT_BUFFER);
        assert_eq!(parse_buffer(Some(" 0".into())).unwrap(), 0);
        let e = parse_buffer(Some("1M".into())).unwrap_err();
        assert!(matches!(e.kind(), weft::ErrorKind::InvalidArgument) && e.to_string().contains("WEFT_SOCKET_BUFFER"), "{e}");
    }

    #[test]
    fn host_local_connections_start_with_reno_and_keep_it() {
        let l = Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        before_connecting(&l, true).unwrap();
        l.bind(&"127.0.0.1:0".parse::<std::net::SocketAddr>().unwrap().into()).unwrap();
        l.listen(1).unwrap();
        let c = Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        before_connecting(&c, true).unwrap();
        c.connect(&l.local_addr().unwrap()).unwrap();
        let (a, _) = l.accept().unwrap();
        connections(&[Some(a.try_clone().unwrap()), Some(c.try_clone().unwrap())]).unwrap();
        let name = |s: &Socket| String::from_utf8(s.tcp_congestion().unwrap()).unwrap().trim_end_matches('\0').to_string();
        assert!(host_local(&a) && host_local(&c));
        // Accepted connections inherit the listener's choice.
        assert_eq!((name(&a), name(&c)), ("reno".to_string(), "reno".to_string()));
    }
}
