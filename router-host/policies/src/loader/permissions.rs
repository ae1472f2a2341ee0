//! Step 3: refuse a plugin file that someone other than the running user or root could have
//! written or swapped (docs/reliability.md, "Plugin file checks").

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use super::{LoadError, PermissionBypass};

/// Most symlinks followed while checking one path (Linux's own limit).
const MAX_SYMLINKS: usize = 40;

/// Refuse a file that someone other than us or root could have written, or swapped for another
/// by renaming an entry on the way to it (OpenSSH's StrictModes, with symlinks followed).
///
/// The file (through its open descriptor) must not be writable by group or others. Then `path`
/// is walked from `/` one name at a time, following symlinks the way the kernel does: every
/// directory a name is looked up in (so the directories of the path as given, of each symlink,
/// and of the resolved target, up to `/`) must not be writable by group or others unless it has
/// the sticky bit, and every directory, symlink and the file must be owned by the running user
/// or root. The sticky exception (`/tmp`, mode 1777) is sound because of the ownership rule: in
/// a sticky directory only an entry's owner (or the directory's owner, or root) can rename or
/// remove it, and every entry looked up is owned by us or root, as is the directory itself;
/// the one thing another user could have done there, create the name first as a hard link to a
/// file of ours or root's, is refused by [`check_not_planted`] (docs/reliability.md, "The sticky
/// rule"). The walk must end at the file that was opened (same device and inode). A refusal
/// names `bypass`, the way to skip these checks in the command that is loading the file.
pub(super) fn check_permissions(
    path: &Path,
    file: &std::fs::File,
    bypass: PermissionBypass,
) -> Result<(), LoadError> {
    let unreadable = |e: std::io::Error| LoadError::Unreadable {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let refuse = |problem: String| LoadError::InsecurePermissions {
        path: path.to_path_buf(),
        problem,
        bypass,
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let meta = file.metadata().map_err(unreadable)?;
    let shown = path.display();
    check_entry(&format!("the file ({shown})"), path, &meta, me, false).map_err(refuse)?;
    let reached = walk_checked(path, me).map_err(|e| match e {
        WalkError::Io(e) => unreadable(e),
        WalkError::Refused(problem) => refuse(problem),
    })?;
    if (reached.dev(), reached.ino()) != (meta.dev(), meta.ino()) {
        return Err(refuse(format!(
            "{shown} changed while its path was checked (it no longer names the opened file)"
        )));
    }
    Ok(())
}

enum WalkError {
    Io(std::io::Error),
    Refused(String),
}

impl From<std::io::Error> for WalkError {
    fn from(e: std::io::Error) -> Self {
        WalkError::Io(e)
    }
}

/// Walks `path` from `/` (see [`check_permissions`]), checking each directory before a name is
/// looked up in it and each symlink before it is followed; returns what the path names.
fn walk_checked(path: &Path, me: u32) -> Result<std::fs::Metadata, WalkError> {
    use std::path::Component;
    let absolute = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()?.join(path)
    };
    // Names still to look up, the next one last.
    let mut pending: Vec<std::ffi::OsString> = Vec::new();
    let push = |pending: &mut Vec<std::ffi::OsString>, p: &Path| {
        for component in p.components().rev() {
            match component {
                Component::Normal(name) => pending.push(name.to_os_string()),
                Component::ParentDir => pending.push("..".into()),
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            }
        }
    };
    push(&mut pending, &absolute);
    // Always a real directory path (no symlinks), so `..` is its parent.
    let mut dir = PathBuf::from("/");
    let mut dir_meta = std::fs::symlink_metadata(&dir)?;
    let mut links = 0;
    while let Some(name) = pending.pop() {
        if name == ".." {
            dir.pop();
            dir_meta = std::fs::symlink_metadata(&dir)?;
            continue;
        }
        let next = dir.join(&name);
        let meta = std::fs::symlink_metadata(&next)?;
        let shown = dir.display();
        if meta.file_type().is_symlink() {
            let what = format!(
                "the directory ({shown}) holding the symlink {}",
                next.display()
            );
            check_entry(&what, &dir, &dir_meta, me, true).map_err(WalkError::Refused)?;
            let what = format!("the symlink ({})", next.display());
            check_entry(&what, &next, &meta, me, false).map_err(WalkError::Refused)?;
            check_not_planted(&what, &dir, &dir_meta, &meta).map_err(WalkError::Refused)?;
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(WalkError::Io(std::io::Error::other(format!(
                    "more than {MAX_SYMLINKS} symlinks on the way to {}",
                    path.display()
                ))));
            }
            let target = std::fs::read_link(&next)?;
            if target.is_absolute() {
                dir = PathBuf::from("/");
                dir_meta = std::fs::symlink_metadata(&dir)?;
            }
            push(&mut pending, &target);
            continue;
        }
        let what = if pending.is_empty() {
            format!("its directory ({shown})")
        } else {
            format!("the directory {shown} on the way to it")
        };
        check_entry(&what, &dir, &dir_meta, me, true).map_err(WalkError::Refused)?;
        if pending.is_empty() {
            let what = format!("the file ({})", next.display());
            check_not_planted(&what, &dir, &dir_meta, &meta).map_err(WalkError::Refused)?;
            return Ok(meta);
        }
        dir = next;
        dir_meta = meta;
    }
    // The path ended in `..` or named `/`: not the file that was opened.
    Ok(dir_meta)
}

