//! Client subcommands of the operations API: `operations`, `progress ID`, `cancel ID`.
//!
//! Plain HTTP/1.1 over a TCP connection (the agent serves plain HTTP on `--listen-address`); the
//! bearer token comes from `--token-file` or the current kubeconfig context, and is never printed.

use std::time::SystemTime;

use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::cli::{ClientArgs, OperationArgs, OutputFormat};
use crate::progress::OperationProgress;
use crate::text::format_bytes;

/// `podvolume-agent operations`.
pub async fn operations(args: ClientArgs) -> i32 {
    let answer = match call(&args, "GET", "/v1/operations").await {
        Ok(a) => a,
        Err(e) => return fail(&e),
    };
    if let Err(e) = answer.ok() {
        return fail(&e);
    }
    if args.output == OutputFormat::Json {
        println!("{}", pretty(&answer.body));
        return 0;
    }
    let list: List = match serde_json::from_slice(&answer.body) {
        Ok(l) => l,
        Err(e) => return fail(&format!("unexpected answer from the agent: {e}")),
    };
    print!("{}", operations_table(&list.items));
    0
}

/// `podvolume-agent progress ID`.
pub async fn progress(args: OperationArgs) -> i32 {
    let path = format!("/v1/operations/{}", encode_id(&args.id));
    let answer = match call(&args.client, "GET", &path).await {
        Ok(a) => a,
        Err(e) => return fail(&e),
    };
    if let Err(e) = answer.ok() {
        return fail(&e);
    }
    print_progress(&args, &answer.body, None)
}

/// `podvolume-agent cancel ID`.
pub async fn cancel(args: OperationArgs) -> i32 {
    let path = format!("/v1/operations/{}/cancel", encode_id(&args.id));
    let answer = match call(&args.client, "POST", &path).await {
        Ok(a) => a,
        Err(e) => return fail(&e),
    };
    if let Err(e) = answer.ok() {
        return fail(&e);
    }
    let note = if answer.status == 202 {
        format!("cancel requested: {} is stopping", args.id)
    } else {
        format!("{} had already finished; nothing to cancel", args.id)
    };
    print_progress(&args, &answer.body, Some(note))
}

fn fail(message: &str) -> i32 {
    eprintln!("error: {message}");
    1
}

fn pretty(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| serde_json::to_string_pretty(&v).ok())
        .unwrap_or_else(|| String::from_utf8_lossy(body).into_owned())
}

fn print_progress(args: &OperationArgs, body: &[u8], note: Option<String>) -> i32 {
    if args.client.output == OutputFormat::Json {
        println!("{}", pretty(body));
        return 0;
    }
    let p: OperationProgress = match serde_json::from_slice(body) {
        Ok(p) => p,
        Err(e) => return fail(&format!("unexpected answer from the agent: {e}")),
    };
    if let Some(n) = note {
        println!("{n}");
    }
    print!("{}", progress_table(&args.id, &p));
    0
}

// ----- rendering -----

#[derive(Debug, Deserialize)]
struct List {
    items: Vec<Item>,
}

#[derive(Debug, Deserialize)]
struct Item {
    id: String,
    kind: String,
    namespace: String,
    name: String,
    state: String,
    phase: String,
    progress: Option<OperationProgress>,
}

fn bytes_done(p: &OperationProgress) -> String {
    match p.percent() {
        Some(pct) => format!(
            "{} / {} ({pct:.1}%)",
            format_bytes(p.n_completed),
            format_bytes(p.n_total)
        ),
        None => format_bytes(p.n_completed),
    }
}

