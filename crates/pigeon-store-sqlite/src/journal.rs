//! The journal: where a batch becomes durable. Each batch is appended as one record and
//! fsynced (a few KiB written at the end of a file), and only then acknowledged; the
//! SQLite tables are brought up to date from it afterwards, in larger transactions (see
//! `applier.rs`). A commit to SQLite writes every B-tree page the batch touched (a direct
//! message dirtied ~7 pages in a small batch), so making the tables the durable copy tied
//! the latency of every send to that cost; the journal ties it to one sequential write.
//!
//! Files: `journal/<first lsn, 20 digits>.journal`, each a segment starting with [`MAGIC`]
//! then records `[payload length u32][crc32 of lsn and payload u32][lsn u64][payload]`
//! (little-endian), lsns consecutive across segments. A segment is deleted once every record
//! in it is applied to SQLite durably. On open, a torn record at the end of the newest
//! segment (a crash mid-append: it was never acknowledged) is cut off; damage anywhere else
//! refuses to start, since acknowledged batches would be lost.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"PIGEONJ1";
const HEADER: usize = 16;
/// A new segment is started once the newest holds this much.
const SEGMENT_BYTES: u64 = 64 << 20;

/// One record read back at open: its lsn and payload.
pub type Record = (u64, Vec<u8>);

pub struct Journal {
    dir: PathBuf,
    sync: bool,
    /// Oldest first; the last is the one appended to.
    segments: Vec<Segment>,
    file: File,
    tail_len: u64,
    next_lsn: u64,
    /// An append failed and the file could not be cut back to its last whole record: any
    /// further record would follow garbage and be lost at the next open, so none is taken.
    poisoned: bool,
    /// Held locked while the journal is open: two stores on one directory would both append
    /// and both apply.
    _lock: File,
}

/// How long opening waits for another store on the same directory to close (a restart in
/// one process drops the old store while the new one opens).
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

fn lock_dir(dir: &Path) -> io::Result<File> {
    let path = dir.join("LOCK");
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)?;
    let deadline = std::time::Instant::now() + LOCK_WAIT;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(fs::TryLockError::WouldBlock) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            Err(fs::TryLockError::WouldBlock) => {
                return Err(io::Error::new(
                    io::ErrorKind::WouldBlock,
                    format!("{} is in use by another store", dir.display()),
                ));
            }
            Err(fs::TryLockError::Error(e)) => return Err(e),
        }
    }
}

struct Segment {
    first_lsn: u64,
    path: PathBuf,
}

fn damaged(path: &Path, why: impl std::fmt::Display) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("journal {} is damaged: {why}", path.display()),
    )
}

fn segment_path(dir: &Path, first_lsn: u64) -> PathBuf {
    dir.join(format!("{first_lsn:020}.journal"))
}

/// One record's bytes as written: room for the header, then the payload. The writer keeps
/// one and reuses it, so that a batch is encoded once, straight into the bytes written, with
/// no fresh allocation per batch.
pub struct RecordBuf(Vec<u8>);

impl Default for RecordBuf {
    /// An empty record: room for the header, no payload.
    fn default() -> Self {
        RecordBuf(vec![0; HEADER])
    }
}

impl RecordBuf {
    /// Capacity kept between records; a larger buffer (a huge batch) is given back.
    const KEEP: usize = 4 << 20;

    /// Empties the record for the next payload, written through [`io::Write`].
    pub fn clear(&mut self) {
        if self.0.capacity() > Self::KEEP {
            self.0 = Vec::new();
        }
        self.0.clear();
        self.0.resize(HEADER, 0);
    }

    pub fn payload(&self) -> &[u8] {
        &self.0[HEADER..]
    }
}

