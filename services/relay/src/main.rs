//! `relay` — see `relay --help` and the README.

fn main() -> std::process::ExitCode {
    relay::cli::main()
}
