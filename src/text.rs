//! Small text helpers shared by parsers, descriptions and the CLI.

/// Removes ANSI escape sequences (CSI `ESC [ ... final`, and two-byte `ESC x`). restic writes
/// `ESC[2K` before some messages even into a pipe, which would defeat text matching.
pub fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('[') => {
                chars.next();
                // Parameters and intermediates, then one final byte in 0x40..=0x7e.
                for c in chars.by_ref() {
                    if ('\u{40}'..='\u{7e}').contains(&c) {
                        break;
                    }
                }
            }
            Some(_) => {
                chars.next();
            }
            None => {}
        }
    }
    out
}

/// Lossy UTF-8 of a record, ANSI stripped and trimmed of surrounding whitespace.
pub fn clean_line(bytes: &[u8]) -> String {
    let s = String::from_utf8_lossy(bytes);
    strip_ansi(&s).trim().to_string()
}

/// Human byte count in binary units, e.g. `1.5 GiB`.
pub fn format_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    format!("{v:.1} {}", UNITS[unit])
}

/// Short duration for ETAs: `45s`, `3m 20s`, `2h 5m`.
pub fn format_eta(secs: u64) -> String {
    match secs {
        s if s < 60 => format!("{s}s"),
        s if s < 3600 => format!("{}m {}s", s / 60, s % 60),
        s => format!("{}h {}m", s / 3600, (s % 3600) / 60),
    }
}

/// Truncates to at most `max` bytes on a char boundary, marking the cut.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Hides the password of URLs with credentials (`rest:https://user:secret@host/` ->
/// `rest:https://user:***@host/`): restic repeats the repository URL in its messages.
pub fn redact_url_credentials(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find("://") {
        let (head, tail) = rest.split_at(i + 3);
        out.push_str(head);
        let authority_end = tail
            .find(|c: char| c == '/' || c == '"' || c == '\'' || c.is_whitespace())
            .unwrap_or(tail.len());
        let authority = &tail[..authority_end];
        match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.split_once(':') {
                    Some((user, _password)) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    None => out.push_str(userinfo),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[authority_end..];
    }
    out.push_str(rest);
    out
}

/// Replaces every occurrence of each secret (of at least 4 bytes: shorter ones would hide
/// ordinary words) by `***`.
pub fn redact_secrets<S: AsRef<str>>(s: &str, secrets: &[S]) -> String {
    let mut out = s.to_string();
    for secret in secrets {
        let secret = secret.as_ref();
        if secret.len() >= 4 {
            out = out.replace(secret, "***");
        }
    }
    out
}

/// FNV-1a, 64 bits: stable across builds and Rust versions (std's hasher promises neither),
/// which a name or record that must be found again after an upgrade needs.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_url_passwords_only() {
        assert_eq!(
            redact_url_credentials(
                "no repository at rest:https://u:s3cr%40t@host:8000/repo: Get \"https://u:s3cr%40t@host:8000/repo/config\": x"
            ),
            "no repository at rest:https://u:***@host:8000/repo: Get \"https://u:***@host:8000/repo/config\": x"
        );
        assert_eq!(
            redact_url_credentials("s3:https://127.0.0.1:9000/bkt/restic/ns"),
            "s3:https://127.0.0.1:9000/bkt/restic/ns"
        );
        assert_eq!(
            redact_url_credentials("https://user@h/x"),
            "https://user@h/x"
        );
        assert_eq!(redact_url_credentials("plain text"), "plain text");
    }

    #[test]
    fn redacts_secret_values() {
        assert_eq!(
            redact_secrets("key AKIA123 and s/e+cret", &["AKIA123", "s/e+cret", "ab"]),
            "key *** and ***"
        );
    }

    #[test]
    fn strips_erase_line_and_colours() {
        assert_eq!(
            strip_ansi("\u{1b}[2Ksignal interrupt received, cleaning up"),
            "signal interrupt received, cleaning up"
        );
        assert_eq!(strip_ansi("\u{1b}[1;31mred\u{1b}[0m"), "red");
        assert_eq!(strip_ansi("trailing \u{1b}"), "trailing ");
    }

    #[test]
    fn formats() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1536), "1.5 KiB");
        assert_eq!(format_bytes(3 * 1024 * 1024 * 1024), "3.0 GiB");
        assert_eq!(format_eta(59), "59s");
        assert_eq!(format_eta(200), "3m 20s");
        assert_eq!(format_eta(7500), "2h 5m");
        assert_eq!(truncate("héllo", 2), "h…");
    }
}
