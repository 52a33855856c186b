#!/usr/bin/env bash
# The GPU session script of before the GPU tools became the subpackage loadgen/gpu: forwards to
# loadgen/gpu/session.sh with the same arguments and environment.
exec bash "$(dirname "$0")/gpu/session.sh" "$@"
