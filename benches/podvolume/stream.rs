//! Captured uploader output with timing (`testdata/restic-streams/*.stream`).
//!
//! Format: `#` lines are comments (how the stream was made). Every read the capturer got from
//! the child is one record: a header line `@<microseconds since start> <fd> <length>`, then
//! exactly `<length>` raw bytes, then `\n`. fd 1 is stdout, 2 is stderr.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Chunk {
    pub t: Duration,
    pub fd: u8,
    pub data: Vec<u8>,
}

pub fn load(path: &Path) -> Vec<Chunk> {
    let raw = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut out = Vec::new();
    let mut i = 0;
    while i < raw.len() {
        let eol = i + raw[i..].iter().position(|&b| b == b'\n').expect("header");
        let line = std::str::from_utf8(&raw[i..eol]).expect("utf-8 header");
        i = eol + 1;
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let mut f = line
            .strip_prefix('@')
            .unwrap_or_else(|| panic!("{}: bad header {line:?}", path.display()))
            .split(' ');
        let t: u64 = f.next().unwrap().parse().unwrap();
        let fd: u8 = f.next().unwrap().parse().unwrap();
        let len: usize = f.next().unwrap().parse().unwrap();
        out.push(Chunk {
            t: Duration::from_micros(t),
            fd,
            data: raw[i..i + len].to_vec(),
        });
        i += len + 1;
    }
    out
}

/// Every `*.stream` file in `dir`, sorted by name.
pub fn load_dir(dir: &Path) -> Vec<(String, Vec<Chunk>)> {
    let mut names: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "stream"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|p| {
            let name = p.file_stem().unwrap().to_string_lossy().to_string();
            (name, load(&p))
        })
        .collect()
}

/// Complete stdout lines with the time their last byte arrived.
pub fn stdout_lines(chunks: &[Chunk]) -> Vec<(Duration, Vec<u8>)> {
    let mut out = Vec::new();
    let mut cur = Vec::new();
    for c in chunks.iter().filter(|c| c.fd == 1) {
        for &b in &c.data {
            if b == b'\n' {
                out.push((c.t, std::mem::take(&mut cur)));
            } else {
                cur.push(b);
            }
        }
    }
    if !cur.is_empty() {
        out.push((chunks.last().map(|c| c.t).unwrap_or_default(), cur));
    }
    out
}

/// Runs `argv` in `cwd` and writes its output as a stream file. Reads use a 32 KiB buffer (as
/// Go's `io.Copy` that fed Velero's buffer did). `replace` pairs are applied to each read (path
/// normalisation). Returns the exit code.
pub fn capture(
    argv: &[String],
    cwd: &Path,
    env: &[(String, String)],
    out: &Path,
    comment: &str,
    replace: &[(String, String)],
) -> i32 {
    let mut cmd = Command::new(&argv[0]);
    cmd.args(&argv[1..])
        .current_dir(cwd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Only the variables we give: nothing of ours (RESTIC_PROGRESS_FPS, ...) leaks in.
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("RESTIC_") {
            cmd.env_remove(k);
        }
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let mut child = cmd.spawn().expect("spawn");
    let (tx, rx) = mpsc::channel::<(Duration, u8, Vec<u8>)>();
    let mut readers = Vec::new();
    let pipes: Vec<(u8, Box<dyn Read + Send>)> = vec![
        (1, Box::new(child.stdout.take().unwrap())),
        (2, Box::new(child.stderr.take().unwrap())),
    ];
    for (fd, mut pipe) in pipes {
        let tx = tx.clone();
        readers.push(std::thread::spawn(move || {
            let mut buf = vec![0u8; 32 * 1024];
            loop {
                match pipe.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        let _ = tx.send((start.elapsed(), fd, buf[..n].to_vec()));
                    }
                }
            }
        }));
    }
    drop(tx);
    let mut chunks: Vec<(Duration, u8, Vec<u8>)> = rx.iter().collect();
    for r in readers {
        r.join().unwrap();
    }
    let status = child.wait().unwrap();
    chunks.sort_by_key(|c| c.0);
    let mut f = std::io::BufWriter::new(std::fs::File::create(out).unwrap());
    for l in comment.lines() {
        writeln!(f, "# {l}").unwrap();
    }
    for (t, fd, mut data) in chunks {
        for (from, to) in replace {
            data = replace_bytes(&data, from.as_bytes(), to.as_bytes());
        }
        writeln!(f, "@{} {fd} {}", t.as_micros(), data.len()).unwrap();
        f.write_all(&data).unwrap();
        f.write_all(b"\n").unwrap();
    }
    f.flush().unwrap();
    status.code().unwrap_or(-1)
}

fn replace_bytes(data: &[u8], from: &[u8], to: &[u8]) -> Vec<u8> {
    if from.is_empty() {
        return data.to_vec();
    }
    let mut out = Vec::with_capacity(data.len());
    let mut i = 0;
    while i < data.len() {
        if data[i..].starts_with(from) {
            out.extend_from_slice(to);
            i += from.len();
        } else {
            out.push(data[i]);
            i += 1;
        }
    }
    out
}
