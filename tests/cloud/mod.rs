//! Real Azure Blob and Google Cloud Storage servers for tests: Azurite (Microsoft's emulator, an
//! npm package) and fake-gcs-server (a Go module), both installed by
//! `scripts/install-cloud-emulators.sh`, each on loopback behind TLS with a certificate signed by
//! a CA made for the test (the openssl CLI, as the S3 tests).
//!
//! Azure is reached as in production, at `https://<account>.blob.<domain>:<port>`: the only form
//! restic (`AZURE_ENDPOINT_SUFFIX`) and the kopia CLI (`--storage-domain`) can address. The name
//! resolves to loopback in a mount namespace of the process under test whose `/etc/hosts` says
//! so (`Azurite::command`), so the machine's own `/etc/hosts` is never touched.
#![allow(dead_code)]

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::s3::make_certificates_for;

/// A program the tests need: `$var`, else the path `scripts/install-cloud-emulators.sh` (or
/// `install-restic.sh`) prints, which test.sh exports.
fn tool(var: &str, what: &str) -> PathBuf {
    let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
        panic!("{var} is not set: run scripts/install-cloud-emulators.sh and scripts/install-restic.sh, and point {var} at {what} (scripts/test.sh does)")
    });
    assert!(path.is_file(), "{var}={} does not exist", path.display());
    path
}

pub fn azurite_blob() -> PathBuf {
    tool("PODVOLUME_AZURITE_BLOB", "azurite-blob")
}

pub fn fake_gcs_server() -> PathBuf {
    tool("PODVOLUME_FAKE_GCS_SERVER", "fake-gcs-server")
}

/// restic with every backend (Debian's 0.18 has no Azure backend; its 0.14 reaches no Azure
/// endpoint but Azure's own).
pub fn cloud_restic() -> PathBuf {
    tool(
        "PODVOLUME_CLOUD_RESTIC",
        "restic built by scripts/install-restic.sh",
    )
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn wait_listening(child: &mut Child, port: u16, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "the emulator exited ({status}): {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "the emulator is not listening on {port}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The domain the Azure account is reached under (its name resolves to 127.0.0.1 only in the
/// namespace `Azurite::command` makes).
pub const AZURE_DOMAIN: &str = "blob.localhost";

pub struct Azurite {
    child: Child,
    pub port: u16,
    pub dir: tempfile::TempDir,
    pub ca_pem: PathBuf,
    pub account: String,
    /// base64, as Azure shows account keys.
    pub key: String,
    hosts: PathBuf,
}

impl Azurite {
    /// Azurite with one account of its own (`AZURITE_ACCOUNTS`), key random, and `containers`.
    pub fn start(containers: &[&str]) -> Azurite {
        let dir = tempfile::Builder::new()
            .prefix("pva-azurite-")
            .tempdir()
            .unwrap();
        let ca_pem = make_certificates_for(
            dir.path(),
            &format!("IP:127.0.0.1,DNS:localhost,DNS:*.{AZURE_DOMAIN}"),
        );
        let account = "pvtestacct".to_string();
        let key = {
            use std::io::Read;
            let mut b = [0u8; 64];
            std::fs::File::open("/dev/urandom")
                .unwrap()
                .read_exact(&mut b)
                .unwrap();
            serde_json::to_value(k8s_openapi::ByteString(b.to_vec()))
                .unwrap()
                .as_str()
                .unwrap()
                .to_string()
        };
        let port = free_port();
        let log_path = dir.path().join("azurite.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let mut child = Command::new(azurite_blob())
            .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
            .arg("--location")
            .arg(dir.path().join("data"))
            .arg("--cert")
            .arg(dir.path().join("server.pem"))
            .arg("--key")
            .arg(dir.path().join("server.key"))
            .args(["--skipApiVersionCheck", "--loose"])
            .env("AZURITE_ACCOUNTS", format!("{account}:{key}"))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("azurite-blob could not be started");
        wait_listening(&mut child, port, &log_path);
        let hosts = dir.path().join("hosts");
        std::fs::write(
            &hosts,
            format!("127.0.0.1 localhost\n127.0.0.1 {account}.{AZURE_DOMAIN}\n"),
        )
        .unwrap();
        let a = Azurite {
            child,
            port,
            dir,
            ca_pem,
            account,
            key,
            hosts,
        };
        for c in containers {
            a.container("create", c, "").unwrap();
        }
        a
    }

    /// `AZURE_ENDPOINT_SUFFIX` (restic's; the agent derives kopia's domain from it): the account
    /// is at `https://<account>.blob.<suffix>`.
    pub fn endpoint_suffix(&self) -> String {
        format!("localhost:{}", self.port)
    }

    /// The account's URL as Velero's `config.storageAccountURI` gives it.
    pub fn account_uri(&self) -> String {
        format!("https://{}.{AZURE_DOMAIN}:{}", self.account, self.port)
    }

    /// `program` in a mount namespace of its own where `/etc/hosts` resolves the account's name
    /// to loopback (needs root, as the test command runs).
    pub fn command(&self, program: &Path) -> Command {
        let w = self.wrapper();
        let mut c = Command::new(&w[0]);
        c.args(&w[1..]).arg(program);
        c
    }

    /// The argv that runs a program (appended with its arguments) in that namespace.
    pub fn wrapper(&self) -> Vec<std::ffi::OsString> {
        let mut w: Vec<std::ffi::OsString> =
            ["unshare", "--mount", "--propagation", "private", "sh", "-c"]
                .iter()
                .map(Into::into)
                .collect();
        w.push(r#"mount --bind "$0" /etc/hosts && exec "$@""#.into());
        w.push(self.hosts.clone().into_os_string());
        w
    }

    /// `helper verb container` through the Blob REST API, path-style on 127.0.0.1; the output's
    /// lines for `list`.
    pub fn container(
        &self,
        verb: &str,
        container: &str,
        prefix: &str,
    ) -> Result<Vec<String>, String> {
        let out = Command::new("python3")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/cloud/azure_container.py"))
            .arg(verb)
            .arg(format!("https://127.0.0.1:{}/{}", self.port, self.account))
            .arg(&self.account)
            .arg(&self.key)
            .arg(container)
            .arg(&self.ca_pem)
            .arg(prefix)
            .output()
            .unwrap();
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(str::to_string)
                .collect())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).to_string())
        }
    }

    /// The blobs under `prefix` in `container`.
    pub fn blobs(&self, container: &str, prefix: &str) -> Vec<String> {
        self.container("list", container, prefix).unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("azurite.log")).unwrap_or_default()
    }
}

