# kvindex: a multi-stage build. The builder compiles the dependencies in a layer of their own
# (rebuilt only when a manifest or Cargo.lock changes), then the workspace; the runtime image
# holds the binary, its config, the demo trace and nothing else, and runs as a non-root user.

FROM rust:1.95-slim-bookworm AS builder
WORKDIR /build
# Dependencies first: the manifests with empty sources, so this layer survives code changes.
COPY Cargo.toml Cargo.lock ./
COPY crates/kvindex-core/Cargo.toml crates/kvindex-core/
COPY crates/kvindex-client/Cargo.toml crates/kvindex-client/
RUN mkdir -p src crates/kvindex-core/src crates/kvindex-core/benches crates/kvindex-client/src crates/kvindex-client/benches \
 && echo 'fn main() {}' > src/main.rs && touch src/lib.rs crates/kvindex-core/src/lib.rs crates/kvindex-client/src/lib.rs \
 && touch crates/kvindex-core/benches/index.rs crates/kvindex-client/benches/decode.rs \
 && cargo build --release --locked --bin kvindex \
 && rm -rf src crates/*/src
# Then the workspace itself.
COPY src src
COPY crates crates
RUN touch src/main.rs src/lib.rs crates/kvindex-core/src/lib.rs crates/kvindex-client/src/lib.rs \
 && cargo build --release --locked --bin kvindex \
 && strip target/release/kvindex

FROM debian:bookworm-slim
RUN useradd --system --no-create-home --uid 10001 kvindex
WORKDIR /usr/share/kvindex
# The working directory holds what the defaults name: config/kvindex.toml and the demo's trace.
COPY config/kvindex.toml config/kvindex.toml
COPY data/traces/conversation_trace.jsonl data/traces/LICENSE-APACHE data/traces/README.md data/traces/
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
