//! One store client's protocol, without I/O: authentication first (when
//! the store has a key), then requests run against the server's state.
//! The server (`tcp_server.rs`) reads frames and writes what this answers.

use super::memory::MemoryStore;
use super::wire::{Encoder, Request, Status};
use super::Store;
use crate::auth::{self, Key};
use crate::error::{Error, ErrorKind, Result};

/// The label of the server's proof, then the client's ([`Key::prove`]).
pub(super) const SERVER_PROOF: &str = "weft store server";
pub(super) const CLIENT_PROOF: &str = "weft store client";

/// What to do after a request.
#[derive(Debug)]
pub(crate) enum Answer {
    /// Send this reply and go on.
    Reply(Vec<u8>),
    /// Tell the client why (if it still listens) and drop it.
    Refuse(Error),
    /// The client left while its request waited: drop it silently.
    Gone,
}

/// One client's state.
pub(crate) struct Session<'a> {
    key: Option<&'a Key>,
    state: &'a MemoryStore,
    /// Our nonce and the client's, between `Hello` and `Proof`.
    challenge: Option<([u8; auth::NONCE], Vec<u8>)>,
    trusted: bool,
}

impl<'a> Session<'a> {
    /// A new client of the store `state`, which requires `key` if any.
    pub(crate) fn new(key: Option<&'a Key>, state: &'a MemoryStore) -> Session<'a> {
        Session { key, state, challenge: None, trusted: key.is_none() }
    }

    /// Whether the client may make requests (it has proven the key, or
    /// none is needed).
    pub(crate) fn trusted(&self) -> bool {
        self.trusted
    }

    /// Answer `req`; a request that waits gives up when `gone()` says the
    /// client has left.
    pub(crate) fn answer(&mut self, req: Request, gone: &dyn Fn() -> bool) -> Answer {
        let ok = || Encoder::default().u8(Status::Ok as u8);
        let req = match (req, self.key, self.trusted) {
            (Request::Hello { nonce: theirs }, Some(key), false) if self.challenge.is_none() && theirs.len() == auth::NONCE => {
                let Ok(mine) = auth::nonce() else { return Answer::Refuse(Error::backend("no randomness")) };
                let proof = key.prove(SERVER_PROOF, &[&theirs, &mine]);
                self.challenge = Some((mine, theirs));
                return Answer::Reply(ok().bytes(&mine).bytes(&proof).0);
            }
            (Request::Proof { proof }, Some(key), false) => {
                return match self.challenge.take() {
                    Some((mine, theirs)) if key.verify(CLIENT_PROOF, &[&mine, &theirs], &proof) => {
                        self.trusted = true;
                        Answer::Reply(ok().0)
                    }
                    _ => Answer::Refuse(Error::backend("authentication failed")),
                }
            }
            (Request::Hello { .. }, None, _) => {
                return Answer::Refuse(Error::backend("this store has no key, but the client has one (WEFT_AUTH_KEY)"))
            }
            (_, Some(_), false) => return Answer::Refuse(Error::backend("this store requires a key (WEFT_AUTH_KEY)")),
            (req, ..) => req,
        };
        match execute(self.state, req, gone) {
            Ok(body) => Answer::Reply(body),
            Err(e) if e.kind() == &ErrorKind::Aborted => Answer::Gone,
            Err(e) if e.kind() == &ErrorKind::Timeout => {
                Answer::Reply(Encoder::default().u8(Status::Timeout as u8).bytes(e.message().as_bytes()).0)
            }
            Err(e) => Answer::Reply(Encoder::default().u8(Status::Error as u8).bytes(e.message().as_bytes()).0),
        }
    }
}

fn refs(keys: &[String]) -> Vec<&str> {
    keys.iter().map(String::as_str).collect()
}

fn execute(s: &MemoryStore, req: Request, gone: &dyn Fn() -> bool) -> Result<Vec<u8>> {
    let ok = Encoder::default().u8(Status::Ok as u8);
    Ok(match req {
        Request::Set { key, value } => {
            s.set(&key, &value)?;
            ok
        }
        Request::Get { key, timeout } => ok.bytes(&s.get_unless_gone(&key, timeout, gone)?),
        Request::Add { key, delta } => ok.u64(s.add(&key, delta)? as u64),
        Request::CompareSet { key, expected, desired } => ok.bytes(&s.compare_set(&key, &expected, &desired)?),
        Request::Wait { keys, timeout } => {
            s.wait_unless_gone(&refs(&keys), timeout, gone)?;
            ok
        }
        Request::Check { keys } => ok.u8(s.check(&refs(&keys))? as u8),
        Request::Delete { key } => ok.u8(s.delete(&key)? as u8),
        Request::NumKeys => ok.u64(s.num_keys()?),
        Request::Hello { .. } | Request::Proof { .. } => return Err(Error::invalid("already authenticated")),
    }
    .0)
}
