//! What the relay does to packets, and the one-line text form users type:
//! `loss=0.05,reorder=0.05,duplicate=0.02,corrupt=0.01,delay_ms=1,seed=7`.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use ferroce_proto::sim::Rng;
use thiserror::Error;

/// The faults a relay injects, each decided per packet and per direction.
///
/// Rates are probabilities in `[0, 1]`. Decisions come from a seeded generator per direction, so
/// the same seed gives the same sequence of fates for the same sequence of packets (the packets
/// themselves depend on timing, so a run over real sockets is repeatable in distribution, not
/// packet for packet; the simulator in `ferroce_proto::sim` is the exactly repeatable tool).
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    /// Probability that a packet is dropped.
    pub loss: f64,
    /// Probability that a packet is held back so that later packets overtake it.
    pub reorder: f64,
    /// Probability that a packet is delivered twice.
    pub duplicate: f64,
    /// Probability that one random bit of a packet is flipped (the receiver's ICRC check must
    /// catch it).
    pub corrupt: f64,
    /// Fixed one-way delay added to every packet.
    pub delay: Duration,
    /// Extra random delay, uniform in `[0, jitter]`, added to every packet (reorders for free
    /// when it exceeds the gap between packets).
    pub jitter: Duration,
    /// A window of time, counted from the relay's start, during which every packet is dropped.
    pub blackhole: Option<Blackhole>,
    /// Seed of the per-direction generators.
    pub seed: u64,
}

/// A time window in which the relay drops everything, like a cut cable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blackhole {
    /// When it starts, from the relay's start.
    pub after: Duration,
    /// How long it lasts.
    pub length: Duration,
}

impl Default for Faults {
    fn default() -> Faults {
        Faults {
            loss: 0.0,
            reorder: 0.0,
            duplicate: 0.0,
            corrupt: 0.0,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            blackhole: None,
            seed: 1,
        }
    }
}

/// A fault specification that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum FaultsError {
    /// A `key=value` pair without the `=`.
    #[error("chaos option '{0}' is not key=value")]
    NotKeyValue(String),
    /// A key the relay does not know.
    #[error("unknown chaos option '{0}' (known: loss, reorder, duplicate, corrupt, delay_ms, jitter_ms, blackhole=AFTER_MS+LENGTH_MS, seed)")]
    UnknownKey(String),
    /// A key given twice.
    #[error("chaos option '{0}' is given twice")]
    Repeated(String),
    /// A value out of range or not a number.
    #[error("chaos option {key}={value}: {problem}")]
    BadValue {
        /// The key.
        key: String,
        /// The value as given.
        value: String,
        /// What is wrong with it.
        problem: &'static str,
    },
}

/// Longest delay, jitter or blackhole a specification may ask for: a relay holding packets for
/// longer is a misconfiguration (every RC QP would have given up), not a test.
const MAX_TIME_MS: f64 = 3_600_000.0;

fn rate(key: &str, value: &str) -> Result<f64, FaultsError> {
    let bad = |problem| FaultsError::BadValue {
        key: key.into(),
        value: value.into(),
        problem,
    };
    let v: f64 = value.parse().map_err(|_| bad("not a number"))?;
    if !(0.0..=1.0).contains(&v) {
        return Err(bad("a rate is between 0 and 1"));
    }
    Ok(v)
}

fn millis(key: &str, value: &str) -> Result<Duration, FaultsError> {
    let bad = |problem| FaultsError::BadValue {
        key: key.into(),
        value: value.into(),
        problem,
    };
    let v: f64 = value
        .parse()
        .map_err(|_| bad("not a number of milliseconds"))?;
    if !(0.0..=MAX_TIME_MS).contains(&v) {
        return Err(bad("milliseconds between 0 and 3600000"));
    }
    Ok(Duration::from_secs_f64(v / 1000.0))
}

impl FromStr for Faults {
    type Err = FaultsError;

