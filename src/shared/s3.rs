//! An S3-compatible bucket (AWS S3, MinIO, Ceph RGW, any server of the S3 API) as a shared
//! tier's backend: object `name` is `prefix/name` in the bucket.
//!
//! Each call is one request (`exists` a HEAD, `read` a GET, `write` a single PUT, `remove`
//! a DELETE) made by Apache Arrow's `object_store` client on a small tokio runtime this
//! backend owns; the tier's thread that makes a call waits for its end. An S3 PUT publishes its
//! object whole or not at all, which is what `Backend::write` asks.
//!
//! Bounds: every call returns within the timeout given to `open`, a timeout error past it.
//! Within it the client retries, with exponential backoff, what may succeed on a second try
//! (5xx, throttling, a connection refused or dropped) and never a 4xx answer (403, 404).
//!
//! Credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN); else the
//! profile AWS_PROFILE (`default`) of AWS_SHARED_CREDENTIALS_FILE (`~/.aws/credentials`);
//! else what AWS provides the host (web identity, the container's or the instance's role).
//! They are never logged nor put in a message.
//!
//! Eviction is the bucket's own business (a lifecycle rule), not this backend's.

use super::backend::{Backend, Sink};
use super::S3Location;
use crate::error::{bail, Error, Result, Status};
use futures_util::StreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, PutPayload, RetryConfig};
use std::future::Future;
use std::time::{Duration, Instant};

/// Worker threads of the backend's runtime. The calls themselves run on the tier's threads
/// (`block_on`); these only drive the connections' background work.
const RUNTIME_THREADS: usize = 2;
/// Retries of one request, each after a backoff, all within the call's timeout.
const MAX_RETRIES: usize = 3;

pub struct S3Backend {
    store: AmazonS3,
    /// Without slashes at either end; empty: objects at the bucket's root.
    prefix: String,
    timeout: Duration,
    /// The endpoint's URL, or AWS's for the region: for messages.
    endpoint: String,
    what: String,
    /// Where the credentials came from, for messages: never the credentials themselves.
    credentials: String,
    /// Dropped last: the client's connections belong to it.
    runtime: tokio::runtime::Runtime,
}

/// Where the credentials came from, for messages: never the credentials themselves.
fn credentials(b: AmazonS3Builder) -> (AmazonS3Builder, String) {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if env("AWS_ACCESS_KEY_ID").is_some() && env("AWS_SECRET_ACCESS_KEY").is_some() {
        return (b, "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY".into());
    }
    let file = env("AWS_SHARED_CREDENTIALS_FILE")
        .map(std::path::PathBuf::from)
        .or_else(|| env("HOME").map(|h| std::path::Path::new(&h).join(".aws/credentials")));
    let profile = env("AWS_PROFILE").unwrap_or_else(|| "default".into());
    if let Some(file) = file {
        if let Ok(text) = std::fs::read_to_string(&file) {
            let keys = profile_keys(&text, &profile);
            let get = |k: &str| keys.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
            if let (Some(id), Some(secret)) = (get("aws_access_key_id"), get("aws_secret_access_key")) {
                let mut b = b.with_access_key_id(id).with_secret_access_key(secret);
                if let Some(token) = get("aws_session_token") {
                    b = b.with_token(token);
                }
                return (b, format!("profile {profile} of {}", file.display()));
            }
        }
    }
    (b, "the host's role (web identity, container or instance metadata)".into())
}

/// The `key = value` lines of section `[profile]` of an AWS credentials file.
fn profile_keys(text: &str, profile: &str) -> Vec<(String, String)> {
    let mut inside = false;
    let mut keys = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(section) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = section.trim() == profile;
        } else if let (true, Some((k, v))) = (inside, line.split_once('=')) {
            keys.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    keys
}

/// Whether the server refused the request's credentials (403 or 401).
fn refused(e: &object_store::Error) -> bool {
    matches!(e, object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. })
}

