//! What a tenant's StreamJob may make the operator do with storage, decided without I/O.
//!
//! One operator serves every namespace, and a job's author may be hostile. Two rules keep a
//! tenant inside what its own credentials, or its namespace's share of the operator's storage,
//! can reach:
//!
//! - **Credentials are allow-listed.** Of a job's `credentialsSecret` the operator takes only
//!   the keys of [`CREDENTIAL_KEYS`] (static keys, region, endpoint); a Secret with any other
//!   key (a container credentials URI, a web-identity token file, an STS endpoint, a path to a
//!   key file...) is refused, naming the key. With a Secret, storage is opened with its keys
//!   only: the operator's own environment is never mixed in, so a tenant's endpoint never
//!   receives a request signed with the operator's identity.
//! - **Without its own credentials, a job stays within its namespace's roots**: the default
//!   storage's `<root>/<namespace>` and the roots the chart allows (`storage.allowedRoots`,
//!   each with `{namespace}`). Local paths (the operator's own filesystem) only ever there.
//!   `initialSavepoint` and every path the runtime reports are held to the same rule, before
//!   anything is read, so a refusal says nothing of what another tenant's path holds.

use std::collections::BTreeMap;

/// The keys of a credentials Secret that the operator takes: access key, secret, session
/// token, region and endpoint (S3); an inline service-account key (GCS); account name, key, SAS
/// token and endpoint (Azure). Everything else steers a credential provider (files, URIs, STS,
/// instance metadata) or the client, and is refused.
pub const CREDENTIAL_KEYS: [&str; 13] = [
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT",
    "AWS_ENDPOINT_URL",
    "AWS_ALLOW_HTTP",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_ENDPOINT",
];

/// Longest value of a credentials Secret key (a GCS service-account key is about 2.5 KiB).
pub const MAX_CREDENTIAL_BYTES: usize = 16 << 10;

/// The keys of a credentials Secret as the storage client's settings, or the keys refused
/// (sorted; their values are never repeated anywhere).
pub fn credential_env(data: &BTreeMap<String, Vec<u8>>) -> Result<Vec<(String, String)>, Vec<String>> {
    let refused: Vec<String> = data
        .iter()
        .filter(|(k, v)| !CREDENTIAL_KEYS.contains(&k.as_str()) || v.len() > MAX_CREDENTIAL_BYTES)
        .map(|(k, _)| k.clone())
        .collect();
    if !refused.is_empty() {
        return Err(refused);
    }
    Ok(data.iter().map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned())).collect())
}

/// The message of a Secret with refused keys.
pub fn refused_keys_message(secret: &str, refused: &[String]) -> String {
    format!(
        "spec.checkpointing.credentialsSecret.name: Secret `{secret}` has keys Weir does not take: {} (they \
         could steer where credentials come from; allowed: {})",
        refused.join(", "),
        CREDENTIAL_KEYS.join(", ")
    )
}

/// Whether `url` names an object store (not the operator's own filesystem).
pub fn is_object_store(url: &str) -> bool {
    weir_checkpoint::cloud_scheme(url).is_some()
}

/// A URL or path in one spelling: `file://` dropped, no trailing slash.
fn normal(url: &str) -> &str {
    url.strip_prefix("file://").unwrap_or(url).trim_end_matches('/')
}

/// Whether `path` is `root` or inside it (segment by segment: `s3://b/shop2` is not inside
/// `s3://b/shop`). Paths with `.`/`..` segments are refused before this is asked
/// (`weir_crds::streamjob::storage_url_problem`).
pub fn within(root: &str, path: &str) -> bool {
    let (root, path) = (normal(root), normal(path));
    path == root || path.strip_prefix(root).is_some_and(|rest| rest.starts_with('/'))
}

/// Which storage roots each namespace may use with the operator's own credentials.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoragePolicy {
    /// Root templates, each with `{namespace}`: the default storage's `<default>/{namespace}`
    /// first, then the chart's `storage.allowedRoots`.
    templates: Vec<String>,
}

/// Why a storage policy cannot be built.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// An allowed root without `{namespace}` would hand one root to every namespace.
    #[error("allowed storage root `{0}` has no {{namespace}}: every namespace would share it")]
    SharedRoot(String),
    /// A root with a `.`/`..` segment, a query or control characters.
    #[error("allowed storage root `{root}` {why}")]
    BadRoot {
        /// The root as given.
        root: String,
        /// What is wrong.
        why: &'static str,
    },
}

