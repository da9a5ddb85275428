//! Creating a group: namespacing the store, agreeing on backends, creating
//! them; or a sub-group over its parent's (`shared.rs`).

use super::executor::Executor;
use super::shared::{Shared, Transports};
use super::GroupCore;
use crate::backend::{Backend, BackendContext};
use crate::error::{Error, ErrorKind, Result};
use crate::options::GroupOptions;
use crate::registry::{self, Route};
use crate::store::{PrefixStore, Store};
use crate::tensor::DeviceKind;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock};

pub(super) fn create(store: Arc<dyn Store>, rank: usize, size: usize, options: GroupOptions) -> Result<GroupCore> {
    let fail = |e: Error| e.with_op("init").with_rank(rank);
    if size == 0 || rank >= size {
        return Err(fail(Error::invalid(format!("rank {rank} is out of range for a group of size {size}"))));
    }
    // Each rank counts the groups it created on this store; ranks create
    // groups in the same order, so the n-th group gets the same namespace.
    let n = store.add(&format!("weft/groups_created/{rank}"), 1).map_err(fail)?;
    let store: Arc<dyn Store> = Arc::new(PrefixStore::new(format!("weft/group{n}"), store));

    let plan = registry::plan(&options.backend).map_err(fail)?;
    // (Before anything connects: a malformed WEFT_ALGORITHM fails every rank alike.)
    let algorithms = crate::algorithms::select::Setting::from_env(&options.hints).map_err(fail)?;
    // Probe once; the availability of each candidate is part of what ranks agree on.
    let mut probes: HashMap<String, std::result::Result<(), String>> = HashMap::new();
    let mut agreed = String::new();
    for (route, cands, _) in &plan.routes {
        let avail: Vec<&str> =
            cands.iter().filter(|c| probes.entry(c.to_string()).or_insert_with(|| probe(c)).is_ok()).map(String::as_str).collect();
        agreed += &format!("{}-{}={};", route.0.name(), route.1.name(), avail.join("|"));
    }
    agree(&*store, rank, &options, &agreed).map_err(fail)?;

    let mut made: HashMap<String, Arc<dyn Backend>> = HashMap::new();
    let mut routes = HashMap::new();
    let mut missing = HashMap::new();
    // CPU first: a staging backend for CUDA gets the CPU backend it runs on.
    let mut order = plan.routes.clone();
    order.sort_by_key(|(route, ..)| route.0 != DeviceKind::Cpu);
    for (route, cands, explicit) in order {
        let mut why = Vec::new();
        for name in &cands {
            if let Err(reason) = &probes[name] {
                why.push(format!("{name}: unavailable: {reason}"));
                continue;
            }
            if let Some(b) = made.get(name) {
                routes.insert(route, b.clone());
                break;
            }
            let ctx = BackendContext {
                rank,
                size,
                store: Arc::new(PrefixStore::new(format!("backend/{name}"), store.clone())),
                timeout: options.timeout,
                hints: options.hints.clone(),
                cpu_backend: routes.get(&(DeviceKind::Cpu, crate::tensor::Layout::Dense)).cloned(),
                group_ranks: (0..size).collect(),
            };
            let factory = registry::find(name).expect("planned backends are registered");
            match factory.create(ctx) {
                Ok(b) => {
                    crate::log::debug(format_args!("rank {rank}: {} {} tensors use {name}", route.0.name(), route.1.name()));
                    made.insert(name.clone(), b.clone());
                    routes.insert(route, b);
                    break;
                }
                Err(e) if e.kind() == &ErrorKind::Unsupported && !explicit => why.push(format!("{name}: {}", e.message())),
                Err(e) => return Err(fail(e.context(format!("creating backend {name}")))),
            }
        }
        if !routes.contains_key(&route) {
            if explicit {
                return Err(fail(Error::unsupported(format!(
                    "backend requested for {} {} tensors is not usable: {}",
                    route.0.name(),
                    route.1.name(),
                    why.join("; ")
                ))));
            }
            missing.insert(route, describe_missing(route, &why));
        }
    }
    if routes.is_empty() {
        return Err(fail(Error::unsupported(format!(
            "backend spec {:?} gives no usable backend (registered: {})",
            options.backend,
            registry::backends().iter().map(|f| f.name().to_string()).collect::<Vec<_>>().join(", ")
        ))));
    }
    let debug_detail =
        std::env::var("WEFT_DEBUG").ok().or_else(|| options.hints.get("debug").cloned()).is_some_and(|v| v.eq_ignore_ascii_case("detail"));
    let routes: Vec<_> = routes.into_iter().collect();
    let transports = Some(Arc::new(Transports(made.into_values().collect())));
    Ok(assemble(Parts { rank, size, options, store, routes, missing, algorithms, debug_detail, transports, shares: false }))
}

