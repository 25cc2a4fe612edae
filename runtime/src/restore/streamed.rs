//! State files a heap restore reads from object storage as it applies them, with no local copy.
//!
//! A heap restore larger than its budget of files in memory reads each file in parts
//! ([`super::KeyedFilesIn::LocalReadOnce`]). From a local filesystem the parts come from links
//! to the checkpoint's files. From object storage every file used to be downloaded to a local
//! copy before the first was applied: 10 GiB from the S3 server of the tests took 32–37 s to
//! download, then 11–15 s to apply (`runtime/BENCHMARKS.md`, session 41), and writing the
//! copies into the page cache was 15% of the machine's CPU samples.
//! Here each reader of a file ([`StreamedFile::reader`]) fetches it in ranges,
//! [`RANGES_IN_FLIGHT`] at a time, and takes them in order; memory holds at most those ranges.
//! The file is verified as it is read, as a link to a local checkpoint's file is
//! ([`super::SnapshotFile::verify`]): its bytes are the snapshot's only once the whole of them
//! matched its digest.

use bytes::Bytes;
use weir_checkpoint::recovery::Restorable;
use weir_checkpoint::{FileRef, Storage, StorageError};

use super::{corrupt, record_damage, retrying, RestoreError, SnapshotFile};

/// Bytes of a file fetched with one request (4 KiB in unit tests, whose files are small).
pub const RANGE_BYTES: u64 = if cfg!(test) { 4 << 10 } else { 8 << 20 };

/// Ranges of a file fetched at once: as many requests as a restore makes for whole files
/// ([`super::FILES_IN_FLIGHT`]), on the one file it reads, so that its bytes come in the order
/// they are applied.
pub const RANGES_IN_FLIGHT: usize = 8;

/// A keyed state file of a snapshot in object storage, its length checked, read from storage
/// by each reader and verified as it is read.
#[derive(Debug)]
pub struct StreamedFile {
    /// The snapshot's file, to verify against and to record damage of.
    pub source: SnapshotFile,
    /// A reader started ahead of the restore ([`Self::prefetch`]).
    ahead: std::sync::Mutex<Option<StreamedReader>>,
}

impl StreamedFile {
    /// `f` of the snapshot `found`, its length checked against the object's.
    pub async fn of(storage: &Storage, found: &Restorable, f: &FileRef) -> Result<StreamedFile, RestoreError> {
        let path = found.resolve(&f.path);
        let size = retrying(&storage.url_of(&path), || async { Ok(storage.size(&path).await?) }).await?;
        match size {
            None => return Err(corrupt(storage, found, f, "missing")),
            Some(len) if len != f.len => {
                return Err(corrupt(storage, found, f, format!("{len} bytes where the metadata says {}", f.len)))
            }
            Some(_) => {}
        }
        let source = SnapshotFile { storage: storage.clone(), path, file: f.clone() };
        Ok(StreamedFile { source, ahead: std::sync::Mutex::new(None) })
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.source.file.len
    }

    /// Whether it is empty (never: a state file has a header).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An increment of the heap backend: where its puts start among its entries
    /// ([`FileRef::puts_from`]).
    pub fn puts_from(&self) -> Option<u64> {
        self.source.file.puts_from
    }

    /// The whole file read again and verified ([`SnapshotFile::verify`]): for a reading that
    /// stopped early.
    pub fn verify_whole(&self) -> Result<(), String> {
        let mut read = super::DigestingReader::new(self.reader(), true);
        std::io::copy(&mut read, &mut std::io::sink()).map_err(|e| format!("reading {}: {e}", self.source.url()))?;
        self.source.verify(&read.digest.unwrap_or_default())
    }

    /// Starts reading it before the restore needs it: the next [`Self::reader`] takes what was
    /// fetched (at most [`RANGES_IN_FLIGHT`] ranges and one more, then the fetching waits). A
    /// restore calls it for the next file of its chain while it applies one: a new file's
    /// first ranges otherwise kept both sides waiting at every file's start.
    pub fn prefetch(&self) {
        let mut ahead = self.ahead.lock().expect("prefetch lock");
        if ahead.is_none() {
            *ahead = Some(self.fetch());
        }
    }

    /// Reads it from its start, its ranges fetched behind the reader on the I/O runtime until
    /// the reader is dropped ([`Self::prefetch`]ed ones first). Transient storage errors are
    /// retried; a range that cannot be fetched fails the read once the bytes before it are
    /// taken. A file found missing or shorter than its metadata says is recorded as damaged.
    pub fn reader(&self) -> StreamedReader {
        let ahead = self.ahead.lock().expect("prefetch lock").take();
        ahead.unwrap_or_else(|| self.fetch())
    }

