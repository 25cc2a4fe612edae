# The weir-runtime release image, for machines with Docker and a registry:
#   docker build -f images/weir-runtime.Dockerfile -t REG/weir-runtime:0.1.0 \
#     --build-arg REVISION=$(git rev-parse HEAD) --build-arg SOURCE_DATE_EPOCH=$(git log -1 --format=%ct) .
# The root filesystem is assembled by the same script as images/build.sh (which builds this
# image here without Docker): the stripped binary, its shared libraries, CA certificates,
# passwd/group with the non-root user 65532, /tmp. Nothing else: no shell, no package manager.
# BUILD_IMAGE: the build stage's image; images/check-dockerfiles.sh passes a stand-in made
# without a registry.
ARG BUILD_IMAGE=docker.io/library/rust:1-bookworm
FROM ${BUILD_IMAGE} AS build
ARG SOURCE_DATE_EPOCH=0
# librocksdb-dev and libclang-dev: the rocksdb state backend links Debian's RocksDB
# (.cargo/config.toml); bindgen reads its headers with libclang.
RUN apt-get update && apt-get install -y --no-install-recommends libssl-dev zlib1g-dev pkg-config \
      binutils ca-certificates librocksdb-dev libclang-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --profile dist --locked -p weir-runtime \
 && objcopy --strip-all target/dist/weir-runtime /weir-runtime \
 && bash e2e/tools/build-image.sh --rootfs-only /rootfs --binary /weir-runtime \
      --dest /usr/local/bin/weir-runtime --ca-certs

FROM scratch
ARG VERSION=0.1.0
ARG REVISION=unknown
COPY --from=build /rootfs/ /
ENV PATH=/usr/local/bin:/usr/bin:/bin HOME=/home/nonroot
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/weir-runtime"]
LABEL org.opencontainers.image.title="weir-runtime" \
      org.opencontainers.image.source="https://github.com/weir-dev/weir" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0"
