//! Collectives for AI training over ferroce: AllReduce and friends (issue #21).
//!
//! So far this crate holds the arithmetic every collective shares: the element types training
//! exchanges ([`DataType`]: f32, f64, f16, bf16, i32, i64, u8), the reduction operators
//! ([`ReduceOp`]: sum, prod, min, max, avg) and [`reduce_into`], which folds one buffer into
//! another; the rendezvous ([`Store`]) through which the ranks of a job, found from torchrun's
//! environment ([`RankInfo::from_env`]), exchange what they need to connect; and the
//! [`Communicator`], which connects every pair of ranks and runs a ring allreduce and a barrier
//! (see its module doc for the protocol). The other collectives, the small-message algorithms
//! (recursive doubling), pipelining and the nccl-tests tool come next.
//!
//! The kernels work on bytes, as the buffers a collective moves are: a peer's chunk lands in
//! registered memory, and the reduction reads it where it landed. They are plain loops over
//! unaligned loads and stores that the compiler vectorises (f32 and i32 sums run at memory
//! speed; `cargo run --release -p ferroce-coll --example reduce_speed` prints GB/s beside
//! `memcpy`). f16 and bf16 are computed in f32 and rounded back, as NCCL does.

mod comm;
mod ops;
mod reduce;
pub mod store;

pub use comm::{CollError, CommOptions, Communicator};
pub use reduce::{finish_avg, reduce_into, DataType, ReduceError, ReduceOp};
pub use store::{RankInfo, Store, StoreError};
