//! The templates hutch knows how to build: Debian packages, files written into the
//! tree, wheels, setup commands, and what a template's snapshot warms up.

use sha2::Digest;

pub const BASE: &str = "base";
pub const SUITE: &str = "bookworm";
pub const MIRROR: &str = "http://deb.debian.org/debian";

/// Packages of the `base` template.
pub const BASE_PACKAGES: &[&str] = &[
    "bash", "coreutils", "python3", "python3-pip", "python3-venv", "git", "curl", "ca-certificates",
    "procps", "sudo", "less", "iproute2", "file",
    // What E2B's base image has and users' first commands expect: `python` (not only
    // `python3`), node and npm, jq, and a C toolchain for pip wheels built from source.
    "python-is-python3", "nodejs", "npm", "jq", "build-essential",
];

/// Extra packages of the `code-interpreter` template (Jupyter kernels and the usual
/// data stack, from Debian: nothing is fetched at run time).
pub const CODE_INTERPRETER_PACKAGES: &[&str] = &[
    "python3-ipykernel", "python3-jupyter-client", "python3-numpy", "python3-pandas", "python3-matplotlib",
    "python3-matplotlib-inline", "fonts-dejavu-core", "python3-pexpect", "python3-filetype",
    // R with IRkernel, and a JDK whose jshell engine hutch's Java kernel drives.
    "r-base-core", "r-cran-irkernel", "openjdk-17-jdk-headless",
];

/// A template hutch knows how to build: Debian packages plus files written into the tree.
pub struct Recipe {
    pub name: &'static str,
    /// Other names it answers to (E2B's SDK asks for `code-interpreter-v1`).
    pub aliases: &'static [&'static str],
    pub packages: &'static [&'static [&'static str]],
    /// (path in the guest, contents, mode)
    pub files: &'static [(&'static str, &'static str, u32)],
    /// PyPI packages (exact pins) that Debian lacks: the host's pip downloads them (the
    /// host has the network and its certificates), the guest's pip installs them
    /// offline without dependencies (those come from Debian, listed in `packages`).
    pub wheels: &'static [&'static str],
    /// Shell commands run in the tree (chroot) once packages, files and wheels are in.
    pub setup: &'static [&'static str],
    /// A guest port the template's own service listens on; a sandbox is ready only
    /// once it accepts connections.
    pub ready_port: Option<u16>,
    /// HTTP requests to `ready_port` made before the template's memory snapshot is
    /// taken, so what it starts lazily (Jupyter kernels) is warm in every sandbox
    /// restored from it.
    pub warm_up: &'static [WarmUp],
    /// Guest memory (MiB) its sandboxes get unless a size is asked for; `None`: hutch's
    /// default. As on E2B, memory belongs to the template.
    pub memory_mib: Option<u32>,
}

/// One warm-up request: a POST of `body` (JSON) to `path` on the template's port.
pub struct WarmUp {
    pub path: &'static str,
    pub body: &'static str,
    /// The least guest memory (MiB) it is made at: in smaller guests what it starts
    /// would take the memory users' code needs (or not fit), so there it starts on
    /// first use instead.
    pub min_memory_mib: u32,
}

impl Recipe {
    /// A fingerprint of everything the recipe puts in the image: a cached template
    /// built from an older recipe is rebuilt.
    pub fn fingerprint(&self) -> String {
        let mut h = sha2::Sha256::new();
        for part in self.packages.iter().flat_map(|p| p.iter()).chain(self.wheels).chain(self.setup) {
            h.update(part.as_bytes());
            h.update([0]);
        }
        for (path, contents, mode) in self.files {
            h.update(format!("{path}\0{mode}\0").as_bytes());
            h.update(contents.as_bytes());
        }
        hex::encode(&h.finalize()[..8])
    }
}

