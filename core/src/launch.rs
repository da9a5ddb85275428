//! Rank and rendezvous information from the launcher's environment:
//! `weft run` / torchrun, Slurm, Open MPI and PMI.

use crate::error::{Error, Result};
use crate::store::{Store, TcpStore};
use std::sync::Arc;
use std::time::Duration;

/// Set by `weft run`: the launcher hosts the store, so rank 0 must not.
pub const ENV_AGENT_STORE: &str = "WEFT_AGENT_STORE";
/// Default store port when `MASTER_PORT` is unset under Slurm or MPI.
pub const DEFAULT_PORT: u16 = 29500;

/// Where the rank and world size came from.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// `RANK` / `WORLD_SIZE` (weft run, torchrun).
    Torchrun,
    /// `SLURM_PROCID` / `SLURM_NTASKS`.
    Slurm,
    /// `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE`.
    OpenMpi,
    /// `PMI_RANK` / `PMI_SIZE` (MPICH, Intel MPI).
    Pmi,
}

/// What a process learns about its place in the job.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchEnv {
    /// Which launcher's variables were used.
    pub launcher: Launcher,
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// Rank on this node, if the launcher says.
    pub local_rank: Option<usize>,
    /// Ranks on this node, if the launcher says.
    pub local_world_size: Option<usize>,
    /// Store host.
    pub master_addr: String,
    /// Store port.
    pub master_port: u16,
    /// The store is hosted by a launcher agent, not by rank 0.
    pub agent_store: bool,
}

impl LaunchEnv {
    /// Read the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// This process's rank and the world size alone, from the process
    /// environment (no store address needed: the caller has a store).
    pub fn rank_and_size() -> Result<(usize, usize)> {
        let get = |k: &str| std::env::var(k).ok();
        let (_, rank, size, _) = ranks(&get)?;
        Ok((rank, size))
    }

    /// Read from any variable lookup (for tests and embedding).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let (launcher, rank, world_size, [local_var, local_size_var]) = ranks(&get)?;
        let num = |k: &str| number(&get, k);
        let missing = |k: &str| Error::invalid(format!("{k} is not set (rank variables of {launcher:?} found)"));
        let master_addr = get("MASTER_ADDR").ok_or_else(|| missing("MASTER_ADDR"))?;
        let master_port = match (get("MASTER_PORT"), launcher) {
            (Some(p), _) => p.trim().parse().map_err(|_| Error::invalid(format!("MASTER_PORT={p:?} is not a port number")))?,
            (None, Launcher::Torchrun) => return Err(missing("MASTER_PORT")),
            (None, _) => DEFAULT_PORT,
        };
        // Slurm's tasks-per-node may be "4(x2)"; keep the leading number.
        let local_world_size = match get(local_size_var) {
            Some(v) if launcher == Launcher::Slurm => v.split(|c: char| !c.is_ascii_digit()).next().and_then(|n| n.parse().ok()),
            _ => num(local_size_var)?,
        };
        Ok(LaunchEnv {
            launcher,
            rank,
            world_size,
            local_rank: num(local_var)?,
            local_world_size,
            master_addr,
            master_port,
            agent_store: get(ENV_AGENT_STORE).is_some_and(|v| v == "1"),
        })
    }

    /// Connect to the job's store, hosting it first on rank 0 unless a
    /// launcher agent hosts it.
    pub fn connect_store(&self, timeout: Duration) -> Result<Arc<dyn Store>> {
        if self.rank == 0 && !self.agent_store {
            return Ok(Arc::new(TcpStore::host(store_bind_addr(&self.master_addr, self.master_port), timeout)?));
        }
        Ok(Arc::new(TcpStore::connect(&self.master_addr, self.master_port, timeout)?))
    }
}

/// The variable `k` as a count, if set.
fn number(get: &impl Fn(&str) -> Option<String>, k: &str) -> Result<Option<usize>> {
    get(k).map(|v| v.trim().parse::<usize>().map_err(|_| Error::invalid(format!("{k}={v:?} is not a non-negative integer")))).transpose()
}

/// Which launcher's variables are set, the rank and world size they give,
/// and the names of its local rank and local size variables.
fn ranks(get: &impl Fn(&str) -> Option<String>) -> Result<(Launcher, usize, usize, [&'static str; 2])> {
    let (launcher, rank_var, size_var, local_var, local_size_var) = if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
        (Launcher::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    } else if get("SLURM_PROCID").is_some() {
        (Launcher::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
    } else if get("OMPI_COMM_WORLD_RANK").is_some() {
        (Launcher::OpenMpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")
    } else if get("PMI_RANK").is_some() {
        (Launcher::Pmi, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    } else {
        return Err(Error::invalid(
            "RANK is not set (nor SLURM_PROCID, OMPI_COMM_WORLD_RANK or PMI_RANK): start the program with `weft run`, torchrun, srun or mpirun",
        ));
    };
    let missing = |k: &str| Error::invalid(format!("{k} is not set (rank variables of {launcher:?} found)"));
    let rank = number(get, rank_var)?.ok_or_else(|| missing(rank_var))?;
    let world_size = number(get, size_var)?.ok_or_else(|| missing(size_var))?;
    if rank >= world_size {
        return Err(Error::invalid(format!("{rank_var}={rank} is not below {size_var}={world_size}")));
    }
    Ok((launcher, rank, world_size, [local_var, local_size_var]))
}

/// Where the store for a job whose ranks reach it at `master_addr` listens:
/// on loopback only when that is a loopback address (a one-host job is not
/// reachable from elsewhere), else on every interface.
pub fn store_bind_addr(master_addr: &str, port: u16) -> std::net::SocketAddr {
    let loopback = master_addr == "localhost" || master_addr.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    let ip = if loopback { std::net::Ipv4Addr::LOCALHOST } else { std::net::Ipv4Addr::UNSPECIFIED };
    std::net::SocketAddr::from((ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        LaunchEnv::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn the_store_listens_on_loopback_for_a_loopback_master() {
        for (addr, loopback) in
            [("127.0.0.1", true), ("127.0.1.1", true), ("localhost", true), ("::1", true), ("10.0.0.5", false), ("node7", false)]
        {
            assert_eq!(store_bind_addr(addr, 5).ip().is_loopback(), loopback, "{addr}");
        }
    }

    #[test]
    fn each_launcher_and_missing_variables() {
        let t = env(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "5"), ("LOCAL_RANK", "1")]).unwrap();
        assert_eq!((t.launcher, t.rank, t.world_size, t.local_rank, t.master_port), (Launcher::Torchrun, 1, 4, Some(1), 5));
        let s = env(&[("SLURM_PROCID", "3"), ("SLURM_NTASKS", "8"), ("SLURM_NTASKS_PER_NODE", "4(x2)"), ("MASTER_ADDR", "n1")]).unwrap();
        assert_eq!((s.launcher, s.rank, s.local_world_size, s.master_port), (Launcher::Slurm, 3, Some(4), DEFAULT_PORT));
        let o = env(&[("OMPI_COMM_WORLD_RANK", "0"), ("OMPI_COMM_WORLD_SIZE", "2"), ("MASTER_ADDR", "x")]).unwrap();
        assert_eq!(o.launcher, Launcher::OpenMpi);
        let p = env(&[("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("MASTER_ADDR", "x")]).unwrap();
        assert_eq!(p.launcher, Launcher::Pmi);
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        let e = env(&[("RANK", "0"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")]).unwrap_err();
        assert!(e.to_string().contains("WORLD_SIZE"), "{e}");
        assert!(env(&[]).unwrap_err().to_string().contains("RANK"));
        assert!(env(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")]).is_err());
    }
}
