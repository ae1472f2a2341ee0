//! Step 3, with a `sha256`: the sealed in-memory copy that is hashed and then mapped, so the
//! bytes checked are the bytes that run.

use std::path::Path;

use super::LoadError;

/// Hash `file` from its start and compare with `expected`; returns the hash.
pub(super) fn check_sha256(
    path: &Path,
    file: &std::fs::File,
    expected: &str,
) -> Result<String, LoadError> {
    let actual = sha256_hex(file).map_err(|e| LoadError::Unreadable {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    if !actual.eq_ignore_ascii_case(expected) {
        return Err(LoadError::HashMismatch {
            path: path.to_path_buf(),
            expected: expected.to_ascii_lowercase(),
            actual,
        });
    }
    Ok(actual)
}

/// Longest memfd name Linux accepts (249 bytes plus the NUL).
const MEMFD_NAME_MAX: usize = 249;

/// Copy the open plugin `file` (`path`, for messages) into an anonymous memory file and seal it
/// against every change (`F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL`), so what is
/// hashed afterwards is what `dlopen` maps. The copy is positioned at its start.
///
/// At most the file's size when it was opened is copied, so a file that keeps growing cannot keep
/// the loader reading; a file changed during the copy only gives a copy whose hash mismatches.
pub(super) fn sealed_copy(path: &Path, file: &std::fs::File) -> Result<std::fs::File, LoadError> {
    use std::io::{Read, Seek, SeekFrom};
    use std::os::fd::{AsRawFd, FromRawFd};
    let fail = |what: &str, e: std::io::Error| LoadError::Unreadable {
        path: path.to_path_buf(),
        message: format!(
            "cannot make the sealed in-memory copy checked against `sha256`: {what}: {e}"
        ),
    };
    // Named after the file, so /proc/PID/maps shows `/memfd:libNAME.so (deleted)`.
    let mut name: Vec<u8> = path
        .file_name()
        .map(|n| std::os::unix::ffi::OsStrExt::as_bytes(n).to_vec())
        .unwrap_or_else(|| b"plugin".to_vec());
    name.truncate(MEMFD_NAME_MAX);
    // A file name holds no NUL byte.
    let name = std::ffi::CString::new(name).map_err(|e| fail("memfd name", e.into()))?;
    let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
    // Ask for an executable memfd explicitly (`vm.memfd_noexec = 1` makes non-executable the
    // default); kernels before 6.3 do not know MFD_EXEC, refuse it with EINVAL, and make every
    // memfd executable.
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call; the flags are
    // valid memfd_create flags. The return value is checked below.
    let mut fd = unsafe { libc::memfd_create(name.as_ptr(), flags | libc::MFD_EXEC) };
    if fd < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINVAL) {
        // SAFETY: as above.
        fd = unsafe { libc::memfd_create(name.as_ptr(), flags) };
    }
    if fd < 0 {
        return Err(fail("memfd_create", std::io::Error::last_os_error()));
    }
    // SAFETY: `fd` was just returned by memfd_create (checked non-negative) and nothing else
    // owns it; the `File` closes it.
    let mut copy = unsafe { std::fs::File::from_raw_fd(fd) };
    let len = file
        .metadata()
        .map_err(|e| fail("reading the file's size", e))?
        .len();
    let mut source = file;
    source
        .seek(SeekFrom::Start(0))
        .map_err(|e| fail("rewinding the file", e))?;
    std::io::copy(&mut source.take(len), &mut copy).map_err(|e| fail("copying the file", e))?;
    let seals = libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
    // SAFETY: `copy` owns a valid memfd created with MFD_ALLOW_SEALING; F_ADD_SEALS takes an
    // int argument and does not touch memory. The return value is checked below.
    if unsafe { libc::fcntl(copy.as_raw_fd(), libc::F_ADD_SEALS, seals) } < 0 {
        return Err(fail(
            "sealing it (F_ADD_SEALS)",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: as above; F_GET_SEALS takes no argument. The return value is checked below.
    let got = unsafe { libc::fcntl(copy.as_raw_fd(), libc::F_GET_SEALS) };
    if got < 0 {
        return Err(fail(
            "reading its seals (F_GET_SEALS)",
            std::io::Error::last_os_error(),
        ));
    }
    if got & seals != seals {
        return Err(fail(
            "sealing it",
            std::io::Error::other(format!("seals {got:#x} lack {:#x}", seals & !got)),
        ));
    }
    copy.seek(SeekFrom::Start(0))
        .map_err(|e| fail("rewinding the copy", e))?;
    Ok(copy)
}

/// Lowercase hex SHA-256 of a file's contents.
pub fn sha256_hex(mut file: &std::fs::File) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut hasher = Sha256::new();
    let mut buf = [0u8; 64 * 1024];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}
