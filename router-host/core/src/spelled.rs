//! [`spelled_enum!`](crate::spelled_enum): a settings enum and its one spelling per variant.
//!
//! The modes the configuration names (`booking.prefill`, `session_affinity.mode`, ...) each
//! need the same four things: every value in order (error messages list them), the spelling of a
//! value (YAML, metrics, logs), the value of a spelling, and `Display`. The macro writes them
//! from one table, so a spelling is written once.

/// Declare a unit-only enum whose variants are written `Variant = "spelling"`, with
/// `pub const ALL` (every value, in declaration order: the order errors list their spellings),
/// `pub const fn as_str`, `pub fn from_name` and `Display` (the spelling).
///
/// ```
/// router_core::spelled_enum! {
///     /// How loud.
///     #[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
///     pub enum Volume {
///         #[default]
///         Quiet = "quiet",
///         Loud = "loud",
///     }
/// }
/// assert_eq!(Volume::ALL, [Volume::Quiet, Volume::Loud]);
/// assert_eq!(Volume::from_name("loud"), Some(Volume::Loud));
/// assert_eq!(Volume::Quiet.to_string(), "quiet");
/// ```
#[macro_export]
macro_rules! spelled_enum {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$variant_meta:meta])* $variant:ident = $text:literal),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis enum $name {
            $($(#[$variant_meta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order (the order errors list their spellings).
            pub const ALL: [$name; [$($text),+].len()] = [$($name::$variant),+];

            /// The spelling: configuration, metrics and logs.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

            /// The value spelled `name` (as [`Self::as_str`] writes it), if any.
            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $($text => Some($name::$variant),)+
                    _ => None,
                }
            }
        }

        impl ::std::fmt::Display for $name {
            fn fmt(&self, f: &mut ::std::fmt::Formatter<'_>) -> ::std::fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}
