//! Dockerfiles as build steps. `parse-dockerfile` parses (heredocs, spans, parser
//! directives); this module checks flags, expands variables (`$V`, `${V}`,
//! `${V:-word}`, `${V:+word}`) as Docker's shell lexer does, gathers `COPY`/`ADD`
//! files from the context, and refuses what hutch does not build yet, each error
//! naming `Dockerfile:LINE:COL`.

use crate::context::{self, CopyFiles, Ignore};
use crate::step::{shell_join, Step, StepKind};
use parse_dockerfile::{Command as DockerCommand, Flag, Instruction, Source, UnescapedString};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
#[error("{file}:{line}:{column}: {message}")]
pub struct DockerfileError {
    pub file: String,
    pub line: usize,
    pub column: usize,
    pub message: String,
}

/// A Dockerfile turned into a build.
#[derive(Debug)]
pub struct Plan {
    /// The `FROM` image, variables expanded.
    pub from: String,
    pub steps: Vec<Step>,
    /// Instructions hutch ignores, one sentence each.
    pub warnings: Vec<String>,
}

struct Planner<'a> {
    /// The Dockerfile with each `RUN cmd <<EOF` rewritten (`run_heredoc.rs`); errors
    /// name the original's lines.
    text: &'a str,
    rewritten: &'a crate::run_heredoc::Rewritten,
    file: &'a str,
    context: &'a Path,
    ignore: Ignore,
    scratch: &'a Path,
    build_args: &'a BTreeMap<String, String>,
    /// Variables `ENV` set (they win over `ARG`s of the same name, as in Docker).
    env: BTreeMap<String, String>,
    /// `ARG`s declared in the stage, with their values.
    args: BTreeMap<String, String>,
    steps: Vec<Step>,
    warnings: Vec<String>,
}

/// Plans the Dockerfile `text` (named `file` in errors) whose context is `context`;
/// `COPY` tars are written into `scratch`.
pub fn plan(text: &str, file: &str, context: &Path, build_args: &BTreeMap<String, String>, scratch: &Path) -> Result<Plan, DockerfileError> {
    let rewritten = crate::run_heredoc::rewrite(text);
    let parsed = parse_dockerfile::parse(&rewritten.text)
        .map_err(|e| DockerfileError { file: file.into(), line: rewritten.original_line(e.line()), column: e.column(), message: strip_position(&e.to_string()) })?;
    let ignore = Ignore::of_context(context).map_err(|e| DockerfileError { file: ".dockerignore".into(), line: 1, column: 1, message: e.to_string() })?;
    let mut p = Planner {
        text: &rewritten.text,
        rewritten: &rewritten,
        file,
        context,
        ignore,
        scratch,
        build_args,
        env: BTreeMap::new(),
        args: BTreeMap::new(),
        steps: Vec::new(),
        warnings: Vec::new(),
    };
    // Global ARGs (before FROM) serve FROM only.
    let mut global = BTreeMap::new();
    for arg in parsed.global_args() {
        for (name, default) in p.arg_pairs(&arg.arguments)? {
            if let Some(v) = build_args.get(&name).cloned().or(default) {
                global.insert(name, v);
            }
        }
    }
    let stages: Vec<_> = parsed.stages().collect();
    let Some(stage) = stages.first() else {
        return Err(p.error(0, "the Dockerfile has no FROM instruction; start it with FROM <image>".into()));
    };
    if let Some(second) = stages.get(1) {
        return Err(p.error(second.from.from.span.start, "multi-stage builds are not supported yet; build from one FROM".into()));
    }
    for flag in &stage.from.options {
        if flag.name.value != "platform" || flag.value.as_ref().is_some_and(|v| v.value != "linux/amd64") {
            return Err(p.error(flag.flag_span().start, format!("FROM --{} is not supported (hutch builds linux/amd64 only)", flag.name.value)));
        }
    }
    let from = p.expand_with(&stage.from.image, &global)?;
    if from == "scratch" {
        return Err(p.error(stage.from.image.span.start, "FROM scratch is not supported: a template needs a userland; start from an image".into()));
    }
    for instruction in stage.instructions {
        p.instruction(instruction)?;
    }
    Ok(Plan { from, steps: p.steps, warnings: p.warnings })
}

/// parse-dockerfile's message carries its own "at line L column C"; ours leads with it.
fn strip_position(message: &str) -> String {
    match message.find(" at line ") {
        Some(i) => message[..i].to_string(),
        None => message.to_string(),
    }
}

