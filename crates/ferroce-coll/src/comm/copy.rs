//! Copies that stream past the caches.

/// Copies at least this long that nothing reads back soon are streamed past the caches.
pub(super) const STREAM_MIN: usize = 64 << 10;

/// Copies `len` bytes with non-temporal stores where the CPU has them: the destination lines
/// are written without first being read into the cache (which a plain copy does for each line
/// it writes), so a large final copy costs one pass over memory instead of two. For data the
/// caller will not read again soon (the last step of a collective into the caller's buffer).
///
/// # Safety
/// As for `copy_nonoverlapping`.
pub(super) unsafe fn copy_streaming(src: *const u8, dst: *mut u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE2 is part of x86_64; the caller vouches for both ranges; every 16-byte
    // stream store goes to a 16-aligned address inside `dst..dst + len`; the fence orders the
    // streamed stores before anything this thread stores next (a header, a credit).
    unsafe {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let head = dst.align_offset(16).min(len);
        std::ptr::copy_nonoverlapping(src, dst, head);
        let mut at = head;
        while at + 64 <= len {
            let s = src.add(at).cast::<__m128i>();
            let d = dst.add(at).cast::<__m128i>();
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            at += 64;
        }
        std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), len - at);
        _mm_sfence();
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, len)
    }
}
