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
/// `<<'WORD'`, `<<"WORD"`, `<<\WORD`), in order, with whether `<<-` strips leading
/// tabs. A here-string (`<<<`) opens none, nor does a `<<` inside quotes or escaped,
/// which the shell reads as words (as BuildKit does, splitting words first).
fn delimiters(command: &str) -> Vec<(String, bool)> {
    let bytes = command.as_bytes();
    let mut out = Vec::new();
    let mut quote: Option<u8> = None;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if let Some(q) = quote {
            if b == q {
                quote = None;
            } else if q == b'"' && b == b'\\' {
                i += 1;
            }
            i += 1;
            continue;
        }
        if b == b'\\' {
            i += 2;
            continue;
        }
        if b == b'\'' || b == b'"' {
            quote = Some(b);
            i += 1;
            continue;
        }
        if !bytes[i..].starts_with(b"<<") {
            i += 1;
            continue;
        }
        let mut j = i + 2;
        if bytes.get(j) == Some(&b'<') {
            // `<<<`: a here-string.
            i = j + 1;
            continue;
        }
        let strip = bytes.get(j) == Some(&b'-');
        if strip {
            j += 1;
        }
        let quoted = bytes.get(j).copied().filter(|q| *q == b'\'' || *q == b'"');
        if quoted.is_some() || bytes.get(j) == Some(&b'\\') {
            j += 1;
        }
        let start = j;
        while bytes.get(j).is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_') {
            j += 1;
        }
        let closed = quoted.map_or(true, |q| bytes.get(j) == Some(&q));
        if j > start && closed {
            // ASCII from `start` to `j`, so these are character boundaries.
            out.push((command[start..j].to_string(), strip));
        }
        i = if quoted.is_some() && closed { j + 1 } else { j.max(i + 2) };
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
    // Exec form (a JSON array) runs no shell; a continued line is left to the parser.
    let exec_form = rest.starts_with('[') && serde_json::from_str::<Vec<String>>(rest).is_ok();
    if rest.starts_with("<<") || exec_form || rest.ends_with('\\') {
        return None;
    }
    let head = &line[..line.len() - rest.len()];
    Some((head, rest))
}

/// The documents a `RUN` or `COPY` line opens right after its keyword and flags (the
/// ones parse-dockerfile reads itself).
fn opened_documents(line: &str) -> Vec<(String, bool)> {
    let trimmed = line.trim_start();
    let Some(keyword) = trimmed.split_whitespace().next() else { return Vec::new() };
    if !["RUN", "COPY", "ADD"].iter().any(|k| keyword.eq_ignore_ascii_case(k)) {
        return Vec::new();
    }
    let mut rest = trimmed[keyword.len()..].trim_start();
    while rest.starts_with("--") {
        match rest.split_once([' ', '\t']) {
            Some((_, r)) => rest = r.trim_start(),
            None => return Vec::new(),
        }
    }
    if !rest.starts_with("<<") {
        return Vec::new();
    }
    delimiters(rest)
}

/// Rewrites each `RUN cmd <<WORD` whose documents all end in the file; leaves every
/// other line as it is.
pub fn rewrite(text: &str) -> Rewritten {
    let lines: Vec<&str> = text.split('\n').collect();
    // A line as its delimiter would be written (a CRLF file's lines end in '\r').
    let bare = |k: usize, strip: bool| {
        let l = lines[k].trim_end_matches('\r');
        if strip {
            l.trim_start_matches('\t')
        } else {
            l
        }
    };
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
                while end < lines.len() && bare(end, *strip) != word {
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
                // The documents of an instruction the parser reads itself (`RUN <<EOF`,
                // `COPY <<EOF /f`) are copied as they are: a Dockerfile inside one is text.
                for (word, strip) in opened_documents(line) {
                    while i < lines.len() {
                        let done = bare(i, strip) == word;
                        out.push(lines[i].to_string());
                        origin.push(i + 1);
                        i += 1;
                        if done {
                            break;
                        }
                    }
                }
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
            "FROM a\nRUN echo \"use <<EOF\"\nRUN <<EOF\necho hi\nEOF\n", // quoted: words, not a document
            "FROM a\nRUN echo \\<<EOF\nEOF\n",      // escaped
            "COPY <<EOF /Dockerfile\nRUN cat <<X\nx\nX\nEOF\n", // a Dockerfile inside a document is text
        ] {
            assert_eq!(rewrite(text).text, text, "{text:?}");
        }
        assert_eq!(delimiters("cat <<-\"END\" x <<A"), [("END".to_string(), true), ("A".to_string(), false)]);
        let tabs = rewrite("RUN cat <<-E\n\tx\n\tE\n");
        assert!(tabs.text.ends_with("\tE\nHUTCH_RUN_1\n"), "{:?}", tabs.text);
        // CRLF lines, and a shell test that looks like the start of exec form.
        let crlf = rewrite("RUN cat <<EOF > /f\r\nx\r\nEOF\r\n");
        assert!(crlf.text.starts_with("RUN <<HUTCH_RUN_1\n") && crlf.text.contains("EOF\r\nHUTCH_RUN_1"), "{:?}", crlf.text);
        let test_form = rewrite("RUN [ -d /x ] || cat <<EOF > /x\nx\nEOF\n");
        assert!(test_form.text.starts_with("RUN <<HUTCH_RUN_1\n[ -d /x ]"), "{:?}", test_form.text);
        assert_eq!(delimiters("cat <<\\END"), [("END".to_string(), false)]);
    }
}
