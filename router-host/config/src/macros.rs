//! Macros shared by the configuration files (declared first in `mod.rs`, so every file sees them).

/// `as_str` (the YAML spelling), `Display` (the same text) and the parsing of that spelling
/// (`strings::Spelled`) of a settings enum, from its variants and their spellings.
macro_rules! spelled {
    ($name:ident { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl $name {
            /// The YAML spelling.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl $crate::strings::Spelled for $name {
            const NAMES: &'static [&'static str] = &[$($text),+];

            fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($text => Some($name::$variant),)+
                    _ => None,
                }
            }
        }
    };
}

/// `visit_unit` and `visit_none` of a visitor for an optional field: null means "absent".
macro_rules! null_is_absent {
    () => {
        fn visit_unit<E: ::serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }

        fn visit_none<E: ::serde::de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    };
}
