//! Text a plugin supplied, made safe to print and to log.

/// Text a plugin supplied (its name, version, type summaries, parameter docs, error messages),
/// made safe to print on a terminal: control characters (newlines and tabs included, as `\n` and
/// `\t`), terminal escapes (`\u{1b}`) and invisible format characters such as bidirectional
/// overrides are escaped the way [`str::escape_debug`] escapes them; quotes, backslashes and
/// every printable character (non-ASCII letters too) are kept. The one helper every message and
/// every `check`/`describe` line that shows plugin text goes through.
pub fn printable(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return std::borrow::Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if needs_escape(c) {
            out.extend(c.escape_debug());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// The most bytes of one plugin-supplied text (a log message, an error, a panic message) the
/// host keeps: a plugin cannot make one log line or one error arbitrarily large.
pub const MAX_PLUGIN_TEXT_BYTES: usize = 1024;

/// Text a plugin hands the host at run time, made safe to log and to show: [`printable`]
/// (no control characters, so no forged log lines or terminal escapes), then cut to
/// [`MAX_PLUGIN_TEXT_BYTES`] on a character boundary, saying how much was cut.
pub fn plugin_text(text: &str) -> String {
    let escaped = printable(text);
    if escaped.len() <= MAX_PLUGIN_TEXT_BYTES {
        return escaped.into_owned();
    }
    let mut end = MAX_PLUGIN_TEXT_BYTES;
    while !escaped.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}... ({} more bytes cut)",
        escaped.get(..end).unwrap_or_default(),
        escaped.len() - end
    )
}

/// Whether [`printable`] escapes `c`: an ASCII control character, or a non-ASCII character that
/// `str::escape_debug` escapes when it is not the first character (C1 controls, format
/// characters such as U+202E, unassigned code points; not combining marks, which
/// `char::escape_debug` would escape too).
fn needs_escape(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_control();
    }
    let mut buf = [0u8; 5];
    buf[0] = b'a';
    let len = 1 + c.encode_utf8(&mut buf[1..]).len();
    match std::str::from_utf8(&buf[..len]) {
        Ok(text) => !text.escape_debug().eq(text.chars()),
        Err(_) => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugin_text_escapes_then_caps_on_a_character_boundary() {
        assert_eq!(plugin_text("fine"), "fine");
        assert_eq!(plugin_text("forged\nINFO line"), "forged\\nINFO line");
        let long = "\u{e9}".repeat(MAX_PLUGIN_TEXT_BYTES); // 2 bytes each
        let kept = plugin_text(&long);
        let cut = 2 * MAX_PLUGIN_TEXT_BYTES - MAX_PLUGIN_TEXT_BYTES;
        assert_eq!(
            kept,
            format!(
                "{}... ({cut} more bytes cut)",
                "\u{e9}".repeat(MAX_PLUGIN_TEXT_BYTES / 2)
            )
        );
    }

    #[test]
    fn printable_escapes_controls_and_invisible_format_characters_only() {
        // Plain text, quotes, backslashes, non-ASCII letters and combining marks stay as they are.
        for kept in [
            "plain",
            "caf\u{e9} e\u{301} \u{65e5}\u{672c}",
            "\"q\" 'a' \\ `b`",
            "",
        ] {
            assert!(
                matches!(printable(kept), std::borrow::Cow::Borrowed(_)),
                "{kept:?}"
            );
        }
        assert_eq!(printable("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
        assert_eq!(printable("one\r\ntwo\tthree"), "one\\r\\ntwo\\tthree");
        assert_eq!(printable("\u{7}\u{0}\u{7f}"), "\\u{7}\\0\\u{7f}");
        // C1 controls (U+009B is CSI on some terminals), bidi overrides, zero-width characters.
        assert_eq!(printable("\u{9b}31m"), "\\u{9b}31m");
        assert_eq!(printable("x\u{202e}y\u{200b}z"), "x\\u{202e}y\\u{200b}z");
        // A combining mark keeps its place even at the start.
        assert_eq!(printable("\u{301}a"), "\u{301}a");
    }
}
