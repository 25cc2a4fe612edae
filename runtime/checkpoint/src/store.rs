//! Checkpoint storage: one `object_store` root per job, addressed by the paths of
//! [`crate::layout`]. Local directories by default; `s3://`, `gs://` and `az://` for real
//! deployments (opened by `object_store::parse_url_opts`); `memory://` for tests.

use std::sync::Arc;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::local::LocalFileSystem;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};

/// Why a storage operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The URL could not be turned into a store.
    #[error("storage URL `{url}`: {reason}")]
    Open {
        /// The URL given.
        url: String,
        /// Why.
        reason: String,
    },
    /// An object was not there.
    #[error("`{0}` not found")]
    NotFound(String),
    /// A create-only write found the object already there (another writer got there first).
    #[error("`{0}` already exists")]
    AlreadyExists(String),
    /// The store refused or failed an operation.
    #[error("{op} `{path}`: {source}")]
    Io {
        /// Which operation.
        op: &'static str,
        /// On which object.
        path: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
}

/// How [`Storage::copy_from`] copied an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopiedBy {
    /// A hard link: both roots are directories on one filesystem.
    Link,
    /// The object store copied it itself (both roots are in one bucket).
    Store,
    /// Its bytes were read and written through this process; their digest, for the caller to
    /// check against the reference it copied.
    Streaming(crate::FileDigest),
}

/// Whether the environment names S3 credentials: static keys, web identity (EKS IRSA), a
/// container credentials endpoint (ECS/EKS pod identity), or an explicit opt-in to the instance
/// metadata service. Without one of them object_store would fall back to instance metadata on
/// its own, reaching out to a link-local address on machines that have none.
pub fn s3_credentials_configured(var: impl Fn(&str) -> Option<String>) -> bool {
    let set = |k: &str| var(k).is_some_and(|v| !v.is_empty());
    (set("AWS_ACCESS_KEY_ID") && set("AWS_SECRET_ACCESS_KEY"))
        || set("AWS_WEB_IDENTITY_TOKEN_FILE")
        || set("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI")
        || set("AWS_CONTAINER_CREDENTIALS_FULL_URI")
        || var("WEIR_S3_INSTANCE_METADATA").as_deref() == Some("true")
}

/// Whether the environment names credentials for `scheme`'s store (see
/// [`s3_credentials_configured`] for S3). GCS: a service account (key, file or path) or
/// `WEIR_GCS_INSTANCE_METADATA=true`; Azure: a storage account with a key, SAS token, client
/// secret, federated token, or `WEIR_AZURE_MANAGED_IDENTITY=true`.
pub fn cloud_credentials_configured(scheme: &str, var: impl Fn(&str) -> Option<String>) -> bool {
    let set = |k: &str| var(k).is_some_and(|v| !v.is_empty());
    match scheme {
        "s3" => s3_credentials_configured(var),
        "gs" => {
            ["GOOGLE_SERVICE_ACCOUNT", "GOOGLE_SERVICE_ACCOUNT_PATH", "GOOGLE_SERVICE_ACCOUNT_KEY"]
                .iter()
                .any(|k| set(k))
                || set("GOOGLE_APPLICATION_CREDENTIALS")
                || var("WEIR_GCS_INSTANCE_METADATA").as_deref() == Some("true")
        }
        "az" => {
            set("AZURE_STORAGE_ACCOUNT_NAME")
                && ([
                    "AZURE_STORAGE_ACCOUNT_KEY",
                    "AZURE_STORAGE_SAS_KEY",
                    "AZURE_CLIENT_SECRET",
                    "AZURE_FEDERATED_TOKEN_FILE",
                ]
                .iter()
                .any(|k| set(k))
                    || set("AZURE_STORAGE_USE_EMULATOR")
                    || var("WEIR_AZURE_MANAGED_IDENTITY").as_deref() == Some("true"))
        }
        _ => false,
    }
}

#[cfg(feature = "cloud")]
fn missing_credentials(scheme: &str) -> &'static str {
    match scheme {
        "s3" => {
            "no S3 credentials in the environment (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, use web identity, \
             or set WEIR_S3_INSTANCE_METADATA=true to use the instance metadata service)"
        }
        "gs" => {
            "no GCS credentials in the environment (set GOOGLE_SERVICE_ACCOUNT_KEY or GOOGLE_APPLICATION_CREDENTIALS, \
             or WEIR_GCS_INSTANCE_METADATA=true to use the metadata server)"
        }
        _ => {
            "no Azure credentials in the environment (set AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, \
             a SAS key or a client secret, or WEIR_AZURE_MANAGED_IDENTITY=true)"
        }
    }
}

fn local_io<'a>(op: &'static str, path: &'a str) -> impl FnOnce(std::io::Error) -> StorageError + 'a {
    move |e| StorageError::Io {
        op,
        path: path.to_string(),
        source: object_store::Error::Generic { store: "local", source: Box::new(e) },
    }
}

/// Objects on a local filesystem at least this large are read in parts at once
/// ([`Storage::get_with_crc32c`]).
pub const PARALLEL_READ_FROM: u64 = 8 << 20;

/// Reads the local file `path` (object `rel`) with its CRC-32C: in a part per core at once
/// when it is [`PARALLEL_READ_FROM`] bytes or more, else whole on this thread.
#[cfg(unix)]
fn read_local_in_parts(path: &std::path::Path, rel: &str) -> Result<(Bytes, u32), StorageError> {
    use std::os::unix::fs::FileExt;
    let file = match std::fs::File::open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(StorageError::NotFound(rel.to_string())),
        Err(e) => return Err(local_io("get", rel)(e)),
    };
    let len = file.metadata().map_err(local_io("get", rel))?.len();
    let len = usize::try_from(len).map_err(|_| local_io("get", rel)(std::io::ErrorKind::OutOfMemory.into()))?;
    let parts = match len as u64 >= PARALLEL_READ_FROM {
        true => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
        false => 1,
    };
    // Zeroed by the allocator without writing (fresh pages): each part's thread faults its
    // own pages in as it reads into them.
    let mut data = vec![0u8; len];
    let part = len.div_ceil(parts).max(1);
    let read = |(i, chunk): (usize, &mut [u8])| {
        file.read_exact_at(chunk, (i * part) as u64).map(|()| (crc32c::crc32c(chunk), chunk.len()))
    };
    let crcs: Vec<(u32, usize)> = if parts < 2 {
        data.chunks_mut(part).enumerate().map(read).collect::<Result<_, _>>()
    } else {
        std::thread::scope(|scope| {
            let reads: Vec<_> =
                data.chunks_mut(part).enumerate().map(|chunk| scope.spawn(move || read(chunk))).collect();
            reads
                .into_iter()
                .map(|read| read.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic)))
                .collect::<Result<_, _>>()
        })
    }
    .map_err(local_io("read", rel))?;
    let crc = crcs.into_iter().fold(0, |crc, (part_crc, part_len)| crc32c::crc32c_combine(crc, part_crc, part_len));
    Ok((Bytes::from(data), crc))
}

/// Objects in an object store at least this large are fetched as ranges at once
/// ([`Storage::get_with_crc32c`]).
pub const RANGED_GET_FROM: u64 = 2 * GET_RANGE_BYTES;

/// The ranges a large object is fetched as ([`Storage::get_with_crc32c`]).
pub const GET_RANGE_BYTES: u64 = 16 << 20;

/// Ranges of one object fetched at once ([`Storage::get_with_crc32c`]).
pub const GET_RANGES_IN_FLIGHT: usize = 4;

/// Reads the body of `res` (of object `rel`) into `part`, and returns its CRC-32C and length;
/// `None` when the body is not `part`'s length.
async fn read_body_into(
    res: object_store::GetResult,
    rel: &str,
    part: &mut [u8],
) -> Result<Option<(u32, usize)>, StorageError> {
    let (mut crc, mut at) = (0u32, 0usize);
    let mut chunks = res.into_stream();
    while let Some(chunk) = chunks.next().await {
        let chunk = chunk.map_err(io("read", rel))?;
        let Some(into) = part.get_mut(at..at + chunk.len()) else { return Ok(None) };
        into.copy_from_slice(&chunk);
        crc = crc32c::crc32c_append(crc, &chunk);
        at += chunk.len();
    }
    Ok((at == part.len()).then_some((crc, at)))
}

