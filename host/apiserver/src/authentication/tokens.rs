//! Static bearer tokens in Kubernetes' token file format (kube-apiserver's
//! `--token-auth-file`): one CSV record per line,
//!
//! ```text
//! token,user,uid,"group1,group2"
//! ```
//!
//! with at least the first three columns; the groups column is optional and extra
//! columns are ignored. Blank lines and lines starting with `#` are skipped. Fields
//! may be double-quoted (a quote inside is written `""`), which the groups column
//! needs as soon as it holds more than one group.

use std::fmt;
use std::path::Path;

use anyhow::{Context as _, anyhow, bail, ensure};
use base64::Engine as _;
use trellis_api::UserInfo;
use trellis_api::user::groups::MASTERS;

use trellis_pki::create_file_atomic;

/// The user [`ensure_admin_token`] creates a token for.
const ADMIN_USER: &str = "admin";
/// The token file holds credentials: readable by its owner alone.
const TOKEN_FILE_MODE: u32 = 0o600;
/// Random bytes per generated token: 256 bits, beyond guessing.
const TOKEN_BYTES: usize = 32;

/// The tokens of a token file and the users they authenticate.
pub struct TokenFile {
    entries: Vec<Entry>,
}

struct Entry {
    token: String,
    user: UserInfo,
}

// Written by hand so that tokens never end up in logs.
impl fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let users: Vec<&str> = self.entries.iter().map(|e| e.user.name.as_str()).collect();
        f.debug_struct("TokenFile").field("users", &users).finish()
    }
}

impl TokenFile {
    /// Reads and parses a token file. Errors name the file and, for a bad record,
    /// the line.
    pub fn load(path: &Path) -> anyhow::Result<TokenFile> {
        let contents =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        TokenFile::parse(&contents).with_context(|| format!("parse {}", path.display()))
    }

    /// Parses the contents of a token file. Errors name the line.
    pub fn parse(contents: &str) -> anyhow::Result<TokenFile> {
        let mut entries: Vec<Entry> = Vec::new();
        for (index, line) in contents.lines().enumerate() {
            let number = index + 1;
            let trimmed = line.trim_start();
            if trimmed.is_empty() || trimmed.starts_with('#') {
                continue;
            }
            let entry = parse_entry(line).with_context(|| format!("line {number}"))?;
            // A token naming two users would authenticate as whichever came last, a
            // mistake better caught at load.
            if entries
                .iter()
                .any(|e| constant_time_eq(e.token.as_bytes(), entry.token.as_bytes()))
            {
                bail!("line {number}: duplicate token");
            }
            entries.push(entry);
        }
        Ok(TokenFile { entries })
    }

    /// The user `token` authenticates, if any.
    ///
    /// Compares against every token in constant time per byte, so the time taken
    /// reveals neither which token nor how much of one matched.
    pub fn lookup(&self, token: &str) -> Option<&UserInfo> {
        let mut found = None;
        for entry in &self.entries {
            if constant_time_eq(entry.token.as_bytes(), token.as_bytes()) {
                found = Some(&entry.user);
            }
        }
        found
    }

    /// The number of tokens.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The first token of user `admin` in group `system:masters`.
    fn admin_token(&self) -> Option<&str> {
        self.entries
            .iter()
            .find(|e| e.user.name == ADMIN_USER && e.user.in_group(MASTERS))
            .map(|e| e.token.as_str())
    }
}

