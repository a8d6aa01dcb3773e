//! A real S3 server for tests: moto's server mode (from PyPI, installed by
//! `scripts/install-moto.sh` into a private venv) on loopback, behind TLS with a certificate
//! signed by a CA generated for the test (openssl CLI). Signatures and IAM policies are enforced:
//! every user created here may use its own buckets only.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// moto's server program: `PODVOLUME_MOTO_SERVER`, else where `scripts/install-moto.sh` puts it.
pub fn moto_server() -> PathBuf {
    let path = std::env::var_os("PODVOLUME_MOTO_SERVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("target/test-tools/moto/bin/moto_server")
        });
    assert!(
        path.is_file(),
        "moto's S3 server is not installed at {}: run scripts/install-moto.sh \
         (or point PODVOLUME_MOTO_SERVER at a moto_server)",
        path.display()
    );
    path
}

/// An IAM user's access key.
#[derive(Debug, Clone)]
pub struct Keys {
    pub access_key_id: String,
    pub secret_access_key: String,
}

impl Keys {
    /// The AWS shared credentials file restic (and Velero's `cloud-credentials`) reads.
    pub fn credentials_file(&self) -> String {
        format!(
            "[default]\naws_access_key_id = {}\naws_secret_access_key = {}\n",
            self.access_key_id, self.secret_access_key
        )
    }
}

pub struct S3Server {
    child: Child,
    pub port: u16,
    pub dir: tempfile::TempDir,
    /// The CA that signed the server's certificate (PEM).
    pub ca_pem: PathBuf,
    pub users: BTreeMap<String, Keys>,
}

impl S3Server {
    /// Starts a server with `users`: `(user, buckets it owns)`.
    pub fn start(users: &[(&str, &[&str])]) -> S3Server {
        let server = moto_server();
        let dir = tempfile::Builder::new()
            .prefix("pva-s3-")
            .tempdir()
            .unwrap();
        let ca_pem = make_certificates(dir.path());
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // Requests before signatures are enforced: exactly those of moto_setup.py.
        let setup_requests: usize = users.iter().map(|(_, b)| 3 + b.len()).sum();
        let log = std::fs::File::create(dir.path().join("moto.log")).unwrap();
        let child = Command::new(&server)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .arg("-c")
            .arg(dir.path().join("server.pem"))
            .arg("-k")
            .arg(dir.path().join("server.key"))
            .env("INITIAL_NO_AUTH_ACTION_COUNT", setup_requests.to_string())
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let mut s = S3Server {
            child,
            port,
            dir,
            ca_pem,
            users: BTreeMap::new(),
        };
        s.wait_listening();
        let spec = serde_json::Value::Array(
            users
                .iter()
                .map(|(u, b)| serde_json::json!({"user": u, "buckets": b}))
                .collect(),
        );
        let python = server.with_file_name("python");
        let out = Command::new(&python)
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/s3/moto_setup.py"))
            .arg(s.endpoint())
            .arg(&s.ca_pem)
            .arg(spec.to_string())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "moto set-up failed: {}\nserver log:\n{}",
            String::from_utf8_lossy(&out.stderr),
            s.log()
        );
        let keys: BTreeMap<String, serde_json::Value> =
            serde_json::from_slice(&out.stdout).unwrap();
        s.users = keys
            .into_iter()
            .map(|(u, k)| {
                (
                    u,
                    Keys {
                        access_key_id: k["accessKeyId"].as_str().unwrap().to_string(),
                        secret_access_key: k["secretAccessKey"].as_str().unwrap().to_string(),
                    },
                )
            })
            .collect();
        s
    }

    fn wait_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("moto_server exited ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "moto_server not listening after 60 s:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("moto.log")).unwrap_or_default()
    }

    pub fn endpoint(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// A restic repository URL in `bucket` (as Velero's repoIdentifier: `s3:<s3Url>/<bucket>/...`).
    pub fn repo(&self, bucket: &str, path: &str) -> String {
        format!("s3:{}/{bucket}/{path}", self.endpoint())
    }

    pub fn keys(&self, user: &str) -> &Keys {
        &self.users[user]
    }

    /// Writes `user`'s credentials file into the server's directory.
    pub fn credentials_path(&self, user: &str) -> PathBuf {
        let p = self.dir.path().join(format!("credentials-{user}"));
        std::fs::write(&p, self.keys(user).credentials_file()).unwrap();
        p
    }

    /// `restic <args>` on `repo` as `user`, trusting this server's CA.
    pub fn restic(
        &self,
        user: &str,
        repo: &str,
        password_file: &Path,
        args: &[&str],
    ) -> std::process::Output {
        // The restic under test (its crate root re-exports `restic_bin` from tests/common).
        Command::new(super::restic_bin())
            .arg(format!("--cacert={}", self.ca_pem.display()))
            .arg(format!(
                "--cache-dir={}",
                self.dir.path().join("cache").display()
            ))
            .args(args)
            .env("RESTIC_REPOSITORY", repo)
            .env("RESTIC_PASSWORD_FILE", password_file)
            .env("AWS_SHARED_CREDENTIALS_FILE", self.credentials_path(user))
            .env_remove("AWS_ACCESS_KEY_ID")
            .env_remove("AWS_SECRET_ACCESS_KEY")
            .env_remove("AWS_PROFILE")
            .stdin(Stdio::null())
            .output()
            .unwrap()
    }

    /// The IDs of the snapshots `restic snapshots` lists in `repo`.
    pub fn snapshots(&self, user: &str, repo: &str, password_file: &Path) -> Vec<String> {
        let out = self.restic(user, repo, password_file, &["snapshots", "--json"]);
        assert!(
            out.status.success(),
            "restic snapshots: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let list: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
        list.iter()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect()
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A CA and a server certificate for 127.0.0.1 signed by it, in `dir` (`ca.pem`, `server.pem`,
/// `server.key`). Returns the CA's path.
fn make_certificates(dir: &Path) -> PathBuf {
    make_certificates_for(dir, "IP:127.0.0.1,DNS:localhost")
}

/// A CA (`ca.pem`, `ca.key`) and a server certificate it signs (`server.pem`, `server.key`) for
/// the subject alternative names `sans` (openssl's `IP:...,DNS:...`), in `dir`; the CA's path.
pub fn make_certificates_for(dir: &Path, sans: &str) -> PathBuf {
    let openssl = |args: &[&str]| {
        let out = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .output()
            .expect("the openssl CLI is needed to make the test CA");
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-subj",
        "/CN=podvolume-agent test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=127.0.0.1",
    ]);
    std::fs::write(
        dir.join("server.ext"),
        format!("subjectAltName={sans}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"),
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        "server.pem",
        "-extfile",
        "server.ext",
    ]);
    dir.join("ca.pem")
}
