//! Python buffers held for the length of a collective: the only way bytes of a Python object
//! reach ferroce-coll.
//!
//! The collectives take the Python objects themselves (a numpy array, a `bytearray`, a
//! `memoryview`, the numpy view torch's `Tensor.numpy()` gives) and ask each for its bytes
//! through the buffer protocol here, in Rust. No address ever crosses from Python: a caller
//! cannot name memory it does not own, and an object cannot be freed, resized or moved while
//! its bytes are in use, because the export ([`PyBuffer_Release`] not yet called) pins them
//! (`bytearray` and numpy refuse to resize an exported buffer; the object itself is referenced
//! by the view). An earlier design passed `(address, length)` pairs from Python: a temporary
//! whose address was taken could be freed before the call read it (`t.contiguous()` of a
//! strided torch tensor), and any Python code could have the extension read or write anywhere.
//!
//! Why our own declarations: the extension is an abi3 wheel for Python >= 3.9, and the buffer
//! protocol (`PyObject_GetBuffer`, `PyBuffer_Release`, `Py_buffer`) joined the limited API
//! only in 3.11, so PyO3 leaves it out of an `abi3-py39` build. Both functions are exported
//! by every CPython 3 (the extension resolves them from the interpreter that loads it, as it
//! does every other C-API symbol), and `Py_buffer`'s layout is the same from 3.3 to today:
//! 3.11 froze that very layout into the stable ABI. The wheel is CPython-only (abi3), Linux
//! only.
//!
//! What is checked, since an exporter may be buggy (or a class written to lie): a C-contiguous
//! buffer is requested (`PyBUF_C_CONTIGUOUS`, plus `PyBUF_WRITABLE` for outputs) and the
//! answer is verified anyway: no sub-offsets, shape and strides that describe exactly `len`
//! bytes in C order, writable when asked, a non-null address for a non-empty buffer, and an
//! address range that does not wrap. An input and an output whose bytes overlap are refused
//! ([`in_out`]): ferroce-coll reads one while writing the other, and Rust may not hold a
//! shared and a mutable view of the same bytes.
//!
//! What is not and cannot be checked here: another Python thread writing the same object
//! while a collective runs without the GIL races with it on those bytes (as with any
//! extension that releases the GIL on a buffer, numpy's included), and a torch tensor
//! resized (`resize_`, `set_`) by another thread under its numpy view frees memory the view
//! still names, which torch documents as the caller's to avoid.

use std::os::raw::{c_char, c_int, c_void};

use pyo3::exceptions::{PyBufferError, PyValueError};
use pyo3::ffi::{PyObject, Py_ssize_t};
use pyo3::prelude::*;

/// CPython's `Py_buffer` (Include/pybuffer.h), unchanged since 3.3.
#[repr(C)]
struct PyBufferView {
    buf: *mut c_void,
    obj: *mut PyObject,
    len: Py_ssize_t,
    itemsize: Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut Py_ssize_t,
    strides: *mut Py_ssize_t,
    suboffsets: *mut Py_ssize_t,
    internal: *mut c_void,
}

const PYBUF_WRITABLE: c_int = 0x0001;
/// `PyBUF_C_CONTIGUOUS`: `0x0020 | PyBUF_STRIDES` (`0x0010 | PyBUF_ND`, `0x0008`).
const PYBUF_C_CONTIGUOUS: c_int = 0x0038;
/// `PyBUF_MAX_NDIM`: no exporter may describe more dimensions.
const MAX_NDIM: c_int = 64;

extern "C" {
    fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut PyBufferView, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut PyBufferView);
}

/// One object's bytes, exported for as long as this lives. Holds `Python<'py>`: it is neither
/// `Send` nor `Sync`, so it stays with the GIL-holding frame that made it (only the byte slices
/// it lends go into `allow_threads`), and its release runs with the GIL held.
struct Exported<'py> {
    /// Boxed: an exporter may point fields of the view into the view itself (CPython's
    /// `PyBuffer_FillInfo` sets `shape = &view->len`), so it must not move once filled.
    view: Box<PyBufferView>,
    _py: Python<'py>,
}