/// Returns the admin token from the token file at `path`, first creating the file
/// (mode 0600) with one random token for user `admin` in group `system:masters` if it
/// does not exist. Fails if the file exists but holds no such token.
pub fn ensure_admin_token(path: &Path) -> anyhow::Result<String> {
    let exists = path
        .try_exists()
        .with_context(|| format!("check whether {} exists", path.display()))?;
    if !exists {
        let token = generate_token();
        let contents = format!(
            "# Static bearer tokens: token,user,uid,\"group1,group2\"\n\
             {token},{ADMIN_USER},{ADMIN_USER},\"{MASTERS}\"\n"
        );
        if create_file_atomic(path, contents.as_bytes(), TOKEN_FILE_MODE)? {
            tracing::info!(file = %path.display(), "created admin token");
            return Ok(token);
        }
        // Another process created it first: use theirs.
    }
    let file = TokenFile::load(path)?;
    file.admin_token().map(str::to_owned).ok_or_else(|| {
        anyhow!(
            "{} has no token for user {ADMIN_USER} in group {MASTERS}",
            path.display()
        )
    })
}

/// A random token: base64url, so it needs no quoting in CSV, YAML or a header.
fn generate_token() -> String {
    let bytes: [u8; TOKEN_BYTES] = rand::random();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn parse_entry(line: &str) -> anyhow::Result<Entry> {
    let fields = parse_record(line)?;
    let [token, name, uid, rest @ ..] = fields.as_slice() else {
        bail!(
            "expected at least 3 columns (token, user name, user uid), found {}",
            fields.len()
        );
    };
    ensure!(!token.is_empty(), "empty token");
    ensure!(!name.is_empty(), "empty user name");
    let groups = rest
        .first()
        .map(|groups| {
            groups
                .split(',')
                .map(str::trim)
                .filter(|g| !g.is_empty())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    Ok(Entry {
        token: token.clone(),
        user: UserInfo {
            name: name.clone(),
            uid: uid.clone(),
            groups,
            extra: Default::default(),
        },
    })
}

/// Splits one CSV record as Go's encoding/csv does with `TrimLeadingSpace`: leading
/// whitespace of a field is dropped, a field may be double-quoted with `""` for a
/// quote, and a quote anywhere else is an error.
fn parse_record(line: &str) -> anyhow::Result<Vec<String>> {
    let mut fields = Vec::new();
    let mut chars = line.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut field = String::new();
        if chars.next_if_eq(&'"').is_some() {
            loop {
                match chars.next() {
                    Some('"') if chars.next_if_eq(&'"').is_some() => field.push('"'),
                    Some('"') => break,
                    Some(c) => field.push(c),
                    None => bail!("unterminated quoted field"),
                }
            }
            fields.push(field);
            match chars.next() {
                None => return Ok(fields),
                Some(',') => {}
                Some(c) => bail!("unexpected {c:?} after a quoted field"),
            }
        } else {
            loop {
                match chars.next() {
                    None => {
                        fields.push(field);
                        return Ok(fields);
                    }
                    Some(',') => break,
                    Some('"') => bail!("quote in an unquoted field"),
                    Some(c) => field.push(c),
                }
            }
            fields.push(field);
        }
    }
}

/// Byte-wise equality whose time depends on the lengths alone, never on where the
/// inputs first differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        let x = a.get(i).copied().unwrap_or(0);
        let y = b.get(i).copied().unwrap_or(0);
        diff |= x ^ y;
    }
    // Keeps the optimiser from turning the accumulation into an early exit.
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_err(contents: &str) -> String {
        format!("{:#}", TokenFile::parse(contents).unwrap_err())
    }

    #[test]
    fn parses_records_with_quoted_groups() {
        let file = TokenFile::parse(
            "# comment\n\
             \n\
             t1,alice,uid-1,\"system:masters,dev\"\n\
             t2,bob,uid-2\r\n\
             \x20\x20# indented comment\n\
             t3, carol , uid-3 , ops , ignored\n\
             \"t,4\",\"dan \"\"the man\"\"\",uid-4,\"\"\n",
        )
        .unwrap();
        assert_eq!(file.len(), 4);
        assert_eq!(
            file.lookup("t1"),
            Some(&UserInfo {
                name: "alice".into(),
                uid: "uid-1".into(),
                groups: vec!["system:masters".into(), "dev".into()],
                ..UserInfo::default()
            })
        );
        assert_eq!(
            file.lookup("t2"),
            Some(&UserInfo {
                name: "bob".into(),
                uid: "uid-2".into(),
                groups: vec![],
                ..UserInfo::default()
            })
        );
        // Leading whitespace is dropped, trailing kept, as Go's csv does.
        let carol = file.lookup("t3").unwrap();
        assert_eq!(carol.name, "carol ");
        assert_eq!(carol.groups, ["ops"]);
        assert_eq!(file.lookup("t,4").unwrap().name, "dan \"the man\"");
        assert!(file.lookup("t,4").unwrap().groups.is_empty());
    }

    #[test]
    fn lookup_needs_the_exact_token() {
        let file = TokenFile::parse("secret,alice,1\n").unwrap();
        assert!(file.lookup("secret").is_some());
        for wrong in ["", "s", "secre", "secreT", "secrets", "secret ", "xsecret"] {
            assert_eq!(file.lookup(wrong), None, "{wrong:?}");
        }
    }

    #[test]
    fn bad_lines_name_the_line() {
        assert!(parse_err("a,b,c\nonly,two\n").contains("line 2"));
        assert!(parse_err("only,two\n").contains("at least 3 columns"));
        assert!(parse_err("# c\n,user,uid\n").contains("line 2: empty token"));
        assert!(parse_err("tok,,uid\n").contains("empty user name"));
        assert!(parse_err("tok,user,uid,\"g1,g2\n").contains("unterminated"));
        assert!(parse_err("tok,us\"er,uid\n").contains("quote"));
        assert!(parse_err("tok,\"user\"x,uid\n").contains("after a quoted field"));
        assert!(parse_err("t,a,1\nt,b,2\n").contains("line 2: duplicate token"));
    }

    #[test]
    fn load_errors_name_the_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.csv");
        std::fs::write(&path, "ok,user,uid\nbad\n").unwrap();
        let err = format!("{:#}", TokenFile::load(&path).unwrap_err());
        assert!(err.contains("tokens.csv"), "{err}");
        assert!(err.contains("line 2"), "{err}");

        let missing = format!(
            "{:#}",
            TokenFile::load(&dir.path().join("nope")).unwrap_err()
        );
        assert!(missing.contains("nope"), "{missing}");
    }

    #[test]
    fn ensure_admin_token_creates_once_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.csv");
        let token = ensure_admin_token(&path).unwrap();
        assert_eq!(token.len(), 43, "{token}");
        assert!(
            token
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        );
        assert_eq!(ensure_admin_token(&path).unwrap(), token);

        let file = TokenFile::load(&path).unwrap();
        let admin = file.lookup(&token).unwrap();
        assert_eq!(admin.name, "admin");
        assert_eq!(admin.groups, [MASTERS]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }

        let other = dir.path().join("other.csv");
        assert_ne!(ensure_admin_token(&other).unwrap(), token);
    }

    #[test]
    fn ensure_admin_token_uses_an_existing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.csv");
        std::fs::write(
            &path,
            "viewer,admin,1,view\nmine,admin,2,\"dev,system:masters\"\n",
        )
        .unwrap();
        assert_eq!(ensure_admin_token(&path).unwrap(), "mine");

        std::fs::write(&path, "t,bob,1,system:masters\n").unwrap();
        let err = format!("{:#}", ensure_admin_token(&path).unwrap_err());
        assert!(err.contains("no token for user admin"), "{err}");
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"", b""));
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"ab"));
        assert!(!constant_time_eq(b"ab\0", b"ab"));
        assert!(!constant_time_eq(b"", b"a"));
    }

    #[test]
    fn debug_hides_tokens() {
        let file = TokenFile::parse("supersecret,alice,1\n").unwrap();
        let debug = format!("{file:?}");
        assert!(debug.contains("alice"));
        assert!(!debug.contains("supersecret"));
    }
}
