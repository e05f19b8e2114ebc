//! Where `layertap bulk` puts a sample's file, and which recorded paths it will read.
//!
//! A plain-layout name is the id made safe for a file name and, after it, the xxh64 of the exact
//! id: ids that look alike once made safe (`a/b` and `a b`, ids that differ only past the first
//! characters kept or only in non-ASCII letters, an empty and a blank id) still get files of their
//! own. The manifest keeps the exact id and the file's path, and every reader goes by the path
//! recorded, so folders written with other names read as they are.
//!
//! A recorded path is read only when it stays inside the folder: relative, without `..`, and (for
//! the file itself) not a link that leads out of it.

use std::path::{Component, Path, PathBuf};

use crate::answer::checksum::xxh64_hex;
use crate::cli::BulkLayout;

use super::input::Sample;

/// Input rows per `shard-NNNNN` folder of the plain layout.
pub(super) const SHARD_SIZE: usize = 1000;

/// Characters of the id kept in its file name (the hash after them tells ids apart).
const STEM_CHARS: usize = 100;

/// The plain layout's file name for a sample id: its ASCII letters, digits, '-', '_' and '.' (any
/// other character as '_', at most [`STEM_CHARS`] of them, '_' first where it would start with
/// '.' or '-' or be empty), '-', and the xxh64 (seed 0) of the id's UTF-8 bytes in 16 hex digits.
pub(super) fn file_name(id: &str) -> String {
    let mut stem: String = id
        .chars()
        .take(STEM_CHARS)
        .map(|c| if c.is_ascii_alphanumeric() || "-_.".contains(c) { c } else { '_' })
        .collect();
    if stem.is_empty() || stem.starts_with(['.', '-']) {
        stem.insert(0, '_');
    }
    format!("{stem}-{}.safetensors", xxh64_hex([id.as_bytes()]))
}

/// Where a sample's file goes, relative to `--out`.
pub(super) fn relative_path(layout: BulkLayout, s: &Sample) -> PathBuf {
    match layout {
        BulkLayout::Plain => PathBuf::from(format!("shard-{:05}", s.index / SHARD_SIZE)).join(file_name(&s.id)),
        BulkLayout::Speculators => PathBuf::from(format!("hs_{}.safetensors", s.index)),
    }
}

/// A manifest's `file`, checked to name a path inside the folder: not empty, relative, and
/// without `..` (or a backslash, a separator elsewhere). The error says what is wrong.
pub(super) fn recorded_path(file: &str) -> Result<PathBuf, String> {
    let refuse =
        |why: &str| Err(format!("the manifest's path {file:?} {why}; layertap reads only files inside the folder"));
    if file.is_empty() {
        return refuse("is empty");
    }
    if file.contains('\\') || file.contains('\0') {
        return refuse("holds a backslash or a NUL");
    }
    let path = Path::new(file);
    let mut normal = false;
    for c in path.components() {
        match c {
            Component::Normal(_) => normal = true,
            Component::CurDir => {}
            Component::ParentDir => return refuse("goes up out of the folder (..)"),
            Component::RootDir | Component::Prefix(_) => return refuse("is absolute"),
        }
    }
    if !normal {
        return refuse("names no file");
    }
    Ok(path.to_path_buf())
}

/// The file a manifest's `file` names under `out`, checked as [`recorded_path`] does and, where
/// it exists, resolved through any links to be inside `out` still. `Ok` for a file that does not
/// exist (its reader reports it missing).
pub(super) fn file_inside(out: &Path, file: &str) -> Result<PathBuf, String> {
    let path = out.join(recorded_path(file)?);
    match (path.canonicalize(), out.canonicalize()) {
        (Ok(real), Ok(root)) if !real.starts_with(&root) => Err(format!(
            "the manifest's path {file:?} leads out of the folder (to {}, through a link); layertap reads only \
             files inside the folder",
            real.display()
        )),
        _ => Ok(path),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_alike_once_made_safe_get_names_of_their_own() {
        let long = "x".repeat(130);
        let ids = [
            "a/b".to_string(),
            "a b".into(),
            "a_b".into(),
            "é".into(),
            "è".into(),
            "日本".into(),
            "".into(),
            " ".into(),
            "_".into(),
            format!("{long}1"),
            format!("{long}2"),
            ".hidden".into(),
            "-flag".into(),
        ];
        let names: Vec<String> = ids.iter().map(|id| file_name(id)).collect();
        let distinct: std::collections::HashSet<String> = names.iter().map(|n| n.to_ascii_lowercase()).collect();
        assert_eq!(distinct.len(), ids.len(), "{names:?}");
        for n in &names {
            assert!(n.len() < 200 && !n.starts_with(['.', '-']) && !n.contains('/'), "{n}");
            assert!(n.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)), "{n}");
        }
        assert_eq!(file_name("a/b"), format!("a_b-{}.safetensors", xxh64_hex([b"a/b".as_slice()])));
    }

    #[test]
    fn recorded_paths_outside_the_folder_are_refused() {
        for ok in ["shard-00000/a.safetensors", "hs_3.safetensors", "./x.safetensors", "a..b.safetensors"] {
            assert!(recorded_path(ok).is_ok(), "{ok}");
        }
        for (bad, says) in [
            ("../x.safetensors", ".."),
            ("shard-00000/../../x", ".."),
            ("/etc/passwd", "absolute"),
            ("", "empty"),
            (".", "names no file"),
            ("..\\x", "backslash"),
        ] {
            let e = recorded_path(bad).unwrap_err();
            assert!(e.contains(says) && e.contains("inside the folder"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_link_out_of_the_folder_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        std::fs::create_dir_all(&out).unwrap();
        std::fs::write(dir.path().join("secret"), b"x").unwrap();
        std::os::unix::fs::symlink(dir.path().join("secret"), out.join("link.safetensors")).unwrap();
        std::fs::write(out.join("real.safetensors"), b"x").unwrap();
        let e = file_inside(&out, "link.safetensors").unwrap_err();
        assert!(e.contains("leads out of the folder"), "{e}");
        assert_eq!(file_inside(&out, "real.safetensors").unwrap(), out.join("real.safetensors"));
        assert_eq!(file_inside(&out, "missing.safetensors").unwrap(), out.join("missing.safetensors"));
    }
}
