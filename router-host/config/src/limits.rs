//! Limits enforced before the YAML parser runs (the file size, and the nesting depth of flow and
//! block collections), and the limits on the worker rows a configuration or a `select` scenario
//! declares, written once for both.

use std::path::Path;

use serde::Deserializer;

use super::error::{ConfigError, ConfigErrorKind};
use super::numbers::de_uint;
use crate::input::{self, InputError};

/// Most data-parallel ranks one worker may declare (`workers[].dp_size` in a configuration,
/// `workers[].dp_size` in a `select` scenario).
pub const MAX_DP_SIZE: u64 = 65_536;

/// Most rows (the sum of every worker's `dp_size`) a configuration's `workers:` or a scenario may
/// declare: the routing core's own cap on a cluster, which materialises every eligible row per
/// request.
pub const MAX_ROWS: usize = router_core::model::MAX_ROWS;

/// A `dp_size` (in a config or a `select` scenario): an integer from 1 to [`MAX_DP_SIZE`]; null
/// means absent.
pub fn de_dp_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let value = de_uint(d, 1, MAX_DP_SIZE)?;
    // MAX_DP_SIZE fits in u32.
    Ok(value.map(|v| u32::try_from(v).unwrap_or(u32::MAX)))
}

/// Largest configuration file [`RouterConfig::from_file`](super::RouterConfig::from_file) reads.
pub const MAX_CONFIG_BYTES: u64 = 16 * 1024 * 1024;

/// The configuration file's bytes: a regular file only (a FIFO would block, a device never end),
/// at most [`MAX_CONFIG_BYTES`].
pub(super) fn read_capped(path: &Path) -> Result<Vec<u8>, ConfigError> {
    input::read_capped(path, MAX_CONFIG_BYTES).map_err(|err| {
        let kind = match err {
            InputError::Io(err) => ConfigErrorKind::Read(err),
            InputError::NotAFile { kind } => ConfigErrorKind::NotAFile { kind },
            InputError::TooLarge { limit } => ConfigErrorKind::TooLarge { limit },
        };
        ConfigError::new(Some(path), kind)
    })
}

/// Deepest nesting of flow collections (`[`, `{`)
/// [`RouterConfig::from_yaml_str`](super::RouterConfig::from_yaml_str) hands to the YAML parser;
/// the parser's own recursion limit (128) refuses deeper documents anyway.
pub const MAX_FLOW_DEPTH: usize = 128;

/// Deepest nesting of block collections (indented mappings and sequences, `- - -` and `? ?`
/// chains) handed to the YAML parser; its recursion limit (128, counting block and flow levels
/// together) refuses deeper documents anyway, so this refuses nothing the parser would accept.
pub const MAX_BLOCK_DEPTH: usize = 128;

/// Which kind of nesting went past its limit, and where (1-based line and column, in
/// characters, of the token that opened the level past the limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TooDeep {
    /// More than [`MAX_FLOW_DEPTH`] nested `[`/`{`.
    Flow { line: usize, column: usize },
    /// More than [`MAX_BLOCK_DEPTH`] nested block collections.
    Block { line: usize, column: usize },
}

/// Where the collections of `text` first nest deeper than [`MAX_FLOW_DEPTH`] (flow) or
/// [`MAX_BLOCK_DEPTH`] (block), if they do.
///
/// libyaml's scanner revisits every open flow level on each token, so its time grows with tokens
/// times flow depth: 100,000 nested `[` (200 KB) took minutes, and serde_yaml reads every event
/// before its own recursion limit applies. Block nesting is linear in time but not in memory
/// (8 million `- ` levels, a 16 MB file, took 4 s and 2.4 GB), so it is capped here too. This
/// pre-scan is linear, allocates at most [`MAX_BLOCK_DEPTH`] indentation levels, and follows
/// libyaml's own tokenizer (unsafe-libyaml 0.2.11, `scanner.rs`) closely enough that what it
/// skips as text is text to the parser too:
///
/// - a comment starts with `#` only where a token may start (after blanks, a line break, or a
///   token such as `]` or a quoted scalar) and ends at any YAML line break (`\n`, `\r`, NEL,
///   LS, PS);
/// - a quote starts a quoted scalar only where a token starts; an apostrophe inside a plain
///   scalar (`note: rock 'n roll`, or a continuation line of a multi-line plain scalar, or any
///   line of a flow collection's plain scalar) is text, as it is to the parser;
/// - a plain scalar ends where libyaml ends it (`: `, ` #`, `,[]{}` in flow context, a line less
///   indented than the enclosing block collection, or a document marker);
/// - a block scalar (`|`, `>`) runs over its indented lines, with its indentation found the way
///   libyaml finds it; brackets and quotes inside it are text.
///
/// Where the parser would report a syntax error the scan may go on differently, which is harmless:
/// the parser stops there (its look-ahead is at most one line and 1024 characters).
pub(super) fn nesting_too_deep(text: &str) -> Option<TooDeep> {
    Scan::new(text.as_bytes()).run()
}