impl StoragePolicy {
    /// Each namespace's share of the default storage (jobs' files go under
    /// `<default>/<namespace>/<name>`), and nothing more until [`StoragePolicy::allow`].
    pub fn new(default_storage: &str) -> StoragePolicy {
        StoragePolicy { templates: vec![format!("{}/{{namespace}}", normal(default_storage))] }
    }

    /// This policy and further roots allowed per namespace, each a template with `{namespace}`.
    pub fn allow(mut self, allowed_roots: &[String]) -> Result<StoragePolicy, PolicyError> {
        for root in allowed_roots.iter().map(|r| r.trim()).filter(|r| !r.is_empty()) {
            if !root.contains("{namespace}") {
                return Err(PolicyError::SharedRoot(root.to_string()));
            }
            if let Some(why) = weir_crds::streamjob::storage_url_problem(&root.replace("{namespace}", "ns")) {
                return Err(PolicyError::BadRoot { root: root.to_string(), why });
            }
            self.templates.push(normal(root).to_string());
        }
        Ok(self)
    }

    /// The roots `namespace` may use with the operator's credentials.
    pub fn roots_for(&self, namespace: &str) -> Vec<String> {
        self.templates.iter().map(|t| t.replace("{namespace}", namespace)).collect()
    }

    /// Whether `url` is inside a root of `namespace`.
    pub fn allows(&self, namespace: &str, url: &str) -> bool {
        self.roots_for(namespace).iter().any(|root| within(root, url))
    }
}

/// Whose identity reads a job's storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageIdentity {
    /// The operator's own (its environment): only inside the namespace's allowed roots.
    Operator,
    /// The job's credentials Secret, its allow-listed keys and nothing else.
    Tenant(Vec<(String, String)>),
}

/// How long one read of a tenant's own storage (its endpoint, its credentials) may take in a
/// reconcile: an endpoint that never answers holds one of the operator's reconcile workers no
/// longer than this, then the job is retried with backoff.
pub const TENANT_STORAGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

impl StorageIdentity {
    /// Runs one storage `read` with this identity: a tenant's within [`TENANT_STORAGE_TIMEOUT`]
    /// (`Err` with the bound when it runs out), the operator's own (the chart's storage) with
    /// only the reconcile's deadline.
    pub async fn bounded<T>(&self, read: impl std::future::Future<Output = T>) -> Result<T, std::time::Duration> {
        match self {
            StorageIdentity::Operator => Ok(read.await),
            StorageIdentity::Tenant(_) => {
                tokio::time::timeout(TENANT_STORAGE_TIMEOUT, read).await.map_err(|_| TENANT_STORAGE_TIMEOUT)
            }
        }
    }

    /// The settings to open storage with.
    pub fn settings(&self) -> weir_checkpoint::CloudSettings<'_> {
        match self {
            StorageIdentity::Operator => weir_checkpoint::CloudSettings::Own,
            StorageIdentity::Tenant(keys) => weir_checkpoint::CloudSettings::Only(keys),
        }
    }
}

