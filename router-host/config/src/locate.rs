//! Locating nodes in the text: key paths, and the line and column of the node at a path (for
//! errors found after parsing, and for entry lines).

use std::fmt;

use serde::de::{self, DeserializeSeed, IgnoredAny, VariantAccess, Visitor};
use serde::Deserializer;

/// One step of a key path.
#[derive(Debug, Clone)]
pub(super) enum Seg {
    Key(String),
    Index(usize),
}

pub(super) fn key(k: &str) -> Seg {
    Seg::Key(k.to_owned())
}

/// Renders `worker_selection.instances[0].name`.
pub(super) fn render_path(path: &[Seg]) -> String {
    let mut out = String::new();
    for seg in path {
        match seg {
            Seg::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Seg::Index(i) => {
                out.push('[');
                out.push_str(&i.to_string());
                out.push(']');
            }
        }
    }
    out
}

/// Marker message of a successful probe; never shown to users.
pub(super) const PROBE_HIT: &str = "\u{0}config-probe-hit\u{0}";

/// Walks the document to the node at a path and fails there, so that the parser attaches that
/// node's line and column to the error. `serde_yaml` exposes positions only on errors.
struct Probe<'a>(&'a [Seg]);

impl Probe<'_> {
    fn leaf<E: de::Error>(&self) -> Result<(), E> {
        if self.0.is_empty() {
            Err(E::custom(PROBE_HIT))
        } else {
            Ok(())
        }
    }
}

impl<'de> DeserializeSeed<'de> for Probe<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

/// `visit_*` methods for scalars, which end the walk: the probe hits if its path ends there.
macro_rules! scalar_leaves {
    ($($method:ident($ty:ty)),+ $(,)?) => {
        $(
            fn $method<E: de::Error>(self, _: $ty) -> Result<(), E> {
                self.leaf()
            }
        )+
    };
}

impl<'de> Visitor<'de> for Probe<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any YAML value")
    }

    scalar_leaves!(
        visit_bool(bool),
        visit_i64(i64),
        visit_u64(u64),
        visit_i128(i128),
        visit_u128(u128),
        visit_f64(f64),
        visit_str(&str),
        visit_bytes(&[u8]),
    );

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.leaf()
    }

    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.leaf()
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }

    fn visit_enum<A: de::EnumAccess<'de>>(self, data: A) -> Result<(), A::Error> {
        self.leaf()?;
        let (IgnoredAny, variant) = data.variant::<IgnoredAny>()?;
        variant.newtype_variant_seed(self)
    }

    fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        self.leaf()?;
        if let Some((Seg::Index(target), rest)) = self.0.split_first() {
            let mut index = 0;
            loop {
                let more = if index == *target {
                    seq.next_element_seed(Probe(rest))?.is_some()
                } else {
                    seq.next_element::<IgnoredAny>()?.is_some()
                };
                if !more {
                    return Ok(());
                }
                index += 1;
            }
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }

    fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.leaf()?;
        let (wanted, rest) = match self.0.split_first() {
            Some((Seg::Key(wanted), rest)) => (Some(wanted.as_str()), rest),
            _ => (None, &[][..]),
        };
        let mut found = false;
        while let Some(k) = map.next_key::<serde_yaml::Value>()? {
            if !found && wanted.is_some() && k.as_str() == wanted {
                found = true;
                map.next_value_seed(Probe(rest))?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// Line and column of the node at `path` in `text`, if the text has one.
pub(super) fn locate(text: &str, path: &[Seg]) -> Option<(usize, usize)> {
    let deserializer = serde_yaml::Deserializer::from_str(text);
    match Probe(path).deserialize(deserializer) {
        Err(err) if err.to_string().contains(PROBE_HIT) => {
            err.location().map(|loc| (loc.line(), loc.column()))
        }
        _ => None,
    }
}