fn when(t: SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

fn operations_table(items: &[Item]) -> String {
    if items.is_empty() {
        return "no operations\n".to_string();
    }
    let mut rows = vec![[
        "ID".to_string(),
        "KIND".to_string(),
        "NAMESPACE/NAME".to_string(),
        "STATE".to_string(),
        "PHASE".to_string(),
        "PROGRESS".to_string(),
    ]];
    for i in items {
        rows.push([
            i.id.clone(),
            i.kind.clone(),
            format!("{}/{}", i.namespace, i.name),
            i.state.clone(),
            i.phase.clone(),
            i.progress.as_ref().map(bytes_done).unwrap_or_default(),
        ]);
    }
    let mut widths = [0usize; 6];
    for r in &rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in &rows {
        let mut line = String::new();
        for (i, (c, w)) in r.iter().zip(widths).enumerate() {
            if i + 1 == r.len() {
                line.push_str(c);
            } else {
                line.push_str(&format!("{c:<w$}   "));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

fn progress_table(id: &str, p: &OperationProgress) -> String {
    let mut out = String::new();
    let mut row = |k: &str, v: String| out.push_str(&format!("{k:<13}{v}\n"));
    row("Operation:", id.to_string());
    row("Completed:", p.completed.to_string());
    row("Progress:", bytes_done(p));
    row("Description:", p.description.clone());
    row("Started:", when(p.started));
    row("Updated:", when(p.updated));
    if !p.err.is_empty() {
        row("Error:", p.err.clone());
    }
    out
}

/// Percent-encodes an id for one path segment (`namespace/name` -> `namespace%2Fname`).
fn encode_id(id: &str) -> String {
    let mut s = String::new();
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

// ----- token -----

/// The bearer token: `--token-file`, else the current kubeconfig context's `token`/`tokenFile`.
/// `Ok(None)` when the kubeconfig has no token (an agent with `--api-auth=none` needs none).
fn token(args: &ClientArgs) -> Result<Option<String>, String> {
    if let Some(f) = &args.token_file {
        let t = std::fs::read_to_string(f)
            .map_err(|e| format!("cannot read the token file {}: {e}", f.display()))?;
        let t = t.trim().to_string();
        if t.is_empty() {
            return Err(format!("the token file {} is empty", f.display()));
        }
        return Ok(Some(t));
    }
    let kc = match &args.kubeconfig {
        Some(p) => kube::config::Kubeconfig::read_from(p)
            .map_err(|e| format!("kubeconfig {}: {e}", p.display()))?,
        None => match kube::config::Kubeconfig::read() {
            Ok(kc) => kc,
            Err(_) => return Ok(None),
        },
    };
    let Some(current) = kc.current_context.as_deref() else {
        return Ok(None);
    };
    let Some(user) = kc
        .contexts
        .iter()
        .find(|c| c.name == current)
        .and_then(|c| c.context.as_ref())
        .and_then(|c| c.user.clone())
    else {
        return Ok(None);
    };
    let Some(info) = kc
        .auth_infos
        .iter()
        .find(|a| a.name == user)
        .and_then(|a| a.auth_info.as_ref())
    else {
        return Ok(None);
    };
    // kube keeps the token as a secret string; its serialisation is the way to the value.
    let v = serde_json::to_value(info).unwrap_or_default();
    if let Some(t) = v["token"].as_str().filter(|t| !t.is_empty()) {
        return Ok(Some(t.to_string()));
    }
    if let Some(f) = v["tokenFile"].as_str().filter(|f| !f.is_empty()) {
        let t = std::fs::read_to_string(f)
            .map_err(|e| format!("cannot read the kubeconfig user's tokenFile {f}: {e}"))?;
        return Ok(Some(t.trim().to_string()));
    }
    Ok(None)
}

// ----- HTTP -----

struct Answer {
    status: u16,
    body: Vec<u8>,
    had_token: bool,
}

impl Answer {
    /// The agent's error message for a non-2xx answer.
    fn ok(&self) -> Result<(), String> {
        if (200..300).contains(&self.status) {
            return Ok(());
        }
        let message = serde_json::from_slice::<Value>(&self.body)
            .ok()
            .and_then(|v| v["message"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&self.body).trim().to_string());
        let hint = if self.status == 401 && !self.had_token {
            " (no token found: give --token-file, or use a kubeconfig context with a token)"
        } else {
            ""
        };
        Err(format!("{} {message}{hint}", self.status))
    }
}

/// Where the agent is: host:port and a path prefix.
fn parse_url(url: &str) -> Result<(String, String), String> {
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        format!("unsupported URL {url:?}: the agent serves plain HTTP (http://host:port)")
    })?;
    let (authority, prefix) = match rest.find('/') {
        Some(i) => (&rest[..i], rest[i..].trim_end_matches('/')),
        None => (rest, ""),
    };
    if authority.is_empty() {
        return Err(format!("no host in URL {url:?}"));
    }
    let authority = if authority
        .rsplit_once(':')
        .is_some_and(|(_, p)| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    Ok((authority, prefix.to_string()))
}

async fn call(args: &ClientArgs, method: &str, path: &str) -> Result<Answer, String> {
    let token = token(args)?;
    let (authority, prefix) = parse_url(&args.url)?;
    let host = authority.clone();
    let full = format!("{prefix}{path}");
    let had_token = token.is_some();
    let exchange = async move {
        let mut s = tokio::net::TcpStream::connect(&authority)
            .await
            .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
        let mut req = format!(
            "{method} {full} HTTP/1.1\r\nHost: {host}\r\nAccept: application/json\r\nContent-Length: 0\r\nConnection: close\r\nUser-Agent: podvolume-agent/{}\r\n",
            env!("CARGO_PKG_VERSION")
        );
        if let Some(t) = &token {
            req.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("cannot send the request: {e}"))?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf)
            .await
            .map_err(|e| format!("cannot read the answer: {e}"))?;
        parse_response(&buf)
    };
    let (status, body) = tokio::time::timeout(args.timeout, exchange)
        .await
        .map_err(|_| {
            format!(
                "no answer from {} in {}",
                args.url,
                humantime::format_duration(args.timeout)
            )
        })??;
    Ok(Answer {
        status,
        body,
        had_token,
    })
}

/// Status and body of an HTTP/1.1 response read to its end (content-length or chunked).
fn parse_response(buf: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("incomplete HTTP answer from the agent")?;
    let head = String::from_utf8_lossy(&buf[..end]);
    let rest = &buf[end + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status: u16 = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("not an HTTP answer: {status_line:?}"))?;
    let mut length = None;
    let mut chunked = false;
    for l in lines {
        if let Some((k, v)) = l.split_once(':') {
            let (k, v) = (k.trim(), v.trim());
            if k.eq_ignore_ascii_case("content-length") {
                length = v.parse::<usize>().ok();
            } else if k.eq_ignore_ascii_case("transfer-encoding")
                && v.to_ascii_lowercase().contains("chunked")
            {
                chunked = true;
            }
        }
    }
    let body = if chunked {
        dechunk(rest)?
    } else if let Some(n) = length {
        rest.get(..n)
            .ok_or("the agent's answer was cut short")?
            .to_vec()
    } else {
        rest.to_vec()
    };
    Ok((status, body))
}

fn dechunk(mut data: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = data
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("bad chunked encoding")?;
        let size_text = String::from_utf8_lossy(&data[..eol]);
        let size_text = size_text.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_text, 16).map_err(|_| "bad chunk size")?;
        data = &data[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        let chunk = data.get(..size).ok_or("the agent's answer was cut short")?;
        out.extend_from_slice(chunk);
        data = data.get(size + 2..).unwrap_or_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            parse_url("http://127.0.0.1:8085").unwrap(),
            ("127.0.0.1:8085".into(), "".into())
        );
        assert_eq!(
            parse_url("http://agent/x/").unwrap(),
            ("agent:80".into(), "/x".into())
        );
        assert!(parse_url("https://agent").is_err());
    }

    #[test]
    fn responses() {
        let r = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(r).unwrap(), (200, b"{}".to_vec()));
        let r = b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        assert_eq!(parse_response(r).unwrap(), (404, b"abcde".to_vec()));
        assert!(parse_response(b"HTTP/1.1 200 OK\r\n").is_err());
    }

    #[test]
    fn ids_are_one_segment() {
        assert_eq!(encode_id("velero/pvb-1"), "velero%2Fpvb-1");
        assert_eq!(encode_id("0f1e-22"), "0f1e-22");
    }
}
