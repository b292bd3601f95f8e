# kvindex: a multi-stage build. The builder compiles the dependencies in a layer of their own
# (rebuilt only when a manifest or Cargo.lock changes), then the workspace. Two images, on one
# slim base that runs as a non-root user: the default target, `kvindex` (the daemon and its CLI,
# its config, nothing else), and `demo` (the development tools' binary and the Mooncake trace:
# the compose stack's load generator; `docker build --target demo`).

# The skeleton of the workspace: every manifest, Cargo.lock, and an empty stand-in for each
# target that `cargo metadata` lists (libraries, binaries, benches, tests, examples, build
# scripts). It follows the manifests by itself, so a new target or crate never needs this file
# changed. This stage reruns on any change; the dependency layer below is rebuilt only when
# the skeleton itself changes.
FROM rust:1.95-slim-bookworm AS planner
WORKDIR /build
COPY . .
RUN mkdir /skeleton && cp Cargo.toml Cargo.lock /skeleton/ \
 && cargo metadata --no-deps --format-version 1 --offline > /tmp/metadata.json \
 && for m in $(grep -o '"manifest_path":"[^"]*"' /tmp/metadata.json | cut -d'"' -f4); do \
      m=${m#/build/}; mkdir -p "/skeleton/$(dirname "$m")" && cp "$m" "/skeleton/$m"; done \
 && for t in $(grep -o '"src_path":"[^"]*"' /tmp/metadata.json | cut -d'"' -f4); do \
      t=${t#/build/}; mkdir -p "/skeleton/$(dirname "$t")" && printf '#![allow(dead_code)]\nfn main() {}\n' > "/skeleton/$t"; done

FROM rust:1.95-slim-bookworm AS builder
WORKDIR /build
# The binary is stripped below: debug info would only cost build time.
ENV CARGO_PROFILE_RELEASE_DEBUG=0
COPY --from=planner /skeleton/ ./
RUN cargo build --release --locked --bin kvindex --bin kvindex-tools
# Then the workspace itself; its sources are touched so that none of the skeleton's empty
# stand-ins built above can pass for them.
COPY . .
RUN find . -path ./target -prune -o -name '*.rs' -exec touch {} + \
 && cargo build --release --locked --bin kvindex --bin kvindex-tools \
 && strip target/release/kvindex target/release/kvindex-tools

FROM debian:bookworm-slim AS base
RUN useradd --system --no-create-home --uid 10001 kvindex
WORKDIR /usr/share/kvindex
# The working directory holds what the defaults name: config/kvindex.toml (and, in the demo
# image, the demo's trace).
COPY LICENSE LICENSE
COPY config/kvindex.toml config/kvindex.toml

# The load generator: `kvindex-tools demo --loop` against a running kvindex.
FROM base AS demo
COPY data/traces/conversation_trace.jsonl data/traces/LICENSE-APACHE data/traces/README.md data/traces/
COPY --from=builder /build/target/release/kvindex-tools /usr/local/bin/kvindex-tools
USER kvindex
ENTRYPOINT ["kvindex-tools"]
CMD ["demo", "--help"]

# The daemon (the default target: the last stage).
FROM base AS kvindex
COPY --from=builder /build/target/release/kvindex /usr/local/bin/kvindex
USER kvindex
# glibc backs the index's large hash tables with transparent huge pages where the kernel grants
# them on request (THP "madvise", the common default), for fewer TLB misses on random probes;
# the gain is host-dependent (docs/OPERATIONS.md, "Huge pages"). Ignored where not offered.
ENV GLIBC_TUNABLES=glibc.malloc.hugetlb=1
EXPOSE 9464
HEALTHCHECK --interval=5s --timeout=3s --start-period=10s --retries=3 CMD ["kvindex", "health", "--path", "/readyz"]
ENTRYPOINT ["kvindex"]
CMD ["serve"]
