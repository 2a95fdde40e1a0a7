//! The tables' files (the database and its WAL) as this store makes them durable itself,
//! written back to the disk a step at a time.
//!
//! SQLite's own sync of a checkpoint handed the disk every page the quarter second's
//! transaction dirtied at once (~5 MB of WAL, then ~5 MB of the database), and every journal
//! fdatasync issued meanwhile (each acknowledged send waits on one) queued behind it: the
//! write-back throttle and the device's queue hold the lump, so sends answered in 4-13 ms
//! instead of 0.3-1 ms for the tens of milliseconds it took. Written back in steps of
//! [`STEP_BYTES`], each waited for before the next is started, each of the two threads that
//! sync the tables (the applier's checkpoints, the checkpointer) has at most one step in the
//! disk's queue, and the sync that follows finds little left to write but the file's
//! metadata. (The syncs SQLite still makes itself are rarer: at open and close, and the
//! writer's automatic checkpoint, a backstop.)

use pigeon_core::store::StoreError;
use std::fs::File;
use std::path::{Path, PathBuf};

/// Which of the tables' files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableFile {
    Database = 0,
    Wal = 1,
}

/// The most bytes of the tables' writes in the disk's queue at once.
const STEP_BYTES: u64 = 512 << 10;

pub fn wal_path(db: &Path) -> PathBuf {
    let mut p = db.as_os_str().to_owned();
    p.push("-wal");
    PathBuf::from(p)
}

/// The database file and its WAL, each through one descriptor held from its first sync on:
/// Linux reports a write-back error to every descriptor open when it happened, so an error
/// that SQLite's own sync met (and a writer's automatic checkpoint ignores) is seen here
/// too, which a descriptor opened afterwards would not.
pub struct TableFiles {
    paths: [PathBuf; 2],
    open: [Option<File>; 2],
    /// A sync failed: nothing is trusted to be durable again in this process.
    pub failed: bool,
}

impl TableFiles {
    pub fn new(db: &Path) -> Self {
        TableFiles {
            paths: [db.to_path_buf(), wal_path(db)],
            open: [None, None],
            failed: false,
        }
    }

    /// Makes everything both files hold durable.
    pub fn sync(&mut self) -> Result<(), StoreError> {
        self.sync_file(TableFile::Database, &|| false)?;
        self.sync_file(TableFile::Wal, &|| false)
    }

    /// Opens whichever of the files exist now, so that a write-back error of any later
    /// write is reported to this holder (a file opened later is opened at its first sync).
    pub fn open_existing(&mut self) {
        for which in [TableFile::Database, TableFile::Wal] {
            // An error here is met again, and reported, by the first sync.
            let _ = self.file(which);
        }
    }

    /// The open file `which`, opened now if need be; `None` if it is not made yet.
    fn file(&mut self, which: TableFile) -> Result<Option<&File>, StoreError> {
        let (path, file) = (&self.paths[which as usize], &mut self.open[which as usize]);
        if file.is_none() {
            match File::open(path) {
                Ok(f) => *file = Some(f),
                // Not made yet: it holds nothing to sync.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                Err(e) => {
                    return Err(StoreError::unavailable(format!(
                        "open {}: {e}",
                        path.display()
                    )));
                }
            }
        }
        Ok(file.as_ref())
    }

    /// Makes everything `which` holds durable, written back a step at a time until `hurry`
    /// says otherwise (someone waits for this sync: the rest goes in one, as SQLite's own
    /// sync would have sent it).
    pub fn sync_file(
        &mut self,
        which: TableFile,
        hurry: &dyn Fn() -> bool,
    ) -> Result<(), StoreError> {
        let path = self.paths[which as usize].clone();
        let Some(f) = self.file(which)? else {
            return Ok(());
        };
        #[cfg(test)]
        if test_failures::fails(&path) {
            return Err(StoreError::unavailable(format!(
                "sync {}: injected failure",
                path.display()
            )));
        }
        write_back_in_steps(f, hurry)
            .and_then(|()| f.sync_data())
            .map_err(|e| StoreError::unavailable(format!("sync {}: {e}", path.display())))
    }
}

/// Syncs made to fail, by path, for tests of what a failing disk leaves.
#[cfg(test)]
pub mod test_failures {
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;

    static FAILING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

    /// Every later sync of `path` fails.
    pub fn fail_syncs_of(path: &Path) {
        FAILING.lock().unwrap().push(path.to_path_buf());
    }

    pub(super) fn fails(path: &Path) -> bool {
        FAILING.lock().unwrap().iter().any(|p| p == path)
    }
}

/// Starts the write-back of `file`'s dirty pages [`STEP_BYTES`] at a time and waits for each
/// step before the next, until `hurry` (Linux; elsewhere the sync after it writes them all
/// at once).
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn write_back_in_steps(file: &File, hurry: &dyn Fn() -> bool) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let len = file.metadata()?.len();
    let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
        | libc::SYNC_FILE_RANGE_WRITE
        | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    let mut offset = 0;
    while offset < len && !hurry() {
        // SAFETY: sync_file_range takes a descriptor this `File` keeps open for the whole
        // call, and integers; it reads and writes no memory of this process.
        let r = unsafe {
            libc::sync_file_range(file.as_raw_fd(), offset as i64, STEP_BYTES as i64, flags)
        };
        if r != 0 {
            return Err(std::io::Error::last_os_error());
        }
        offset += STEP_BYTES;
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
fn write_back_in_steps(_file: &File, _hurry: &dyn Fn() -> bool) -> std::io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::temp_dir;
    use std::io::Write;

    /// Files not made yet hold nothing to sync; a file of several steps and a ragged end
    /// is written back whole, unchanged.
    #[test]
    fn both_files_sync_in_steps_and_keep_their_bytes() {
        let dir = temp_dir("table-files");
        let db = dir.join("pigeon.db");
        let mut files = TableFiles::new(&db);
        files.sync().unwrap();

        let bytes: Vec<u8> = (0..(3 * STEP_BYTES + 123))
            .map(|i| (i % 251) as u8)
            .collect();
        for path in [&db, &wal_path(&db)] {
            std::fs::File::create(path)
                .unwrap()
                .write_all(&bytes)
                .unwrap();
        }
        files.sync().unwrap();
        files.sync_file(TableFile::Wal, &|| true).unwrap();
        assert_eq!(std::fs::read(&db).unwrap(), bytes);
        assert_eq!(std::fs::read(wal_path(&db)).unwrap(), bytes);
        assert!(files.open.iter().all(Option::is_some), "each kept open");
        // One step per STEP_BYTES (four here, the last ragged), asking before each whether
        // to hurry; hurried (at the third ask), it stops stepping at once.
        #[cfg(target_os = "linux")]
        {
            let asked = std::cell::Cell::new(0);
            let count = || {
                asked.set(asked.get() + 1);
                false
            };
            files.sync_file(TableFile::Database, &count).unwrap();
            assert_eq!(asked.get(), 4);
            asked.set(0);
            let hurried = || {
                asked.set(asked.get() + 1);
                asked.get() > 2
            };
            files.sync_file(TableFile::Database, &hurried).unwrap();
            assert_eq!(asked.get(), 3);
        }
        std::fs::remove_dir_all(dir).unwrap();
    }
}
