//! String field validators: names, plugin paths and digests, and the plain-string spellings of
//! the enum settings. They run while parsing, so an error carries the value's exact location.

use std::fmt;

use serde::de::{self, Unexpected, Visitor};
use serde::Deserializer;

use super::error::excerpt;
use super::{
    AdmissionMode, AffinityMode, DecodeBooking, OnError, PrefillBooking, Room, TieBreak,
    DEFAULT_INSTANCE, MAX_NAME_LEN,
};

/// A settings enum written as a plain string: its spellings and the value of each. The
/// config's own enums get it from `spelled!`; the core's modes from their `ALL`, `as_str` and
/// `from_name`.
pub(super) trait Spelled: Sized {
    /// Every spelling, in the order the error for an unknown one lists them.
    const NAMES: &'static [&'static str];

    /// The value spelled `name`, if any.
    fn from_name(name: &str) -> Option<Self>;
}

/// [`Spelled`] for an enum of the core, whose `as_str` is a `const fn`.
macro_rules! spelled_in_core {
    ($($name:ident),+) => {$(
        impl Spelled for $name {
            const NAMES: &'static [&'static str] = &{
                let mut names = [""; $name::ALL.len()];
                let mut i = 0;
                while i < names.len() {
                    names[i] = $name::ALL[i].as_str();
                    i += 1;
                }
                names
            };

            fn from_name(name: &str) -> Option<Self> {
                $name::from_name(name)
            }
        }
    )+};
}

spelled_in_core!(
    AdmissionMode,
    AffinityMode,
    DecodeBooking,
    PrefillBooking,
    Room,
    TieBreak
);

/// Accepts a unit variant of `T` written as a plain string; null means "absent" unless
/// `required`. Without it, `serde_yaml` reports a sequence or mapping given for an enum as
/// "expected a YAML tag starting with '!'", which names neither the accepted values nor the
/// mistake.
struct VariantVisitor<T> {
    expecting: &'static str,
    required: bool,
    variant: std::marker::PhantomData<T>,
}

impl<'de, T: Spelled> Visitor<'de> for VariantVisitor<T> {
    type Value = Option<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        // The same error, to the byte, as a serde-derived enum gives for an unknown variant.
        T::from_name(v)
            .map(Some)
            .ok_or_else(|| E::unknown_variant(v, T::NAMES))
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        if self.required {
            Err(E::invalid_type(Unexpected::Other("null"), &self))
        } else {
            Ok(None)
        }
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        self.visit_unit()
    }
}

fn de_variant<'de, D: Deserializer<'de>, T: Spelled>(
    d: D,
    expecting: &'static str,
    required: bool,
) -> Result<Option<T>, D::Error> {
    d.deserialize_any(VariantVisitor {
        expecting,
        required,
        variant: std::marker::PhantomData,
    })
}

pub(super) fn de_on_error<'de, D: Deserializer<'de>>(d: D) -> Result<Option<OnError>, D::Error> {
    de_variant(d, "`fallback` or `fail`", false)
}

pub(super) fn de_admission<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<AdmissionMode>, D::Error> {
    de_variant(d, "`any_eligible` or `chosen_row`", false)
}

pub(super) fn de_prefill_booking<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<PrefillBooking>, D::Error> {
    de_variant(d, "`prompt` or `uncached`", false)
}

pub(super) fn de_decode_booking<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<DecodeBooking>, D::Error> {
    de_variant(d, "`prompt` or `deduplicated`", false)
}

pub(super) fn de_room<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Room>, D::Error> {
    de_variant(d, "`free` or `not_recent`", false)
}

pub(super) fn de_tie_break<'de, D: Deserializer<'de>>(d: D) -> Result<Option<TieBreak>, D::Error> {
    de_variant(d, "`lowest_row` or `spread`", false)
}

pub(super) fn de_affinity_mode<'de, D: Deserializer<'de>>(d: D) -> Result<AffinityMode, D::Error> {
    const EXPECTING: &str = "`soft` or `hard`";
    // `required` makes null an error inside the visitor, so the error carries the value's place.
    de_variant(d, EXPECTING, true)?
        .ok_or_else(|| de::Error::invalid_type(Unexpected::Other("null"), &EXPECTING))
}

/// What kind of string a [`StrVisitor`] accepts.
#[derive(Clone, Copy)]
enum StrRule {
    InstanceName,
    ClassName,
    TypeName,
    PluginPath,
    LibraryName,
    Sha256,
}

/// Accepts a string under a [`StrRule`]; null means "absent" for optional fields, and is rejected
/// by the derive for required ones.
struct StrVisitor(StrRule);