impl Planner<'_> {
    fn error(&self, offset: usize, message: String) -> DockerfileError {
        let before = &self.text[..offset.min(self.text.len())];
        let line = self.rewritten.original_line(before.matches('\n').count() + 1);
        let column = before.rfind('\n').map(|i| before.len() - i).unwrap_or(before.len() + 1);
        DockerfileError { file: self.file.into(), line, column, message }
    }

    fn vars(&self) -> BTreeMap<String, String> {
        let mut vars = self.args.clone();
        vars.extend(self.env.clone());
        vars
    }

    fn expand(&self, s: &UnescapedString<'_>) -> Result<String, DockerfileError> {
        self.expand_with(s, &self.vars())
    }

    fn expand_with(&self, s: &UnescapedString<'_>, vars: &BTreeMap<String, String>) -> Result<String, DockerfileError> {
        words(&s.value, vars).map(|w| w.join(" ")).map_err(|m| self.error(s.span.start, m))
    }

    fn push(&mut self, kind: StepKind, text: String) {
        self.steps.push(Step { kind, force: false, text });
    }

    /// `NAME[=default] ...` of an ARG.
    fn arg_pairs(&self, s: &UnescapedString<'_>) -> Result<Vec<(String, Option<String>)>, DockerfileError> {
        let list = words(&s.value, &self.vars()).map_err(|m| self.error(s.span.start, m))?;
        Ok(list
            .into_iter()
            .map(|w| match w.split_once('=') {
                Some((k, v)) => (k.to_string(), Some(v.to_string())),
                None => (w, None),
            })
            .collect())
    }

    /// `K=V ...`, or the old `K V` form.
    fn env_pairs(&self, s: &UnescapedString<'_>) -> Result<Vec<(String, String)>, DockerfileError> {
        let list = words(&s.value, &self.vars()).map_err(|m| self.error(s.span.start, m))?;
        let Some(first) = list.first() else { return Err(self.error(s.span.start, "ENV needs NAME=VALUE".into())) };
        if !first.contains('=') {
            return Ok(vec![(first.clone(), list[1..].join(" "))]);
        }
        list.iter()
            .map(|w| w.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| self.error(s.span.start, format!("'{w}' is not NAME=VALUE"))))
            .collect()
    }

    fn instruction(&mut self, instruction: &Instruction<'_>) -> Result<(), DockerfileError> {
        match instruction {
            Instruction::Arg(arg) => {
                for (name, default) in self.arg_pairs(&arg.arguments)? {
                    if let Some(v) = self.build_args.get(&name).cloned().or(default) {
                        self.args.insert(name, v);
                    }
                }
            }
            Instruction::Env(env) => {
                let pairs = self.env_pairs(&env.arguments)?;
                self.env.extend(pairs.iter().cloned());
                let text = format!("ENV {}", pairs.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" "));
                self.push(StepKind::Env(pairs), text);
            }
            Instruction::Workdir(w) => {
                let dir = self.expand(&w.arguments)?;
                self.push(StepKind::Workdir(dir.clone()), format!("WORKDIR {dir}"));
            }
            Instruction::User(u) => {
                let user = self.expand(&u.arguments)?;
                self.push(StepKind::User(user.clone()), format!("USER {user}"));
            }
            Instruction::Run(run) => {
                for flag in &run.options {
                    match &*flag.name.value {
                        "mount" | "network" | "security" => self.warnings.push(format!("{}: RUN --{} is ignored", self.where_(flag.flag_span().start), flag.name.value)),
                        other => return Err(self.error(flag.flag_span().start, format!("RUN --{other} is not a RUN flag hutch knows"))),
                    }
                }
                let cmd = match &run.arguments {
                    DockerCommand::Exec(words) => shell_join(words.value.iter().map(|w| w.value.to_string()).collect::<Vec<_>>().iter()),
                    DockerCommand::Shell(text) => with_here_docs(&join_lines(text.value), run.here_docs.iter().map(|h| (h.value.to_string(), h.expand)).collect()),
                    _ => return Err(self.error(run.run.span.start, "a RUN form hutch does not know".into())),
                };
                let first_line = cmd.lines().next().unwrap_or("").to_string();
                let shown = if cmd.lines().count() > 1 { format!("RUN {first_line} …") } else { format!("RUN {first_line}") };
                let build_args = self.args.iter().filter(|(k, _)| !self.env.contains_key(*k)).map(|(k, v)| (k.clone(), v.clone())).collect();
                self.push(StepKind::Run { cmd, user: None, build_args }, shown);
            }
            Instruction::Copy(copy) => {
                let mut chown = None;
                let mut chmod = None;
                for flag in &copy.options {
                    match &*flag.name.value {
                        "from" => return Err(self.error(flag.flag_span().start, "COPY --from needs a multi-stage build, which hutch does not build yet".into())),
                        "chown" => chown = Some(self.flag_value(flag)?),
                        "chmod" => chmod = Some(self.flag_value(flag)?),
                        other => return Err(self.error(flag.flag_span().start, format!("COPY --{other} is not a COPY flag hutch knows (--chown, --chmod)"))),
                    }
                }
                self.copy("COPY", &copy.src, &copy.dest, chown, chmod, false)?;
            }
            Instruction::Add(add) => {
                let mut chown = None;
                let mut chmod = None;
                for flag in &add.options {
                    match &*flag.name.value {
                        "chown" => chown = Some(self.flag_value(flag)?),
                        "chmod" => chmod = Some(self.flag_value(flag)?),
                        other => return Err(self.error(flag.flag_span().start, format!("ADD --{other} is not an ADD flag hutch knows (--chown, --chmod)"))),
                    }
                }
                self.copy("ADD", &add.src, &add.dest, chown, chmod, true)?;
            }
            Instruction::Cmd(cmd) => {
                let words = self.command_words(&cmd.arguments);
                self.push(StepKind::Command { entrypoint: None, cmd: Some(words.clone()) }, format!("CMD {words:?}"));
            }
            Instruction::Entrypoint(e) => {
                let words = self.command_words(&e.arguments);
                self.push(StepKind::Command { entrypoint: Some(words.clone()), cmd: None }, format!("ENTRYPOINT {words:?}"));
            }
            Instruction::Shell(s) => return Err(self.error(s.shell.span.start, "SHELL is not supported: RUN steps run with /bin/sh -c".into())),
            Instruction::Onbuild(o) => return Err(self.error(o.onbuild.span.start, "ONBUILD is not supported".into())),
            Instruction::From(f) => return Err(self.error(f.from.span.start, "multi-stage builds are not supported yet; build from one FROM".into())),
            Instruction::Expose(i) => self.warn(i.expose.span.start, "EXPOSE"),
            Instruction::Volume(i) => self.warn(i.volume.span.start, "VOLUME"),
            Instruction::Label(i) => self.warn(i.label.span.start, "LABEL"),
            Instruction::Maintainer(i) => self.warn(i.maintainer.span.start, "MAINTAINER"),
            Instruction::Healthcheck(i) => self.warn(i.healthcheck.span.start, "HEALTHCHECK"),
            Instruction::Stopsignal(i) => self.warn(i.stopsignal.span.start, "STOPSIGNAL"),
            _ => return Err(self.error(0, "an instruction hutch does not know".into())),
        }
        Ok(())
    }

    fn where_(&self, offset: usize) -> String {
        let e = self.error(offset, String::new());
        format!("{}:{}:{}", e.file, e.line, e.column)
    }

    fn warn(&mut self, offset: usize, what: &str) {
        let at = self.where_(offset);
        self.warnings.push(format!("{at}: {what} is ignored (hutch templates have no use for it)"));
    }

    fn flag_value(&self, flag: &Flag<'_>) -> Result<String, DockerfileError> {
        match &flag.value {
            Some(v) => self.expand(v),
            None => Err(self.error(flag.flag_span().start, format!("--{} needs a value", flag.name.value))),
        }
    }

    fn command_words(&self, c: &DockerCommand<'_>) -> Vec<String> {
        match c {
            DockerCommand::Exec(words) => words.value.iter().map(|w| w.value.to_string()).collect(),
            DockerCommand::Shell(text) => vec!["/bin/sh".into(), "-c".into(), join_lines(text.value)],
            _ => Vec::new(),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn copy(&mut self, verb: &str, src: &[Source<'_>], dest: &UnescapedString<'_>, chown: Option<String>, chmod: Option<String>, add: bool) -> Result<(), DockerfileError> {
        let dest_path = self.expand(dest)?;
        if let Some(mode) = &chmod {
            if u32::from_str_radix(mode, 8).map_or(true, |m| m > 0o7777) {
                return Err(self.error(dest.span.start, format!("--chmod={mode} is not octal permissions such as 0755")));
            }
        }
        let n = self.steps.len() + 1;
        let out = self.scratch.join(format!("copy-{n}.tar"));
        let mut paths = Vec::new();
        let mut here = None;
        for s in src {
            match s {
                Source::Path(p) => {
                    let value = self.expand(p)?;
                    if add && (value.contains("://") || value.starts_with("git@")) {
                        return Err(self.error(p.span.start, format!("ADD {value}: URLs are not supported; download it in a RUN step")));
                    }
                    paths.push((value, p.span.start));
                }
                Source::HereDoc(h) => here = Some(h.value.to_string()),
                _ => return Err(self.error(dest.span.start, format!("a {verb} source hutch does not know"))),
            }
        }
        let files = match here {
            Some(content) if paths.is_empty() => {
                let name = Path::new(&dest_path).file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "file".into());
                context::here_doc(&name, &content, &out).map_err(|e| self.error(dest.span.start, e.to_string()))?
            }
            Some(_) => return Err(self.error(dest.span.start, format!("{verb} mixes a here-document with paths; use one or the other"))),
            None => {
                let at = paths.first().map(|p| p.1).unwrap_or(dest.span.start);
                let names: Vec<String> = paths.iter().map(|p| p.0.clone()).collect();
                let archive = if add && names.len() == 1 { local_archive(self.context, &names[0]) } else { None };
                match archive {
                    Some(kind) => repack_archive(&self.context.join(&names[0]), kind, &out).map_err(|e| self.error(at, e))?,
                    None => context::collect(self.context, &names, &dest_path, &self.ignore, &out).map_err(|e| self.error(at, e.to_string()))?,
                }
            }
        };
        let shown = format!("{verb} {} {dest_path}", src.iter().map(|s| match s { Source::Path(p) => p.value.to_string(), _ => "<<heredoc".into() }).collect::<Vec<_>>().join(" "));
        // Docker: files are root's unless --chown says otherwise, whatever USER is.
        let owner = Some(chown.unwrap_or_else(|| "root".into()));
        self.push(StepKind::Copy { files, dest: dest_path, owner, mode: chmod }, shown);
        Ok(())
    }
}

/// Docker's word rules for instruction arguments: whitespace splits words, quotes
/// group them (single quotes literally), `\` escapes, and variables expand (not in
/// single quotes).
pub fn words(s: &str, vars: &BTreeMap<String, String>) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('\'') => break,
                        Some(c) => word.push(c),
                        None => return Err("a single quote is not closed".into()),
                    }
                }
            }
            '"' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some('"') => break,
                        Some('\\') => match chars.next() {
                            Some(c @ ('"' | '\\' | '$')) => word.push(c),
                            Some(c) => {
                                word.push('\\');
                                word.push(c);
                            }
                            None => return Err("a double quote is not closed".into()),
                        },
                        Some('$') => word.push_str(&variable(&mut chars, vars)?),
                        Some(c) => word.push(c),
                        None => return Err("a double quote is not closed".into()),
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(c) = chars.next() {
                    word.push(c);
                }
            }
            '$' => {
                in_word = true;
                word.push_str(&variable(&mut chars, vars)?);
            }
            c => {
                in_word = true;
                word.push(c);
            }
        }
    }
    if in_word {
        out.push(word);
    }
    Ok(out)
}