impl io::Write for RecordBuf {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn checksum(lsn: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&lsn.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// What stops a segment from reading to its end.
enum Problem {
    /// The last record runs past the end of the file, or its checksum fails and nothing
    /// follows it: a crash during its append, so it was never acknowledged.
    Torn(String),
    /// Anything else: acknowledged records may be unreadable.
    Damaged(String),
}

/// Reads a segment's records in order. Returns them and the length of its whole-record
/// prefix, and what stopped it before the end of the file, if anything.
fn read_segment(bytes: &[u8], mut expect_lsn: u64) -> (Vec<Record>, usize, Option<Problem>) {
    let mut out = Vec::new();
    if bytes.len() < MAGIC.len() && MAGIC.starts_with(bytes) {
        // A crash while the segment was being created.
        return (
            out,
            0,
            Some(Problem::Torn("a partial segment header".into())),
        );
    }
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return (out, 0, Some(Problem::Damaged("no segment header".into())));
    }
    let mut at = MAGIC.len();
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < HEADER {
            let why = format!("short record header at byte {at}");
            return (out, at, Some(Problem::Torn(why)));
        }
        let len = u32::from_le_bytes(rest[0..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(rest[4..8].try_into().expect("4 bytes"));
        let lsn = u64::from_le_bytes(rest[8..16].try_into().expect("8 bytes"));
        if rest.len() - HEADER < len {
            let why = format!("short record at byte {at}");
            return (out, at, Some(Problem::Torn(why)));
        }
        let payload = &rest[HEADER..HEADER + len];
        if checksum(lsn, payload) != crc {
            let why = format!("checksum mismatch at byte {at}");
            let last = rest.len() == HEADER + len;
            return (
                out,
                at,
                Some(if last {
                    Problem::Torn(why)
                } else {
                    Problem::Damaged(why)
                }),
            );
        }
        if lsn != expect_lsn {
            let why = format!("lsn {lsn} at byte {at} where {expect_lsn} was due");
            return (out, at, Some(Problem::Damaged(why)));
        }
        out.push((lsn, payload.to_vec()));
        expect_lsn += 1;
        at += HEADER + len;
    }
    (out, at, None)
}

impl Journal {
    /// Opens the journal in `dir` (creating it), cutting off a torn last record, and returns
    /// it with every record after `applied`, the last lsn the tables hold.
    pub fn open(dir: &Path, sync: bool, applied: u64) -> io::Result<(Journal, Vec<Record>)> {
        if !dir.exists() {
            fs::create_dir_all(dir)?;
            if sync && let Some(parent) = dir.parent() {
                // The new directory's name must survive a power loss, or its records would.
                File::open(parent)?.sync_all()?;
            }
        }
        let lock = lock_dir(dir)?;
        let mut segments = Vec::new();
        for entry in fs::read_dir(dir)? {
            let path = entry?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            let Some(stem) = name.strip_suffix(".journal") else {
                continue;
            };
            let Ok(first_lsn) = stem.parse::<u64>() else {
                tracing::warn!(file = %path.display(), "ignoring a file that is not a journal segment");
                continue;
            };
            segments.push(Segment { first_lsn, path });
        }
        segments.sort_by_key(|s| s.first_lsn);

        let mut pending = Vec::new();
        let mut next_lsn = applied + 1;
        let mut tail_len = 0;
        let count = segments.len();
        for (i, seg) in segments.iter().enumerate() {
            if i == 0 && seg.first_lsn > applied + 1 {
                return Err(damaged(
                    &seg.path,
                    format!(
                        "records {} to {} are missing (the tables hold up to {applied})",
                        applied + 1,
                        seg.first_lsn - 1
                    ),
                ));
            }
            // A gap is harmless where every record in it is applied (a crash between deleting
            // applied segments, or between starting a new one after them and deleting them).
            let gap_applied = seg.first_lsn > next_lsn && seg.first_lsn <= applied + 1;
            if i > 0 && seg.first_lsn != next_lsn && !gap_applied {
                return Err(damaged(
                    &seg.path,
                    format!("it starts at {} where {next_lsn} was due", seg.first_lsn),
                ));
            }
            let bytes = fs::read(&seg.path)?;
            let (records, whole, problem) = read_segment(&bytes, seg.first_lsn);
            let last = i + 1 == count;
            if let Some(problem) = problem {
                let why = match problem {
                    Problem::Torn(why) if last => why,
                    Problem::Torn(why) | Problem::Damaged(why) => {
                        return Err(damaged(&seg.path, why));
                    }
                };
                // A crash during the last append: that record was never acknowledged.
                tracing::warn!(journal = %seg.path.display(), %why, "cutting off a torn journal record");
                let f = OpenOptions::new().write(true).open(&seg.path)?;
                if whole < MAGIC.len() {
                    f.set_len(0)?;
                    (&f).write_all(MAGIC)?;
                } else {
                    f.set_len(whole as u64)?;
                }
                f.sync_all()?;
            }
            next_lsn = seg.first_lsn + records.len() as u64;
            tail_len = whole.max(MAGIC.len()) as u64;
            pending.extend(records.into_iter().filter(|(lsn, _)| *lsn > applied));
        }

        let mut journal = match segments.last() {
            Some(last) if next_lsn > applied => {
                let file = OpenOptions::new().append(true).open(&last.path)?;
                Journal {
                    dir: dir.to_path_buf(),
                    sync,
                    segments,
                    file,
                    tail_len,
                    next_lsn,
                    poisoned: false,
                    _lock: lock,
                }
            }
            _ => {
                // No journal yet, or every record in it is applied and the tables are ahead
                // (its segments were deleted after a crash): start after the tables, once the
                // old segments are gone (a gap before them would read as damage).
                for seg in segments.drain(..) {
                    fs::remove_file(&seg.path)?;
                }
                let first = applied + 1;
                let (file, seg) = Self::create_segment(dir, first, sync)?;
                segments.push(seg);
                Journal {
                    dir: dir.to_path_buf(),
                    sync,
                    segments,
                    file,
                    tail_len: MAGIC.len() as u64,
                    next_lsn: first,
                    poisoned: false,
                    _lock: lock,
                }
            }
        };
        journal.forget_through(applied)?;
        Ok((journal, pending))
    }

    fn create_segment(dir: &Path, first_lsn: u64, sync: bool) -> io::Result<(File, Segment)> {
        let path = segment_path(dir, first_lsn);
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(true)
            .write(true)
            .open(&path)?;
        file.write_all(MAGIC)?;
        if sync {
            file.sync_all()?;
            // The new name must survive a power loss too.
            File::open(dir)?.sync_all()?;
        }
        Ok((file, Segment { first_lsn, path }))
    }

    /// The directory the journal lives in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The lsn the next record gets.
    pub fn next_lsn(&self) -> u64 {
        self.next_lsn
    }

    /// Appends `payload` as the next record (see [`Journal::append_record`]).
    #[cfg(test)]
    pub fn append(&mut self, payload: &[u8]) -> io::Result<u64> {
        let mut record = RecordBuf::default();
        record.clear();
        record.0.extend_from_slice(payload);
        self.append_record(&mut record)
    }

    /// Appends `record` as the next record and, with `sync`, waits until it is on disk; its
    /// header is filled in here. Returns its lsn.
    pub fn append_record(&mut self, record: &mut RecordBuf) -> io::Result<u64> {
        if self.poisoned {
            return Err(io::Error::other(
                "the journal refused writes after a failed append",
            ));
        }
        let payload = record.payload();
        let len = u32::try_from(payload.len())
            .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "record too large"))?;
        if self.tail_len >= SEGMENT_BYTES {
            let (file, seg) = Self::create_segment(&self.dir, self.next_lsn, self.sync)?;
            self.file = file;
            self.segments.push(seg);
            self.tail_len = MAGIC.len() as u64;
        }
        let lsn = self.next_lsn;
        let crc = checksum(lsn, payload);
        let buf = &mut record.0;
        buf[0..4].copy_from_slice(&len.to_le_bytes());
        buf[4..8].copy_from_slice(&crc.to_le_bytes());
        buf[8..HEADER].copy_from_slice(&lsn.to_le_bytes());
        let written = self.file.write_all(buf).and_then(|()| {
            if self.sync {
                self.file.sync_data()
            } else {
                Ok(())
            }
        });
        if let Err(e) = written {
            // Cut the partial record off, or no later record could be read back.
            if self
                .file
                .set_len(self.tail_len)
                .and_then(|()| self.file.sync_all())
                .is_err()
            {
                self.poisoned = true;
            }
            return Err(e);
        }
        self.tail_len += buf.len() as u64;
        self.next_lsn += 1;
        Ok(lsn)
    }