    fn from_str(spec: &str) -> Result<Faults, FaultsError> {
        let mut f = Faults::default();
        let mut seen: Vec<&str> = Vec::new();
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| FaultsError::NotKeyValue(item.into()))?;
            let (key, value) = (key.trim(), value.trim());
            if seen.contains(&key) {
                return Err(FaultsError::Repeated(key.into()));
            }
            match key {
                "loss" => f.loss = rate(key, value)?,
                "reorder" => f.reorder = rate(key, value)?,
                "duplicate" => f.duplicate = rate(key, value)?,
                "corrupt" => f.corrupt = rate(key, value)?,
                "delay_ms" => f.delay = millis(key, value)?,
                "jitter_ms" => f.jitter = millis(key, value)?,
                "seed" => {
                    f.seed = value.parse().map_err(|_| FaultsError::BadValue {
                        key: key.into(),
                        value: value.into(),
                        problem: "not an unsigned 64-bit number",
                    })?
                }
                "blackhole" => {
                    let (after, length) =
                        value.split_once('+').ok_or_else(|| FaultsError::BadValue {
                            key: key.into(),
                            value: value.into(),
                            problem: "write AFTER_MS+LENGTH_MS",
                        })?;
                    f.blackhole = Some(Blackhole {
                        after: millis(key, after)?,
                        length: millis(key, length)?,
                    });
                }
                _ => return Err(FaultsError::UnknownKey(key.into())),
            }
            seen.push(key);
        }
        Ok(f)
    }
}

impl fmt::Display for Faults {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "loss={},reorder={},duplicate={},corrupt={},delay_ms={},jitter_ms={}",
            self.loss,
            self.reorder,
            self.duplicate,
            self.corrupt,
            self.delay.as_secs_f64() * 1000.0,
            self.jitter.as_secs_f64() * 1000.0
        )?;
        if let Some(b) = self.blackhole {
            write!(
                f,
                ",blackhole={}+{}",
                b.after.as_secs_f64() * 1000.0,
                b.length.as_secs_f64() * 1000.0
            )?;
        }
        write!(f, ",seed={}", self.seed)
    }
}

/// What happens to one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// Dropped by the loss rate.
    Lost,
    /// Dropped inside a blackhole.
    Blackholed,
    /// Delivered: `copies` times (1 or 2), after `hold`, with bit `flip` of the packet inverted.
    Delivered {
        /// 1, or 2 when duplicated.
        copies: u8,
        /// How long to hold it before sending.
        hold: Duration,
        /// Whether it was held back to be overtaken.
        reordered: bool,
        /// The bit to invert, counted from the first byte's least significant bit.
        flip: Option<usize>,
    },
}

/// How long a reordered packet is held beyond its normal delay: long enough for a stream's next
/// packets (a few microseconds apart on loopback) to overtake it, short against any ACK timeout.
const REORDER_HOLD_MIN: Duration = Duration::from_micros(300);

/// The per-direction decision maker.
#[derive(Debug, Clone)]
pub struct Dice {
    rng: Rng,
    faults: Faults,
}

impl Dice {
    /// Dice for one direction (`direction` 0 or 1 gives independent streams from one seed).
    pub fn new(faults: &Faults, direction: u64) -> Dice {
        Dice {
            rng: Rng::new(
                faults
                    .seed
                    .wrapping_mul(0x2545_f491_4f6c_dd1d)
                    .wrapping_add(direction),
            ),
            faults: faults.clone(),
        }
    }