/// A variable name (letters, digits, `_`) at the front of `chars`, taken off it.
fn take_name(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) -> String {
    let mut name = String::new();
    while let Some(&c) = chars.peek().filter(|c| c.is_ascii_alphanumeric() || **c == '_') {
        name.push(c);
        chars.next();
    }
    name
}

/// The value of the variable after a `$`: `NAME`, `{NAME}`, `{NAME:-word}`, `{NAME:+word}`.
fn variable(chars: &mut std::iter::Peekable<std::str::Chars<'_>>, vars: &BTreeMap<String, String>) -> Result<String, String> {
    if chars.peek() == Some(&'{') {
        chars.next();
        let name = take_name(chars);
        let mut modifier = String::new();
        loop {
            match chars.next() {
                Some('}') => break,
                Some(c) => modifier.push(c),
                None => return Err(format!("${{{name} is not closed with }}")),
            }
        }
        let value = vars.get(&name).filter(|v| !v.is_empty());
        return match modifier.get(..2) {
            None if modifier.is_empty() => Ok(vars.get(&name).cloned().unwrap_or_default()),
            Some(":-") => Ok(value.cloned().unwrap_or_else(|| modifier[2..].to_string())),
            Some(":+") => Ok(value.map(|_| modifier[2..].to_string()).unwrap_or_default()),
            _ => Err(format!("${{{name}{modifier}}} is not a substitution hutch knows (${{V}}, ${{V:-word}}, ${{V:+word}})")),
        };
    }
    let name = take_name(chars);
    if name.is_empty() {
        return Ok("$".into());
    }
    Ok(vars.get(&name).cloned().unwrap_or_default())
}

