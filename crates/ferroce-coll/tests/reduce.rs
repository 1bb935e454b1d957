//! The reduction kernels against a plain per-element reference: every type × every operator,
//! lengths from 0 to a few thousand elements, buffers at odd addresses, random bit patterns
//! (NaNs and infinities included), and the refusals.

use ferroce_coll::{finish_avg, reduce_into, DataType, ReduceError, ReduceOp};
use half::{bf16, f16};
use proptest::prelude::*;

/// One element as the reference computes with it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Val {
    Int(i128),
    Float(f64),
}

fn read(t: DataType, b: &[u8]) -> Val {
    match t {
        DataType::I32 => Val::Int(i32::from_ne_bytes(b.try_into().unwrap()).into()),
        DataType::I64 => Val::Int(i64::from_ne_bytes(b.try_into().unwrap()).into()),
        DataType::U8 => Val::Int(b[0].into()),
        DataType::F32 => Val::Float(f32::from_ne_bytes(b.try_into().unwrap()).into()),
        DataType::F64 => Val::Float(f64::from_ne_bytes(b.try_into().unwrap())),
        DataType::F16 => Val::Float(f16::from_ne_bytes(b.try_into().unwrap()).to_f64()),
        DataType::Bf16 => Val::Float(bf16::from_ne_bytes(b.try_into().unwrap()).to_f64()),
    }
}

/// Stores `v` as type `t`: integers keep their low bits (wrapping), floats round to the type
/// (from a value `combine` computed in f32 for f32 and the half types, in f64 for f64).
fn write(t: DataType, v: Val, out: &mut [u8]) {
    match (t, v) {
        (DataType::I32, Val::Int(i)) => out.copy_from_slice(&(i as i32).to_ne_bytes()),
        (DataType::I64, Val::Int(i)) => out.copy_from_slice(&(i as i64).to_ne_bytes()),
        (DataType::U8, Val::Int(i)) => out[0] = i as u8,
        (DataType::F32, Val::Float(f)) => out.copy_from_slice(&(f as f32).to_ne_bytes()),
        (DataType::F64, Val::Float(f)) => out.copy_from_slice(&f.to_ne_bytes()),
        (DataType::F16, Val::Float(f)) => {
            out.copy_from_slice(&f16::from_f32(f as f32).to_ne_bytes())
        }
        (DataType::Bf16, Val::Float(f)) => {
            out.copy_from_slice(&bf16::from_f32(f as f32).to_ne_bytes())
        }
        _ => unreachable!(),
    }
}

fn combine(t: DataType, op: ReduceOp, a: Val, b: Val) -> Val {
    match (a, b) {
        (Val::Int(x), Val::Int(y)) => Val::Int(match op {
            ReduceOp::Sum | ReduceOp::Avg => x + y,
            ReduceOp::Prod => x * y,
            ReduceOp::Min => x.min(y),
            ReduceOp::Max => x.max(y),
        }),
        (Val::Float(x), Val::Float(y)) => {
            let v = match op {
                ReduceOp::Sum | ReduceOp::Avg => x + y,
                ReduceOp::Prod => x * y,
                ReduceOp::Min => x.min(y),
                ReduceOp::Max => x.max(y),
            };
            // f64 in f64; f32 and the half types in f32, rounded back once per element (the
            // documented semantics: an exact sum rounded once can differ from that in a tie).
            if t != DataType::F64 {
                let (x, y) = (x as f32, y as f32);
                Val::Float(f64::from(match op {
                    ReduceOp::Sum | ReduceOp::Avg => x + y,
                    ReduceOp::Prod => x * y,
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Max => x.max(y),
                }))
            } else {
                Val::Float(v)
            }
        }
        _ => unreachable!(),
    }
}

fn same(t: DataType, a: &[u8], b: &[u8]) -> bool {
    a.chunks(t.size()).zip(b.chunks(t.size())).all(|(x, y)| {
        match (read(t, x), read(t, y)) {
            // NaN payloads may differ between vector and scalar code; NaN is NaN.
            (Val::Float(p), Val::Float(q)) if p.is_nan() && q.is_nan() => true,
            (p, q) => p == q,
        }
    })
}

