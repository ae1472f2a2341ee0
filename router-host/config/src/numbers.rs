//! Numeric field validators. They run while parsing, so an error carries the value's exact
//! location; null means "absent" (the field takes its default).

use std::fmt;

use serde::de::{self, Unexpected, Visitor};
use serde::Deserializer;

use super::error::excerpt;
use super::MAX_SESSION_TTL_SECS;

/// Whether `s` is written like an integer (too large for the parser's integer types).
fn looks_like_integer(s: &str) -> bool {
    let digits = s.strip_prefix(['-', '+']).unwrap_or(s);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit() || b == b'_')
}

/// Whether `s` is a numeral too large for `f64` (`1e400`), as opposed to a spelled-out infinity.
fn overflows_to_infinity(s: &str) -> bool {
    s.parse::<f64>().is_ok_and(f64::is_infinite) && !s.to_ascii_lowercase().contains("inf")
}

/// The error for a string where a number is expected. The YAML parser hands over numerals that
/// overflow `f64` (`1e400`) as strings: those get the `overflow` message, anything else is a
/// wrong type.
fn string_for_number<E: de::Error>(
    v: &str,
    expected: &dyn de::Expected,
    overflow: fmt::Arguments<'_>,
) -> E {
    if overflows_to_infinity(v) {
        E::custom(overflow)
    } else {
        E::invalid_type(Unexpected::Str(&excerpt(v)), expected)
    }
}

/// Accepts an integer in `min..=max`; null means "absent".
struct UintVisitor {
    min: u64,
    max: u64,
}

impl UintVisitor {
    fn out_of_range<E: de::Error>(&self, value: impl fmt::Display) -> E {
        E::custom(format_args!(
            "invalid value: integer `{value}` is out of range, expected {self}"
        ))
    }
}

impl fmt::Display for UintVisitor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.max == u64::MAX {
            write!(f, "an integer >= {}", self.min)
        } else {
            write!(f, "an integer from {} to {}", self.min, self.max)
        }
    }
}

impl<'de> Visitor<'de> for UintVisitor {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
        if v < self.min || v > self.max {
            Err(self.out_of_range(v))
        } else {
            Ok(Some(v))
        }
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(self.out_of_range(v)),
        }
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<Self::Value, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(self.out_of_range(v)),
        }
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<Self::Value, E> {
        match u64::try_from(v) {
            Ok(v) => self.visit_u64(v),
            Err(_) => Err(self.out_of_range(v)),
        }
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        if looks_like_integer(v) && v.parse::<u128>().is_err() {
            Err(self.out_of_range(excerpt(v)))
        } else {
            Err(string_for_number(
                v,
                &self,
                format_args!(
                    "invalid type: floating point `{}` (overflows to infinity), expected {self}",
                    excerpt(v)
                ),
            ))
        }
    }

    null_is_absent!();
}

pub(super) fn de_uint<'de, D: Deserializer<'de>>(
    d: D,
    min: u64,
    max: u64,
) -> Result<Option<u64>, D::Error> {
    d.deserialize_any(UintVisitor { min, max })
}

pub(super) fn de_block_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let value = de_uint(d, 1, u64::from(u32::MAX))?;
    value
        .map(|v| u32::try_from(v).map_err(|_| de::Error::custom("block_size out of range")))
        .transpose()
}

/// `plugin_images_max`: at least 1 (a configuration with a plugin maps one), at most 65,536.
pub(super) fn de_images_max<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, 65_536)
}

pub(super) fn de_pick_budget<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, u64::MAX)
}

pub(super) fn de_hang_after<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, u64::MAX)
}

pub(super) fn de_quarantine_after<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, u64::from(u32::MAX))
}

pub(super) fn de_ttl_secs<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_SESSION_TTL_SECS)
}

pub(super) fn de_max_bindings<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, u64::try_from(usize::MAX).unwrap_or(u64::MAX))
}

/// Longest a queued request may wait: one day.
pub const MAX_QUEUE_WAIT_MS: u64 = 86_400_000;

