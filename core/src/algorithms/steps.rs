//! [`Steps`]: what every algorithm talks to, a backend bound to the op
//! being run (its tags, its phases, its point-to-point steps).

use super::line;
use crate::backend::{Backend, GatherSend, OpContext, P2p};
use crate::error::Result;

/// A backend plus the op being run, whose message steps it tags: what
/// every algorithm talks to (`Steps::new(backend, ctx)`).
#[derive(Clone, Copy)]
pub struct Steps<'a> {
    backend: &'a dyn Backend,
    ctx: &'a OpContext,
    /// Added to every step: lets one op run several algorithms in turn.
    base: u32,
    /// Locality bits for every step's tag ([`crate::tag::COMBINES`],
    /// [`crate::tag::FRESH`]).
    locality: u64,
}

impl<'a> Steps<'a> {
    /// Bind a backend to an op.
    pub fn new(backend: &'a dyn Backend, ctx: &'a OpContext) -> Self {
        Steps { backend, ctx, base: 0, locality: 0 }
    }
    /// The same steps for phase `n` of an op (steps of different phases never share a tag).
    pub fn phase(&self, n: u32) -> Self {
        Steps { base: n * 4096, ..*self }
    }
    /// The same steps for steps whose receiver reduces what it receives as
    /// it arrives: a transport that can leave a message in either side's
    /// cache leaves it in the receiver's.
    pub fn combining(&self) -> Self {
        Steps { locality: crate::tag::COMBINES, ..*self }
    }
    /// The same steps for steps whose sender has just written what it sends
    /// (a block it reduced, one it received in the step before): a
    /// transport that can move a message with either side's core moves it
    /// with the sender's, whose cache holds it. Read by the receiver's
    /// core, every line would come out of the sender's cache one by one
    /// (2.4 times slower: bench/RESULTS.md, "Algorithm choices").
    pub fn sending_fresh(&self) -> Self {
        Steps { locality: crate::tag::FRESH, ..*self }
    }
    /// Which phase these steps are in.
    pub fn phase_index(&self) -> u32 {
        self.base / 4096
    }
    /// The same phase with steps shifted by `offset` (a sub-range of tags).
    pub fn phase_step(&self, offset: u32) -> Self {
        Steps { base: self.base + offset, ..*self }
    }
    /// The tag of `step` in this phase.
    pub fn tag(&self, step: u32) -> u64 {
        self.ctx.tag(self.base + step) | self.locality
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.ctx.rank
    }
    /// Group size.
    pub fn size(&self) -> usize {
        self.ctx.size
    }
    /// The op context.
    pub fn ctx(&self) -> &OpContext {
        self.ctx
    }
    /// The backend's [`Capabilities::step_bytes`](crate::backend::Capabilities::step_bytes).
    pub fn step_bytes(&self) -> usize {
        self.backend.capabilities().step_bytes
    }
    /// Where this rank sits along rings and chains (the backend's
    /// [`Capabilities::rank_order`](crate::backend::Capabilities::rank_order)).
    pub fn line(&self) -> line::Line<'a> {
        line::Line::new(self.backend.capabilities().rank_order.as_deref(), self.size(), self.rank())
    }
    /// Run a batch of point-to-point ops.
    pub fn exchange(&self, ops: &mut [P2p<'_>]) -> Result<()> {
        self.backend.exchange(ops, &self.ctx.deadline)
    }
    /// Run a batch of point-to-point ops plus sends of gathered bytes
    /// ([`Backend::exchange_gathered`]).
    pub fn exchange_gathered(&self, ops: &mut [P2p<'_>], gathered: &[GatherSend<'_>]) -> Result<()> {
        self.backend.exchange_gathered(ops, gathered, &self.ctx.deadline)
    }
    /// Send `data` to `to` and receive `buf` from `from` at once, as step `step`.
    pub fn send_recv(&self, step: u32, to: usize, data: &[u8], from: usize, buf: &mut [u8]) -> Result<()> {
        let tag = self.tag(step);
        self.exchange(&mut [P2p::Send { peer: to, tag, data }, P2p::Recv { peer: from, tag, buf }])
    }
    /// Send only.
    pub fn send(&self, step: u32, to: usize, data: &[u8]) -> Result<()> {
        self.exchange(&mut [P2p::Send { peer: to, tag: self.tag(step), data }])
    }
    /// Receive only.
    pub fn recv(&self, step: u32, from: usize, buf: &mut [u8]) -> Result<()> {
        self.exchange(&mut [P2p::Recv { peer: from, tag: self.tag(step), buf }])
    }
}
