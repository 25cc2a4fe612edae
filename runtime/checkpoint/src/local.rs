//! Local files written under a memory limit: restored copies of state files, spilled full
//! images, a restore's sorted runs; and checkpoint files written past the page cache.
//!
//! Under a cgroup v1 memory limit, dirty page-cache pages count against the limit until they
//! are written back, and nothing throttles the writer before the OOM killer acts: a file larger
//! than the limit, written without syncs, gets its process killed. [`SyncedWriter`] syncs as it
//! writes.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// The block size direct writes are aligned to (the largest logical block size in use).
const DIRECT_ALIGN: usize = 4096;

/// Direct writes go through an aligned buffer of this size (one per writing thread, kept).
const DIRECT_CHUNK: usize = 256 << 10;

thread_local! {
    /// Each thread's buffer for direct writes, reused: it stays in memory the thread touched.
    static DIRECT_BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Writes `data` to a new file at `path` (it must not exist), past the page cache when the
/// filesystem allows it (`O_DIRECT`), and syncs it.
///
/// A checkpoint file is written once and read only by a restore. Written through the page cache,
/// every byte is copied into a page the kernel allocates for it: on a virtual machine whose free
/// memory is handed back to its host, that copy was most of the CPU a checkpoint cost outside
/// the task threads (about 8 ns per byte, against 0.2 written directly). The data goes through
/// an aligned buffer of 256 KiB that the calling thread reuses; the last block is padded and the
/// file truncated to its length. A filesystem that refuses direct I/O (tmpfs) gets an ordinary
/// write.
pub fn write_file_direct(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let direct = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32)
        .open(path);
    let file = match direct {
        Ok(file) => file,
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
            // Before Linux 6.6 tmpfs refuses O_DIRECT only after creating the file; with
            // O_EXCL an existing file would have failed first, so this one is ours.
            let _ = std::fs::remove_file(path);
            return write_file_buffered(path, data);
        }
        Err(e) => return Err(e),
    };
    match write_direct(&file, data) {
        Ok(()) => file.sync_all(),
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error()) => {
            drop(file);
            std::fs::remove_file(path)?;
            write_file_buffered(path, data)
        }
        Err(e) => Err(e),
    }
}

fn write_file_buffered(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).open(path)?;
    file.write_all(data)?;
    file.sync_all()
}

fn write_direct(mut file: &File, data: &[u8]) -> std::io::Result<()> {
    DIRECT_BUFFER.with(|buffer| {
        let mut buffer = buffer.borrow_mut();
        if buffer.len() < DIRECT_CHUNK + DIRECT_ALIGN {
            buffer.resize(DIRECT_CHUNK + DIRECT_ALIGN, 0);
        }
        let start = buffer.as_ptr().align_offset(DIRECT_ALIGN);
        let aligned = &mut buffer[start..start + DIRECT_CHUNK];
        for part in data.chunks(DIRECT_CHUNK) {
            aligned[..part.len()].copy_from_slice(part);
            // The last part is padded to a whole block; the file is cut to its length below.
            let padded = part.len().next_multiple_of(DIRECT_ALIGN);
            aligned[part.len()..padded].fill(0);
            file.write_all(&aligned[..padded])?;
        }
        file.set_len(data.len() as u64)
    })
}