/// The scanner state that matters for nesting; the field names follow libyaml's.
struct Scan<'a> {
    b: &'a [u8],
    i: usize,
    /// 1-based line.
    line: usize,
    /// 0-based column in characters.
    col: usize,
    flow_level: usize,
    /// Columns of the open block collections; libyaml's `indent` is the last (-1 when empty).
    indents: Vec<usize>,
    simple_key_allowed: bool,
    /// The possible simple key of the block context: (line, column, byte index).
    simple_key: Option<(usize, usize, usize)>,
}

impl<'a> Scan<'a> {
    fn new(b: &'a [u8]) -> Self {
        Scan {
            b,
            i: 0,
            line: 1,
            col: 0,
            flow_level: 0,
            indents: Vec::new(),
            // The stream start token allows a simple key.
            simple_key_allowed: true,
            simple_key: None,
        }
    }

    fn at(&self, offset: usize) -> u8 {
        // NUL stands for the end of the input, as in libyaml (a NUL byte is an error anyway).
        self.b.get(self.i + offset).copied().unwrap_or(0)
    }

    /// Length of the line break at `offset`, if there is one.
    fn break_len(&self, offset: usize) -> Option<usize> {
        match (self.at(offset), self.at(offset + 1), self.at(offset + 2)) {
            (b'\r', b'\n', _) => Some(2),
            (b'\r' | b'\n', _, _) => Some(1),
            (0xC2, 0x85, _) => Some(2),
            (0xE2, 0x80, 0xA8 | 0xA9) => Some(3),
            _ => None,
        }
    }

    fn is_end(&self, offset: usize) -> bool {
        self.i + offset >= self.b.len() || self.at(offset) == 0
    }

    fn is_blank(&self, offset: usize) -> bool {
        matches!(self.at(offset), b' ' | b'\t')
    }

    fn is_blankz(&self, offset: usize) -> bool {
        self.is_blank(offset) || self.break_len(offset).is_some() || self.is_end(offset)
    }

    /// Moves past one character (or one line break).
    fn skip(&mut self) {
        if let Some(len) = self.break_len(0) {
            self.i += len;
            self.line += 1;
            self.col = 0;
            return;
        }
        self.i += 1;
        while self.i < self.b.len() && self.b[self.i] & 0xC0 == 0x80 {
            self.i += 1;
        }
        self.col += 1;
    }

    fn skip_to_break(&mut self) {
        while !self.is_end(0) && self.break_len(0).is_none() {
            self.skip();
        }
    }

    fn document_marker(&self) -> bool {
        self.col == 0
            && matches!(
                (self.at(0), self.at(1), self.at(2)),
                (b'-', b'-', b'-') | (b'.', b'.', b'.')
            )
            && self.is_blankz(3)
    }

    /// libyaml's `indent`.
    fn indent(&self) -> isize {
        self.indents
            .last()
            .map_or(-1, |&c| isize::try_from(c).unwrap_or(isize::MAX))
    }

    fn save_simple_key(&mut self) {
        if self.simple_key_allowed && self.flow_level == 0 {
            self.simple_key = Some((self.line, self.col, self.i));
        }
    }

    fn remove_simple_key(&mut self) {
        if self.flow_level == 0 {
            self.simple_key = None;
        }
    }

