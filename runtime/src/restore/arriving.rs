//! Local copies of a restore's state files that are downloaded while the restore reads them.
//!
//! A heap restore larger than its budget of files in memory reads each file in parts from a
//! local copy ([`super::KeyedFilesIn::LocalReadOnce`]). From object storage, downloading every
//! copy before applying the first left both cores waiting on the network first and on the
//! applying after: 10 GiB from the S3 server of the tests took 23–31 s to download, then 9–11 s
//! to apply. Here a copy is handed to the restore as soon as it is created, empty, and a thread
//! per chain downloads the chain's files in its order, each in ranges fetched several at a time
//! and written in order; a reader of the copy waits for the bytes it reaches
//! ([`ArrivingReader`]). The copy is verified as it is read, as a link to a local checkpoint's
//! file is ([`super::LocalCopy::verify_read`]): its bytes are the snapshot's only once the
//! whole of them matched its digest.

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex, Weak};

use futures::StreamExt;
use weir_checkpoint::Storage;

use super::{record_damage, retrying, LocalCopy, RestoreError};

/// Bytes of a copy fetched with one request (4 KiB in unit tests, whose files are small).
pub const RANGE_BYTES: u64 = if cfg!(test) { 4 << 10 } else { 8 << 20 };

/// Ranges of a chain fetched at once: as many requests as a restore makes for whole files
/// ([`super::FILES_IN_FLIGHT`]), on one file at a time, so that its bytes come in the order
/// they are applied. At most this many ranges wait in memory to be written.
pub const RANGES_IN_FLIGHT: usize = 8;

/// How much of a copy has arrived, and how its download ended.
#[derive(Debug, Default)]
pub struct Arrival {
    state: Mutex<Arrived>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Arrived {
    /// Bytes written from the copy's start.
    bytes: u64,
    /// Why the download stopped before the end; no byte past `bytes` will come.
    failed: Option<String>,
}

impl Arrival {
    fn advance(&self, bytes: u64) {
        self.state.lock().expect("arrival lock").bytes = bytes;
        self.changed.notify_all();
    }

    fn fail(&self, why: String) {
        self.state.lock().expect("arrival lock").failed = Some(why);
        self.changed.notify_all();
    }

    /// Blocks until bytes past `at` have arrived, or all `len` of them, and returns how many
    /// bytes from `at` may be read now (0: the copy ends at `at`). A failed download is an
    /// error once the bytes before it are read.
    fn wait_past(&self, at: u64, len: u64) -> std::io::Result<u64> {
        let mut state = self.state.lock().expect("arrival lock");
        loop {
            if state.bytes > at || state.bytes >= len {
                return Ok(state.bytes.saturating_sub(at));
            }
            if let Some(why) = &state.failed {
                return Err(std::io::Error::other(why.clone()));
            }
            state = self.changed.wait(state).expect("arrival lock");
        }
    }

    /// Blocks until the whole copy of `len` bytes has arrived, or says why it will not.
    pub fn wait_whole(&self, len: u64) -> Result<(), String> {
        let mut state = self.state.lock().expect("arrival lock");
        loop {
            if state.bytes >= len {
                return Ok(());
            }
            if let Some(why) = &state.failed {
                return Err(why.clone());
            }
            state = self.changed.wait(state).expect("arrival lock");
        }
    }
}

/// Reads a copy whose download may still run: each read waits until the bytes it starts at
/// have arrived, then takes no more than those.
#[derive(Debug)]
pub struct ArrivingReader {
    file: std::fs::File,
    at: u64,
    len: u64,
    arrival: Arc<Arrival>,
}

impl ArrivingReader {
    /// Reads `file` (the copy, opened on its own) as `arrival` says it arrives.
    pub fn new(file: std::fs::File, len: u64, arrival: Arc<Arrival>) -> Self {
        ArrivingReader { file, at: 0, len, arrival }
    }
}

impl std::io::Read for ArrivingReader {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use std::os::unix::fs::FileExt;
        let ready = self.arrival.wait_past(self.at, self.len)?;
        let n = (buf.len() as u64).min(ready) as usize;
        if n == 0 {
            return Ok(0);
        }
        let read = self.file.read_at(&mut buf[..n], self.at)?;
        if read == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the copy is shorter than arrived"));
        }
        self.at += read as u64;
        Ok(read)
    }
}

/// One file of a chain to download into its copy.
#[derive(Debug)]
pub struct Download {
    /// The copy: a download whose copy is gone (the restore failed, or finished with it)
    /// stops.
    pub copy: Weak<LocalCopy>,
    /// Where its bytes go, opened for writing when the copy was created.
    pub file: std::fs::File,
    /// Its arrival, shared with the copy.
    pub arrival: Arc<Arrival>,
    /// The snapshot's file, from the storage root.
    pub path: String,
    /// Its length by the snapshot's metadata (checked against the object's when the copy was
    /// made).
    pub len: u64,
}