fn reference(t: DataType, op: ReduceOp, dst: &[u8], src: &[u8]) -> Vec<u8> {
    let mut out = vec![0u8; dst.len()];
    for ((d, s), o) in dst
        .chunks(t.size())
        .zip(src.chunks(t.size()))
        .zip(out.chunks_mut(t.size()))
    {
        write(t, combine(t, op, read(t, d), read(t, s)), o);
    }
    out
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 29) as u8
        })
        .collect()
}

#[test]
fn every_type_and_operator_matches_the_reference_at_any_alignment() {
    for t in DataType::ALL {
        for op in ReduceOp::ALL {
            for (i, n) in [0usize, 1, 7, 64, 1023, 4099].into_iter().enumerate() {
                let len = n * t.size();
                for offset in [0usize, 1, 3] {
                    let mut d = bytes(i as u64 * 31 + 1, len + offset);
                    let s = bytes(i as u64 * 31 + 2, len + offset);
                    let want = reference(t, op, &d[offset..], &s[offset..]);
                    reduce_into(&mut d[offset..], &s[offset..], t, op).unwrap();
                    assert!(
                        same(t, &d[offset..], &want),
                        "{t} {op} {n} elements at offset {offset}"
                    );
                }
            }
        }
    }
}

#[test]
fn averages_divide_the_sum_by_the_ranks() {
    let ranks = 3usize;
    for t in DataType::ALL {
        let n = 513;
        let parts: Vec<Vec<u8>> = (0..ranks)
            .map(|r| {
                let mut v = vec![0u8; n * t.size()];
                for (i, e) in v.chunks_mut(t.size()).enumerate() {
                    // Small values every type holds exactly.
                    let x = ((i * 7 + r * 13) % 50) as i128;
                    let val = match t {
                        DataType::I32 | DataType::I64 | DataType::U8 => Val::Int(x),
                        _ => Val::Float(x as f64),
                    };
                    write(t, val, e);
                }
                v
            })
            .collect();
        let mut acc = parts[0].clone();
        for p in &parts[1..] {
            reduce_into(&mut acc, p, t, ReduceOp::Avg).unwrap();
        }
        finish_avg(&mut acc, t, ranks).unwrap();
        for (i, e) in acc.chunks(t.size()).enumerate() {
            let sum: i128 = (0..ranks).map(|r| ((i * 7 + r * 13) % 50) as i128).sum();
            let got = read(t, e);
            let ok = match got {
                Val::Int(v) => v == sum / ranks as i128,
                Val::Float(v) => (v - sum as f64 / ranks as f64).abs() <= 0.5,
            };
            assert!(ok, "{t} element {i}: {got:?}, sum {sum}");
        }
    }
}

#[test]
fn mismatched_or_partial_buffers_are_refused_untouched() {
    let mut d = vec![1u8; 8];
    let before = d.clone();
    assert_eq!(
        reduce_into(&mut d, &[0u8; 4], DataType::F32, ReduceOp::Sum),
        Err(ReduceError::LengthMismatch { dst: 8, src: 4 })
    );
    assert_eq!(
        reduce_into(&mut d[..6], &[0u8; 6], DataType::F32, ReduceOp::Sum),
        Err(ReduceError::PartialElement {
            len: 6,
            dtype: DataType::F32
        })
    );
    assert_eq!(
        finish_avg(&mut d, DataType::I32, 0),
        Err(ReduceError::NoRanks)
    );
    assert_eq!(d, before);
    assert!("float16".parse::<DataType>().is_err());
    assert!("mean".parse::<ReduceOp>().is_err());
    for t in DataType::ALL {
        assert_eq!(t.name().parse::<DataType>(), Ok(t));
    }
    for o in ReduceOp::ALL {
        assert_eq!(o.name().parse::<ReduceOp>(), Ok(o));
    }
}

proptest! {
    /// Random bit patterns (NaNs, infinities, extremes) of every type and operator.
    #[test]
    fn random_bits_match_the_reference(
        t in prop::sample::select(DataType::ALL.to_vec()),
        op in prop::sample::select(ReduceOp::ALL.to_vec()),
        raw in prop::collection::vec(any::<u8>(), 0..2048),
    ) {
        let n = raw.len() / (2 * t.size());
        let (d0, s) = raw.split_at(n * t.size());
        let s = &s[..n * t.size()];
        let mut d = d0.to_vec();
        let want = reference(t, op, &d, s);
        reduce_into(&mut d, s, t, op).unwrap();
        prop_assert!(same(t, &d, &want));
    }
}
