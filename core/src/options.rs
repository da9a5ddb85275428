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

/// The timeout from `WEFT_TIMEOUT_SECONDS` (see [`parse_timeout`]), or
/// 600 s where it is unset or empty.
pub fn timeout_from_env() -> Result<Duration> {
    match std::env::var(ENV_TIMEOUT) {
        Ok(v) if !v.trim().is_empty() => parse_timeout(&v),
        _ => Ok(DEFAULT_TIMEOUT),
    }
}

/// A timeout as `WEFT_TIMEOUT_SECONDS` gives it: a positive number of
/// seconds (fractions allowed) the clock can hold; anything else (0, a
/// negative number, text) is `InvalidArgument`. The one parser: the
/// Python package calls it too.
pub fn parse_timeout(text: &str) -> Result<Duration> {
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| Error::invalid(format!("{ENV_TIMEOUT}={text:?} is not a positive number of seconds the clock can hold")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_are_positive_seconds_the_clock_can_hold() {
        assert_eq!(parse_timeout(" 2.5 ").unwrap(), Duration::from_millis(2500));
        for bad in ["0", "-1", "soon", "", "inf", "1e300"] {
            let e = parse_timeout(bad).unwrap_err();
            assert_eq!(e.kind(), &crate::ErrorKind::InvalidArgument, "{bad}");
            assert!(e.to_string().contains(ENV_TIMEOUT), "{e}");
        }
    }
}
