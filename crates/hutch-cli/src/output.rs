//! Writing to stdout for commands whose output is their result (a broken pipe, as in
//! `hutch ls | head`, ends the command with an error instead of a panic).

/// `println!` that returns an error instead of panicking when stdout is closed
/// (`hutch ls | head -1`); main turns that error into a quiet exit.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)?
    }};
}
pub(crate) use outln;