/// Parts of a file written by [`Storage::put_file`]: S3 takes at most 10,000 parts, so a file
/// of up to about 80 GiB.
const FILE_PART_BYTES: usize = 8 << 20;

/// The largest object an object store is asked to copy itself ([`Storage::copies_cheaply_from`]):
/// S3 copies at most 5 GiB in one request (larger objects take a multipart copy, which
/// object_store does not make). Held to for every store.
pub const COPY_IN_STORE_MAX: u64 = 5 << 30;

/// Parts of one file uploading at once.
const FILE_PARTS_IN_FLIGHT: usize = 4;

/// Makes the names of local staging files unique within the process.
static NEXT_STAGING: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A job's storage root.
#[derive(Clone, Debug)]
pub struct Storage {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    url: String,
    /// The local directory behind a filesystem store (empty directories are removed by hand).
    local: Option<std::path::PathBuf>,
}

fn io<'a>(op: &'static str, path: &'a str) -> impl FnOnce(object_store::Error) -> StorageError + 'a {
    move |source| match source {
        object_store::Error::NotFound { .. } => StorageError::NotFound(path.to_string()),
        object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. } => {
            StorageError::AlreadyExists(path.to_string())
        }
        source => StorageError::Io { op, path: path.to_string(), source },
    }
}

/// The object-store scheme of `url` (`s3`, `gs` or `az`); `None` for a local path, `file://`
/// or `memory://`.
pub fn cloud_scheme(url: &str) -> Option<&str> {
    url.split_once("://").map(|(scheme, _)| scheme).filter(|scheme| matches!(*scheme, "s3" | "gs" | "az"))
}

/// Where [`Storage::open_for`] takes a cloud root's settings and credentials from.
#[derive(Clone, Copy, Debug)]
pub enum CloudSettings<'a> {
    /// The process environment's `AWS_*`, `GOOGLE_*` or `AZURE_*` variables: the caller's own
    /// identity, for roots the caller itself is responsible for.
    Own,
    /// These keys only (e.g. a tenant's credentials Secret); the process environment is never
    /// read, so nothing of the caller's identity or settings is mixed in.
    Only(&'a [(String, String)]),
}

impl Storage {
    /// Opens a storage root from a URL: a local path (created if missing), `file:///abs/path`,
    /// `s3://bucket/prefix` (credentials, region and endpoint from the usual `AWS_*`
    /// environment variables), or `memory://` (process-local, for tests).
    pub fn open(url: &str) -> Result<Storage, StorageError> {
        Storage::open_with_env(url, &[])
    }

    /// Like [`Storage::open`], with `env` (e.g. the keys of a job's credentials Secret) taking
    /// precedence over the process environment for S3 settings (`AWS_*`).
    pub fn open_with_env(url: &str, env: &[(String, String)]) -> Result<Storage, StorageError> {
        let fail = |reason: String| StorageError::Open { url: url.to_string(), reason };
        if let Some(scheme) = cloud_scheme(url) {
            return Storage::open_cloud(url, scheme, env, true).map_err(fail);
        }
        Storage::open_local(url, true)?.ok_or_else(|| fail("its directory does not exist".into()))
    }

    /// Opens a root on behalf of someone else (the operator, for a tenant's job): a cloud root
    /// with exactly the `settings` given, a local root only if it exists (`None` when it does
    /// not: nothing is created from a path someone else wrote).
    pub fn open_for(url: &str, settings: CloudSettings<'_>) -> Result<Option<Storage>, StorageError> {
        let fail = |reason: String| StorageError::Open { url: url.to_string(), reason };
        if let Some(scheme) = cloud_scheme(url) {
            let (env, process_env) = match settings {
                CloudSettings::Own => (&[][..], true),
                CloudSettings::Only(env) => (env, false),
            };
            return Storage::open_cloud(url, scheme, env, process_env).map(Some).map_err(fail);
        }
        Storage::open_local(url, false)
    }

    /// A local (`file://` or plain path) or `memory://` root; a missing directory is created
    /// when `create`, else the answer is `None`.
    fn open_local(url: &str, create: bool) -> Result<Option<Storage>, StorageError> {
        let fail = |reason: String| StorageError::Open { url: url.to_string(), reason };
        if let Some(rest) = url.strip_prefix("memory://") {
            return Ok(Some(Storage {
                store: Arc::new(InMemory::new()),
                prefix: rest.trim_matches('/').to_string(),
                url: url.to_string(),
                local: None,
            }));
        }
        let path = match url.strip_prefix("file://") {
            Some(p) => p.to_string(),
            None if url.contains("://") => {
                return Err(fail("unsupported scheme (use a path, file://, s3://, gs://, az:// or memory://)".into()))
            }
            None => url.to_string(),
        };
        if create {
            std::fs::create_dir_all(&path).map_err(|e| fail(format!("cannot create directory: {e}")))?;
        } else if !std::path::Path::new(&path).is_dir() {
            return Ok(None);
        }
        let abs = std::fs::canonicalize(&path).map_err(|e| fail(e.to_string()))?;
        let store = LocalFileSystem::new_with_prefix(&abs).map_err(|e| fail(e.to_string()))?;
        Ok(Some(Storage {
            store: Arc::new(store),
            prefix: String::new(),
            url: abs.display().to_string(),
            local: Some(abs),
        }))
    }

    /// Without the `cloud` feature every cloud root is refused, naming the feature.
    #[cfg(not(feature = "cloud"))]
    fn open_cloud(_url: &str, scheme: &str, _env: &[(String, String)], _process_env: bool) -> Result<Storage, String> {
        Err(format!(
            "this build of Weir has no {scheme}:// storage: build it with the `cloud` feature (on by default; \
             the build was made with --no-default-features)"
        ))
    }

