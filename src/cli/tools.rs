//! The development tools' subcommands (`demo`, `bench`, `e2e`, `gen`, `bridge-bench`,
//! `shard-bench`) live in the `kvindex-tools` binary, so the daemon's build carries no
//! benchmark, plotting or peer code; `kvindex demo ...` runs `kvindex-tools demo ...` in its
//! place, found beside this executable or on the `PATH`.

use anyhow::{bail, Context, Result};
use std::path::PathBuf;
use std::process::Command;

/// The tools' binary: beside this one (a cargo build, the image), else on the `PATH`.
fn tools_binary() -> Option<PathBuf> {
    let beside = std::env::current_exe().ok()?.with_file_name("kvindex-tools");
    if beside.is_file() {
        return Some(beside);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("kvindex-tools")).find(|p| p.is_file())
}

/// Runs `kvindex-tools {tool} {args}` in place of this process (its exit status is ours).
pub fn forward(tool: &str, args: &[String]) -> Result<()> {
    let Some(bin) = tools_binary() else {
        bail!(
            "`kvindex {tool}` runs the development tools' binary, kvindex-tools, which is not installed here: \
             build it with `cargo build --release -p kvindex-tools` (scripts/demo does), or run `scripts/demo`"
        );
    };
    let mut cmd = Command::new(&bin);
    cmd.arg(tool).args(args);
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let err = cmd.exec();
        Err(err).with_context(|| format!("running {}", bin.display()))
    }
    #[cfg(not(unix))]
    {
        let status = cmd.status().with_context(|| format!("running {}", bin.display()))?;
        std::process::exit(status.code().unwrap_or(1));
    }
}