impl Drop for Azurite {
    fn drop(&mut self) {
        // node and its workers: the whole group.
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = self.child.wait();
    }
}

pub struct FakeGcs {
    child: Child,
    pub port: u16,
    pub dir: tempfile::TempDir,
    pub ca_pem: PathBuf,
    /// A service-account key file as Google issues them (its own RSA key; the emulator checks
    /// no credentials): what Velero's `cloud-credentials` holds for GCP.
    pub service_account: PathBuf,
}

impl FakeGcs {
    /// fake-gcs-server over TLS with a filesystem backend, and `buckets`.
    pub fn start(buckets: &[&str]) -> FakeGcs {
        let dir = tempfile::Builder::new()
            .prefix("pva-fakegcs-")
            .tempdir()
            .unwrap();
        let ca_pem = make_certificates_for(dir.path(), "IP:127.0.0.1,DNS:localhost");
        let port = free_port();
        let log_path = dir.path().join("fake-gcs-server.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let url = format!("https://127.0.0.1:{port}");
        let mut child = Command::new(fake_gcs_server())
            .args([
                "-scheme",
                "https",
                "-host",
                "127.0.0.1",
                "-port",
                &port.to_string(),
            ])
            .args(["-backend", "filesystem", "-filesystem-root"])
            .arg(dir.path().join("data"))
            .args([
                "-public-host",
                &format!("127.0.0.1:{port}"),
                "-external-url",
                &url,
            ])
            .arg("-cert-location")
            .arg(dir.path().join("server.pem"))
            .arg("-private-key-location")
            .arg(dir.path().join("server.key"))
            .args(["-log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .expect("fake-gcs-server could not be started");
        wait_listening(&mut child, port, &log_path);
        let service_account = dir.path().join("service-account.json");
        std::fs::write(&service_account, service_account_json(dir.path())).unwrap();
        let g = FakeGcs {
            child,
            port,
            dir,
            ca_pem,
            service_account,
        };
        for b in buckets {
            let body = g.curl(
                &["-X", "POST", "-d", &format!("{{\"name\":\"{b}\"}}")],
                "/storage/v1/b?project=test",
            );
            assert!(
                body.contains(&format!("\"name\":\"{b}\"")),
                "creating bucket {b}: {body}"
            );
        }
        g
    }

    /// `STORAGE_EMULATOR_HOST`: where Google's Go clients (kopia's, restic's) go instead of
    /// storage.googleapis.com, without authenticating.
    pub fn emulator_host(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    fn curl(&self, args: &[&str], path: &str) -> String {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "30", "--cacert"])
            .arg(&self.ca_pem)
            .args(args)
            .arg(format!("{}{path}", self.emulator_host()))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "curl: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    /// The objects under `prefix` in `bucket`.
    pub fn objects(&self, bucket: &str, prefix: &str) -> Vec<String> {
        let body = self.curl(&[], &format!("/storage/v1/b/{bucket}/o?prefix={prefix}"));
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["items"]
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .filter_map(|i| i["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for FakeGcs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A service-account key file with a fresh RSA key (openssl), for project `podvolume-test`.
pub fn service_account_json(dir: &Path) -> String {
    let out = Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
        ])
        .current_dir(dir)
        .output()
        .expect("openssl");
    assert!(out.status.success());
    serde_json::json!({
        "type": "service_account",
        "project_id": "podvolume-test",
        "private_key_id": "0123456789abcdef",
        "private_key": String::from_utf8(out.stdout).unwrap(),
        "client_email": "velero@podvolume-test.iam.gserviceaccount.com",
        "client_id": "1",
        "token_uri": "https://oauth2.googleapis.com/token",
    })
    .to_string()
}