/// Whose identity may read `url` for a job of `namespace` (`tenant_keys`: its credentials
/// Secret's keys, when it names one), or why none may. `field` names the spec field in the
/// message. With its own credentials a job may name any object store; the operator's
/// credentials and filesystem serve only the namespace's roots.
pub fn storage_identity(
    policy: &StoragePolicy,
    namespace: &str,
    field: &str,
    url: &str,
    tenant_keys: Option<&[(String, String)]>,
) -> Result<StorageIdentity, String> {
    match tenant_keys {
        Some(keys) if is_object_store(url) || policy.allows(namespace, url) => {
            Ok(StorageIdentity::Tenant(keys.to_vec()))
        }
        None if policy.allows(namespace, url) => Ok(StorageIdentity::Operator),
        _ => Err(format!(
            "{field}: `{url}` is outside the storage namespace {namespace} may use ({}){}",
            policy.roots_for(namespace).join(", "),
            if is_object_store(url) { "; name a credentialsSecret to use storage of your own" } else { "" }
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(keys: &[(&str, &str)]) -> BTreeMap<String, Vec<u8>> {
        keys.iter().map(|(k, v)| (k.to_string(), v.as_bytes().to_vec())).collect()
    }

    #[test]
    fn only_allow_listed_credential_keys_are_taken() {
        let ok = credential_env(&data(&[("AWS_ACCESS_KEY_ID", "a"), ("AWS_SECRET_ACCESS_KEY", "b")])).unwrap();
        assert_eq!(ok.len(), 2);
        for steering in [
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_ENDPOINT_URL_STS",
            "AWS_PROFILE",
            "AWS_CONFIG_FILE",
            "GOOGLE_APPLICATION_CREDENTIALS",
            "GOOGLE_SERVICE_ACCOUNT_PATH",
            "AZURE_FEDERATED_TOKEN_FILE",
            "AZURE_AUTHORITY_HOST",
            "WEIR_S3_INSTANCE_METADATA",
        ] {
            let refused = credential_env(&data(&[("AWS_ACCESS_KEY_ID", "a"), (steering, "x")])).unwrap_err();
            assert_eq!(refused, [steering]);
            let message = refused_keys_message("keys", &refused);
            assert!(message.contains(steering) && !message.contains("=x"), "{message}");
        }
        let huge = "k".repeat(MAX_CREDENTIAL_BYTES + 1);
        assert_eq!(credential_env(&data(&[("AWS_SECRET_ACCESS_KEY", &huge)])).unwrap_err(), ["AWS_SECRET_ACCESS_KEY"]);
    }

    /// `kubectl explain` lists the keys a credentials Secret may hold: the same as taken here.
    #[test]
    fn the_crd_documents_every_allowed_key() {
        let crd = serde_yaml::to_string(&weir_crds::streamjob::crd()).unwrap();
        let documented = crd.split("credentialsSecret:").nth(1).unwrap().split("properties:").next().unwrap();
        for key in CREDENTIAL_KEYS {
            assert!(documented.contains(key), "{key} is not in credentialsSecret's description");
        }
    }

    #[test]
    fn within_goes_segment_by_segment() {
        assert!(within("s3://b/shop", "s3://b/shop"));
        assert!(within("s3://b/shop/", "s3://b/shop/j/savepoints/sp-1-2"));
        assert!(!within("s3://b/shop", "s3://b/shop2/j"));
        assert!(!within("s3://b/shop", "s3://b"));
        assert!(within("/var/weir/shop", "file:///var/weir/shop/j"));
        assert!(!within("/var/weir/shop", "/var/weir/shopping"));
    }

    #[test]
    fn a_namespace_uses_the_operators_credentials_only_within_its_roots() {
        let policy = StoragePolicy::new("s3://state/weir/").allow(&["s3://team-{namespace}/jobs".to_string()]).unwrap();
        assert_eq!(policy.roots_for("shop"), ["s3://state/weir/shop", "s3://team-shop/jobs"]);
        let identity = |url: &str, keys: Option<&[(String, String)]>| storage_identity(&policy, "shop", "f", url, keys);
        assert_eq!(identity("s3://state/weir/shop/orders", None), Ok(StorageIdentity::Operator));
        assert_eq!(identity("s3://team-shop/jobs/orders/savepoints/sp-1-1", None), Ok(StorageIdentity::Operator));
        // Another namespace's root, or a bucket of one's own without credentials: refused,
        // naming the roots this namespace has (not what is at the path).
        let other = identity("s3://state/weir/bank/payments/savepoints/sp-1-1", None).unwrap_err();
        assert!(other.starts_with("f: `s3://state/weir/bank/payments/savepoints/sp-1-1` is outside"), "{other}");
        assert!(other.contains("s3://state/weir/shop, s3://team-shop/jobs"), "{other}");
        assert!(identity("s3://mine/x", None).unwrap_err().contains("name a credentialsSecret"));
        // With credentials of its own: any object store, with those credentials only.
        let keys = vec![("AWS_ACCESS_KEY_ID".to_string(), "a".to_string())];
        assert_eq!(identity("s3://mine/x", Some(&keys)), Ok(StorageIdentity::Tenant(keys.clone())));
        assert_eq!(identity("s3://state/weir/shop/orders", Some(&keys)), Ok(StorageIdentity::Tenant(keys.clone())));
        // The operator's filesystem: never outside the roots, credentials or not.
        assert!(identity("/etc/weir", Some(&keys)).is_err());
        assert!(identity("/var/run/secrets/kubernetes.io/serviceaccount", None).is_err());
        let local = StoragePolicy::new("/var/weir");
        assert_eq!(storage_identity(&local, "shop", "f", "/var/weir/shop/j", None), Ok(StorageIdentity::Operator));
        assert!(storage_identity(&local, "shop", "f", "/var/weir/bank/j", None).is_err());
    }

    #[test]
    fn allowed_roots_must_be_per_namespace() {
        let shared = StoragePolicy::new("/var/weir").allow(&["s3://shared".to_string()]).unwrap_err();
        assert_eq!(shared, PolicyError::SharedRoot("s3://shared".into()));
        assert!(StoragePolicy::new("/var/weir").allow(&["s3://b/{namespace}/../x".to_string()]).is_err());
    }
}