    /// Deletes the segments whose every record is at most `applied` (the newest is kept).
    pub fn forget_through(&mut self, applied: u64) -> io::Result<()> {
        for path in self.detach_applied(applied) {
            fs::remove_file(path)?;
        }
        Ok(())
    }

    /// Lets go of the segments whose every record is at most `applied` (the newest is kept)
    /// and answers their paths, for the caller to delete outside any lock: unlinking a
    /// 64 MiB segment takes tens of milliseconds, which a commit waiting for the journal
    /// would wait too. (A segment left behind by a crash before its deletion holds only
    /// applied records: the next open deletes it.)
    pub fn detach_applied(&mut self, applied: u64) -> Vec<PathBuf> {
        let mut done = Vec::new();
        while self.segments.len() > 1 && self.segments[1].first_lsn <= applied + 1 {
            done.push(self.segments.remove(0).path);
        }
        done
    }

    /// The next append starts a new segment (tests: a segment is 64 MiB).
    #[cfg(test)]
    pub(crate) fn end_segment(&mut self) {
        self.tail_len = SEGMENT_BYTES;
    }

    #[cfg(test)]
    fn segment_count(&self) -> usize {
        self.segments.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::temp_dir;

    /// A journal in `dir` holding "one" (lsn 1) and "two" (lsn 2), each in its own segment.
    fn two_segments(dir: &Path) -> Journal {
        let (mut j, _) = Journal::open(dir, true, 0).unwrap();
        j.append(b"one").unwrap();
        // Force a second segment.
        j.tail_len = SEGMENT_BYTES;
        j.append(b"two").unwrap();
        assert_eq!(j.segment_count(), 2);
        j
    }

    #[test]
    fn records_come_back_after_the_applied_lsn_in_order() {
        let dir = temp_dir("order");
        let (mut j, pending) = Journal::open(&dir, true, 0).unwrap();
        assert!(pending.is_empty());
        for i in 1..=5u64 {
            assert_eq!(j.append(format!("batch {i}").as_bytes()).unwrap(), i);
        }
        drop(j);
        let (j, pending) = Journal::open(&dir, true, 2).unwrap();
        let got: Vec<_> = pending
            .iter()
            .map(|(l, p)| (*l, String::from_utf8(p.clone()).unwrap()))
            .collect();
        assert_eq!(
            got,
            vec![
                (3, "batch 3".to_string()),
                (4, "batch 4".to_string()),
                (5, "batch 5".to_string())
            ]
        );
        assert_eq!(j.next_lsn(), 6);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_reused_record_buffer_writes_each_payload_whole_and_alone() {
        use std::io::Write;
        let dir = temp_dir("reuse");
        let (mut j, _) = Journal::open(&dir, true, 0).unwrap();
        let mut rec = RecordBuf::default();
        let payloads = [
            vec![b'x'; 5000],
            b"short".to_vec(),
            Vec::new(),
            vec![b'y'; 70],
        ];
        for (i, p) in payloads.iter().enumerate() {
            rec.clear();
            rec.write_all(p).unwrap();
            assert_eq!(j.append_record(&mut rec).unwrap(), i as u64 + 1);
        }
        drop(j);
        let (_, pending) = Journal::open(&dir, true, 0).unwrap();
        let want: Vec<(u64, Vec<u8>)> = payloads
            .iter()
            .enumerate()
            .map(|(i, p)| (i as u64 + 1, p.clone()))
            .collect();
        assert_eq!(pending, want);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_torn_last_record_is_cut_off_and_appends_go_on_after_it() {
        let dir = temp_dir("torn");
        let (mut j, _) = Journal::open(&dir, true, 0).unwrap();
        j.append(b"one").unwrap();
        j.append(b"two").unwrap();
        drop(j);
        let seg = segment_path(&dir, 1);
        let len = fs::metadata(&seg).unwrap().len();
        // A crash in the middle of the second record's write.
        OpenOptions::new()
            .write(true)
            .open(&seg)
            .unwrap()
            .set_len(len - 2)
            .unwrap();
        let (mut j, pending) = Journal::open(&dir, true, 0).unwrap();
        assert_eq!(pending, vec![(1, b"one".to_vec())]);
        assert_eq!(j.append(b"three").unwrap(), 2);
        drop(j);
        let (_, pending) = Journal::open(&dir, true, 0).unwrap();
        assert_eq!(pending, vec![(1, b"one".to_vec()), (2, b"three".to_vec())]);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn damage_inside_the_newest_segment_refuses_to_open_and_a_partial_header_does_not() {
        let dir = temp_dir("inner");
        let (mut j, _) = Journal::open(&dir, true, 0).unwrap();
        for p in [b"one", b"two", b"six"] {
            j.append(p).unwrap();
        }
        drop(j);
        let seg = segment_path(&dir, 1);
        let mut bytes = fs::read(&seg).unwrap();
        // The first record's payload: records after it were acknowledged.
        bytes[MAGIC.len() + HEADER] ^= 0xff;
        fs::write(&seg, &bytes).unwrap();
        let err = Journal::open(&dir, true, 0).err().expect("must refuse");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // A crash while a new segment was created leaves part of its header: not damage.
        fs::write(&seg, &MAGIC[..3]).unwrap();
        let (mut j, pending) = Journal::open(&dir, true, 0).unwrap();
        assert!(pending.is_empty());
        assert_eq!(j.append(b"seven").unwrap(), 1);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_second_journal_on_one_directory_waits_for_the_first() {
        let dir = temp_dir("lock");
        let (first, _) = Journal::open(&dir, true, 0).unwrap();
        let opened = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let second = {
            let (dir, opened) = (dir.clone(), opened.clone());
            std::thread::spawn(move || {
                let j = Journal::open(&dir, true, 0).unwrap();
                opened.store(true, std::sync::atomic::Ordering::SeqCst);
                j
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(300));
        assert!(!opened.load(std::sync::atomic::Ordering::SeqCst));
        drop(first);
        let (j, _) = second.join().unwrap();
        assert_eq!(j.next_lsn(), 1);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn damage_before_the_last_segment_refuses_to_open() {
        let dir = temp_dir("damage");
        drop(two_segments(&dir));
        let seg = segment_path(&dir, 1);
        let mut bytes = fs::read(&seg).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        fs::write(&seg, bytes).unwrap();
        let err = Journal::open(&dir, true, 0).err().expect("must refuse");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn applied_segments_are_deleted_and_a_gap_before_the_journal_refuses_to_open() {
        let dir = temp_dir("forget");
        let mut j = two_segments(&dir);
        j.forget_through(0).unwrap();
        assert_eq!(j.segment_count(), 2, "record 1 is not applied yet");
        j.forget_through(1).unwrap();
        assert_eq!(j.segment_count(), 1);
        assert!(!segment_path(&dir, 1).exists());
        drop(j);
        // The tables say only record 0 is applied, but record 1 is gone: refuse.
        let err = Journal::open(&dir, true, 0).err().expect("must refuse");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        let (_, pending) = Journal::open(&dir, true, 1).unwrap();
        assert_eq!(pending, vec![(2, b"two".to_vec())]);
        fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_detached_segment_left_by_a_crash_before_its_deletion_is_deleted_at_open() {
        let dir = temp_dir("detach");
        let mut j = two_segments(&dir);
        assert!(
            j.detach_applied(0).is_empty(),
            "record 1 is not applied yet"
        );
        assert_eq!(j.detach_applied(1), vec![segment_path(&dir, 1)]);
        assert_eq!(j.segment_count(), 1);
        // The process dies before it deletes the detached segment.
        drop(j);
        assert!(segment_path(&dir, 1).exists());
        let (mut j, pending) = Journal::open(&dir, true, 1).unwrap();
        assert_eq!(pending, vec![(2, b"two".to_vec())]);
        assert!(!segment_path(&dir, 1).exists());
        assert_eq!(j.append(b"three").unwrap(), 3);
        fs::remove_dir_all(dir).unwrap();
    }
}
