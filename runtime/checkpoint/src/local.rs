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

/// The length and CRC-32C of a local file, read in 1 MiB parts.
pub fn file_len_and_crc32c(path: &Path) -> std::io::Result<(u64, u32)> {
    use std::io::Read;
    let mut file = File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut len, mut crc) = (0u64, 0u32);
    loop {
        let n = match file.read(&mut buf) {
            Ok(0) => return Ok((len, crc)),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        len += n as u64;
    }
}

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

#[cfg(test)]
mod tests {
    #[test]
    fn a_files_length_and_crc_are_those_of_its_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        assert_eq!(super::file_len_and_crc32c(&path).unwrap(), (data.len() as u64, crc32c::crc32c(&data)));
    }
}
