#!/bin/sh
# Entrypoint of the tokenmill dev image (deploy/Dockerfile.dev). Runs as the unprivileged `dev`.
#   JUPYTER_TOKEN            required, non-empty: JupyterLab token (or JUPYTER_TOKEN_FILE)
#   SSH_AUTHORIZED_KEYS      public keys, one per line; and/or a file mounted at
#   AUTHORIZED_KEYS_FILE     (default /run/secrets/authorized_keys)
#   SSH_PORT                 default 22;  JUPYTER_PORT default 8888
# Without any authorized key sshd is not started (key-only auth: nobody could log in anyway).
# Arguments, if any, replace JupyterLab as the main process (e.g. `bash`).
set -eu

state="${HOME}/.tokenmill-dev"
mkdir -p "${state}" "${HOME}/.ssh"
chmod 0700 "${state}" "${HOME}/.ssh"

# ---- SSH: keys only ----
keys="${HOME}/.ssh/authorized_keys"
: > "${keys}"
keys_file="${AUTHORIZED_KEYS_FILE:-/run/secrets/authorized_keys}"
if [ -r "${keys_file}" ]; then
    cat "${keys_file}" >> "${keys}"
fi
if [ -n "${SSH_AUTHORIZED_KEYS:-}" ]; then
    printf '%s\n' "${SSH_AUTHORIZED_KEYS}" >> "${keys}"
fi
chmod 0600 "${keys}"

if grep -Eq '^(ssh-|ecdsa-|sk-)' "${keys}"; then
    # Host key made per container on first start, never baked into the image.
    if [ ! -f "${state}/ssh_host_ed25519_key" ]; then
        ssh-keygen -q -t ed25519 -N '' -f "${state}/ssh_host_ed25519_key"
    fi
    cp /etc/tokenmill-dev/sshd_config "${state}/sshd_config"
    {
        echo "Port ${SSH_PORT:-22}"
        echo "HostKey ${state}/ssh_host_ed25519_key"
        echo "AuthorizedKeysFile ${keys}"
    } >> "${state}/sshd_config"
    chmod 0600 "${state}/sshd_config"
    /usr/sbin/sshd -t -f "${state}/sshd_config"
    /usr/sbin/sshd -f "${state}/sshd_config" -E "${state}/sshd.log"
    echo "dev-entrypoint: sshd listening on port ${SSH_PORT:-22} (public-key auth only, user $(id -un))"
else
    echo "dev-entrypoint: no authorized keys (mount ${keys_file} or set SSH_AUTHORIZED_KEYS): sshd not started" >&2
fi

if [ "$#" -gt 0 ]; then
    exec "$@"
fi

# ---- JupyterLab: token auth, token never empty ----
if [ -z "${JUPYTER_TOKEN:-}" ] && [ -n "${JUPYTER_TOKEN_FILE:-}" ] && [ -r "${JUPYTER_TOKEN_FILE}" ]; then
    JUPYTER_TOKEN="$(cat "${JUPYTER_TOKEN_FILE}")"
fi
if [ -z "${JUPYTER_TOKEN:-}" ]; then
    echo "dev-entrypoint: JUPYTER_TOKEN (or JUPYTER_TOKEN_FILE) must be set to a non-empty token" >&2
    exit 64
fi
export JUPYTER_TOKEN  # read by jupyter_server's IdentityProvider; kept off the command line

exec jupyter lab \
    --ip=0.0.0.0 \
    --port="${JUPYTER_PORT:-8888}" \
    --no-browser \
    --ServerApp.root_dir=/workspace \
    --ServerApp.allow_remote_access=True
