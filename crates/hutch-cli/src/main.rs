//! `hutch`: run code in microVM sandboxes.

#![allow(unsafe_code)] // terminal ioctls only; each block has a SAFETY note.


mod commands;
mod output;
mod local;
mod progress;
mod terminal;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "hutch", version, about = "Run untrusted code in microVM sandboxes", propagate_version = true)]
struct Cli {
    #[command(flatten)]
    server: commands::remote::Server,
    /// Log what hutch is doing (repeat for more detail); HUTCH_LOG sets a filter.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a command in a new, ephemeral sandbox and exit with its exit code.
    Run(commands::run::RunArgs),
    /// Download and build everything sandboxes need (kernel, initramfs, templates).
    Setup(commands::setup::SetupArgs),
    /// Report what hutch found on this host and what it will use.
    Doctor(commands::doctor::DoctorArgs),
    /// Measure boot and exec latency against a bare QEMU boot.
    Bench(commands::bench::BenchArgs),
    /// Serve the REST API and data proxy (E2B-compatible) for teams and SDKs.
    Serve(commands::serve::ServeArgs),
    /// Manage the API keys of `hutch serve`.
    #[command(subcommand)]
    Keys(commands::keys::KeysCommand),
    /// Manage the secrets of `hutch serve`'s API keys (values are read from stdin and never shown).
    #[command(subcommand)]
    Secret(commands::secret::SecretCommand),
    /// Templates: build one from an OCI image, list them.
    #[command(subcommand)]
    Template(commands::template::TemplateCommand),
    #[command(flatten)]
    Remote(commands::remote::RemoteCommand),
    /// End a stopped server's VMs at their end times (started by `hutch serve`).
    #[command(hide = true)]
    Reaper(commands::reaper::ReaperArgs),
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info,hutch=info",
        _ => "debug,hyper=info,h2=info",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("HUTCH_LOG").unwrap_or_else(|_| default.into());
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())).init();
}

fn main() {
    // hutch without root runs itself again in a user namespace to unpack an image there.
    if std::env::args_os().nth(1).is_some_and(|a| a == hutch_image::unprivileged::HELPER) {
        let args: Vec<String> = std::env::args_os().skip(2).map(|a| a.to_string_lossy().into_owned()).collect();
        std::process::exit(hutch_image::unprivileged::helper_main(&args));
    }
    let cli = Cli::parse();
    init_logging(cli.verbose);
    // The server's key leaves the environment before any thread or child exists: every
    // process hutch starts (QEMU, image tools, the reaper) would inherit it otherwise.
    let serve_key = match &cli.command {
        Command::Serve(_) => {
            let key = std::env::var("HUTCH_API_KEY").ok().filter(|k| !k.is_empty());
            std::env::remove_var("HUTCH_API_KEY");
            key
        }
        _ => None,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("hutch: cannot start the async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            Command::Run(args) => commands::run::run(args).await,
            Command::Setup(args) => commands::setup::run(args).await,
            Command::Doctor(args) => commands::doctor::run(args).await,
            Command::Bench(args) => commands::bench::run(args).await,
            Command::Serve(args) => commands::serve::run(args, serve_key).await,
            Command::Keys(cmd) => commands::keys::run(cmd).await,
            Command::Secret(cmd) => commands::secret::run(cmd).await,
            Command::Template(cmd) => commands::template::run(cmd).await,
            Command::Remote(cmd) => commands::remote::run(cli.server, cmd).await,
            Command::Reaper(args) => commands::reaper::run(args).await,
        }
    });
    // Everything the command started (VMs included) has been torn down by now.
    runtime.shutdown_timeout(std::time::Duration::from_millis(200));
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) if e.chain().any(|c| c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)) => {
            // Whoever read our output stopped reading; that is not an error worth a word.
            std::process::exit(141);
        }
        Err(e) => {
            eprintln!("hutch: error: {e}");
            for cause in e.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            std::process::exit(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;
    use std::collections::HashMap;

    /// Every flag and argument of every command says, in its own words, what it does: a
    /// doc comment on the wrong field shows one flag's text under another and none under
    /// the first, and `--help` then misleads.
    #[test]
    fn every_argument_has_its_own_help() {
        let mut root = Cli::command();
        // Built, so global flags show under every subcommand as users see them.
        root.build();
        let mut faults = Vec::new();
        let mut stack = vec![(root.get_name().to_string(), &root)];
        while let Some((path, cmd)) = stack.pop() {
            let mut seen: HashMap<String, String> = HashMap::new();
            for arg in cmd.get_arguments().filter(|a| !matches!(a.get_id().as_str(), "help" | "version")) {
                let name = match arg.get_long() {
                    Some(long) => format!("--{long}"),
                    None => arg.get_id().to_string(),
                };
                let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                if help.trim().is_empty() {
                    faults.push(format!("`{path}` {name}: no help"));
                } else if let Some(other) = seen.insert(help.clone(), name.clone()) {
                    faults.push(format!("`{path}` {name}: same help as {other} ({help:?})"));
                }
            }
            // clap's generated `help` subcommand is not ours to document.
            stack.extend(cmd.get_subcommands().filter(|s| s.get_name() != "help").map(|s| (format!("{path} {}", s.get_name()), s)));
        }
        faults.sort();
        assert!(faults.is_empty(), "arguments whose help misleads:\n{}", faults.join("\n"));
    }
}