    /// The fate of a packet of `len` bytes arriving `since_start` after the relay started;
    /// `forced_blackhole` is the relay's manual switch.
    pub fn roll(&mut self, len: usize, since_start: Duration, forced_blackhole: bool) -> Fate {
        let f = &self.faults;
        let in_window = f
            .blackhole
            .is_some_and(|b| since_start >= b.after && since_start < b.after + b.length);
        if forced_blackhole || in_window {
            return Fate::Blackholed;
        }
        if self.rng.chance(f.loss) {
            return Fate::Lost;
        }
        let copies = if self.rng.chance(f.duplicate) { 2 } else { 1 };
        let flip = (len > 0 && self.rng.chance(f.corrupt))
            .then(|| self.rng.below(len as u64 * 8) as usize);
        let mut hold = f.delay;
        if !f.jitter.is_zero() {
            hold += f.jitter.mul_f64(self.rng.unit());
        }
        let reordered = self.rng.chance(f.reorder);
        if reordered {
            let span = REORDER_HOLD_MIN.max((f.delay + f.jitter) * 2);
            hold += span.mul_f64(0.25 + 0.75 * self.rng.unit());
        }
        Fate::Delivered {
            copies,
            hold,
            reordered,
            flip,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_form() {
        let f: Faults = "loss=0.05,reorder=0.05,duplicate=0.02,corrupt=0.01,delay_ms=1,seed=9"
            .parse()
            .unwrap();
        assert_eq!(f.loss, 0.05);
        assert_eq!(f.reorder, 0.05);
        assert_eq!(f.duplicate, 0.02);
        assert_eq!(f.corrupt, 0.01);
        assert_eq!(f.delay, Duration::from_millis(1));
        assert_eq!(f.seed, 9);
        let g: Faults = f.to_string().parse().unwrap();
        assert_eq!(f, g, "Display reads back");
        let b: Faults = "blackhole=1500+250.5".parse().unwrap();
        assert_eq!(
            b.blackhole,
            Some(Blackhole {
                after: Duration::from_millis(1500),
                length: Duration::from_micros(250_500)
            })
        );
        assert_eq!("".parse::<Faults>().unwrap(), Faults::default());
    }

    #[test]
    fn rejects_bad_specifications_with_a_reason() {
        let cases = [
            ("loss", "not key=value"),
            ("loss=1.5", "between 0 and 1"),
            ("loss=-0.1", "between 0 and 1"),
            ("loss=abc", "not a number"),
            ("loss=nan", "between 0 and 1"),
            ("drop=0.1", "unknown chaos option 'drop'"),
            ("loss=0.1,loss=0.2", "given twice"),
            ("delay_ms=-1", "milliseconds"),
            ("delay_ms=1e9", "milliseconds"),
            ("blackhole=100", "AFTER_MS+LENGTH_MS"),
            ("seed=-3", "unsigned"),
        ];
        for (spec, want) in cases {
            let e = spec.parse::<Faults>().unwrap_err().to_string();
            assert!(e.contains(want), "{spec}: {e}");
        }
    }

    #[test]
    fn rates_are_honoured_and_seeded() {
        let f: Faults = "loss=0.2,duplicate=0.1,corrupt=0.05,reorder=0.1,seed=3"
            .parse()
            .unwrap();
        let roll_all = |dir| {
            let mut d = Dice::new(&f, dir);
            (0..100_000)
                .map(|_| d.roll(1000, Duration::ZERO, false))
                .collect::<Vec<_>>()
        };
        let a = roll_all(0);
        assert_eq!(a, roll_all(0), "same seed, same fates");
        assert_ne!(a, roll_all(1), "directions are independent");
        let n = a.len() as f64;
        let lost = a.iter().filter(|x| **x == Fate::Lost).count() as f64 / n;
        let delivered: Vec<_> = a
            .iter()
            .filter_map(|x| match x {
                Fate::Delivered {
                    copies,
                    reordered,
                    flip,
                    hold,
                } => Some((*copies, *reordered, *flip, *hold)),
                _ => None,
            })
            .collect();
        let m = delivered.len() as f64;
        let dup = delivered.iter().filter(|d| d.0 == 2).count() as f64 / m;
        let reo = delivered.iter().filter(|d| d.1).count() as f64 / m;
        let cor = delivered.iter().filter(|d| d.2.is_some()).count() as f64 / m;
        assert!((lost - 0.2).abs() < 0.01, "loss {lost}");
        assert!((dup - 0.1).abs() < 0.01, "duplicate {dup}");
        assert!((reo - 0.1).abs() < 0.01, "reorder {reo}");
        assert!((cor - 0.05).abs() < 0.01, "corrupt {cor}");
        assert!(delivered.iter().all(|d| d.2.unwrap_or(0) < 8000));
        assert!(delivered
            .iter()
            .all(|d| d.1 == (d.3 >= REORDER_HOLD_MIN / 4)));
    }

    #[test]
    fn blackhole_window_and_switch() {
        let f: Faults = "blackhole=100+50".parse().unwrap();
        let mut d = Dice::new(&f, 0);
        let at = |ms| Duration::from_millis(ms);
        assert!(matches!(d.roll(10, at(99), false), Fate::Delivered { .. }));
        assert_eq!(d.roll(10, at(100), false), Fate::Blackholed);
        assert_eq!(d.roll(10, at(149), false), Fate::Blackholed);
        assert!(matches!(d.roll(10, at(150), false), Fate::Delivered { .. }));
        assert_eq!(d.roll(10, at(0), true), Fate::Blackholed);
    }
}
