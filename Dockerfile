# The relay and the example provider in one image (two binaries).
# Build: docker build -t relay .   (compose.yaml does this for you)
# `relay --version` names the commit: the context holds no .git, so pass
# it: docker build --build-arg RELAY_GIT_REVISION=$(git rev-parse --short=12 HEAD) .
# Base images are pinned to exact releases (the toolchain and the Debian
# point release these were tested with). Pinning them by digest as well
# needs a registry lookup, e.g. `docker buildx imagetools inspect
# rust:1.95.0-bookworm`, which the machines this was written on cannot make.
FROM rust:1.95.0-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
ARG RELAY_GIT_REVISION=unknown
RUN cargo build --release --locked -p relay-cli -p example-provider

FROM debian:12.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates && rm -rf /var/lib/apt/lists/* \
 && useradd --system --uid 10001 relay
COPY --from=build /src/target/release/relay /src/target/release/example-provider /usr/local/bin/
COPY relay.example.toml /etc/relay/relay.toml
COPY contracts /etc/relay/contracts
USER relay
WORKDIR /etc/relay
ENTRYPOINT ["relay"]
CMD ["--config", "/etc/relay/relay.toml", "run"]
