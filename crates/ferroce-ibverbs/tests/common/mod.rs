//! What the drop-in's Rust tests share: opening the loopback device and mapping a buffer, as a
//! C program does it.

use ferroce_ibverbs::abi::*;

extern "C" {
    fn ibv_get_device_list(num: *mut libc::c_int) -> *mut *mut ibv_device;
    fn ibv_get_device_name(dev: *mut ibv_device) -> *const libc::c_char;
    fn ibv_open_device(dev: *mut ibv_device) -> *mut ibv_context;
}

/// Opens the loopback device (`ferroce_lo`) if there is one, else the first: the test talks
/// to itself. Panics, naming the OS error, if nothing opens.
pub fn open_loopback_context() -> *mut ibv_context {
    // SAFETY: the library's calls as a C program makes them: the count is an output on the
    // stack, every listed entry below the count is a live device, and names are C strings.
    unsafe {
        let mut n = 0;
        let list = ibv_get_device_list(&mut n);
        assert!(!list.is_null() && n > 0, "no ferroce device");
        let devs: Vec<*mut ibv_device> = (0..n as usize).map(|i| *list.add(i)).collect();
        let pick = devs
            .iter()
            .copied()
            .find(|&d| std::ffi::CStr::from_ptr(ibv_get_device_name(d)).to_bytes() == b"ferroce_lo")
            .unwrap_or(devs[0]);
        let ctx = ibv_open_device(pick);
        assert!(
            !ctx.is_null(),
            "ibv_open_device: {}",
            std::io::Error::last_os_error()
        );
        ctx
    }
}

/// `len` bytes of fresh anonymous memory, mapped for the life of the test process.
pub fn map_buffer(len: usize) -> *mut libc::c_void {
    // SAFETY: an anonymous private mapping asks nothing of existing memory.
    let buf = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(buf, libc::MAP_FAILED);
    buf
}
