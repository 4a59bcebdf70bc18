//! Names the git revision the binary is built from: `SERVICE_REVISION` for the code
//! (`timer-service --version`, the instance list), from the build's environment variable
//! `BUILD_REVISION` when set (a build outside git, such as a source package), else
//! `git rev-parse`, else `unknown`. Neither is a `TIMER_` name: cargo sets `SERVICE_REVISION`
//! where it runs the tests too, and the service reads every `TIMER_` variable as config.

use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=BUILD_REVISION");
    let revision = std::env::var("BUILD_REVISION")
        .ok()
        .filter(|r| !r.trim().is_empty())
        .or_else(from_git)
        .unwrap_or_else(|| "unknown".to_owned());
    println!("cargo:rustc-env=SERVICE_REVISION={}", revision.trim());
}

/// The short hash of HEAD; rebuilt when HEAD or the branch it names moves.
fn from_git() -> Option<String> {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
    };
    let head = git(&["rev-parse", "--git-path", "HEAD"])?;
    println!("cargo:rerun-if-changed={head}");
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        if let Some(path) = git(&["rev-parse", "--git-path", &branch]) {
            println!("cargo:rerun-if-changed={path}");
        }
        if let Some(packed) = git(&["rev-parse", "--git-path", "packed-refs"]) {
            println!("cargo:rerun-if-changed={packed}");
        }
    }
    git(&["rev-parse", "--short=12", "HEAD"])
}
