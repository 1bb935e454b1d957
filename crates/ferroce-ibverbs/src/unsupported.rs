//! Every other exported call of rdma-core's libibverbs: what ferroce does not do fails the way
//! rdma-core fails an unsupported feature (`EOPNOTSUPP`: returned, or in `errno` with NULL or
//! -1), never crashing and never pretending to succeed.
//!
//! The private `IBVERBS_PRIVATE_34` calls are how rdma-core's own provider libraries (libmlx5,
//! libefa, …, which perftest and UCX load) talk to the kernel. They must resolve for those
//! libraries to load at all; their registration hooks do nothing, so no foreign provider ever
//! finds a device, and their kernel commands fail as on a machine without the kernel device.
//!
//! The parameters are left out: on x86-64 and AArch64 a callee that ignores its arguments may
//! be declared without them, and the return register carries the same type either way.

use std::ffi::c_char;

// why: multicast groups are not built (a UD multicast group needs the fabric's membership:
// IGMP on Ethernet, the subnet manager on InfiniBand)
returns_errno!(ibv_attach_mcast, ibv_detach_mcast);

// why: the kernel's neighbour lookup for a GID; RoCE over UDP sockets needs no L2 address
returns_errno!(ibv_resolve_eth_l2_from_gid);

// why: rdma-core's provider libraries' commands to a kernel device, which ferroce has none of
returns_errno!(
    execute_ioctl,
    ibv_cmd_advise_mr,
    ibv_cmd_alloc_dm,
    ibv_cmd_alloc_mw,
    ibv_cmd_alloc_pd,
    ibv_cmd_attach_mcast,
    ibv_cmd_close_xrcd,
    ibv_cmd_create_ah,
    ibv_cmd_create_counters,
    ibv_cmd_create_cq,
    ibv_cmd_create_cq_ex,
    ibv_cmd_create_flow,
    ibv_cmd_create_flow_action_esp,
    ibv_cmd_create_qp,
    ibv_cmd_create_qp_ex,
    ibv_cmd_create_qp_ex2,
    ibv_cmd_create_rwq_ind_table,
    ibv_cmd_create_srq,
    ibv_cmd_create_srq_ex,
    ibv_cmd_create_wq,
    ibv_cmd_dealloc_mw,
    ibv_cmd_dealloc_pd,
    ibv_cmd_dereg_mr,
    ibv_cmd_destroy_ah,
    ibv_cmd_destroy_counters,
    ibv_cmd_destroy_cq,
    ibv_cmd_destroy_flow,
    ibv_cmd_destroy_flow_action,
    ibv_cmd_destroy_qp,
    ibv_cmd_destroy_rwq_ind_table,
    ibv_cmd_destroy_srq,
    ibv_cmd_destroy_wq,
    ibv_cmd_detach_mcast,
    ibv_cmd_free_dm,
    ibv_cmd_get_context,
    ibv_cmd_modify_cq,
    ibv_cmd_modify_flow_action_esp,
    ibv_cmd_modify_qp,
    ibv_cmd_modify_qp_ex,
    ibv_cmd_modify_srq,
    ibv_cmd_modify_wq,
    ibv_cmd_open_qp,
    ibv_cmd_open_xrcd,
    ibv_cmd_poll_cq,
    ibv_cmd_post_recv,
    ibv_cmd_post_send,
    ibv_cmd_post_srq_recv,
    ibv_cmd_query_context,
    ibv_cmd_query_device_any,
    ibv_cmd_query_mr,
    ibv_cmd_query_port,
    ibv_cmd_query_qp,
    ibv_cmd_query_srq,
    ibv_cmd_read_counters,
    ibv_cmd_reg_dm_mr,
    ibv_cmd_reg_dmabuf_mr,
    ibv_cmd_reg_mr,
    ibv_cmd_req_notify_cq,
    ibv_cmd_rereg_mr,
    ibv_cmd_resize_cq,
);

// why: not built: objects shared from another process's context, dma-buf memory, extended
// QPs (`ibv_wr_*`), and rdma-core's internal device-open path
returns_null!(
    ibv_import_device,
    ibv_import_mr,
    ibv_import_pd,
    ibv_import_dm,
    ibv_reg_dmabuf_mr,
    ibv_qp_to_qp_ex,
    _verbs_init_and_alloc_context,
    verbs_open_device,
);

// why: a kernel device's sysfs files, which ferroce's devices have none of
returns_minus_one!(ibv_read_sysfs_file, ibv_read_ibdev_sysfs_file);

does_nothing!(
    ibv_copy_path_rec_from_kern,
    ibv_copy_path_rec_to_kern,
    ibv_copy_qp_attr_from_kern,
    ibv_copy_ah_attr_from_kern,
    ibv_unimport_mr,
    ibv_unimport_pd,
    ibv_unimport_dm,
    __verbs_log,
    verbs_register_driver_34,
    verbs_set_ops,
    verbs_uninit_context,
    verbs_init_cq,
);

/// `ibv_query_qp_data_in_order`: 0, "no in-order guarantee to rely on", the answer rdma-core
/// gives for a device that does not say.
#[no_mangle]
extern "C" fn ibv_query_qp_data_in_order() -> libc::c_int {
    0
}

/// `__ioctl_final_num_attrs`: a provider's ioctl helper; counts nothing beyond what it is given.
#[no_mangle]
extern "C" fn __ioctl_final_num_attrs(num_attrs: libc::c_uint) -> libc::c_uint {
    num_attrs
}

/// `ibv_get_sysfs_path`: where rdma-core looks for devices (ferroce needs no sysfs entry).
#[no_mangle]
extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// `verbs_allow_disassociate_destroy`: rdma-core's flag for destroying objects of a device that
/// went away; ferroce's devices do not.
#[no_mangle]
static verbs_allow_disassociate_destroy: bool = false;