/// An object's bytes as they arrive, split for a sink: the first `header_len` gathered into
/// its header, the rest handed on as payload pieces.
struct Split<'a> {
    header: Vec<u8>,
    header_len: usize,
    sink: &'a mut dyn Sink,
    /// `false` once the sink wants no more.
    wanted: bool,
}

impl<'a> Split<'a> {
    fn new(header_len: usize, sink: &'a mut dyn Sink) -> Self {
        Split { header: Vec::with_capacity(header_len), header_len, sink, wanted: true }
    }

    /// Takes the next chunk of the body; whether the sink wants more.
    fn feed(&mut self, mut chunk: &[u8]) -> bool {
        if self.header.len() < self.header_len {
            let n = chunk.len().min(self.header_len - self.header.len());
            self.header.extend_from_slice(&chunk[..n]);
            chunk = &chunk[n..];
            if self.header.len() == self.header_len {
                self.wanted = self.sink.header(&self.header);
            }
        }
        if self.wanted && !chunk.is_empty() {
            self.wanted = self.sink.payload(chunk);
        }
        self.wanted
    }
}

impl S3Backend {
    /// Opens bucket `loc.bucket` and checks, with one GET of an object that is not there,
    /// that it exists and takes these credentials: a bucket that does not, credentials it
    /// refuses and an endpoint that does not answer are refused here, each with what to
    /// fix, not at the first put. Each call of the backend returns within `timeout`.
    pub fn open(loc: &S3Location, timeout: Duration) -> Result<S3Backend> {
        if loc.bucket.is_empty() {
            bail!(InvalidArg, "the shared tier's S3 bucket is empty; name a bucket");
        }
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let endpoint = if loc.endpoint.is_empty() { env("AWS_ENDPOINT_URL").unwrap_or_default() } else { loc.endpoint.clone() };
        let region = [Some(loc.region.clone()).filter(|r| !r.is_empty()), env("AWS_REGION"), env("AWS_DEFAULT_REGION")]
            .into_iter()
            .flatten()
            .next()
            .unwrap_or_else(|| "us-east-1".into());
        let prefix = loc.prefix.trim_matches('/').to_string();
        let shown = if endpoint.is_empty() { format!("AWS S3 ({region})") } else { endpoint.clone() };
        let what = format!("s3://{}/{prefix} at {shown}", loc.bucket);

        let options =
            ClientOptions::new().with_timeout(timeout).with_connect_timeout(timeout).with_allow_http(endpoint.starts_with("http://"));
        let retry = RetryConfig {
            backoff: BackoffConfig { init_backoff: Duration::from_millis(50), max_backoff: Duration::from_secs(1), base: 2.0 },
            max_retries: MAX_RETRIES,
            retry_timeout: timeout,
        };
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(&loc.bucket)
            .with_region(&region)
            .with_client_options(options)
            .with_retry(retry)
            // The object's header checksums its payload, so signing the payload would only
            // add a SHA-256 pass over every byte put.
            .with_unsigned_payload(true);
        b = if endpoint.is_empty() { b.with_virtual_hosted_style_request(true) } else { b.with_endpoint(&endpoint) };
        let (b, credentials) = credentials(b);
        let store = b.build().map_err(|e| Error::new(Status::InvalidArg, format!("the shared tier's S3 bucket {what}: {e}")))?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RUNTIME_THREADS)
            .thread_name("kvx-s3")
            .enable_all()
            .build()
            .map_err(|e| Error::io(format_args!("starting the threads of the S3 backend for {what}"), e))?;
        let s3 = S3Backend { store, prefix, timeout, endpoint: shown, what, credentials, runtime };

