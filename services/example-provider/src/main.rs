//! `example-provider --listen 127.0.0.1:8081`: a fake third-party API that
//! honours idempotency keys and counts applied effects (see the library docs).

use clap::Parser;

#[derive(Parser)]
#[command(about = "A fake third-party HTTP API that honours Idempotency-Key and counts applied effects")]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8081", env = "PROVIDER_LISTEN")]
    listen: std::net::SocketAddr,
    /// Header carrying the idempotency key.
    #[arg(long, default_value = "Idempotency-Key")]
    idempotency_header: String,
    /// How it answers about keys (as the IETF draft, as Stripe, or without keys).
    #[arg(long, value_enum, default_value = "lenient")]
    dialect: example_provider::Dialect,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_writer(std::io::stderr).init();
    let args = Args::parse();
    example_provider::serve(
        args.listen,
        example_provider::Settings {
            idempotency_header: args.idempotency_header,
            dialect: args.dialect,
            ..Default::default()
        },
    )
    .await
}
