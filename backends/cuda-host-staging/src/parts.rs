//! An op as a list of device tensors to stage, and the same op rebuilt
//! over host views of one chunk of each.
//!
//! Every op splits into chunks the same way on every rank: chunk k of a
//! tensor of n elements is elements `[n*k/C, n*(k+1)/C)`. The tensor a peer
//! pairs with this one (rank i's input and output i of an all_gather, say)
//! has the same length, hence the same boundaries, so the op on chunk k of
//! every tensor is itself a valid op, and the C of them make the whole.

use weft::backend::Op;
use weft::{DType, Device, Error, Result, Tensor, TensorMut};

/// What staging does with a tensor.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Copied to the host before the op.
    In,
    /// Copied back to the device after the op.
    Out,
    /// Both (in-place ops).
    InOut,
}

impl Role {
    pub fn downloads(self) -> bool {
        self != Role::Out
    }
    pub fn uploads(self) -> bool {
        self != Role::In
    }
}

/// One device tensor of the op.
#[derive(Copy, Clone, Debug)]
pub struct Part {
    pub addr: u64,
    pub numel: usize,
    pub dtype: DType,
    pub role: Role,
}

impl Part {
    /// Element range of chunk `k` of `chunks`.
    pub fn range(&self, k: usize, chunks: usize) -> (usize, usize) {
        (self.numel * k / chunks, self.numel * (k + 1) / chunks)
    }
}

fn part(t: &Tensor<'_>, role: Role) -> Part {
    Part { addr: t.as_ptr() as u64, numel: t.numel(), dtype: t.dtype(), role }
}
fn part_mut(t: &TensorMut<'_>, role: Role) -> Part {
    part(&t.as_tensor(), role)
}

/// The device tensors of `op` on this rank, in a fixed order, and the CUDA
/// device they are on.
pub fn parts(op: &Op<'_>, rank: usize) -> Result<(Vec<Part>, usize)> {
    let mut v = Vec::new();
    match op {
        Op::Send { data, .. } => v.push(part(data, Role::In)),
        Op::Recv { buf, .. } => v.push(part_mut(buf, Role::Out)),
        Op::Broadcast { buf, root } => v.push(part_mut(buf, if rank == *root { Role::In } else { Role::Out })),
        Op::AllReduce { buf, .. } => v.push(part_mut(buf, Role::InOut)),
        Op::Reduce { buf, root, .. } => v.push(part_mut(buf, if rank == *root { Role::InOut } else { Role::In })),
        Op::AllGather { input, outputs } | Op::Gather { input, outputs, .. } => {
            v.push(part(input, Role::In));
            v.extend(outputs.iter().map(|t| part_mut(t, Role::Out)));
        }
        Op::ReduceScatter { inputs, output, .. } | Op::Scatter { inputs, output, .. } => {
            v.extend(inputs.iter().map(|t| part(t, Role::In)));
            v.push(part_mut(output, Role::Out));
        }
        Op::AllToAll { inputs, outputs } => {
            v.extend(inputs.iter().map(|t| part(t, Role::In)));
            v.extend(outputs.iter().map(|t| part_mut(t, Role::Out)));
        }
        Op::Barrier => {}
        Op::Batch { ops } => {
            for op in ops {
                v.extend(parts(op, rank)?.0);
            }
        }
        _ => return Err(Error::unsupported("cuda-host-staging: this op has no staged form")),
    }
    let device = devices(op)?;
    Ok((v, device))
}

fn devices(op: &Op<'_>) -> Result<usize> {
    let mut found = None;
    let mut check = |d: Device| -> Result<()> {
        match (d, found) {
            (Device::Cuda(i), None) => found = Some(i as usize),
            (Device::Cuda(i), Some(j)) if i as usize == j => {}
            _ => return Err(Error::invalid(format!("cuda-host-staging: tensors on {d} and cuda:{}", found.unwrap_or(0)))),
        }
        Ok(())
    };
    match op {
        Op::Send { data, .. } => check(data.device())?,
        Op::Recv { buf, .. } | Op::Broadcast { buf, .. } | Op::AllReduce { buf, .. } | Op::Reduce { buf, .. } => check(buf.device())?,
        Op::AllGather { input, outputs } | Op::Gather { input, outputs, .. } => {
            check(input.device())?;
            outputs.iter().try_for_each(|t| check(t.device()))?;
        }
        Op::ReduceScatter { inputs, output, .. } | Op::Scatter { inputs, output, .. } => {
            inputs.iter().try_for_each(|t| check(t.device()))?;
            check(output.device())?;
        }
        Op::AllToAll { inputs, outputs } => {
            inputs.iter().try_for_each(|t| check(t.device()))?;
            outputs.iter().try_for_each(|t| check(t.device()))?;
        }
        Op::Batch { ops } => {
            for op in ops {
                match op {
                    Op::Send { data, .. } => check(data.device())?,
                    Op::Recv { buf, .. } => check(buf.device())?,
                    _ => {}
                }
            }
        }
        _ => {}
    }
    Ok(found.unwrap_or(0))
}

