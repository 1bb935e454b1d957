//! Element types, reduction operators and the kernels that fold one buffer into another.

use std::fmt;
use std::str::FromStr;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// An element type a collective reduces (nccl-tests' names in [`DataType::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DataType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 double precision.
    F64,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16 (the top half of an f32).
    Bf16,
    /// 32-bit signed integer (sums wrap).
    I32,
    /// 64-bit signed integer (sums wrap).
    I64,
    /// 8-bit unsigned integer (sums wrap).
    U8,
}

impl DataType {
    /// Every type, in nccl-tests' order.
    pub const ALL: [DataType; 7] = [
        DataType::I32,
        DataType::I64,
        DataType::U8,
        DataType::F16,
        DataType::F32,
        DataType::F64,
        DataType::Bf16,
    ];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DataType::F32 | DataType::I32 => 4,
            DataType::F64 | DataType::I64 => 8,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::U8 => 1,
        }
    }

    /// The name nccl-tests prints (and its `-d` option takes).
    pub const fn name(self) -> &'static str {
        match self {
            DataType::F32 => "float",
            DataType::F64 => "double",
            DataType::F16 => "half",
            DataType::Bf16 => "bfloat16",
            DataType::I32 => "int32",
            DataType::I64 => "int64",
            DataType::U8 => "uint8",
        }
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DataType {
    type Err = ReduceError;
    fn from_str(s: &str) -> Result<DataType, ReduceError> {
        DataType::ALL
            .into_iter()
            .find(|t| t.name() == s)
            .ok_or_else(|| ReduceError::UnknownType(s.to_string()))
    }
}

/// How two elements combine (nccl-tests' names in [`ReduceOp::name`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// a + b (integers wrap).
    Sum,
    /// a × b (integers wrap).
    Prod,
    /// The smaller (floats: a NaN loses to a number, as `f32::min`).
    Min,
    /// The larger (floats: a NaN loses to a number, as `f32::max`).
    Max,
    /// The sum while reducing; [`finish_avg`] divides by the number of ranks at the end.
    Avg,
}

impl ReduceOp {
    /// Every operator, in nccl-tests' order.
    pub const ALL: [ReduceOp; 5] = [
        ReduceOp::Sum,
        ReduceOp::Prod,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Avg,
    ];

    /// The name nccl-tests prints (and its `-o` option takes).
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceOp {
    type Err = ReduceError;
    fn from_str(s: &str) -> Result<ReduceOp, ReduceError> {
        ReduceOp::ALL
            .into_iter()
            .find(|o| o.name() == s)
            .ok_or_else(|| ReduceError::UnknownOp(s.to_string()))
    }
}

/// Why a reduction was refused (nothing was written).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReduceError {
    /// The two buffers differ in length.
    #[error("buffers of {dst} and {src} bytes cannot be reduced into each other")]
    LengthMismatch {
        /// Bytes of the destination.
        dst: usize,
        /// Bytes of the source.
        src: usize,
    },
    /// The length is not a whole number of elements.
    #[error("{len} bytes are not a whole number of {dtype} elements")]
    PartialElement {
        /// Bytes given.
        len: usize,
        /// The element type.
        dtype: DataType,
    },
    /// `finish_avg` over zero ranks.
    #[error("an average over zero ranks")]
    NoRanks,
    /// A type name nccl-tests does not use.
    #[error("unknown data type {0:?} (int32, int64, uint8, half, float, double, bfloat16)")]
    UnknownType(String),
    /// An operator name nccl-tests does not use.
    #[error("unknown reduction {0:?} (sum, prod, max, min, avg)")]
    UnknownOp(String),
}

fn check(dst: &[u8], src_len: usize, dtype: DataType) -> Result<(), ReduceError> {
    if dst.len() != src_len {
        return Err(ReduceError::LengthMismatch {
            dst: dst.len(),
            src: src_len,
        });
    }
    if dst.len() % dtype.size() != 0 {
        return Err(ReduceError::PartialElement {
            len: dst.len(),
            dtype,
        });
    }
    Ok(())
}