/// A shell-form command's continuation lines joined, as Docker does.
fn join_lines(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.split('\n').peekable();
    while let Some(line) = lines.next() {
        let trimmed = line.trim_end_matches('\r');
        match trimmed.strip_suffix('\\') {
            Some(head) if lines.peek().is_some() => out.push_str(head),
            _ => {
                out.push_str(trimmed);
                if lines.peek().is_some() {
                    out.push('\n');
                }
            }
        }
    }
    // Comment lines inside a continued command are dropped by Docker.
    out.lines().filter(|l| !l.trim_start().starts_with('#')).collect::<Vec<_>>().join("\n")
}

/// A RUN with a here-document as one shell script. parse-dockerfile reads one only
/// right after RUN: `RUN <<EOF` runs the document itself; `RUN <<EOF python3` feeds it
/// to the command that follows, as BuildKit does. `expand`: the delimiter was not
/// quoted, so the shell expands variables in it.
fn with_here_docs(cmd: &str, docs: Vec<(String, bool)>) -> String {
    let Some((doc, expand)) = docs.into_iter().next() else { return cmd.to_string() };
    if cmd.trim().is_empty() {
        return doc;
    }
    let delimiter = if expand { "HUTCH_EOF" } else { "'HUTCH_EOF'" };
    let newline = if doc.ends_with('\n') { "" } else { "\n" };
    format!("{} <<{delimiter}\n{doc}{newline}HUTCH_EOF", cmd.trim())
}

