//! `relay` — see `relay --help` and the README.

/// mimalloc instead of the system allocator (glibc): the relay allocates and
/// frees many small, short-lived values per record and per call (decoded
/// events, rendered JSON, HTTP requests), and profiling the benchmark found a
/// fifth of the process's CPU time in glibc's malloc and free.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    relay_cli::cli::main()
}
