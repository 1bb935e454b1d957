//! The libibverbs calls this library makes, found in the process with `dlsym`: the contexts,
//! PDs and QPs it makes must be the ones the program's own verbs calls see.

use super::*;

pub(super) type GetDeviceListFn = unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device;

pub(super) type FreeDeviceListFn = unsafe extern "C" fn(*mut *mut ibv_device);

pub(super) type GetDeviceNameFn = unsafe extern "C" fn(*mut ibv_device) -> *const c_char;

pub(super) type OpenDeviceFn = unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context;

pub(super) type QueryPortFn =
    unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;

pub(super) type AllocPdFn = unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd;

pub(super) type DeallocPdFn = unsafe extern "C" fn(*mut ibv_pd) -> c_int;

pub(super) type CreateQpFn =
    unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;

pub(super) type ModifyQpFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;

pub(super) type DestroyQpFn = unsafe extern "C" fn(*mut ibv_qp) -> c_int;

pub(super) type CreateCompChannelFn =
    unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel;

pub(super) type DestroyCompChannelFn = unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int;

pub(super) type CreateCqFn = unsafe extern "C" fn(
    *mut ibv_context,
    c_int,
    *mut c_void,
    *mut ibv_comp_channel,
    c_int,
) -> *mut ibv_cq;

pub(super) type DestroyCqFn = unsafe extern "C" fn(*mut ibv_cq) -> c_int;

pub(super) type EceFn = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_ece) -> c_int;

pub(super) type RegMrFn =
    unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;

pub(super) type DeregMrFn = unsafe extern "C" fn(*mut ibv_mr) -> c_int;

pub(super) type GetCqEventFn =
    unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;

pub(super) type AckCqEventsFn = unsafe extern "C" fn(*mut ibv_cq, std::ffi::c_uint);

/// The libibverbs calls this library makes, resolved in the process's global scope.
pub(super) struct Verbs {
    pub(super) get_device_list: GetDeviceListFn,
    pub(super) free_device_list: FreeDeviceListFn,
    pub(super) get_device_name: GetDeviceNameFn,
    pub(super) open_device: OpenDeviceFn,
    pub(super) query_port: QueryPortFn,
    pub(super) alloc_pd: AllocPdFn,
    pub(super) dealloc_pd: DeallocPdFn,
    pub(super) create_qp: CreateQpFn,
    pub(super) modify_qp: ModifyQpFn,
    pub(super) destroy_qp: DestroyQpFn,
    pub(super) create_comp_channel: CreateCompChannelFn,
    pub(super) destroy_comp_channel: DestroyCompChannelFn,
    pub(super) create_cq: CreateCqFn,
    pub(super) destroy_cq: DestroyCqFn,
    pub(super) query_ece: EceFn,
    pub(super) set_ece: EceFn,
    pub(super) reg_mr: RegMrFn,
    pub(super) dereg_mr: DeregMrFn,
    pub(super) get_cq_event: GetCqEventFn,
    pub(super) ack_cq_events: AckCqEventsFn,
}

/// The function `name` among the process's loaded objects (`dlsym` with `RTLD_DEFAULT`).
pub(super) fn find_symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: a NUL-terminated name; RTLD_DEFAULT searches the loaded objects.
    let p = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!p.is_null()).then_some(p)
}

pub(super) fn verbs() -> Option<&'static Verbs> {
    static VERBS: OnceLock<Option<Verbs>> = OnceLock::new();
    VERBS
        .get_or_init(|| {
            let find = find_symbol;
            // SAFETY: each symbol is libibverbs' function of that name, whose C signature is
            // the one declared in the field.
            // The symbol `$name`, as the function type `$ty`.
            macro_rules! sym {
                ($name:literal as $ty:ty) => {
                    std::mem::transmute::<*mut c_void, $ty>(find($name)?)
                };
            }
            unsafe {
                Some(Verbs {
                    get_device_list: sym!(c"ibv_get_device_list" as GetDeviceListFn),
                    free_device_list: sym!(c"ibv_free_device_list" as FreeDeviceListFn),
                    get_device_name: sym!(c"ibv_get_device_name" as GetDeviceNameFn),
                    open_device: sym!(c"ibv_open_device" as OpenDeviceFn),
                    query_port: sym!(c"ibv_query_port" as QueryPortFn),
                    alloc_pd: sym!(c"ibv_alloc_pd" as AllocPdFn),
                    dealloc_pd: sym!(c"ibv_dealloc_pd" as DeallocPdFn),
                    create_qp: sym!(c"ibv_create_qp" as CreateQpFn),
                    modify_qp: sym!(c"ibv_modify_qp" as ModifyQpFn),
                    destroy_qp: sym!(c"ibv_destroy_qp" as DestroyQpFn),
                    create_comp_channel: sym!(c"ibv_create_comp_channel" as CreateCompChannelFn),
                    destroy_comp_channel: sym!(c"ibv_destroy_comp_channel" as DestroyCompChannelFn),
                    create_cq: sym!(c"ibv_create_cq" as CreateCqFn),
                    destroy_cq: sym!(c"ibv_destroy_cq" as DestroyCqFn),
                    query_ece: sym!(c"ibv_query_ece" as EceFn),
                    set_ece: sym!(c"ibv_set_ece" as EceFn),
                    reg_mr: sym!(c"ibv_reg_mr" as RegMrFn),
                    dereg_mr: sym!(c"ibv_dereg_mr" as DeregMrFn),
                    get_cq_event: sym!(c"ibv_get_cq_event" as GetCqEventFn),
                    ack_cq_events: sym!(c"ibv_ack_cq_events" as AckCqEventsFn),
                })
            }
        })
        .as_ref()
}