/// `dst[i] = f(dst[i], src[i])` for every element of type `T`, with unaligned loads and stores:
/// the loop the compiler vectorises.
#[inline(always)]
fn zip_apply<T: Copy>(dst: &mut [u8], src: &[u8], f: impl Fn(T, T) -> T) {
    let n = dst.len() / std::mem::size_of::<T>();
    let d = dst.as_mut_ptr().cast::<T>();
    let s = src.as_ptr().cast::<T>();
    for i in 0..n {
        // SAFETY: `i < n` elements of `T` lie in each buffer (both hold `n * size_of::<T>()`
        // bytes, checked by the caller); unaligned reads and writes of plain-data types; `dst`
        // and `src` are distinct borrows, so they do not overlap.
        unsafe {
            let v = f(d.add(i).read_unaligned(), s.add(i).read_unaligned());
            d.add(i).write_unaligned(v);
        }
    }
}

/// `dst[i] = f(dst[i])` for every element of type `T`.
#[inline(always)]
fn map_apply<T: Copy>(dst: &mut [u8], f: impl Fn(T) -> T) {
    let n = dst.len() / std::mem::size_of::<T>();
    let d = dst.as_mut_ptr().cast::<T>();
    for i in 0..n {
        // SAFETY: `i < n` elements of `T` lie in `dst`; unaligned access of plain data.
        unsafe { d.add(i).write_unaligned(f(d.add(i).read_unaligned())) };
    }
}

/// Elements of a half type a block holds: its f32 copies stay in the L1 cache.
const HALF_BLOCK: usize = 512;

/// A 16-bit float type whose conversions are cheaper a block at a time (f16, through the CPU's
/// conversion instructions where it has them).
trait HalfBits {
    fn widen(bits: &[u16], out: &mut [f32]);
    fn narrow(vals: &[f32], out: &mut [u16]);
}

struct F16Bits;
impl HalfBits for F16Bits {
    fn widen(bits: &[u16], out: &mut [f32]) {
        let mut h = [f16::ZERO; HALF_BLOCK];
        for (d, &b) in h.iter_mut().zip(bits) {
            *d = f16::from_bits(b);
        }
        h[..bits.len()].convert_to_f32_slice(out);
    }
    fn narrow(vals: &[f32], out: &mut [u16]) {
        let mut h = [f16::ZERO; HALF_BLOCK];
        h[..vals.len()].convert_from_f32_slice(vals);
        for (d, v) in out.iter_mut().zip(&h) {
            *d = v.to_bits();
        }
    }
}

/// A bf16's value as f32.
#[inline(always)]
fn bf16_widen(b: u16) -> f32 {
    f32::from_bits(u32::from(b) << 16)
}

/// An f32 rounded to bf16 (to nearest, ties to even; a NaN stays a quiet NaN).
#[inline(always)]
fn bf16_round(v: f32) -> u16 {
    let x = v.to_bits();
    if v.is_nan() {
        ((x >> 16) | 0x0040) as u16
    } else {
        ((x + 0x7fff + ((x >> 16) & 1)) >> 16) as u16
    }
}

/// `zip_apply` for a 16-bit float type `H`: each block of both buffers is widened to f32,
/// combined by `f` there, and narrowed back (one rounding per element, NCCL's way).
#[inline(always)]
fn half_apply<H: HalfBits>(dst: &mut [u8], src: &[u8], f: impl Fn(f32, f32) -> f32) {
    let (mut db, mut sb) = ([0u16; HALF_BLOCK], [0u16; HALF_BLOCK]);
    let (mut df, mut sf) = ([0f32; HALF_BLOCK], [0f32; HALF_BLOCK]);
    for (d, s) in dst
        .chunks_mut(2 * HALF_BLOCK)
        .zip(src.chunks(2 * HALF_BLOCK))
    {
        let n = d.len() / 2;
        let (dp, sp) = (d.as_mut_ptr().cast::<u16>(), s.as_ptr().cast::<u16>());
        for i in 0..n {
            // SAFETY: `i < n` 16-bit elements lie in each chunk; unaligned reads of plain data.
            unsafe {
                db[i] = dp.add(i).read_unaligned();
                sb[i] = sp.add(i).read_unaligned();
            }
        }
        H::widen(&db[..n], &mut df[..n]);
        H::widen(&sb[..n], &mut sf[..n]);
        for (a, &b) in df[..n].iter_mut().zip(&sf[..n]) {
            *a = f(*a, b);
        }
        H::narrow(&df[..n], &mut db[..n]);
        for (i, &v) in db[..n].iter().enumerate() {
            // SAFETY: as above, a write.
            unsafe { dp.add(i).write_unaligned(v) };
        }
    }
}