/// Downloads each chain's files in order on a thread of its own (its writes and syncs block
/// it, not the I/O runtime), [`RANGES_IN_FLIGHT`] ranges at a time. Transient storage errors
/// are retried; a range that cannot be fetched fails its copy's reader, and the chain's later
/// files, which the restore would not reach. A file found missing or shorter than its metadata
/// says is recorded as damaged, so that no later restore picks a snapshot that needs it.
pub fn download_in_background(storage: &Storage, chains: Vec<Vec<Download>>) {
    for chain in chains.into_iter().filter(|c| !c.is_empty()) {
        let storage = storage.clone();
        let spawned = std::thread::Builder::new()
            .name("weir-restore-download".into())
            .spawn(move || crate::io().block_on(download_chain(&storage, chain)));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "a restore's download thread did not start");
        }
    }
}

async fn download_chain(storage: &Storage, chain: Vec<Download>) {
    let mut files = chain.into_iter();
    while let Some(file) = files.next() {
        if let Err(why) = download(storage, file).await {
            for later in files {
                later.arrival.fail(format!("an earlier file of its chain was not downloaded: {why}"));
            }
            return;
        }
    }
}

/// Downloads one file into its copy; `Err` when the chain should stop (its copy's reader was
/// told why).
async fn download(storage: &Storage, d: Download) -> Result<(), String> {
    let Download { copy, file, arrival, path, len } = d;
    let url = storage.url_of(&path);
    let mut out = weir_checkpoint::local::SyncedWriter::on(file);
    let mut ranges = futures::stream::iter((0..len).step_by(RANGE_BYTES as usize).map(|at| {
        let range = at..(at + RANGE_BYTES).min(len);
        let (path, url) = (&path, &url);
        async move {
            let got = retrying(url, || {
                let range = range.clone();
                async move { Ok(storage.get_range(path, range).await?) }
            })
            .await;
            (range, got)
        }
    }))
    .buffered(RANGES_IN_FLIGHT);
    while let Some((range, got)) = ranges.next().await {
        let Some(_alive) = copy.upgrade() else { return Err("the restore no longer reads it".into()) };
        let why = match got {
            Ok(bytes) if bytes.len() as u64 == range.end - range.start => {
                match out.write_all(&bytes).and_then(|()| out.flush()) {
                    Ok(()) => {
                        arrival.advance(range.end);
                        continue;
                    }
                    Err(e) => format!("writing its local copy: {e}"),
                }
            }
            Ok(bytes) => {
                let why = format!("bytes {}..{}: {} came", range.start, range.end, bytes.len());
                record_damage(storage, &path, &why).await;
                why
            }
            Err(RestoreError::Storage(weir_checkpoint::StorageError::NotFound(_))) => {
                record_damage(storage, &path, "missing").await;
                "missing".into()
            }
            Err(e) => e.to_string(),
        };
        let why = format!("downloading {url}: {why}");
        arrival.fail(why.clone());
        return Err(why);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A reader waits for the bytes it reaches, takes each as it arrives, ends where the copy
    /// ends, and fails after the bytes before a failed download's end.
    #[test]
    fn a_reader_waits_for_the_bytes_it_reaches_and_fails_where_the_download_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("copy");
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
        for fails_at in [None, Some(60_000u64)] {
            let mut writer = std::fs::File::create(&path).unwrap();
            let arrival = Arc::new(Arrival::default());
            let mut reader =
                ArrivingReader::new(std::fs::File::open(&path).unwrap(), data.len() as u64, arrival.clone());
            let writing = {
                let (arrival, data) = (arrival.clone(), data.clone());
                std::thread::spawn(move || {
                    for at in (0..data.len()).step_by(10_000) {
                        std::thread::sleep(std::time::Duration::from_millis(2));
                        if fails_at == Some(at as u64) {
                            arrival.fail("the server went away".into());
                            return;
                        }
                        writer.write_all(&data[at..at + 10_000]).unwrap();
                        arrival.advance(at as u64 + 10_000);
                    }
                })
            };
            let mut read = Vec::new();
            let result = reader.read_to_end(&mut read);
            writing.join().unwrap();
            match fails_at {
                None => {
                    assert_eq!(result.unwrap(), data.len());
                    assert!(read == data, "the bytes read are the bytes written");
                    assert_eq!(arrival.wait_whole(data.len() as u64), Ok(()));
                }
                Some(at) => {
                    let e = result.unwrap_err();
                    assert!(e.to_string().contains("the server went away"), "{e}");
                    assert!(read == data[..at as usize], "every byte before the failure was read");
                    assert_eq!(arrival.wait_whole(data.len() as u64), Err("the server went away".into()));
                }
            }
        }
    }
}
