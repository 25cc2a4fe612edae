//! Local files written under a memory limit: restored copies of state files, spilled full
//! images, a restore's sorted runs.
//!
//! Under a cgroup v1 memory limit, dirty page-cache pages count against the limit until they
//! are written back, and nothing throttles the writer before the OOM killer acts: a file larger
//! than the limit, written without syncs, gets its process killed. [`SyncedWriter`] syncs as it
//! writes.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// A file is synced every this many bytes written.
pub const SYNC_EVERY_BYTES: usize = 8 << 20;

/// A buffered writer to a local file that syncs the file's data every [`SYNC_EVERY_BYTES`].
pub struct SyncedWriter {
    out: BufWriter<File>,
    unsynced: usize,
}

impl SyncedWriter {
    /// Creates (or truncates) the file at `path`.
    pub fn create(path: &Path) -> std::io::Result<Self> {
        Ok(SyncedWriter { out: BufWriter::with_capacity(1 << 20, File::create(path)?), unsynced: 0 })
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
        if self.unsynced >= SYNC_EVERY_BYTES {
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