    /// An object store root: `s3://bucket/prefix`, `gs://bucket/prefix` or `az://container/prefix`.
    /// Its settings are the environment's `AWS_*`, `GOOGLE_*` or `AZURE_*` variables (as
    /// object_store's `from_env` reads them; only when `process_env`), with `env` taking
    /// precedence. Without credentials named in either, opening fails: the stores would
    /// otherwise fall back to a cloud metadata service, reaching out to a link-local address on
    /// machines that have none (and, for someone else's root, with this machine's identity).
    #[cfg(feature = "cloud")]
    fn open_cloud(url: &str, scheme: &str, env: &[(String, String)], process_env: bool) -> Result<Storage, String> {
        let parsed = url::Url::parse(url).map_err(|e| e.to_string())?;
        if parsed.host_str().unwrap_or_default().is_empty() {
            return Err(format!("needs a bucket: {scheme}://bucket/prefix"));
        }
        let from_process = |k: &str| if process_env { std::env::var(k).ok() } else { None };
        let var = |k: &str| env.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone()).or_else(|| from_process(k));
        let env_prefix = match scheme {
            "s3" => "AWS_",
            "gs" => "GOOGLE_",
            _ => "AZURE_",
        };
        if !cloud_credentials_configured(scheme, var) {
            return Err(missing_credentials(scheme).to_string());
        }
        // The process environment first, the job's Secret over it; object_store ignores keys
        // that are not its settings.
        let process: Vec<(String, String)> = if process_env { std::env::vars().collect() } else { Vec::new() };
        let mut options: std::collections::BTreeMap<String, String> = process
            .into_iter()
            .chain(env.iter().cloned())
            .filter(|(k, _)| k.starts_with(env_prefix))
            .map(|(k, v)| (k.to_ascii_lowercase(), v))
            .collect();
        if scheme == "gs" {
            // object_store's own name for the service-account file variable.
            if let Some(path) = var("GOOGLE_APPLICATION_CREDENTIALS") {
                options.entry("google_service_account".into()).or_insert(path);
            }
        }
        let (store, _) = object_store::parse_url_opts(&parsed, options).map_err(|e| e.to_string())?;
        // The prefix is the URL's path for every scheme: the host is the bucket or container.
        // (object_store's parse reads `az://` as `az://account/container/path` and would drop
        // the first segment of `az://container/prefix`; its Azure builder takes the host as the
        // container, as Weir does.)
        let prefix = parsed.path().trim_matches('/').to_string();
        Ok(Storage { store: Arc::from(store), prefix, url: url.to_string(), local: None })
    }

    /// A storage root over any object store, with `url` naming it in messages (for stores
    /// built by hand, e.g. a wrapper that injects failures in tests).
    pub fn with_store(store: Arc<dyn ObjectStore>, url: &str) -> Storage {
        Storage { store, prefix: String::new(), url: url.to_string(), local: None }
    }

    /// The URL (or absolute path) of this root, for messages and status.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Whether this root is a directory of a local filesystem (not object storage nor memory).
    pub fn is_local_filesystem(&self) -> bool {
        self.local.is_some()
    }

    /// Whether `other` is this root: the same canonical directory, the same in-memory store
    /// (each `memory://` root opened is a store of its own), or the same object store URL up
    /// to trailing slashes. Roots named differently (a bucket's endpoint spelled two ways)
    /// count as different, the safe answer for whoever asks whether files of one may be
    /// referenced from the other.
    pub fn is_same_root(&self, other: &Storage) -> bool {
        match (&self.local, &other.local) {
            (Some(a), Some(b)) => a == b,
            (None, None) if self.url.starts_with("memory://") => {
                Arc::ptr_eq(&self.store, &other.store) && self.prefix == other.prefix
            }
            (None, None) => self.url.trim_end_matches('/') == other.url.trim_end_matches('/'),
            _ => false,
        }
    }

    /// The URL of a path under this root.
    pub fn url_of(&self, rel: &str) -> String {
        if rel.is_empty() {
            return self.url.clone();
        }
        format!("{}/{}", self.url.trim_end_matches('/'), rel)
    }

    fn full(&self, rel: &str) -> Path {
        if self.prefix.is_empty() {
            Path::from(rel)
        } else {
            Path::from(format!("{}/{}", self.prefix, rel))
        }
    }

    fn strip<'a>(&self, full: &'a str) -> &'a str {
        if self.prefix.is_empty() {
            full
        } else {
            full.strip_prefix(&self.prefix).map(|s| s.trim_start_matches('/')).unwrap_or(full)
        }
    }

    /// Writes an object (atomically: readers see the old object, nothing, or all of the new one).
    /// On a local filesystem the file and its directory are synced before this returns, so a
    /// checkpoint acknowledged or a file published survives a power loss.
    ///
    /// On a local filesystem the object is written past the page cache where the filesystem
    /// allows it ([`crate::local::write_file_direct`]) to a staging file beside it, then renamed.
    pub async fn put(&self, rel: &str, data: Bytes) -> Result<(), StorageError> {
        if let Some(root) = &self.local {
            let object = self.local_object(root, rel)?;
            // Named as object_store names its staging files (`<name>#<digits>`), which its
            // listings leave out.
            let n = NEXT_STAGING.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut staging = object.clone().into_os_string();
            staging.push(format!("#{}{n:06}", std::process::id()));
            let staging = std::path::PathBuf::from(staging);
            let written = crate::local::write_file_direct(&staging, &data)
                .and_then(|()| std::fs::rename(&staging, &object))
                .map_err(local_io("put", rel));
            if written.is_err() {
                let _ = std::fs::remove_file(&staging);
            }
            written?;
            let dir = object.parent().unwrap_or(root);
            return std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(local_io("fsync", rel));
        }
        self.store.put(&self.full(rel), PutPayload::from(data)).await.map_err(io("put", rel))?;
        self.sync_local(&[rel]).map_err(local_io("fsync", rel))
    }

    /// Deletes the staging files that writers killed mid-write left under this root, unwritten
    /// for `idle` ([`crate::local::remove_abandoned_staging`]); returns how many. Only a local
    /// filesystem has them: an object store's writes are atomic and leave nothing.
    pub fn discard_abandoned_staging(&self, idle: std::time::Duration) -> Result<usize, StorageError> {
        let Some(root) = &self.local else { return Ok(0) };
        let dir = if self.prefix.is_empty() { root.clone() } else { root.join(&self.prefix) };
        crate::local::remove_abandoned_staging(&dir, idle).map_err(local_io("discard staging files", ""))
    }

    /// The file of object `rel` under a local root, its directory created.
    fn local_object(&self, root: &std::path::Path, rel: &str) -> Result<std::path::PathBuf, StorageError> {
        let object = root.join(self.full(rel).as_ref());
        if let Some(parent) = object.parent() {
            std::fs::create_dir_all(parent).map_err(local_io("create directory", rel))?;
        }
        Ok(object)
    }

    /// Writes the local file `local` at `rel` as one object, streamed in parts (a file may be
    /// larger than memory). On a local filesystem the file is hard-linked instead when it can
    /// be (same filesystem): it must not be changed afterwards, only deleted.
    pub async fn put_file(&self, rel: &str, local: &std::path::Path) -> Result<(), StorageError> {
        use std::io::Read;
        if let Some(root) = &self.local {
            if self.link_local(root, rel, local)?.is_ok() {
                return self.sync_local(&[rel]).map_err(local_io("fsync", rel));
            }
        }
        let mut file = std::fs::File::open(local).map_err(local_io("open", rel))?;
        let parts = std::iter::from_fn(move || {
            let mut part = Vec::with_capacity(FILE_PART_BYTES);
            match (&mut file).take(FILE_PART_BYTES as u64).read_to_end(&mut part) {
                Ok(0) => None,
                Ok(_) => Some(Ok(part)),
                Err(e) => Some(Err(local_io("read", rel)(e))),
            }
        });
        self.put_parts(rel, futures::stream::iter(parts)).await
    }

    /// Writes `parts` (of about [`FILE_PART_BYTES`] each, the last one shorter) as the one
    /// object `rel` by a multipart upload, [`FILE_PARTS_IN_FLIGHT`] parts at a time; the first
    /// part that fails to come or to go fails the upload, which is aborted.
    async fn put_parts(
        &self,
        rel: &str,
        parts: impl futures::Stream<Item = Result<Vec<u8>, StorageError>>,
    ) -> Result<(), StorageError> {
        let mut upload = self.store.put_multipart(&self.full(rel)).await.map_err(io("put", rel))?;
        let sent: Result<(), StorageError> = async {
            let mut parts = std::pin::pin!(parts);
            let mut in_flight: futures::stream::FuturesUnordered<object_store::UploadPart> =
                futures::stream::FuturesUnordered::new();
            while let Some(part) = parts.next().await {
                let part = part?;
                if in_flight.len() >= FILE_PARTS_IN_FLIGHT {
                    if let Some(sent) = in_flight.next().await {
                        sent.map_err(io("put part of", rel))?;
                    }
                }
                in_flight.push(upload.put_part(PutPayload::from(part)));
            }
            while let Some(sent) = in_flight.next().await {
                sent.map_err(io("put part of", rel))?;
            }
            upload.complete().await.map_err(io("complete the upload of", rel))?;
            Ok(())
        }
        .await;
        if let Err(failed) = sent {
            // The abort is best effort (parts left behind are the bucket's lifecycle rule's
            // to remove), and the error returned is the one that failed the upload:
            // object_store's own writer returns the abort's instead when the abort fails too,
            // as a server that already dropped the upload answers, which hid why a merged
            // image's upload had failed (`runtime/BENCHMARKS.md`, "Increments into spare
            // buffers").
            let _ = upload.abort().await;
            return Err(failed);
        }
        self.sync_local(&[rel]).map_err(local_io("fsync", rel))
    }

    /// Hard-links the local file `original` as object `rel` under the local root `root`,
    /// replacing whatever is there (its directory created); the link's own result is returned
    /// for the caller to fall back on a copy (another filesystem).
    fn link_local(
        &self,
        root: &std::path::Path,
        rel: &str,
        original: &std::path::Path,
    ) -> Result<std::io::Result<()>, StorageError> {
        let object = self.local_object(root, rel)?;
        let _ = std::fs::remove_file(&object);
        Ok(std::fs::hard_link(original, &object))
    }

    /// Writes an object only if none exists under that name (S3 `If-None-Match: *`, a hard
    /// link on a filesystem): [`StorageError::AlreadyExists`] when another writer was first.
    pub async fn put_if_absent(&self, rel: &str, data: Bytes) -> Result<(), StorageError> {
        let opts = PutOptions { mode: PutMode::Create, ..PutOptions::default() };
        self.store.put_opts(&self.full(rel), PutPayload::from(data), opts).await.map_err(io("put-if-absent", rel))?;
        self.sync_local(&[rel]).map_err(local_io("fsync", rel))
    }

    /// Syncs local files and their directories (a no-op for object stores, whose writes are
    /// durable when acknowledged).
    fn sync_local(&self, rels: &[&str]) -> std::io::Result<()> {
        let Some(local) = &self.local else { return Ok(()) };
        let mut dirs = std::collections::BTreeSet::new();
        for rel in rels {
            // The file object_store names: the path as `Path` encodes it (`%`, `#`, `~` and the
            // like percent-encoded), as `local_object` and `get_to_file` name it too.
            let path = local.join(self.full(rel).as_ref());
            if path.is_file() {
                std::fs::File::open(&path)?.sync_all()?;
            }
            dirs.extend(path.parent().map(|d| d.to_path_buf()));
        }
        for dir in dirs {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    }

    /// Reads a whole object.
    pub async fn get(&self, rel: &str) -> Result<Bytes, StorageError> {
        let res = self.store.get(&self.full(rel)).await.map_err(io("get", rel))?;
        res.bytes().await.map_err(io("read", rel))
    }

    /// Reads a whole object of at most `max` bytes; `Ok(Err(size))`, its body not read, when
    /// it is larger. One request: the size comes with the response, before the body.
    pub async fn get_at_most(&self, rel: &str, max: u64) -> Result<Result<Bytes, u64>, StorageError> {
        let res = self.store.get(&self.full(rel)).await.map_err(io("get", rel))?;
        if res.meta.size > max {
            return Ok(Err(res.meta.size));
        }
        res.bytes().await.map(Ok).map_err(io("read", rel))
    }

    /// Reads a whole object and returns its CRC-32C too. On a local filesystem an object of
    /// [`PARALLEL_READ_FROM`] bytes or more is read in parts at once, a thread per core, each
    /// computing its part's checksum as it reads (the parts' are then combined): one thread
    /// reading a 259 MB checkpoint file spent most of its time faulting the fresh buffer's
    /// pages in and copying from the page cache, then the checksum took another pass.
    ///
    /// From an object store, an object said to be `len` bytes long, [`RANGED_GET_FROM`] or
    /// more, is fetched as ranges of [`GET_RANGE_BYTES`], [`GET_RANGES_IN_FLIGHT`] at a time,
    /// each written into its place in one buffer and checksummed as it arrives: one request
    /// is one stream, which one server thread reads, checks and sends (MinIO's bitrot hash
    /// included), so a large object came no faster than that thread, while the others' files
    /// were done. When a range's response says the object's size or ETag is not the first's
    /// (not the `len` given, or replaced meanwhile), the object is read whole instead, and the
    /// caller's check of its length and checksum says what is wrong; so it is when a range
    /// fails (a range past the end of a shorter object is an error on some stores).
    pub async fn get_with_crc32c(&self, rel: &str, len: u64) -> Result<(Bytes, u32), StorageError> {
        #[cfg(unix)]
        if let Some(root) = &self.local {
            return read_local_in_parts(&root.join(self.full(rel).as_ref()), rel);
        }
        if len >= RANGED_GET_FROM {
            match self.get_in_ranges(rel, len).await {
                Ok(Some(read)) => return Ok(read),
                Ok(None) => tracing::debug!(path = rel, len, "an object is not as said: read whole"),
                // Read whole, which fails the same way if the store does (a missing object).
                Err(e) => tracing::debug!(path = rel, error = %e, "a range of an object failed: read whole"),
            }
        }
        let data = self.get(rel).await?;
        let crc = crc32c::crc32c(&data);
        Ok((data, crc))
    }

    /// Reads a whole object of `len` bytes as ranges of [`GET_RANGE_BYTES`], at most
    /// [`GET_RANGES_IN_FLIGHT`] at a time, and returns it with its CRC-32C
    /// ([`Storage::get_with_crc32c`]); `None` when a response says the object is not `len`
    /// bytes long (or is empty) or not the object (ETag) the first response was of. Nothing is allocated for
    /// the object before the first range's response says it is `len` bytes long (a damaged
    /// document's length would not size a buffer).
    pub async fn get_in_ranges(&self, rel: &str, len: u64) -> Result<Option<(Bytes, u32)>, StorageError> {
        if len == 0 {
            return Ok(None);
        }
        let path = self.full(rel);
        let first = self.get_range_response(&path, rel, 0..len.min(GET_RANGE_BYTES)).await?;
        let size = match usize::try_from(len) {
            Ok(size) if first.meta.size == len && first.range == (0..len.min(GET_RANGE_BYTES)) => size,
            _ => return Ok(None),
        };
        let tag = first.meta.e_tag.clone();
        let mut data = vec![0u8; size];
        let (head, rest) = data.split_at_mut(size.min(GET_RANGE_BYTES as usize));
        let rest = futures::stream::iter(rest.chunks_mut(GET_RANGE_BYTES as usize).enumerate().map(|(i, part)| {
            let start = (i as u64 + 1) * GET_RANGE_BYTES;
            let tag = &tag;
            let path = &path;
            async move {
                let res = self.get_range_response(path, rel, start..start + part.len() as u64).await?;
                match res.meta.size == len && res.range == (start..start + part.len() as u64) && res.meta.e_tag == *tag
                {
                    true => read_body_into(res, rel, part).await,
                    false => Ok(None),
                }
            }
        }))
        .buffered(GET_RANGES_IN_FLIGHT - 1)
        .try_collect::<Vec<_>>();
        let (head, rest) = futures::future::try_join(read_body_into(first, rel, head), rest).await?;
        let Some(parts) = std::iter::once(head).chain(rest).collect::<Option<Vec<_>>>() else { return Ok(None) };
        let crc =
            parts.into_iter().fold(0, |crc, (part_crc, part_len)| crc32c::crc32c_combine(crc, part_crc, part_len));
        Ok(Some((Bytes::from(data), crc)))
    }

    /// The response to a GET of bytes `range` of object `path` (`rel`).
    async fn get_range_response(
        &self,
        path: &Path,
        rel: &str,
        range: std::ops::Range<u64>,
    ) -> Result<object_store::GetResult, StorageError> {
        let options =
            object_store::GetOptions { range: Some(object_store::GetRange::Bounded(range)), ..Default::default() };
        self.store.get_opts(path, options).await.map_err(io("get", rel))
    }

    /// Reads bytes `range` of an object.
    pub async fn get_range(&self, rel: &str, range: std::ops::Range<u64>) -> Result<Bytes, StorageError> {
        self.store.get_range(&self.full(rel), range).await.map_err(io("get", rel))
    }

    /// Reads the first `len` bytes of an object (all of it when it is shorter) and returns
    /// them with the object's size.
    pub async fn get_head(&self, rel: &str, len: u64) -> Result<(Bytes, u64), StorageError> {
        let options =
            object_store::GetOptions { range: Some(object_store::GetRange::Bounded(0..len)), ..Default::default() };
        let res = self.store.get_opts(&self.full(rel), options).await.map_err(io("get", rel))?;
        let size = res.meta.size;
        Ok((res.bytes().await.map_err(io("read", rel))?, size))
    }

    /// Copies an object into the local file `local` (created or truncated), streamed: the
    /// object may be larger than memory. Returns its digest (length, CRC-32C, last bytes),
    /// computed on the way.
    ///
    /// On a local filesystem the object is hard-linked instead when it can be (same filesystem),
    /// and only read to compute its checksum: a copy would write every byte again. Deleting
    /// `local` later deletes the link, never the object.
    pub async fn get_to_file(&self, rel: &str, local: &std::path::Path) -> Result<crate::FileDigest, StorageError> {
        use futures::StreamExt;
        use std::io::Write;
        if let Some(root) = &self.local {
            let object = root.join(self.full(rel).as_ref());
            let _ = std::fs::remove_file(local);
            if std::fs::hard_link(&object, local).is_ok() {
                return crate::local::file_digest(local).map_err(local_io("read", rel));
            }
        }
        let res = self.store.get(&self.full(rel)).await.map_err(io("get", rel))?;
        // Synced as it goes: a copy may be larger than the process's memory limit.
        let mut out = crate::local::SyncedWriter::create(local).map_err(local_io("create", rel))?;
        let mut digest = crate::FileDigest::default();
        let mut chunks = res.into_stream();
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(io("read", rel))?;
            digest.update(&chunk);
            out.write_all(&chunk).map_err(local_io("write", rel))?;
        }
        out.flush().map_err(local_io("write", rel))?;
        Ok(digest)
    }

    /// On a local filesystem, hard-links an object to the local file `local` (replaced if
    /// there) without reading it, and returns the object's length; `None` where it cannot be
    /// linked (an object store, or another filesystem). Deleting `local` later deletes the link,
    /// never the object.
    pub fn link_to_file(&self, rel: &str, local: &std::path::Path) -> Result<Option<u64>, StorageError> {
        let Some(root) = &self.local else { return Ok(None) };
        let object = root.join(self.full(rel).as_ref());
        let len = match std::fs::metadata(&object) {
            Ok(meta) => meta.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(StorageError::NotFound(rel.to_string())),
            Err(e) => return Err(local_io("stat", rel)(e)),
        };
        let _ = std::fs::remove_file(local);
        Ok(std::fs::hard_link(&object, local).is_ok().then_some(len))
    }

    /// Copies object `from` of `source` (another root, or this one) to `to` under this root,
    /// replacing whatever is there, and says how: a hard link where both roots are directories
    /// on one filesystem, a copy inside the store where both are the same bucket of one object
    /// store (S3 copies up to 5 GiB in one request), else the bytes streamed through this
    /// process in parts ([`FILE_PART_BYTES`]; a file may be larger than memory), with their
    /// digest, for the caller to check against the reference it copies. A copy inside the store
    /// that the store refuses (too large, another account's bucket) is streamed instead.
    /// The source is only read: deleting it later leaves the copy whole.
    pub async fn copy_from(&self, source: &Storage, from: &str, to: &str) -> Result<CopiedBy, StorageError> {
        if let (Some(root), Some(source_root)) = (&self.local, &source.local) {
            let original = source_root.join(source.full(from).as_ref());
            match self.link_local(root, to, &original)? {
                Ok(()) => return self.sync_local(&[to]).map(|()| CopiedBy::Link).map_err(local_io("fsync", to)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(StorageError::NotFound(from.into())),
                // Another filesystem: streamed below.
                Err(_) => {}
            }
        } else if self.same_store(source) {
            match self.store.copy(&source.full(from), &self.full(to)).await {
                Ok(()) => return Ok(CopiedBy::Store),
                Err(object_store::Error::NotFound { .. }) => return Err(StorageError::NotFound(from.into())),
                // Refused (S3 copies at most 5 GiB at once; another account's bucket): streamed.
                Err(_) => {}
            }
        }
        let res = source.store.get(&source.full(from)).await.map_err(io("get", from))?;
        let digest = std::sync::Mutex::new(crate::FileDigest::default());
        let parts = futures::stream::unfold((res.into_stream(), false), |(mut chunks, ended)| {
            let digest = &digest;
            async move {
                if ended {
                    return None;
                }
                let mut part = Vec::with_capacity(FILE_PART_BYTES);
                while part.len() < FILE_PART_BYTES {
                    match chunks.next().await {
                        Some(Ok(chunk)) => {
                            digest.lock().unwrap_or_else(std::sync::PoisonError::into_inner).update(&chunk);
                            part.extend_from_slice(&chunk);
                        }
                        Some(Err(e)) => return Some((Err(io("read", from)(e)), (chunks, true))),
                        None => return (!part.is_empty()).then_some((Ok(part), (chunks, true))),
                    }
                }
                Some((Ok(part), (chunks, false)))
            }
        });
        self.put_parts(to, parts).await?;
        Ok(CopiedBy::Streaming(digest.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner)))
    }

    /// Whether objects of `source` of up to `largest` bytes each can be copied under this root
    /// without their bytes passing through this process: both roots are directories on one
    /// filesystem (hard links), or in one bucket of an object store that copies objects that
    /// large itself ([`COPY_IN_STORE_MAX`]). What [`Storage::copy_from`] does otherwise,
    /// streaming every byte, takes about as long as reading them again (10.7 GB from the S3
    /// server of the tests into a local directory: 59 s, past the default checkpoint timeout).
    pub fn copies_cheaply_from(&self, source: &Storage, largest: u64) -> bool {
        #[cfg(unix)]
        if let (Some(a), Some(b)) = (&self.local, &source.local) {
            use std::os::unix::fs::MetadataExt;
            let device = |dir: &std::path::Path| std::fs::metadata(dir).map(|m| m.dev()).ok();
            let (into, from) = (device(a), device(b));
            return into.is_some() && into == from;
        }
        self.same_store(source) && largest <= COPY_IN_STORE_MAX
    }

    /// Whether `other` is a root in the same bucket (or container) of the same object store, so
    /// that this root's store can copy its objects: the same in-memory store, or object store
    /// URLs with the same scheme and bucket. Not for local roots (linked instead).
    fn same_store(&self, other: &Storage) -> bool {
        if self.local.is_some() || other.local.is_some() {
            return false;
        }
        if self.url.starts_with("memory://") || other.url.starts_with("memory://") {
            return Arc::ptr_eq(&self.store, &other.store);
        }
        fn bucket(url: &str) -> Option<(&str, &str)> {
            url.split_once("://").map(|(scheme, rest)| (scheme, rest.split('/').next().unwrap_or("")))
        }
        bucket(&self.url).is_some_and(|b| Some(b) == bucket(&other.url))
    }

    /// Size of an object, or `None` when it does not exist.
    pub async fn size(&self, rel: &str) -> Result<Option<u64>, StorageError> {
        match self.store.head(&self.full(rel)).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(source) => Err(StorageError::Io { op: "head", path: rel.to_string(), source }),
        }
    }

    /// Renames an object (used to publish committed output). On S3 this is a copy and a
    /// delete; on a filesystem an atomic rename whose directories are synced.
    pub async fn rename(&self, from: &str, to: &str) -> Result<(), StorageError> {
        self.store.rename(&self.full(from), &self.full(to)).await.map_err(io("rename", from))?;
        self.sync_local(&[to, from]).map_err(local_io("fsync", to))
    }

    /// Deletes an object; a missing object is not an error.
    pub async fn delete(&self, rel: &str) -> Result<(), StorageError> {
        match self.store.delete(&self.full(rel)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(source) => Err(StorageError::Io { op: "delete", path: rel.to_string(), source }),
        }
    }

    /// Every object under a directory (recursively), as paths relative to this root.
    pub async fn list(&self, dir: &str) -> Result<Vec<String>, StorageError> {
        let prefix = self.full(dir);
        let items: Vec<_> = match self.store.list(Some(&prefix)).try_collect().await {
            Ok(items) => items,
            Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
            Err(source) => return Err(StorageError::Io { op: "list", path: dir.to_string(), source }),
        };
        let mut out: Vec<String> = items.into_iter().map(|m| decoded(self.strip(m.location.as_ref()))).collect();
        out.sort();
        Ok(out)
    }

    /// The immediate subdirectory names of a directory.
    pub async fn list_dirs(&self, dir: &str) -> Result<Vec<String>, StorageError> {
        let prefix = self.full(dir);
        let listing = match self.store.list_with_delimiter(Some(&prefix)).await {
            Ok(l) => l,
            Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
            Err(source) => return Err(StorageError::Io { op: "list", path: dir.to_string(), source }),
        };
        Ok(listing.common_prefixes.iter().filter_map(|p| p.filename().map(decoded)).collect())
    }

    /// Deletes every object under a directory.
    pub async fn delete_dir(&self, dir: &str) -> Result<(), StorageError> {
        for rel in self.list(dir).await? {
            self.delete(&rel).await?;
        }
        if let Some(local) = &self.local {
            // A filesystem store leaves the emptied directories behind.
            let path = local.join(self.full(dir.trim_matches('/')).as_ref());
            match std::fs::remove_dir_all(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(StorageError::Io {
                        op: "rmdir",
                        path: dir.to_string(),
                        source: object_store::Error::Generic { store: "local", source: Box::new(e) },
                    })
                }
            }
        }
        Ok(())
    }
}