    fn roll_indent(&mut self, line: usize, column: usize) -> Result<(), TooDeep> {
        if self.flow_level == 0 && self.indent() < isize::try_from(column).unwrap_or(isize::MAX) {
            if self.indents.len() >= MAX_BLOCK_DEPTH {
                return Err(TooDeep::Block {
                    line,
                    column: column + 1,
                });
            }
            self.indents.push(column);
        }
        Ok(())
    }

    fn run(mut self) -> Option<TooDeep> {
        self.tokens().err()
    }

    /// libyaml's `fetch_next_token`, in a loop.
    fn tokens(&mut self) -> Result<(), TooDeep> {
        loop {
            self.scan_to_next_token();
            if self.is_end(0) {
                return Ok(());
            }
            if self.flow_level == 0 {
                // unroll_indent
                while self.indent() > isize::try_from(self.col).unwrap_or(isize::MAX) {
                    self.indents.pop();
                }
            }
            let c = self.at(0);
            if self.col == 0 && c == b'%' {
                // A directive: its line, then the document's tokens.
                self.indents.clear();
                self.remove_simple_key();
                self.simple_key_allowed = false;
                self.skip_to_break();
                continue;
            }
            if self.document_marker() {
                self.indents.clear();
                self.remove_simple_key();
                self.simple_key_allowed = false;
                for _ in 0..3 {
                    self.skip();
                }
                continue;
            }
            match c {
                b'[' | b'{' => {
                    self.save_simple_key();
                    self.flow_level += 1;
                    if self.flow_level > MAX_FLOW_DEPTH {
                        return Err(TooDeep::Flow {
                            line: self.line,
                            column: self.col + 1,
                        });
                    }
                    self.simple_key_allowed = true;
                    self.skip();
                }
                b']' | b'}' => {
                    self.remove_simple_key();
                    self.flow_level = self.flow_level.saturating_sub(1);
                    self.simple_key_allowed = false;
                    self.skip();
                }
                b',' => {
                    self.remove_simple_key();
                    self.simple_key_allowed = true;
                    self.skip();
                }
                b'-' if self.is_blankz(1) => {
                    self.roll_indent(self.line, self.col)?;
                    self.remove_simple_key();
                    self.simple_key_allowed = true;
                    self.skip();
                }
                b'?' if self.flow_level > 0 || self.is_blankz(1) => {
                    self.roll_indent(self.line, self.col)?;
                    self.remove_simple_key();
                    self.simple_key_allowed = self.flow_level == 0;
                    self.skip();
                }
                b':' if self.flow_level > 0 || self.is_blankz(1) => {
                    // A simple key is stale once the line changed or 1024 bytes passed.
                    let key = self
                        .simple_key
                        .filter(|&(line, _, index)| line == self.line && index + 1024 >= self.i);
                    match key {
                        Some((line, column, _)) if self.flow_level == 0 => {
                            self.roll_indent(line, column)?;
                            self.simple_key_allowed = false;
                        }
                        _ => {
                            self.roll_indent(self.line, self.col)?;
                            self.simple_key_allowed = self.flow_level == 0;
                        }
                    }
                    self.remove_simple_key();
                    self.skip();
                }
                b'*' | b'&' => {
                    self.save_simple_key();
                    self.simple_key_allowed = false;
                    self.skip();
                    while self.at(0).is_ascii_alphanumeric() || matches!(self.at(0), b'_' | b'-') {
                        self.skip();
                    }
                }
                b'!' => {
                    // A tag runs to a blank (or `,` in flow context), or is a syntax error.
                    self.save_simple_key();
                    self.simple_key_allowed = false;
                    while !(self.is_blankz(0) || (self.flow_level > 0 && self.at(0) == b',')) {
                        self.skip();
                    }
                }
                b'|' | b'>' if self.flow_level == 0 => {
                    self.remove_simple_key();
                    self.simple_key_allowed = true;
                    self.block_scalar();
                }
                b'\'' | b'"' => {
                    self.save_simple_key();
                    self.simple_key_allowed = false;
                    self.quoted_scalar(c);
                }
                _ => {
                    self.save_simple_key();
                    self.simple_key_allowed = false;
                    self.plain_scalar();
                }
            }
        }
    }

