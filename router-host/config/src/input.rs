//! Reading the files the CLI and `serve` are told to read (configs, scenarios, traces, tokenizer
//! files): regular files only, never more than a limit of them, and their structs as objects only.
//!
//! A FIFO nobody writes blocks `open` forever, a device or `/proc` file may never end, and a
//! directory fails only at the first read with an OS message that says nothing about the input.
//! So a path is refused, naming what it is, unless it is a regular file (after symlinks), and it
//! is opened with `O_NONBLOCK`: a file swapped for a FIFO between the check and the `open` cannot
//! block it, and the open file is checked again. Each caller names the file and its limit in its
//! own error type.

use std::fs::{File, FileType};
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use serde::de::Visitor;
use serde::Deserializer;

/// Why a file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// It could not be opened or read (missing, no permission, an I/O error).
    #[error("{0}")]
    Io(std::io::Error),
    /// It is not a regular file.
    #[error("not a regular file ({kind})")]
    NotAFile {
        /// What it is: `a FIFO`, `a directory`, `a character device`, ...
        kind: &'static str,
    },
    /// It holds more than the caller's limit.
    #[error("larger than {limit} bytes")]
    TooLarge {
        /// The limit in bytes.
        limit: u64,
    },
}

/// What a file that is not a regular file is, in words (`None` for a regular file).
pub fn kind_of(file_type: FileType) -> Option<&'static str> {
    if file_type.is_file() {
        None
    } else if file_type.is_dir() {
        Some("a directory")
    } else if file_type.is_fifo() {
        Some("a FIFO")
    } else if file_type.is_char_device() {
        Some("a character device")
    } else if file_type.is_block_device() {
        Some("a block device")
    } else if file_type.is_socket() {
        Some("a socket")
    } else {
        Some("an unknown kind of file")
    }
}

/// Opens `path` for reading if it is a regular file; never blocks on what it finds there.
pub fn open_regular(path: &Path) -> Result<File, InputError> {
    // Looked at before opening, so that a device is never opened at all.
    let meta = std::fs::metadata(path).map_err(InputError::Io)?;
    if let Some(kind) = kind_of(meta.file_type()) {
        return Err(InputError::NotAFile { kind });
    }
    // O_NONBLOCK: if the path became a FIFO since, `open` returns at once (reads of a regular
    // file ignore the flag).
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(InputError::Io)?;
    let meta = file.metadata().map_err(InputError::Io)?;
    if let Some(kind) = kind_of(meta.file_type()) {
        return Err(InputError::NotAFile { kind });
    }
    Ok(file)
}

/// The whole of the regular file at `path`, refused past `limit` bytes: at once when its size
/// says so, and without reading further when it grows (or, like `/proc` files, says 0) past it.
pub fn read_capped(path: &Path, limit: u64) -> Result<Vec<u8>, InputError> {
    let file = open_regular(path)?;
    if file.metadata().map_err(InputError::Io)?.len() > limit {
        return Err(InputError::TooLarge { limit });
    }
    let mut bytes = Vec::new();
    file.take(limit.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(InputError::Io)?;
    if u64::try_from(bytes.len()).map_or(true, |len| len > limit) {
        return Err(InputError::TooLarge { limit });
    }
    Ok(bytes)
}

/// A deserializer that reads a struct from a mapping only.
///
/// serde's derived `Deserialize` for a struct also takes a sequence of its fields in order, and
/// serde_json hands it one: `{"workers": [[1, 0, 2]]}` was read as a worker, positionally, and a
/// reordered or shortened array silently meant something else. Every struct read from a JSON file
/// is derived with `#[serde(remote = "Self")]` and gets its `Deserialize` from `objects_only!`,
/// which runs the derived code through this adapter: a sequence is then an `invalid type` error
/// in the struct's own `expecting` words, at its line and column.
pub struct StructAsMap<D>(pub D);

impl<'de, D: Deserializer<'de>> Deserializer<'de> for StructAsMap<D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_any(visitor)
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_map(visitor)
    }

    // The derived code asks for a struct only.
    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

/// `Deserialize` for each listed struct, which must derive it with `#[serde(remote = "Self")]`
/// (serde then writes the derived code as an inherent `deserialize`): that code run through
/// [`StructAsMap`], so the struct is read from a mapping only. A struct without the `remote`
/// attribute does not compile (two impls, or an endless instantiation).
#[macro_export]
macro_rules! objects_only {
    ($($ty:ty),+ $(,)?) => {$(
        impl<'de> ::serde::Deserialize<'de> for $ty {
            fn deserialize<D: ::serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                <$ty>::deserialize($crate::input::StructAsMap(d))
            }
        }
    )+};
}
pub use crate::objects_only;

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("router-host-input-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_fifo_a_directory_and_a_device_are_named_not_opened() {
        let dir = temp("kinds");
        let fifo = dir.join("fifo");
        let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        for (path, kind) in [
            (fifo.as_path(), "a FIFO"),
            (dir.as_path(), "a directory"),
            (Path::new("/dev/zero"), "a character device"),
        ] {
            match read_capped(path, 16) {
                Err(InputError::NotAFile { kind: found }) => assert_eq!(found, kind),
                other => panic!("{}: {other:?}", path.display()),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_regular_file_is_read_up_to_its_limit_and_refused_past_it() {
        let dir = temp("limit");
        let path = dir.join("f");
        std::fs::write(&path, b"0123456789").unwrap();
        assert_eq!(read_capped(&path, 10).unwrap(), b"0123456789");
        assert!(matches!(
            read_capped(&path, 9),
            Err(InputError::TooLarge { limit: 9 })
        ));
        assert!(matches!(
            read_capped(&dir.join("missing"), 9),
            Err(InputError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