/// A name as it was written: object_store's `Path` percent-encodes characters such as `%`,
/// `#`, `~` and `*` in what it lists; every other method here takes names unencoded.
fn decoded(listed: &str) -> String {
    percent_encoding::percent_decode_str(listed).decode_utf8_lossy().into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Copies between roots: a link between two directories (the copy outlives the original's
    /// deletion), a copy inside one in-memory store, the bytes streamed in parts between a
    /// directory and another store, with their digest; a missing source is `NotFound` and
    /// leaves nothing behind.
    #[tokio::test]
    async fn copies_between_roots_link_copy_in_the_store_or_stream_with_their_digest() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        let (a, b) =
            (Storage::open(&a.display().to_string()).unwrap(), Storage::open(&b.display().to_string()).unwrap());
        // Over two parts of a streamed copy.
        let data: Bytes = (0..(FILE_PART_BYTES + 12_345) as u64).map(|i| ((i * 2_654_435_761) >> 13) as u8).collect();
        a.put("savepoints/sp-1/op/0.kv", data.clone()).await.unwrap();
        let how = b.copy_from(&a, "savepoints/sp-1/op/0.kv", "checkpoints/shared/op/0-1-1-adopted-0.kv").await.unwrap();
        assert_eq!(how, CopiedBy::Link);
        a.delete("savepoints/sp-1/op/0.kv").await.unwrap();
        assert_eq!(
            b.get("checkpoints/shared/op/0-1-1-adopted-0.kv").await.unwrap(),
            data,
            "the link outlives the original"
        );

        let memory = Storage::open("memory://one/x").unwrap();
        let other = Storage { prefix: "y".into(), url: "memory://one/y".into(), ..memory.clone() };
        let streamed = memory.copy_from(&b, "checkpoints/shared/op/0-1-1-adopted-0.kv", "f").await.unwrap();
        assert_eq!(streamed, CopiedBy::Streaming(crate::FileDigest::of(&data)));
        assert_eq!(memory.get("f").await.unwrap(), data);
        assert_eq!(other.copy_from(&memory, "f", "g").await.unwrap(), CopiedBy::Store);
        assert_eq!(other.get("g").await.unwrap(), data);
        let back = a.copy_from(&other, "g", "h").await.unwrap();
        assert_eq!(back, CopiedBy::Streaming(crate::FileDigest::of(&data)));
        assert_eq!(a.get("h").await.unwrap(), data);
        // Another in-memory store is not the same store, whatever its name.
        let elsewhere = Storage::open("memory://one/y").unwrap();
        assert!(matches!(elsewhere.copy_from(&memory, "f", "f").await.unwrap(), CopiedBy::Streaming(_)));

        assert!(b.copies_cheaply_from(&a, u64::MAX), "one filesystem: links");
        assert!(other.copies_cheaply_from(&memory, COPY_IN_STORE_MAX), "one store");
        assert!(!other.copies_cheaply_from(&memory, COPY_IN_STORE_MAX + 1), "larger than a store copies");
        assert!(!elsewhere.copies_cheaply_from(&memory, 1) && !memory.copies_cheaply_from(&b, 1));
        assert!(!a.copies_cheaply_from(&memory, 1), "streamed");
        for (to, from) in [(&b, &a), (&memory, &b), (&other, &memory)] {
            let missing = to.copy_from(from, "nothing/here", "copy-of-nothing").await;
            assert!(matches!(missing, Err(StorageError::NotFound(_))), "{missing:?}");
            assert_eq!(to.size("copy-of-nothing").await.unwrap(), None);
        }
    }

    /// A directory is its root however it is named (a path, `file://`, a trailing slash, a
    /// `..` on the way), and not a directory inside it or next to it.
    #[test]
    fn a_root_is_the_same_however_it_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let job = dir.path().join("job");
        let open = |url: String| Storage::open(&url).unwrap();
        let root = open(job.display().to_string());
        for same in [
            format!("file://{}", job.display()),
            format!("{}/", job.display()),
            format!("{}/job/../job", dir.path().display()),
        ] {
            assert!(root.is_same_root(&open(same.clone())), "{same}");
        }
        for other in [job.join("checkpoints"), dir.path().join("job2"), dir.path().to_path_buf()] {
            assert!(!root.is_same_root(&open(other.display().to_string())), "{}", other.display());
        }
        let memory = open("memory://m".into());
        assert!(memory.is_same_root(&memory.clone()));
        assert!(!memory.is_same_root(&open("memory://m".into())), "another store of the same name");
    }

    /// The staging files a killed writer left (`<name>#<digits>`, at any depth) go once nobody
    /// has written them for the idle time; objects, recent staging files and other names stay,
    /// and listings are the same before and after. Another root's files are not touched.
    #[tokio::test]
    async fn abandoned_staging_files_are_discarded_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(&dir.path().join("job").display().to_string()).unwrap();
        for rel in ["checkpoints/chk-1/_metadata", "checkpoints/shared/op/0-1.kv", "out#put", "a#1b", "a#1#2"] {
            s.put(rel, Bytes::from_static(b"object")).await.unwrap();
        }
        let job = dir.path().join("job");
        let old = std::time::SystemTime::now() - Duration::from_secs(3600);
        let stale =
            ["checkpoints/chk-1/_metadata#4242000017", "checkpoints/shared/op/0-2.kv#7", "part-0-1-0#123456789"];
        let recent = "checkpoints/shared/op/0-3.kv#4242000018";
        for rel in stale.iter().chain([&recent]) {
            std::fs::write(job.join(rel), b"half of it").unwrap();
        }
        for rel in stale {
            std::fs::File::options().write(true).open(job.join(rel)).unwrap().set_modified(old).unwrap();
        }
        let elsewhere = dir.path().join("other#1");
        std::fs::write(&elsewhere, b"x").unwrap();
        std::fs::File::options().write(true).open(&elsewhere).unwrap().set_modified(old).unwrap();
        let listed = s.list("").await.unwrap();

        assert_eq!(s.discard_abandoned_staging(Duration::from_secs(60)).unwrap(), stale.len());
        for rel in stale {
            assert!(!job.join(rel).exists(), "{rel} is discarded");
        }
        assert!(job.join(recent).exists(), "a staging file written recently may be a writer's");
        assert!(elsewhere.exists(), "outside the root");
        assert_eq!(s.list("").await.unwrap(), listed);
        assert_eq!(s.discard_abandoned_staging(Duration::from_secs(60)).unwrap(), 0);
        assert_eq!(Storage::open("memory://m").unwrap().discard_abandoned_staging(Duration::ZERO).unwrap(), 0);
        for name in ["x#1", "x.kv#4242000017"] {
            assert!(crate::local::is_staging_name(name), "{name}");
        }
        for name in ["#1", "x#", "x#1a", "x", "a#1b", "a#1#2"] {
            assert!(!crate::local::is_staging_name(name), "{name}");
        }
    }

    /// A local object is linked, not copied, and the link's checksum is the object's; deleting
    /// the local file leaves the object. An in-memory store (as S3 would) is copied.
    #[tokio::test]
    async fn objects_fetched_to_local_files_match_and_deleting_the_file_keeps_the_object() {
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let dir = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        for s in [Storage::open(dir.path().to_str().unwrap()).unwrap(), Storage::open("memory://m").unwrap()] {
            s.put("chk-1/state", Bytes::from(data.clone())).await.unwrap();
            let local = work.path().join("copy");
            std::fs::write(&local, b"stale").unwrap();
            assert_eq!(s.get_to_file("chk-1/state", &local).await.unwrap(), crate::FileDigest::of(&data));
            assert_eq!(std::fs::read(&local).unwrap(), data);
            std::fs::remove_file(&local).unwrap();
            assert_eq!(s.get("chk-1/state").await.unwrap(), data);
        }
        let linked = dir.path().join("chk-1/state");
        let local = work.path().join("linked");
        Storage::open(dir.path().to_str().unwrap()).unwrap().get_to_file("chk-1/state", &local).await.unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(&local).unwrap().ino(), std::fs::metadata(&linked).unwrap().ino(), "linked");
    }

    /// `link_to_file` links a local object without reading it and gives its length; a missing
    /// object is not found, an object store links nothing, and deleting the link keeps the
    /// object.
    #[tokio::test]
    async fn local_objects_are_linked_unread_and_object_stores_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        s.put("chk-1/state", Bytes::from_static(b"twelve bytes")).await.unwrap();
        let local = work.path().join("link");
        std::fs::write(&local, b"stale").unwrap();
        assert_eq!(s.link_to_file("chk-1/state", &local).unwrap(), Some(12));
        assert_eq!(std::fs::read(&local).unwrap(), b"twelve bytes");
        std::fs::remove_file(&local).unwrap();
        assert_eq!(s.get("chk-1/state").await.unwrap(), &b"twelve bytes"[..]);
        assert!(matches!(s.link_to_file("chk-1/none", &local), Err(StorageError::NotFound(_))));
        let memory = Storage::open("memory://m").unwrap();
        memory.put("chk-1/state", Bytes::from_static(b"x")).await.unwrap();
        assert_eq!(memory.link_to_file("chk-1/state", &local).unwrap(), None);
    }

    /// A local file put as an object (linked on a filesystem, streamed elsewhere) stays the
    /// object once the local file is deleted; an older object under the name is replaced.
    #[tokio::test]
    async fn local_files_put_as_objects_outlive_the_file_and_replace_an_older_object() {
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 241) as u8).collect();
        let dir = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        for s in [Storage::open(dir.path().to_str().unwrap()).unwrap(), Storage::open("memory://m").unwrap()] {
            s.put("shared/op/0-1-1.staged", Bytes::from_static(b"older")).await.unwrap();
            let local = work.path().join("image");
            std::fs::write(&local, &data).unwrap();
            s.put_file("shared/op/0-1-1.staged", &local).await.unwrap();
            std::fs::remove_file(&local).unwrap();
            assert_eq!(s.get("shared/op/0-1-1.staged").await.unwrap(), data);
        }
    }

    #[tokio::test]
    async fn local_put_get_list_rename_delete() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        s.put("a/b/1", Bytes::from_static(b"x")).await.unwrap();
        s.put("a/c/2", Bytes::from_static(b"yy")).await.unwrap();
        assert_eq!(s.list("a").await.unwrap(), vec!["a/b/1", "a/c/2"]);
        assert_eq!(s.list_dirs("a").await.unwrap(), vec!["b", "c"]);
        assert_eq!(s.size("a/c/2").await.unwrap(), Some(2));
        s.rename("a/c/2", "a/c/3").await.unwrap();
        assert_eq!(&s.get("a/c/3").await.unwrap()[..], b"yy");
        assert!(matches!(s.get("a/c/2").await, Err(StorageError::NotFound(_))));
        s.delete_dir("a").await.unwrap();
        assert!(s.list("a").await.unwrap().is_empty());
        assert!(!dir.path().join("a").exists(), "emptied directories are removed too");
    }

    /// A file of several parts goes up whole and in order through an object store's multipart
    /// upload (parts in flight at once, the last one short), and an empty file as one empty
    /// object.
    #[tokio::test]
    async fn a_file_of_many_parts_is_one_object_with_its_bytes_in_order() {
        let work = tempfile::tempdir().unwrap();
        let s = Storage::open("memory:///").unwrap();
        let len = FILE_PART_BYTES * (FILE_PARTS_IN_FLIGHT + 2) + 12_345;
        let data: Vec<u8> = (0..len).map(|i| (i / 4096 % 251) as u8 ^ (i % 7) as u8).collect();
        let local = work.path().join("image");
        std::fs::write(&local, &data).unwrap();
        s.put_file("shared/op/merged.kv", &local).await.unwrap();
        let got = s.get("shared/op/merged.kv").await.unwrap();
        assert_eq!(got.len(), len);
        assert!(got[..] == data[..], "the object's bytes differ from the file's");
        std::fs::write(&local, b"").unwrap();
        s.put_file("shared/op/empty.kv", &local).await.unwrap();
        assert_eq!(s.size("shared/op/empty.kv").await.unwrap(), Some(0));
    }

    /// A local object of PARALLEL_READ_FROM bytes or more, read in parts at once, is its bytes and
    /// checksum; a smaller one too; a missing one is not found.
    #[tokio::test]
    async fn large_local_objects_read_in_parts_are_the_object_with_its_checksum() {
        let dir = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        // Parts that do not divide it evenly, a name object_store encodes.
        let len = PARALLEL_READ_FROM as usize + 12_345;
        let data: Vec<u8> = (0..len).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for name in ["state/big 100%.kv", "state/small.kv"] {
            let data = if name.contains("small") { data[..1000].to_vec() } else { data.clone() };
            s.put(name, Bytes::from(data.clone())).await.unwrap();
            let (read, crc) = s.get_with_crc32c(name, data.len() as u64).await.unwrap();
            assert!(read == data, "{name}: the object's bytes");
            assert_eq!(crc, crc32c::crc32c(&data), "{name}");
        }
        assert!(matches!(s.get_with_crc32c("state/none.kv", 10).await, Err(StorageError::NotFound(_))));
    }

    /// From an object store, an object read as ranges is its bytes and checksum whether its
    /// ranges divide it or not; one whose length is not the one given (even absurdly) is read
    /// whole (the caller's check then finds the length wrong); a missing one is not found. (The S3 server's
    /// test is in `runtime/tests/s3.rs`.)
    #[tokio::test]
    async fn objects_read_as_ranges_are_the_object_with_its_checksum() {
        let s = Storage::open("memory://").unwrap();
        let range = GET_RANGE_BYTES as usize;
        let data: Vec<u8> = (0..4 * range + 777).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in [RANGED_GET_FROM as usize - 1, RANGED_GET_FROM as usize, 3 * range, 4 * range + 777] {
            let name = format!("state/{len}.kv");
            s.put(&name, Bytes::copy_from_slice(&data[..len])).await.unwrap();
            let whole = (Bytes::copy_from_slice(&data[..len]), crc32c::crc32c(&data[..len]));
            assert_eq!(s.get_in_ranges(&name, len as u64).await.unwrap().as_ref(), Some(&whole), "{len} as ranges");
            assert!(!matches!(s.get_in_ranges(&name, len as u64 - 1).await, Ok(Some(_))), "{len} said one less");
            assert!(!matches!(s.get_in_ranges(&name, len as u64 + 1).await, Ok(Some(_))), "{len} said one more");
            // A damaged document's length sizes no buffer: the first range says it is wrong.
            assert!(matches!(s.get_in_ranges(&name, 1 << 50).await, Ok(None)), "{len} said to be a petabyte");
            let said = [len, len - 1, len + 1, 1 << 50];
            let reads = futures::future::try_join_all(said.map(|said| s.get_with_crc32c(&name, said as u64))).await;
            assert!(reads.unwrap().iter().all(|read| *read == whole), "{len} bytes, said right or not: read whole");
        }
        assert!(matches!(s.get_with_crc32c("state/none.kv", 3 * range as u64).await, Err(StorageError::NotFound(_))));
    }

    /// Names with characters object_store percent-encodes (`%`, `~`, `#`, spaces) are the
    /// same object whichever way it was written or read: Weir's own local writes, links and
    /// syncs name the file as object_store does.
    #[tokio::test]
    async fn names_object_store_encodes_are_one_object_on_a_local_root() {
        let dir = tempfile::tempdir().unwrap();
        let work = tempfile::tempdir().unwrap();
        let s = Storage::open(dir.path().to_str().unwrap()).unwrap();
        let name = "out/we~ird 100%#1x/part #2~.json";
        s.put(name, Bytes::from_static(b"put")).await.unwrap();
        assert_eq!(s.list("out").await.unwrap(), vec![name.to_string()]);
        assert_eq!(s.size(name).await.unwrap(), Some(3));
        assert_eq!(&s.store.get(&s.full(name)).await.unwrap().bytes().await.unwrap()[..], b"put");
        let local = work.path().join("file");
        std::fs::write(&local, b"put_file").unwrap();
        s.put_file(name, &local).await.unwrap();
        std::fs::remove_file(&local).unwrap();
        assert_eq!(&s.get(name).await.unwrap()[..], b"put_file");
        assert_eq!(s.get_to_file(name, &local).await.unwrap(), crate::FileDigest::of(b"put_file"));
        assert_eq!(s.list("out").await.unwrap(), vec![name.to_string()], "one object, not two");
        assert_eq!(s.list_dirs("out").await.unwrap(), vec!["we~ird 100%#1x".to_string()]);
        s.delete(name).await.unwrap();
        assert!(s.list("out").await.unwrap().is_empty());
        s.put(name, Bytes::from_static(b"again")).await.unwrap();
        s.delete_dir("out/we~ird 100%#1x").await.unwrap();
        assert!(std::fs::read_dir(dir.path().join("out")).unwrap().next().is_none(), "the directory is gone too");
    }

    #[tokio::test]
    async fn an_object_over_its_bound_is_not_read() {
        let dir = tempfile::tempdir().unwrap();
        for url in ["memory://bounded".to_string(), dir.path().display().to_string()] {
            let s = Storage::open(&url).unwrap();
            s.put("doc", Bytes::from_static(b"0123456789")).await.unwrap();
            assert_eq!(s.get_at_most("doc", 10).await.unwrap(), Ok(Bytes::from_static(b"0123456789")));
            assert_eq!(s.get_at_most("doc", 9).await.unwrap(), Err(10));
            assert!(matches!(s.get_at_most("none", 9).await, Err(StorageError::NotFound(_))));
        }
        assert_eq!(cloud_scheme("s3://b/p"), Some("s3"));
        assert_eq!(cloud_scheme("file:///x"), None);
        assert_eq!(cloud_scheme("/x/s3://y"), None);
    }

    #[tokio::test]
    async fn put_if_absent_refuses_a_second_writer() {
        for url in ["memory://", ""] {
            let dir = tempfile::tempdir().unwrap();
            let s = if url.is_empty() {
                Storage::open(dir.path().to_str().unwrap()).unwrap()
            } else {
                Storage::open(url).unwrap()
            };
            s.put_if_absent("x/claim", Bytes::from_static(b"1")).await.unwrap();
            assert!(
                matches!(
                    s.put_if_absent("x/claim", Bytes::from_static(b"2")).await,
                    Err(StorageError::AlreadyExists(_))
                ),
                "{url}"
            );
            assert_eq!(&s.get("x/claim").await.unwrap()[..], b"1", "{url}: the first write stays");
        }
    }

    #[test]
    fn s3_needs_credentials_from_the_environment() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert!(!s3_credentials_configured(env(&[])));
        assert!(!s3_credentials_configured(env(&[("AWS_ACCESS_KEY_ID", "a")])));
        assert!(s3_credentials_configured(env(&[("AWS_ACCESS_KEY_ID", "a"), ("AWS_SECRET_ACCESS_KEY", "b")])));
        assert!(s3_credentials_configured(env(&[("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/token")])));
        assert!(s3_credentials_configured(env(&[("WEIR_S3_INSTANCE_METADATA", "true")])));
    }

    fn env_of(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    /// Every scheme the CRD and job validation accept opens, configured from the job's
    /// environment (no request is made: building a store does no I/O).
    #[cfg(feature = "cloud")]
    #[test]
    fn gcs_and_azure_roots_open_with_their_settings() {
        let gcs = Storage::open_with_env("gs://weir-state/jobs/a", &env_of(&[("WEIR_GCS_INSTANCE_METADATA", "true")]))
            .expect("gs:// opens");
        assert_eq!(
            (gcs.url(), gcs.url_of("checkpoints")),
            ("gs://weir-state/jobs/a", "gs://weir-state/jobs/a/checkpoints".into())
        );
        assert_eq!(gcs.prefix, "jobs/a");
        let azure = env_of(&[("AZURE_STORAGE_ACCOUNT_NAME", "weiracct"), ("AZURE_STORAGE_ACCOUNT_KEY", "a2V5")]);
        let az = Storage::open_with_env("az://state/jobs", &azure).expect("az:// opens");
        assert_eq!(az.prefix, "jobs");
        let s3 = env_of(&[("AWS_ACCESS_KEY_ID", "a"), ("AWS_SECRET_ACCESS_KEY", "b"), ("AWS_REGION", "eu-west-1")]);
        assert_eq!(Storage::open_with_env("s3://b/p/q", &s3).expect("s3:// opens").prefix, "p/q");
    }

    #[cfg(feature = "cloud")]
    #[test]
    fn cloud_roots_without_credentials_or_bucket_are_refused_with_the_fix() {
        let refused = |url: &str, env: &[(&str, &str)]| match Storage::open_with_env(url, &env_of(env)) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("{url} opened"),
        };
        assert!(refused("gs://weir-state/jobs", &[]).contains("set GOOGLE_SERVICE_ACCOUNT_KEY"));
        assert!(refused("az://state", &[("AZURE_STORAGE_ACCOUNT_KEY", "a2V5")]).contains("AZURE_STORAGE_ACCOUNT_NAME"));
        assert!(refused("s3://b", &[]).contains("AWS_ACCESS_KEY_ID"));
        assert!(refused("gs:///jobs", &[("WEIR_GCS_INSTANCE_METADATA", "true")]).contains("needs a bucket: gs://"));
        assert!(refused("ftp://host/x", &[]).contains("unsupported scheme"));
    }

    #[cfg(not(feature = "cloud"))]
    #[test]
    fn cloud_roots_without_the_feature_are_refused_naming_it() {
        let env = env_of(&[("AWS_ACCESS_KEY_ID", "a"), ("AWS_SECRET_ACCESS_KEY", "b")]);
        let err = Storage::open_with_env("s3://b/p", &env).err().expect("refused").to_string();
        assert!(err.contains("no s3:// storage: build it with the `cloud` feature"), "{err}");
    }

    #[test]
    fn refuses_unknown_schemes() {
        assert!(matches!(Storage::open("ftp://x"), Err(StorageError::Open { .. })));
    }
}
