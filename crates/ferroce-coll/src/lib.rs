//! Collectives for AI training over ferroce: AllReduce and friends (issue #21).
//!
//! A [`Communicator`] joins the ranks of a job (torchrun's environment through the
//! rendezvous, [`Store`]; or [`Communicator::split`] of another) and connects every pair over
//! ferroce: shared memory between ranks on one host, RoCE v2 over UDP between hosts, mixed in
//! one communicator. Its collectives are allreduce (in place and out of place), reduce_scatter,
//! allgather, broadcast, reduce, alltoall, barrier and point-to-point send/recv/sendrecv, over
//! the element types training exchanges ([`DataType`]: f32, f64, f16, bf16, i32, i64, u8) and the
//! reduction operators ([`ReduceOp`]: sum, prod, min, max, avg). How the bytes move (WRITEs into
//! slots the receiver grants with credits, as NCCL's IB transport does) is in `comm/mod.rs`'s
//! module doc; which algorithm each collective uses (recursive doubling or a pipelined ring for
//! allreduce, a binomial tree or a chain for broadcast, ...) in `ops.rs`'s.
//!
//! Rank 0's rendezvous ([`store`]) is open to whoever reaches its port: connections that are
//! not a rank of the job (garbage, silence, oversized lengths, duplicate or out-of-range
//! ranks) are turned away and counted ([`RendezvousStats`]), never a failure or a stall of the
//! job. Setting `FERROCE_JOB_TOKEN` to one secret for every rank makes rank 0 admit only ranks
//! that present it.
//!
//! The kernels work on bytes, as the buffers a collective moves are: a peer's chunk lands in
//! registered memory, and the reduction reads it where it landed. They are plain loops over
//! unaligned loads and stores that the compiler vectorises (f32 and i32 sums run at memory
//! speed; `cargo run --release -p ferroce-coll --example reduce_speed` prints GB/s beside
//! `memcpy`). f16 and bf16 are computed in f32 and rounded back, as NCCL does.

mod comm;
#[cfg(feature = "fuzzing")]
#[doc(hidden)]
pub mod fuzzing;
mod ops;
mod reduce;
pub mod store;
mod words;

pub use comm::{AbortHandle, CollError, CommOptions, Communicator, Progress, Ticket};
pub use reduce::{finish_avg, reduce_into, DataType, ReduceError, ReduceOp};
pub use store::{RankInfo, RendezvousStats, Store, StoreError};