/// The ownership and mode rules for one entry; `what` describes it, `path` is what to chmod.
fn check_entry(
    what: &str,
    path: &Path,
    meta: &std::fs::Metadata,
    me: u32,
    directory: bool,
) -> Result<(), String> {
    let mode = meta.mode() & 0o7777;
    let uid = meta.uid();
    let shown = path.display();
    let symlink = meta.file_type().is_symlink();
    if uid != me && uid != 0 {
        let fix = if symlink {
            // `chown` without `-h` would change the file the symlink points to.
            format!("`chown -h {me} {shown}`, or configure the file it points to instead")
        } else if directory {
            format!(
                "`chown {me} {shown}`, or move the plugin to a directory only you (and root) \
                 can write"
            )
        } else {
            format!(
                "`chown {me} {shown}`, or copy it (`cp`) to a directory only you (and root) \
                 can write: the copy is yours"
            )
        };
        return Err(format!(
            "{what} is owned by uid {uid}, not by the running user (uid {me}) or root (mode \
             {mode:o}); fix: {fix}"
        ));
    }
    // A symlink's own mode means nothing (and is 777).
    if symlink {
        return Ok(());
    }
    let sticky = mode & 0o1000 != 0;
    if mode & 0o022 != 0 && !(directory && sticky) {
        let fix = if directory {
            format!(
                "`chmod go-w {shown}`, or move the plugin to a directory only you (and root) can \
                 write (a directory others can write is accepted only if it is sticky, mode \
                 1777 like /tmp: see docs/reliability.md, Plugin file checks)"
            )
        } else {
            format!("`chmod go-w {shown}`")
        };
        return Err(format!(
            "{what} is writable by group or others (mode {mode:o}) and owned by uid {uid}; fix: \
             {fix}"
        ));
    }
    Ok(())
}

/// In a sticky directory that others can write (`/tmp`), nobody else can rename or remove our
/// entries, but anyone could have created the name first as a hard link to a file that belongs
/// to us or root (another plugin, an old build, any root-owned library), which passes every
/// ownership and mode check. A file we put there ourselves has one link; refuse a file or
/// symlink with more. `what` describes the entry (`meta`), found in `dir` (`dir_meta`).
fn check_not_planted(
    what: &str,
    dir: &Path,
    dir_meta: &std::fs::Metadata,
    meta: &std::fs::Metadata,
) -> Result<(), String> {
    let shared = dir_meta.mode() & 0o022 != 0;
    if !shared || meta.is_dir() || meta.nlink() <= 1 {
        return Ok(());
    }
    Err(format!(
        "{what} has {} hard links and is in {}, a sticky directory that others can write \
         (mode {:o}): anyone who can write there could have made that name a hard link to a \
         file of yours or root's; fix: move the plugin to a directory only you (and root) can \
         write, or give it a copy of its own there (`cp`, not `ln`)",
        meta.nlink(),
        dir.display(),
        dir_meta.mode() & 0o7777
    ))
}