/// The digest (length, CRC-32C, last bytes) of a local file, read in 1 MiB parts.
pub fn file_digest(path: &Path) -> std::io::Result<crate::FileDigest> {
    use std::io::Read;
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut digest = crate::FileDigest::default();
    loop {
        match file.read(&mut buf) {
            Ok(0) => return Ok(digest),
            Ok(n) => digest.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Whether a file name is a staging file's: `<name>#<digits>`, as [`crate::Storage::put`] and
/// `object_store`'s local filesystem name a file before renaming it to its object's name. The
/// rule is `object_store`'s for the files its listings leave out (everything after the first
/// `#` is digits), so that no file a listing shows as an object is ever taken for one.
pub fn is_staging_name(name: &str) -> bool {
    match name.split_once('#') {
        Some((object, digits)) => {
            !object.is_empty() && !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
        }
        None => false,
    }
}

/// Deletes the staging files ([`is_staging_name`]) under `dir`, at any depth, that nobody has
/// written for `idle`: a writer killed between writing one and renaming it leaves it behind, and
/// no listing shows it. A staging file written more recently may still be some writer's and is
/// left. Files that vanish during the walk (retention deletes directories) are skipped. Returns
/// how many files were deleted.
pub fn remove_abandoned_staging(dir: &Path, idle: std::time::Duration) -> std::io::Result<usize> {
    let now = std::time::SystemTime::now();
    let mut removed = 0;
    let mut dirs = vec![dir.to_path_buf()];
    while let Some(d) = dirs.pop() {
        let entries = match std::fs::read_dir(&d) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        for entry in entries {
            let entry = match entry {
                Ok(entry) => entry,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            // Not followed through symbolic links: only what lies under `dir`.
            let Ok(kind) = entry.file_type() else { continue };
            if kind.is_dir() {
                dirs.push(entry.path());
                continue;
            }
            if !kind.is_file() || !entry.file_name().to_str().is_some_and(is_staging_name) {
                continue;
            }
            let Ok(modified) = entry.metadata().and_then(|m| m.modified()) else { continue };
            if now.duration_since(modified).is_ok_and(|age| age >= idle) {
                match std::fs::remove_file(entry.path()) {
                    Ok(()) => removed += 1,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }
    Ok(removed)
}

/// A file is synced every this many bytes written.
pub const SYNC_EVERY_BYTES: usize = 8 << 20;

/// A buffered writer to a local file that syncs the file's data every [`SYNC_EVERY_BYTES`].
pub struct SyncedWriter {
    out: BufWriter<File>,
    unsynced: usize,
    sync_every: usize,
}

impl SyncedWriter {
    /// Creates (or truncates) the file at `path`.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Self::with_limits(path, 1 << 20, SYNC_EVERY_BYTES)
    }

    /// [`Self::create`] with a buffer of `buffer` bytes, syncing every `sync_every` bytes: for
    /// many files written at once, whose buffers and unsynced pages add up.
    pub fn with_limits(path: &Path, buffer: usize, sync_every: usize) -> std::io::Result<Self> {
        Ok(SyncedWriter { out: BufWriter::with_capacity(buffer, File::create(path)?), unsynced: 0, sync_every })
    }

    /// Flushes the buffer and syncs the whole file (data and metadata).
    pub fn sync_all(mut self) -> std::io::Result<()> {
        self.out.flush()?;
        self.out.get_ref().sync_all()
    }
}

impl Write for SyncedWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.out.write_all(bytes)?;
        self.unsynced += bytes.len();
        if self.unsynced >= self.sync_every {
            self.out.flush()?;
            self.out.get_ref().sync_data()?;
            self.unsynced = 0;
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// Bytes a [`WriterThread`] holds that its thread has not written yet, at most.
pub const WRITER_THREAD_IN_FLIGHT: usize = 16 << 20;

/// A [`SyncedWriter`] on a thread of its own: [`Write::write`] hands the bytes over and
/// returns, waiting only while [`WRITER_THREAD_IN_FLIGHT`] bytes are still to be written, so
/// that whoever makes a large file (a task encoding a full image) and the disk work at once.
pub struct WriterThread {
    chunks: Option<std::sync::mpsc::SyncSender<Vec<u8>>>,
    written: Option<std::thread::JoinHandle<std::io::Result<()>>>,
}

/// Bytes handed to a [`WriterThread`]'s thread at a time.
const WRITER_THREAD_CHUNK: usize = 1 << 20;

impl WriterThread {
    /// Creates (or truncates) the file at `path` and starts its thread, `name`d.
    pub fn create(path: &Path, name: &str) -> std::io::Result<Self> {
        let mut out = SyncedWriter::create(path)?;
        let (chunks, to_write) =
            std::sync::mpsc::sync_channel::<Vec<u8>>(WRITER_THREAD_IN_FLIGHT / WRITER_THREAD_CHUNK);
        let written = std::thread::Builder::new().name(name.into()).spawn(move || {
            for chunk in to_write {
                out.write_all(&chunk)?;
            }
            out.sync_all()
        })?;
        Ok(WriterThread { chunks: Some(chunks), written: Some(written) })
    }

    /// Waits until every byte is written and the file synced (data and metadata).
    pub fn finish(mut self) -> std::io::Result<()> {
        self.chunks = None;
        self.outcome()
    }

    /// The thread's outcome, once it ended (its channel closed, or it failed).
    fn outcome(&mut self) -> std::io::Result<()> {
        match self.written.take().map(std::thread::JoinHandle::join) {
            Some(Ok(outcome)) => outcome,
            Some(Err(_)) => Err(std::io::Error::other("the file's writer thread panicked")),
            None => Err(std::io::Error::other("the file's writer thread already ended")),
        }
    }
}

impl Write for WriterThread {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        for chunk in bytes.chunks(WRITER_THREAD_CHUNK) {
            let sent = self.chunks.as_ref().map(|c| c.send(chunk.to_vec()));
            if !matches!(sent, Some(Ok(()))) {
                // The thread stopped at an error: that error.
                self.chunks = None;
                return Err(match self.outcome() {
                    Err(e) => e,
                    Ok(()) => std::io::Error::other("the file's writer thread ended early"),
                });
            }
        }
        Ok(bytes.len())
    }

    /// Nothing to do: [`Self::finish`] waits for the bytes.
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for WriterThread {
    fn drop(&mut self) {
        self.chunks = None;
        let _ = self.outcome();
    }
}

#[cfg(test)]
mod tests {
    /// A writer thread's file holds every byte handed to it, in order, once finished; a write
    /// after its thread failed returns that failure.
    #[test]
    fn a_writer_thread_writes_every_byte_and_reports_its_failure() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("image");
        let mut w = super::WriterThread::create(&path, "test-writer").unwrap();
        let mut expected = Vec::new();
        for i in 0..40u32 {
            // Past the bytes in flight, in pieces smaller and larger than a chunk.
            let piece: Vec<u8> = (0..(i as usize * 97_003) % 3_000_000).map(|b| (b as u32 ^ i) as u8).collect();
            w.write_all(&piece).unwrap();
            expected.extend_from_slice(&piece);
        }
        w.finish().unwrap();
        assert!(expected.len() > 2 * super::WRITER_THREAD_IN_FLIGHT);
        assert!(std::fs::read(&path).unwrap() == expected, "the same bytes in the same order");

        // /dev/full refuses every write with ENOSPC.
        if std::path::Path::new("/dev/full").exists() {
            let mut full = super::WriterThread::create(std::path::Path::new("/dev/full"), "test-full").unwrap();
            let failed = (0..64).find_map(|_| full.write_all(&[7u8; 1 << 20]).err());
            let failed = failed.or_else(|| full.finish().err()).expect("a full device fails the writer");
            assert_eq!(failed.raw_os_error(), Some(28), "{failed}");
        }
    }

    /// Direct writes hold exactly the bytes given, at lengths around the block and buffer
    /// sizes, on the disk's filesystem and on tmpfs (which refuses direct I/O); an existing
    /// file is never overwritten.
    #[test]
    fn direct_writes_hold_exactly_their_bytes_whatever_the_length_and_filesystem() {
        let disk = tempfile::tempdir().unwrap();
        let shm = std::path::Path::new("/dev/shm");
        let tmpfs = shm.is_dir().then(|| tempfile::tempdir_in(shm).unwrap());
        let dirs = std::iter::once(disk.path()).chain(tmpfs.as_ref().map(|d| d.path()));
        for dir in dirs {
            for len in [0, 1, 4095, 4096, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 4097, 3 << 20] {
                let data: Vec<u8> = (0..len).map(|i| (i * 31 % 253) as u8 + 1).collect();
                let path = dir.join(format!("f{len}"));
                super::write_file_direct(&path, &data).unwrap();
                assert!(std::fs::read(&path).unwrap() == data, "{}: {len} bytes", dir.display());
                let again = super::write_file_direct(&path, b"other");
                assert_eq!(again.unwrap_err().kind(), std::io::ErrorKind::AlreadyExists);
                assert!(std::fs::read(&path).unwrap() == data, "{}: kept", dir.display());
            }
        }
    }

    #[test]
    fn a_files_length_and_crc_are_those_of_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        assert_eq!(super::file_digest(&path).unwrap(), crate::FileDigest::of(&data));
    }
}
