//! Spare segments: the next journal segment, laid down ahead of time as zeros on the disk.
//!
//! A record appended at the end of a file grows it, so its `fdatasync` has the file system
//! write the inode (the new size) and, on ext4 without a journal, the block bitmaps of the
//! blocks just allocated, each a synchronous write of its own after the data. A record
//! written over blocks that already hold zeros, inside the file's length, changes no
//! metadata a data sync must keep: the sync writes the record's pages and nothing else. (So
//! PostgreSQL fills each WAL segment with zeros before it uses it.) On this project's disk,
//! 64 KiB synced every 3 ms beside a writer of 80 MB/s: syncs over 5 ms fell from 25-36 to
//! 6-12 in 8 s, p99 from 5.3-5.8 to 3.7-4.5 ms (BENCHMARKS.md, twelfth session).
//!
//! One thread (`pigeon-journal-spare`, background work for the scheduler) lays a spare down
//! when the journal asks: [`MAGIC`] then zeros, written back a step at a time so that the
//! journal's own syncs never queue behind the whole file, then synced with its metadata. The
//! journal renames it into place when it starts a segment; until one is ready it starts a
//! segment that grows as before, and moves to the spare as soon as it is ready.

use super::MAGIC;
use crate::table_files::{STEP_BYTES, write_back};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

/// The spare's name in the journal's directory (not a segment's: open never reads it).
pub const SPARE_NAME: &str = "next-segment.spare";

/// How long the thread rests after a spare failed before it may be asked again.
const AFTER_FAILURE: Duration = Duration::from_secs(1);

const IDLE: u8 = 0;
const LAYING: u8 = 1;
const READY: u8 = 2;

struct Shared {
    /// `IDLE`, `LAYING` (asked, not ready) or `READY` (in `ready`).
    state: AtomicU8,
    ready: Mutex<Option<File>>,
    /// The journal is closing: a spare half laid down is given up.
    stop: AtomicBool,
}

pub struct Spares {
    path: PathBuf,
    /// The spare's length: [`MAGIC`] and zeros.
    bytes: u64,
    shared: Arc<Shared>,
    asks: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Spares {
    /// Starts the thread for the journal in `dir`; a spare left by an earlier process (it
    /// may be half laid down) is removed first.
    pub fn start(dir: &Path, bytes: u64) -> io::Result<Spares> {
        let path = dir.join(SPARE_NAME);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let shared = Arc::new(Shared {
            state: AtomicU8::new(IDLE),
            ready: Mutex::new(None),
            stop: AtomicBool::new(false),
        });
        let (asks, asked) = mpsc::channel::<()>();
        let thread = {
            let (path, shared) = (path.clone(), shared.clone());
            std::thread::Builder::new()
                .name("pigeon-journal-spare".into())
                .spawn(move || {
                    crate::background::run_as_batch_work();
                    for () in asked {
                        let began = std::time::Instant::now();
                        match lay_down(&path, bytes, &shared.stop) {
                            Ok(file) => {
                                *shared.ready.lock().expect("spare lock") = Some(file);
                                shared.state.store(READY, Ordering::Release);
                                tracing::debug!(took = ?began.elapsed(), "a spare journal segment is laid down");
                            }
                            Err(_) if shared.stop.load(Ordering::Relaxed) => break,
                            Err(e) => {
                                tracing::warn!(error = %e, spare = %path.display(), "laying down a spare journal segment failed; segments grow as they are written");
                                std::thread::sleep(AFTER_FAILURE);
                                shared.state.store(IDLE, Ordering::Release);
                            }
                        }
                    }
                })?
        };
        Ok(Spares {
            path,
            bytes,
            shared,
            asks: Some(asks),
            thread: Some(thread),
        })
    }

    /// Asks for a spare, unless one is ready or being laid down.
    pub fn ask(&self) {
        let state = &self.shared.state;
        if state.load(Ordering::Relaxed) == IDLE
            && state
                .compare_exchange(IDLE, LAYING, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
            && let Some(asks) = &self.asks
        {
            // The thread is gone only if it panicked: segments then grow.
            let _ = asks.send(());
        }
    }

    /// Whether a spare is ready to be taken.
    pub fn ready(&self) -> bool {
        self.shared.state.load(Ordering::Acquire) == READY
    }

    /// Moves the ready spare to `to` and answers it, open for writing, with its length;
    /// `None` if none is ready. The rename is durable before this answers.
    pub fn take_as(&self, to: &Path) -> io::Result<Option<(File, u64)>> {
        if !self.ready() {
            return Ok(None);
        }
        let Some(file) = self.shared.ready.lock().expect("spare lock").take() else {
            return Ok(None);
        };
        self.shared.state.store(IDLE, Ordering::Release);
        let began = std::time::Instant::now();
        std::fs::rename(&self.path, to)?;
        // Records written to it from now on must be found under its new name after a crash.
        File::open(to.parent().unwrap_or(Path::new(".")))?.sync_all()?;
        tracing::debug!(segment = %to.display(), took = ?began.elapsed(), "the spare journal segment is in use");
        Ok(Some((file, self.bytes)))
    }
}

impl Drop for Spares {
    /// Stops the thread (a spare half laid down is given up) and removes the spare: the
    /// directory is another store's once the journal is closed.
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.asks.take();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the journal's spare thread panicked");
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Writes `bytes` of [`MAGIC`] then zeros to a new file at `path`, a step at a time, and
/// syncs it with its metadata (its length and blocks: what a record's data sync then
/// leaves alone).
fn lay_down(path: &Path, bytes: u64, stop: &AtomicBool) -> io::Result<File> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(path)?;
    let mut step = vec![0u8; STEP_BYTES as usize];
    step[..MAGIC.len()].copy_from_slice(MAGIC);
    let mut at = 0;
    while at < bytes {
        if stop.load(Ordering::Relaxed) {
            return Err(io::Error::new(
                io::ErrorKind::Interrupted,
                "the journal closed",
            ));
        }
        let n = (bytes - at).min(STEP_BYTES);
        file.write_all_at(&step[..n as usize], at)?;
        if at == 0 {
            step[..MAGIC.len()].fill(0);
        }
        write_back(&file, at, n)?;
        at += n;
    }
    file.sync_all()?;
    Ok(file)
}