        let probe = s3.path(".kvxfer-probe");
        let (store, p) = (s3.store.clone(), probe.clone());
        match s3.bounded("opening", &probe, async move { store.get(&p).await.map(|_| ()) }) {
            Ok(Ok(_)) => {}
            Ok(Err(object_store::Error::NotFound { source, .. })) if source.to_string().contains("NoSuchBucket") => bail!(
                InvalidArg,
                "the shared tier's S3 bucket {} does not exist at {}; create it, or name an existing one",
                loc.bucket,
                s3.endpoint
            ),
            Ok(Err(object_store::Error::NotFound { .. })) => {}
            Ok(Err(e)) if refused(&e) => return Err(Error::new(Status::InvalidArg, s3.refused("opening", &e))),
            Ok(Err(e)) => {
                bail!(
                    Io,
                    "the shared tier's S3 endpoint {} cannot be reached with credentials from {} ({e}); check \
                     that it is up and its URL, and that credentials are set (AWS_ACCESS_KEY_ID and \
                     AWS_SECRET_ACCESS_KEY, or ~/.aws/credentials) where the host has no role",
                    s3.endpoint,
                    s3.credentials
                )
            }
            Err(e) => return Err(e),
        }
        log::debug!("shared tier: {} opened, credentials from {}", s3.what, s3.credentials);
        Ok(s3)
    }

    /// The client this backend makes its calls with, settings and credentials included:
    /// for measuring the client alone against the same bucket (the bench's limit).
    pub fn client(&self) -> AmazonS3 {
        self.store.clone()
    }

    fn path(&self, name: &str) -> Path {
        if self.prefix.is_empty() {
            Path::from(name)
        } else {
            Path::from(format!("{}/{name}", self.prefix))
        }
    }

    /// Runs `f` on the backend's runtime, giving up on it past the timeout (the call is
    /// then dropped). A failure that comes only once the timeout has passed (the client's
    /// own timer may fire first) is a timeout too. The request runs on the runtime's
    /// threads, where its connection's events arrive, and this thread waits for its end
    /// alone: awaited here instead, each chunk of a body would wake this thread from the
    /// runtime's, which cost more CPU than the bytes' copies.
    fn bounded<T: Send + 'static>(
        &self,
        op: &str,
        path: &Path,
        f: impl Future<Output = object_store::Result<T>> + Send + 'static,
    ) -> Result<object_store::Result<T>> {
        let t0 = Instant::now();
        let timed_out = |e: &dyn std::fmt::Display| {
            Error::new(
                Status::Timeout,
                format!(
                    "S3 {}: {op} {path} took longer than {:?} ({e}); check the endpoint is up and not overloaded",
                    self.what, self.timeout
                ),
            )
        };
        let call = self.runtime.spawn(f);
        let abort = call.abort_handle();
        match self.runtime.block_on(async { tokio::time::timeout(self.timeout, call).await }) {
            Err(e) => {
                abort.abort();
                Err(timed_out(&e))
            }
            Ok(Err(e)) => Err(Error::new(Status::Internal, format!("S3 {}: {op} {path} failed inside the client: {e}", self.what))),
            Ok(Ok(Err(e))) if !matches!(e, object_store::Error::NotFound { .. }) && t0.elapsed() >= self.timeout => Err(timed_out(&e)),
            Ok(Ok(r)) => Ok(r),
        }
    }

    /// What to tell the caller when the bucket refused these credentials (403, 401) for
    /// `op`: such an answer comes again on every try until the credentials or the bucket's
    /// policy change, so it is never retried.
    fn refused(&self, op: &str, e: &object_store::Error) -> String {
        format!(
            "the shared tier's S3 bucket {} refused the credentials of {} for {op} ({e}); kvxfer reads \
             AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, else profile AWS_PROFILE \
             (default) of AWS_SHARED_CREDENTIALS_FILE (~/.aws/credentials): set credentials the bucket \
             grants s3:GetObject, s3:PutObject, s3:DeleteObject and s3:ListBucket",
            self.what, self.credentials
        )
    }

    /// A call that failed with `e` within its bound (a 5xx after its retries, a refusal,
    /// a connection that could not be made or was dropped).
    fn failed(&self, op: &str, e: object_store::Error) -> Error {
        if refused(&e) {
            return Error::new(Status::Io, self.refused(op, &e));
        }
        Error::new(Status::Io, format!("S3 {}: {op} failed: {e}; check that the endpoint is up and not overloaded", self.what))
    }
}