/// The reduction of one type for every operator, as `zip_apply` calls (`$sum`, `$prod` are
/// the type's own arithmetic: wrapping for integers).
macro_rules! reduce_typed {
    ($t:ty, $dst:expr, $src:expr, $op:expr, $sum:expr, $prod:expr, $min:expr, $max:expr) => {
        match $op {
            ReduceOp::Sum | ReduceOp::Avg => zip_apply::<$t>($dst, $src, $sum),
            ReduceOp::Prod => zip_apply::<$t>($dst, $src, $prod),
            ReduceOp::Min => zip_apply::<$t>($dst, $src, $min),
            ReduceOp::Max => zip_apply::<$t>($dst, $src, $max),
        }
    };
}

/// Folds `src` into `dst` element by element: `dst[i] = dst[i] op src[i]`, both buffers holding
/// elements of `dtype` in native byte order at any alignment. For [`ReduceOp::Avg`] this is the
/// sum; [`finish_avg`] divides once every rank's part is in.
pub fn reduce_into(
    dst: &mut [u8],
    src: &[u8],
    dtype: DataType,
    op: ReduceOp,
) -> Result<(), ReduceError> {
    check(dst, src.len(), dtype)?;
    match dtype {
        DataType::F32 => {
            reduce_typed!(
                f32,
                dst,
                src,
                op,
                |a, b| a + b,
                |a, b| a * b,
                f32::min,
                f32::max
            )
        }
        DataType::F64 => {
            reduce_typed!(
                f64,
                dst,
                src,
                op,
                |a, b| a + b,
                |a, b| a * b,
                f64::min,
                f64::max
            )
        }
        DataType::I32 => reduce_typed!(
            i32,
            dst,
            src,
            op,
            i32::wrapping_add,
            i32::wrapping_mul,
            Ord::min,
            Ord::max
        ),
        DataType::I64 => reduce_typed!(
            i64,
            dst,
            src,
            op,
            i64::wrapping_add,
            i64::wrapping_mul,
            Ord::min,
            Ord::max
        ),
        DataType::U8 => reduce_typed!(
            u8,
            dst,
            src,
            op,
            u8::wrapping_add,
            u8::wrapping_mul,
            Ord::min,
            Ord::max
        ),
        // Half types in f32, rounded back once per element (NCCL's way).
        DataType::F16 => match op {
            ReduceOp::Sum | ReduceOp::Avg => half_apply::<F16Bits>(dst, src, |a, b| a + b),
            ReduceOp::Prod => half_apply::<F16Bits>(dst, src, |a, b| a * b),
            ReduceOp::Min => half_apply::<F16Bits>(dst, src, f32::min),
            ReduceOp::Max => half_apply::<F16Bits>(dst, src, f32::max),
        },
        // bf16 is the top half of an f32: widening and rounding back are a few integer
        // instructions, which vectorise with the arithmetic in one loop.
        DataType::Bf16 => {
            let via = |f: fn(f32, f32) -> f32| {
                move |a: u16, b: u16| bf16_round(f(bf16_widen(a), bf16_widen(b)))
            };
            reduce_typed!(
                u16,
                dst,
                src,
                op,
                via(|a, b| a + b),
                via(|a, b| a * b),
                via(f32::min),
                via(f32::max)
            )
        }
    }
    Ok(())
}

/// Ends an average: divides every element of `buf` (a sum over `ranks` ranks) by `ranks`.
/// Integers divide with truncation, as NCCL's average does.
pub fn finish_avg(buf: &mut [u8], dtype: DataType, ranks: usize) -> Result<(), ReduceError> {
    check(buf, buf.len(), dtype)?;
    if ranks == 0 {
        return Err(ReduceError::NoRanks);
    }
    let n = ranks;
    match dtype {
        DataType::F32 => map_apply::<f32>(buf, |a| a / n as f32),
        DataType::F64 => map_apply::<f64>(buf, |a| a / n as f64),
        DataType::I32 => map_apply::<i32>(buf, |a| a.wrapping_div(n.min(i32::MAX as usize) as i32)),
        DataType::I64 => map_apply::<i64>(buf, |a| a.wrapping_div(n.min(i64::MAX as usize) as i64)),
        DataType::U8 => map_apply::<u8>(buf, |a| (usize::from(a) / n) as u8),
        DataType::F16 => map_apply::<u16>(buf, |a| {
            f16::from_f32(f16::from_bits(a).to_f32() / n as f32).to_bits()
        }),
        DataType::Bf16 => map_apply::<u16>(buf, |a| {
            bf16::from_f32(bf16::from_bits(a).to_f32() / n as f32).to_bits()
        }),
    }
    Ok(())
}
