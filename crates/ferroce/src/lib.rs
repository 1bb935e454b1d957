//! ferroce: the RDMA verbs programming model over RoCE v2, in userspace.
#![warn(missing_docs)]

pub mod cm;
