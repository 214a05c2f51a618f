//! Running the host tools the builds need (apt-get, dpkg-deb, mmdebstrap, mkfs.ext4).

use crate::Progress;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};

#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("'{tool}' is not installed; install it with: apt-get install {package}")]
    Missing { tool: String, package: String },
    #[error("'{command}' failed ({status}): {output}")]
    Failed { command: String, status: String, output: String },
    #[error("running '{command}'")]
    Io { command: String, #[source] source: std::io::Error },
}

fn package_of(tool: &str) -> &str {
    match tool {
        "apt-get" => "apt",
        "dpkg-deb" => "dpkg",
        "mkfs.ext4" => "e2fsprogs",
        other => other,
    }
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs a command, streaming its output lines to `progress` and keeping the last ones
/// for the error message.
pub fn run(mut cmd: Command, cwd: Option<&Path>, progress: &dyn Progress) -> Result<String, ToolError> {
    if let Some(dir) = cwd {
        cmd.current_dir(dir);
    }
    let command = describe(&cmd);
    let tool = cmd.get_program().to_string_lossy().into_owned();
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => ToolError::Missing { package: package_of(&tool).into(), tool: tool.clone() },
        _ => ToolError::Io { command: command.clone(), source },
    })?;
    let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
    let collect = |stream: Option<Box<dyn std::io::Read + Send>>| {
        let mut lines = Vec::new();
        if let Some(s) = stream {
            for line in BufReader::new(s).lines().map_while(Result::ok) {
                progress.detail(&line);
                lines.push(line);
            }
        }
        lines
    };
    let (out, err) = std::thread::scope(|scope| {
        let err = scope.spawn(|| collect(stderr.map(|e| Box::new(e) as Box<dyn std::io::Read + Send>)));
        let out = collect(stdout.map(|o| Box::new(o) as Box<dyn std::io::Read + Send>));
        (out, err.join().unwrap_or_default())
    });
    let status = child.wait().map_err(|source| ToolError::Io { command: command.clone(), source })?;
    if !status.success() {
        let lines = if err.iter().any(|l| !l.trim().is_empty()) { &err } else { &out };
        let output = lines[lines.len().saturating_sub(8)..].join("\n");
        return Err(ToolError::Failed { command, status: status.to_string(), output });
    }
    Ok(out.join("\n"))
}
