//! Names and rates: the `*_str` calls, the rate conversions and the fork calls. The strings
//! are the ones rdma-core prints, so a program's output reads the same over ferroce; the test
//! compares every value with the installed library's.

use std::ffi::c_char;

use crate::abi::*;

/// A NUL-terminated literal as a C string.
macro_rules! c {
    ($s:literal) => {
        concat!($s, "\0").as_ptr().cast::<c_char>()
    };
}

/// `ibv_wc_status_str`.
#[no_mangle]
extern "C" fn ibv_wc_status_str(status: ibv_wc_status) -> *const c_char {
    match status {
        IBV_WC_SUCCESS => c!("success"),
        IBV_WC_LOC_LEN_ERR => c!("local length error"),
        IBV_WC_LOC_QP_OP_ERR => c!("local QP operation error"),
        IBV_WC_LOC_EEC_OP_ERR => c!("local EE context operation error"),
        IBV_WC_LOC_PROT_ERR => c!("local protection error"),
        IBV_WC_WR_FLUSH_ERR => c!("Work Request Flushed Error"),
        IBV_WC_MW_BIND_ERR => c!("memory management operation error"),
        IBV_WC_BAD_RESP_ERR => c!("bad response error"),
        IBV_WC_LOC_ACCESS_ERR => c!("local access error"),
        IBV_WC_REM_INV_REQ_ERR => c!("remote invalid request error"),
        IBV_WC_REM_ACCESS_ERR => c!("remote access error"),
        IBV_WC_REM_OP_ERR => c!("remote operation error"),
        IBV_WC_RETRY_EXC_ERR => c!("transport retry counter exceeded"),
        IBV_WC_RNR_RETRY_EXC_ERR => c!("RNR retry counter exceeded"),
        IBV_WC_LOC_RDD_VIOL_ERR => c!("local RDD violation error"),
        IBV_WC_REM_INV_RD_REQ_ERR => c!("remote invalid RD request"),
        IBV_WC_REM_ABORT_ERR => c!("aborted error"),
        IBV_WC_INV_EECN_ERR => c!("invalid EE context number"),
        IBV_WC_INV_EEC_STATE_ERR => c!("invalid EE context state"),
        IBV_WC_FATAL_ERR => c!("fatal error"),
        IBV_WC_RESP_TIMEOUT_ERR => c!("response timeout error"),
        IBV_WC_GENERAL_ERR => c!("general error"),
        IBV_WC_TM_ERR => c!("TM error"),
        IBV_WC_TM_RNDV_INCOMPLETE => c!("TM software rendezvous"),
        _ => c!("unknown"),
    }
}

/// `ibv_node_type_str`.
#[no_mangle]
extern "C" fn ibv_node_type_str(node_type: ibv_node_type) -> *const c_char {
    match node_type {
        IBV_NODE_CA => c!("InfiniBand channel adapter"),
        IBV_NODE_SWITCH => c!("InfiniBand switch"),
        IBV_NODE_ROUTER => c!("InfiniBand router"),
        IBV_NODE_RNIC => c!("iWARP NIC"),
        IBV_NODE_USNIC => c!("usNIC"),
        IBV_NODE_USNIC_UDP => c!("usNIC UDP"),
        IBV_NODE_UNSPECIFIED => c!("unspecified"),
        _ => c!("unknown"),
    }
}

/// `ibv_port_state_str`.
#[no_mangle]
extern "C" fn ibv_port_state_str(state: ibv_port_state) -> *const c_char {
    match state {
        IBV_PORT_NOP => c!("no state change (NOP)"),
        IBV_PORT_DOWN => c!("down"),
        IBV_PORT_INIT => c!("init"),
        IBV_PORT_ARMED => c!("armed"),
        IBV_PORT_ACTIVE => c!("active"),
        IBV_PORT_ACTIVE_DEFER => c!("active defer"),
        _ => c!("unknown"),
    }
}