pub(super) fn de_queue_wait_ms<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_QUEUE_WAIT_MS)
}

/// The most `max_queued_requests` may be: far above any useful backlog, and still a bound.
pub const MAX_QUEUED_REQUESTS: u64 = 1 << 20;

pub(super) fn de_max_queued<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 1, MAX_QUEUED_REQUESTS)
}

pub(super) fn de_kv_recent_window_ms<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<u64>, D::Error> {
    de_uint(d, 0, super::MAX_KV_RECENT_WINDOW_MS)
}

pub(super) fn de_engine_waiting<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 0, u64::MAX)
}

/// A fraction of the KV cache: a finite number from 0 to 1.
pub(super) fn de_kv_usage<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    d.deserialize_any(FloatVisitor {
        min: 0.0,
        exclusive: false,
        max: Some(1.0),
    })
}

/// A class priority: any integer (higher = more important).
pub(super) fn de_priority<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    <Option<i64> as serde::Deserialize>::deserialize(d)
}

pub(super) fn de_busy_threshold<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_uint(d, 0, u64::MAX)
}

/// A parsed integer as the setting's type, or `default` when absent (or out of the type's range,
/// which the validators above rule out).
pub(super) fn narrow_or<T: TryFrom<u64>>(value: Option<u64>, default: T) -> T {
    value.and_then(|n| T::try_from(n).ok()).unwrap_or(default)
}

/// Accepts a finite number `>= min` (or `> min` when `exclusive`); null means "absent".
struct FloatVisitor {
    min: f64,
    exclusive: bool,
    /// An inclusive upper bound, when there is one.
    max: Option<f64>,
}

impl FloatVisitor {
    fn check<E: de::Error>(&self, v: f64) -> Result<Option<f64>, E> {
        let in_range = if self.exclusive {
            v > self.min
        } else {
            v >= self.min
        };
        let in_range = in_range && self.max.is_none_or(|max| v <= max);
        if v.is_finite() && in_range {
            Ok(Some(v))
        } else {
            Err(E::custom(format_args!(
                "invalid value: {}, expected {self}",
                yaml_float(v)
            )))
        }
    }
}

impl fmt::Display for FloatVisitor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(max) = self.max {
            return write!(f, "a finite number from {} to {max}", self.min);
        }
        let op = if self.exclusive { ">" } else { ">=" };
        write!(f, "a finite number {op} {}", self.min)
    }
}

/// `visit_*` methods for integers, checked as `f64`: integers are accepted as numbers, and
/// precision loss above 2^53 is irrelevant for weights.
macro_rules! integers_as_f64 {
    ($($method:ident($ty:ty)),+) => {
        $(
            #[allow(clippy::cast_precision_loss)]
            fn $method<E: de::Error>(self, v: $ty) -> Result<Self::Value, E> {
                self.check(v as f64)
            }
        )+
    };
}

impl<'de> Visitor<'de> for FloatVisitor {
    type Value = Option<f64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
        self.check(v)
    }

    integers_as_f64!(
        visit_u64(u64),
        visit_i64(i64),
        visit_u128(u128),
        visit_i128(i128)
    );

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Err(string_for_number(
            v,
            &self,
            format_args!(
                "invalid value: {} is too large (overflows to infinity), expected {self}",
                excerpt(v)
            ),
        ))
    }

    null_is_absent!();
}

pub(super) fn de_weight<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    d.deserialize_any(FloatVisitor {
        min: 0.0,
        exclusive: false,
        max: None,
    })
}

pub(super) fn de_busy_frac<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    d.deserialize_any(FloatVisitor {
        min: 0.0,
        exclusive: true,
        max: None,
    })
}

/// How a float is written in YAML (`.nan`, `.inf`, `-.inf`, or the number).
pub(super) fn yaml_float(v: f64) -> String {
    if v.is_nan() {
        ".nan".to_owned()
    } else if v == f64::INFINITY {
        ".inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-.inf".to_owned()
    } else {
        v.to_string()
    }
}