impl<'py> Exported<'py> {
    fn get(obj: &Bound<'py, PyAny>, writable: bool, role: &str) -> PyResult<Exported<'py>> {
        let py = obj.py();
        let mut view = Box::new(PyBufferView {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        let flags = PYBUF_C_CONTIGUOUS | if writable { PYBUF_WRITABLE } else { 0 };
        // SAFETY: `obj` is a live object (borrowed for 'py, GIL held through `py`); `view` is
        // a writable `Py_buffer` of the interpreter's layout (see the module doc), boxed so its
        // address is stable until `PyBuffer_Release` in `drop`.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc != 0 {
            let cause = PyErr::fetch(py);
            let err = PyBufferError::new_err(format!(
                "the {role} must be a C-contiguous{} buffer ({} given): {cause}",
                if writable { ", writable" } else { "" },
                obj.get_type()
                    .name()
                    .map_or_else(|_| "?".to_string(), |n| n.to_string()),
            ));
            err.set_cause(py, Some(cause));
            return Err(err);
        }
        // From here `drop` releases the export, whatever `check` says.
        let held = Exported { view, _py: py };
        held.check(writable)
            .map_err(|why| PyBufferError::new_err(format!("the {role}'s exporter {why}")))?;
        Ok(held)
    }

    /// Verifies the exporter's answer (see the module doc): `Err` says what is wrong.
    fn check(&self, writable: bool) -> Result<(), String> {
        let v = &*self.view;
        let len = usize::try_from(v.len).map_err(|_| format!("gave a length of {}", v.len))?;
        if writable && v.readonly != 0 {
            return Err("gave a read-only buffer for a writable request".into());
        }
        if !v.suboffsets.is_null() {
            return Err("gave an indirect (sub-offset) buffer".into());
        }
        if len > 0 && v.buf.is_null() {
            return Err("gave a null address".into());
        }
        (v.buf as usize)
            .checked_add(len)
            .ok_or("gave an address range that wraps")?;
        if !(0..=MAX_NDIM).contains(&v.ndim) {
            return Err(format!("gave {} dimensions", v.ndim));
        }
        if v.ndim == 0 || v.shape.is_null() {
            // One item, or bytes described by `len` alone: nothing more to agree with.
            return Ok(());
        }
        let ndim = v.ndim as usize;
        // SAFETY: the exporter filled `shape` (non-null) with `ndim` extents, valid while the
        // export lasts; `ndim` is at most PyBUF_MAX_NDIM.
        let shape = unsafe { std::slice::from_raw_parts(v.shape, ndim) };
        let strides = if v.strides.is_null() {
            None
        } else {
            // SAFETY: as for `shape`.
            Some(unsafe { std::slice::from_raw_parts(v.strides, ndim) })
        };
        let itemsize = usize::try_from(v.itemsize)
            .ok()
            .filter(|&s| s > 0)
            .ok_or_else(|| format!("gave an item size of {}", v.itemsize))?;
        // The extents times the item size must be exactly `len`, and the strides (where given)
        // those of C order: each the product of the item size and the later extents.
        let mut expect = itemsize;
        for d in (0..ndim).rev() {
            let n = usize::try_from(shape[d]).map_err(|_| format!("gave extent {}", shape[d]))?;
            if let Some(s) = strides {
                if n > 1 && usize::try_from(s[d]).ok() != Some(expect) {
                    return Err("gave a buffer that is not C-contiguous".into());
                }
            }
            expect = expect
                .checked_mul(n)
                .ok_or("gave extents whose product overflows")?;
        }
        if expect != len {
            return Err(format!(
                "described {expect} bytes but gave a length of {len}"
            ));
        }
        Ok(())
    }

    /// The address range `[start, end)` of the bytes (empty for an empty buffer).
    fn range(&self) -> (usize, usize) {
        let start = self.view.buf as usize;
        // `check` verified that this does not wrap.
        (start, start + self.len())
    }

    fn len(&self) -> usize {
        self.view.len as usize
    }
}

impl Drop for Exported<'_> {
    fn drop(&mut self) {
        // SAFETY: `view` was filled by a successful `PyObject_GetBuffer` and is released once,
        // here; the GIL is held (`Exported` cannot leave the thread that holds `Python<'py>`,
        // and no code path drops it inside `allow_threads`).
        unsafe { PyBuffer_Release(&mut *self.view) };
    }
}

/// A buffer a collective reads.
pub(crate) struct Input<'py>(Exported<'py>);

/// A buffer a collective writes (it must be writable).
pub(crate) struct Output<'py>(Exported<'py>);

impl<'py> Input<'py> {
    /// Exports `obj`'s bytes for reading (read-only objects such as `bytes` are fine).
    pub(crate) fn of(obj: &Bound<'py, PyAny>) -> PyResult<Input<'py>> {
        Exported::get(obj, false, "input").map(Input)
    }

    /// The bytes, for as long as this export is borrowed.
    pub(crate) fn bytes(&self) -> &[u8] {
        let len = self.0.len();
        if len == 0 {
            return &[];
        }
        // SAFETY: `check` verified `len` bytes at the non-null `buf`, C-contiguous; the export
        // keeps them allocated and in place while `self` lives, which the borrow ties the
        // slice to. Nothing in this crate writes them: an output that overlaps them is refused
        // by `in_out` before a mutable slice exists.
        unsafe { std::slice::from_raw_parts(self.0.view.buf as *const u8, len) }
    }
}

impl<'py> Output<'py> {
    /// Exports `obj`'s bytes for writing.
    pub(crate) fn of(obj: &Bound<'py, PyAny>) -> PyResult<Output<'py>> {
        Exported::get(obj, true, "output").map(Output)
    }

    /// The bytes of a collective that has no other buffer (an in-place one).
    pub(crate) fn alone(&mut self) -> &mut [u8] {
        let len = self.0.len();
        if len == 0 {
            return &mut [];
        }
        // SAFETY: as in `Input::bytes`, for a writable export (`check` refused a read-only
        // one); the `&mut self` borrow makes this the only slice of this export in Rust.
        unsafe { std::slice::from_raw_parts_mut(self.0.view.buf as *mut u8, len) }
    }
}

/// An input's and an output's bytes together, refused if they overlap.
pub(crate) fn in_out<'a>(
    input: &'a Input<'_>,
    output: &'a mut Output<'_>,
) -> PyResult<(&'a [u8], &'a mut [u8])> {
    let (a, b) = (input.0.range(), output.0.range());
    if a.0 < a.1 && b.0 < b.1 && a.0 < b.1 && b.0 < a.1 {
        return Err(PyValueError::new_err(format!(
            "the input and output buffers overlap ({} bytes at {:#x} and {} bytes at {:#x}): \
             pass an output that shares no memory with the input",
            a.1 - a.0,
            a.0,
            b.1 - b.0,
            b.0
        )));
    }
    Ok((input.bytes(), output.alone()))
}
