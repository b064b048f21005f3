//! Bakes the git commit the binary is built from into `relay --version`
//! (the checked-out commit; changes not committed are not told apart).
//! Outside a git checkout (a source tarball, a Docker context without
//! `.git`) the revision comes from `RELAY_GIT_REVISION`, else it is
//! "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn main() {
    println!("cargo:rerun-if-env-changed=RELAY_GIT_REVISION");
    let revision = match std::env::var("RELAY_GIT_REVISION") {
        Ok(r) if !r.trim().is_empty() => r.trim().to_owned(),
        _ => match git(&["rev-parse", "--short=12", "HEAD"]) {
            Some(rev) => {
                // Rebuilt when HEAD moves: a commit, a checkout.
                if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
                    println!("cargo:rerun-if-changed={dir}/HEAD");
                    if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
                        println!("cargo:rerun-if-changed={dir}/{head}");
                    }
                    println!("cargo:rerun-if-changed={dir}/packed-refs");
                }
                rev
            }
            None => "unknown".to_owned(),
        },
    };
    println!("cargo:rustc-env=RELAY_GIT_REVISION={revision}");
}