/// Host memory of one chunk of each part, in the order of [`parts`].
pub struct HostViews {
    pub ptrs: Vec<(*mut u8, usize, DType)>,
}

impl HostViews {
    fn tensor<'a>(&self, i: usize) -> Result<Tensor<'a>> {
        let (p, n, d) = self.ptrs[i];
        // SAFETY: the pipeline hands out disjoint, live ranges of its pinned
        // slot, aligned for the dtype, valid while the host op runs.
        unsafe { Tensor::from_raw_parts(p, d, Device::Cpu, &[n], None) }
    }
    fn tensor_mut<'a>(&self, i: usize) -> Result<TensorMut<'a>> {
        let (p, n, d) = self.ptrs[i];
        // SAFETY: as above; each range is used by exactly one view.
        unsafe { TensorMut::from_raw_parts(p, d, Device::Cpu, &[n], None) }
    }
}

/// `op` again, over host views (the same variant and arguments).
pub fn host_op<'a>(op: &Op<'_>, h: &HostViews) -> Result<Op<'a>> {
    let outs = |from: usize, n: usize| (from..from + n).map(|i| h.tensor_mut(i)).collect::<Result<Vec<_>>>();
    let ins = |from: usize, n: usize| (from..from + n).map(|i| h.tensor(i)).collect::<Result<Vec<_>>>();
    Ok(match op {
        Op::Send { peer, tag, .. } => Op::Send { data: h.tensor(0)?, peer: *peer, tag: *tag },
        Op::Recv { peer, tag, .. } => Op::Recv { buf: h.tensor_mut(0)?, peer: *peer, tag: *tag },
        Op::Broadcast { root, .. } => Op::Broadcast { buf: h.tensor_mut(0)?, root: *root },
        Op::AllReduce { op, .. } => Op::AllReduce { buf: h.tensor_mut(0)?, op: *op },
        Op::Reduce { root, op, .. } => Op::Reduce { buf: h.tensor_mut(0)?, root: *root, op: *op },
        Op::AllGather { outputs, .. } => Op::AllGather { input: h.tensor(0)?, outputs: outs(1, outputs.len())? },
        Op::Gather { outputs, root, .. } => Op::Gather { input: h.tensor(0)?, outputs: outs(1, outputs.len())?, root: *root },
        Op::ReduceScatter { inputs, op, .. } => {
            Op::ReduceScatter { inputs: ins(0, inputs.len())?, output: h.tensor_mut(inputs.len())?, op: *op }
        }
        Op::Scatter { inputs, root, .. } => Op::Scatter { inputs: ins(0, inputs.len())?, output: h.tensor_mut(inputs.len())?, root: *root },
        Op::AllToAll { inputs, outputs } => Op::AllToAll { inputs: ins(0, inputs.len())?, outputs: outs(inputs.len(), outputs.len())? },
        Op::Barrier => Op::Barrier,
        // One part per send or receive, in order.
        Op::Batch { ops } => Op::Batch {
            ops: ops
                .iter()
                .enumerate()
                .map(|(i, op)| match op {
                    Op::Send { peer, tag, .. } => Ok(Op::Send { data: h.tensor(i)?, peer: *peer, tag: *tag }),
                    Op::Recv { peer, tag, .. } => Ok(Op::Recv { buf: h.tensor_mut(i)?, peer: *peer, tag: *tag }),
                    _ => Err(Error::invalid("a batch holds only sends and receives")),
                })
                .collect::<Result<Vec<_>>>()?,
        },
        _ => return Err(Error::unsupported("cuda-host-staging: this op has no staged form")),
    })
}