fn name_chars_ok(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

fn check_name(what: &str, v: &str) -> Result<(), String> {
    if v.is_empty() {
        return Err(format!("invalid {what}: the name is empty"));
    }
    if v.len() > MAX_NAME_LEN {
        return Err(format!(
            "invalid {what} `{}`: longer than {MAX_NAME_LEN} characters",
            excerpt(v)
        ));
    }
    if !name_chars_ok(v) {
        return Err(format!(
            "invalid {what} `{}`: names may only contain letters, digits, `_`, `.` and `-`",
            excerpt(v)
        ));
    }
    Ok(())
}

impl StrRule {
    fn expecting(self) -> &'static str {
        match self {
            StrRule::InstanceName => {
                "an instance name (a string of letters, digits, `_`, `.`, `-`)"
            }
            StrRule::ClassName => {
                "a policy class name (a string of letters, digits, `_`, `.`, `-`)"
            }
            StrRule::TypeName => "a policy type name (a non-empty string)",
            StrRule::PluginPath => "a plugin file path (a non-empty string)",
            StrRule::LibraryName => "a library name such as `two_tier_cost_fn`",
            StrRule::Sha256 => "a SHA-256 digest (64 hexadecimal digits, as a string)",
        }
    }

    fn check(self, v: &str) -> Result<String, String> {
        match self {
            StrRule::InstanceName => {
                check_name("instance name", v)?;
                if v == DEFAULT_INSTANCE {
                    return Err(format!(
                        "instance name `{DEFAULT_INSTANCE}` is reserved for the built-in selector; \
                         choose another name"
                    ));
                }
                Ok(v.to_owned())
            }
            StrRule::ClassName => {
                check_name("policy class name", v)?;
                Ok(v.to_owned())
            }
            StrRule::TypeName => {
                if v.trim().is_empty() {
                    Err("invalid policy type name: the name is empty".to_owned())
                } else {
                    Ok(v.to_owned())
                }
            }
            StrRule::PluginPath => {
                if v.is_empty() {
                    Err("invalid plugin path: the path is empty".to_owned())
                } else if v.contains('\0') {
                    Err(format!(
                        "invalid plugin path `{}`: contains a NUL character",
                        excerpt(v)
                    ))
                } else {
                    Ok(v.to_owned())
                }
            }
            StrRule::LibraryName => {
                check_name("plugin library name", v)?;
                if v.ends_with(".so") {
                    return Err(format!(
                        "invalid plugin library name `{}`: give the name without `lib` and `.so` \
                         (for `libfoo.so` write `name: foo`), or use `path:` for a file",
                        excerpt(v)
                    ));
                }
                Ok(v.to_owned())
            }
            StrRule::Sha256 => {
                if v.len() == 64 && v.bytes().all(|b| b.is_ascii_hexdigit()) {
                    Ok(v.to_ascii_lowercase())
                } else {
                    Err(format!(
                        "invalid sha256 `{}`: expected 64 hexadecimal digits, found {} characters{}",
                        excerpt(v),
                        v.chars().count(),
                        if v.chars().all(|c| c.is_ascii_hexdigit()) {
                            ""
                        } else {
                            " including non-hexadecimal ones"
                        }
                    ))
                }
            }
        }
    }
}

impl<'de> Visitor<'de> for StrVisitor {
    type Value = Option<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hint = match self.0 {
            StrRule::InstanceName | StrRule::ClassName | StrRule::Sha256 => {
                " (quote values that look like numbers)"
            }
            _ => "",
        };
        write!(f, "{}{hint}", self.0.expecting())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        self.0.check(v).map(Some).map_err(E::custom)
    }

    null_is_absent!();
}

fn de_opt_str<'de, D: Deserializer<'de>>(d: D, rule: StrRule) -> Result<Option<String>, D::Error> {
    d.deserialize_any(StrVisitor(rule))
}

fn de_required_str<'de, D: Deserializer<'de>>(d: D, rule: StrRule) -> Result<String, D::Error> {
    de_opt_str(d, rule)?
        .ok_or_else(|| de::Error::invalid_type(Unexpected::Unit, &StrRule::expecting(rule)))
}

pub(super) fn de_instance_name<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    de_required_str(d, StrRule::InstanceName)
}

pub(super) fn de_class_name<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    de_required_str(d, StrRule::ClassName)
}

pub(super) fn de_type_name<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    de_required_str(d, StrRule::TypeName)
}

pub(super) fn de_plugin_path<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    de_opt_str(d, StrRule::PluginPath)
}

pub(super) fn de_library_name<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    de_opt_str(d, StrRule::LibraryName)
}

pub(super) fn de_sha256<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    de_opt_str(d, StrRule::Sha256)
}
