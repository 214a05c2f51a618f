//! `RUN cmd <<EOF` (a here-document after a command: `RUN cat <<EOF > /etc/app.conf`,
//! `RUN python3 - <<'PY'`). BuildKit hands such a command and its documents to the
//! shell; parse-dockerfile reads a here-document only right after `RUN` (and its
//! flags), and takes the document's lines for instructions. So before parsing, each such
//! RUN is rewritten as a RUN of one here-document whose script is the command with its
//! documents, which the shell then runs as BuildKit's would:
//!
//! ```text
//! RUN cat <<EOF > /f        RUN <<HUTCH_RUN_1
//! hello               →     cat <<EOF > /f
//! EOF                       hello
//!                           EOF
//!                           HUTCH_RUN_1
//! ```
//!
//! `origin` maps each line of the rewritten text to the Dockerfile's own, so errors
//! still name the user's lines.

/// The rewritten Dockerfile and, per line of it, the original line (1-based).
pub struct Rewritten {
    pub text: String,
    pub origin: Vec<usize>,
}

impl Rewritten {
    /// The Dockerfile's own line for line `line` (1-based) of the rewritten text.
    pub fn original_line(&self, line: usize) -> usize {
        self.origin.get(line.saturating_sub(1)).copied().unwrap_or(line)
    }
}

/// The delimiters of the here-documents `command` opens (`<<WORD`, `<<-WORD`,
/// `<<'WORD'`, `<<"WORD"`), in order, with whether `<<-` strips leading tabs. A
/// here-string (`<<<`) opens none.
fn delimiters(command: &str) -> Vec<(String, bool)> {
    let bytes = command.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = command[i..].find("<<").map(|p| p + i) {
        let mut j = at + 2;
        if bytes.get(j) == Some(&b'<') {
            // `<<<`: a here-string.
            i = j + 1;
            continue;
        }
        let strip = bytes.get(j) == Some(&b'-');
        if strip {
            j += 1;
        }
        let quote = bytes.get(j).copied().filter(|q| *q == b'\'' || *q == b'"');
        if quote.is_some() {
            j += 1;
        }
        let start = j;
        while bytes.get(j).is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_') {
            j += 1;
        }
        let closed = quote.is_none_or(|q| bytes.get(j) == Some(&q));
        if j > start && closed {
            out.push((command[start..j].to_string(), strip));
        }
        i = j.max(at + 2);
    }
    out
}

/// The command part of a `RUN` line (after `RUN` and its `--flags`), if the line is a
/// RUN whose command does not itself start with a here-document.
fn run_command(line: &str) -> Option<(&str, &str)> {
    let trimmed = line.trim_start();
    let keyword = trimmed.get(..3)?;
    if !keyword.eq_ignore_ascii_case("RUN") || !trimmed[3..].starts_with([' ', '\t']) {
        return None;
    }
    let mut rest = trimmed[3..].trim_start();
    while rest.starts_with("--") {
        rest = rest.split_once([' ', '\t']).map(|(_, r)| r.trim_start())?;
    }
    if rest.starts_with("<<") || rest.starts_with('[') || rest.ends_with('\\') {
        return None;
    }
    let head = &line[..line.len() - rest.len()];
    Some((head, rest))
}

/// Rewrites each `RUN cmd <<WORD` whose documents all end in the file; leaves every
/// other line as it is.
pub fn rewrite(text: &str) -> Rewritten {
    let lines: Vec<&str> = text.split('\n').collect();
    let mut out: Vec<String> = Vec::with_capacity(lines.len());
    let mut origin = Vec::with_capacity(lines.len());
    let mut n = 0;
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let rewritable = run_command(line).and_then(|(head, command)| {
            let docs = delimiters(command);
            if docs.is_empty() {
                return None;
            }
            // Each document ends at its delimiter's line, in order.
            let mut end = i;
            for (word, strip) in &docs {
                end += 1;
                while end < lines.len() && (if *strip { lines[end].trim_start_matches('\t') } else { lines[end] }) != word {
                    end += 1;
                }
                if end >= lines.len() {
                    return None;
                }
            }
            Some((head, command, end))
        });
        match rewritable {
            Some((head, command, end)) => {
                n += 1;
                let marker = format!("HUTCH_RUN_{n}");
                out.push(format!("{}<<{marker}", head));
                origin.push(i + 1);
                out.push(command.to_string());
                origin.push(i + 1);
                for (k, body) in lines.iter().enumerate().take(end + 1).skip(i + 1) {
                    out.push(body.to_string());
                    origin.push(k + 1);
                }
                out.push(marker);
                origin.push(end + 1);
                i = end + 1;
            }
            None => {
                out.push(line.to_string());
                origin.push(i + 1);
                i += 1;
            }
        }
    }
    Rewritten { text: out.join("\n"), origin }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_with_here_documents_becomes_one_script() {
        let r = rewrite("FROM a\nRUN --network=none cat <<EOF > /f && python3 - <<'PY'\nhello $X\nEOF\nprint(1)\nPY\nENV A=b\n");
        assert_eq!(r.text, "FROM a\nRUN --network=none <<HUTCH_RUN_1\ncat <<EOF > /f && python3 - <<'PY'\nhello $X\nEOF\nprint(1)\nPY\nHUTCH_RUN_1\nENV A=b\n");
        // Lines keep pointing at the user's: ENV is line 7 of the Dockerfile.
        assert_eq!(r.original_line(9), 7);
        assert_eq!((r.original_line(2), r.original_line(3), r.original_line(8)), (2, 2, 6));
    }

    #[test]
    fn what_parse_dockerfile_reads_itself_or_cannot_be_a_document_is_left_alone() {
        for text in [
            "FROM a\nRUN <<EOF\necho hi\nEOF\n",       // a document right after RUN
            "FROM a\nRUN cat <<<word\n",                // a here-string
            "FROM a\nRUN echo '<<' done\n",             // no delimiter
            "FROM a\nRUN cat <<EOF\nno end\n",          // unterminated: the parser says so
            "FROM a\nRUN [\"cat\", \"<<EOF\"]\nEOF\n", // exec form
        ] {
            assert_eq!(rewrite(text).text, text, "{text:?}");
        }
        assert_eq!(delimiters("cat <<-\"END\" x <<A"), [("END".to_string(), true), ("A".to_string(), false)]);
        let tabs = rewrite("RUN cat <<-E\n\tx\n\tE\n");
        assert!(tabs.text.ends_with("\tE\nHUTCH_RUN_1\n"), "{:?}", tabs.text);
    }
}
