//! The integration tests' scratch directories (`common::temp_dir`) are removed when their guard
//! drops: at the end of a test and while a failing test unwinds.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;

#[test]
fn the_directory_is_removed_when_the_guard_drops() {
    let dir = common::temp_dir("guard-drop");
    let file = common::write(&dir, "a.txt", "x");
    std::fs::create_dir_all(dir.join("sub/deeper")).unwrap();
    common::write(&dir.join("sub/deeper"), "b.txt", "y");
    let path: PathBuf = dir.to_path_buf();
    assert!(file.is_file() && path.is_dir());
    drop(dir);
    assert!(!path.exists(), "{} is left behind", path.display());
}

#[test]
fn the_directory_is_removed_when_the_test_panics() {
    let path = std::sync::Mutex::new(None);
    let result = std::panic::catch_unwind(|| {
        let dir = common::temp_dir("guard-panic");
        common::write(&dir, "a.txt", "x");
        *path.lock().unwrap() = Some(dir.to_path_buf());
        panic!("the test fails");
    });
    assert!(result.is_err());
    let path = path.into_inner().unwrap().expect("the closure ran");
    assert!(!path.exists(), "{} is left behind", path.display());
}

#[test]
fn a_directory_left_without_permissions_is_removed_too() {
    let dir = common::temp_dir("guard-modes");
    let locked = dir.join("locked");
    std::fs::create_dir_all(locked.join("inner")).unwrap();
    common::write(&locked.join("inner"), "c.txt", "z");
    for d in [locked.join("inner"), locked.clone()] {
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o000)).unwrap();
    }
    let path = dir.to_path_buf();
    drop(dir);
    assert!(!path.exists(), "{} is left behind", path.display());
}
