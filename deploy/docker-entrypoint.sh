#!/bin/sh
# Container entrypoint: `tokenmill serve --host 0.0.0.0` plus flags from the environment.
#   TOKENMILL_ARGS        extra flags, word-split (e.g. "--max-queue 256 --drain-timeout 30")
#   TOKENMILL_API_KEY     API key; or TOKENMILL_API_KEY_FILE pointing at a mounted secret
# Arguments given to the container (CMD / k8s args) come last, so they win over both.
# `exec` keeps tokenmill as PID 1 so SIGTERM reaches it and it drains.
set -eu

if [ -n "${TOKENMILL_API_KEY_FILE:-}" ] && [ -r "${TOKENMILL_API_KEY_FILE}" ]; then
    TOKENMILL_API_KEY="$(cat "${TOKENMILL_API_KEY_FILE}")"
fi

api_key="${TOKENMILL_API_KEY:-}"
unset TOKENMILL_API_KEY

# shellcheck disable=SC2086  # TOKENMILL_ARGS is a flag list: word splitting is intended
set -- serve --host 0.0.0.0 ${TOKENMILL_ARGS:-} "$@"
if [ -n "${api_key}" ]; then
    set -- "$@" --api-key "${api_key}"
fi

exec tokenmill "$@"