/// `ibv_event_type_str`.
#[no_mangle]
extern "C" fn ibv_event_type_str(event: ibv_event_type) -> *const c_char {
    match event {
        IBV_EVENT_CQ_ERR => c!("CQ error"),
        IBV_EVENT_QP_FATAL => c!("local work queue catastrophic error"),
        IBV_EVENT_QP_REQ_ERR => c!("invalid request local work queue error"),
        IBV_EVENT_QP_ACCESS_ERR => c!("local access violation work queue error"),
        IBV_EVENT_COMM_EST => c!("communication established"),
        IBV_EVENT_SQ_DRAINED => c!("send queue drained"),
        IBV_EVENT_PATH_MIG => c!("path migrated"),
        IBV_EVENT_PATH_MIG_ERR => c!("path migration request error"),
        IBV_EVENT_DEVICE_FATAL => c!("local catastrophic error"),
        IBV_EVENT_PORT_ACTIVE => c!("port active"),
        IBV_EVENT_PORT_ERR => c!("port error"),
        IBV_EVENT_LID_CHANGE => c!("LID change"),
        IBV_EVENT_PKEY_CHANGE => c!("P_Key change"),
        IBV_EVENT_SM_CHANGE => c!("SM change"),
        IBV_EVENT_SRQ_ERR => c!("SRQ catastrophic error"),
        IBV_EVENT_SRQ_LIMIT_REACHED => c!("SRQ limit reached"),
        IBV_EVENT_QP_LAST_WQE_REACHED => c!("last WQE reached"),
        IBV_EVENT_CLIENT_REREGISTER => c!("client reregistration"),
        IBV_EVENT_GID_CHANGE => c!("GID table change"),
        IBV_EVENT_WQ_FATAL => c!("WQ fatal"),
        _ => c!("unknown"),
    }
}

/// Each static rate: its multiple of 2.5 Gb/s (-1 where it is none) and its Mb/s.
const RATES: [(ibv_rate, i32, i32); 23] = [
    (IBV_RATE_2_5_GBPS, 1, 2500),
    (IBV_RATE_5_GBPS, 2, 5000),
    (IBV_RATE_10_GBPS, 4, 10000),
    (IBV_RATE_20_GBPS, 8, 20000),
    (IBV_RATE_30_GBPS, 12, 30000),
    (IBV_RATE_40_GBPS, 16, 40000),
    (IBV_RATE_60_GBPS, 24, 60000),
    (IBV_RATE_80_GBPS, 32, 80000),
    (IBV_RATE_120_GBPS, 48, 120000),
    (IBV_RATE_14_GBPS, -1, 14062),
    (IBV_RATE_56_GBPS, -1, 56250),
    (IBV_RATE_112_GBPS, -1, 112500),
    (IBV_RATE_168_GBPS, -1, 168750),
    (IBV_RATE_25_GBPS, -1, 25781),
    (IBV_RATE_100_GBPS, -1, 103125),
    (IBV_RATE_200_GBPS, -1, 206250),
    (IBV_RATE_300_GBPS, -1, 309375),
    (IBV_RATE_28_GBPS, 11, 28125),
    (IBV_RATE_50_GBPS, 20, 53125),
    (IBV_RATE_400_GBPS, 160, 425000),
    (IBV_RATE_600_GBPS, 240, 637500),
    (IBV_RATE_800_GBPS, 320, 850000),
    (IBV_RATE_1200_GBPS, 480, 1275000),
];

/// `ibv_rate_to_mult`.
#[no_mangle]
extern "C" fn ibv_rate_to_mult(rate: ibv_rate) -> libc::c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.1)
}

/// `mult_to_ibv_rate`.
#[no_mangle]
extern "C" fn mult_to_ibv_rate(mult: libc::c_int) -> ibv_rate {
    RATES
        .iter()
        .find(|r| r.1 == mult && mult > 0)
        .map_or(IBV_RATE_MAX, |r| r.0)
}

/// `ibv_rate_to_mbps`.
#[no_mangle]
extern "C" fn ibv_rate_to_mbps(rate: ibv_rate) -> libc::c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

/// `mbps_to_ibv_rate`.
#[no_mangle]
extern "C" fn mbps_to_ibv_rate(mbps: libc::c_int) -> ibv_rate {
    RATES
        .iter()
        .find(|r| r.2 == mbps)
        .map_or(IBV_RATE_MAX, |r| r.0)
}

/// `ibv_fork_init`: nothing to do. rdma-core marks registered memory do-not-fork because a NIC
/// writes the physical pages it pinned, which a copy-on-write after `fork` would take away
/// from the parent; ferroce reaches memory through the owner's virtual addresses, which stay
/// the parent's own.
#[no_mangle]
extern "C" fn ibv_fork_init() -> libc::c_int {
    0
}

/// `ibv_is_fork_initialized`: fork needs no care (see [`ibv_fork_init`]).
#[no_mangle]
extern "C" fn ibv_is_fork_initialized() -> ibv_fork_status {
    IBV_FORK_UNNEEDED
}

/// `ibv_dontfork_range`: nothing to do (see [`ibv_fork_init`]).
#[no_mangle]
extern "C" fn ibv_dontfork_range(_base: *mut libc::c_void, _size: usize) -> libc::c_int {
    0
}

/// `ibv_dofork_range`: nothing to do (see [`ibv_fork_init`]).
#[no_mangle]
extern "C" fn ibv_dofork_range(_base: *mut libc::c_void, _size: usize) -> libc::c_int {
    0
}
