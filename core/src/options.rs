//! Per-op and per-group options, and their defaults from the environment.

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::time::Duration;

/// Environment variable giving the default timeout in seconds.
pub const ENV_TIMEOUT: &str = "WEFT_TIMEOUT_SECONDS";
/// Environment variable giving the backend spec (see [`crate::registry`]).
pub const ENV_BACKEND: &str = "WEFT_BACKEND";
/// Default timeout when `WEFT_TIMEOUT_SECONDS` is unset.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// Options of one op: a timeout overriding the group's and free-form hints
/// (e.g. `algorithm=ring`) a backend may honour.
#[derive(Clone, Debug, Default)]
pub struct OpOptions {
    /// Timeout for this op; `None` uses the group's.
    pub timeout: Option<Duration>,
    /// Backend hints; unknown keys are ignored.
    pub hints: HashMap<String, String>,
    /// For device tensors: the stream the op is ordered after; `None` uses
    /// this thread's [`crate::stream::current_stream`] at issue time.
    pub stream: Option<crate::stream::StreamHandle>,
}

impl OpOptions {
    /// Options with the group defaults.
    pub fn new() -> Self {
        Self::default()
    }
    /// Set the timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
    /// Add a hint.
    pub fn hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }
    /// Order device ops after `stream` (see [`crate::stream`]).
    pub fn stream(mut self, stream: crate::stream::StreamHandle) -> Self {
        self.stream = Some(stream);
        self
    }
}

/// Options of a process group.
#[derive(Clone, Debug)]
pub struct GroupOptions {
    /// Backend spec: `"auto"`, a name, or `"cpu:NAME,cuda:NAME"`.
    pub backend: String,
    /// Default timeout of every op and of setup.
    pub timeout: Duration,
    /// Hints passed to every backend at creation.
    pub hints: HashMap<String, String>,
}

impl GroupOptions {
    /// Defaults, with `WEFT_BACKEND` and `WEFT_TIMEOUT_SECONDS` applied.
    /// An unparsable timeout is an error naming the variable.
    pub fn from_env() -> Result<Self> {
        Ok(GroupOptions {
            backend: std::env::var(ENV_BACKEND).unwrap_or_else(|_| "auto".into()),
            timeout: timeout_from_env()?,
            hints: HashMap::new(),
        })
    }
    /// Set the backend spec.
    pub fn backend(mut self, spec: impl Into<String>) -> Self {
        self.backend = spec.into();
        self
    }
    /// Set the default timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
    /// Add a hint.
    pub fn hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }
}

impl Default for GroupOptions {
    /// As [`GroupOptions::from_env`], with an invalid `WEFT_TIMEOUT_SECONDS`
    /// replaced by the 600 s default.
    fn default() -> Self {
        GroupOptions {
            backend: std::env::var(ENV_BACKEND).unwrap_or_else(|_| "auto".into()),
            timeout: timeout_from_env().unwrap_or(DEFAULT_TIMEOUT),
            hints: HashMap::new(),
        }
    }
}

/// The timeout from `WEFT_TIMEOUT_SECONDS` (fractions allowed), or 600 s.
pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var(ENV_TIMEOUT) {
        Err(_) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| *s > 0.0)
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .ok_or_else(|| Error::invalid(format!("{ENV_TIMEOUT}={v:?} is not a positive number of seconds the clock can hold"))),
    }
}