#[derive(Clone, Copy)]
enum ArchiveKind {
    Tar,
    Gzip,
}

/// ADD unpacks a local tar (plain or gzip) instead of copying it.
fn local_archive(context: &Path, src: &str) -> Option<ArchiveKind> {
    use std::io::Read;
    let path = context.join(src);
    let real = std::fs::canonicalize(&path).ok()?;
    if !real.starts_with(std::fs::canonicalize(context).ok()?) || !real.is_file() {
        return None;
    }
    let mut head = [0u8; 512];
    let n = std::fs::File::open(&real).ok()?.read(&mut head).ok()?;
    if n >= 2 && head[..2] == [0x1f, 0x8b] {
        Some(ArchiveKind::Gzip)
    } else if n >= 262 && &head[257..262] == b"ustar" {
        Some(ArchiveKind::Tar)
    } else {
        None
    }
}

/// The archive's entries as a copy into the destination directory.
fn repack_archive(path: &Path, kind: ArchiveKind, out: &Path) -> Result<CopyFiles, String> {
    use sha2::Digest;
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let reader: Box<dyn Read> = match kind {
        ArchiveKind::Tar => Box::new(file),
        ArchiveKind::Gzip => Box::new(flate2::read::MultiGzDecoder::new(file)),
    };
    // The archive's bytes are copied as they are (the agent reads plain tar); the hash
    // is of what the guest receives.
    let mut raw = Vec::new();
    reader.take(4 << 30).read_to_end(&mut raw).map_err(|e| format!("reading the archive {}: {e}", path.display()))?;
    std::fs::write(out, &raw).map_err(|e| format!("writing {}: {e}", out.display()))?;
    let entries = tar::Archive::new(&raw[..]).entries().map(|e| e.count()).unwrap_or(0);
    Ok(CopyFiles { tar: PathBuf::from(out), single: false, hash: hex::encode(sha2::Sha256::digest(&raw)), entries })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn words_split_quote_and_expand() {
        let v = vars(&[("A", "1"), ("E", "")]);
        assert_eq!(words(r#"K=$A L="x $A" M='$A' N=${A}b O=${E:-d} P=${A:+y} Q=\$A"#, &v).expect("words"), ["K=1", "L=x 1", "M=$A", "N=1b", "O=d", "P=y", "Q=$A"]);
        assert!(words("'open", &v).is_err());
    }

    fn plan_text(text: &str) -> Result<Plan, DockerfileError> {
        let ctx = tempfile::tempdir().expect("ctx");
        std::fs::write(ctx.path().join("app.py"), "print(1)\n").expect("file");
        let scratch = tempfile::tempdir().expect("scratch");
        let args = vars(&[("VERSION", "2")]);
        plan(text, "Dockerfile", ctx.path(), &args, scratch.path())
    }

    #[test]
    fn a_dockerfile_becomes_steps() {
        let plan = plan_text(
            "ARG BASE=127.0.0.1:5000/tiny\nFROM ${BASE}:v1\nARG VERSION=1\nENV APP=/srv/app GREETING=\"hi there\"\nWORKDIR $APP\nCOPY --chown=user app.py ./\nRUN echo $VERSION \\\n  && echo done\nUSER user\nEXPOSE 80\nCMD [\"python3\", \"app.py\"]\n",
        )
        .expect("plan");
        assert_eq!(plan.from, "127.0.0.1:5000/tiny:v1");
        let texts: Vec<&str> = plan.steps.iter().map(|s| s.text.as_str()).collect();
        assert_eq!(texts[..4], ["ENV APP=/srv/app GREETING=hi there", "WORKDIR /srv/app", "COPY app.py ./", "RUN echo $VERSION   && echo done"]);
        match &plan.steps[3].kind {
            StepKind::Run { build_args, cmd, .. } => {
                assert_eq!(build_args.get("VERSION").map(String::as_str), Some("2"), "--build-arg wins over the default");
                assert!(!cmd.contains('\\'), "{cmd}");
            }
            other => panic!("{other:?}"),
        }
        assert!(plan.warnings.iter().any(|w| w.starts_with("Dockerfile:10:1: EXPOSE")), "{:?}", plan.warnings);
    }

    #[test]
    fn refusals_name_line_and_column() {
        let e = plan_text("FROM a\nRUNN x\n").expect_err("unknown");
        assert_eq!((e.line, e.column), (2, 1), "{e}");
        let e = plan_text("FROM a AS one\nFROM b\n").expect_err("stages");
        assert!(e.to_string().starts_with("Dockerfile:2:1: multi-stage"), "{e}");
        let e = plan_text("FROM a\nCOPY --from=x /a /b\n").expect_err("from");
        assert!(e.to_string().starts_with("Dockerfile:2:6: COPY --from"), "{e}");
        let e = plan_text("FROM a\nADD https://example.invalid/x /x\n").expect_err("url");
        assert!(e.to_string().contains("URLs are not supported"), "{e}");
        let e = plan_text("FROM a\nCOPY missing.txt /x\n").expect_err("missing");
        assert!(e.to_string().starts_with("Dockerfile:2:6:") && e.to_string().contains("not in the build context"), "{e}");
    }

    /// A RUN step's script, trimmed.
    fn run_script(step: &Step) -> &str {
        match &step.kind {
            StepKind::Run { cmd, .. } => cmd.trim(),
            other => panic!("not a RUN: {other:?}"),
        }
    }

    #[test]
    fn a_here_document_after_a_command_runs_as_buildkit_runs_it() {
        let plan = plan_text("FROM a\nRUN cat <<EOF > /etc/app.conf\nkey=$HOME\nEOF\nEXPOSE 80\n").expect("plan");
        assert_eq!(run_script(&plan.steps[0]), "cat <<EOF > /etc/app.conf\nkey=$HOME\nEOF");
        // Warnings and errors still name the Dockerfile's own lines.
        assert!(plan.warnings.iter().any(|w| w.starts_with("Dockerfile:5:")), "{:?}", plan.warnings);
        let e = plan_text("FROM a\nRUN cat <<EOF\nx\nEOF\nCOPY missing.txt /x\n").expect_err("missing");
        assert!(e.to_string().starts_with("Dockerfile:5:"), "{e}");
    }

    #[test]
    fn here_documents_run_as_scripts() {
        // parse-dockerfile reads a here-document only right after RUN (`RUN <<EOF`).
        let plan = plan_text("FROM a\nRUN <<EOF\necho one\necho two\nEOF\nCOPY <<EOF /etc/motd\nhello\nEOF\n").expect("plan");
        assert_eq!(run_script(&plan.steps[0]), "echo one\necho two");
        assert!(matches!(&plan.steps[1].kind, StepKind::Copy { files, .. } if files.single));
        assert_eq!(with_here_docs("python3", vec![("print(1)\n".into(), false)]), "python3 <<'HUTCH_EOF'\nprint(1)\nHUTCH_EOF");
    }
}