    /// A reader whose ranges are fetched from now on, each by a task of its own, so that they
    /// keep coming while the reader's thread applies the ones before.
    fn fetch(&self) -> StreamedReader {
        let (ranges, rx) = tokio::sync::mpsc::channel(1);
        let source = self.source.clone();
        crate::io().spawn(async move {
            let len = source.file.len;
            let mut starts = (0..len).step_by(RANGE_BYTES as usize);
            let mut in_flight = std::collections::VecDeque::with_capacity(RANGES_IN_FLIGHT);
            loop {
                while in_flight.len() < RANGES_IN_FLIGHT {
                    let Some(at) = starts.next() else { break };
                    let range = at..(at + RANGE_BYTES).min(len);
                    in_flight.push_back(tokio::spawn(fetch_range(source.clone(), range)));
                }
                let Some(next) = in_flight.pop_front() else { return };
                let message = match next.await {
                    Ok(Ok(bytes)) => Ok(bytes),
                    Ok(Err(why)) => Err(why),
                    Err(e) => Err(format!("reading {}: {e}", source.url())),
                };
                let failed = message.is_err();
                // Stopped on the first failure, or once the reader is gone.
                if ranges.send(message).await.is_err() || failed {
                    in_flight.iter().for_each(tokio::task::JoinHandle::abort);
                    return;
                }
            }
        });
        StreamedReader { ranges: rx, current: Bytes::new(), failed: None }
    }
}

/// Fetches `range` of `source`, storage errors retried; one that is missing or comes short is
/// recorded as damaged. The error says which file and why.
async fn fetch_range(source: SnapshotFile, range: std::ops::Range<u64>) -> Result<Bytes, String> {
    let got = retrying(&source.url(), || {
        let range = range.clone();
        let source = &source;
        async move { Ok(source.storage.get_range(&source.path, range).await?) }
    })
    .await;
    let why = match got {
        Ok(bytes) if bytes.len() as u64 == range.end - range.start => return Ok(bytes),
        Ok(bytes) => {
            let why = format!("bytes {}..{}: {} came", range.start, range.end, bytes.len());
            record_damage(&source.storage, &source.path, &why).await;
            why
        }
        Err(RestoreError::Storage(StorageError::NotFound(_))) => {
            record_damage(&source.storage, &source.path, "missing").await;
            "missing".to_string()
        }
        Err(e) => return Err(format!("reading {}: {e}", source.url())),
    };
    Err(format!("{}: {why}", source.url()))
}

/// Reads a [`StreamedFile`]: each read takes the bytes of the range in hand, or waits for the
/// next one.
#[derive(Debug)]
pub struct StreamedReader {
    ranges: tokio::sync::mpsc::Receiver<Result<Bytes, String>>,
    current: Bytes,
    failed: Option<String>,
}

impl StreamedReader {
    /// A reader of the ranges `rx` brings, in order (for tests of its reading).
    #[cfg(test)]
    fn of(ranges: tokio::sync::mpsc::Receiver<Result<Bytes, String>>) -> Self {
        StreamedReader { ranges, current: Bytes::new(), failed: None }
    }
}

impl std::io::Read for StreamedReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            if let Some(why) = &self.failed {
                return Err(std::io::Error::other(why.clone()));
            }
            // Blocks the task thread (never a thread of the I/O runtime).
            match self.ranges.blocking_recv() {
                Some(Ok(bytes)) => self.current = bytes,
                Some(Err(why)) => self.failed = Some(why),
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current.split_to(n));
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A reader takes the ranges in order as they come, ends where they end, and fails after
    /// the bytes before a failed range, on every read from then on.
    #[test]
    fn a_reader_takes_ranges_as_they_come_and_fails_where_the_fetching_failed() {
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for fails_at in [None, Some(60_000usize)] {
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let mut reader = StreamedReader::of(rx);
            let sending = {
                let data = data.clone();
                std::thread::spawn(move || {
                    for at in (0..data.len()).step_by(10_000) {
                        std::thread::sleep(std::time::Duration::from_millis(2));
                        if fails_at == Some(at) {
                            tx.blocking_send(Err("the server went away".into())).unwrap();
                            return;
                        }
                        tx.blocking_send(Ok(Bytes::copy_from_slice(&data[at..at + 10_000]))).unwrap();
                    }
                })
            };
            let mut read = Vec::new();
            let result = reader.read_to_end(&mut read);
            sending.join().unwrap();
            match fails_at {
                None => {
                    assert_eq!(result.unwrap(), data.len());
                    assert!(read == data, "the bytes read are the bytes sent");
                }
                Some(at) => {
                    let e = result.unwrap_err();
                    assert!(e.to_string().contains("the server went away"), "{e}");
                    assert!(read == data[..at], "every byte before the failure was read");
                    assert!(reader.read(&mut [0; 16]).is_err(), "and it stays failed");
                }
            }
        }
    }
}