/// The sub-group `ranks` of `parent` (this rank is its `rank`), running over
/// the parent's transports in tag space `space` (`shared.rs`).
pub(super) fn shared(parent: &GroupCore, store: Arc<dyn Store>, rank: usize, ranks: &[usize], space: u8) -> Result<GroupCore> {
    let transports = parent.transports.lock().unwrap_or_else(|p| p.into_inner()).clone();
    if transports.is_none() {
        return Err(Error::aborted("the parent group was closed").with_op("split").with_rank(parent.rank));
    }
    let mut views: Vec<(Arc<dyn Backend>, Arc<dyn Backend>)> = Vec::new();
    let routes = parent
        .routes
        .iter()
        .map(|(route, b)| {
            let view = match views.iter().find(|(of, _)| Arc::ptr_eq(of, b)) {
                Some((_, v)) => v.clone(),
                None => {
                    let v: Arc<dyn Backend> = Arc::new(Shared::new(b.clone(), parent.size, ranks, space));
                    views.push((b.clone(), v.clone()));
                    v
                }
            };
            (*route, view)
        })
        .collect();
    Ok(assemble(Parts {
        rank,
        size: ranks.len(),
        options: parent.options.clone(),
        store,
        routes,
        missing: parent.missing.clone(),
        algorithms: parent.algorithms.clone(),
        debug_detail: parent.debug_detail,
        transports,
        shares: true,
    }))
}

/// What a group is made of, before it runs anything.
struct Parts {
    rank: usize,
    size: usize,
    options: GroupOptions,
    store: Arc<dyn Store>,
    routes: Vec<(Route, Arc<dyn Backend>)>,
    missing: HashMap<Route, String>,
    algorithms: crate::algorithms::select::Setting,
    debug_detail: bool,
    transports: Option<Arc<Transports>>,
    shares: bool,
}

fn assemble(p: Parts) -> GroupCore {
    GroupCore {
        rank: p.rank,
        size: p.size,
        debug_detail: p.debug_detail,
        host: super::fast::HostPaths::new(&p.routes, &p.options, &p.algorithms, p.debug_detail),
        options: p.options,
        store: p.store,
        routes: p.routes,
        missing: p.missing,
        exec: Arc::new(Executor::default()),
        progress_threads: Default::default(),
        transports: Mutex::new(p.transports),
        shares: p.shares,
        on_abort: OnceLock::new(),
        aborted: AtomicBool::new(false),
        dropped: AtomicBool::new(false),
        poisoned: OnceLock::new(),
        splits: AtomicU64::new(0),
        windows: AtomicU64::new(0),
        surveys: AtomicU64::new(0),
        revoked: AtomicBool::new(false),
        hasher: Default::default(),
        algorithms: p.algorithms,
    }
}

fn probe(name: &str) -> std::result::Result<(), String> {
    registry::find(name).ok_or_else(|| "not registered".to_string())?.probe()
}

/// Rank 0 publishes what it planned; every other rank must have planned the same.
fn agree(store: &dyn Store, rank: usize, options: &GroupOptions, plan: &str) -> Result<()> {
    let mine = format!("spec {:?}: {plan}", options.backend);
    if rank == 0 {
        return store.set("plan", mine.as_bytes());
    }
    let first = store.get("plan", options.timeout).map_err(|e| e.context("waiting for rank 0 to join the group"))?;
    if first != mine.as_bytes() {
        return Err(Error::invalid(format!(
            "backend choice differs between ranks: rank 0 has {}, rank {rank} has {mine}",
            String::from_utf8_lossy(&first)
        )));
    }
    Ok(())
}

fn describe_missing(route: Route, why: &[String]) -> String {
    if why.is_empty() {
        let registered: Vec<String> = registry::backends()
            .iter()
            .map(|f| {
                let devs: Vec<&str> = f.devices().iter().map(|d| d.name()).collect();
                format!("{} ({})", f.name(), devs.join(","))
            })
            .collect();
        format!("no registered backend handles {} {} tensors (registered: {})", route.0.name(), route.1.name(), registered.join(", "))
    } else {
        why.join("; ")
    }
}
