//! TLS to a runtime's control API by a pinned certificate: the operator issues each job a
//! self-signed certificate (in the job's token Secret) and trusts, at a runtime's address,
//! that certificate and no other. No certificate authority is involved, and names are not
//! checked: a pod's address (a Service name, a pod IP) says nothing of whose pod answers, the
//! certificate's key does. A runtime of another job, reached at this job's address, cannot
//! prove it holds this job's key, so it never receives this job's token.
//!
//! One [`reqwest::Client`] serves every job ([`pinned_http_client`]): its verifier looks up
//! the fingerprint pinned for the host it connects to ([`Pins`]).

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, SignatureScheme};

use crate::ClientError;

/// SHA-256 of a certificate's DER encoding.
pub type Fingerprint = [u8; 32];

/// The fingerprint of a certificate in DER.
pub fn fingerprint(der: &[u8]) -> Fingerprint {
    let digest = ring::digest::digest(&ring::digest::SHA256, der);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

/// The fingerprint of the first certificate of a PEM text (`tls.crt`).
pub fn pem_fingerprint(pem: &[u8]) -> Result<Fingerprint, ClientError> {
    let der = CertificateDer::from_pem_slice(pem).map_err(|e| ClientError::Certificate(e.to_string()))?;
    Ok(fingerprint(der.as_ref()))
}

/// How a URL's host is named in [`Pins`]: a DNS name in lower case, an IP address without
/// brackets.
pub fn pin_host(url: &url::Url) -> Option<String> {
    match url.host()? {
        url::Host::Domain(d) => Some(d.trim_end_matches('.').to_ascii_lowercase()),
        url::Host::Ipv4(ip) => Some(ip.to_string()),
        url::Host::Ipv6(ip) => Some(ip.to_string()),
    }
}

/// The certificate fingerprint each runtime host must present, shared by a client's
/// connections and whoever learns the hosts (the operator, as it observes each job).
#[derive(Clone, Default, Debug)]
pub struct Pins(Arc<RwLock<HashMap<String, Fingerprint>>>);

impl Pins {
    /// Trusts `fingerprint`, and nothing else, at `host` (as [`pin_host`] names it).
    pub fn pin(&self, host: &str, fingerprint: Fingerprint) {
        let unchanged = self.0.read().unwrap_or_else(|e| e.into_inner()).get(host) == Some(&fingerprint);
        if !unchanged {
            self.0.write().unwrap_or_else(|e| e.into_inner()).insert(host.to_string(), fingerprint);
        }
    }

    /// Trusts `fingerprint` at the host of `url`; a URL without a host pins nothing.
    pub fn pin_url(&self, url: &str, fingerprint: Fingerprint) {
        if let Some(host) = url::Url::parse(url).ok().as_ref().and_then(pin_host) {
            self.pin(&host, fingerprint);
        }
    }

    /// Forgets `host`: nothing is trusted there until it is pinned again.
    pub fn unpin(&self, host: &str) {
        self.0.write().unwrap_or_else(|e| e.into_inner()).remove(host);
    }

    fn get(&self, host: &str) -> Option<Fingerprint> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).get(host).copied()
    }
}

/// Accepts a server's certificate when it is the one pinned for the host connected to; the
/// handshake's signatures are checked with that certificate's key as usual.
#[derive(Debug)]
struct PinVerifier {
    pins: Pins,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let host = match server_name {
            ServerName::DnsName(name) => name.as_ref().trim_end_matches('.').to_ascii_lowercase(),
            ServerName::IpAddress(ip) => std::net::IpAddr::from(*ip).to_string(),
            _ => return Err(rustls::Error::InvalidCertificate(CertificateError::NotValidForName)),
        };
        match self.pins.get(&host) {
            Some(pinned) if pinned == fingerprint(end_entity.as_ref()) => Ok(ServerCertVerified::assertion()),
            Some(_) => Err(rustls::Error::InvalidCertificate(CertificateError::ApplicationVerificationFailure)),
            None => Err(rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// The TLS configuration of a client that trusts only what `pins` holds.
pub fn pinned_tls_config(pins: Pins) -> Result<rustls::ClientConfig, ClientError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| ClientError::Certificate(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinVerifier { pins, provider }))
        .with_no_client_auth();
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_named_one_way() {
        let host = |u: &str| pin_host(&url::Url::parse(u).unwrap());
        assert_eq!(host("https://Job-Control.NS.svc.:8081").as_deref(), Some("job-control.ns.svc"));
        assert_eq!(host("https://10.0.0.7:8081").as_deref(), Some("10.0.0.7"));
        assert_eq!(host("https://[fd00::7]:8081").as_deref(), Some("fd00::7"));
    }

    #[test]
    fn only_the_pinned_certificate_is_accepted_at_its_host() {
        let pins = Pins::default();
        let verifier = PinVerifier { pins: pins.clone(), provider: Arc::new(rustls::crypto::ring::default_provider()) };
        let (mine, other) = (CertificateDer::from(vec![1u8, 2, 3]), CertificateDer::from(vec![4u8, 5, 6]));
        let name = ServerName::try_from("job-control.ns.svc").unwrap();
        let verify = |cert: &CertificateDer<'_>, name: &ServerName<'_>| {
            verifier.verify_server_cert(cert, &[], name, &[], UnixTime::now()).is_ok()
        };
        assert!(!verify(&mine, &name), "nothing is trusted before a pin");
        pins.pin_url("https://job-control.ns.svc:8081", fingerprint(mine.as_ref()));
        assert!(verify(&mine, &name));
        assert!(!verify(&other, &name), "another certificate at the pinned host");
        let elsewhere = ServerName::try_from("other-control.ns.svc").unwrap();
        assert!(!verify(&mine, &elsewhere), "the pin holds for its host only");
        pins.unpin("job-control.ns.svc");
        assert!(!verify(&mine, &name));
    }
}
