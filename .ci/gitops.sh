#!/usr/bin/env bash
# The GitOps integrations against their tools' own libraries (gitops/check): the Argo CD health
# check in gopher-lua with its test cases, and kstatus (Flux) on the same StreamJobs. The
# StreamJobs themselves are checked against the operator's status code by
# `cargo test -p weir-operator --test gitops_fixtures`.
set -euo pipefail
cd "$(dirname "$0")/../gitops/check"
WEIR_CACHE="${WEIR_CACHE:-$HOME/.cache/weir}"
export GOPATH="$WEIR_CACHE/go" GOMODCACHE="$WEIR_CACHE/go/pkg/mod" GOCACHE="$WEIR_CACHE/go/cache"
export GOFLAGS="-buildvcs=false -mod=readonly" GOWORK=off CGO_ENABLED=0
go test -count=1 ./...
