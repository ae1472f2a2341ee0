//! Limits enforced before the YAML parser runs: the file size, and the nesting depth of flow
//! collections.

use std::io::Read;
use std::path::Path;

use super::error::{ConfigError, ConfigErrorKind};

/// Largest configuration file [`RouterConfig::from_file`](super::RouterConfig::from_file) reads.
pub const MAX_CONFIG_BYTES: u64 = 16 * 1024 * 1024;

pub(super) fn read_capped(path: &Path) -> Result<Vec<u8>, ConfigError> {
    let read_error = |err| ConfigError::new(Some(path), ConfigErrorKind::Read(err));
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if u64::try_from(bytes.len()).map_or(true, |len| len > MAX_CONFIG_BYTES) {
        return Err(ConfigError::new(
            Some(path),
            ConfigErrorKind::TooLarge {
                limit: MAX_CONFIG_BYTES,
            },
        ));
    }
    Ok(bytes)
}

/// Deepest nesting of flow collections (`[`, `{`)
/// [`RouterConfig::from_yaml_str`](super::RouterConfig::from_yaml_str) hands to the YAML parser;
/// the parser's own recursion limit (128) refuses deeper documents anyway.
pub const MAX_FLOW_DEPTH: usize = 128;

/// Where the flow collections of `text` first nest deeper than [`MAX_FLOW_DEPTH`], if they do.
///
/// The YAML scanner revisits every open flow level on each token, so its time grows with tokens
/// times depth: 100,000 nested `[` (200 KB) took minutes before the parser's recursion limit
/// could refuse them. This linear pre-scan refuses them first. It skips comments and quoted
/// scalars; a bracket inside a plain or block scalar counts, so a false refusal would need more
/// than 128 unbalanced `[`/`{` in plain text.
pub(super) fn flow_too_deep(text: &str) -> Option<(usize, usize)> {
    let bytes = text.as_bytes();
    let (mut depth, mut line, mut line_start) = (0usize, 1usize, 0usize);
    // Whether the previous byte lets a comment or a quoted scalar start here.
    let mut at_token_start = true;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        match b {
            b'\n' => {
                line += 1;
                line_start = i + 1;
            }
            b'#' if at_token_start => {
                while i + 1 < bytes.len() && bytes[i + 1] != b'\n' {
                    i += 1;
                }
            }
            b'"' | b'\'' if at_token_start => {
                i += 1;
                while i < bytes.len() {
                    match bytes[i] {
                        // An escaped character, or `''` in single quotes; an escaped line
                        // break still starts a new line.
                        b'\\' if b == b'"' => {
                            i += 1;
                            if bytes.get(i) == Some(&b'\n') {
                                line += 1;
                                line_start = i + 1;
                            }
                        }
                        b'\'' if b == b'\'' && bytes.get(i + 1) == Some(&b'\'') => i += 1,
                        c if c == b => break,
                        b'\n' => {
                            line += 1;
                            line_start = i + 1;
                        }
                        _ => {}
                    }
                    i += 1;
                }
            }
            b'[' | b'{' => {
                depth += 1;
                if depth > MAX_FLOW_DEPTH {
                    return Some((line, i - line_start + 1));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        at_token_start = matches!(
            bytes.get(i),
            Some(b' ' | b'\t' | b'\n' | b'\r' | b'[' | b'{' | b',' | b':')
        );
        i += 1;
    }
    None
}
