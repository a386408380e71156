//! The collectives as the untyped API takes them ([`Collective`]): braid's
//! own type, the planner's `braid_core::plan::Collective` without the
//! point-to-point groups (those go through [`crate::Communicator::group`]).

use braid_core::plan;
use braid_core::types::RedOp;

use crate::error::{Error, Result};

/// A collective operation for [`crate::Communicator::run_bytes`] and
/// [`crate::CudaComm::run`], with counts in elements (as NCCL's API takes
/// them). The typed methods (`all_reduce`, `all_gather`, ...) build these
/// for you.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Collective {
    /// Every rank receives `op` over the ranks' `count` elements.
    AllReduce { count: usize, op: RedOp },
    /// Each rank receives `recv_count` elements of the reduced array of
    /// `nranks · recv_count`.
    ReduceScatter { recv_count: usize, op: RedOp },
    /// Each rank contributes `send_count` elements; every rank receives
    /// all `nranks · send_count`.
    AllGather { send_count: usize },
    /// `root`'s `count` elements reach every rank.
    Broadcast { count: usize, root: u32 },
    /// `root` receives `op` over the ranks' `count` elements.
    Reduce { count: usize, op: RedOp, root: u32 },
    /// `count` elements go to each peer (send and recv hold
    /// `nranks · count`).
    AllToAll { count: usize },
    /// No rank leaves before every rank entered; each buffer is one element
    /// of any datatype (the token).
    Barrier,
}

impl Collective {
    /// Short name used in logs and errors (`AllReduce`, `Broadcast`, ...).
    pub fn name(&self) -> &'static str {
        self.plan().name()
    }

    /// The reduction operator, if the collective reduces.
    pub fn red_op(&self) -> Option<RedOp> {
        self.plan().red_op()
    }

    /// The root, for rooted collectives.
    pub fn root(&self) -> Option<u32> {
        self.plan().root()
    }

    /// Element counts of the send and the receive buffer with `nranks`
    /// ranks; an error if they overflow the address space.
    pub fn buffer_counts(&self, nranks: u32) -> Result<[usize; 2]> {
        self.plan().collective_counts(nranks).map_err(|e| match e {
            braid_core::CoreError::InvalidArgument(m) => Error::InvalidArgument(m),
            other => Error::Core(other),
        })
    }

    /// The planner's description of the same operation.
    pub(crate) fn plan(self) -> plan::Collective {
        match self {
            Collective::AllReduce { count, op } => plan::Collective::AllReduce { count, op },
            Collective::ReduceScatter { recv_count, op } => {
                plan::Collective::ReduceScatter { recv_count, op }
            }
            Collective::AllGather { send_count } => plan::Collective::AllGather { send_count },
            Collective::Broadcast { count, root } => plan::Collective::Broadcast { count, root },
            Collective::Reduce { count, op, root } => plan::Collective::Reduce { count, op, root },
            Collective::AllToAll { count } => plan::Collective::AllToAll { count },
            Collective::Barrier => plan::Collective::Barrier,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variant names the planner's operation of the same name and
    /// counts, and the counts that overflow are an invalid argument.
    #[test]
    fn same_operation_as_the_planner() {
        let op = RedOp::Max;
        let all = [
            Collective::AllReduce { count: 5, op },
            Collective::ReduceScatter { recv_count: 5, op },
            Collective::AllGather { send_count: 5 },
            Collective::Broadcast { count: 5, root: 2 },
            Collective::Reduce {
                count: 5,
                op,
                root: 1,
            },
            Collective::AllToAll { count: 5 },
            Collective::Barrier,
        ];
        let names = [
            "AllReduce",
            "ReduceScatter",
            "AllGather",
            "Broadcast",
            "Reduce",
            "AllToAll",
            "Barrier",
        ];
        let counts = [[5, 5], [15, 5], [5, 15], [5, 5], [5, 5], [15, 15], [1, 1]];
        for ((c, name), want) in all.iter().zip(names).zip(counts) {
            assert_eq!(c.name(), name);
            assert_eq!(c.plan().name(), name);
            assert_eq!(c.buffer_counts(3).unwrap(), want, "{name}");
        }
        assert_eq!(all[0].red_op(), Some(op));
        assert_eq!(all[2].red_op(), None);
        assert_eq!(all[3].root(), Some(2));
        assert_eq!(all[4].root(), Some(1));
        let huge = Collective::AllGather {
            send_count: usize::MAX / 2,
        };
        assert!(matches!(
            huge.buffer_counts(3),
            Err(Error::InvalidArgument(_))
        ));
    }
}