pub const RECIPES: &[Recipe] = &[
    Recipe { name: BASE, aliases: &[], packages: &[BASE_PACKAGES], files: &[], wheels: &[], setup: &[], ready_port: None, warm_up: &[], memory_mib: None },
    Recipe {
        name: "code-interpreter",
        aliases: &["code-interpreter-v1"],
        packages: &[BASE_PACKAGES, CODE_INTERPRETER_PACKAGES],
        files: &[
            ("usr/lib/hutch/code_interpreter.py", include_str!("../guest/code_interpreter.py"), 0o755),
            ("usr/lib/hutch/ipython_formatters.py", include_str!("../guest/ipython_formatters.py"), 0o644),
            ("usr/lib/hutch/ipython_sandbox_env.py", include_str!("../guest/ipython_sandbox_env.py"), 0o644),
            ("etc/hutch/start", CODE_INTERPRETER_START, 0o755),
            ("usr/lib/hutch/kernel-oom-default", KERNEL_OOM_DEFAULT, 0o755),
            ("usr/lib/hutch/hutch_java_kernel.py", include_str!("../guest/hutch_java_kernel.py"), 0o644),
            ("usr/lib/hutch/java/HutchJShell.java", include_str!("../guest/java/HutchJShell.java"), 0o644),
            ("usr/local/share/jupyter/kernels/javascript/kernel.json", DENO_KERNEL_JS, 0o644),
            ("usr/local/share/jupyter/kernels/typescript/kernel.json", DENO_KERNEL_TS, 0o644),
            ("usr/local/share/jupyter/kernels/r/kernel.json", R_KERNEL, 0o644),
            ("usr/local/share/jupyter/kernels/java/kernel.json", JAVA_KERNEL, 0o644),
        ],
        // bash_kernel for run_code(language="bash"); Deno (PyPI redistributes its
        // binary) for JavaScript and TypeScript: its own Jupyter kernel has ES modules,
        // top-level await and TypeScript, which Node 18's kernels lack.
        wheels: &["bash_kernel==0.10.0", "deno==2.9.8"],
        setup: &[
            "python3 -m bash_kernel.install --prefix /usr/local",
            "javac -d /usr/lib/hutch/java /usr/lib/hutch/java/HutchJShell.java",
        ],
        ready_port: Some(49999),
        // Not counted (`warm_up`): the user's first cell is execution 1. The kernels
        // E2B's server starts (Python, JavaScript), bash, and the two slowest to start
        // under TCG for what they take (Java 24 s for ~130 MiB of guest memory, R 12 s
        // for ~105) are warm in the snapshot; TypeScript, a second Deno (6 s, ~185
        // MiB), starts on first use (measured in docs/BENCHMARKS.md).
        // R and Java only from 1 GiB: with them a restored guest uses ~800 MiB.
        warm_up: &[
            WarmUp { path: "/execute", body: PYTHON_WARM_UP, min_memory_mib: 0 },
            WarmUp { path: "/execute", body: r#"{"code": "true", "language": "bash", "warm_up": true}"#, min_memory_mib: 0 },
            WarmUp { path: "/execute", body: r#"{"code": "process.cwd()", "language": "javascript", "warm_up": true}"#, min_memory_mib: 0 },
            WarmUp { path: "/execute", body: r#"{"code": "getwd()", "language": "r", "warm_up": true}"#, min_memory_mib: 1024 },
            WarmUp { path: "/execute", body: r#"{"code": "System.getProperty(\"user.dir\")", "language": "java", "warm_up": true}"#, min_memory_mib: 1024 },
        ],
        // E2B's template has 2 GiB. With its warm kernels a restored guest uses ~800
        // MiB (resident: Deno ~215, Python with numpy and pandas ~135, R ~125, Java
        // ~100, bash's kernel and the server ~70 each; a kernel's start also costs the
        // guest the page cache and memory it frees again), which 512 MiB could not hold.
        memory_mib: Some(2048),
    },
];

/// The Python kernel's warm-up, also the first cell a pooled sandbox runs: the imports
/// users' code starts with, and once each the three ways a cell answers, which cost
/// 0.1-1.2 s more the first time than after (through the official SDK under TCG,
/// docs/BENCHMARKS.md): a result (IPython's display hook and formatters), printed
/// output, and an error. The error is raised by a cell run inside this one: IPython's
/// handling of an error that leaves a cell is what is slow (~1.2 s), and formatting
/// one caught inside a cell did not warm it. Its traceback is not published (no
/// `"error"` reaches the warm-up's reply), `sys.last_*` are cleared so `%debug` never
/// finds it, and the display hook's outputs (`_`, `_1`, `Out`) are flushed. The stub
/// that keeps it unpublished is set inside the `try` and removed in the `finally`, so
/// no interruption leaves a user's errors unpublished. It also writes twice to a
/// scratch SQLite database beside IPython's history (then removes it): IPython's
/// thread writes each counted cell there after the cell, and its first write, run
/// during the user's second cell, made that cell ~130 ms slower than the ones after.
const PYTHON_WARM_UP: &str = r#"{"code": "import numpy, pandas, matplotlib.pyplot\n_hutch_shell = get_ipython()\ndef _hutch_warm_history_writes():\n    # IPython writes each counted cell to its history database in a thread, after the\n    # cell: the first such write (SQLite, a journal, an fsync) ran during the user's\n    # second cell. The same writes to a scratch database beside it, then removed.\n    import os, sqlite3, tempfile\n    where = os.path.dirname(str(_hutch_shell.history_manager.hist_file))\n    fd, path = tempfile.mkstemp(suffix=\".sqlite\", dir=where if os.path.isdir(where) else None)\n    os.close(fd)\n    try:\n        db = sqlite3.connect(path)\n        try:\n            with db:\n                db.execute(\"CREATE TABLE history (session integer, line integer, source text, source_raw text, PRIMARY KEY (session, line))\")\n            for line in (1, 2):\n                with db:\n                    db.execute(\"INSERT INTO history VALUES (?, ?, ?, ?)\", (1, line, \"1\", \"1\"))\n        finally:\n            db.close()\n    finally:\n        for leftover in (path, path + \"-journal\"):\n            if os.path.exists(leftover):\n                os.remove(leftover)\ntry:\n    try:\n        _hutch_warm_history_writes()\n    except Exception:\n        pass\n    _hutch_shell.run_cell(\"print(' ', end='')\\n1\", store_history=False)\n    _hutch_shell._showtraceback = lambda *args, **kwargs: None\n    _hutch_shell.run_cell(\"_hutch_warm_up_error\", store_history=False)\nfinally:\n    vars(_hutch_shell).pop(\"_showtraceback\", None)\n    for _hutch_name in (\"last_type\", \"last_value\", \"last_traceback\", \"last_exc\"):\n        vars(__import__(\"sys\")).pop(_hutch_name, None)\n    if _hutch_shell.displayhook.do_full_cache:\n        _hutch_shell.displayhook.flush()\n    del _hutch_shell, _hutch_name, _hutch_warm_history_writes\n", "warm_up": true}"#;

/// Run by the agent at boot (see hutch-agent): the code-interpreter server, as `user`.
/// The guest's OOM killer never picks the server: a sandbox that runs out of memory
/// loses a kernel (the server restarts it on that context's next cell, and says so),
/// not port 49999 with every context, which the SDKs see as a 502 "port is not open".
/// Its kernels go back to the default score (`KERNEL_OOM_DEFAULT`). A server that ends
/// all the same is started again, its contexts gone, rather than leaving the port shut.
const CODE_INTERPRETER_START: &str = "#!/bin/sh\n\
cd /home/user\n\
echo -1000 > /proc/self/oom_score_adj\n\
while :; do\n\
  runuser -u user -- env HOME=/home/user PYTHONUNBUFFERED=1 python3 /usr/lib/hutch/code_interpreter.py >>/var/log/code-interpreter.log 2>&1\n\
  echo \"hutch: the code interpreter exited ($?); starting it again\" >>/var/log/code-interpreter.log\n\
  sleep 1\n\
done\n";

/// Every kernel's command starts with this (code_interpreter.py): the server's OOM
/// immunity, inherited, is dropped before the kernel runs, so a kernel is what a guest
/// short of memory loses.
const KERNEL_OOM_DEFAULT: &str = "#!/bin/sh\necho 0 > /proc/self/oom_score_adj\nexec \"$@\"\n";

/// Deno's kernel for JavaScript and for TypeScript (one binary, a context each); no
/// colours in results, no update check (a sandbox has no network to check with).
const DENO_KERNEL_JS: &str = r#"{"argv": ["/usr/local/bin/deno", "jupyter", "--kernel", "--conn", "{connection_file}"], "display_name": "JavaScript (Deno)", "language": "javascript", "env": {"NO_COLOR": "1", "DENO_NO_UPDATE_CHECK": "1", "DENO_NO_PROMPT": "1"}}"#;
const DENO_KERNEL_TS: &str = r#"{"argv": ["/usr/local/bin/deno", "jupyter", "--kernel", "--conn", "{connection_file}"], "display_name": "TypeScript (Deno)", "language": "typescript", "env": {"NO_COLOR": "1", "DENO_NO_UPDATE_CHECK": "1", "DENO_NO_PROMPT": "1"}}"#;
/// IRkernel from Debian ships no kernel spec; this is the one its installspec() writes.
const R_KERNEL: &str = r#"{"argv": ["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"], "display_name": "R", "language": "R"}"#;
const JAVA_KERNEL: &str = r#"{"argv": ["python3", "/usr/lib/hutch/hutch_java_kernel.py", "-f", "{connection_file}"], "display_name": "Java (jshell)", "language": "java"}"#;

/// The templates hutch knows how to build.
pub fn builtin_names() -> Vec<&'static str> {
    RECIPES.iter().map(|r| r.name).collect()
}

/// The recipe a template name (or alias) refers to.
pub fn recipe(name: &str) -> Option<&'static Recipe> {
    RECIPES.iter().find(|r| r.name == name || r.aliases.contains(&name))
}

/// The guest memory (MiB) the built-in template `name` asks for, if it asks.
pub fn memory_mib(name: &str) -> Option<u32> {
    recipe(name)?.memory_mib
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A warm-up body is sent as it is written: one that is not the JSON the server
    /// reads would fail only when a template snapshot is made.
    #[test]
    fn every_warm_up_is_a_json_cell_not_counted() {
        for recipe in RECIPES {
            for w in recipe.warm_up {
                let body: serde_json::Value = serde_json::from_str(w.body).unwrap_or_else(|e| panic!("{}: {e}: {}", recipe.name, w.body));
                assert!(body["code"].is_string(), "{}: {}", recipe.name, w.body);
                assert_eq!(body["warm_up"], serde_json::Value::Bool(true), "{}: {}", recipe.name, w.body);
            }
        }
    }
}
