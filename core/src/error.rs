//! The typed error every public weft call returns.
//!
//! Callers match on [`Error::kind`]; the message names the op, the rank(s) and
//! what was expected versus found.

use std::fmt;

/// What went wrong, in a form a caller can match on.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A deadline passed before the operation finished.
    Timeout,
    /// A peer rank died, closed its connection or left the group.
    PeerLost {
        /// The rank (in the group the op ran on) that was lost.
        rank: usize,
    },
    /// The caller passed something invalid: a size, dtype, root, split,
    /// tag, a reduce op on a dtype it does not apply to (BAND on floats)...
    InvalidArgument,
    /// The request is valid but not supported here (no backend for a
    /// device, an op or a window a backend lacks...).
    Unsupported,
    /// The group (or the op) was aborted.
    Aborted,
    /// A transport or backend failure that fits none of the above
    /// (protocol violation, I/O error, plugin failure).
    Backend,
}

/// The error type of the weft API.
///
/// One pointer wide (the details are boxed), so `Result<()>` is too: every
/// op returns one, and moving a 72-byte result through each layer cost
/// the small-op fast path measurably.
#[derive(Clone)]
pub struct Error(Box<Details>);

#[derive(Clone)]
struct Details {
    kind: ErrorKind,
    op: Option<&'static str>,
    rank: Option<usize>,
    /// A timeout's cause: the peer that never answered.
    stalled: Option<usize>,
    message: String,
}

/// Shorthand for `std::result::Result<T, weft::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error(Box::new(Details { kind, op: None, rank: None, stalled: None, message: message.into() }))
    }
    /// A [`ErrorKind::Timeout`] error.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Timeout, message)
    }
    /// A [`ErrorKind::PeerLost`] error naming `rank`.
    pub fn peer_lost(rank: usize, message: impl Into<String>) -> Self {
        Self::new(ErrorKind::PeerLost { rank }, message)
    }
    /// The [`ErrorKind::PeerLost`] error of an op that needs `peer`, which
    /// closed its group on purpose (every transport says it alike).
    pub fn peer_left(peer: usize) -> Self {
        Self::peer_lost(peer, format!("peer rank {peer} left the group (its process group was closed)"))
    }
    /// A [`ErrorKind::InvalidArgument`] error.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::InvalidArgument, message)
    }
    /// A [`ErrorKind::Unsupported`] error.
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }
    /// A [`ErrorKind::Aborted`] error.
    pub fn aborted(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Aborted, message)
    }
    /// A [`ErrorKind::Backend`] error.
    pub fn backend(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Backend, message)
    }

    /// The kind, for matching.
    pub fn kind(&self) -> &ErrorKind {
        &self.0.kind
    }
    /// The op that failed, when known.
    pub fn op(&self) -> Option<&'static str> {
        self.0.op
    }
    /// The rank that reported the error, when known.
    pub fn rank(&self) -> Option<usize> {
        self.0.rank
    }
    /// The message without the op/rank prefix.
    pub fn message(&self) -> &str {
        &self.0.message
    }
    /// True for [`ErrorKind::Timeout`].
    pub fn is_timeout(&self) -> bool {
        self.0.kind == ErrorKind::Timeout
    }
    /// For a timeout: the peer that never answered, when one is to blame
    /// (what a rank that gives up tells the others is the cause).
    pub fn stalled_peer(&self) -> Option<usize> {
        self.0.stalled
    }
    /// Record `peer` (if any) as the one that never answered, unless one
    /// is already.
    pub fn stalled_on(mut self, peer: Option<usize>) -> Self {
        if self.0.stalled.is_none() {
            self.0.stalled = peer;
        }
        self
    }
    /// The peer to blame for this error: the lost one, or the one a timeout
    /// waited for.
    pub fn blamed_peer(&self) -> Option<usize> {
        match self.0.kind {
            ErrorKind::PeerLost { rank } => Some(rank),
            _ => self.0.stalled,
        }
    }

    /// Attach the op name unless one is already set.
    pub fn with_op(mut self, op: &'static str) -> Self {
        self.0.op.get_or_insert(op);
        self
    }
    /// Attach the reporting rank unless one is already set.
    pub fn with_rank(mut self, rank: usize) -> Self {
        self.0.rank.get_or_insert(rank);
        self
    }
    /// The same error with the peer it names (lost, or stalled on)
    /// renumbered by `map`: an error of a transport shared with another
    /// group, told in this group's ranks.
    pub(crate) fn renumbered(mut self, map: impl Fn(usize) -> usize) -> Self {
        if let ErrorKind::PeerLost { rank } = &mut self.0.kind {
            *rank = map(*rank);
        }
        self.0.stalled = self.0.stalled.map(&map);
        self
    }
    /// Prefix the message with more context.
    pub fn context(mut self, context: impl fmt::Display) -> Self {
        self.0.message = format!("{context}: {}", self.0.message);
        self
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &*self.0;
        f.debug_struct("Error").field("kind", &d.kind).field("op", &d.op).field("rank", &d.rank).field("message", &d.message).finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Details { kind, op, rank, message, .. } = &*self.0;
        let kind = match kind {
            ErrorKind::Timeout => "timeout".to_string(),
            ErrorKind::PeerLost { rank } => format!("peer rank {rank} lost"),
            ErrorKind::InvalidArgument => "invalid argument".into(),
            ErrorKind::Unsupported => "unsupported".into(),
            ErrorKind::Aborted => "aborted".into(),
            ErrorKind::Backend => "backend error".into(),
        };
        match (op, rank) {
            (Some(op), Some(r)) => write!(f, "{op} on rank {r}: {kind}: {message}"),
            (Some(op), None) => write!(f, "{op}: {kind}: {message}"),
            (None, Some(r)) => write!(f, "rank {r}: {kind}: {message}"),
            (None, None) => write!(f, "{kind}: {message}"),
        }
    }
}

impl std::error::Error for Error {}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        use std::io::ErrorKind as K;
        match e.kind() {
            K::TimedOut | K::WouldBlock => Error::timeout(e.to_string()),
            _ => Error::backend(e.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_op_rank_and_kind() {
        let e = Error::peer_lost(3, "connection closed").with_op("all_reduce").with_rank(1);
        assert_eq!(e.to_string(), "all_reduce on rank 1: peer rank 3 lost: connection closed");
        assert_eq!(e.kind(), &ErrorKind::PeerLost { rank: 3 });
        // The first op/rank attached wins: inner layers know more.
        let e = e.with_op("outer").with_rank(9);
        assert_eq!(e.op(), Some("all_reduce"));
        assert_eq!(e.rank(), Some(1));
    }
}