    /// libyaml's `scan_to_next_token`: blanks, comments and line breaks.
    fn scan_to_next_token(&mut self) {
        loop {
            if self.col == 0 && self.b[self.i..].starts_with("\u{feff}".as_bytes()) {
                self.skip();
            }
            while self.is_blank(0) {
                self.skip();
            }
            if self.at(0) == b'#' {
                self.skip_to_break();
            }
            if self.break_len(0).is_none() {
                return;
            }
            self.skip();
            if self.flow_level == 0 {
                self.simple_key_allowed = true;
            }
        }
    }

    /// libyaml's `scan_flow_scalar`, from the opening quote past the closing one.
    fn quoted_scalar(&mut self, quote: u8) {
        self.skip();
        while !self.is_end(0) {
            match self.at(0) {
                b'\'' if quote == b'\'' && self.at(1) == b'\'' => {
                    self.skip();
                    self.skip();
                }
                b'\\' if quote == b'"' => {
                    self.skip();
                    if !self.is_end(0) {
                        self.skip();
                    }
                }
                c if c == quote => {
                    self.skip();
                    return;
                }
                _ => self.skip(),
            }
        }
    }

    /// libyaml's `scan_plain_scalar`: stops at the first character that is not the scalar's.
    fn plain_scalar(&mut self) {
        let indent = self.indent() + 1;
        loop {
            if self.document_marker() || self.at(0) == b'#' {
                return;
            }
            while !self.is_blankz(0) {
                let c = self.at(0);
                if (c == b':' && self.is_blankz(1))
                    || (self.flow_level > 0
                        && (matches!(c, b',' | b'[' | b']' | b'{' | b'}')
                            || (c == b':'
                                && matches!(self.at(1), b',' | b'?' | b'[' | b']' | b'{' | b'}'))))
                {
                    return;
                }
                self.skip();
                self.simple_key_allowed = false;
            }
            if !self.is_blank(0) && self.break_len(0).is_none() {
                return;
            }
            let mut leading_blanks = false;
            while self.is_blank(0) || self.break_len(0).is_some() {
                leading_blanks |= self.break_len(0).is_some();
                self.skip();
            }
            if leading_blanks {
                // libyaml sets this when the scalar ends after a line break.
                self.simple_key_allowed = true;
            }
            if self.flow_level == 0 && isize::try_from(self.col).unwrap_or(isize::MAX) < indent {
                return;
            }
        }
    }

    /// libyaml's `scan_block_scalar`: the header line, then every line of the body.
    fn block_scalar(&mut self) {
        self.skip();
        let mut increment = 0usize;
        for _ in 0..2 {
            match self.at(0) {
                b'+' | b'-' => self.skip(),
                d @ b'1'..=b'9' => {
                    increment = usize::from(d - b'0');
                    self.skip();
                }
                _ => {}
            }
        }
        while self.is_blank(0) {
            self.skip();
        }
        if self.at(0) == b'#' {
            self.skip_to_break();
        }
        if self.break_len(0).is_none() {
            // A syntax error (or the end): the parser stops here.
            return;
        }
        self.skip();
        let parent = self.indent();
        let mut indent = if increment == 0 {
            0
        } else {
            usize::try_from(parent.max(0)).unwrap_or(0) + increment
        };
        if !self.block_scalar_breaks(&mut indent, parent) {
            return;
        }
        while self.col == indent && !self.is_end(0) {
            self.skip_to_break();
            if self.is_end(0) {
                return;
            }
            self.skip();
            if !self.block_scalar_breaks(&mut indent, parent) {
                return;
            }
        }
    }

    /// libyaml's `scan_block_scalar_breaks`: empty lines and the indentation of the next one;
    /// fixes `indent` when it was left to be detected. False at a tab where indentation belongs
    /// (a syntax error).
    fn block_scalar_breaks(&mut self, indent: &mut usize, parent: isize) -> bool {
        let mut max_indent = 0;
        loop {
            while (*indent == 0 || self.col < *indent) && self.at(0) == b' ' {
                self.skip();
            }
            max_indent = max_indent.max(self.col);
            if (*indent == 0 || self.col < *indent) && self.at(0) == b'\t' {
                return false;
            }
            if self.break_len(0).is_none() {
                break;
            }
            self.skip();
        }
        if *indent == 0 {
            let least = usize::try_from(parent + 1).unwrap_or(0).max(1);
            *indent = max_indent.max(least);
        }
        true
    }
}