impl Backend for S3Backend {
    fn describe(&self) -> String {
        self.what.clone()
    }

    fn exists(&self, name: &str) -> Result<bool> {
        let path = self.path(name);
        let (store, p) = (self.store.clone(), path.clone());
        match self.bounded("HEAD", &path, async move { store.head(&p).await })? {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(self.failed("HEAD", e)),
        }
    }

    fn read(&self, name: &str, header_len: usize, payload_len: usize, sink: &mut dyn Sink) -> Result<Option<u64>> {
        let path = self.path(name);
        let want = (header_len + payload_len) as u64;
        let (store, p) = (self.store.clone(), path.clone());
        // The object's length and its body's chunks (none when the length is not `want`),
        // handed to the sink on this thread.
        let got = async move {
            let r = match store.get(&p).await {
                Ok(r) => r,
                Err(object_store::Error::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(e),
            };
            let mut chunks = Vec::new();
            if r.meta.size != want {
                return Ok(Some((r.meta.size, chunks)));
            }
            let mut body = r.into_stream();
            let mut len = 0u64;
            while let Some(chunk) = body.next().await {
                let chunk = chunk?;
                len += chunk.len() as u64;
                chunks.push(chunk);
            }
            Ok(Some((len, chunks)))
        };
        let Some((len, chunks)) = self.bounded("GET", &path, got)?.map_err(|e| self.failed("GET", e))? else { return Ok(None) };
        if len == want {
            let mut split = Split::new(header_len, sink);
            for chunk in &chunks {
                if !split.feed(chunk) {
                    break;
                }
            }
        }
        Ok(Some(len))
    }

    fn write(&self, name: &str, header: &[u8], payload: &[u8]) -> Result<()> {
        let path = self.path(name);
        let mut body = Vec::with_capacity(header.len() + payload.len());
        body.extend_from_slice(header);
        body.extend_from_slice(payload);
        let (store, p) = (self.store.clone(), path.clone());
        self.bounded("PUT", &path, async move { store.put(&p, PutPayload::from(body)).await })?
            .map(|_| ())
            .map_err(|e| self.failed("PUT", e))
    }

    fn remove(&self, name: &str) -> Result<()> {
        let path = self.path(name);
        let (store, p) = (self.store.clone(), path.clone());
        match self.bounded("DELETE", &path, async move { store.delete(&p).await })? {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.failed("DELETE", e)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_splits_into_header_and_payload_pieces_until_the_sink_stops() {
        #[derive(Default)]
        struct Keep(Vec<u8>, Vec<Vec<u8>>);
        impl Sink for Keep {
            fn header(&mut self, h: &[u8]) -> bool {
                self.0 = h.to_vec();
                true
            }
            fn payload(&mut self, p: &[u8]) -> bool {
                self.1.push(p.to_vec());
                self.1.len() < 2
            }
        }
        let mut k = Keep::default();
        let mut split = Split::new(4, &mut k);
        assert!(split.feed(&[1, 2, 3]));
        assert!(split.feed(&[4, 5, 6]));
        assert!(!split.feed(&[7, 8]), "the sink wanted two pieces");
        assert!(!split.feed(&[9]));
        assert_eq!((k.0, k.1), (vec![1, 2, 3, 4], vec![vec![5, 6], vec![7, 8]]));
    }

    #[test]
    fn a_profile_is_read_from_its_own_section_only() {
        let text = "[other]\naws_access_key_id = A\n[ work ]\nAWS_ACCESS_KEY_ID=B\naws_secret_access_key = s = t\n";
        assert_eq!(
            profile_keys(text, "work"),
            [("aws_access_key_id".into(), "B".into()), ("aws_secret_access_key".into(), "s = t".into())]
        );
        assert!(profile_keys(text, "default").is_empty());
    }
}
